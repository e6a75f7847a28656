"""The coordinator's decisions after plans that fail while they are carried out, driven with
reports directly (an in-memory store, no processes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch.distributed as dist

from spotpipe.cluster.coordinator import Coordinator
from spotpipe.plan import Layout, held_replica
from spotpipe.protocol import (Channel, DecisionRecord, Heartbeat, JoinAnswer, JoinRequest,
                               Notice, Prepare, Regroup, Report, job_key, keys)
from spotpipe.store import board

KEY = job_key(b"sesame", "test")

from conftest import tiny_config


def _coordinator(corpus, stages: int, nodes: list[str]) -> tuple[Coordinator, list[dict]]:
    # (iterations past the reports' 5-6: the job has iterations left after their boundaries)
    cfg = tiny_config(corpus, stages=stages, pipelines=1, redundancy="lazy", iterations=20)
    emitted: list[dict] = []
    coord = Coordinator(cfg=cfg, store=dist.HashStore(), layout=Layout.build(stages, 1, nodes),
                        kill=lambda node: None, emit=emitted.append, now=lambda: 0.0,
                        channel=Channel(KEY, "coordinator"), partition=[(0, 1), (1, 2)][:stages])
    return coord, emitted


def _with_standby(coord: Coordinator, standby: tuple[str, ...]) -> None:
    coord.history = dataclasses.replace(coord.history,
                                        layout=coord.layout.with_standby(standby))


def _plan(coord: Coordinator, generation: int) -> dict:
    """The Decision the coordinator published for `generation`, as a worker reads it."""
    opened = board.first(coord.store, keys.decision_board(generation), Channel(KEY, "node0"),
                         on_refused=lambda why, _: None, timeout_s=5, expect=DecisionRecord)
    return opened.message.decision


def _make(coord: Coordinator, node: str, **extra) -> Report:
    fields = dict(node=node, generation=coord.generation, boundary=False, iteration=5,
                  position=0, instruction="", committed_through=4, stepped_through=4, done=(),
                  clip_scale=None, flight=-1, formed=False, lacking=(), untouched=True,
                  leaving=False, reason="forming the process groups failed: wait timeout",
                  time_s=0.0)
    fields.update(extra)
    fields["lacking"] = tuple(fields["lacking"])
    fields.setdefault("replica", _held(coord, node, fields["untouched"], fields["lacking"]))
    return Report(**fields)


def _held(coord: Coordinator, node: str, untouched: bool, lacking: tuple[str, ...]) -> int | None:
    """The replica a node holds, as its report says: the one the layout before the last plan
    gave it when that plan changed nothing of its state, else the last plan's, unless it
    reports lacking it."""
    before = coord.history.before
    layout = before[0] if untouched and before is not None else coord.history.layout
    replica = held_replica(layout, node)
    return None if f"replica {replica}" in lacking else replica


def _report(coord: Coordinator, node: str, **extra) -> None:
    coord.report(_make(coord, node, **extra), node)


def test_plans_that_keep_failing_with_no_loss_stop_the_job(corpus):
    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    for attempt in range(3):
        generation = coord.generation
        _report(coord, "node0")
        _report(coord, "node1")
        plan = _plan(coord, generation)
        if attempt < 2:
            assert plan["action"] == "keep" and coord.generation == generation + 1
    assert plan["action"] == "stop"
    assert "could not re-form" in plan["message"] and "wait timeout" in plan["message"]


def test_generations_that_form_but_fail_before_an_iteration_stop_the_job(corpus):
    """Nodes that form their generation but fail at their first exchange (NCCL connects at its
    first collective): formed, nothing committed in it. Such plans count as failed too, and
    the job stops instead of forming them forever; a generation that commits an iteration
    restarts the count."""
    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    why = "communication failed: Connect timeout [none]"

    def fail(committed: int) -> dict:
        g = coord.generation
        for node in ("node0", "node1"):
            _report(coord, node, formed=True, committed_through=committed, reason=why)
        return _plan(coord, g)

    assert fail(4)["action"] == "keep"  # the launch's generation committed 0-4: no stall
    assert [fail(4)["action"] for _ in range(2)] == ["keep", "keep"]  # 2 failed plans
    assert fail(5)["action"] == "keep"  # iteration 5 committed: progress, the count restarts
    assert [fail(5)["action"] for _ in range(2)] == ["keep", "keep"]
    plan = fail(5)  # the third plan in a row that failed before its first iteration
    assert plan["action"] == "stop"
    assert "could not re-form" in plan["message"] and "Connect timeout" in plan["message"]


def test_a_resumed_jobs_first_generation_that_fails_before_an_iteration_counts(corpus):
    """A job resumed from a checkpoint at iteration 40: its launch generation, formed and
    failing at its first exchange, committed nothing past the checkpoint (39), which counts
    as a failed plan as it would at iteration 0 (the history started at 0 before, and such
    generations of a resumed job never counted)."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy")
    coord = Coordinator(cfg=cfg, store=dist.HashStore(),
                        layout=Layout.build(2, 1, ["node0", "node1"]), kill=lambda node: None,
                        emit=lambda event: None, now=lambda: 0.0,
                        channel=Channel(KEY, "coordinator"), partition=[(0, 1), (1, 2)],
                        start=40)
    plans = []
    for _ in range(3):
        g = coord.generation
        for node in ("node0", "node1"):
            _report(coord, node, formed=True, committed_through=39, iteration=40,
                    reason="communication failed: Connect timeout [none]")
        plans.append(_plan(coord, g))
    assert [p["action"] for p in plans] == ["keep", "keep", "stop"], plans
    assert "Connect timeout" in plans[-1]["message"]


def test_boundary_reports_below_the_resume_do_not_count_as_failed_plans(corpus):
    """Reports at a boundary are a change planned, not a failure (the simulator's `settle`
    makes them with nothing committed since the last plan)."""
    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    for _ in range(5):
        g = coord.generation
        for node in ("node0", "node1"):
            _report(coord, node, boundary=True, formed=True, committed_through=4, iteration=5,
                    reason="the layout changes at this iteration boundary")
        assert _plan(coord, g)["action"] == "keep"


