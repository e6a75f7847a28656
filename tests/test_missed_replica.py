"""A node that missed only its replica when a plan failed keeps its place and its stages.

A plan is carried out over a new generation's groups; a peer lost meanwhile ends it, and each
node reports what it did not receive. A node that lacks a stage does not hold its place and
joins again. One that received its stages but not its replica (the replica of its successor's
stage, which every takeover and copy leans on) runs its stages as placed: the next plan sends
the replica again, and until it has, nothing is taken over or copied from it. Each node's
report says which replica it holds, so the planner reads the layout it plans from (the failed
plan's, or the one before, when the plan is rolled back) the same way.
"""

from __future__ import annotations

import json

from spotpipe.plan import Layout, held_replica, layer_plan
from spotpipe.plan.policy import Action, MoveKind, decide
from spotpipe.plan.recovery import Decision, History, NodeReport, Rules, recover
from spotpipe.plan.transfers import REPLICA, Transfer, transfers

PART = ((0, 1), (1, 2), (2, 3))


def _rules(**extra) -> Rules:
    return Rules(**{"replicas": True, "shadows": False, "repartition": False,
                    "replay_rest": True, "microbatches": 4, **extra})


def _placed() -> tuple[Layout, Layout]:
    """P = 3, D = 1: a0 carried stages 0 and 1 after a1 was lost; the rebalance that failed
    placed the joiner j on stage 1 (copied from a0) with the replica of stage 2 (from a2)."""
    before = Layout.from_mapping(3, 1, {(0, 0): "a0", (0, 1): "a0", (0, 2): "a2"})
    placed = Layout.from_mapping(3, 1, {(0, 0): "a0", (0, 1): "j", (0, 2): "a2"})
    assert held_replica(placed, "j") == 2 and held_replica(placed, "a0") == 1
    return before, placed


def _failed(node: str, *, lacking=(), replica=None, untouched=False) -> NodeReport:
    return NodeReport(node, iteration=7, committed_through=6, formed=False,
                      lacking=tuple(lacking), untouched=untouched, replica=replica)


def test_a_node_that_missed_only_its_replica_keeps_its_stage_and_is_sent_it_again():
    """j received stage 1 and not the replica of stage 2 (a peer was lost first; a0 and a2
    hold theirs). Counted out, j would join again and stage 1 would go back to a0; it stays,
    nobody rejoins, and the next plan sends j the replica from a2, stage 2's owner."""
    before, placed = _placed()
    history = History(placed, PART, generation=3, before=(before, PART), resumed_at=7)
    reports = {"a0": _failed("a0", replica=1), "a2": _failed("a2", replica=0),
               "j": _failed("j", lacking=["replica 2"])}
    out = recover(history, reports, [], _rules())
    d = out.decision
    assert not d.stopped and d.rejoin == () and out.lacking == {}
    assert out.unreplicated == {"j"} and d.unreplicated == ("j",)
    assert d.layout.owner(0, 1) == "j" and d.layout.active_nodes == {"a0", "j", "a2"}
    assert list(d.transfers) == [Transfer(REPLICA, 2, "a2", "j")]
    assert d.receives("j") == ["replica 2"]
    # the Decision carries who lacks a replica to every node (a re-partition reads it)
    assert Decision.from_json(json.loads(json.dumps(d.to_json()))) == d


def test_a_node_lacking_a_stage_is_still_counted_out():
    before, placed = _placed()
    history = History(placed, PART, generation=3, before=(before, PART), resumed_at=7)
    reports = {"a0": _failed("a0", replica=1), "a2": _failed("a2", replica=0),
               "j": _failed("j", lacking=["stage 1", "replica 2"])}
    out = recover(history, reports, [], _rules())
    assert out.decision.rejoin == ("j",) and set(out.lacking) == {"j"}
    assert out.decision.layout.owner(0, 1) == "a0"  # a0's replica of stage 1, promoted


