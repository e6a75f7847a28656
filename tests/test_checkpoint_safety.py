"""Nothing unpickled, nothing lost: what a checkpoint folder may hold, who wrote it, and what
happens when the disk fails (issue 13)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotpipe import job
from spotpipe.checkpoint import durable, lock
from spotpipe.checkpoint.durable import CheckpointError
from spotpipe.cluster.launcher import LaunchError, train
from spotpipe.runfiles import read_jsonl

from conftest import tiny_config

KEY = b"a" * 32
RUN = {"stages": 2, "iterations": 6, "checkpoint.every": 2}


def _stage(seed: int = 0):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def _commit(root: Path, iteration: int, keep: int = 5, seed: int = 0) -> Path:
    module, optimizer = _stage(seed)
    sums = durable.save_stage(root, iteration, 0, module, optimizer)
    return durable.commit(root, iteration, {"partition": [[0, 1]]}, sums, keep=keep, key=KEY)


class _Creates:
    """Unpickling this creates `path`: what a hostile `.metadata` does."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_pickle_metadata_is_refused_and_never_unpickled(tmp_path):
    ckpt = _commit(tmp_path / "ck", 1)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Creates(marker))
    # the craft is real: unpickling it does create the file
    pickle.loads(evil).close()
    assert marker.exists()
    marker.unlink()
    (ckpt / "stage0" / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointError, match=r"stage0/\.metadata: not listed in the manifest"):
        durable.verify(ckpt)
    # even listed in the manifest (a forger rewrote it: its MAC no longer holds), loading
    # reads the JSON metadata and never opens the pickle
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["checksums"]["stage0/.metadata"] = durable.file_checksums(ckpt)["stage0/.metadata"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    forged = durable.verify(ckpt)
    assert "does not match" in forged.origin_problem(KEY)
    module, optimizer = _stage(seed=1)
    durable.load_stage(forged, module, optimizer)
    want, _ = _stage(seed=0)
    assert torch.equal(module[0].weight, want[0].weight)
    assert not marker.exists()


def test_a_flipped_byte_in_a_file_the_manifest_does_not_list_is_found(tmp_path):
    ckpt = _commit(tmp_path, 1)
    extra = ckpt / "stage0" / "notes.bin"
    extra.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=f"{extra}: not listed in the manifest"):
        durable.verify(ckpt)
    extra.unlink()
    meta = ckpt / "stage0" / "dcp_metadata.json"  # listed: a flipped byte is a mismatch
    data = bytearray(meta.read_bytes())
    data[5] ^= 0x01
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{meta}: checksum mismatch"):
        durable.verify(ckpt)


def test_manifest_lists_only_files_inside_the_checkpoint(tmp_path):
    ckpt = _commit(tmp_path, 1)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["checksums"]["../elsewhere"] = "0" * 64
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a file of the checkpoint"):
        durable.verify(ckpt)


@pytest.mark.parametrize("damage, problem", [
    (lambda m: [], "not a JSON object"),
    (lambda m: {**m, "checksums": {"stage0/a\0b": "0" * 64}}, "not a file of the checkpoint"),
    (lambda m: {**m, "checksums": {k: 7 for k in m["checksums"]}}, "not a string"),
    (lambda m: {**m, "checksums": ["stage0"]}, "lists no files"),
    (lambda m: {**m, "next_iteration": "10"}, "not an iteration number"),
    (lambda m: {**m, "next_iteration": -3}, "next_iteration -3 does not follow iteration 2"),
    (lambda m: {**m, "next_iteration": 0, "iteration": -1}, "next_iteration 0 does not"),
    (lambda m: {**m, "next_iteration": 1}, "next_iteration 1 does not follow iteration 2"),
    (lambda m: {**m, "iteration": "2"}, "next_iteration 3 does not follow iteration '2'"),
], ids=["a list", "a NUL in a name", "a number for a checksum", "a list of files",
        "a string for an iteration", "a negative iteration", "iteration -1",
        "an earlier next iteration", "a string for the iteration done"])