def test_a_node_lost_between_failed_plans_is_progress(corpus):
    """Failed plans count as futile only while nothing changes: a loss in between restarts
    the count (each plan then re-forms around the loss)."""
    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    for _ in range(2):
        g = coord.generation
        _report(coord, "node0")
        _report(coord, "node1")
        assert _plan(coord, g)["action"] != "stop"
    coord.node_exited("node2", -9)  # the standby node goes: a loss, and no spare any more
    g = coord.generation
    _report(coord, "node0")
    _report(coord, "node1")
    plan = _plan(coord, g)
    assert plan["action"] == "keep" and "node2" not in plan["layout"].get("standby", [])


def _rebalancing(corpus) -> tuple[Coordinator, list]:
    """P = 2 with node2 on standby: node1 crashes, node0 takes its stage over, and at the
    next boundary the plan is a rebalance that hands stage 1 to node2, being carried out."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True)
    assert _plan(coord, 0)["action"] == "failover"
    coord.report(_boundary(coord, "node0"), "node0")
    assert _plan(coord, 1)["action"] == "rebalance"
    return coord, emitted


def test_failed_plan_rolled_back_only_when_no_survivor_changed(corpus):
    """A rebalance places the standby node2 and fails: rolled back when every node of the
    layout before reports its state untouched, not when one changed. node2, which did not
    receive its stage, is counted out either way (it joins again)."""
    for untouched in (True, False):
        coord, emitted = _rebalancing(corpus)
        _report(coord, "node0", untouched=untouched, committed_through=6)
        _report(coord, "node2", lacking=["stage 1", "replica 0"], committed_through=-1)
        agreement = [e for e in emitted if e["kind"] == "agreement"][-1]
        assert bool(agreement.get("rolled_back")) == untouched
        assert "node2" in agreement["lost"] and agreement["resume"] == 7
        plan = _plan(coord, 2)
        assert "node2" not in str(plan["layout"])
        # rolled back, node0 still carries both stages and the job keeps going; otherwise
        # node0's new state is that of the failed plan, where node2 owned a stage
        assert plan["action"] == ("keep" if untouched else "failover"), plan["action"]


def test_a_plan_whose_only_receiver_died_is_rolled_back(corpus):
    """The same rebalance, but node2, the only node it sends anything to, is killed while it
    is carried out: no survivor lacks anything, yet the layout it planned was never made
    (node0 still runs both stages). Rolled back, the job keeps going; before, it took the
    failed plan's layout, where the dead node2 owned stage 1 and nothing else held it, and
    stopped (found by a hunt of three faults a run: a joiner crashing in its placement)."""
    coord, emitted = _rebalancing(corpus)
    coord.node_exited("node2", -9)
    _report(coord, "node0", formed=False, untouched=True, committed_through=6)
    agreement = [e for e in emitted if e["kind"] == "agreement"][-1]
    assert agreement.get("rolled_back") and "node2" in agreement["lost"], agreement
    plan = _plan(coord, 2)
    assert plan["action"] == "keep" and not coord.stop_message, plan
    assert Layout.from_json(plan["layout"]).stages_of("node0") == [(0, 0), (0, 1)]


def test_a_joiner_on_standby_in_a_plan_rolled_back_still_waits_and_hears_the_end(corpus):
    """node2 and node3 join a job whose node0 carries both stages; the rebalance places node2
    and keeps node3 on standby, and fails (node2 did not receive its stage). Its rollback
    restores the layout before it, which never listed node3: node3 is a joiner again, which a
    later plan can place and which hears that the job is over at its end. (Found in a full
    suite's run: forgotten, it waited for an answer after the job had ended, and the job
    waited for it.)"""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True)
    assert _plan(coord, 0)["action"] == "failover"
    cfg = coord.cfg
    for node in ("node2", "node3"):
        coord.join(JoinRequest(node, 0.0, cfg.digest(), cfg.model_digest()), node)
    coord.report(_boundary(coord, "node0"), "node0")
    rebalance = _plan(coord, 1)
    assert rebalance["action"] == "rebalance" and rebalance["layout"]["standby"] == ["node3"]
    _report(coord, "node0", untouched=True, committed_through=6)
    _report(coord, "node2", lacking=["stage 1", "replica 0"], committed_through=-1)
    assert [e for e in emitted if e["kind"] == "agreement"][-1].get("rolled_back")
    assert "node3" not in str(_plan(coord, 2)["layout"])
    assert "node3" in coord.joining
    coord.release_standby()
    for _, opened in board.read(coord.store, keys.join_board("node3"), Channel(KEY, "node3"),
                                on_refused=lambda why, _: None, timeout_s=5):
        if isinstance(opened.message, JoinAnswer):  # (the first answer: a Prepare may come)
            assert opened.message.outcome == "finished", opened.message
            break


def _boundary(coord: Coordinator, node: str) -> Report:
    return _make(coord, node, boundary=True, iteration=6, committed_through=6,
                 stepped_through=6, formed=True,
                 reason="the layout changes at this iteration boundary")


def test_a_successor_from_the_books_decides_as_the_coordinator_would(corpus):
    """The coordinator's books (`books`, sealed as a CoordinatorState and opened again, as a
    successor on another host reads them) taken in the middle of an agreement: a fresh
    coordinator restored from them and given the last report publishes the same Decision as
    the coordinator that was never interrupted, and ends with the same books."""
    from spotpipe.cluster import succession
    from spotpipe.protocol import CoordinatorState

    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy")
    nodes = ["node0", "node1", "node2", "node3"]

    def make() -> Coordinator:
        return Coordinator(cfg=cfg, store=dist.HashStore(), layout=Layout.build(2, 2, nodes),
                           kill=lambda node: None, emit=lambda e: None, now=lambda: 0.0,
                           channel=Channel(KEY, "coordinator"), partition=[(0, 2), (2, 4)])

    original = make()
    original.node_exited("node3", -9)
    _report(original, "node0", formed=True, committed_through=4, flight=5)
    _report(original, "node1", formed=True, committed_through=4, flight=5)
    assert original.collecting is not None and original.generation == 0
    books = original.books()
    assert succession.history_from_json(books["history"]) == original.history
    fields = dict(books, cursor=7, journal=2, last_metrics=None, exited={"node3": -9},
                  checkpoints={}, admission={}, time_s=1.0)
    blob = Channel(KEY, "coordinator").seal(CoordinatorState(**fields), 0,
                                            at=keys.COORDINATOR_STATE)
    opened = Channel(KEY, "agent2").open(blob, at=keys.COORDINATOR_STATE,
                                         expect=CoordinatorState, writers={"coordinator"})
    successor = make()
    successor.restore(opened.message)
    assert successor.books() == books
    last = _make(original, "node2", formed=True, committed_through=4, flight=5)
    original.report(last, "node2")
    successor.report(last, "node2")
    want, got = _plan(original, 0), _plan(successor, 0)
    assert want["action"] == "failover" and got == want
    assert successor.books() == original.books()


def _on_one_store(corpus) -> Callable[[], Coordinator]:
    """Coordinators of one 2-stage job on one store: a predecessor and its successor."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy")
    store = dist.HashStore()
    return lambda: Coordinator(
        cfg=cfg, store=store, layout=Layout.build(2, 1, ["node0", "node1"]),
        kill=lambda node: None, emit=lambda e: None, now=lambda: 0.0,
        channel=Channel(KEY, "coordinator"), partition=[(0, 2), (2, 4)])


