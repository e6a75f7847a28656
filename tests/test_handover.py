"""A notice starts a planned hand-over (plan.recovery.recover, pure): with a standby node
waiting, the leaving node's stage goes straight to it and nobody carries two stages; without
one, the takeover as after a crash. Adjacent nodes leaving together (a spot market takes
machines in bulk) hand their stages over themselves: the replica of one went with the other.

The state each node holds is followed here by hand (owned stages and the replica of the next
stage, moved by the Decision's transfers), independently of the planner's own bookkeeping:
every transfer's source must hold what it sends, a leaving node is a source only of what no
node that stays holds (it may vanish at any instant of the notice window), and afterwards
every node holds exactly what the new layout says.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from spotpipe.plan import Action, Layout, held_replica, layer_plan
from spotpipe.plan.layout import uniform_partition
from spotpipe.plan.recovery import History, NodeReport, Rules, recover, settle

RULES = Rules(replicas=True, shadows=False, repartition=True, replay_rest=True, microbatches=4,
              partition_for=lambda depth: tuple((i, i + 1) for i in range(depth)))


def history(stages: int, pipelines: int, standby: tuple[str, ...] = ()) -> History:
    nodes = [f"node{i}" for i in range(stages * pipelines)]
    layout = Layout.build(stages, pipelines, nodes).with_standby(standby)
    return History(layout, tuple((i, i + 1) for i in range(stages)), generation=1,
                   resumed_at=3)


def reports(h: History, leaving: set[str], dead: set[str] = frozenset()) -> dict:
    return {n: NodeReport(n, iteration=6, committed_through=5, leaving=n in leaving)
            for n in sorted(h.layout.active_nodes - dead)}


def holdings(layout: Layout) -> dict[str, set[tuple[str, int]]]:
    """What each node of `layout` holds: its stages and its replica (predecessor's ring)."""
    out: dict[str, set[tuple[str, int]]] = {n: set() for n in layout.active_nodes}
    for (d, s), n in layout.mapping.items():
        out[n].add(("stage", s))
        out[n].add(("replica", (s + 1) % layout.num_stages))
    return out


def carry_out(decision, leaving: set[str],
              gone: set[str] = frozenset()) -> dict[str, set[tuple[str, int]]]:
    """The transfers applied to the holdings before the decision (all sends read the state
    before it, as runtime.migrate does); `gone`: nodes crashed, which send nothing."""
    before = holdings(decision.previous_layout)
    after = {n: set(before.get(n, ())) for n in decision.layout.active_nodes}
    staying = decision.previous_layout.active_nodes - leaving - gone
    assert not {t.src for t in decision.transfers} & gone, "a transfer from a crashed node"
    for t in decision.transfers:
        src = before[t.src]
        if t.src in leaving:
            held = [n for n in staying if ("stage", t.stage) in before[n]
                    or ("replica", t.stage) in before[n]]
            assert not held, f"{t} reads from a node that is leaving, though {held} hold it"
        assert ("stage", t.stage) in src or ("replica", t.stage) in src, \
            f"{t}: {t.src} holds no copy of stage {t.stage}"
        after[t.dst].add((t.kind, t.stage))
    for m in decision.moves:  # promoted replicas become owned stages
        if m.kind.value == "promote":
            after[m.dst].add(("stage", m.stage))
    for n in after:  # what the new layout does not give a node, it drops
        want = {("stage", s) for (_, s), o in decision.layout.mapping.items() if o == n}
        r = held_replica(decision.layout, n)
        after[n] &= want | ({("replica", r)} if r is not None else set())
    return after


@pytest.mark.parametrize("stages,pipelines,leaver", [(3, 1, "node1"), (3, 1, "node2"),
                                                       (2, 2, "node3"), (2, 2, "node0")])
def test_a_notice_with_a_standby_node_hands_the_stage_over(stages, pipelines, leaver):
    spare = f"node{stages * pipelines}"
    h = history(stages, pipelines, (spare,))
    out = recover(h, reports(h, {leaver}), [], RULES)
    d = out.decision
    assert d.action == Action.HANDOVER and out.leaving == {leaver}
    slot = h.layout.stages_of(leaver)[0]
    assert d.layout.owner(*slot) == spare and leaver not in d.layout.all_nodes
    assert d.layout.carriers() == {} and d.previous_layout.carriers() == {}
    assert d.layout.standby == () and d.resume == 6 and d.salvage is None
    # the state, followed by hand: exactly what the new layout says, nobody holds two stages
    got = carry_out(d, {leaver})
    assert got == holdings(d.layout)
    assert all(sum(k == "stage" for k, _ in held) == 1 for held in got.values())
    stage_from = [t for t in d.transfers if t.kind == "stage"]
    assert [(t.stage, t.src, t.dst) for t in stage_from] == [
        (slot[1], h.layout.replica_holder(*slot), spare)]
    # and the layout needs nothing more at the next boundary
    assert not out.improve


LAYERS = 6  # the model of the re-partition tests: 6 layers, split evenly at any depth
SPLIT = Rules(replicas=True, shadows=False, repartition=True, replay_rest=True, microbatches=4,
              partition_for=lambda depth: tuple(uniform_partition(LAYERS, depth)))


def split_history(stages: int, pipelines: int) -> History:
    layout = Layout.build(stages, pipelines, [f"node{i}" for i in range(stages * pipelines)])
    return History(layout, tuple(uniform_partition(LAYERS, stages)), generation=1,
                   resumed_at=3)


def layers_held(layout: Layout, partition, node: str) -> set[int]:
    """A node's layers, by hand: its stages' and its successor's (the replica ring)."""
    p = layout.num_stages
    stages = {s for (_, s), n in layout.mapping.items() if n == node}
    if len(stages) == 1:
        stages.add((next(iter(stages)) + 1) % p)
    return {layer for s in stages for layer in range(*partition[s])}


@pytest.mark.parametrize("stages,pipelines,leaver", [(3, 1, "node1"), (3, 1, "node2"),
                                                       (4, 1, "node0"), (3, 2, "node4")])
def test_without_a_standby_node_the_notice_is_a_re_partition_at_once(stages, pipelines,
                                                                      leaver):
    """No node carries two stages at any point, nothing more is planned at the next
    boundary, and no layer comes from the leaving node: its stage's come from the replica
    its predecessor holds (the layers each node holds are followed by hand)."""
    h = split_history(stages, pipelines)
    outcomes = settle(h, SPLIT, leaving={leaver}, committed=5)
    assert [o.decision.action for o in outcomes] == [Action.REPARTITION]
    d = outcomes[0].decision
    assert d.layout.num_stages == stages - 1 and d.layout.num_pipelines == pipelines
    assert d.layout.carriers() == {} and leaver not in d.layout.all_nodes
    assert "on a notice" in d.reason and d.resume == 6
    moves = layer_plan(d.previous_layout, d.layout, list(d.previous_partition),
                       list(d.partition), True)
    assert moves and leaver not in {m.src for m in moves}
    for m in moves:
        assert m.layer in layers_held(d.previous_layout, d.previous_partition, m.src), m
    for node in d.layout.active_nodes:  # afterwards each holds what the new layout says
        got = layers_held(d.previous_layout, d.previous_partition, node) | {
            m.layer for m in moves if m.dst == node}
        assert layers_held(d.layout, d.partition, node) <= got, node


def test_without_a_standby_node_and_no_re_partition_the_notice_is_a_takeover():
    h = history(3, 1)
    outcomes = settle(h, replace(RULES, repartition=False), leaving={"node1"}, committed=5)
    assert [o.decision.action for o in outcomes] == [Action.FAILOVER]
    assert outcomes[0].decision.layout.carriers() == {"node0": [(0, 0), (0, 1)]}


def test_a_notice_whose_re_partition_cannot_be_made_is_a_takeover():
    """The partitioner refuses the depth (a layer too large for it, say): the job takes the
    stage over rather than run on without it, and says why it keeps a carrier."""
    def refuse(depth: int):
        raise ValueError("no split of this model at that depth")

    h = history(3, 1)
    outcomes = settle(h, replace(RULES, partition_for=refuse), leaving={"node1"}, committed=5)
    first = outcomes[0]
    assert first.decision.action == Action.FAILOVER
    assert first.decision.layout.carriers() == {"node0": [(0, 0), (0, 1)]}
    assert "no split of this model" in (first.refused or "")


@pytest.mark.parametrize("redundancy", [True, False], ids=["adjacent", "no-redundancy"])
def test_a_leaving_stage_without_a_replica_is_handed_over_whole_in_the_re_partition(
        redundancy):
    """P = 4, no standby. node1 and node2 leave together (stage 2's replica went with node1),
    or node2 leaves without redundancy: node2 hands stage 2 whole to node3 (the node a
    takeover would copy it to) before the layers move, and the layer plan takes stage 2's
    layers from node3. One re-partition, no carrier, no layer from a leaving node."""
    rules = replace(SPLIT, replicas=redundancy)
    leaving = {"node1", "node2"} if redundancy else {"node2"}
    h = split_history(4, 1)
    outcomes = settle(h, rules, leaving=leaving, committed=5)
    assert [o.decision.action for o in outcomes] == [Action.REPARTITION]
    d = outcomes[0].decision
    assert d.layout.carriers() == {} and not leaving & d.layout.all_nodes
    assert [tuple(t.to_json()) for t in d.transfers] == [("stage", 2, "node2", "node3")]
    assert d.departing == {"node2"} and d.handover_group() == ["node2", "node3"]
    assert "handed over whole" in d.reason
    moves = layer_plan(d.previous_layout, d.layout, list(d.previous_partition),
                       list(d.partition), redundancy, handed=d.transfers)
    assert not leaving & {m.src for m in moves}
    held = {n: layers_held(d.previous_layout, d.previous_partition, n) if redundancy else
            {layer for (_, s), o in d.previous_layout.mapping.items() if o == n
             for layer in range(*d.previous_partition[s])} for n in d.layout.active_nodes}
    held["node3"] |= set(range(*d.previous_partition[2]))  # handed over whole
    for m in moves:
        assert m.layer in held[m.src], m
    for node in d.layout.active_nodes:
        got = held[node] | {m.layer for m in moves if m.dst == node}
        want = (layers_held(d.layout, d.partition, node) if redundancy else
                {layer for (_, s), o in d.layout.mapping.items() if o == node
                 for layer in range(*d.partition[s])})
        assert want <= got, node

def test_a_crash_with_the_notice_is_a_takeover():
    h = history(4, 1, ("node4", "node5"))
    out = recover(h, reports(h, {"node1"}, dead={"node3"}), [], RULES, dead={"node3"})
    assert out.decision.action == Action.FAILOVER


def test_adjacent_leaving_nodes_hand_over_to_standby_nodes_the_second_from_itself():
    """node1 and node2 leave together: node2's replica went with node1, so node2 sends its
    stage itself; node1's stage comes from the replica node0 holds, as alone."""
    h = history(4, 1, ("node4", "node5"))
    out = recover(h, reports(h, {"node1", "node2"}), [], RULES)
    d = out.decision
    assert d.action == Action.HANDOVER, d.reason
    assert d.layout.owner(0, 1) == "node4" and d.layout.owner(0, 2) == "node5"
    stages = sorted((t.stage, t.src, t.dst) for t in d.transfers if t.kind == "stage")
    assert stages == [(1, "node0", "node4"), (2, "node2", "node5")]
    assert d.departing == {"node2"}
    assert d.handover_group() == sorted({"node2"} | {t.dst for t in d.handed_over})
    got = carry_out(d, {"node1", "node2"})
    assert got == holdings(d.layout)
    assert d.layout.carriers() == {} and not out.improve


def test_adjacent_leaving_nodes_without_standby_are_taken_over_and_copied():
    """P = 4, node1 and node2 leave, nobody waits, and the job may not re-partition: node0
    promotes its replica of stage 1, and stage 2, whose replica holder leaves too, is copied
    from node2 to node3 (forward first: it receives stage 2's activations). Before, this
    stopped the job as a crash of adjacent stages does. (With re-partitions: one, at once,
    `test_a_leaving_stage_without_a_replica_is_handed_over_whole_in_the_re_partition`.)"""
    h = history(4, 1)
    outcomes = settle(h, replace(RULES, repartition=False), leaving={"node1", "node2"},
                      committed=5)
    d = outcomes[0].decision
    assert d.action == Action.FAILOVER, d.reason
    assert d.layout.carriers() == {"node0": [(0, 0), (0, 1)], "node3": [(0, 2), (0, 3)]}
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 2, "node2", "node3")]
    assert d.departing == {"node2"} and "copied to a neighbour from nodes leaving" in d.reason
    # (a node carrying two stages holds no replica: nothing else moves)
    assert carry_out(d, {"node1", "node2"}) == {
        "node0": {("stage", 0), ("stage", 1)}, "node3": {("stage", 2), ("stage", 3)}}
    assert len(outcomes) == 1