def test_a_manifest_of_the_wrong_shape_is_named_and_skipped(tmp_path, damage, problem):
    """Valid JSON of the wrong shape (planted, or written by something else) is a
    CheckpointError naming the file, like any other damage: resuming takes the one before,
    and retention counts it for nothing instead of failing the commit."""
    good = _commit(tmp_path, 1)
    bad = _commit(tmp_path, 2)
    manifest = bad / "manifest.json"
    manifest.write_text(json.dumps(damage(json.loads(manifest.read_text()))))
    with pytest.raises(CheckpointError, match=f"{manifest}: .*{problem}"):
        durable.verify(bad)
    found, problems = durable.resolve(tmp_path)
    assert found.path == good and problem in problems[0]
    newer = _commit(tmp_path, 3, keep=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [good.name, bad.name, newer.name]


def _adamw(*layers: torch.nn.Module):
    module = torch.nn.Sequential(*layers)
    return module, torch.optim.AdamW(module.parameters(), lr=0.1)


@pytest.mark.parametrize("other, problem", [
    (lambda: _adamw(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3)),
     r"manifest.json: no stage holds layer 1 \(1.weight\): the checkpoint's partition "
     r"\[\(0, 1\)\] has layers 0 to 0"),
    (lambda: _adamw(torch.nn.Linear(4, 5)),
     r"stage0/dcp_metadata.json: 0.weight is float32 of shape \[3, 4\] in the checkpoint, "
     r"float32 of shape \[5, 4\] in this stage's"),
    (lambda: _adamw(torch.nn.Linear(4, 3).double()),
     r"stage0/dcp_metadata.json: 0.weight is float32 of shape \[3, 4\] in the checkpoint, "
     r"float64 of shape \[3, 4\]"),
], ids=["more layers", "wider", "another dtype"])
def test_a_checkpoint_that_does_not_hold_every_tensor_of_the_stage_is_refused(tmp_path, other,
                                                                             problem):
    """Each tensor the stage wants must be in the checkpoint with its shape and dtype: a
    model with more layers than the checkpoint's used to load "successfully", its extra
    layers left at their initial values."""
    ckpt = durable.verify(_commit(tmp_path, 1))
    module, optimizer = other()
    with pytest.raises(CheckpointError, match=problem):
        durable.load_stage(ckpt, module, optimizer)


def test_a_tensor_the_checkpoint_lacks_is_named(tmp_path):
    module, optimizer = _adamw(torch.nn.Linear(4, 3, bias=False))
    sums = durable.save_stage(tmp_path, 1, 0, module, optimizer)
    ckpt = durable.verify(durable.commit(tmp_path, 1, {"partition": [[0, 1]]}, sums, keep=5,
                                         key=KEY))
    module, optimizer = _adamw(torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointError, match=r"stage0/dcp_metadata.json: has no tensor "
                                              r"0.bias"):
        durable.load_stage(ckpt, module, optimizer)


def test_a_checkpoint_written_in_fp32_loads_in_fp16_with_a_fresh_loss_scale(tmp_path, corpus):
    """It was refused (no loss_scale tensor): the scaler's state starts where a fresh
    GradScaler's does, `loss_scale.init`, and everything else is the checkpoint's."""
    from spotpipe.runtime.optim import build_optimizer

    _commit(tmp_path, 2, seed=4)
    cfg = tiny_config(corpus, precision="fp16", **{"loss_scale.init": 1024.0})
    module = torch.nn.Sequential(torch.nn.Linear(4, 3))
    optimizer = build_optimizer(module.parameters(), cfg)
    fresh = durable.load_stage(durable.newest(tmp_path), module, optimizer)
    assert sorted(fresh) == sorted(f"optim/0.{n}/{s}" for n in ("weight", "bias")
                                   for s in ("loss_scale", "loss_scale_growth"))
    want, want_optimizer = _stage(seed=4)
    assert torch.equal(module[0].weight, want[0].weight)
    state, want_state = optimizer.state[module[0].weight], want_optimizer.state[want[0].weight]
    assert torch.equal(state["exp_avg"], want_state["exp_avg"])
    assert state["loss_scale"].item() == 1024.0 and state["loss_scale_growth"].item() == 0