def test_books_older_than_the_published_plan_stop_the_job(corpus):
    """The coordinator published its Decision and was lost before it saved its books: the
    successor (same store) sees a plan its books do not know, and stops the job with a clear
    message, as a stop Decision on the board of the generation the workers are in."""
    from spotpipe.protocol import CoordinatorState

    make = _on_one_store(corpus)
    original = make()
    fresh = make()
    fresh.restore(CoordinatorState(**original.books(), cursor=0, journal=0, last_metrics=None,
                                   exited={}, checkpoints={}, admission={}, time_s=0.0))
    assert not fresh.decided_after_books()  # nothing published since the books: go on
    books = dict(original.books(), cursor=3, journal=1, last_metrics=None, exited={},
                 checkpoints={}, admission={}, time_s=0.0)
    for node in ("node0", "node1"):  # a boundary change: generation 0 ends with a plan
        _report(original, node, boundary=True, committed_through=5, iteration=5)
    assert _plan(original, 0)["action"] != "stop" and original.generation == 1
    successor = make()
    successor.restore(CoordinatorState(**books))
    assert successor.generation == 0
    assert successor.decided_after_books()
    assert "before it saved its books" in successor.stop_message
    stop = _plan(successor, 1)
    assert stop["action"] == "stop" and stop["message"] == successor.stop_message


def test_a_successor_says_the_cause_of_a_loss_its_predecessor_was_told(corpus):
    """node1's agent said why node1 died (its host's fork server ended); the coordinator that
    heard it was lost before node0's loss stopped the job: the successor's stop says it too."""
    from spotpipe.protocol import CoordinatorState

    make = _on_one_store(corpus)
    original = make()
    why = "on host-b, the fork server that starts the workers exited with code 1, and they " \
          "died with it"
    original.node_exited("node1", -9, why)
    fields = dict(original.books(), cursor=1, journal=0, last_metrics=None,
                  exited={"node1": -9}, checkpoints={}, admission={}, time_s=0.0)
    blob = Channel(KEY, "coordinator").seal(CoordinatorState(**fields), 0,
                                            at=keys.COORDINATOR_STATE)
    successor = make()
    successor.restore(Channel(KEY, "agent2").open(blob, at=keys.COORDINATOR_STATE,
                                                  expect=CoordinatorState).message)
    successor.node_exited("node0", -9)
    assert successor.stop_message is not None and successor.stop_message.startswith(why + "; ")


def test_a_deposed_coordinators_late_plan_stops_the_job_rather_than_split_it(corpus):
    """A coordinator cut off from etcd retries its calls past its lease, so its plan can land
    after its successor read the board and found nothing: then two plans of one generation
    stand on its board, and the nodes follow the first, the deposed one's. The successor sees
    its own landed second and stops the job clearly instead of going on from a layout the
    nodes are not in."""
    from spotpipe.protocol import CoordinatorState

    make = _on_one_store(corpus)
    deposed = make()
    successor = make()
    successor.restore(CoordinatorState(**deposed.books(), cursor=0, journal=0,
                                       last_metrics=None, exited={}, checkpoints={},
                                       admission={}, time_s=0.0))
    assert not successor.decided_after_books()  # the board is empty when it looks
    for coordinator in (deposed, successor):  # the same reports reach both; the deposed first
        for node in ("node0", "node1"):
            _report(coordinator, node, boundary=True, committed_through=5, iteration=5)
    assert "after its successor took over" in successor.stop_message
    assert _plan(successor, 0)["action"] != "stop"  # (the one the nodes follow: the deposed's)
    stop = _plan(successor, 1)
    assert stop["action"] == "stop" and stop["message"] == successor.stop_message


def test_a_spare_node_lost_leaves_training_untouched(corpus):
    """A node on standby since before the last plan, or accepted to join and not placed yet,
    holds no stage: its exit aborts nothing and starts no agreement, and no later plan
    places it. One that the last plan put on standby may still be sending layers to the
    others: its exit aborts the generation, as any loss."""
    import json

    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    coord.joining = ["node3"]
    g = coord.generation
    coord.node_exited("node2", -9)
    coord.node_exited("node3", 0)  # a joiner going before it was placed
    assert [(e["kind"], e["node"]) for e in emitted] == [("standby_lost", "node2"),
                                                           ("standby_lost", "node3")]
    assert coord.collecting is None and coord.generation == g and coord.joining == []
    assert not coord.store.check([keys.board_slot(keys.abort_board(g), 1)])
    coord.node_exited("node1", -9)  # then a real loss: node0 takes over, nobody is placed
    _report(coord, "node0")
    plan = _plan(coord, g)
    assert plan["action"] == "failover"
    assert "node2" not in json.dumps(plan) and "node3" not in json.dumps(plan)


def test_a_node_the_last_plan_put_on_standby_is_a_loss_like_any(corpus):
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    coord.history = dataclasses.replace(coord.history, before=(
        Layout.build(2, 1, ["node0", "node2"]), coord.history.partition))
    g = coord.generation
    coord.node_exited("node2", -9)
    assert [e["kind"] for e in emitted] == ["node_lost", "failure_detected"]
    assert coord.store.check([keys.board_slot(keys.abort_board(g), 1)])


