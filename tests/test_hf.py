"""Hugging Face causal LMs (`model.kind: hf`): split into layers, trained exactly.

The reference is a plain single-process transformers loop: the model built by transformers
from the same config and seed, `model(input_ids=x).logits`, cross entropy, torch's fused
AdamW and clip_grad_norm_, over the same samples. Spotpipe at P = 2, D = 1 must end with the
same bits, and its final model.safetensors must load with `from_pretrained`.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")  # the `hf` extra (part of `test`)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from spotpipe import job  # noqa: E402
from spotpipe.cluster.launcher import train  # noqa: E402
from spotpipe.config import ConfigError  # noqa: E402
from spotpipe.data import collate  # noqa: E402

from conftest import tiny_config  # noqa: E402

TINY = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 16,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 0},
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
              "max_position_embeddings": 16, "eos_token_id": 0, "bos_token_id": 0},
}


def hf_config(corpus, kind, overrides=None, **extra):
    return tiny_config(corpus, **{"model.kind": "hf", "model.hf.config": kind,
                                  "model.hf.overrides": json.dumps(TINY[kind] if overrides is None else overrides),
                                  "data.block_size": 16, "lr_schedule.kind": "constant",
                                  "lr_schedule.warmup_iters": 0, **extra})


def plain_transformers_loop(cfg, kind, overrides):
    """Train the transformers model itself, as its users would, on spotpipe's samples (with
    the workers' thread count: some CPU kernels sum in another order on more threads)."""
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **overrides))
    model.train()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)
    dataset = job.build_dataset(cfg)
    sampler = job.build_sampler(cfg, dataset)
    m = cfg.num_microbatches
    for t in range(cfg.iterations):
        for idx in sampler.pipeline_microbatches(t, 0, 1, m):
            x, y = collate(dataset, idx)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) / m
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_equals_a_plain_transformers_loop(tmp_path, corpus, kind):
    cfg = hf_config(corpus, kind)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    got = load_file(str(run / "final" / "model.safetensors"))
    want = plain_transformers_loop(cfg, kind, TINY[kind]).state_dict()
    assert set(got) == set(want), "final keys must be the transformers model's own"
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the transformers loop"
    loaded = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(loaded).__name__ == type(AutoModelForCausalLM.from_config(
        AutoConfig.for_model(kind, **TINY[kind]))).__name__
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, got[key]), key


def test_tied_gpt2_stays_tied_across_stages_and_loads(tmp_path, corpus):
    overrides = {**TINY["gpt2"], "tie_word_embeddings": True}
    cfg = hf_config(corpus, "gpt2", overrides)
    assert job.build_model(cfg).tied == [("0.wte.weight", "4.weight")]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    got = load_file(str(run / "final" / "model.safetensors"))
    assert torch.equal(got["transformer.wte.weight"], got["lm_head.weight"])
    want = plain_transformers_loop(cfg, "gpt2", overrides).state_dict()
    for key in want:  # the two halves of the tied gradient are summed in another order
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)
    loaded = AutoModelForCausalLM.from_pretrained(run / "final")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight.detach(), got["lm_head.weight"])