def test_a_crash_beside_a_leaving_node_is_repaired_from_what_the_leaving_node_holds():
    """node2 crashed and node1, which holds stage 2's replica, leaves on a notice: it is still
    there at the boundary, so it copies that replica (exact at the boundary, as for a
    promotion) to node3, forward first, before it goes, and node0 promotes its replica of
    stage 1. Before, the job stopped here as for two adjacent crashes, which still stop it.
    The other way round node1's stage is node0's replica, and node2 sends its own."""
    h = history(4, 1)
    out = recover(h, reports(h, {"node1"}, dead={"node2"}), [], RULES, dead={"node2"})
    d = out.decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node0": [(0, 0), (0, 1)], "node3": [(0, 2), (0, 3)]}
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 2, "node1", "node3")]
    assert d.departing == {"node1"} and d.handed_over == d.transfers
    assert carry_out(d, {"node1"}, gone={"node2"}) == {
        "node0": {("stage", 0), ("stage", 1)}, "node3": {("stage", 2), ("stage", 3)}}
    out = recover(h, reports(h, {"node2"}, dead={"node1"}), [], RULES, dead={"node1"})
    d = out.decision
    assert d.action == Action.FAILOVER and d.departing == {"node2"}
    assert [(t.stage, t.src, t.dst) for t in d.transfers] == [(2, "node2", "node3")]
    crashed = recover(h, reports(h, set(), dead={"node1", "node2"}), [], RULES,
                      dead={"node1", "node2"})
    assert crashed.decision.stopped and "adjacent" in crashed.decision.message