def test_a_node_the_last_plan_put_on_standby_is_a_spare_once_that_plan_committed(corpus):
    """Once the plan's first iteration is committed nothing can give the node its old place
    back (no rollback after a commit) and it sends nothing: its exit aborts nothing, and the
    iteration in flight is not replayed for it."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    coord.history = dataclasses.replace(coord.history, resumed_at=6, before=(
        Layout.build(2, 1, ["node0", "node2"]), coord.history.partition))
    g = coord.generation
    coord.committed(5)  # (a line of the iteration before the plan: not yet)
    assert not coord._spare("node2")
    coord.committed(6)
    coord.node_exited("node2", -9)
    assert [(e["kind"], e["node"]) for e in emitted] == [("standby_lost", "node2")]
    assert coord.collecting is None and coord.generation == g
    assert not coord.store.check([keys.board_slot(keys.abort_board(g), 1)])


# ---------------------------------------------------------------------- groups formed ahead

def _record(coord: Coordinator, generation: int) -> DecisionRecord:
    opened = board.first(coord.store, keys.decision_board(generation), Channel(KEY, "node0"),
                         on_refused=lambda why, _: None, timeout_s=5, expect=DecisionRecord)
    return opened.message


def _regroup_board(coord: Coordinator, generation: int, count: int) -> list:
    """The first `count` records of a generation's regroup board, as a node's watcher reads
    them."""
    got = []
    for _, opened in board.read(coord.store, keys.regroup_board(generation),
                                Channel(KEY, "node0"), on_refused=lambda why, _: None,
                                timeout_s=5, expect=(Prepare, Regroup)):
        got.append(opened.message)
        if len(got) == count:
            return got
    raise AssertionError("unreachable")


def _at_boundary(coord: Coordinator, leaving: str, nodes: list[str]) -> None:
    for node in nodes:
        _report(coord, node, boundary=True, formed=True, committed_through=5, iteration=6,
                leaving=node == leaving, reason="a notice")


def test_a_notice_has_the_next_layouts_groups_formed_ahead_and_the_plan_takes_them(corpus):
    """node1 of P = 3 has a notice: before the boundary, the coordinator posts the layout the
    planner gives its departure (with no standby node, P = 2 on node0 and node2); the
    boundary's Decision has that layout and says the nodes take the groups formed for it."""
    coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node1")
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.1), "node1")  # said twice: prepared once
    [prepare] = [e for e in emitted if e["kind"] == "groups_prepared"]
    assert prepare["generation"] == 1 and prepare["nodes"] == ["node0", "node2"]
    _at_boundary(coord, "node1", ["node0", "node1", "node2"])
    record = _record(coord, 0)
    prepared = _regroup_board(coord, 0, 1)[0]
    assert isinstance(prepared, Prepare) and prepared.generation == 0
    assert record.decision["action"] == "repartition" and record.prepared
    assert Layout.from_json(record.decision["layout"]) == Layout.from_json(prepared.layout)
    assert Layout.from_json(prepared.layout).grid == (("node0", "node2"),)


def test_groups_formed_ahead_are_not_taken_when_the_layout_changed_meanwhile(corpus):
    """A loss before the boundary changes the plan: its Decision says to form fresh groups."""
    coord, _ = _coordinator(corpus, 4, ["node0", "node1", "node2", "node3"])
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node1")
    coord.node_exited("node3", -9)  # a loss as well: node2 carries stage 3 too
    for node in ("node0", "node1", "node2"):
        _report(coord, node, formed=True, committed_through=5, leaving=node == "node1")
    record = _record(coord, 0)
    assert record.decision["action"] == "failover"
    assert Layout.from_json(record.decision["layout"]).owner(0, 3) == "node2"
    assert not record.prepared


def test_a_notice_only_from_its_own_node_and_generation(corpus):
    coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node2")  # node2 speaking for node1
    coord.noticed(Notice("node1", 3, "SIGTERM", 1.0), "node1")  # another generation's
    assert not [e for e in emitted if e["kind"] == "groups_prepared"]
    assert [e for e in emitted if e["kind"] == "record_refused"]


def test_the_plan_after_a_failover_is_prepared_before_its_regroup_is_asked(corpus):
    """After a failover the layout can improve (a re-partition to P = 2): its groups are
    prepared on the new generation's regroup board before the request that ends the nodes'
    watch of it, and the re-partition at the next boundary takes them."""
    coord, _ = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    coord.node_exited("node1", -9)
    for node in ("node0", "node2"):
        _report(coord, node, formed=True, committed_through=5, flight=6)
    assert _record(coord, 0).decision["action"] == "failover"
    first, second = _regroup_board(coord, 1, 2)
    assert isinstance(first, Prepare) and isinstance(second, Regroup)
    _at_boundary(coord, "", ["node0", "node2"])
    record = _record(coord, 1)
    assert record.decision["action"] == "repartition" and record.prepared
    assert Layout.from_json(record.decision["layout"]) == Layout.from_json(first.layout)


def test_a_failover_that_retrains_the_last_iteration_asks_for_no_improvement(corpus):
    """The same failover with the last iteration in flight: nothing follows that iteration's
    boundary, so a re-partition there would only stop the nodes and form groups for nothing.
    No preparation and no regroup request; the job ends on the failover's layout."""
    coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    last = coord.cfg.iterations - 1
    coord.node_exited("node1", -9)
    for node in ("node0", "node2"):
        _report(coord, node, formed=True, committed_through=last - 1, flight=last)
    decision = _record(coord, 0).decision
    assert decision["action"] == "failover" and decision["resume"] == last
    kinds = [e["kind"] for e in emitted]
    assert "plan" in kinds
    assert "groups_prepared" not in kinds and "regroup_requested" not in kinds


