"""NaN and infinity: refused in every setting and input before anything starts, and caught at
the commit at run time (training.nonfinite: stop or skip)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.checkpoint import durable
from spotpipe.cluster.launcher import train
from spotpipe.config import Config, ConfigError, from_dict
from spotpipe.runfiles import read_jsonl
from spotpipe.runtime.faults import Fault
from spotpipe.runtime.reference import train_reference

from conftest import tiny_config


def _numeric_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """Every key whose value is a number (or a list of numbers), by walking the dataclasses."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out += _numeric_keys(tp, key + ".")
        elif tp in (int, float) or typing.get_args(tp) in ((int,), (float,)):
            out.append((key, tp))
        elif f.name == "every":  # checkpoint.every: an integer or "auto"
            out.append((key, tp))
    return out


KEYS = _numeric_keys()


def test_the_walk_finds_the_numeric_keys():
    names = [k for k, _ in KEYS]
    for key in ("optimizer.lr", "optimizer.grad_clip", "optimizer.betas", "cluster.timeout_s",
                "failover.heartbeat_s", "failover.hang_timeout_s", "checkpoint.mtbf_s",
                "checkpoint.every", "iterations", "model.gpt.dropout"):
        assert key in names
    assert len(names) > 30


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("key,tp", KEYS, ids=[k for k, _ in KEYS])
def test_every_numeric_key_refuses_nan_and_infinity(key, tp, value):
    text = f"[{value}, 0.9]" if typing.get_origin(tp) is list else value
    with pytest.raises(ConfigError) as err:
        from_dict({"data": {"path": "x.txt"}}, [f"{key}={text}"])
    assert str(err.value).startswith(key), str(err.value)


def test_nan_inside_factory_kwargs_is_refused_naming_the_entry():
    with pytest.raises(ConfigError, match=r"model.factory_kwargs.width\[1\]: expected a finite"):
        from_dict({"data": {"path": "x.txt"}}, ["model.factory_kwargs={width: [1, .nan]}"])


# ---------------------------------------------------------------------- at run time

RUN = {"stages": 2, "iterations": 6, "checkpoint.every": 2, "optimizer.grad_clip": 0.5}
K = 3  # the iteration whose gradient gets the NaN


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def _equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_nan_with_stop_ends_the_job_naming_iteration_and_stage(tmp_path, corpus):
    cfg = tiny_config(corpus, **RUN)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault("nan", "node1", K, "all-reduce")]) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert f"at iteration {K} (stage 1)" in summary["message"], summary["message"]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["iter"] for m in metrics] == list(range(K))  # nothing of K committed
    newest = durable.newest(run / "checkpoints")
    assert newest is not None and newest.manifest["iteration"] == K - 2
    # the checkpoint before K resumes exactly: the uninterrupted run's parameters
    resumed = tmp_path / "resumed"
    assert train(cfg, resumed, progress=False, resume=newest.path) == 0
    model, _ = train_reference(cfg)
    assert _equal(_final(resumed), model.state_dict())


@pytest.mark.parametrize("where", ["node1", "node0"])
def test_nan_with_skip_is_the_reference_loop_without_that_step(tmp_path, corpus, where):
    cfg = tiny_config(corpus, **{**RUN, "training.nonfinite": "skip", "shadow.enabled": True,
                                 "redundancy": "lazy" if where == "node0" else "none"})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault("nan", where, K, "all-reduce")]) == 0
    skipped = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "step_skipped"]
    assert [(e["iteration"], e["stage"]) for e in skipped] == [(K, int(where[-1]))]
    model, _ = train_reference(cfg, skip=frozenset({K}))
    want = model.state_dict()
    assert _equal(_final(run), want)
    plain, _ = train_reference(cfg)
    assert not _equal(_final(run), plain.state_dict())  # the skip did change something
    # the shadows skipped alike: their newest checkpoint resumes to the same parameters
    newest = durable.newest(run / "checkpoints")
    assert newest.manifest["iteration"] == 5
    shadow_state = {}
    from spotpipe import job
    from spotpipe.runtime import node as nodelib

    spec = job.RunSpec.from_json(json.loads((run / "run.json").read_text()))
    for s in range(cfg.stages):
        state = nodelib.build_stage_state(job.build_model(cfg), spec.partition, s, cfg,
                                          torch.device("cpu"))
        durable.load_stage(newest, state.module, state.optimizer)
        shadow_state.update({k: v for k, v in state.module.state_dict().items()})
    assert all(torch.equal(shadow_state[k], want[k]) for k in shadow_state)