def test_a_crash_after_a_node_whose_notice_came_with_it():
    """node1 crashed and node0 leaves on a notice in the same agreement (found by a chaos run
    of two faults): node3 promotes its replica of stage 0, and node0 copies its replica of
    stage 1 to node2 before it goes; the two carry two stages each."""
    h = history(4, 1)
    d = recover(h, reports(h, {"node0"}, dead={"node1"}), [], RULES, dead={"node1"}).decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node3": [(0, 0), (0, 3)], "node2": [(0, 1), (0, 2)]}
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 1, "node0", "node2")]
    assert carry_out(d, {"node0"}, gone={"node1"}) == {
        "node3": {("stage", 0), ("stage", 3)}, "node2": {("stage", 1), ("stage", 2)}}


def test_a_node_carries_more_than_two_stages_where_the_model_fits_in_fewer_nodes():
    """P = 3, node1 and node2 leave together and nobody waits: node0 promotes its replica of
    stage 1 and has room for stage 2 too, which node2 hands it, where the model fits on one
    node's memory (`min_stages` 1; or 2, where a node holds a stage and a replica of half
    the model), and runs all three as a re-partition to one stage would (there is no replica
    ring below two), until nodes join. Where it needs three nodes, no node may carry three
    stages, and the job stops, saying so. Before, it stopped in all three."""
    h = history(3, 1)
    outcomes = settle(h, RULES, leaving={"node1", "node2"}, committed=5)
    d = outcomes[0].decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node0": [(0, 0), (0, 1), (0, 2)]}
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 2, "node2", "node0")]
    assert carry_out(d, {"node1", "node2"}) == {"node0": {("stage", 0), ("stage", 1),
                                                           ("stage", 2)}}
    assert [o.decision.action for o in outcomes[1:]] == []
    two = Rules(**{**RULES.__dict__, "min_stages": 2})
    assert recover(h, reports(h, {"node1", "node2"}), [], two).decision.action == \
        Action.FAILOVER
    three = Rules(**{**RULES.__dict__, "min_stages": 3})
    stopped = recover(h, reports(h, {"node1", "node2"}), [], three).decision
    assert stopped.stopped and "no layout of the 1 surviving node(s)" in stopped.message