def test_a_joining_nodes_placement_is_prepared_on_its_own_board_too(corpus):
    """After a failover at P = 2 one node carries both stages; node2 joins. The rebalance the
    next boundary makes is known at once: prepared on the running generation's regroup board
    (before the Regroup record) and on node2's answer board, which node2 watches while it
    waits, and the boundary's Decision takes the groups."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True, committed_through=5, flight=6)
    assert _record(coord, 0).decision["action"] == "failover"
    cfg = coord.cfg
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    first, second = _regroup_board(coord, 1, 2)
    assert isinstance(first, Prepare) and isinstance(second, Regroup)
    opened = board.first(coord.store, keys.join_board("node2"), Channel(KEY, "node2"),
                         on_refused=lambda why, _: None, timeout_s=5, expect=Prepare)
    assert opened.message == first
    assert Layout.from_json(first.layout).active_nodes == {"node0", "node2"}
    _at_boundary(coord, "", ["node0"])
    record = _record(coord, 1)
    assert record.decision["action"] == "rebalance" and record.prepared
    assert Layout.from_json(record.decision["layout"]) == Layout.from_json(first.layout)


class _SlowStore:
    """The coordinator's store, answering each heartbeat check the next of `stalls` seconds
    late on the test's clock (an etcd under load, or restarting); everything else as the store
    it wraps."""

    def __init__(self, store: dist.Store, now: list[float], stalls) -> None:
        self._store, self._now, self._stalls = store, now, iter(stalls)

    def check(self, keys_: list[str]) -> bool:
        self._now[0] += next(self._stalls)
        return self._store.check(keys_)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_slow_store_does_not_suspend_fencing_a_silent_node(corpus):
    """Every tick's heartbeat check answers 3 s late (more than half the 5 s heartbeat
    timeout), so every tick restarts the clocks; node0 and node1 beat on (their beats land,
    late), node2's stop. node2 is fenced once the others' beats have arrived for more than
    the timeout after its last: the first after it came at t = 6 s, so at the tick at t = 12 s.
    Before, a store that stayed this slow never let the coordinator fence anyone."""
    coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    now = [0.0]
    coord.liveness.clock = lambda: now[0]
    coord.store = _SlowStore(coord.store, now, [3.0] * 6)
    killed: list[tuple[str, float]] = []
    coord.kill = lambda node: killed.append((node, now[0]))
    writers = {n: Channel(KEY, n) for n in ("node0", "node1", "node2")}
    for tick in range(6):  # ticks at t = 3, 6, ..., 18 s (the check's stall is the clock)
        for node in ("node0", "node1") if tick else ("node0", "node1", "node2"):
            at = keys.heartbeat(node)
            coord.liveness.store.set(at, writers[node].seal(Heartbeat(node, "busy", 0, tick, 0),
                                                            at=at))
        coord.tick()
    assert killed == [("node2", 12.0)], emitted
    fenced = [e for e in emitted if e["kind"] == "node_fenced"]
    assert [e["node"] for e in fenced] == ["node2"]
    assert fenced[0]["time_s"] == 0.0 and "while the store was slow" in fenced[0]["reason"]
    assert sum(e["kind"] == "store_stalled" for e in emitted) == 6


def test_a_node_back_late_from_an_etcd_restart_is_not_fenced(corpus):
    """etcd restarts under the job: one heartbeat check waits 4.5 s for it (node1's beat was
    the first held back, node0's and node2's went in just before), then the store answers at
    once. Each node's store client comes back on its own backoff: node1's beat lands 1.5 s
    after the others'. Nobody is fenced: one late check is an outage, not a slow store (before,
    the others' beats on either side of the outage counted as 5.5 s of the store taking writes
    without node1's, and node1 was fenced: seen in a CI run of tests/test_etcd.py)."""
    coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
    now = [0.0]
    coord.liveness.clock = lambda: now[0]
    coord.store = _SlowStore(coord.store, now, [0.0, 0.5, 4.5] + [0.5] * 40)
    killed: list[str] = []
    coord.kill = killed.append
    writers = {n: Channel(KEY, n) for n in ("node0", "node1", "node2")}
    for tick in range(43):  # checks at t = 0, 0.5, 5.0 (the outage), 5.5, ... 25.0 s
        beating = ["node0", "node2"] + (["node1"] if tick == 0 or now[0] >= 6.0 else [])
        for node in beating:
            at = keys.heartbeat(node)
            coord.liveness.store.set(at, writers[node].seal(Heartbeat(node, "busy", 0, tick, 0),
                                                            at=at))
        coord.tick()
    assert killed == [], [e for e in emitted if e["kind"] == "node_fenced"]
    assert [e["stalled_s"] for e in emitted if e["kind"] == "store_stalled"] == [4.5]


def test_a_joiner_with_a_notice_is_not_placed(corpus):
    """node2 joins a job whose one survivor carries both stages, then has a notice: it leaves
    its standby at once, so the boundary's plan does not place it (under load its exit came
    after that plan, which placed it and failed to move a stage there); its exit, code 0,
    then loses nothing and aborts nothing."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True, committed_through=5, flight=6)
    cfg = coord.cfg
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    coord.noticed(Notice("node2", 0, "SIGTERM", 1.0), "node2")
    _at_boundary(coord, "", ["node0"])
    assert "node2" not in Layout.from_json(_record(coord, 1).decision["layout"]).all_nodes
    before = len(emitted)
    coord.node_exited("node2", 0)
    assert emitted[before:] == [] and coord.collecting is None


def test_a_joiner_that_would_wait_on_standby_prepares_nothing(corpus):
    """One node joining a full P = 2 pipeline is one short of a second pipeline: the plan
    leaves it on standby, the groups would be today's nodes again, and a second joiner moments
    later would change the plan anyway. Nothing is prepared; the regroup is still asked."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    cfg = coord.cfg
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    kinds = [e["kind"] for e in emitted]
    assert "join_accepted" in kinds and "regroup_requested" in kinds
    assert "groups_prepared" not in kinds
    [regroup] = _regroup_board(coord, 0, 1)
    assert isinstance(regroup, Regroup)


