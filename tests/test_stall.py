"""The node's own hang watch (`spotpipe.runtime.stall`) on a hand-driven clock, and the
coordinator's handling of its report (an in-memory store, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from spotpipe.cluster.coordinator import Coordinator
from spotpipe.plan import Layout
from spotpipe.protocol import Channel, Stalled, job_key
from spotpipe.runtime.stall import StallWatch, Still

from conftest import tiny_config


class Node:
    """What the watch reads: the main thread's place (None while it waits) on a clock the
    test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.still: Still | None = None
        self.reports: list[tuple[Still, float]] = []

    def watch(self, timeout_s: float = 2.0, poll_s: float = 0.2) -> StallWatch:
        return StallWatch(timeout_s, poll_s, lambda: self.still,
                          lambda s, secs: self.reports.append((s, secs)), clock=lambda: self.now)


def test_a_stall_is_reported_at_the_timeout_itself_and_once():
    node = Node()
    watch = node.watch()
    node.still = Still(0, 5, 3, since=10.0)
    node.now = 10.05
    assert watch.look() == pytest.approx(0.2)  # the beat's period while far from the timeout
    node.now = 11.9
    assert watch.look() == pytest.approx(0.1)  # the next look is brought forward to 12.0
    assert node.reports == []
    node.now = 12.0
    assert watch.look() == pytest.approx(0.2)
    assert node.reports == [(Still(0, 5, 3, 10.0), pytest.approx(2.0))]
    node.now = 12.5
    watch.look()
    assert len(node.reports) == 1  # the same stall is not reported again


def test_progress_or_a_wait_starts_the_count_again():
    node = Node()
    watch = node.watch()
    node.still = Still(0, 5, 3, since=0.0)
    node.now = 1.9
    watch.look()
    node.still = Still(0, 5, 4, since=1.95)  # the next instruction began
    node.now = 2.5
    assert watch.look() == pytest.approx(0.2)
    assert node.reports == []
    node.still = None  # waiting on a peer, seen by a look
    node.now = 3.0
    watch.look()
    # busy again at the same instruction with an old stamp (a wait the stamps do not cover):
    # the stall counts from the look that saw the wait, never from before it
    node.still = Still(0, 5, 4, since=1.95)
    node.now = 4.9
    assert watch.look() == pytest.approx(0.1)
    assert node.reports == []
    node.now = 5.0
    watch.look()
    assert node.reports == [(Still(0, 5, 4, 3.0), pytest.approx(2.0))]


def test_a_report_that_cannot_go_is_tried_again():
    node = Node()
    failures = []

    def report(still: Still, secs: float) -> None:
        if not failures:
            failures.append(still)
            raise ConnectionError("store away")
        node.reports.append((still, secs))

    watch = StallWatch(2.0, 0.2, lambda: node.still, report, clock=lambda: node.now)
    node.still = Still(1, 0, 0, since=0.0)
    node.now = 2.0
    with pytest.raises(ConnectionError):
        watch.look()
    node.now = 2.2
    watch.look()
    assert len(node.reports) == 1 and node.reports[0][1] == pytest.approx(2.2)


def _coordinator(corpus) -> tuple[Coordinator, list[dict], list[str]]:
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy")
    emitted: list[dict] = []
    killed: list[str] = []
    coord = Coordinator(cfg=cfg, store=dist.HashStore(),
                        layout=Layout.build(2, 1, ["node0", "node1"]), kill=killed.append,
                        emit=emitted.append, now=lambda: 0.0,
                        channel=Channel(job_key(b"sesame", "test"), "coordinator"),
                        partition=[(0, 1), (1, 2)])
    return coord, emitted, killed


def _stall(coord: Coordinator, node: str, **extra) -> Stalled:
    fields = dict(node=node, generation=coord.generation, iteration=7, position=4,
                  still_s=2.0, time_s=1.0)
    fields.update(extra)
    return Stalled(**fields)


def test_the_coordinator_fences_a_node_on_its_own_stall_report(corpus):
    coord, emitted, killed = _coordinator(corpus)
    coord.stalled(_stall(coord, "node1"), "node1")
    assert killed == ["node1"] and "node1" in coord.fenced
    fenced = [e for e in emitted if e["kind"] == "node_fenced"]
    assert len(fenced) == 1 and fenced[0]["node"] == "node1"
    assert "hung: no progress for 2.0 s at iteration 7, instruction 4" in fenced[0]["reason"]


def test_a_stall_report_fences_only_its_writer_and_only_in_its_generation(corpus):
    coord, emitted, killed = _coordinator(corpus)
    coord.stalled(_stall(coord, "node1"), "node0")  # node0 cannot have node1 fenced
    coord.stalled(_stall(coord, "node1", generation=coord.generation + 1), "node1")
    assert killed == []
    refusals = [e for e in emitted if e["kind"] == "record_refused"]
    assert len(refusals) == 2
    assert "a stall report for node1" in refusals[0]["reason"]
    assert "generation" in refusals[1]["reason"]
    coord.stalled(_stall(coord, "node3"), "node3")  # not in the job: nothing to fence
    assert killed == [] and not coord.fenced


