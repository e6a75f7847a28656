"""The committer: checkpoints committed in order on a thread of their own, each after the
steps handed over before it (an uploaded stage to receive); a failed step fails only its
iteration."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path

import pytest

from spotpipe.checkpoint import durable
from spotpipe.cluster.committer import Committer

KEY = b"k" * 32


def _written(root: Path, iteration: int) -> dict[str, str]:
    """One stage's file in the iteration's uncommitted folder; its checksums."""
    folder = durable.iter_dir(root, iteration, partial=True) / "stage0"
    folder.mkdir(parents=True)
    data = f"iteration {iteration}".encode()
    (folder / "x.bin").write_bytes(data)
    return {"stage0/x.bin": hashlib.sha256(data).hexdigest()}


def test_commits_in_order_and_a_failed_step_fails_only_its_iteration(tmp_path):
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=5, key=KEY, now=lambda: 1.5)
    ran: list[str] = []
    for t in (1, 2, 3):
        checksums = _written(root, t)
        committer.submit_step(t, lambda t=t: ran.append(f"step {t}") or
                              ("it arrived damaged" if t == 2 else ""))
        committer.submit(t, {"stages": 1}, checksums)
    done = committer.close()
    assert ran == ["step 1", "step 2", "step 3"]
    assert [(c.iteration, c.path is not None, c.error) for c in done] == [
        (1, True, ""), (2, False, "it arrived damaged"), (3, True, "")]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == \
        ["iter_00000001", "iter_00000003"]
    assert durable.verify(root / "iter_00000003").manifest["iteration"] == 3
    assert all(c.time_s == 1.5 for c in done)


def test_the_caller_does_not_wait_for_a_commit(tmp_path):
    """submit returns at once; `finished` has nothing until the commit is done; `close`
    waits for it."""
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)
    release = threading.Event()
    committer.submit_step(1, lambda: "" if release.wait(30) else "never released")
    committer.submit(1, {"stages": 1}, _written(root, 1))
    assert committer.finished() == []  # the step holds the thread; the caller went on
    release.set()
    done = committer.close()
    assert [(c.iteration, c.error) for c in done] == [(1, "")]
    assert (root / "iter_00000001").is_dir()


def test_a_job_without_checkpoints_starts_no_thread(tmp_path):
    committer = Committer(tmp_path, keep=2, key=KEY, now=lambda: 0.0)
    before = {t.name for t in threading.enumerate()}
    assert committer.close() == [] and "checkpoint-commit" not in before


def test_a_deposed_coordinator_drops_the_commits_not_yet_started(tmp_path):
    """Its successor commits from now on: the commit under way ends, the rest never run."""
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=5, key=KEY, now=lambda: 0.0)
    started, release = threading.Event(), threading.Event()
    committer.submit_step(1, lambda: "" if started.set() or release.wait(30) else "stuck")
    committer.submit(1, {"stages": 1}, _written(root, 1))
    committer.submit(2, {"stages": 1}, _written(root, 2))
    assert started.wait(30)  # the thread is inside iteration 1's step
    committer.drop_pending()  # (abandon() is this, then close())
    release.set()
    done = committer.close()
    assert done == []  # iteration 1's commit and iteration 2 were dropped with the queue
    assert not any(p.name.startswith("iter_") for p in root.iterdir())


def test_uploads_are_taken_side_by_side_and_the_commit_waits_for_all_of_them(tmp_path):
    """A slow host's stage does not hold another host's: the second receive runs while the
    first still waits for its sender, and the iteration commits only once both are in."""
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)
    slow_started, fast_done, release = threading.Event(), threading.Event(), threading.Event()
    committer.submit_step(1, lambda: "" if slow_started.set() or release.wait(30) else "stuck")
    committer.submit_step(1, lambda: "" if fast_done.set() is None else "")
    committer.submit(1, {"stages": 1}, _written(root, 1))
    assert slow_started.wait(30) and fast_done.wait(30)  # the second ran; the first waits
    assert committer.finished() == [] and not (root / "iter_00000001").exists()
    release.set()
    assert [(c.iteration, c.error) for c in committer.close()] == [(1, "")]
    assert (root / "iter_00000001").is_dir()


def test_a_step_that_raises_fails_its_iteration_naming_the_error(tmp_path):
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)

    def broken() -> str:
        raise OSError("No space left on device")

    committer.submit_step(1, broken)
    committer.submit(1, {"stages": 1}, _written(root, 1))
    committer.submit(2, {"stages": 1}, _written(root, 2))
    assert [(c.iteration, c.error) for c in committer.close()] == [
        (1, "OSError: No space left on device"), (2, "")]


def test_a_commit_whose_stage_files_are_missing_fails_naming_one(tmp_path):
    """The checksums come from the workers' reports; a stage whose file never reached this
    folder (sent to a coordinator deposed since) must not be committed as if it had."""
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)
    checksums = _written(root, 1)
    committer.submit(1, {"stages": 2}, {**checksums, "stage1/x.bin": "0" * 64})
    [done] = committer.close()
    assert done.path is None and "stage1/x.bin" in done.error and "not in" in done.error
    assert not (root / "iter_00000001").exists()


def test_a_checkpoint_is_committed_once_every_stage_is_on_disk_never_after_a_failed_one():
    """The coordinator's part before the committer: an iteration's stages reported one by
    one (in any order, two iterations interleaved) give the whole iteration's checksums
    at the last of them, once; a stage that could not be written keeps its iteration from
    ever being committed; and what is half gathered survives the books' round trip (a
    successor gathers the rest)."""
    from spotpipe.cluster.checkpoint_parts import CheckpointParts

    three = ((0, 2), (2, 4), (4, 6))
    parts = CheckpointParts()
    assert parts.saved(10, 2, {"stage2/a": "c"}, three) is None
    assert parts.saved(20, 0, {"stage0/a": "x"}, three) is None
    assert parts.saved(10, 0, {"stage0/a": "a"}, three) is None
    parts.fail(20)
    successor = CheckpointParts.from_json(json.loads(json.dumps(parts.to_json())))
    assert successor.saved(20, 1, {"stage1/a": "y"}, three) is None  # failed: never
    assert successor.saved(10, 1, {"stage1/a": "b", "stage1/b": "b2"}, three) == {
        "stage0/a": "a", "stage1/a": "b", "stage1/b": "b2", "stage2/a": "c"}
    assert successor.parts == {} and successor.partitions == {} and successor.failed == {20}
    assert successor.saved(20, 2, {"stage2/a": "z"}, three) is None


def test_a_checkpoint_is_cut_by_the_partition_its_stages_were_written_under():
    """An asynchronous write (dcp_async) or an upload is reported after the boundary it was
    taken at, and a re-partition (4 stages to 3) can come in between: three of the four
    stages reported is not the whole checkpoint, and the fourth completes it, under the
    partition the four were written with (the job's is another by then)."""
    from spotpipe.cluster.checkpoint_parts import CheckpointParts

    four = ((0, 2), (2, 4), (4, 6), (6, 8))
    parts = CheckpointParts()
    for stage in range(3):
        assert parts.saved(7, stage, {f"stage{stage}/a": str(stage)}, four) is None
    assert parts.saved(7, 3, {"stage3/a": "3"}, four) == {
        f"stage{s}/a": str(s) for s in range(4)}
    with pytest.raises(ValueError, match="written under partition"):
        parts.saved(8, 0, {"stage0/a": "0"}, four)
        parts.saved(8, 1, {"stage1/a": "1"}, ((0, 3), (3, 6), (6, 8)))


def test_a_commit_that_raises_anything_fails_its_iteration_and_the_thread_goes_on(
        tmp_path, monkeypatch):
    """Not only the disk's errors: whatever a commit raises is that iteration's failure (an
    event), and the commits behind it are still made, so the committer becomes idle again
    (a coordinator's hand-over waits for that)."""
    root = tmp_path / "ckpt"
    real = durable.commit

    def commit(root, iteration, *args, **kwargs):
        if iteration == 1:
            raise AttributeError("'list' object has no attribute 'get'")
        return real(root, iteration, *args, **kwargs)

    monkeypatch.setattr(durable, "commit", commit)
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)
    committer.submit(1, {"stages": 1}, _written(root, 1))
    committer.submit(2, {"stages": 1}, _written(root, 2))
    done = committer.close()
    assert [(c.iteration, c.path is not None, c.error) for c in done] == [
        (1, False, "commit: AttributeError: 'list' object has no attribute 'get'"),
        (2, True, "")]
    assert committer.idle()
    assert durable.newest(root).manifest["iteration"] == 2