def test_a_second_joiner_prepares_the_pipeline_the_two_form(corpus):
    """A full P = 2 pipeline; node2 joins, one node short of a second pipeline: nothing is
    prepared, the regroup is asked. node3 joins before the boundary: the plan now forms a
    second pipeline of the two, prepared after the `Regroup` on the generation's board (the
    nodes read on to its last record) and on both joiners' boards, and the boundary's
    Decision takes those groups."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    cfg = coord.cfg
    for node in ("node2", "node3"):
        coord.join(JoinRequest(node, 0.0, cfg.digest(), cfg.model_digest()), node)
    first, second = _regroup_board(coord, 0, 2)
    assert isinstance(first, Regroup) and isinstance(second, Prepare)
    assert Layout.from_json(second.layout).active_nodes == {"node0", "node1", "node2", "node3"}
    for node in ("node2", "node3"):
        opened = board.first(coord.store, keys.join_board(node), Channel(KEY, node),
                             on_refused=lambda why, _: None, timeout_s=5, expect=Prepare)
        assert opened.message == second
    _at_boundary(coord, "", ["node0", "node1"])
    record = _record(coord, 0)
    assert record.decision["action"] == "add_pipeline" and record.prepared
    ended = _regroup_board(coord, 0, 3)[2]
    assert isinstance(ended, Regroup) and ended.ended


def test_two_notices_in_a_generation_prepare_the_layout_without_both(corpus):
    """node1 and then node3 of P = 4 have notices: the second prepares again, for the layout
    the planner gives both departures, and the boundary's Decision (both leaving) takes it."""
    coord, emitted = _coordinator(corpus, 4, ["node0", "node1", "node2", "node3"])
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node1")
    coord.noticed(Notice("node3", 0, "SIGTERM", 1.1), "node3")
    coord.noticed(Notice("node3", 0, "SIGTERM", 1.2), "node3")  # said twice: prepared once
    prepared = [e for e in emitted if e["kind"] == "groups_prepared"]
    assert [p["nodes"] for p in prepared] == [["node0", "node2", "node3"], ["node0", "node2"]]
    for node in ("node0", "node1", "node2", "node3"):
        _report(coord, node, boundary=True, formed=True, committed_through=5, iteration=6,
                leaving=node in ("node1", "node3"), reason="a notice")
    record = _record(coord, 0)
    assert record.prepared
    assert Layout.from_json(record.decision["layout"]).active_nodes == {"node0", "node2"}


def test_a_layout_replaced_in_a_generation_is_not_prepared_again(corpus):
    """Preparations L1, then L2 after another event: were the events to lead back to L1, its
    groups would form a second time under the same store prefix as the abandoned ones. The
    coordinator prepares each layout at most once a generation (the boundary then forms fresh
    groups)."""
    coord, emitted = _coordinator(corpus, 4, ["node0", "node1", "node2", "node3"])
    coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node1")
    first = coord._prepared[1]
    coord.noticed(Notice("node3", 0, "SIGTERM", 1.1), "node3")
    decision = dataclasses.replace(_plan_like(coord), layout=first)
    coord._prepare(0, decision, "back to the first layout")
    assert [e["reason"] for e in emitted if e["kind"] == "groups_prepared"] == [
        "node1 leaves on a notice", "node3 leaves on a notice"]


def _plan_like(coord: Coordinator):
    """A decision of the kind the coordinator prepares (what settle gives its history now)."""
    from spotpipe.plan.recovery import settle

    return settle(coord.history, coord.rules, leaving=["node1"], with_transfers=False)[0].decision


def test_a_joiner_that_received_its_state_in_a_plan_rolled_back_stays_in_the_job(corpus):
    """node2 and node3 join and form a second pipeline; node1, a sender, is lost while the
    states move. node3 misses its stage and is counted out, node0 is untouched, so the plan
    is rolled back; node2 received all it was sent and reports nothing lacking. The layout
    before the plan never listed node2, yet it must stay in the job, waiting to be placed: a
    node that a Decision neither runs, keeps on standby nor counts out leaves the job
    (`Worker._recover_once`), and a healthy node was lost without a word. (Found by a run:
    node2 left with "worker_left" right after the rollback.)"""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    cfg = coord.cfg
    for node in ("node2", "node3"):
        coord.join(JoinRequest(node, 0.0, cfg.digest(), cfg.model_digest()), node)
    coord.report(_boundary(coord, "node0"), "node0")
    coord.report(_boundary(coord, "node1"), "node1")
    add = _plan(coord, 0)
    assert add["action"] == "add_pipeline", add["action"]
    coord.node_exited("node1", -9)
    _report(coord, "node0", untouched=True, committed_through=6)
    _report(coord, "node2", formed=True, untouched=False, committed_through=6)
    _report(coord, "node3", lacking=["stage 1", "replica 0"], committed_through=6)
    agreement = [e for e in emitted if e["kind"] == "agreement"][-1]
    assert agreement.get("rolled_back") and "node2" not in agreement["lost"], agreement
    plan = _plan(coord, 1)
    assert plan["rejoin"] == ["node3"]
    layout = Layout.from_json(plan["layout"])
    assert "node2" in layout.all_nodes, plan["layout"]
    assert "node2" not in coord.left


def test_a_stop_names_the_iteration_in_flight_when_only_a_joiner_reports(corpus):
    """node1 leaves on a notice and hands its stage to node2, which waited on standby; node0,
    the only source, dies while the states move. node2, which never ran an iteration,
    reports iteration -1: the stop names the job's iteration, not that."""
    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    _with_standby(coord, ("node2",))
    coord.report(_boundary(coord, "node0"), "node0")
    coord.report(dataclasses.replace(_boundary(coord, "node1"), leaving=True), "node1")
    assert _plan(coord, 0)["action"] == "handover"
    coord.node_exited("node1", 0)  # (left on its notice, as the plan says)
    coord.node_exited("node0", -9)
    _report(coord, "node2", iteration=-1, committed_through=-1,
            lacking=["stage 1", "replica 0"])
    plan = _plan(coord, 1)
    assert plan["action"] == "stop", plan["action"]
    assert "in iteration 7 (the last committed iteration is 6)" in plan["message"], \
        plan["message"]