def test_a_node_let_go_by_a_plan_is_fenced_on_its_stall_whatever_its_generation(corpus):
    """node1 leaves on a notice: the plan lets it go, and it hands its stage over outside
    the new generation's layout (no heartbeat check watches it). Stuck there, it reports its
    stall: it is fenced as a live node is (before, it was not, and its receivers waited out
    `cluster.timeout_s`, the job's end its exit for ever), even from a generation the job
    has left behind; a node that merely finished is not."""
    coord, emitted, killed = _coordinator(corpus)
    coord.left.add("node1")
    # (its stall comes from the plan's generation or an older one)
    coord.history = dataclasses.replace(coord.history, generation=coord.generation + 1)
    coord.stalled(_stall(coord, "node1", generation=coord.generation - 1,
                         step="handing over stage 1 to node0"), "node1")
    assert killed == ["node1"] and "node1" in coord.fenced
    fenced = [e for e in emitted if e["kind"] == "node_fenced"]
    assert "handing over stage 1 to node0" in fenced[0]["reason"], fenced
    coord.finished.add("node0")
    coord.stalled(_stall(coord, "node0"), "node0")
    assert killed == ["node1"]


# -- between instructions: the steps of carrying out a Decision (`runtime.activity`) ---------

def test_a_step_computes_until_a_wait_opens_and_a_wait_ends_with_a_fresh_stamp():
    from spotpipe.runtime.activity import Activity

    now = [0.0]
    act = Activity(clock=lambda: now[0])
    assert not act.busy  # running instructions: the executor's stamps speak
    act.begin("moving states", 3)
    assert act.busy and (act.step, act.generation, act.since) == ("moving states", 3, 0.0)
    now[0] = 5.0
    with act.waiting():
        assert not act.busy
        with act.waiting():  # nested (a Waiter's call inside a marked wait)
            pass
        assert not act.busy
        now[0] = 9.0
    assert act.busy and act.since == 9.0  # the stall counts from the wait's end
    now[0] = 10.0
    act.begin("starting the generation", 3)
    assert act.since == 10.0
    act.end()
    assert not act.busy


def test_a_comms_waits_mark_the_main_threads_activity_and_only_its_own():
    """A Comm's waiter marks each wait of the thread that owns the activity (the worker's main
    thread); the same waiter code run by another thread (groups formed ahead) is not a wait
    of the main thread, which may be computing meanwhile."""
    import threading

    from spotpipe.runtime.activity import Activity
    from spotpipe.runtime.comm import Waiter
    from spotpipe.store.abort import AbortSignal

    act = Activity()
    act.begin("moving states", 1)
    waiter = Waiter(AbortSignal(), act)
    release, entered, seen = threading.Event(), threading.Event(), []

    def blocking() -> None:
        entered.set()
        seen.append(act.busy)  # on the waiter's thread, while the main thread waits
        release.wait(10)

    release.set()
    waiter.call(blocking, "a peer")
    assert seen == [False] and act.busy
    # another thread's wait on a waiter of the same activity: the main thread stays busy
    release.clear()
    other = threading.Thread(target=lambda: waiter.call(blocking, "a peer"))
    other.start()
    assert entered.wait(10)
    entered.clear()
    while len(seen) < 2:
        threading.Event().wait(0.01)  # (polling the list the waiter fills; no timing)
    assert seen[1] is True
    release.set()
    other.join(10)
    waiter.stop()


def test_a_stall_between_instructions_names_its_step(corpus):
    coord, emitted, killed = _coordinator(corpus)
    coord.stalled(_stall(coord, "node1", step="forming the process groups"), "node1")
    assert killed == ["node1"]
    reason = next(e for e in emitted if e["kind"] == "node_fenced")["reason"]
    assert reason.startswith("hung: no progress for 2.0 s forming the process groups"), reason


def test_beats_in_a_step_are_judged_and_a_new_step_is_progress():
    """The coordinator's own judgement from beats, between instructions: busy in one step for
    the hang timeout is a hang named by the step; a new step starts the count again; a wait
    is never a hang."""
    from torch.distributed import HashStore

    from spotpipe.cluster.liveness import Liveness
    from spotpipe.protocol import Heartbeat, keys

    key = job_key(b"token", "inst")
    store, now = HashStore(), [0.0]
    liveness = Liveness(store, Channel(key, "coordinator"), lambda w, r: None,
                        clock=lambda: now[0])
    node = Channel(key, "node0")

    def beat(at: float, state: str, step: str) -> str | None:
        now[0] = at
        store.set(keys.heartbeat("node0"),
                  node.seal(Heartbeat("node0", state, 2, 5, 3, step=step),
                            at=keys.heartbeat("node0")))
        return liveness.verdict("node0", heartbeat_timeout_s=3.0, hang_timeout_s=2.0)

    assert beat(0.0, "busy", "taking over stage 1") is None
    assert beat(1.5, "busy", "taking over stage 1") is None
    assert beat(2.5, "busy", "moving states") is None  # a new step: progress
    assert beat(4.0, "waiting", "moving states") is None
    assert beat(7.0, "waiting", "moving states") is None  # waiting on peers: never hung
    assert beat(7.5, "busy", "moving states") is None
    verdict = beat(9.75, "busy", "moving states")  # counted from the last beat that waited
    assert verdict and verdict.startswith("hung: no progress for 2.8 s moving states"), verdict