def test_a_failed_load_says_its_cause(tmp_path):
    """DCP's exception leads with the ranks that failed; the cause after it is what the
    message must say (here: the data file is gone since the checkpoint was verified)."""
    ckpt = durable.verify(_commit(tmp_path, 1))
    shard = next((ckpt.path / "stage0").glob("*.distcp"))
    shard.unlink()
    module, optimizer = _stage(seed=1)
    with pytest.raises(CheckpointError, match=f"stage0: cannot be loaded \\(FileNotFoundError: "
                                              f".*{shard.name}"):
        durable.load_stage(ckpt, module, optimizer)


def test_mac_is_checked_under_the_key(tmp_path):
    ckpt = durable.verify(_commit(tmp_path, 1))
    assert ckpt.origin_problem(KEY) == ""
    assert "does not match" in ckpt.origin_problem(b"b" * 32)
    unsigned = {k: v for k, v in ckpt.manifest.items() if k != "mac"}
    assert "no MAC" in durable.Checkpoint(ckpt.path, unsigned).origin_problem(KEY)


def test_keep_one_never_deletes_the_good_one_for_a_damaged_newest(tmp_path):
    good = _commit(tmp_path, 1, keep=1)
    module, optimizer = _stage()
    sums = durable.save_stage(tmp_path, 2, 0, module, optimizer)
    shard = next((durable.iter_dir(tmp_path, 2, partial=True) / "stage0").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged after it was hashed, before the commit
    shard.write_bytes(bytes(data))
    with pytest.raises(durable.CheckpointError, match="checksum mismatch"):
        durable.commit(tmp_path, 2, {"partition": [[0, 1]]}, sums, keep=1, key=KEY)
    # (checked before its rename; one that leaves retention to a later commit is not)
    durable.commit(tmp_path, 2, {"partition": [[0, 1]]}, sums, keep=1, key=KEY,
                   apply_retention=False)
    assert durable.retain(tmp_path, 1, KEY, upto=2) == []
    assert good.is_dir()
    assert durable.newest(tmp_path).path == good
    newer = _commit(tmp_path, 3, keep=1)  # a good newer one: now the older ones go
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [newer.name]


def test_retention_counts_only_checkpoints_signed_under_the_key(tmp_path):
    good = _commit(tmp_path, 1)
    module, optimizer = _stage()
    sums = durable.save_stage(tmp_path, 2, 0, module, optimizer)
    durable.commit(tmp_path, 2, {"partition": [[0, 1]]}, sums, keep=5, key=b"x" * 32)
    assert durable.retain(tmp_path, 1, KEY) == []  # the foreign newer one does not count
    assert good.is_dir()


def test_retention_never_deletes_the_checkpoint_just_committed_for_a_later_one(tmp_path):
    """A job resumed from an older checkpoint (or started afresh) in a folder that holds
    another run's later checkpoints: at keep = 1 its commit of 44 used to be deleted at once
    for the other run's 49. Later folders are not this job's: they neither count nor go."""
    _commit(tmp_path, 39, keep=1)
    other = _commit(tmp_path, 49, keep=1, seed=1)
    mine = _commit(tmp_path, 44, keep=1, seed=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [mine.name, other.name]
    module, optimizer = _stage(seed=3)
    durable.load_stage(durable.verify(mine), module, optimizer)
    want, _ = _stage(seed=2)
    assert torch.equal(module[0].weight, want[0].weight)
    _commit(tmp_path, 46, keep=1)  # its next one: the one before it goes, the later one stays
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_00000046", other.name]


def test_checkpoints_past_iteration_10_to_the_8_are_newer_than_those_before(tmp_path):
    """`iter_{:08d}` grows a ninth digit at 10^8: ordered as text, iter_100000000 came before
    iter_99999999, so the newest checkpoint was taken for the oldest (resumed from the older,
    and deleted first by retention)."""
    older = _commit(tmp_path, 99_999_999, keep=1)
    assert older.name == "iter_99999999"
    newer = _commit(tmp_path, 100_000_000, keep=1, seed=1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [newer.name]
    assert durable.newest(tmp_path).path == newer


def test_committing_onto_an_existing_checkpoint_folder_replaces_it(tmp_path):
    _commit(tmp_path, 2, seed=0)
    again = _commit(tmp_path, 2, seed=1)  # a job resumed from an earlier one, same folder
    module, optimizer = _stage(seed=3)
    durable.load_stage(durable.verify(again), module, optimizer)
    want, _ = _stage(seed=1)
    assert torch.equal(module[0].weight, want[0].weight)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [again.name]


def test_partial_folders_are_cleaned(tmp_path):
    _commit(tmp_path, 1)
    module, optimizer = _stage()
    durable.save_stage(tmp_path, 2, 0, module, optimizer)  # never committed
    assert durable.clean_partials(tmp_path) == [durable.iter_dir(tmp_path, 2, partial=True)]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["iter_00000001"]


class _Stopped(BaseException):
    """The job stops here (a kill, a lost machine)."""


def _stopped_between_renames(root: Path, monkeypatch) -> Path:
    """Commit 1 and 2, then a commit replacing 2 that stops once the old 2 is moved aside:
    the old 2's folder (gone from its name)."""
    _commit(root, 1)
    old = _commit(root, 2, seed=0)
    module, optimizer = _stage(seed=1)
    sums = durable.save_stage(root, 2, 0, module, optimizer)
    real = os.replace

    def stopping(src, dst):
        real(src, dst)
        if str(dst).endswith(".replaced"):
            raise _Stopped

    monkeypatch.setattr(durable.os, "replace", stopping)
    with pytest.raises(_Stopped):
        durable.commit(root, 2, {"partition": [[0, 1]]}, sums, keep=5, key=KEY)
    monkeypatch.setattr(durable.os, "replace", real)
    return old


def test_a_job_stopped_between_the_renames_of_a_replacing_commit_loses_neither(tmp_path,
                                                                              monkeypatch):
    """Committing onto an existing iteration moves the old folder aside, then renames the new
    one into place; a job stopped between the two finds, at its next start, the old one put
    back (the commit was not made), not both removed as partials."""
    old = _stopped_between_renames(tmp_path, monkeypatch)
    assert not old.exists()
    assert durable.clean_partials(tmp_path) == [durable.iter_dir(tmp_path, 2, partial=True)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_00000001",
                                                                         old.name]
    found = durable.newest(tmp_path)
    assert found.path == old and found.origin_problem(KEY) == ""
    loaded, optimizer = _stage(seed=3)
    durable.load_stage(found, loaded, optimizer)
    want, _ = _stage(seed=0)
    assert torch.equal(loaded[0].weight, want[0].weight)


def test_a_checkpoint_moved_aside_by_a_stopped_commit_is_found_before_the_folder_is_held(
        tmp_path, monkeypatch):
    """`--resume` resolves its checkpoint before the job takes the folder's lock (which puts a
    moved-aside checkpoint back): it used to find nothing, or an older checkpoint, there."""
    old = _stopped_between_renames(tmp_path, monkeypatch)
    found, problems = durable.resolve(tmp_path)
    assert found.iteration == 2 and found.path.name == ".iter_00000002.replaced", problems
    durable.clean_partials(tmp_path)  # what the job does once it holds the folder
    assert durable.settled(found).path == old and old.is_dir()
    loaded, optimizer = _stage(seed=3)
    durable.load_stage(durable.settled(found), loaded, optimizer)
    want, _ = _stage(seed=0)
    assert torch.equal(loaded[0].weight, want[0].weight)


def test_resume_from_a_folder_takes_the_newest_of_the_timeline_that_last_held_it(tmp_path):
    """A folder can hold two runs' checkpoints: the highest iteration there need not be the
    last job's. Reference: which checkpoint each step committed, by hand."""
    for iteration in (50, 100):  # run A
        _commit(tmp_path, iteration)
    assert durable.newest(tmp_path).iteration == 100
    durable.begin_timeline(tmp_path, durable.verify(durable.iter_dir(tmp_path, 50)))
    assert durable.newest(tmp_path).iteration == 50  # resumed from 50, nothing committed
    _commit(tmp_path, 60, seed=1)
    assert durable.newest(tmp_path).iteration == 60
    durable.begin_timeline(tmp_path, None)  # run B starts afresh in the folder
    with pytest.raises(CheckpointError, match="latest: the job that last started in this "
                                              "folder has committed no checkpoint yet"):
        durable.resolve(tmp_path)
    _commit(tmp_path, 10, seed=2)
    found, _ = durable.resolve(tmp_path)
    assert found.iteration == 10
    assert durable.resolve(durable.iter_dir(tmp_path, 100))[0].iteration == 100  # by name
    (tmp_path / "latest").unlink()  # a folder an older spotpipe wrote: by the names
    assert durable.newest(tmp_path).iteration == 100


def test_a_late_commit_of_a_deposed_coordinator_does_not_move_the_pointer_back(tmp_path):
    """A coordinator that lost the store goes on committing what it held while its successor
    commits on: the pointer must stay at the successor's later checkpoint (a commit of 55
    after 60 once made `--resume` go on from 55)."""
    _commit(tmp_path, 50)
    _commit(tmp_path, 60, seed=1)  # the successor's
    _commit(tmp_path, 55, seed=2)  # the deposed coordinator's, late
    assert durable.newest(tmp_path).iteration == 60
    assert durable.resolve(tmp_path)[0].iteration == 60
    assert (tmp_path / "iter_00000055").is_dir()  # (a good checkpoint, kept)


@pytest.mark.parametrize("text, problem", [
    ("{", "not valid JSON|Expecting"), ("[1]", "iteration is 'absent'"),
    ('{"iteration": "7"}', "iteration is '7'"), ('{"iteration": -1}', "iteration is -1"),
    ('{"iteration": true}', "iteration is True"), (" " * 5000, "over 4096 bytes"),
    ("\udcff", "codec|utf-8")])
def test_a_pointer_spotpipe_did_not_write_is_named_not_guessed(tmp_path, text, problem):
    _commit(tmp_path, 3)
    (tmp_path / "latest").write_text(text, errors="surrogateescape")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'}: not a pointer to a "
                                              "checkpoint") as exc:
        durable.resolve(tmp_path)
    import re
    assert re.search(problem, str(exc.value)), exc.value


def test_a_peers_discard_between_folder_and_stage_does_not_fail_the_write(tmp_path,
                                                                           monkeypatch):
    """Seen in CI: stage 1's write failed, and its `discard_stage` removed the still empty
    partial folder between stage 0's making of it and of its own folder in it; stage 0's
    write then failed too (FileNotFoundError), for no fault of its own."""
    partial = durable.iter_dir(tmp_path, 3, partial=True)
    real_mkdir = Path.mkdir
    raced = []

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self == partial and not raced:  # the peer's discard, at the worst instant
            raced.append(True)
            durable.discard_stage(tmp_path, 3, 1)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    folder = durable.prepare_stage_folder(tmp_path, 3, 0)
    assert raced and folder.is_dir() and folder.parent == partial


# ---------------------------------------------------------------------- jobs


def _key_file(tmp_path: Path, name: str, fill: str) -> str:
    path = tmp_path / name
    path.write_text(fill * 32)
    return str(path)


@pytest.fixture(scope="module")
def signed(tmp_path_factory, corpus) -> tuple[Path, str]:
    """A run whose checkpoints are signed under a key of its own."""
    base = tmp_path_factory.mktemp("signed")
    key = _key_file(base, "key", "s")
    run = base / "run"
    assert train(tiny_config(corpus, **RUN, **{"checkpoint.key": key}), run,
                 progress=False) == 0
    return run, key


def test_a_checkpoint_without_a_valid_mac_is_refused_unless_trusted(tmp_path, corpus, signed):
    run, key = signed
    source = run / "checkpoints" / "iter_00000003"
    other = _key_file(tmp_path, "other", "o")
    cfg = tiny_config(corpus, **RUN, **{"checkpoint.key": other})
    with pytest.raises(LaunchError, match="MAC does not match this job's key.*"
                                          "--trust-checkpoint"):
        train(cfg, tmp_path / "refused", progress=False, resume=source)
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "trusted"
    assert train(cfg, out, progress=False, resume=source, trust_checkpoint=True) == 0
    trusted = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "checkpoint_trusted"]
    assert len(trusted) == 1 and "does not match" in trusted[0]["reason"]
    # under its own key it resumes without being told to trust it
    own = tmp_path / "own"
    assert train(tiny_config(corpus, **RUN, **{"checkpoint.key": key}), own, progress=False,
                 resume=source) == 0
    # and to the same parameters as the run it came from
    got = load_file(str(own / "final" / "model.safetensors"))
    want = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not any(e["kind"] == "checkpoint_trusted" for e in read_jsonl(own / "events.jsonl"))


def test_a_job_started_afresh_in_a_folder_is_what_resume_goes_on_from(tmp_path, corpus,
                                                                         signed):
    """A run of 4 iterations started afresh in a folder that holds a run of 6: it commits
    iteration 1 and 3 over the older run's; the older run's 5 stays (retention never deletes a
    later run's). `--resume` of the folder used to take that 5."""
    run, key = signed
    folder = tmp_path / "shared"
    shutil.copytree(run / "checkpoints", folder)
    cfg = tiny_config(corpus, **{**RUN, "iterations": 4, "checkpoint.dir": str(folder),
                                 "checkpoint.key": key})
    assert train(cfg, tmp_path / "b", progress=False) == 0
    assert durable.iter_dir(folder, 5).is_dir()
    found, _ = durable.resolve(folder)
    assert found.iteration == 3
    committed = [e for e in read_jsonl(tmp_path / "b" / "events.jsonl")
                 if e["kind"] == "checkpoint_committed"]
    assert committed[-1]["iteration"] == 3


def test_overwrite_refuses_an_out_that_holds_the_inputs(tmp_path, corpus, signed):
    run, _ = signed
    before = sorted(str(p) for p in run.rglob("*"))
    cfg = tiny_config(corpus, **RUN)
    with pytest.raises(LaunchError, match="holds --resume"):
        train(cfg, run, overwrite=True, progress=False, resume=run / "checkpoints")
    config = run / "job.yaml"
    with pytest.raises(LaunchError, match="holds the configuration"):
        train(cfg, run, overwrite=True, progress=False, config_path=config)
    data = tmp_path / "out"
    data.mkdir()
    shutil.copy(corpus, data / "corpus.txt")
    with pytest.raises(LaunchError, match="holds data.path"):
        train(tiny_config(data / "corpus.txt", **RUN), data, overwrite=True, progress=False)
    assert sorted(str(p) for p in run.rglob("*")) == before
    assert (data / "corpus.txt").exists()


def test_out_that_is_a_file_is_refused(tmp_path, corpus):
    out = tmp_path / "afile"
    out.write_text("x")
    with pytest.raises(LaunchError, match="is a file, not a folder"):
        train(tiny_config(corpus, **RUN), out, progress=False)


def test_a_second_job_on_the_same_checkpoint_dir_is_refused(tmp_path, corpus):
    shared = tmp_path / "shared"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    try:
        shared.mkdir()
        (shared / lock.LOCK).write_text(json.dumps(
            {"host": os.uname().nodename, "pid": holder.pid, "run": "/runs/first"}))
        cfg = tiny_config(corpus, **{**RUN, "checkpoint.dir": str(shared)})
        with pytest.raises(LaunchError, match=f"in use by another job \\(pid {holder.pid} on "
                                              f".*run folder /runs/first\\)"):
            train(cfg, tmp_path / "second", progress=False)
        assert not (tmp_path / "second").exists()
    finally:
        holder.communicate(b"")
    # its process is gone: the lock is stale and taken over
    (shared / ".iter_00000009.partial").mkdir()
    out = tmp_path / "third"
    assert train(cfg, out, progress=False) == 0
    events = read_jsonl(out / "events.jsonl")
    assert any(e["kind"] == "checkpoint_partial_removed" for e in events)
    assert not (shared / ".iter_00000009.partial").exists()
    assert not (shared / lock.LOCK).exists()  # released at the end
    assert sorted(p.name for p in shared.iterdir()) == ["iter_00000003", "iter_00000005",
                                                        "latest"]


def test_two_jobs_taking_over_a_stale_lock_at_once_do_not_both_win(tmp_path, monkeypatch):
    """Job B has found the lock's holder dead; before it acts, job A takes the lock over,
    completely. B must then be refused, naming A, and A's lock stay (B used to remove it as
    the dead holder's and create its own: both ran)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / lock.LOCK).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": gone.pid, "run": "/runs/dead"}))
    real = lock.refuse_if_held
    took: list[lock.Holder] = []

    def then_a_takes_it_over(folder: Path) -> None:
        real(folder)  # B: the holder is dead
        if not took:
            monkeypatch.setattr(lock, "refuse_if_held", real)
            took.append(lock.acquire(folder, Path("/runs/a")))  # A, from start to end
            monkeypatch.setattr(lock, "refuse_if_held", then_a_takes_it_over)

    monkeypatch.setattr(lock, "refuse_if_held", then_a_takes_it_over)
    with pytest.raises(lock.LockHeld, match=r"in use by another job \(pid \d+ on .*run "
                                            r"folder /runs/a\)"):
        lock.acquire(tmp_path, Path("/runs/b"))
    assert took and json.loads((tmp_path / lock.LOCK).read_text())["run"] == "/runs/a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK]  # no takeover file left


def test_a_failed_checkpoint_write_is_an_event_and_training_goes_on(tmp_path, corpus):
    from spotpipe.runtime.faults import Fault

    cfg = tiny_config(corpus, **RUN)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault("ioerror", "node1", 3, "checkpoint")]) == 0
    events = read_jsonl(run / "events.jsonl")
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert [(e["iteration"], e["stage"]) for e in failed] == [(3, 1)]
    assert "No space left on device" in failed[0]["message"]
    committed = [e["iteration"] for e in events if e["kind"] == "checkpoint_committed"]
    assert committed == [1, 5]  # 3 never, and the next one as scheduled
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "iter_00000001", "iter_00000005", "latest"]
    # the checkpoint before the failed one resumes to the uninterrupted run's parameters
    resumed = tmp_path / "resumed"
    assert train(cfg, resumed, progress=False,
                 resume=run / "checkpoints" / "iter_00000001") == 0
    got = load_file(str(resumed / "final" / "model.safetensors"))
    want = load_file(str(run / "final" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_launcher_failing_to_write_its_files_stops_the_job(tmp_path, corpus, monkeypatch):
    from spotpipe.cluster import jobloop

    real = jobloop.RunFiles.metric
    calls = []

    def full_disk(self, record):
        calls.append(record["iter"])
        if len(calls) == 2:  # from now on the disk is full (/dev/full: every write ENOSPC)
            self.metrics.close()
            self.metrics = open("/dev/full", "w")
        real(self, record)

    monkeypatch.setattr(jobloop.RunFiles, "metric", full_disk)
    out = tmp_path / "run"
    assert train(tiny_config(corpus, **{**RUN, "iterations": 20}), out, progress=False) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["message"] == f"cannot write {out / 'metrics.jsonl'}: No space left on device"


def test_a_copy_of_some_stage_folders_verifies_for_their_layers_only(tmp_path):
    """A host's copy of a checkpoint may hold only the stage folders its workers load (an
    agent's --resume copy): it verifies for their layers and loads; for another layer the
    missing file is named; a file the manifest does not list is still refused."""
    first, first_optimizer = _stage(seed=0)  # layer 0 (its tensors are named "0.*")
    torch.manual_seed(1)
    second = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 3))  # layer 1
    second_optimizer = torch.optim.AdamW(second.parameters(), lr=0.1)
    second(torch.ones(2, 4)).sum().backward()
    second_optimizer.step()
    sums = {**durable.save_stage(tmp_path, 4, 0, first, first_optimizer),
            **durable.save_stage(tmp_path, 4, 1, second, second_optimizer)}
    ckpt = durable.commit(tmp_path, 4, {"partition": [[0, 1], [1, 2]]}, sums, keep=5, key=KEY)
    shutil.rmtree(ckpt / "stage0")
    with pytest.raises(CheckpointError, match=r"stage0/.*: missing"):
        durable.verify(ckpt)
    with pytest.raises(CheckpointError, match=r"stage0/.*: missing"):
        durable.verify(ckpt, layers={0, 1})
    copy = durable.verify(ckpt, layers={1})
    module = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    durable.load_stage(copy, module, optimizer)
    assert torch.equal(module[1].weight, second[1].weight)
    assert durable.layers_of(module) == {1}
    (ckpt / "stage1" / "stray").write_text("x")
    with pytest.raises(CheckpointError, match="not listed in the manifest"):
        durable.verify(ckpt, layers={1})
    (ckpt / "stage1" / "stray").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["partition"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="has no partition"):
        durable.verify(ckpt, layers={1})


def test_the_folders_a_host_loads_at_the_start(corpus):
    """`job.start_layers` (a node's stage and its replica in the first layout) and
    `durable.folders_holding` (the old stage folders with some of those layers), against
    layers and folders read off by hand."""
    partition = [(0, 2), (2, 3), (3, 5), (5, 6)]
    lazy = tiny_config(corpus, stages=4, pipelines=1, redundancy="lazy")
    plain = tiny_config(corpus, stages=4, pipelines=1, redundancy="none")
    assert job.start_layers(lazy, partition, ["node1"]) == {2, 3, 4}  # stage 1, replica of 2
    assert job.start_layers(lazy, partition, ["node3"]) == {5, 0, 1}  # stage 3, replica of 0
    assert job.start_layers(plain, partition, ["node1"]) == {2}
    assert job.start_layers(plain, partition, ["node0", "node3"]) == {0, 1, 5}
    written = [(0, 3), (3, 6)]  # a checkpoint of the same model on two stages
    assert durable.folders_holding(written, {2, 3, 4}) == {"stage0", "stage1"}
    assert durable.folders_holding(written, {2}) == {"stage0"}
    assert durable.folders_holding(written, {5}) == {"stage1"}


def test_the_user_key_file_appears_whole_to_a_job_started_beside_the_first(tmp_path,
                                                                           monkeypatch):
    """Two local jobs make the per-user key at once: the second one starts while the first
    is writing it (here, from inside the first's draw of the secret). Each reads a whole key,
    the same one, and no stray file is left beside it. Before, the first created the file
    empty and then wrote it, and the second read it empty: "expected a secret of at least
    16 bytes" (seen in the test suite, whose workers share one key file)."""
    import secrets

    from spotpipe.checkpoint import origin

    path = tmp_path / "cfg" / "checkpoint.key"
    monkeypatch.setenv("SPOTPIPE_KEY_FILE", str(path))
    monkeypatch.delenv("SPOTPIPE_JOIN_TOKEN", raising=False)
    draw, second = secrets.token_hex, []

    def drawn_while_another_job_starts(n: int) -> str:
        if n == 32 and not second:
            second.append(None)
            second[0] = origin.resolve_key()
        return draw(n)

    monkeypatch.setattr(secrets, "token_hex", drawn_while_another_job_starts)
    first = origin.resolve_key()
    assert len(first) == 64 and first == second[0] == path.read_bytes().strip()
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.key"]
    assert (path.stat().st_mode & 0o777) == 0o600