def test_a_node_s_memory_decides_how_many_stages_it_carries_where_it_was_measured():
    """The same two nodes leaving as above, with the memory each node has (`Rules.room`,
    which the launch's per-layer estimates answer in a run): where node0 holds three
    stages the job goes on on it, whatever `min_stages` says (the count it implied was a
    stand-in for this), and where it holds two, the job stops."""
    h = history(3, 1)
    seen = []

    def three(depth: int, stages: tuple[int, ...]) -> bool:
        seen.append((depth, stages))
        return True

    roomy = Rules(**{**RULES.__dict__, "min_stages": 3, "room": three})
    d = recover(h, reports(h, {"node1", "node2"}), [], roomy).decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node0": [(0, 0), (0, 1), (0, 2)]}
    assert (3, (0, 1, 2)) in seen  # asked of the stages node0 would run, at this depth
    two = Rules(**{**RULES.__dict__, "room": lambda depth, stages: len(stages) <= 2})
    stopped = recover(h, reports(h, {"node1", "node2"}), [], two).decision
    assert stopped.stopped, stopped
    # what stopped it: room, not a copy lost (as when the two crash)
    assert "could hand their stages over, but no node left has room" in stopped.message
    assert "no replica of one of them survives" not in stopped.message
    crashed = recover(h, reports(h, set(), dead={"node1", "node2"}), [], RULES,
                      dead={"node1", "node2"}).decision
    assert crashed.stopped and "no replica of one of them survives" in crashed.message
    assert "has room" not in crashed.message
    # the last node leaving too: no node is left at all (it said none "has room")
    alone = Layout.from_mapping(3, 1, {(0, 0): "node0", (0, 1): "node0", (0, 2): "node0"})
    last = History(alone, h.partition, resumed_at=h.resumed_at)
    gone = recover(last, reports(last, {"node0"}), [], roomy).decision
    assert gone.stopped and "every node is leaving, so none is left to take them" in \
        gone.message, gone.message


