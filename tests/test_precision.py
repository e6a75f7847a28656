"""Mixed precision (bf16, fp16 with its loss scaler) and activation checkpointing.

The reference is the plain single-process loop in the same precision, with torch's own
`torch.amp.GradScaler` for fp16 and no activation checkpointing: a pipeline at D = 1 must end
with its parameters bit for bit, with or without checkpointing, with or without failures, and
replicas and shadows must equal their owners (loss scaler included) after every iteration.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from spotpipe import job
from spotpipe.cluster.launcher import train
from spotpipe.config import ConfigError
from spotpipe.model import build_stage
from spotpipe.runtime.faults import Fault
from spotpipe.runtime.precision import Precision, run_layers

from conftest import tiny_config
from test_equivalence import reference
from test_failover import FAST, assert_samples_exactly_once
from test_shadow import state_digests

# fp16 whose first steps overflow: the scale starts at 1e30 and backs off by 1e-10, so the
# first iterations are skipped and the later ones step (both paths run)
SKIPPING = {"precision": "fp16", "loss_scale.init": 1e30, "loss_scale.backoff_factor": 1e-10}


def _final(run):
    return load_file(str(run / "final" / "model.safetensors"))


def _assert_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the reference loop"


def test_layers_run_in_the_compute_dtype_and_checkpointing_changes_no_bits(corpus):
    cfg = tiny_config(corpus)
    model = job.build_model(cfg)
    stage = build_stage(model, 1, 3)  # two blocks: a stage in the middle
    x = torch.randn(2, 16, 32)
    for name in ("bf16", "fp16"):
        results = []
        for ckpt in ("none", "layers", "stage"):
            stage.zero_grad(set_to_none=True)
            inp = x.to(Precision(name).dtype).requires_grad_()
            y = run_layers(stage, inp, Precision(name, ckpt))
            assert y.dtype == Precision(name).dtype  # what the next stage receives
            y.backward(torch.ones_like(y))
            assert inp.grad.dtype == y.dtype  # what goes back to the previous stage
            grads = [p.grad for p in stage.parameters()]
            assert all(g.dtype == torch.float32 for g in grads)  # fp32 master weights
            results.append((y.detach(), inp.grad, grads))
        for y, gx, grads in results[1:]:
            assert torch.equal(y, results[0][0]) and torch.equal(gx, results[0][1])
            assert all(torch.equal(a, b) for a, b in zip(grads, results[0][2]))


def test_bad_precision_keys_are_refused(corpus):
    with pytest.raises(ConfigError, match="precision"):
        tiny_config(corpus, precision="fp8")
    with pytest.raises(ConfigError, match="loss_scale"):
        tiny_config(corpus, **{"loss_scale.backoff_factor": 2.0})
    with pytest.raises(ConfigError, match="model.activation_checkpointing"):
        tiny_config(corpus, **{"model.activation_checkpointing": "all"})


@pytest.mark.parametrize("extra", [
    {"precision": "bf16"},
    {"precision": "bf16", "model.activation_checkpointing": "layers"},
    {**SKIPPING, "iterations": 4},
    {**SKIPPING, "iterations": 4, "model.activation_checkpointing": "stage"},
], ids=["bf16", "bf16-ckpt-layers", "fp16-skips", "fp16-ckpt-stage"])
def test_pipeline_equals_the_loop_in_the_same_precision(tmp_path, corpus, extra):
    cfg = tiny_config(corpus, stages=2, **extra)
    assert train(cfg, tmp_path / "run", progress=False) == 0
    plain = {k: v for k, v in extra.items() if k != "model.activation_checkpointing"}
    want, _ = reference(tiny_config(corpus, **plain))
    _assert_equal(_final(tmp_path / "run"), want)
    # lower precision did change the result (the comparison is not fp32 against fp32)
    fp32, _ = reference(tiny_config(corpus, iterations=cfg.iterations))
    assert any(not torch.equal(fp32[k], want[k]) for k in want)
    if extra.get("precision") == "fp16":
        # the reference's GradScaler skipped the first step, and stepped later
        first, _ = reference(tiny_config(corpus, **{**plain, "iterations": 1}))
        init = job.build_model(cfg).to_sequential().state_dict()
        assert all(torch.equal(first[k], init[k]) for k in init)
        assert any(not torch.equal(want[k], init[k]) for k in init)


@pytest.mark.parametrize("extra", [{"precision": "bf16"}, SKIPPING],
                         ids=["bf16", "fp16-skips"])
def test_replicas_and_shadows_equal_their_owners(tmp_path, corpus, extra):
    cfg = tiny_config(corpus, stages=3, redundancy="lazy", iterations=5,
                      **{"shadow.enabled": True, "logging.state_digests": True, **extra})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    seen = state_digests(run)
    for t in range(cfg.iterations):
        for s in range(cfg.stages):
            owner = seen[("owner", s, t)]
            assert len(owner) == 1, (s, t)
            assert seen[("replica", s, t)] == owner, f"replica of stage {s} after {t}"
            assert seen[("shadow", s, t)] == owner, f"shadow of stage {s} after {t}"
    assert len({next(iter(seen[("owner", 0, t)])) for t in range(cfg.iterations)}) == 5
    want, _ = reference(tiny_config(corpus, **{"iterations": 5, **extra}))
    _assert_equal(_final(run), want)


@pytest.mark.parametrize("stages,mode,extra,fault", [
    (3, "lazy", {"precision": "bf16"}, "node1@2:all-reduce"),
    (2, "eager", {"precision": "bf16", "model.activation_checkpointing": "stage"},
     "node0@3:backward"),
    (3, "lazy", {**SKIPPING, "model.activation_checkpointing": "layers"}, "node2@1:forward"),
], ids=["bf16-allreduce-P3", "bf16-ckpt-brc-P2", "fp16-skipped-iteration-P3"])
def test_failover_in_lower_precision_is_exact(tmp_path, corpus, stages, mode, extra, fault):
    cfg = tiny_config(corpus, stages=stages, redundancy=mode, **{**FAST, **extra})
    nodes = [f"node{r}" for r in range(stages)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault.parse("fail", fault, nodes)]) == 0
    plain = {k: v for k, v in {**FAST, **extra}.items()
             if k != "model.activation_checkpointing"}
    want, _ = reference(tiny_config(corpus, **plain))
    _assert_equal(_final(run), want)
    assert_samples_exactly_once(run, cfg)