@pytest.mark.parametrize("committed", [None, 5])
def test_every_node_lost_with_its_fork_server_is_said_so_with_no_made_up_iteration(
        corpus, committed):
    """Every worker died with the fork server that had started them, so no node reported:
    the stop said "lost node0, node1 in iteration 0 (the last committed iteration is -1)",
    whatever the job had committed, and nothing of the server. It says what the launcher
    knew of the cause, and the iteration the job's own commits tell."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    if committed is not None:
        coord.committed(committed)
    why = "the fork server that starts the workers was killed by SIGKILL, and they died with it"
    coord.node_exited("node0", -9, why)
    coord.node_exited("node1", -9, why)
    plan = _plan(coord, 0)
    assert plan["action"] == "stop", plan["action"]
    when = ("before any iteration was committed" if committed is None
            else "in iteration 6 (the last committed iteration is 5)")
    assert f"(pipeline 0, stage 1) {when}:" in plan["message"], plan["message"]
    assert coord.stop_message == f"{why}; {plan['message']}"
    assert [e.get("reason") for e in emitted if e["kind"] == "node_lost"] == [why, why]


def test_a_node_that_reported_is_not_answered_on_its_join_board(corpus):
    """node0 carries both stages; the rebalance places node2, which receives its state, while
    node0's part fails with its state untouched: the plan is rolled back, node2 waits on
    standby in the layout before it, and the same Decision places it again at once. node2
    reported in that generation and reads the Decision on its board, as every node that
    reported does: a placement answer on its join board too would lie there unread until it
    next waits to be placed, and then place it by a Decision long past."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True)
    assert _plan(coord, 0)["action"] == "failover"
    cfg = coord.cfg
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    coord.report(_boundary(coord, "node0"), "node0")
    assert _plan(coord, 1)["action"] == "rebalance"
    _report(coord, "node0", untouched=True, lacking=["replica 1"], committed_through=6)
    _report(coord, "node2", formed=True, untouched=False, committed_through=6)
    assert [e for e in emitted if e["kind"] == "agreement"][-1].get("rolled_back")
    plan = _plan(coord, 2)
    assert plan["action"] == "rebalance" and "node2" in str(plan["layout"]["owners"])
    answers, slot = [], 1
    while coord.store.check([key := keys.board_slot(keys.join_board("node2"), slot)]):
        message = Channel(KEY, "node2").open(coord.store.get(key), at=key).message
        if isinstance(message, JoinAnswer):
            answers.append(message)
        slot += 1
    assert [a.generation for a in answers] == [1], answers  # (its first placement only)


def test_a_successor_counts_a_standby_node_spare_once_the_plan_committed(corpus):
    """The books say the last plan's first iteration is committed (its metrics line): a
    successor restored from them counts the loss of the node that plan put on standby as
    the coordinator it succeeds does, a spare lost (no abort), not a loss that aborts the
    generation for nothing."""
    from spotpipe.protocol import CoordinatorState

    def at_the_plan(coord: Coordinator) -> None:
        _with_standby(coord, ("node2",))
        coord.history = dataclasses.replace(coord.history, resumed_at=6, before=(
            Layout.build(2, 1, ["node0", "node2"]), coord.history.partition))

    original, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    at_the_plan(original)
    original.committed(6)
    successor, heard = _coordinator(corpus, 2, ["node0", "node1"])
    successor.restore(CoordinatorState(
        **original.books(), cursor=0, journal=0, last_metrics={"iter": 6}, exited={},
        checkpoints={}, admission={}, time_s=0.0))
    for coord, events in ((original, emitted), (successor, heard)):
        coord.node_exited("node2", -9)
        assert [(e["kind"], e["node"]) for e in events] == [("standby_lost", "node2")]
        assert coord.collecting is None
        assert not coord.store.check([keys.board_slot(keys.abort_board(0), 1)])


@pytest.mark.parametrize("again", [False, True])
def test_a_successor_takes_the_groups_its_predecessor_prepared(corpus, again):
    """node1 of P = 3 has a notice and the coordinator has the next layout's groups formed
    ahead; then its host is lost and a successor takes over from its books (same store). The
    boundary's Decision says, as the predecessor's would, that the nodes take the groups they
    formed: from books that forgot the preparation, it told them to form fresh ones (a
    regroup's cost again). `again`: the notice, not yet in the books, is read again from the
    mailbox: it prepares nothing a second time (nor does it keep node1 from being prepared
    for as leaving, which the books forgot too)."""
    from spotpipe.protocol import CoordinatorState

    nodes = ["node0", "node1", "node2"]
    predecessor, _ = _coordinator(corpus, 3, nodes)
    notice = Notice("node1", 0, "SIGTERM", 1.0)
    predecessor.noticed(notice, "node1")
    successor, emitted = _coordinator(corpus, 3, nodes)
    successor.store = successor.liveness.store = predecessor.store
    successor.restore(CoordinatorState(
        **predecessor.books(), cursor=0, journal=0, last_metrics=None, exited={},
        checkpoints={}, admission={}, time_s=0.0))
    if again:
        successor.noticed(notice, "node1")
    assert [e for e in emitted if e["kind"] == "groups_prepared"] == []
    assert successor.leaving_now() == {"node1"}
    _at_boundary(successor, "node1", nodes)
    record = _record(successor, 0)
    assert record.decision["action"] == "repartition" and record.prepared