def test_a_stage_is_copied_to_the_nearest_node_whose_memory_holds_it():
    """P = 4: node0 crashes and node1 leaves in one iteration. node3 promotes its replica of
    stage 0; stage 1 (its replica went with node0) is handed over by node1 to the nearest
    node that runs one stage, node2, unless node2's memory cannot hold stages 1 and 2
    together: then to node3, whose memory holds stages 0, 1 and 3 (before, node2 took it
    whatever its memory held)."""
    h = history(4, 1)
    rep = reports(h, {"node1"}, dead={"node0"})
    d = recover(h, rep, [], RULES, dead={"node0"}).decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node3": [(0, 0), (0, 3)], "node2": [(0, 1), (0, 2)]}
    apart = Rules(**{**RULES.__dict__, "room": lambda depth, stages: not {1, 2} <= set(stages)})
    d = recover(h, rep, [], apart, dead={"node0"}).decision
    assert d.action == Action.FAILOVER, d.message
    assert d.layout.carriers() == {"node3": [(0, 0), (0, 1), (0, 3)]}
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 1, "node1", "node3")]
    assert carry_out(d, {"node1"}, gone={"node0"}) == {
        "node3": {("stage", 0), ("stage", 1), ("stage", 3)},
        "node2": {("stage", 2), ("replica", 3)}}
    tight = Rules(**{**RULES.__dict__, "room": lambda depth, stages: len(stages) < 2})
    assert recover(h, rep, [], tight, dead={"node0"}).decision.stopped


