"""torchrun-style restarts (`failover.restarts`): the launcher and its store stay up, the
workers are stopped and started again from the newest durable checkpoint.

The run must end with the failure-free run's parameters, bit for bit (the single-process
reference loop), after exactly one restart from the checkpoint before the loss.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.checkpoint import durable
from spotpipe.cluster.launcher import _restart_point, train
from spotpipe.config import ConfigError
from spotpipe.faults import Fault

from conftest import tiny_config
from test_equivalence import reference

FAST = {"failover.heartbeat_s": 0.2, "failover.heartbeat_timeout_s": 3.0,
        "failover.hang_timeout_s": 2.0, "iterations": 6, "redundancy": "none",
        "checkpoint.every": 2}


def test_restart_resumes_from_the_newest_checkpoint_exactly(tmp_path, corpus):
    cfg = tiny_config(corpus, stages=2, **FAST, **{"failover.restarts": 1})
    run = tmp_path / "run"
    faults = [Fault.parse("fail", "node1@3:backward", ["node0", "node1"])]
    assert train(cfg, run, progress=False, faults=faults) == 0
    events = [json.loads(line) for line in open(run / "events.jsonl")]
    launches = [e for e in events if e["kind"] == "launch"]
    assert [e.get("restart", 0) for e in launches] == [0, 1]
    # the checkpoint after iteration 1 (every 2: iterations 1, 3, 5) is the newest before the
    # loss in iteration 3; the restarted round starts at 2 with the same store server
    assert launches[1]["start_iteration"] == 2
    assert launches[1]["store"] == launches[0]["store"]
    assert launches[1]["store_prefix"] == "restart1"
    assert [e["kind"] for e in events].count("fault_injected") == 1  # it does not fire again
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == [0, 1, 2, 2, 3, 4, 5]
    got = load_file(str(run / "final" / "model.safetensors"))
    want, _ = reference(tiny_config(corpus, stages=2, **FAST))
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the failure-free run"


def test_restarts_must_be_a_count(corpus):
    with pytest.raises(ConfigError, match="failover.restarts"):
        tiny_config(corpus, stages=2, **{"failover.restarts": -1})


def test_restart_without_a_checkpoint_starts_over(tmp_path, corpus):
    """As a torchrun script that finds no checkpoint: the workers start from iteration 0."""
    cfg = tiny_config(corpus, stages=2, **{**FAST, "checkpoint.every": 0, "iterations": 4,
                                           "failover.restarts": 1})
    run = tmp_path / "run"
    faults = [Fault.parse("fail", "node0@2:forward", ["node0", "node1"])]
    assert train(cfg, run, progress=False, faults=faults) == 0
    launches = [e for e in map(json.loads, open(run / "events.jsonl")) if e["kind"] == "launch"]
    assert len(launches) == 2 and "start_iteration" not in launches[1]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == [0, 1, 0, 1, 2, 3]
    got = load_file(str(run / "final" / "model.safetensors"))
    want, _ = reference(tiny_config(corpus, stages=2, **{**FAST, "checkpoint.every": 0,
                                                         "iterations": 4}))
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the failure-free run"


def _checkpoint(root: Path, iteration: int, info: dict, key: bytes) -> durable.Checkpoint:
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    sums = durable.save_stage(root, iteration, 0, module, optimizer)
    return durable.verify(durable.commit(root, iteration, {"partition": [[0, 1]], **info},
                                         sums, keep=9, key=key))


def test_the_restart_point_is_this_jobs_newest_checkpoint_that_resuming_would_accept(
        tmp_path, corpus):
    """After a loss it cannot fail over, the job restarts from its own newest checkpoint:
    not a later folder signed under another key, of another model or of another count of
    samples (what --resume refuses), nor a later one of another run under the same key and configuration (this job never
    committed it); a job that committed nothing and resumed from nothing starts over."""
    cfg = tiny_config(corpus, stages=1, **FAST)
    key, root, out = b"k" * 32, tmp_path / "ckpt", tmp_path / "run"
    samples = 1000
    mine = {"model_digest": cfg.model_digest(), "global_batch": cfg.global_batch,
            "seed": cfg.seed, "num_samples": samples}
    first = _checkpoint(root, 1, mine, key)
    own = _checkpoint(root, 2, mine, key)
    _checkpoint(root, 3, {**mine, "num_samples": samples + 1}, key)
    _checkpoint(root, 4, {**mine, "seed": cfg.seed + 1}, key)
    _checkpoint(root, 5, {**mine, "model_digest": "another"}, key)
    _checkpoint(root, 6, mine, b"x" * 32)
    _checkpoint(root, 7, mine, key)  # another run's, under the same key and configuration
    out.mkdir()
    (out / "events.jsonl").write_text("".join(json.dumps(
        {"time_s": 0.0, "kind": "checkpoint_committed", "node": "launcher", "iteration": t})
        + "\n" for t in (1, 2, 6)))
    launcher = types.SimpleNamespace(
        coordinator=types.SimpleNamespace(stop_message="two adjacent stages lost"), cfg=cfg,
        out=out, resume=None, checkpoint_root=root, checkpoint_key=key,
        spec=types.SimpleNamespace(num_samples=samples))
    again, found = _restart_point(launcher, 1)  # type: ignore[arg-type]
    assert again and found is not None and found.path == own.path
    (out / "events.jsonl").write_text("")
    assert _restart_point(launcher, 1) == (True, None)  # type: ignore[arg-type]
    launcher.resume = first  # resumed from 1, committed nothing yet
    assert _restart_point(launcher, 1)[1].path == first.path  # type: ignore[arg-type]


def test_a_restart_leaves_one_tensorboard_point_per_iteration(tmp_path, corpus):
    """The restarted round trains again the iterations after its checkpoint, and its lines
    go on in the same folder (metrics.jsonl keeps both, in time order). TensorBoard showed
    both as well: step 2 twice, the line going back from 2 to 2 (the round before wrote 0-2).
    The round's writer tells TensorBoard to drop the steps from its first on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(corpus, stages=2, **FAST, **{"failover.restarts": 1,
                                                   "logging.tensorboard": True})
    run = tmp_path / "run"
    faults = [Fault.parse("fail", "node1@3:backward", ["node0", "node1"])]
    assert train(cfg, run, progress=False, faults=faults) == 0
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == [0, 1, 2, 2, 3, 4, 5]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for tag in ("loss", "lr", "samples_per_s"):
        assert [e.step for e in acc.Scalars(tag)] == [0, 1, 2, 3, 4, 5], tag
    # the points of the steps trained again are the restarted round's
    assert [e.value for e in acc.Scalars("samples_per_s")][2:] == \
        pytest.approx([m["samples_per_s"] for m in metrics[3:]])
    # the summary counts the job from its first round: 6 iterations of 8 samples since launch
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_iteration"] == 0
    assert summary["samples_per_s"] == round(48 / metrics[-1]["time_s"], 3)
