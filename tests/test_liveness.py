"""Liveness that depends on neither clocks nor luck, and nothing that grows per generation."""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault
from spotpipe.store import mailbox
from spotpipe.store.watchers import KEEP, OPENERS

from conftest import tiny_config
from procs import workers_of
from test_failover import (FAST, assert_samples_exactly_once, config, events, failure_free)


def _exact(run, want) -> bool:
    got = load_file(str(run / "final" / "model.safetensors"))
    return all(torch.equal(got[k], want[k]) for k in want)


def test_clock_skew_neither_fences_nor_hides_a_node(tmp_path, tmp_path_factory, corpus,
                                                    monkeypatch):
    """node0's clock runs 30 s ahead, node2's 30 s behind: no one is fenced, and node1's
    crash is still found and taken over."""
    monkeypatch.setenv("SPOTPIPE_TEST_CLOCK_OFFSET", "node0=30,node2=-30")
    cfg = config(corpus, 3, 1, iterations=8)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault("fail", "node1", 4)]) == 0
    kinds = [e["kind"] for e in events(run)]
    assert "node_fenced" not in kinds
    assert [e["node"] for e in events(run) if e["kind"] == "node_lost"] == ["node1"]
    assert [e["action"] for e in events(run) if e["kind"] == "plan"][0] == "failover"
    assert_samples_exactly_once(run, cfg)
    assert _exact(run, failure_free(tmp_path_factory, config(corpus, 3, 1, iterations=8)))


def test_a_starved_replica_update_does_not_hide_an_abort(tmp_path, tmp_path_factory, corpus,
                                                         monkeypatch):
    """node0's replica updates are held back 2 s each (an idle-priority thread without CPU)
    while replica.max_lag makes node0 wait for them, longer than the hang timeout: node0 is
    waiting, not hung, so it is not fenced; and when node1 crashes, it answers the abort."""
    # (a hang timeout long enough that a busy worker on a loaded 2-core machine is not hung,
    # and still shorter than each held-back update)
    monkeypatch.setenv("SPOTPIPE_TEST_REPLICA_DELAY", "node0=2.0")
    extra = {"replica.max_lag": 1, "failover.hang_timeout_s": 1.2, "iterations": 6}
    cfg = config(corpus, 2, 1, **extra)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault("fail", "node1", 4)]) == 0
    kinds = [e["kind"] for e in events(run)]
    assert "node_fenced" not in kinds, [e for e in events(run) if e["kind"] == "node_fenced"]
    assert [e["action"] for e in events(run) if e["kind"] == "plan"] == ["failover"]
    assert_samples_exactly_once(run, cfg)
    assert _exact(run, failure_free(tmp_path_factory, config(corpus, 2, 1, **extra)))