def test_a_pipeline_is_dropped_rather_than_left_on_one_node_while_another_runs_whole():
    """P = 3 x D = 2: node1 and node2 of pipeline 0 leave together. node0 could run all
    three of its stages (the model fits on one node), but that pipeline would run at a third
    of the other's pace, and the two step together: pipeline 1 runs whole, so pipeline 0 is
    dropped instead, node0 put on standby (the simulator's p3 trace lost 4 % of its samples
    the other way)."""
    h = history(3, 2)
    d = recover(h, reports(h, {"node1", "node2"}), [], RULES).decision
    assert d.action == Action.DROP_PIPELINE, d.reason
    assert d.layout.num_pipelines == 1 and "node0" in d.layout.standby
    assert d.layout.carriers() == {}


@pytest.mark.parametrize("standby", [("node3",), ()], ids=["standby", "none-waiting"])
def test_without_redundancy_a_notice_hands_the_stage_over_from_the_leaving_node(standby):
    """Redundancy off: no replica anywhere, so a crash stops the job; a notice does not, the
    leaving node sends its stage before it goes (to the standby node, or to its neighbour,
    whose layers the re-partition of the same plan go on from)."""
    rules = Rules(replicas=False, shadows=False, repartition=True, replay_rest=True,
                  microbatches=4, partition_for=RULES.partition_for)
    h = history(3, 1, standby)
    d = recover(h, reports(h, {"node1"}), [], rules).decision
    assert d.action == (Action.HANDOVER if standby else Action.REPARTITION), d.reason
    target = "node3" if standby else "node2"
    assert [(t.kind, t.stage, t.src, t.dst) for t in d.transfers] == [
        ("stage", 1, "node1", target)]
    crashed = recover(h, reports(h, set(), dead={"node1"}), [], rules, dead={"node1"})
    assert crashed.decision.stopped and "redundancy is off" in crashed.decision.message


def test_a_decision_with_a_transfer_from_a_stranger_is_refused():
    from spotpipe.plan.recovery import Decision
    h = history(4, 1, ("node4", "node5"))
    data = recover(h, reports(h, {"node1", "node2"}), [], RULES).decision.to_json()
    data["transfers"][-1][2] = "node9"
    with pytest.raises(ValueError, match="node9"):
        Decision.from_json(data)


def test_too_few_standby_nodes_is_a_takeover():
    h = history(2, 2, ("node4",))
    out = recover(h, reports(h, {"node1", "node2"}), [], RULES)
    assert out.decision.action == Action.FAILOVER


def test_a_joiner_arriving_at_the_notice_boundary_takes_the_stage():
    h = history(3, 1)
    out = recover(h, reports(h, {"node2"}), ["node3"], RULES)
    assert out.decision.action == Action.HANDOVER
    assert out.decision.layout.owner(0, 2) == "node3"


def test_handover_round_trips_through_json():
    from spotpipe.plan.recovery import Decision
    h = history(3, 1, ("node3",))
    d = recover(h, reports(h, {"node1"}), [], RULES).decision
    assert Decision.from_json(d.to_json()) == d