def test_a_commit_with_a_newer_one_ready_behind_it_leaves_retention_to_it(tmp_path,
                                                                           monkeypatch):
    """Commits that come faster than they run (each one's retention hashes every checkpoint
    it keeps) do not each pay for retention: one with a newer checkpoint ready behind it (no
    step of that one under way or failed) is made without it, and the newest applies it.
    Worked out by hand, keep = 2, the thread held until every item is queued: commit 1 has 2
    and 4 ready behind it (3's upload fails, or is still under way: it cannot count either
    way), commit 2 has 4; 3 fails with its upload; 4 has none behind it and applies
    retention once, which keeps 4 and 2."""
    root = tmp_path / "ckpt"
    retained: list[list[str]] = []
    real = durable.retain

    def retain(*args, **kwargs):
        retained.append(sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")))
        return real(*args, **kwargs)

    monkeypatch.setattr(durable, "retain", retain)
    committer = Committer(root, keep=2, key=KEY, now=lambda: 0.0)
    held, third = threading.Event(), threading.Event()
    committer.submit_step(1, lambda: "" if held.wait(30) else "never released")
    committer.submit(1, {"stages": 1}, _written(root, 1))
    committer.submit(2, {"stages": 1}, _written(root, 2))
    committer.submit_step(3, lambda: "it arrived damaged" if third.wait(30) else "stuck")
    committer.submit(3, {"stages": 1}, _written(root, 3))
    committer.submit(4, {"stages": 1}, _written(root, 4))
    third.set()
    held.set()
    done = committer.close()
    assert [(c.iteration, c.path is not None, c.error, c.retention_left_to) for c in done] == [
        (1, True, "", (2, 4)), (2, True, "", (4,)), (3, False, "it arrived damaged", ()),
        (4, True, "", ())]
    assert retained == [["iter_00000001", "iter_00000002", "iter_00000004"]]  # once, at 4
    assert sorted(p.name for p in root.iterdir()) == ["iter_00000002", "iter_00000004",
                                                      "latest"]


def test_a_commit_that_left_retention_to_a_newer_one_stays_when_that_one_fails(tmp_path):
    """The newer checkpoint ready behind it fails to commit (a stage file it lists is not
    there): the one before it was committed all the same, and is the checkpoint to go back
    to, even at keep = 1."""
    root = tmp_path / "ckpt"
    committer = Committer(root, keep=1, key=KEY, now=lambda: 0.0)
    held = threading.Event()
    committer.submit_step(1, lambda: "" if held.wait(30) else "never released")
    committer.submit(1, {"stages": 1}, _written(root, 1))
    committer.submit(2, {"stages": 1}, {"stage0/gone.bin": "0" * 64})
    held.set()
    done = committer.close()
    assert [(c.iteration, c.path is not None, c.retention_left_to) for c in done] == [
        (1, True, (2,)), (2, False, ())]
    assert "stage file(s) listed but not in" in done[1].error
    assert durable.newest(root) is not None and durable.newest(root).next_iteration == 2


def _intake(stages: int, partition: list[tuple[int, int]], events: list[dict]):
    """The coordinator's checkpoint intake with no store and no processes: only its books,
    its events, and what it hands the committer (`intake.committer` is replaced by a fake)."""
    from types import SimpleNamespace

    from spotpipe.cluster.checkpoint_intake import CheckpointIntake

    from conftest import tiny_config

    return CheckpointIntake(tiny_config("unused", stages=stages, pipelines=1),
                            SimpleNamespace(num_samples=100, partition=partition),
                            Path("unused"), KEY, lambda: 1.0, events.append)


def test_commit_outcomes_are_events():
    """What the loop writes of each outcome; a commit that left its retention to newer ones
    says which (the commits are behind)."""
    from spotpipe.cluster.committer import Committed

    events: list[dict] = []
    _intake(2, [(0, 4), (4, 8)], events).record([
        Committed(10, 1.0, path=Path("a"), retention_left_to=(20, 30)),
        Committed(20, 2.0, path=Path("b")), Committed(30, 3.0, error="commit: disk full")])
    assert [(e["kind"], e["iteration"], e.get("retention_left_to")) for e in events] == [
        ("checkpoint_committed", 10, [20, 30]), ("checkpoint_committed", 20, None),
        ("checkpoint_failed", 30, None)]
    assert events[2]["message"] == "commit: disk full"


def test_the_job_loop_commits_by_the_partition_the_stages_report():
    """The job has been re-partitioned to 3 stages when the reports of a checkpoint written
    by 4 come in; it is committed once all 4 are, cut as they were."""
    from types import SimpleNamespace

    from spotpipe.protocol import CheckpointSaved

    intake = _intake(4, [(0, 2), (2, 4), (4, 6), (6, 8)], [])
    submitted: list[tuple[int, dict]] = []
    intake.committer = SimpleNamespace(submit=lambda t, info, sums: submitted.append((t, info)))
    four = ((0, 2), (2, 4), (4, 6), (6, 8))
    for stage in range(4):
        intake.saved(CheckpointSaved("node0", 0.0, 7, stage, {f"stage{stage}/a": "x"}, four))
        assert len(submitted) == (1 if stage == 3 else 0)
    assert submitted[0][0] == 7
    assert submitted[0][1]["partition"] == [list(r) for r in four]
    assert submitted[0][1]["stages"] == 4


@pytest.mark.parametrize("name", ["stage0/a", "manifest.json", "stage1/../../outside"])
def test_a_stage_that_reports_a_file_outside_its_folder_fails_its_checkpoint(name):
    """Stage 1 reports a file of stage 0, the manifest's place, or a way out of the
    checkpoint: its iteration is never committed and the event names the file (the commit
    listed it as stage 1's, over stage 0's own, or a file outside the checkpoint)."""
    from types import SimpleNamespace

    from spotpipe.protocol import CheckpointSaved

    events: list[dict] = []
    intake = _intake(2, [(0, 4), (4, 8)], events)
    submitted: list[int] = []
    intake.committer = SimpleNamespace(submit=lambda t, info, sums: submitted.append(t))
    two = ((0, 4), (4, 8))
    intake.saved(CheckpointSaved("node0", 0.0, 7, 0, {"stage0/a": "x"}, two))
    intake.saved(CheckpointSaved("node1", 0.0, 7, 1, {name: "y"}, two))
    assert submitted == [] and 7 in intake.parts.failed
    [event] = events
    assert event["kind"] == "checkpoint_failed" and event["iteration"] == 7
    assert event["message"] == ("checkpoint of iteration 7: stage 1 reported a file outside "
                                f"its folder stage1/: {name!r}")


def test_a_stage_upload_in_another_nodes_name_is_refused():
    """Only a node announces its own stage (as only it announces its final parameters): a
    receive started in another's name would be ended by that node's loss, not its sender's."""
    from types import SimpleNamespace

    from spotpipe.cluster.jobloop import JobLoop
    from spotpipe.plan import Layout
    from spotpipe.protocol import StageUpload

    loop = JobLoop.__new__(JobLoop)  # (no store, no processes: only its dispatch)
    loop._received = 0
    events: list[dict] = []
    refused: list[tuple[str, str]] = []
    steps: list[int] = []
    loop.files = SimpleNamespace(event=events.append)
    loop.coordinator = SimpleNamespace(refused=lambda writer, why: refused.append((writer, why)))
    loop.intake = _intake(1, [(0, 8)], events)
    loop.intake.ran(0, Layout.from_mapping(2, 1, {(0, 0): "node0", (0, 1): "node1"}))
    loop.intake.open(SimpleNamespace(), lambda: SimpleNamespace())
    loop.intake.committer = SimpleNamespace(submit_step=lambda t, run: steps.append(t))
    upload = StageUpload("node1", 0.0, 4, 1, {"stage1/a": "x"})
    loop._handle_record(SimpleNamespace(message=upload, writer="node2"))
    assert (steps, events) == ([], [])
    assert refused == [("node2", "a stage_upload in the name of node1")]
    loop._handle_record(SimpleNamespace(message=upload, writer="node1"))
    assert steps == [4] and [e["kind"] for e in events] == ["checkpoint_upload"]


@pytest.mark.parametrize("entry", ["absolute", "../outside.bin", "stage0/../../outside.bin",
                                   "stage0/link", "manifest.json"])
def test_commit_refuses_a_checksum_entry_outside_the_checkpoint_writing_nothing(tmp_path,
                                                                                entry):
    """`durable.commit` is public and the last line of defence: an entry that names a file
    outside the checkpoint folder (absolute, `..`, a symlink out) or the manifest's own place
    is refused naming it, before the manifest is written or anything renamed."""
    root = tmp_path / "ckpt"
    checksums = _written(root, 1)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the job's")
    partial = durable.iter_dir(root, 1, partial=True)
    (partial / "stage0" / "link").symlink_to(outside)
    (partial / "manifest.json").write_text("{}")  # (what a listed manifest would hash)
    name = str(outside) if entry == "absolute" else entry
    sums = {**checksums, name: hashlib.sha256(b"not the job's").hexdigest()}
    with pytest.raises(ValueError, match=f"checkpoint 1: .*{re.escape(repr(name))}"):
        durable.commit(root, 1, {"stages": 1}, sums, keep=2, key=KEY)
    assert sorted(p.name for p in root.iterdir()) == [partial.name]  # no iter_1, no latest
    assert (partial / "manifest.json").read_text() == "{}"
    assert outside.read_bytes() == b"not the job's"


def _dispatching_loop(stages: int, events: list[dict], refused: list[tuple[str, str]],
                      layouts: list[tuple[int, object]]):
    """The job loop's dispatch of checkpoint records with no store and no processes: its
    coordinator a fake whose history is the last of `layouts` (the first iteration each ran,
    the layout), which the loop is told of one by one, as its turns would."""
    from types import SimpleNamespace

    from spotpipe.cluster.jobloop import JobLoop

    loop = JobLoop.__new__(JobLoop)
    loop._received = 0
    loop.files = SimpleNamespace(event=events.append)
    loop.coordinator = SimpleNamespace(
        refused=lambda writer, why: refused.append((writer, why)))
    loop.intake = _intake(stages, [(2 * s, 2 * s + 2) for s in range(stages)], events)
    for first, layout in layouts:
        loop.coordinator.history = SimpleNamespace(resumed_at=first, layout=layout)
        loop._note_layout()
    return loop


def test_a_checkpoint_stage_reported_by_a_node_that_did_not_write_it_is_refused():
    """Each stage of a checkpoint counts only from the node that owned it (pipeline 0) in
    the layout that ran the iteration, in its own name (or from the shadow of that stage):
    node1 owned stage 1 up to iteration 9, node2 from 10 on (after a failover). A report in
    another's name, or of a stage its sender did not own for that iteration, is refused
    (named) and does not count: the commit waits for the true owner's."""
    from types import SimpleNamespace

    from spotpipe.plan import Layout
    from spotpipe.protocol import CheckpointSaved, StageUpload

    before = Layout.from_mapping(2, 1, {(0, 0): "node0", (0, 1): "node1"})
    after = Layout.from_mapping(2, 1, {(0, 0): "node0", (0, 1): "node2"})
    events: list[dict] = []
    refused: list[tuple[str, str]] = []
    loop = _dispatching_loop(2, events, refused, [(0, before), (10, after)])
    submitted: list[int] = []
    steps: list[int] = []
    loop.intake.committer = SimpleNamespace(submit=lambda t, info, sums: submitted.append(t),
                                            submit_step=lambda t, run: steps.append(t))
    loop.intake.open(SimpleNamespace(), lambda: SimpleNamespace())
    two = ((0, 2), (2, 4))

    def saved(writer: str, node: str, t: int, stage: int) -> None:
        message = CheckpointSaved(node, 0.0, t, stage, {f"stage{stage}/a": writer}, two)
        loop._handle_record(SimpleNamespace(message=message, writer=writer))

    saved("node0", "node0", 9, 0)
    saved("node2", "node1", 9, 1)  # in another node's name
    saved("node2", "node2", 9, 1)  # node2 took stage 1 over only from iteration 10
    saved("node0", "node0", 9, 1)  # not its stage
    loop._handle_record(SimpleNamespace(
        message=StageUpload("node2", 0.0, 9, 1, {"stage1/a": "x"}), writer="node2"))
    assert submitted == [] and steps == []
    assert refused == [
        ("node2", "a checkpoint_saved in the name of node1"),
        ("node2", "a checkpoint_saved of stage 1 of iteration 9, which node1 wrote"),
        ("node0", "a checkpoint_saved of stage 1 of iteration 9, which node1 wrote"),
        ("node2", "a stage_upload of stage 1 of iteration 9, which node1 wrote")]
    assert [e["node"] for e in events if e["kind"] == "checkpoint_saved"] == ["node0"]
    saved("node1", "node1", 9, 1)  # the owner's: the checkpoint of 9 is whole
    assert submitted == [9]
    saved("shadow0", "shadow0", 11, 0)  # a stage's shadow writes that stage
    saved("node2", "node2", 11, 1)
    assert submitted == [9, 11]
    saved("node1", "node1", 13, 1)  # (node1 owns no stage from 10 on)
    saved("shadow0", "shadow0", 13, 1)
    assert refused[4:] == [
        ("node1", "a checkpoint_saved of stage 1 of iteration 13, which node2 wrote"),
        ("shadow0", "a checkpoint_saved of stage 1 of iteration 13, which node2 wrote")]
    assert 13 not in loop.intake.parts.parts


def test_the_writers_of_checkpoints_are_kept_for_a_bounded_number_of_layouts():
    """A roll back replaces the layouts from where it resumes; the books carry the writers to
    a successor; only the newest KEPT_LAYOUTS are kept."""
    from spotpipe.cluster.checkpoint_parts import KEPT_LAYOUTS, CheckpointParts

    parts = CheckpointParts()
    parts.ran(0, ("a", "b"))
    parts.ran(10, ("a", "c"))
    parts.ran(10, ("a", "c"))  # (noted again at the next turn: nothing changes)
    assert [parts.writer_of(t, 1) for t in (0, 9, 10, 99)] == ["b", "b", "c", "c"]
    assert parts.writer_of(9, 2) is None and parts.writer_of(9, -1) is None
    parts.ran(5, ("d", "b"))  # rolled back to 5: what ran from 10 on is run again
    assert parts.writers == [(0, ("a", "b")), (5, ("d", "b"))]
    successor = CheckpointParts.from_json(json.loads(json.dumps(parts.to_json())))
    assert successor.writers == parts.writers
    for first in range(6, 6 + 2 * KEPT_LAYOUTS):
        parts.ran(first, (f"n{first}",))
    assert len(parts.writers) == KEPT_LAYOUTS and parts.writer_of(first, 0) == f"n{first}"
    assert parts.writer_of(6, 0) is None  # too old: refused, never guessed


def test_a_stage_uploaded_while_more_receives_than_the_floor_wait_is_taken_at_once(tmp_path):
    """Every host streams its stage at once and each sender waits for its pieces to be
    taken: a receive queued behind UPLOADS_AT_ONCE others (here held on purpose) left its
    sender waiting for its first acknowledgement until its timeout, and the checkpoint was
    lost. The receives run side by side for as many stages as the job can upload at once."""
    from datetime import timedelta

    import torch.distributed as dist

    from spotpipe.checkpoint import transfer
    from spotpipe.cluster.committer import UPLOADS_AT_ONCE
    from spotpipe.protocol import StageUpload
    from spotpipe.store.sealed import SealedStore

    stages = UPLOADS_AT_ONCE + 1
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))

    def connect() -> SealedStore:
        return SealedStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                         timeout=timedelta(seconds=30)), KEY)

    events: list[dict] = []
    intake = _intake(stages, [(s, s + 1) for s in range(stages)], events)
    intake.committer.root = intake.root = tmp_path / "ckpt"
    intake.open(connect(), connect)
    release = threading.Event()
    for _ in range(UPLOADS_AT_ONCE):  # the other hosts' receives, still taking their pieces
        intake.committer.submit_step(1, lambda: "" if release.wait(60) else "never released")
    last = stages - 1
    sent = tmp_path / "sender" / f"stage{last}"
    sent.mkdir(parents=True)
    (sent / "x.bin").write_bytes(b"the last stage")
    checksums = {f"stage{last}/x.bin": hashlib.sha256(b"the last stage").hexdigest()}
    intake.upload(StageUpload(f"node{last}", 0.0, 1, last, checksums))
    try:  # (its sender's wait for the stage to be taken: seconds where it is not queued)
        assert transfer.send_stage(connect(), 1, last, sent.parent, checksums,
                                   timeout_s=5) == len(b"the last stage")
    finally:
        release.set()
    intake.end(abandon=False)
    assert events == []  # no receive failed
    got = durable.iter_dir(tmp_path / "ckpt", 1, partial=True) / f"stage{last}" / "x.bin"
    assert got.read_bytes() == b"the last stage"


