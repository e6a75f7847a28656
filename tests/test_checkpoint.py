"""Durable checkpoints: written atomically, resharded on load, checked before use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.checkpoint import durable
from spotpipe.cluster.launcher import LaunchError, train

from conftest import assert_close_where_width_changed, tiny_config

# SGD with momentum: an update is linear in the gradient, so a run that changes D (and with it
# the order of summation) stays within float tolerance; AdamW would turn last-bit differences
# of near-zero gradients into whole learning-rate steps
SAVE = {"checkpoint.every": 3, "iterations": 8, "model.gpt.n_layer": 2,
        "optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.lr": 0.05}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus) -> Path:
    """A run at P=4, D=1 that checkpointed after iterations 2 and 5 (of 8: the LR schedule
    depends on the total, so the saved run is the same job as the resumed ones)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    assert train(tiny_config(corpus, stages=4, pipelines=1, **SAVE), run, progress=False) == 0
    return run


def final(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def test_checkpoints_are_committed_with_a_manifest(saved):
    names = sorted(p.name for p in (saved / "checkpoints").iterdir())
    assert names == ["iter_00000002", "iter_00000005", "latest"]  # no partial folder left
    assert durable.latest.read(saved / "checkpoints").iteration == 5
    ckpt = durable.verify(saved / "checkpoints" / "iter_00000005")
    m = ckpt.manifest
    assert m["iteration"] == 5 and m["next_iteration"] == 6 and m["stages"] == 4
    assert m["partition"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert m["format_version"] == durable.FORMAT_VERSION and m["checksums"]


@pytest.mark.parametrize("stages,pipelines", [(2, 2), (1, 1), (2, 1)])
def test_resume_reshards_and_continues_like_the_uninterrupted_run(tmp_path, corpus, saved,
                                                                  stages, pipelines):
    iters = {**SAVE, "iterations": 8, "checkpoint.every": 0}
    resumed = tmp_path / "resumed"
    # the global batch stays 8 samples: D = 2 pipelines of 2 micro-batches, or 1 of 4
    iters["num_microbatches"] = 4 // pipelines
    cfg = tiny_config(corpus, stages=stages, pipelines=pipelines, **iters)
    assert train(cfg, resumed, progress=False,
                 resume=saved / "checkpoints" / "iter_00000005") == 0
    metrics = [json.loads(line) for line in open(resumed / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == [6, 7]  # exactly where the data left off
    got = final(resumed)
    if pipelines == 1:
        # D as at save: bit for bit the uninterrupted run (the single-process loop)
        from test_equivalence import reference

        want, _ = reference(tiny_config(corpus, pipelines=1, **iters))
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        # D changed from 1 to 2 after the checkpoint: the same samples, summed in another
        # order, so close to the run that was uninterrupted at D = 2 from iteration 3 on
        straight = tmp_path / "straight"
        assert train(tiny_config(corpus, stages=stages, pipelines=pipelines, **iters), straight,
                     progress=False) == 0
        want = final(straight)
        assert_close_where_width_changed(got, want)
        loss = {m["iter"]: m["loss"] for m in map(json.loads, open(straight / "metrics.jsonl"))}
        assert metrics[0]["loss"] == pytest.approx(loss[6], rel=1e-4)


def test_resume_with_an_explicit_partition_and_activation_checkpointing(tmp_path, corpus,
                                                                        saved):
    """How the model is cut and run is not part of the model: the P=4 checkpoint resumes at
    P=3 with an explicit partition and activation checkpointing (both used to be refused as
    another model), and the run ends as the uninterrupted one, bit for bit."""
    from test_equivalence import reference

    iters = {**SAVE, "checkpoint.every": 0, "num_microbatches": 4}
    cfg = tiny_config(corpus, stages=3, pipelines=1, **iters,
                      **{"model.partition": "explicit", "model.stage_of_layer": [0, 0, 1, 2],
                         "model.activation_checkpointing": "layers"})
    resumed = tmp_path / "resumed"
    assert train(cfg, resumed, progress=False,
                 resume=saved / "checkpoints" / "iter_00000005") == 0
    got = final(resumed)
    want, _ = reference(tiny_config(corpus, pipelines=1, **iters))
    assert all(torch.equal(got[k], want[k]) for k in want)


# (DCP warns on every save and load without a default process group, as a worker's: nothing
# in a worker's log should look like a problem that is not one)
@pytest.mark.filterwarnings("error::UserWarning")
def test_tied_embeddings_saved_at_p1_load_at_p2(tmp_path):
    """With tied embeddings, `wte` and `lm_head` are one parameter at P=1 and two (updated
    alike) at P=2: the optimizer state written at P=1 must load into the second stage's
    `lm_head` too (it was written under the first name only, and P=2 could not load it)."""
    from spotpipe.model.gpt import GPTConfig, build_gpt
    from spotpipe.model.partition import build_stage

    gc = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=1, n_embd=4,
                   tie_embeddings=True)
    layers = gc.n_layer + 2
    whole = build_stage(build_gpt(gc, 0), 0, layers)
    optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    whole(torch.randint(0, 16, (2, 4))).sum().backward()
    optimizer.step()
    weights, state = whole.state_dict(), optimizer.state[whole.get_parameter("0.wte.weight")]
    sums = durable.save_stage(tmp_path, 0, 0, whole, optimizer)
    ckpt = durable.verify(durable.commit(tmp_path, 0, {"partition": [[0, layers]]}, sums,
                                         keep=2, key=b"k" * 32))
    for start, end, tied in [(0, 2, "0.wte.weight"), (2, layers, "3.lm_head.weight")]:
        stage = build_stage(build_gpt(gc, 1), start, end)  # another seed: nothing shared
        stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        durable.load_stage(ckpt, stage, stage_optimizer)
        for name, value in stage.state_dict().items():
            assert torch.equal(value, weights[name]), name
        loaded = stage_optimizer.state[stage.get_parameter(tied)]
        assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    # one written before the state went under both names (the first only) still loads at P=1
    folder = durable.prepare_stage_folder(tmp_path, 1, 0)
    durable.dcp_save(durable.stage_tensors(whole, optimizer, aliases=False), folder)
    old = durable.verify(durable.commit(tmp_path, 1, {"partition": [[0, layers]]},
                                        durable.stage_checksums(folder, 0), keep=2,
                                        key=b"k" * 32))
    stage = build_stage(build_gpt(gc, 1), 0, layers)
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    durable.load_stage(old, stage, stage_optimizer)
    loaded = stage_optimizer.state[stage.get_parameter("0.wte.weight")]
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(saved / "checkpoints", root)
    return root


def _a_shard(folder: Path) -> Path:
    return next(p for p in sorted(folder.rglob("*.distcp")))


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_damaged_newest_checkpoint_is_named_and_skipped(tmp_path, saved, damage):
    root = _copy(saved, tmp_path)
    newest = root / "iter_00000005"
    if damage == "flip":
        shard = _a_shard(newest)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = f"{shard}: checksum mismatch"
    elif damage == "truncate":
        shard = _a_shard(newest)
        shard.write_bytes(shard.read_bytes()[:10])
        expected = f"{shard}: checksum mismatch"
    else:
        (newest / "manifest.json").unlink()
        expected = f"{newest / 'manifest.json'}: missing"
    with pytest.raises(durable.CheckpointError, match="checksum mismatch|missing"):
        durable.verify(newest)
    problems: list[str] = []
    fallback = durable.newest(root, problems)
    assert fallback is not None and fallback.manifest["iteration"] == 2
    assert problems == [expected] or expected in problems[0]


def test_resume_with_another_global_batch_is_refused(tmp_path, corpus, saved):
    cfg = tiny_config(corpus, stages=2, pipelines=2, **SAVE)
    with pytest.raises(LaunchError, match="global batch"):
        train(cfg, tmp_path / "out", progress=False, resume=saved)


def test_resume_with_data_of_another_count_of_samples_is_refused(tmp_path, corpus, saved):
    """Another block size cuts the same corpus into another count of samples: each epoch is
    a permutation of another range, and the samples the checkpoint's epoch had consumed
    would come again (accepted before: only the global batch and the seed were compared)."""
    saved_samples = durable.verify(
        saved / "checkpoints" / "iter_00000005").manifest["num_samples"]
    cfg = tiny_config(corpus, stages=2, **{**SAVE, "data.block_size": 8})
    samples = (corpus.stat().st_size - 1) // 8
    with pytest.raises(LaunchError, match=f"data of {saved_samples} samples, this job's data "
                                          f"file '{corpus}' holds {samples}"):
        train(cfg, tmp_path / "out", progress=False, resume=saved)
    assert not (tmp_path / "out").exists()


def test_checkpoint_of_another_model_is_refused(tmp_path, corpus, saved):
    cfg = tiny_config(corpus, stages=2, **{**SAVE, "model.gpt.n_embd": 64})
    with pytest.raises(LaunchError, match="another model"):
        train(cfg, tmp_path / "out", progress=False, resume=saved)
    cfg = tiny_config(corpus, stages=2, **{**SAVE, "optimizer.name": "adamw"})
    with pytest.raises(LaunchError, match="another model"):
        train(cfg, tmp_path / "out", progress=False, resume=saved)
    assert not (tmp_path / "out").exists()


def test_incompatible_format_version_is_refused(tmp_path, saved):
    root = _copy(saved, tmp_path)
    manifest = root / "iter_00000005" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(durable.CheckpointError, match="format version 99 is not supported"):
        durable.verify(root / "iter_00000005")


def test_a_failure_is_handled_while_a_commit_is_still_running(tmp_path, corpus, monkeypatch):
    """Commits (manifest, rename, retention hashing every kept checkpoint: seconds per GB) run
    off the coordinator's loop. Here the first commit holds until the job has recovered from
    a failure that comes after it: with the commit on the loop, nothing would be handled
    meanwhile (the loop would be inside it) and the hold would end at its limit, unseen."""
    import threading
    import time

    real = durable.commit
    run = tmp_path / "run"
    seen: list[str] = []

    def held(root, iteration, *args, **kwargs):
        if not seen:
            limit = time.monotonic() + 60
            while time.monotonic() < limit and not seen:  # a real condition, polled
                lines = (run / "events.jsonl").read_text().splitlines()
                if any(json.loads(line)["kind"] == "resumed" for line in lines):
                    seen.append(threading.current_thread().name)
                time.sleep(0.05)
            seen.append("released")
        return real(root, iteration, *args, **kwargs)

    monkeypatch.setattr(durable, "commit", held)
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**SAVE, "iterations": 12, "failover.heartbeat_s": 0.2})
    from spotpipe.faults import Fault

    fault = Fault.parse("fail", "node1@7:backward", ["node0", "node1"])
    assert train(cfg, run, progress=False, faults=[fault]) == 0
    assert seen[:1] == ["checkpoint-commit"], "the job did not recover while the commit ran"
    evs = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    committed = [e["iteration"] for e in evs if e["kind"] == "checkpoint_committed"]
    assert sorted(committed) == [2, 5, 8, 11][:len(committed)] and 2 in committed
    assert [p.name for p in sorted((run / "checkpoints").iterdir()) if p.is_dir()] == \
        [f"iter_{t:08d}" for t in sorted(committed)[-cfg.checkpoint.keep:]]
    for path in (run / "checkpoints").glob("iter_*"):
        durable.verify(path)