def test_a_notice_s_re_partition_cut_short_is_rolled_back_without_the_leaving_node():
    """P = 4, node1 leaves with no standby: the job re-partitions onto node0, node2 and node3
    at once. node3 crashes in the layer exchange; the others report they lack their new
    stages, their states untouched. node1 was let go and reports no more: it does not keep
    the plan from being rolled back (it did before, and the survivors were counted out as
    lacking their stages), and it is lost in the layout rolled back to. There node0 and
    node2 take stages 1 and 3 over from their replicas."""
    h = split_history(4, 1)
    [first] = settle(h, SPLIT, leaving={"node1"}, committed=5)
    d = first.decision
    assert d.action == Action.REPARTITION and "node1" not in d.layout.all_nodes
    failed = {n: NodeReport(n, iteration=6, committed_through=5, formed=False,
                            lacking=tuple(d.receives(n)), untouched=True,
                            replica=held_replica(h.layout, n))
              for n in ("node0", "node2")}
    out = recover(first.history, failed, [], SPLIT, dead={"node3"})
    assert out.rolled_back and out.lost == {"node1", "node3"}, out
    again = out.decision
    assert again.action == Action.FAILOVER and again.previous_layout == h.layout
    assert sorted((m.stage, m.dst) for m in again.moves) == [(1, "node0"), (3, "node2")]


def test_a_leaving_node_gone_before_its_hand_over_leaves_a_re_partition_rolled_back():
    """node1 and node2 leave together (P = 4, no standby): node2 is to hand stage 2 whole to
    node3 for the re-partition, and is gone first. The re-partition is rolled back; with
    node1 gone too, nothing holds stage 2 and the job stops naming both."""
    h = split_history(4, 1)
    [first] = settle(h, SPLIT, leaving={"node1", "node2"}, committed=5)
    d = first.decision
    assert d.departing == {"node2"}
    failed = {n: NodeReport(n, iteration=6, committed_through=5, formed=False,
                            lacking=tuple(d.receives(n)), untouched=True,
                            replica=held_replica(h.layout, n))
              for n in ("node0", "node3")}
    out = recover(first.history, failed, [], SPLIT, dead={"node2"})
    assert out.rolled_back and out.decision.stopped
    assert out.decision.message.startswith(
        "lost node1 (pipeline 0, stage 1), node2 (pipeline 0, stage 2) in iteration 6"), \
        out.decision.message
    assert "adjacent stages of one pipeline" in out.decision.message


def test_a_notice_s_re_partition_never_hands_a_stage_to_a_node_it_puts_on_standby():
    """P = 4 x D = 2, redundancy off: node1 and node2 leave pipeline 0, node6 pipeline 1.
    node6's stage would go whole to node7, and the re-partition onto five nodes (P = 2) puts
    node7 on standby: the takeover first (every stage copied from its leaving owner), the
    re-partition at the next boundary. With only node6 leaving, node7 stays in the layout,
    and the re-partition is made at once."""
    h = split_history(4, 2)
    rules = replace(SPLIT, replicas=False)
    outcomes = settle(h, rules, leaving={"node1", "node2", "node6"}, committed=5)
    assert [o.decision.action for o in outcomes] == [Action.FAILOVER, Action.REPARTITION]
    assert outcomes[1].decision.layout.standby == ("node7",)
    [once] = settle(h, rules, leaving={"node6"}, committed=5)
    assert once.decision.action == Action.REPARTITION
    assert [tuple(t.to_json()) for t in once.decision.transfers] == [
        ("stage", 2, "node6", "node7")]
    assert "node7" in once.decision.layout.active_nodes


def test_a_layer_plan_refuses_a_stage_handed_to_no_node_of_the_new_layout():
    from spotpipe.plan.transfers import Transfer

    old, new = Layout.build(3, 1, ["a", "b", "c"]), Layout.build(2, 1, ["a", "b"])
    with pytest.raises(ValueError, match="handed to c"):
        layer_plan(old, new, uniform_partition(6, 3), uniform_partition(6, 2), True,
                   handed=[Transfer("stage", 2, "x", "c")])
