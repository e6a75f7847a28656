"""A notice starts a planned hand-over (plan.recovery.recover, pure): with a standby node
waiting, the leaving node's stage goes straight to it and nobody carries two stages; without
one, the takeover as after a crash.

The state each node holds is followed here by hand (owned stages and the replica of the next
stage, moved by the Decision's transfers), independently of the planner's own bookkeeping:
every transfer's source must hold what it sends, the leaving node is never a source (it may
vanish at any instant of the notice window), and afterwards every node holds exactly what the
new layout says.
"""

from __future__ import annotations

import pytest

from spotpipe.plan import Action, Layout, held_replica
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


def carry_out(decision, leaving: set[str]) -> dict[str, set[tuple[str, int]]]:
    """The transfers applied to the holdings before the decision (all sends read the state
    before it, as runtime.migrate does)."""
    before = holdings(decision.previous_layout)
    after = {n: set(before.get(n, ())) for n in decision.layout.active_nodes}
    for t in decision.transfers:
        assert t.src not in leaving, f"{t} reads from a node that is leaving"
        src = before[t.src]
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


def test_without_a_standby_node_the_notice_is_a_takeover():
    h = history(3, 1)
    outcomes = settle(h, RULES, leaving={"node1"}, committed=5)
    first = outcomes[0].decision
    assert first.action == Action.FAILOVER
    assert first.layout.carriers() == {"node0": [(0, 0), (0, 1)]}
    assert [o.decision.action for o in outcomes[1:]] == [Action.REPARTITION]


def test_a_crash_with_the_notice_is_a_takeover():
    h = history(4, 1, ("node4", "node5"))
    out = recover(h, reports(h, {"node1"}, dead={"node3"}), [], RULES, dead={"node3"})
    assert out.decision.action == Action.FAILOVER


def test_a_leaving_node_whose_replica_holder_leaves_too_is_a_takeover_or_stop():
    h = history(3, 1, ("node3", "node4"))
    out = recover(h, reports(h, {"node1", "node2"}), [], RULES)
    assert out.decision.action != Action.HANDOVER


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