def test_a_node_that_exits_0_mid_job_after_a_recovery_began_is_lost_saying_so(corpus):
    """A worker ended with code 0 mid-job (os._exit, a C library), its peer's report of the
    broken connection first: the recovery had begun, and the node was lost with no reason
    (the order a loaded machine gives `test_cli_errors`' run of it); it is said as when its
    exit comes first, and its stage is taken over."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    g = coord.generation
    _report(coord, "node0", reason="communication failed: Connection closed by peer")
    assert coord.collecting is not None
    coord.node_exited("node1", 0)
    lost = [(e["node"], e["returncode"], e.get("reason")) for e in emitted
            if e["kind"] == "node_lost"]
    assert lost == [("node1", 0, "it exited with code 0 before the job's end")]
    assert _plan(coord, g)["action"] == "failover"


def test_a_successor_loses_a_node_that_exited_0_before_the_hand_over(corpus):
    """node1 exited with code 0 mid-job while no recovery was under way (a joiner leaving
    standby on its notice just after a plan placed it): its exit is counted when its peers'
    recovery begins. The coordinator then handed its office on. The successor, which no
    exit of node1 will reach again (the predecessor took it in), loses node1 when node0
    reports, as the predecessor would have: from books without it, the agreement waited for
    node1's report to the end of the job (`test_agent`'s office hand-over, under load)."""
    from spotpipe.protocol import CoordinatorState

    predecessor, _ = _coordinator(corpus, 2, ["node0", "node1"])
    predecessor.node_exited("node1", 0)
    assert predecessor.collecting is None and "node1" in predecessor.live
    successor, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    successor.store = successor.liveness.store = predecessor.store
    successor.restore(CoordinatorState(
        **predecessor.books(), cursor=0, journal=0, last_metrics=None, exited={"node1": 0},
        checkpoints={}, admission={}, time_s=0.0))
    g = successor.generation
    _report(successor, "node0", reason="communication failed: Connection closed by peer")
    lost = [(e["node"], e["returncode"], e.get("reason")) for e in emitted
            if e["kind"] == "node_lost"]
    assert lost == [("node1", 0, "it exited with code 0 before the job's end")]
    assert _plan(successor, g)["action"] == "failover"


def test_a_node_fenced_after_its_exit_0_was_taken_in_is_lost_at_once(corpus):
    """A node whose exit (code 0, mid-job, no recovery under way) was taken in is then found
    silent (its beats stopped with it) and fenced: no exit of it will come again, so the
    fence loses it there and then and the recovery decides, rather than wait for an exit its
    kill can no longer bring."""
    coord, emitted = _coordinator(corpus, 2, ["node0", "node1"])
    killed: list[str] = []
    coord.kill = killed.append
    g = coord.generation
    coord.node_exited("node1", 0)
    coord._fence("node1", "no heartbeat for 5.0 s")  # (what `tick` does once it is silent)
    assert killed == []
    assert [e["node"] for e in emitted if e["kind"] == "node_lost"] == ["node1"]
    _report(coord, "node0", reason="communication failed: Connection closed by peer")
    assert _plan(coord, g)["action"] == "failover"


def test_a_generations_records_go_once_the_generations_after_it_end(corpus):
    """Generation g's boards and groups' rendezvous are deleted when the plan that ends
    g + 1 + KEPT_GENERATIONS is published (every node still in the job reported in g + 1,
    and a node that g's plan let go, which reports in no later generation, may still read
    g's Decision a few plans later), and not before; the generations after it keep theirs."""
    from spotpipe.cluster.collect import KEPT_GENERATIONS as kept

    coord, _ = _coordinator(corpus, 2, ["node0", "node1"])
    store = coord.store

    def left(g: int) -> list[str]:
        names = [keys.board_slot(keys.decision_board(g), 1),
                 keys.board_slot(keys.regroup_board(g), 1),
                 keys.board_slot(keys.abort_board(g), 1),
                 f"{keys.groups_prefix(keys.ROOT, g)}/world/0/0",
                 f"{keys.groups_prefix(keys.ROOT, g)}/world/0/1"]
        return [name for name in names if store.check([name])]

    seen = []
    plans = kept + 4
    for g in range(plans):
        assert coord.generation == g
        for rank in range(2):  # (as gloo writes them: tests/test_store_collection.py)
            store.set(f"{keys.groups_prefix(keys.ROOT, g)}/world/0/{rank}", "address")
        for node in ("node0", "node1"):
            _report(coord, node, boundary=True, formed=True, untouched=False,
                    reason="a regroup", iteration=5 + g, committed_through=4 + g)
        assert _plan(coord, g)["generation"] == g + 1
        seen.append([len(left(k)) for k in range(g + 1)])
    # after the plan that ends g: generations before g - kept gone, the others whole
    assert seen[kept] == [5] * (kept + 1)
    assert seen[kept + 1] == [0] + [5] * (kept + 1)
    assert seen[-1] == [0] * 3 + [5] * (kept + 1)
    # a successor (same store) restored from the books of the newest generation: its plan
    # that ends it deletes the generation kept + 1 before, as its predecessor's would have
    from spotpipe.protocol import CoordinatorState

    successor = Coordinator(cfg=coord.cfg, store=store, layout=Layout.build(2, 1, ["node0",
                            "node1"]), kill=lambda node: None, emit=lambda e: None,
                            now=lambda: 0.0, channel=Channel(KEY, "coordinator"),
                            partition=[(0, 1), (1, 2)])
    successor.restore(CoordinatorState(**coord.books(), cursor=0, journal=0, last_metrics=None,
                                       exited={}, checkpoints={}, admission={}, time_s=0.0))
    for node in ("node0", "node1"):
        _report(successor, node, boundary=True, formed=True, untouched=False,
                reason="a regroup", iteration=5 + plans, committed_through=4 + plans)
    assert _plan(successor, plans)["generation"] == plans + 1
    assert left(plans - kept - 1) == [] and len(left(plans - kept)) == 5
    assert len(left(plans)) == 3  # (its groups' keys were not written here)


def test_a_node_a_plan_let_go_is_a_loss_until_that_plan_committed_then_only_said(corpus):
    """node1 of P = 3 leaves on a notice at the boundary of iteration 6. Until the plan's
    first iteration is committed it may still be sending its stages, and its exit (killed
    by the cloud) is a loss like any: the generation is aborted. Once committed, nothing
    needs it: its exit, whatever the code, is said (`left_node_exited`) and aborts
    nothing. Before, that exit started a recovery the job did not need."""
    for commit_first in (False, True):
        coord, emitted = _coordinator(corpus, 3, ["node0", "node1", "node2"])
        coord.noticed(Notice("node1", 0, "SIGTERM", 1.0), "node1")
        _at_boundary(coord, "node1", ["node0", "node1", "node2"])
        assert _plan(coord, 0)["action"] == "repartition" and coord.generation == 1
        assert "node1" in coord.left and not coord.let_go("node1")
        emitted.clear()
        if commit_first:
            coord.committed(6)
            assert coord.let_go("node1")
        coord.node_exited("node1", 1, "RuntimeError: boom (log: node1.log)")
        kinds = [(e["kind"], e["node"]) for e in emitted]
        aborted = coord.store.check([keys.board_slot(keys.abort_board(1), 1)])
        if commit_first:
            assert kinds == [("left_node_exited", "node1")], kinds
            assert emitted[0]["returncode"] == 1 and "boom" in emitted[0]["reason"]
            assert not aborted and coord.collecting is None
        else:
            assert kinds == [("node_lost", "node1"), ("failure_detected", "launcher")], kinds
            assert aborted and coord.collecting is not None