def test_weights_are_loaded_from_local_safetensors(tmp_path, corpus):
    torch.manual_seed(123)
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY["llama"]))
    save_file({k: v.contiguous() for k, v in source.state_dict().items()},
              str(tmp_path / "w.safetensors"))
    cfg = hf_config(corpus, "llama", **{"model.hf.weights": str(tmp_path / "w.safetensors")})
    layered = job.build_model(cfg)
    names = {v: k for k, v in layered.export_names.items()}
    mine = dict(layered.to_sequential().state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(mine[names[key]], value), key
    save_file({"nonsense": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    bad = hf_config(corpus, "llama", **{"model.hf.weights": str(tmp_path / "bad.safetensors")})
    with pytest.raises(ValueError, match="does not fit the model"):
        job.build_model(bad)


def test_hf_config_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match="model.hf.config"):
        tiny_config(corpus, **{"model.kind": "hf"})
    with pytest.raises(ValueError, match="model.hf.config"):
        job.build_model(hf_config(corpus, "no-such-model-type", {}))
    with pytest.raises(ValueError, match="config.json"):
        job.build_model(hf_config(corpus, str(tmp_path), {}))


def test_token_ids_beyond_a_transformers_models_vocabulary_are_refused_at_launch(corpus):
    """The vocabulary check covered the built-in GPT only: a transformers model with 64
    tokens read the byte-level corpus (ids to 255) into its embedding's bare IndexError, at
    the launch's profiling ("model: cannot profile its layers"); now the data is named."""
    from spotpipe.cluster.launcher import LaunchError, prepare

    cfg = hf_config(corpus, "gpt2", {**TINY["gpt2"], "vocab_size": 64})
    assert job.model_vocabulary(cfg) == 64  # (read from the transformers config: 64)
    with pytest.raises(LaunchError, match=r"^data: .* beyond the model's vocabulary of 64"):
        prepare(cfg)


def test_samples_longer_than_a_transformers_models_positions_are_refused_at_launch(corpus):
    """`data.block_size` over `model.gpt.block_size` is refused naming both keys, but a
    transformers GPT-2 of 8 positions read samples of 16 tokens into its position
    embedding's bare IndexError at the launch's profiling ("model: cannot profile its layers
    on one micro-batch: index out of range in self"); now the keys are named."""
    from spotpipe.cluster.launcher import LaunchError, prepare

    cfg = hf_config(corpus, "gpt2", {**TINY["gpt2"], "n_positions": 8})
    with pytest.raises(LaunchError, match=r"^data: data.block_size: 16 tokens a sample, more "
                                          r"than the model's n_positions \(8\)"):
        prepare(cfg)
    cfg = hf_config(corpus, "gpt2", {**TINY["gpt2"], "n_positions": 8}, **{"data.block_size": 8})
    assert len(job.build_dataset(cfg)) == (len(corpus.read_bytes()) - 1) // 8  # (8 is fine)
    cfg = hf_config(corpus, "llama", {**TINY["llama"], "max_position_embeddings": 8})
    with pytest.raises(job.DataError, match=r"16 tokens a sample, more than the model's "
                                            r"max_position_embeddings \(8\)"):
        job.build_dataset(cfg)


SLIDING = {**TINY["llama"], "vocab_size": 64, "max_position_embeddings": 32, "sliding_window": 4}


@pytest.mark.parametrize("kind,overrides", [
    ("mistral", SLIDING),  # every block attends within the window
    ("qwen2", {**SLIDING, "use_sliding_window": True, "max_window_layers": 1}),  # block 1 only
    ("qwen3", {**SLIDING, "use_sliding_window": True, "max_window_layers": 1, "head_dim": 16}),
])
def test_sliding_window_blocks_attend_as_in_the_transformers_forward(kind, overrides):
    """Each block got the full causal mask: a Mistral, or a Qwen2/Qwen3 with sliding layers,
    attended past its window (here 4 tokens of 16) and trained another model than the
    transformers one, without any error."""
    from spotpipe.model.hf import build_hf_model, split_hf

    model, config = build_hf_model(kind, overrides, "", seed=0)
    layers = split_hf(model, config).to_sequential().eval()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(layers(x), model.eval()(input_ids=x).logits)


def test_a_config_folder_in_bf16_trains_fp32_master_weights(tmp_path, corpus):
    """A published config.json names the dtype its weights were saved in (`"dtype":
    "bfloat16"`, `torch_dtype` before), and transformers' `from_config` builds the model in
    it: spotpipe trained bf16 parameters, gradients and AdamW state, whatever `precision`
    said (fp32 master weights, README), and ended elsewhere than the same model in fp32."""
    folder = tmp_path / "llama"
    AutoConfig.for_model("llama", **TINY["llama"], dtype="bfloat16").save_pretrained(folder)
    cfg = hf_config(corpus, "llama", {}, **{"model.hf.config": str(folder)})
    params = job.build_model(cfg).to_sequential().parameters()
    assert all(p.dtype == torch.float32 for p in params)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    got = load_file(str(run / "final" / "model.safetensors"))
    want = plain_transformers_loop(cfg, "llama", TINY["llama"]).state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the fp32 loop"
    loaded = AutoModelForCausalLM.from_pretrained(run / "final")  # the weights as trained
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, got[key]), key


def test_weights_without_the_head_are_refused_for_an_untied_model(tmp_path, corpus):
    """A tied model's published file has no lm_head.weight (GPT-2's, Qwen2-0.5B's). The key
    was excused for any model whose class can tie it: with `tie_word_embeddings: false` the
    head was left at its random init, and the job trained on without a word."""
    torch.manual_seed(123)
    tied = {**TINY["gpt2"], "tie_word_embeddings": True}
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **tied))
    state = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "tied.safetensors"))
    weights = {"model.hf.weights": str(tmp_path / "tied.safetensors")}
    loaded = job.build_model(hf_config(corpus, "gpt2", tied, **weights))  # tied: it fits
    head = loaded.layers[-1].weight
    assert head is loaded.layers[0].wte.weight
    assert torch.equal(head, source.lm_head.weight)
    with pytest.raises(ValueError, match=r"does not fit the model: missing \['lm_head.weight'\]"):
        job.build_model(hf_config(corpus, "gpt2", **weights))  # TINY's GPT-2 is untied