@pytest.mark.parametrize("stage", [2, -1])
def test_a_stage_outside_its_partition_fails_its_checkpoint_instead_of_completing_it(stage):
    """A checkpoint of 2 stages is whole once stages 0 and 1 are in: a report of stage 2 (or
    -1) under that partition is no stage of it, and counted it completed the checkpoint
    without stage 1 (committed, then unloadable: no folder holds stage 1's layers)."""
    from spotpipe.cluster.checkpoint_parts import CheckpointParts

    parts = CheckpointParts()
    two = ((0, 4), (4, 8))
    assert parts.saved(7, 0, {"stage0/a": "x"}, two) is None
    with pytest.raises(ValueError, match=f"stage {stage} .*not a stage of the partition"):
        parts.saved(7, stage, {f"stage{stage}/a": "y"}, two)
    assert list(parts.parts[7]) == [0]


def test_a_commit_whose_files_differ_from_their_checksums_fails_and_keeps_the_one_before(
        tmp_path):
    """The checksums are the writers' reports; a file that differs on disk (damaged, or
    written over since) made a checkpoint that was said committed and never verified. The
    commit that applies retention checks the files before the rename (retention hashed
    them just after it anyway): the error names the file, and the one before stays newest."""
    root = tmp_path / "ckpt"
    durable.commit(root, 1, {"stages": 1}, _written(root, 1), keep=2, key=KEY)
    checksums = _written(root, 2)
    (durable.iter_dir(root, 2, partial=True) / "stage0" / "x.bin").write_bytes(b"other")
    with pytest.raises(durable.CheckpointError, match="stage0/x.bin: checksum mismatch"):
        durable.commit(root, 2, {"stages": 1}, checksums, keep=2, key=KEY)
    assert not durable.iter_dir(root, 2).exists()
    assert durable.newest(root).iteration == 1