def test_a_replica_that_never_arrived_is_not_taken_over():
    """a2, the sender of stage 2's replica, is the peer lost: stage 2's replica was to be
    j's, which never received it. No replica of stage 2 survives: with shadows the stage is
    restored from its shadow and j keeps stage 1 (counted out before, it would have taken
    stage 1 back to a0 as well); without, the job stops and says why."""
    before, placed = _placed()
    history = History(placed, PART, generation=3, before=(before, PART), resumed_at=7)
    reports = {"a0": _failed("a0", replica=1), "j": _failed("j", lacking=["replica 2"])}
    out = recover(history, reports, [], _rules(shadows=True), dead={"a2"})
    d = out.decision
    assert d.action == Action.RESTORE_FROM_SHADOW and d.rejoin == ()
    assert not [m for m in d.moves if m.kind == MoveKind.PROMOTE]
    assert [(m.kind, m.stage) for m in d.moves] == [(MoveKind.RESTORE, 2)]
    assert d.layout.owner(0, 1) == "j"

    stop = recover(history, reports, [], _rules(), dead={"a2"}).decision
    assert stop.stopped
    assert "j had not received the replica of stage 2 when a peer was lost" in stop.message


def test_a_rolled_back_plan_leaves_the_replica_missing_where_it_was():
    """The plan after the failed one (j to get its replica) fails too, before it changed any
    node: it is rolled back to the layout j lacks its replica in. j's report says it holds
    none, so the replica is sent again, and still nothing is promoted from it."""
    _, placed = _placed()
    retry = Layout.from_mapping(3, 1, {(0, 0): "a0", (0, 1): "j", (0, 2): "a2"},
                                standby=("k",))
    history = History(retry, PART, generation=4, before=(placed, PART), resumed_at=7)
    reports = {"a0": _failed("a0", replica=1, untouched=True),
               "a2": _failed("a2", replica=0, untouched=True),
               "j": _failed("j", lacking=["replica 2"], untouched=True)}
    out = recover(history, reports, [], _rules())
    assert out.rolled_back and out.unreplicated == {"j"}
    assert Transfer(REPLICA, 2, "a2", "j") in out.decision.transfers


def test_a_formed_node_holds_its_layouts_replica():
    """Only a node whose last plan failed can lack its replica: one whose generation formed
    received it, whatever its report's field says (the simulator's boundary reports)."""
    before, placed = _placed()
    history = History(placed, PART, generation=3, before=(before, PART), resumed_at=7)
    reports = {n: NodeReport(n, iteration=7, committed_through=6, boundary=True)
               for n in ("a0", "j", "a2")}
    out = recover(history, reports, [], _rules(), dead={"a2"})
    assert out.unreplicated == frozenset()
    assert [(m.kind, m.dst) for m in out.decision.moves] == [(MoveKind.PROMOTE, "j")]


def test_decide_takes_nothing_from_a_missing_replica():
    """D = 2: b0's replica of stage 1 is missing; b1 lost. Pipeline 1 cannot be repaired in
    place, so it is dropped (not taken over from b0)."""
    lay = Layout.build(2, 2, ["a0", "a1", "b0", "b1"])
    assert held_replica(lay, "b0") == 1
    promoted = decide(lay, {"b1"}, [])
    assert promoted.action == Action.FAILOVER
    assert [(m.kind, m.dst) for m in promoted.moves] == [(MoveKind.PROMOTE, "b0")]
    dropped = decide(lay, {"b1"}, [], unreplicated={"b0"})
    assert dropped.action == Action.DROP_PIPELINE
    assert dropped.layout.grid == (("a0", "a1"),)


def test_transfers_send_a_missing_replica_though_the_layout_keeps_it():
    lay = Layout.build(3, 1, ["a0", "a1", "a2"])
    assert transfers(lay, lay, [], set(), True) == []
    assert transfers(lay, lay, [], set(), True, unreplicated={"a1"}) == [
        Transfer(REPLICA, 2, "a2", "a1")]


def test_a_repartition_takes_no_layer_from_a_missing_replica():
    """P = 3 -> 2 at D = 1: a0 holds layer 1 as stage 1's replica, and its new stage 0 is
    layers 0-1; lacking that replica, a0 receives layer 1 from a1, its owner, and sends none
    of it."""
    old = Layout.build(3, 1, ["a0", "a1", "a2"])
    new = Layout.build(2, 1, ["a0", "a1"])
    new_part = [(0, 2), (2, 3)]
    kept = layer_plan(old, new, list(PART), new_part, True)
    assert not [m for m in kept if m.dst == "a0" and m.layer == 1]
    missing = layer_plan(old, new, list(PART), new_part, True, unreplicated={"a0"})
    assert [m for m in missing if m.dst == "a0" and m.layer == 1] == [
        type(missing[0])(1, "a1", "a0")]
    assert not [m for m in missing if m.src == "a0" and m.layer == 1]
