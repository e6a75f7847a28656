"""spotpipe.model: GPT layers, stage building, partitioning, user factories."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from spotpipe.model import (
    FactoryError,
    GPTConfig,
    LayeredModel,
    PartitionError,
    balanced_partition,
    build_gpt,
    build_stage,
    build_user_model,
    compute_weights,
    load_factory,
    parameter_counts,
    partition,
)

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)


def _batch(cfg: GPTConfig, b: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_gpt_forward_shapes_and_layer_list() -> None:
    model = build_gpt(TINY, seed=0)
    assert model.num_layers == TINY.n_layer + 2
    x, y = _batch(TINY)
    h = model.layers[0](x)
    assert h.shape == (2, TINY.block_size, TINY.n_embd)
    for block in model.layers[1:-1]:
        h = block(h)
        assert h.shape == (2, TINY.block_size, TINY.n_embd)
    logits = model.layers[-1](h)
    assert logits.shape == (2, TINY.block_size, TINY.vocab_size)
    loss = model.loss_fn(logits, y)
    assert loss.dim() == 0
    # an untrained model predicts roughly uniformly: loss near log(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(32.0)).item()) < 0.5


def test_gpt_is_causal() -> None:
    seq = build_gpt(TINY, seed=0).to_sequential()
    x, _ = _batch(TINY)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % TINY.vocab_size  # change only the last token
    out, out2 = seq(x), seq(x2)
    assert torch.equal(out[:, :-1], out2[:, :-1])
    assert not torch.equal(out[:, -1], out2[:, -1])


def test_gpt_init_deterministic_and_seed_dependent() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_gpt(TINY, seed=7).to_sequential().state_dict()
    assert torch.equal(torch.get_rng_state(), before), "build_gpt must not touch the global RNG"
    b = build_gpt(TINY, seed=7).to_sequential().state_dict()
    c = build_gpt(TINY, seed=8).to_sequential().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["0.wte.weight"], c["0.wte.weight"])
    std = a["1.attn.c_proj.weight"].std().item()
    assert 0.5 < std / (0.02 / (2 * TINY.n_layer) ** 0.5) < 1.5


def test_tied_embeddings_share_the_parameter() -> None:
    model = build_gpt(GPTConfig(**{**TINY.__dict__, "tie_embeddings": True}), seed=0)
    head = TINY.n_layer + 1
    assert model.layers[head].lm_head.weight is model.layers[0].wte.weight
    assert model.tied == [("0.wte.weight", f"{head}.lm_head.weight")]
    untied = build_gpt(TINY, seed=0)
    assert untied.tied == []
    assert untied.layers[head].lm_head.weight is not untied.layers[0].wte.weight


def test_stage_keys_equal_unpartitioned_keys() -> None:
    model = build_gpt(TINY, seed=0)
    ref_keys = list(model.to_sequential().state_dict())
    stage_keys: list[str] = []
    for start, end in partition(model, 3):
        stage_keys += list(build_stage(model, start, end).state_dict())
    assert stage_keys == ref_keys
    assert "2.attn.c_attn.weight" in stage_keys


def test_build_stage_shares_layers() -> None:
    model = build_gpt(TINY, seed=0)
    stage = build_stage(model, 1, 3)
    assert stage[0] is model.layers[1] and stage[1] is model.layers[2]
    with pytest.raises(PartitionError):
        build_stage(model, 2, 2)


def test_stages_in_sequence_equal_unpartitioned_bitwise() -> None:
    x, y = _batch(TINY, b=3)
    ref = build_gpt(TINY, seed=1)
    ref_loss = ref.loss_fn(ref.to_sequential()(x), y)
    ref_loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in ref.to_sequential().named_parameters()}

    model = build_gpt(TINY, seed=1)
    stages = [build_stage(model, s, e) for s, e in partition(model, 3, "parameters")]
    # run like a pipeline: detach at each cut, send the input gradient back
    acts, inputs = [], []
    h: torch.Tensor = x
    for i, stage in enumerate(stages):
        inp = h.detach().requires_grad_(i > 0)
        inputs.append(inp)
        h = stage(inp)
        acts.append(h)
    loss = model.loss_fn(h, y)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        acts[i].backward(inputs[i + 1].grad)
    got = {k: p.grad for st in stages for k, p in st.named_parameters()}
    assert got.keys() == ref_grads.keys()
    for k in ref_grads:
        assert torch.equal(got[k], ref_grads[k]), k


def test_uniform_partition() -> None:
    model = build_gpt(GPTConfig(n_layer=5, vocab_size=16, n_embd=8, n_head=2), seed=0)  # 7 layers
    bounds = partition(model, 3)
    assert bounds == [(0, 3), (3, 5), (5, 7)]
    assert partition(model, 1) == [(0, 7)]
    assert partition(model, 7) == [(i, i + 1) for i in range(7)]


def test_parameter_partition_minimises_the_largest_stage() -> None:
    assert balanced_partition([1, 1, 1, 10], 2) == [(0, 3), (3, 4)]
    assert balanced_partition([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 10)]
    weights = [3, 1, 4, 1, 5, 9, 2, 6]
    bounds = balanced_partition(weights, 3)
    got = max(sum(weights[s:e]) for s, e in bounds)
    assert got == 14  # [3 1 4 1 5] [9 2] [6]; brute force below confirms the optimum
    best = min(
        max(sum(weights[:a]), sum(weights[a:b]), sum(weights[b:]))
        for a in range(1, 7)
        for b in range(a + 1, 8)
    )
    assert got == best


def test_parameter_partition_on_gpt() -> None:
    model = build_gpt(TINY, seed=0)
    counts = parameter_counts(model)
    bounds = partition(model, 2, "parameters")
    sums = [sum(counts[s:e]) for s, e in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == model.num_layers
    assert max(sums) <= sum(counts) - min(counts)  # not the trivial 1 | rest split
    assert max(sums) == min(
        max(sum(counts[:k]), sum(counts[k:])) for k in range(1, model.num_layers)
    )


def test_compute_weights_count_what_a_layer_multiplies_by() -> None:
    # vocab 32, h 16, 3 blocks, biases: a block is 12h^2 + 13h = 3280 (ln 2h, qkv 3h^2 + 3h,
    # proj h^2 + h, ln 2h, fc 4h^2 + 4h, proj 4h^2 + h); the embedding's two tables (32 x 16
    # tokens, 8 x 16 positions) are looked up: 0; the head is ln_f (2h) and the 32 x 16 matmul
    for tie in (False, True):
        model = build_gpt(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16,
                                    tie_embeddings=tie), seed=0)
        assert compute_weights(model) == [0, 3280, 3280, 3280, 32 + 512]
    # plain counts put the tables on the first layer (the untied model's head holds its own)
    assert parameter_counts(build_gpt(TINY, seed=0))[0] == 32 * 16 + 8 * 16
    # a bag of embeddings is a lookup too; a layer's own raw parameter is multiplied
    bag = nn.Sequential(nn.EmbeddingBag(10, 4), nn.Linear(4, 3))
    own = nn.Linear(4, 3)
    own.register_parameter("scale", nn.Parameter(torch.ones(3)))
    model = LayeredModel([bag, own], loss_fn=lambda y, t: (y - t).pow(2).mean())
    assert compute_weights(model) == [4 * 3 + 3, 4 * 3 + 3 + 3]


def test_time_partition_profiles_and_restores_grads() -> None:
    model = build_gpt(TINY, seed=0)
    x, _ = _batch(TINY)
    bounds = partition(model, 2, "time", sample_input=x)
    assert len(bounds) == 2 and bounds[0][0] == 0 and bounds[-1][1] == model.num_layers
    assert all(p.grad is None for p in model.to_sequential().parameters())
    with pytest.raises(PartitionError, match="sample_input"):
        partition(model, 2, "time")


def test_explicit_partition_and_errors() -> None:
    model = build_gpt(TINY, seed=0)  # 5 layers
    assert partition(model, 2, "explicit", explicit=[0, 0, 0, 1, 1]) == [(0, 3), (3, 5)]
    for bad, stages, msg in [
        ([0, 0, 1, 1], 2, "4 entries"),
        ([0, 1, 0, 1, 1], 2, "non-decreasing"),
        ([0, 0, 2, 2, 2], 3, "no stage skipped"),
        ([1, 1, 1, 1, 1], 2, "start at stage 0"),
        ([0, 0, 0, 0, 0], 2, "end at stage 1"),
    ]:
        with pytest.raises(PartitionError, match=msg):
            partition(model, stages, "explicit", explicit=bad)
    with pytest.raises(PartitionError, match="needs the explicit"):
        partition(model, 2, "explicit")


def test_partition_errors() -> None:
    model = LayeredModel([nn.Linear(2, 2) for _ in range(3)], nn.functional.mse_loss)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        partition(model, 4)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        partition(model, 4, "parameters")
    with pytest.raises(PartitionError, match="unknown partition method"):
        partition(model, 2, "magic")
    with pytest.raises(PartitionError, match=">= 1"):
        partition(model, 0)


def test_layered_model_validation() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        LayeredModel([], nn.functional.mse_loss)
    with pytest.raises(TypeError, match="layer 1"):
        LayeredModel([nn.ReLU(), "x"], nn.functional.mse_loss)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="9.weight"):
        LayeredModel([nn.Linear(2, 2)], nn.functional.mse_loss, tied=[("0.weight", "9.weight")])


USER_MODULE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    NOT_CALLABLE = 3

    def seq(width=4):
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))

    def with_loss():
        return [nn.Linear(4, 4), nn.Linear(4, 1)], F.mse_loss

    def with_module_loss():
        return nn.Sequential(nn.Linear(4, 4)), nn.MSELoss()

    def tied():
        a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        b.weight = a.weight
        return [a, b]

    def empty():
        return []

    def not_layers():
        return [nn.Linear(2, 2), 5]

    def in_bf16():
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3).to(torch.bfloat16))
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "sp_user_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sp_user_models"


def test_build_user_model_forms(user_module: str) -> None:
    m = build_user_model(f"{user_module}:seq", {"width": 5}, seed=0)
    assert m.num_layers == 3 and m.loss_fn is nn.functional.cross_entropy
    assert m.layers[0].in_features == 5
    again = build_user_model(f"{user_module}:seq", {"width": 5}, seed=0)
    assert torch.equal(m.layers[0].weight, again.layers[0].weight)  # seeded
    m = build_user_model(f"{user_module}:with_loss", {}, seed=0)
    assert m.loss_fn is nn.functional.mse_loss and m.num_layers == 2
    m = build_user_model(f"{user_module}:with_module_loss", {}, seed=0)
    assert isinstance(m.loss_fn, nn.MSELoss) and m.num_layers == 1
    m = build_user_model(f"{user_module}:tied", {}, seed=0)
    assert m.tied == [("0.weight", "1.weight")]


def test_factory_errors(user_module: str) -> None:
    with pytest.raises(FactoryError, match="no_such_pkg_xyz.mod:f.*cannot import.*no_such_pkg_xyz"):
        load_factory("no_such_pkg_xyz.mod:f")
    with pytest.raises(FactoryError, match=f"{user_module}:missing.*no attribute 'missing'"):
        load_factory(f"{user_module}:missing")
    with pytest.raises(FactoryError, match="not callable"):
        load_factory(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(FactoryError, match="form 'package.module:function'"):
        load_factory("just_a_module")
    with pytest.raises(FactoryError, match="bad arguments"):
        build_user_model(f"{user_module}:seq", {"depth": 2}, seed=0)
    with pytest.raises(FactoryError, match="no layers"):
        build_user_model(f"{user_module}:empty", {}, seed=0)
    with pytest.raises(FactoryError, match="layer 1 is a int"):
        build_user_model(f"{user_module}:not_layers", {}, seed=0)
    # weights are fp32 (the master copy); `precision` is how one computes in 16 bits
    with pytest.raises(FactoryError, match=r"parameter 1\.weight is torch\.bfloat16.*precision"):
        build_user_model(f"{user_module}:in_bf16", {}, seed=0)