def _counts(pid: int) -> tuple[int, int, int]:
    """(threads, open files, sockets) of a process, from /proc."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return threads, len(fds), sockets


def _store_keys(run, store: dist.Store | None) -> tuple[dist.Store | None, int | None]:
    """A client of the job's store (connected on first call, and again after one that
    failed), and how many keys the store holds."""
    try:
        if store is None:
            host, port = events(run)[0]["store"].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=timedelta(seconds=10))
        return store, store.num_keys()
    except (OSError, RuntimeError, KeyError, IndexError, ValueError):  # not up, or gone
        return None, None


def test_two_hundred_generations_leave_nothing_behind(tmp_path, corpus, monkeypatch):
    """Every iteration ends its generation (a regroup at each boundary), 200 times, with a
    crash and a joiner among them: a surviving worker's and the launcher's threads, open files
    and sockets, and the keys in the job's store, stay under a fixed bound, the same late in
    the run as early."""
    monkeypatch.setenv("SPOTPIPE_TEST_REGROUP_EVERY_ITERATION", "1")
    # the mailbox's read slots kept before they are deleted: reached by generation 20
    monkeypatch.setattr(mailbox, "KEPT_READ", 64)
    # a regroup asked during an iteration ends its generation at the next boundary: two
    # iterations a generation, unless a generation's board watcher waits for its connection
    # (a dropped name lookup, asked again after 1 s: a CI run's generation 32 lasted 119
    # iterations of 8 ms, and the job reached 152 generations in 420): room for two of those
    iters = 640
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": iters})
    run = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(code=train(
        cfg, run, progress=False, faults=[Fault("fail", "node1", 10)], joins=[12])))
    job.start()
    samples: dict[str, list[tuple[int, tuple[int, int, int]]]] = {"worker": [], "launcher": []}
    store, stored = None, []  # (generation, keys in the store)

    def generation() -> int:
        try:
            lines = (run / "metrics.jsonl").read_text().strip().splitlines()
        except FileNotFoundError:
            return -1
        return json.loads(lines[-1])["generation"] if lines else -1

    while job.is_alive():
        g = generation()
        node0 = workers_of(run).get("node0") if g >= 0 else None
        try:
            if node0 is not None:
                samples["worker"].append((g, _counts(node0)))
        except OSError:
            pass
        samples["launcher"].append((g, _counts(os.getpid())))
        if g >= 0:
            store, count = _store_keys(run, store)
            if count is not None:
                stored.append((g, count))
        job.join(timeout=0.25)  # the sampling period; the loop ends when the job does
    assert result["code"] == 0
    assert generation() >= 200, generation()
    for who, seen in samples.items():
        # two windows of 40 generations each, 140 apart: a leak of one per generation shows
        # as 140 more; windows of equal length see as many transient peaks (a process group
        # torn down while the next one is set up), where a longer late window saw more
        early = [c for g, c in seen if 20 <= g < 60]
        late = [c for g, c in seen if 160 <= g < 200]
        assert early and late, (who, len(seen))
        for i, what in enumerate(("threads", "open files", "sockets")):
            high_early = max(c[i] for c in early)
            high_late = max(c[i] for c in late)
            # a worker's spare store connections (ready ones, and one being opened on each
            # opener) come and go with the generations' timing, within a bound of their own
            slack = 4 + (KEEP + OPENERS if who == "worker" and i else 0)
            assert high_late <= high_early + slack, (who, what, high_early, high_late)
            assert high_late < 200, (who, what, high_late)
    # one generation's keys at most (P = 2, D = 1): its world group's two addresses, an
    # abort board's two slots (a node's, the end's), one decision, a regroup board's three (a
    # request, a preparation for the joiner, the end), and the two addresses of the groups
    # formed ahead; those of the ten newest generations stay (a late reader's), and a
    # sample may fall between a generation's first write and the removal of an older one;
    # and the mailbox's read slots, deleted a batch of 8 a turn past the 64 kept
    one_generation = 2 + 2 + 1 + 3 + 2
    early = [c for g, c in stored if 20 <= g < 60]
    late = [c for g, c in stored if 160 <= g < 200]
    assert early and late, stored
    # (before: 821 more keys of generations after 140 generations, and ~1,400 read slots)
    assert max(late) <= max(early) + one_generation + 8, (max(early), max(late))


def test_only_a_busy_node_can_be_hung_and_a_finishing_one_beats_on():
    """A node saving its final model (longer than the hang timeout, for a real model) says
    "finishing" and is judged only on its beats; the same beats saying "busy" are a hang. The
    clock is the test's own, so nothing here waits."""
    from torch.distributed import HashStore

    from spotpipe.cluster.liveness import Liveness
    from spotpipe.protocol import Channel, Heartbeat, keys
    from spotpipe.protocol.auth import job_key

    key = job_key(b"token", "inst")
    store, now = HashStore(), [0.0]
    liveness = Liveness(store, Channel(key, "coordinator"), lambda w, r: None,
                        clock=lambda: now[0])
    writers = {state: Channel(key, f"n-{state}") for state in ("busy", "finishing")}
    for step in range(40):  # 40 beats, 0.5 s apart, all at iteration 5, instruction 32
        now[0] = step * 0.5
        verdicts = {}
        for state, channel in writers.items():
            store.set(keys.heartbeat(channel.writer),
                      channel.seal(Heartbeat(channel.writer, state, 1, 5, 32),
                                   at=keys.heartbeat(channel.writer)))
            verdicts[state] = liveness.verdict(channel.writer, heartbeat_timeout_s=3.0,
                                               hang_timeout_s=2.0)
        assert verdicts["finishing"] is None, (step, verdicts)
        if now[0] > 2.0:
            assert verdicts["busy"] and verdicts["busy"].startswith("hung"), (step, verdicts)
    # and beats that stop are a death, finishing or not
    now[0] += 3.5
    assert liveness.verdict("n-finishing", 3.0, 2.0).startswith("no heartbeat")


def test_beats_that_stop_after_a_wait_are_a_silence_not_a_hang():
    """With the hang timeout shorter than the heartbeat timeout, a node whose beats stop
    while it waits or finishes (its host lost, or it exited with its exit still on the way
    from its agent) was fenced "hung" at the hang timeout: its last beat's clock ran on. It is
    judged by the beats' age alone; a node whose last beat said it computes is still hung at
    the hang timeout (a frozen process)."""
    from torch.distributed import HashStore

    from spotpipe.cluster.liveness import Liveness
    from spotpipe.protocol import Channel, Heartbeat, keys
    from spotpipe.protocol.auth import job_key

    key = job_key(b"token", "inst")
    store, now = HashStore(), [0.0]
    liveness = Liveness(store, Channel(key, "coordinator"), lambda w, r: None,
                        clock=lambda: now[0])
    states = ("busy", "waiting", "finishing")
    writers = {state: Channel(key, f"n-{state}") for state in states}
    for step in range(4):  # beats 0.5 s apart, then none from t = 1.5 s
        now[0] = step * 0.5
        for state, channel in writers.items():
            store.set(keys.heartbeat(channel.writer),
                      channel.seal(Heartbeat(channel.writer, state, 1, 5, 32 + step),
                                   at=keys.heartbeat(channel.writer)))
            assert liveness.verdict(channel.writer, 30.0, 2.0) is None
    verdicts: dict[str, list[tuple[float, str | None]]] = {s: [] for s in states}
    for tenth in range(16, 330):
        now[0] = tenth / 10
        for state, channel in writers.items():
            verdicts[state].append((now[0], liveness.verdict(channel.writer, 30.0, 2.0)))

    def first(state: str) -> tuple[float, str]:
        return next((t, v) for t, v in verdicts[state] if v)

    t, why = first("busy")
    assert 3.5 < t <= 3.6 and why.startswith("hung: no progress for 2."), (t, why)
    for state in ("waiting", "finishing"):
        t, why = first(state)
        assert 31.5 < t <= 31.6 and why.startswith("no heartbeat for 30."), (state, t, why)


