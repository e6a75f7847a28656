"""The protocol: typed messages and their seals, and a job that a process without the token
cannot steer or crash through the store."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault
from spotpipe.protocol import (Abort, AgentArrival, ArrivalsClosed, Assignment, Channel,
                               DecisionRecord, Exit, Heartbeat, JobOver, MessageError, Refused,
                               Report, ReplayGuard, from_plain, job_key, keys, parse, plain,
                               same_secret, vouch, vouched)
from spotpipe.store import board

from conftest import tiny_config
from test_failover import FAST, assert_samples_exactly_once, events, failure_free


def test_messages_round_trip_and_refuse_what_does_not_match():
    report = Report(node="node1", generation=2, boundary=False, iteration=5, position=3,
                    instruction="F1.2", committed_through=4, stepped_through=4,
                    done=(("forward", 1, 0),), clip_scale=None, flight=5, formed=True,
                    lacking=(), untouched=True, replica=None, leaving=False, reason="peer lost",
                    time_s=1.5)
    body = json.loads(json.dumps(report.to_json()))
    assert parse("report", 1, body) == report
    with pytest.raises(MessageError, match="missing field 'iteration'"):
        parse("report", 1, {k: v for k, v in body.items() if k != "iteration"})
    with pytest.raises(MessageError, match="report.iteration: expected an integer"):
        parse("report", 1, {**body, "iteration": "5"})
    with pytest.raises(MessageError, match="unknown version 2"):
        parse("report", 2, body)
    with pytest.raises(MessageError, match="unknown field"):
        parse("report", 1, {**body, "extra": 1})
    with pytest.raises(MessageError, match="finite number"):
        parse("report", 1, {**body, "time_s": float("nan")})
    with pytest.raises(MessageError, match="unknown message type"):
        parse("nonsense", 1, {})


@pytest.mark.parametrize("rows, problem", [
    ([[0, 2, 3]], r"partition\[0\]: expected 2 items, got 3"),
    ([[0]], r"partition\[0\]: expected 2 items, got 1"),
    ([[0, "2"]], r"partition\[0\]\[1\]: expected an integer")])
def test_a_fixed_length_tuple_field_is_refused_at_another_length(rows, problem):
    """A checkpoint's partition is layer ranges, (start, end) each: a row of another length
    opened as one (only its first item's type was checked) and reached the manifest, where a
    resume failed on it."""
    from spotpipe.protocol import CheckpointSaved

    saved = CheckpointSaved("node0", 0.0, 7, 0, {"stage0/a": "x"}, ((0, 2), (2, 4)))
    body = json.loads(json.dumps(saved.to_json()))
    assert parse("checkpoint_saved", 1, body) == saved
    with pytest.raises(MessageError, match=f"checkpoint_saved.{problem}"):
        parse("checkpoint_saved", 1, {**body, "partition": rows})


def test_seals_bind_key_writer_generation_and_sequence():
    key = job_key("tøken ✓".encode(), "inst")  # any bytes make a token
    assert job_key("tøken ✓".encode(), "inst") == key
    assert job_key("tøken ✓".encode(), "other run") != key  # a key is worth one run only
    writer = Channel(key, "node3")
    at = keys.heartbeat("node3")
    blob = writer.seal(Heartbeat("node3", "busy", 4, 9, 2), 4, at=at)
    assert b"t\xc3\xb8ken" not in blob  # the token never travels
    guard = ReplayGuard()
    opened = Channel(key, "coordinator").open(blob, at=at, guard=guard)
    assert opened.writer == "node3" and opened.generation == 4
    with pytest.raises(Refused, match="replay"):
        Channel(key, "coordinator").open(blob, at=at, guard=guard)
    with pytest.raises(Refused, match="bad MAC"):
        Channel(job_key(b"guess", "inst"), "x").open(blob, at=at)
    tampered = blob.replace(b'"gen":4', b'"gen":5')
    with pytest.raises(Refused, match="bad MAC"):
        Channel(key, "coordinator").open(tampered, at=at)
    # a genuine record is worth nothing under another key: another node's, another board's
    for elsewhere in (keys.heartbeat("node0"), keys.board_slot(keys.decision_board(4), 1)):
        with pytest.raises(Refused, match="a copy"):
            Channel(key, "coordinator").open(blob, at=elsewhere)
    moved = blob.replace(at.encode(), keys.heartbeat("node0").encode())
    with pytest.raises(Refused, match="bad MAC"):
        Channel(key, "coordinator").open(moved, at=keys.heartbeat("node0"))
    with pytest.raises(Refused, match="older than"):
        Channel(key, "coordinator").open(blob, at=at, min_generation=5)
    with pytest.raises(Refused, match="may not write"):
        Channel(key, "node0").open(blob, at=at, writers={"coordinator"})
    assert same_secret("sésame", "sésame".encode()) and not same_secret(b"a", b"b")


def test_rendezvous_records_are_typed_and_vouched_for_by_the_token():
    """The agents' rendezvous travels unsealed (no job key exists yet): each record is typed,
    and those a party acts on carry a proof that binds the token, the key and the body."""
    key = "job1/spotpipe/rdzv/assign/3"
    answer = vouch(Assignment(ranks=(2, 3), world=4), "sesame", key)
    blob = plain(answer)
    assert from_plain(blob, Assignment) == answer and b"sesame" not in blob
    assert vouched(answer, "sesame", key)
    assert not vouched(answer, "guess", key)  # another token
    assert not vouched(answer, "sesame", "job1/spotpipe/rdzv/assign/4")  # another agent's slot
    assert not vouched(replace(answer, ranks=(0, 1)), "sesame", key)  # the body changed
    for bad, why in ((b"\xff", "not a JSON record"), (b"[1]", "no type or version"),
                     (plain(JobOver("failed")), "'job_over' record where assignment belongs"),
                     (json.dumps({"type": "assignment", "ver": 1, "body": {"ranks": "x"}}),
                      "assignment.ranks: expected a list")):
        with pytest.raises(MessageError, match=why):
            from_plain(bad, Assignment)
    arrival = AgentArrival("host", 1, -1, "", "m", "c")
    assert from_plain(plain(arrival), AgentArrival, ArrivalsClosed) == arrival


def _store_of(run) -> dist.TCPStore:
    launch = events(run)[0]
    host, port = launch["store"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _training(tmp_path, corpus, pipelines: int, iterations: int, crash: str,
              crash_at: int = 40, trained: bool = True):
    """A P = 2 job (lazy redundancy) training on a thread, `crash` killed at iteration
    `crash_at`; returns once it has completed an iteration (`trained`), else once its store
    is up. (The tiny job runs about 7 ms an iteration since pipeline channels went through
    shared memory: what a test does while it runs needs iterations enough for a loaded
    machine.)"""
    cfg = tiny_config(corpus, stages=2, pipelines=pipelines, redundancy="lazy",
                      **{**FAST, "iterations": iterations, "logging.sample_log": True})
    run = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(code=train(
        cfg, run, progress=False, faults=[Fault("fail", crash, crash_at)])))
    job.start()
    if trained:
        _wait_for(lambda: (run / "metrics.jsonl").exists()
                  and (run / "metrics.jsonl").read_text().strip(), 120, "the job to train")
    else:
        _wait_for(lambda: (run / "events.jsonl").exists()
                  and (run / "events.jsonl").read_text().strip(), 120, "the job's store")
    return cfg, run, job, result


def _refusals(run) -> list[dict]:
    return [e for e in events(run) if e["kind"] == "record_refused"]


def test_forged_records_are_refused_and_the_job_is_undisturbed(tmp_path, tmp_path_factory,
                                                                corpus, monkeypatch):
    """A process with the store's address but not the token writes a fake exit, a forged
    decision and abort, a stale heartbeat, a report, and a valid record replayed where it does
    not belong: each is refused with an event; the job (one real crash at iteration 40) ends
    bit-identical to the run without failures."""
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "sesame")
    # long enough for the replays below to meet a coordinator read (see there): the stale
    # heartbeat is refused 0.7 s into the job, against 5 s or more of its 500 iterations
    iters = 500
    cfg, run, job, result = _training(tmp_path, corpus, 1, iters, "node1")
    store = _store_of(run)
    forger = Channel(job_key(b"a guess", "any"), "node0")  # a key, but not the job's
    # a fake exit: unsealed, and sealed under the wrong key
    board.post(store, keys.MAILBOX, lambda _: json.dumps({"type": "exit", "node": "node0",
                                                          "code": -9}).encode(),
               count_key=keys.MAILBOX_COUNT)
    board.post(store, keys.MAILBOX, lambda at: forger.seal(Exit("node0", -9), at=at),
               count_key=keys.MAILBOX_COUNT)
    # a forged report of generation 0, and a forged decision and abort for generation 0,
    # posted before the coordinator's own
    board.post(store, keys.MAILBOX, lambda at: forger.seal(Report(
        node="node0", generation=0, boundary=False, iteration=0, position=0, instruction="",
        committed_through=-1, stepped_through=-1, done=(), clip_scale=None, flight=-1,
        formed=True, lacking=(), untouched=True, replica=None, leaving=True, reason="forged",
        time_s=0.0), at=at), count_key=keys.MAILBOX_COUNT)
    board.post(store, keys.decision_board(0),
               lambda at: forger.seal(DecisionRecord(0, {"action": "stop"}), at=at))
    board.post(store, keys.abort_board(0), lambda at: forger.seal(Abort(0, "forged abort"), at=at))
    # a valid record (node0's own heartbeat) replayed where it does not belong: the mailbox
    valid = store.get(keys.heartbeat("node0"))
    board.post(store, keys.MAILBOX, lambda _: valid, count_key=keys.MAILBOX_COUNT)
    # a stale heartbeat: node0's valid beat written back over a newer one just after it, so
    # that it stands for most of a beat's period, whatever the phase of the coordinator's
    # reads; only after every third beat, so that the coordinator still sees the real beats
    # (a replay over every beat would hide them all and fence node0: a store writer can always
    # deny service, but must not steer). Until the coordinator says it refused one (a real
    # condition: its event).
    period = cfg.failover.heartbeat_s
    newest = valid
    beats = 0

    def stale_refused() -> bool:
        nonlocal newest, beats
        _wait_for(lambda: store.get(keys.heartbeat("node0")) not in (newest, valid), 30,
                  "a newer beat")
        newest = store.get(keys.heartbeat("node0"))
        beats += 1
        if beats % 3 == 0:
            time.sleep(period / 40)  # where in the beat's period the replay lands, not a wait
            store.set(keys.heartbeat("node0"), valid)
        return any("heartbeat: a replay" in e["reason"] for e in _refusals(run))

    _wait_for(stale_refused, 60, "the stale heartbeat's refusal")
    job.join()
    assert result["code"] == 0
    refused = _refusals(run)
    reasons = " | ".join(e["reason"] for e in refused)
    assert "no MAC" in reasons and "bad MAC" in reasons and "heartbeat: a replay" in reasons
    # (a heartbeat is sealed for its own key: in the mailbox it is a copy)
    assert "mailbox: a copy: sealed for 'spotpipe/hb/node0'" in reasons
    # the forged decision and abort were skipped by the survivors (their own events)
    assert any("writer" in e and "bad MAC" in e["reason"] for e in refused)
    # node0, whose beats the forger replayed, is never fenced. node1 may be: its crash is a
    # SIGKILL to itself, and on a loaded machine its teardown can outlast the 2 s hang timeout
    # while its last beat said it computed (seen with two busy loops beside the test: fenced
    # 2.2 s after the kill, 4 ms before its exit was reported); the outcome is the same
    fenced = [e["node"] for e in events(run) if e["kind"] == "node_fenced"]
    assert set(fenced) <= {"node1"}, fenced
    assert [e["action"] for e in events(run) if e["kind"] == "plan"] == ["failover"]
    assert [e["node"] for e in events(run) if e["kind"] == "node_lost"] == ["node1"]
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, cfg)
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the token is nowhere in the run's files
    for path in run.rglob("*"):
        if path.is_file():
            assert b"sesame" not in path.read_bytes(), path


def test_squatted_group_addresses_are_refused_and_the_job_is_undisturbed(tmp_path,
                                                                         tmp_path_factory,
                                                                         corpus, monkeypatch):
    """A process with the store's address but not the token writes an address of its own for
    every rank of the next generations' process groups (world and data-parallel) before they
    form. The groups form with the genuine addresses (gloo would otherwise connect to the
    forger's), every rendezvous record in the store is sealed, and the job (one real crash at
    iteration 60, P = 2 x D = 2) ends bit-identical to the run without failures."""
    from spotpipe.store.sealed import TAG

    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "sesame")
    # the squats must land before the crash's regroup: written as soon as the store is up,
    # before the job has formed its first generation, 60 iterations before the crash
    cfg, run, job, result = _training(tmp_path, corpus, 2, 100, "node3", crash_at=60,
                                      trained=False)
    store = _store_of(run)
    forged = b"forged: the forger's own gloo address"
    squatted = [f"spotpipe/gen{g}/{group}/0/{r}" for g in (1, 2)
                for group in ("world", "dp0", "dp1") for r in range(4)]
    for key in squatted:
        store.set(key, forged)
    assert store.check(squatted)  # landed (a set does not wait for the server)
    _wait_for(lambda: any(e["kind"] == "plan" for e in events(run)), 120, "the failover")
    # the survivors formed generation 1 over the squatted keys: what stands there now is theirs
    # (each rank writes its own: wait for all three survivors', not for one of them, which
    # CI once found written while rank 1's was not yet)
    survivors = [f"spotpipe/gen1/world/0/{r}" for r in range(3)]
    _wait_for(lambda: all(store.get(k) != forged for k in survivors), 120,
              "generation 1's groups")
    formed = [k for k in squatted if k.startswith("spotpipe/gen1/") and store.get(k) != forged]
    assert set(survivors) <= set(formed), formed
    assert all(store.get(k).startswith(TAG) for k in formed)
    job.join()
    assert result["code"] == 0
    assert [e["action"] for e in events(run) if e["kind"] == "plan"][0] == "failover"
    # a survivor that read a squatted address before its rank wrote over it said so
    for refusal in _refusals(run):
        assert "no seal" in refusal["reason"] and "/gen" in refusal["reason"], refusal
    assert "node_fenced" not in [e["kind"] for e in events(run)]
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, cfg)
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