def _beating(names: tuple[str, ...]):
    """A Liveness on the test's own clock, and a function that writes a beat for a node."""
    from torch.distributed import HashStore

    from spotpipe.cluster.liveness import Liveness
    from spotpipe.protocol import Channel, Heartbeat, keys
    from spotpipe.protocol.auth import job_key

    key = job_key(b"token", "inst")
    store, now = HashStore(), [0.0]
    liveness = Liveness(store, Channel(key, "coordinator"), lambda w, r: None,
                        clock=lambda: now[0])
    writers = {n: Channel(key, n) for n in names}

    def beat(node: str) -> None:
        store.set(keys.heartbeat(node), writers[node].seal(Heartbeat(node, "busy", 1, 5, 32),
                                                           at=keys.heartbeat(node)))
    return liveness, now, beat


def test_a_silent_node_is_fenced_while_the_store_stays_slow():
    """A store slower than half the heartbeat timeout makes the coordinator restart every
    clock (beats could not arrive on time), so age alone never fences while it stays slow. The
    slow store still takes beats in: node `x`, silent from t = 1 s while `a` and `b` beat every
    0.5 s, is outpaced once their beats have arrived for more than the timeout (3 s) after its
    last one: the first after it arrived at 1.5 s, so from t = 5 s on, not before."""
    liveness, now, beat = _beating(("a", "b", "x"))
    judged: list[tuple[float, str | None]] = []
    for step in range(20):
        now[0] = step * 0.5
        for node in ("a", "b") if now[0] > 1.0 else ("a", "b", "x"):
            beat(node)
            liveness.read(node)
        liveness.read("x")
        judged.append((now[0], liveness.outpaced("x", 3.0)))
        assert liveness.outpaced("a", 3.0) is None and liveness.outpaced("b", 3.0) is None
        liveness.restart_clocks()  # as the coordinator does at every tick of a slow store
        assert liveness.verdict("x", 3.0, 30.0) is None  # (the age alone: restarted)
    first = next(t for t, why in judged if why)
    assert first == 5.0, judged
    assert judged[-1][1].startswith("no heartbeat for 8.5 s while the store was slow"), judged


def test_no_node_is_outpaced_without_evidence_or_within_the_timeout():
    """Every node silent (the store away): nobody beats, so nobody is judged. After the outage
    `a` and `b` are back at once and `x` 2.5 s later (the store client's reconnection backoff):
    within the 3 s timeout of the first beat after the outage, so `x` is not fenced."""
    liveness, now, beat = _beating(("a", "b", "x"))
    for node in ("a", "b", "x"):
        beat(node)
        liveness.read(node)
    for tenth in range(1, 100):  # 10 s of outage
        now[0] = tenth / 10
        for node in ("a", "b", "x"):
            liveness.read(node)
            assert liveness.outpaced(node, 3.0) is None
    for step in range(20):  # back at t = 10 s, beats every 0.5 s; x from t = 12.5 s
        now[0] = 10 + step * 0.5
        for node in ("a", "b", "x") if now[0] >= 12.5 else ("a", "b"):
            beat(node)
        for node in ("a", "b", "x"):
            liveness.read(node)
            assert liveness.outpaced(node, 3.0) is None, (now[0], node)


def test_beats_before_the_store_began_to_answer_slowly_are_no_evidence():
    """`since` (the coordinator's second late check in a row): the other nodes' beats before it
    count for nothing, whatever the gap, so a node silent from t = 1 s is outpaced only once
    their beats have arrived for more than the timeout (3 s) after t = 6 s (from the first
    after it, at 6.5 s): at t = 10 s."""
    liveness, now, beat = _beating(("a", "x"))
    judged: list[tuple[float, str | None]] = []
    for step in range(30):
        now[0] = step * 0.5
        for node in ("a",) if now[0] > 1.0 else ("a", "x"):
            beat(node)
            liveness.read(node)
        judged.append((now[0], liveness.outpaced("x", 3.0, since=6.0)))
    assert next(t for t, why in judged if why) == 10.0, judged
    assert judged[-1][1].startswith("no heartbeat for 13.5 s while the store was slow"), judged
