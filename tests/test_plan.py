"""Plan decisions: failover, rebalance, pipelines added and dropped, re-partition, restore."""

import pytest

from spotpipe.plan import Action, Layout, MoveKind, decide, layer_moves, uniform_partition


def nodes(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def four_by_one() -> Layout:
    return Layout.build(4, 1, ["a", "b", "c", "d"])


def test_replica_ring_is_predecessor_and_wraps():
    lay = four_by_one()
    assert lay.replica_holder(0, 1) == "a"
    assert lay.replica_holder(0, 0) == "d"  # stage 0's replica lives on the last stage's node
    assert lay.grid == (("a", "b", "c", "d"),)


def test_layout_rejects_missing_or_shared_slots():
    with pytest.raises(ValueError):
        Layout.from_mapping(2, 1, {(0, 0): "a"})
    with pytest.raises(ValueError):
        Layout.from_mapping(1, 2, {(0, 0): "a", (1, 0): "a"})
    with pytest.raises(ValueError):
        Layout.build(2, 2, ["a", "b", "c"])


def test_single_loss_fails_over_to_predecessor():
    d = decide(four_by_one(), {"b"}, [])
    assert d.action == Action.FAILOVER
    assert d.layout.grid == (("a", "a", "c", "d"),)
    assert d.layout.carriers() == {"a": [(0, 0), (0, 1)]}
    assert [(m.kind, m.stage, m.dst) for m in d.moves] == [(MoveKind.PROMOTE, 1, "a")]
    assert not d.needs_restore


def test_last_stage_loss_wraps_to_stage_zero_holder():
    d = decide(four_by_one(), {"a"}, [])
    assert d.action == Action.FAILOVER
    assert d.layout.owner(0, 0) == "d"  # d held the replica of stage 0


def test_two_non_adjacent_losses_both_fail_over():
    d = decide(four_by_one(), {"a", "c"}, [])
    assert d.action == Action.FAILOVER
    assert d.layout.grid == (("d", "b", "b", "d"),)


def test_adjacent_loss_in_only_pipeline_restores_from_shadows():
    lay = Layout.build(4, 1, ["a", "b", "c", "d", "e", "f"])  # two standby: 4 nodes remain
    d = decide(lay, {"b", "c"}, [])
    assert d.action == Action.RESTORE_FROM_CHECKPOINT
    assert d.needs_restore
    assert d.layout.num_stages == 4 and d.layout.num_pipelines == 1
    assert d.layout.active_nodes == {"a", "d", "e", "f"}


def test_loss_next_to_a_carrier_is_fatal():
    after = decide(four_by_one(), {"b"}, []).layout  # a carries stages 0 and 1
    # stage 2's replica was on b (gone); a has no room for it, so losing c is fatal.
    assert not after.has_replica(0, 2)
    d = decide(after, {"c"}, [])
    assert d.action == Action.REPARTITION and d.needs_restore
    assert d.layout.num_stages == 2  # a and d remain


def test_join_rebalances_carrier_before_adding_pipeline():
    after = decide(four_by_one(), {"b"}, []).layout
    d = decide(after, set(), ["e", "f", "g", "h", "i"])
    assert d.action == Action.REBALANCE
    assert d.layout.grid == (("a", "e", "c", "d"),)
    assert any(m.kind == MoveKind.COPY and m.src == "a" and m.dst == "e" for m in d.moves)
    assert any(m.kind == MoveKind.REPLICA and m.stage == 2 and m.dst == "e" for m in d.moves)
    d2 = decide(d.layout, set(), [])
    assert d2.action == Action.ADD_PIPELINE
    assert d2.layout.num_pipelines == 2
    assert d2.layout.grid[1] == ("f", "g", "h", "i")
    assert decide(d2.layout, set(), []).action == Action.KEEP


def test_too_few_standby_for_pipeline_keeps():
    lay = Layout.build(4, 1, nodes("n", 4))
    d = decide(lay, set(), ["x", "y", "z"])
    assert d.action == Action.KEEP
    assert d.layout.standby == ("x", "y", "z")


def test_max_pipelines_caps_growth():
    lay = Layout.build(2, 1, nodes("n", 2), max_pipelines=1)
    assert decide(lay, set(), ["x", "y"]).action == Action.KEEP


def test_pipelines_two_to_one_to_two():
    lay = Layout.build(4, 2, nodes("n", 8))
    d = decide(lay, {"n5", "n6"}, [])  # adjacent stages 1, 2 of pipeline 1
    assert d.action == Action.DROP_PIPELINE
    assert d.lost_pipelines == (1,)
    assert d.layout.num_pipelines == 1
    assert d.layout.grid == (("n0", "n1", "n2", "n3"),)
    assert set(d.layout.standby) == {"n4", "n7"}
    assert not d.needs_restore
    d2 = decide(d.layout, set(), ["m0", "m1"])
    assert d2.action == Action.ADD_PIPELINE
    assert d2.layout.num_pipelines == 2
    assert d2.layout.grid[1] == ("n4", "n7", "m0", "m1")


def test_drop_also_fails_over_surviving_pipeline():
    lay = Layout.build(4, 2, nodes("n", 8))
    d = decide(lay, {"n5", "n6", "n0"}, [])
    assert d.action == Action.DROP_PIPELINE
    assert d.layout.grid == (("n3", "n1", "n2", "n3"),)


def test_repartition_four_to_two_to_four():
    lay = four_by_one()
    d = decide(lay, {"b", "c"}, [])
    assert d.action == Action.REPARTITION
    assert (d.layout.num_stages, d.layout.num_pipelines) == (2, 1)
    assert d.layout.target_stages == 4
    d2 = decide(d.layout, set(), ["x"])
    assert d2.action == Action.KEEP  # 3 nodes: not enough for P = 4, not enough for D = 2
    d3 = decide(d2.layout, set(), ["y"])
    assert d3.action == Action.REPARTITION
    assert (d3.layout.num_stages, d3.layout.num_pipelines) == (4, 1)
    assert not d3.needs_restore


def test_min_stages_stops_and_joins_restart():
    lay = four_by_one()
    d = decide(lay, {"a", "b", "c"}, [], min_stages=2)
    assert d.action == Action.STOP
    assert d.layout.num_pipelines == 0
    assert d.layout.standby == ("d",)
    d2 = decide(d.layout, set(), ["e"], min_stages=2)
    assert d2.action == Action.REPARTITION and d2.needs_restore
    assert d2.layout.num_stages == 2


def test_everything_lost_stops():
    d = decide(four_by_one(), {"a", "b", "c", "d"}, [])
    assert d.action == Action.STOP
    assert decide(d.layout, set(), []).action == Action.STOP


def test_lost_standby_only_is_keep():
    lay = Layout.build(2, 1, ["a", "b", "c"])
    d = decide(lay, {"c"}, [])
    assert d.action == Action.KEEP and d.layout.standby == ()


def test_single_stage_pipeline_has_no_redundancy():
    lay = Layout.build(1, 2, ["a", "b"])
    d = decide(lay, {"a"}, [])
    assert d.action == Action.DROP_PIPELINE and d.layout.grid == (("b",),)


def test_layer_moves():
    old = uniform_partition(8, 4)
    assert old == [(0, 2), (2, 4), (4, 6), (6, 8)]
    new = uniform_partition(8, 2)
    assert layer_moves(old, new) == [(2, 1, 0), (3, 1, 0), (4, 2, 1), (5, 2, 1), (6, 3, 1),
                                     (7, 3, 1)]
    assert layer_moves(new, old) == [(l, b, a) for l, a, b in layer_moves(old, new)]
    assert layer_moves(old, old) == []
    with pytest.raises(ValueError):
        layer_moves(old, [(0, 3), (4, 8)])
    with pytest.raises(ValueError):
        layer_moves(old, [(0, 9)])


def _state_survives(lay: Layout, lost: set[str]) -> bool:
    """Whether every stage's state is on a node not lost: one that owns the stage in some
    pipeline, or the owner of the stage before it there, which holds its replica when it runs
    no other stage (Bamboo's ring; a node running two stages has no room for a replica)."""
    runs = {n: sum(1 for row in lay.grid for m in row if m == n) for n in lay.active_nodes}
    return all(any(row[s] not in lost or (row[s - 1] not in lost and row[s - 1] != row[s]
                                          and runs[row[s - 1]] == 1) for row in lay.grid)
               for s in range(lay.num_stages))


def test_random_event_sequences_keep_layouts_valid():
    """Decisions build layouts unchecked for speed; re-validate them through Layout(...).
    A loss never stops the job nor sends it back to its checkpoint while some survivor holds
    each stage's state, and always does when one stage's is on no survivor."""
    import random

    rng = random.Random(0)
    assembled = 0
    for trial in range(40):
        lay = Layout.build(4, 2, nodes("n", 9), max_pipelines=3)
        fresh = 0
        for _ in range(30):
            live = sorted(lay.all_nodes)
            lost = set(rng.sample(live, k=min(len(live), rng.choice((0, 1, 2, 2, 3, 4)))))
            joined = [f"j{trial}_{fresh + i}" for i in range(rng.randint(0, 3))]
            fresh += len(joined)
            if lost & lay.active_nodes:
                d = decide(lay, lost, joined)
                restarts = d.action == Action.STOP or d.needs_restore
                assert restarts != _state_survives(lay, lost), (lay.to_json(), lost, d)
                assembled += d.action == Action.DROP_PIPELINE and len(d.lost_pipelines) == (
                    lay.num_pipelines)
            for _ in range(8):
                d = decide(lay, lost, joined)
                lost, joined = set(), []
                checked = Layout(d.layout.num_stages, d.layout.num_pipelines, d.layout.owners,
                                 d.layout.standby, d.layout.target_stages,
                                 d.layout.max_pipelines)
                assert checked == d.layout
                assert max((len(v) for v in d.layout.carriers().values()), default=1) <= 2
                lay = d.layout
                if d.action in (Action.KEEP, Action.STOP):
                    break
    assert assembled >= 5  # the sequences did meet pipelines assembled from broken ones


# -- re-partition in place: policy, layer-ownership diff, deadlock-free order ----------------

def test_carriers_without_standby_repartition_down_then_back_up():
    after = decide(four_by_one(), {"b", "d"}, []).layout
    assert after.grid == (("a", "a", "c", "c"),)
    d = decide(after, set(), [])
    assert d.action == Action.REPARTITION and not d.needs_restore
    assert d.layout.grid == (("a", "c"),) and d.layout.target_stages == 4
    assert {(m.kind, m.src) for m in d.moves} == {(MoveKind.LAYERS, "peers")}
    assert not d.layout.has_carriers and d.layout.has_replica(0, 0) and d.layout.has_replica(0, 1)
    assert decide(d.layout, set(), []).action == Action.KEEP
    d2 = decide(d.layout, set(), ["x"])
    assert d2.action == Action.KEEP  # 3 nodes: P = 4 needs 4
    d3 = decide(d2.layout, set(), ["y"])
    assert d3.action == Action.REPARTITION
    # a ran the first half and c the second: they keep their place, joiners fill the gaps
    assert d3.layout.grid == (("a", "x", "c", "y"),)
    assert decide(d3.layout, set(), []).action == Action.KEEP


def test_repartition_keeps_the_number_of_pipelines():
    lay = Layout.build(4, 2, nodes("n", 8))
    after = decide(lay, {"n1", "n3"}, []).layout  # pipeline 0 keeps 2 nodes, pipeline 1 all 4
    d = decide(after, set(), [])
    assert d.action == Action.REPARTITION
    assert (d.layout.num_stages, d.layout.num_pipelines) == (3, 2)
    checked = Layout(d.layout.num_stages, d.layout.num_pipelines, d.layout.owners,
                     d.layout.standby, d.layout.target_stages)
    assert checked == d.layout and not d.layout.has_carriers and d.layout.standby == ()
    assert set(d.layout.grid[0]) >= {"n0", "n2"}  # pipeline 1 lent pipeline 0 a node
    # back to P = 4 only when both pipelines can have it: 6 + 1 nodes are not enough
    assert decide(d.layout, set(), ["x"]).action == Action.KEEP
    up = decide(d.layout, set(), ["x", "y"])
    assert up.action == Action.REPARTITION and (up.layout.num_stages,
                                                up.layout.num_pipelines) == (4, 2)


def test_no_repartition_below_two_stages_or_min_stages():
    after = decide(Layout.build(2, 1, ["a", "b"]), {"b"}, []).layout  # a carries both
    assert decide(after, set(), []).action == Action.KEEP
    after = decide(Layout.build(6, 1, nodes("n", 6)), {"n1", "n3", "n5"}, []).layout
    assert decide(after, set(), [], min_stages=4).action == Action.KEEP
    assert decide(after, set(), [], min_stages=3).layout.num_stages == 3


def test_spread_keeps_order_and_room():
    from spotpipe.plan.policy import spread

    assert spread([0, 2], 4, 2) == [0, 1]
    assert spread([0, 1], 2, 4) == [0, 2]
    assert spread([0, 1, 2], 4, 3) == [0, 1, 2]
    assert spread([3], 4, 2) == [1]
    assert spread([2, 3], 4, 3) == [1, 2]


def test_layer_plan_moves_only_what_is_missing():
    from spotpipe.plan import LayerMove, layer_plan

    p4, p2 = uniform_partition(4, 4), uniform_partition(4, 2)
    carried = Layout.from_mapping(4, 1, {(0, 0): "a", (0, 1): "a", (0, 2): "c", (0, 3): "c"})
    two = Layout.build(2, 1, ["a", "c"], target_stages=4)
    # a keeps layers 0-1 (its own, one of them a promoted replica) and gets its new replica
    assert layer_plan(carried, two, p4, p2, redundancy=True) == [
        LayerMove(2, "c", "a"), LayerMove(3, "c", "a"), LayerMove(0, "a", "c"),
        LayerMove(1, "a", "c")]
    assert layer_plan(carried, two, p4, p2, redundancy=False) == []
    four = Layout.build(4, 1, ["a", "x", "c", "y"])
    up = layer_plan(two, four, p2, p4, redundancy=True)
    # a and c hold everything (own half + replica of the other); joiners get two layers each,
    # spread over both holders
    assert sorted((m.dst, m.layer) for m in up) == [("x", 1), ("x", 2), ("y", 0), ("y", 3)]
    assert {m.src for m in up} == {"a", "c"}
    assert all(m.src not in ("x", "y") for m in up)
    with pytest.raises(ValueError):
        layer_plan(two, Layout.build(4, 1, ["x", "y", "z", "w"]), p2, p4, redundancy=True)


def _completes(orders: dict[str, list[tuple[str, str]]]) -> bool:
    """Run every node's ops as blocking rendezvous: a send to q finishes only together with
    q's receive from this node. True when all finish, False on a deadlock."""
    pos = {n: 0 for n in orders}
    while True:
        moved = False
        for n, ops in orders.items():
            if pos[n] < len(ops) and ops[pos[n]][0] == "send":
                q = ops[pos[n]][1]
                if pos[q] < len(orders[q]) and orders[q][pos[q]] == ("recv", n):
                    pos[n] += 1
                    pos[q] += 1
                    moved = True
        if not moved:
            return all(pos[n] == len(ops) for n, ops in orders.items())


def test_exchange_order_cannot_deadlock():
    import random

    from spotpipe.plan import LayerMove, exchange_order

    names = nodes("n", 6)
    assert not _completes({"a": [("recv", "b"), ("send", "b")],
                           "b": [("recv", "a"), ("send", "a")]})  # the check can fail
    rng = random.Random(3)
    for _ in range(200):
        moves = [LayerMove(rng.randrange(8), *rng.sample(names, 2))
                 for _ in range(rng.randint(1, 12))]
        ranks = {n: i for i, n in enumerate(rng.sample(names, len(names)))}
        orders = {n: exchange_order(moves, n, ranks) for n in names}
        assert _completes(orders)
        sent = sorted((n, peer) for n, ops in orders.items() for op, peer in ops if op == "send")
        assert sent == sorted({(m.src, m.dst) for m in moves})


def test_repartitions_through_random_events_keep_every_layer_reachable():
    """Whatever failovers and joins did before, a re-partition finds a live holder for every
    layer that a node of the new layout needs."""
    import random

    from spotpipe.plan import layer_plan

    rng = random.Random(1)
    seen = 0
    for trial in range(60):
        lay = Layout.build(4, rng.choice([1, 2]), nodes("n", 8))
        lay = Layout.build(4, lay.num_pipelines, sorted(lay.active_nodes))
        parts = {p: uniform_partition(8, p) for p in range(1, 5)}
        fresh = 0
        for _ in range(12):
            live = sorted(lay.active_nodes)
            lost = set(rng.sample(live, k=rng.randint(0, 1)))
            joined = [f"j{trial}_{fresh}"] if rng.random() < 0.3 else []
            fresh += len(joined)
            d = decide(lay, lost, joined)
            if d.action == Action.REPARTITION and not d.needs_restore:
                seen += 1
                layer_plan(lay, d.layout, parts[lay.num_stages], parts[d.layout.num_stages],
                           redundancy=True)
            if d.action == Action.STOP or d.layout.num_pipelines == 0:
                break
            lay = d.layout
    assert seen > 10


def test_without_repartition_carriers_carry_on():
    """`failover.repartition: false`: after a failover the carrier keeps both stages."""
    lay = Layout.build(4, 1, ["n0", "n1", "n2", "n3"])
    after = decide(lay, {"n1"}, []).layout
    assert after.has_carriers
    assert decide(after, set(), []).action == Action.REPARTITION
    assert decide(after, set(), [], repartition=False).action == Action.KEEP


def test_a_dropped_pipeline_frees_its_nodes_in_slot_order_not_name_order():
    """Ties are broken by where nodes stand, never by their names: the simulator replays a
    decision for other nodes in the same places (`sim.planmemo`), which is exact only if
    the names played no part."""
    lay = Layout.from_mapping(4, 2, {**{(0, s): f"n{s}" for s in range(4)},
                                     **{(1, s): n for s, n in enumerate("zyxw")}})
    d = decide(lay, {"y", "x"}, [])  # adjacent stages 1 and 2 of pipeline 1
    assert d.action == Action.DROP_PIPELINE
    assert d.layout.standby == ("z", "w")  # stage 0's owner first, though "w" < "z"


def test_a_rebalance_relieves_carriers_by_their_first_stage_not_their_names():
    lay = Layout.from_mapping(4, 2, {**{(0, s): n for s, n in enumerate("pqrs")},
                                     **{(1, s): n for s, n in enumerate("abcd")}})
    after = decide(lay, {"q", "b"}, []).layout  # p and a each carry two stages
    assert after.carriers() == {"p": [(0, 0), (0, 1)], "a": [(1, 0), (1, 1)]}
    d = decide(after, set(), ["x"])  # one standby node for two carriers
    assert d.action == Action.REBALANCE
    assert d.layout.owner(0, 1) == "x"  # pipeline 0's carrier first, though "a" < "p"
    assert d.layout.carriers() == {"a": [(1, 0), (1, 1)]}


def test_growth_reaches_the_next_width_the_micro_batches_split_over_at_once():
    """8 micro-batches split over 1, 2, 4 or 8 pipelines, not 3: at D = 2 with four spares,
    two pipelines form in one decision; with two spares, nothing (D = 3 would not run)."""
    lay = Layout.build(2, 2, nodes("n", 4))
    d = decide(lay, set(), nodes("s", 4), microbatches=8)
    assert d.action == Action.ADD_PIPELINE
    assert d.layout.grid == (("n0", "n1"), ("n2", "n3"), ("s0", "s1"), ("s2", "s3"))
    assert d.layout.standby == ()
    copies = {(m.pipeline, m.stage, m.src, m.dst) for m in d.moves if m.kind == MoveKind.COPY}
    assert copies == {(2, 0, "n0", "s0"), (2, 1, "n1", "s1"), (3, 0, "n2", "s2"),
                      (3, 1, "n3", "s3")}
    d = decide(lay, set(), nodes("s", 3), microbatches=8)
    assert d.action == Action.KEEP and d.layout.standby == ("s0", "s1", "s2")
    # without the batch's constraint: as many as the spares make up
    assert decide(lay, set(), nodes("s", 3)).layout.num_pipelines == 3


def test_spares_form_every_pipeline_they_can_in_one_decision_copied_from_each_pipeline():
    """D = 2, eight spares at P = 2, 12 micro-batches: D = 6 in one decision (one pause, where
    it used to take four); the new pipelines copy from pipelines 0 and 1 in turn."""
    lay = Layout.build(2, 2, nodes("n", 4))
    d = decide(lay, set(), nodes("s", 8), microbatches=12)
    assert d.action == Action.ADD_PIPELINE and d.layout.num_pipelines == 6
    assert d.reason == "standby nodes form pipelines 2-5"
    copies = sorted((m.pipeline, m.stage, m.src) for m in d.moves if m.kind == MoveKind.COPY)
    assert copies == [(2, 0, "n0"), (2, 1, "n1"), (3, 0, "n2"), (3, 1, "n3"),
                      (4, 0, "n0"), (4, 1, "n1"), (5, 0, "n2"), (5, 1, "n3")]
    # 16 micro-batches split over 4 pipelines, not 5 or 6: two form, four spares wait
    d = decide(lay, set(), nodes("s", 8), microbatches=16)
    assert d.layout.num_pipelines == 4 and d.layout.standby == tuple(nodes("s", 8)[4:])


def test_a_drop_keeps_the_widest_split_and_puts_a_whole_pipeline_on_standby():
    """D = 4 with 8 micro-batches; pipeline 0 loses adjacent stages. Three pipelines would not
    split the batch (this used to stop the job): two are kept, the third goes to standby.
    Pipeline 2 lost a stage too (a takeover), so it is the one set aside, not pipeline 3."""
    lay = Layout.build(2, 4, nodes("n", 8))
    d = decide(lay, {"n0", "n1", "n4"}, [], microbatches=8)
    assert d.action == Action.DROP_PIPELINE
    assert d.layout.grid == (("n2", "n3"), ("n6", "n7"))
    assert set(d.layout.standby) == {"n5"}
    assert d.lost_pipelines == (0, 2)
    assert not [m for m in d.moves if m.kind == MoveKind.PROMOTE]
    assert "micro-batches split over 2 pipelines, not 3" in d.reason
    # nothing lost elsewhere: the last pipeline is the one set aside
    d = decide(lay, {"n0", "n1"}, [], microbatches=8)
    assert d.layout.grid == (("n2", "n3"), ("n4", "n5")) and set(d.layout.standby) == {"n6", "n7"}


def test_a_restart_runs_as_many_pipelines_as_the_micro_batches_split_over():
    """Everything lost but six nodes on standby, P = 2, 8 micro-batches: D = 2 (three
    pipelines would not split the batch), two nodes wait."""
    lay = Layout.build(2, 2, nodes("n", 4)).with_standby(tuple(nodes("s", 6)))
    d = decide(lay, set(nodes("n", 4)), [], shadows=True, microbatches=8)
    assert d.action == Action.RESTORE_FROM_CHECKPOINT
    assert d.layout.num_pipelines == 2 and len(d.layout.standby) == 2
    assert decide(lay, set(nodes("n", 4)), [], shadows=True).layout.num_pipelines == 3


def test_shadows_repair_the_pipeline_that_keeps_a_node_and_drop_the_one_wholly_lost():
    """Every pipeline broken, one of them wholly lost: the shadows repair the pipeline that
    keeps a live node (the lost one held the same state, data parallel) and the job goes on at
    D = 1. Before, one pipeline with no live node sent the whole job to a restart from its
    checkpoint, which the runtime does not carry out: it stopped, with the state at hand."""
    lay = Layout.build(3, 2, ["a", "b", "c", "d", "e", "f", "g"])  # g waits on standby
    d = decide(lay, {"b", "c", "d", "e", "f"}, [], shadows=True, microbatches=4)
    assert d.action == Action.RESTORE_FROM_SHADOW
    assert d.layout.grid == (("a", "a", "g"),) and d.layout.standby == ()
    assert [(m.kind, m.pipeline, m.stage, m.dst) for m in d.moves] == [
        (MoveKind.PROMOTE, 0, 1, "a"), (MoveKind.RESTORE, 0, 2, "g")]
    assert d.lost_pipelines == (1,)
    # the pipeline wholly lost may be pipeline 0: the survivor's becomes pipeline 0
    d = decide(lay, {"a", "b", "c", "e", "f"}, [], shadows=True, microbatches=4)
    assert d.action == Action.RESTORE_FROM_SHADOW
    assert d.layout.grid == (("d", "d", "g"),) and d.lost_pipelines == (0,)


# -- every pipeline broken, yet every stage's state on some survivor: assemble ----------------

def _three_by_two(*standby: str) -> Layout:
    """P = 3 x D = 2: a0 a1 a2 / b0 b1 b2 (a0 holds stage 1's replica, b1 stage 2's)."""
    return Layout.build(3, 2, ["a0", "a1", "a2", "b0", "b1", "b2", *standby])


def _assemble_rules(**extra):
    from spotpipe.plan.recovery import Rules

    return Rules(**{"replicas": True, "shadows": False, "repartition": True,
                    "replay_rest": True, "microbatches": 4, **extra})


def test_two_broken_pipelines_assemble_one_from_their_survivors():
    """Pipeline 0 keeps a0 (stage 0, stage 1's replica), pipeline 1 keeps b1 (stage 1, stage
    2's replica): neither can be repaired from memory, but together they hold every stage.
    One pipeline of them: a0 keeps stage 0, b1 stage 1 and takes over stage 2 from its
    replica (as after a failover). Before, the job stopped (a restart, in the simulator)."""
    from spotpipe.plan.recovery import History, recover

    lost = {"a1", "a2", "b0", "b2"}
    d = decide(_three_by_two(), lost, [], microbatches=4)
    assert d.action == Action.DROP_PIPELINE and not d.needs_restore
    assert d.layout.grid == (("a0", "b1", "b1"),) and d.layout.standby == ()
    assert [(m.kind, m.pipeline, m.stage, m.src, m.dst) for m in d.moves] == [
        (MoveKind.PROMOTE, 0, 2, "b1", "b1")]
    assert d.lost_pipelines == (0, 1)
    # nothing travels: a0 keeps the replica of stage 1 (now fed by b1), b1 carries two stages
    out = recover(History(_three_by_two(), ((0, 1), (1, 2), (2, 3))), {}, [], _assemble_rules(),
                  dead=lost)
    assert not out.decision.stopped and out.decision.layout == d.layout
    assert out.decision.transfers == () and out.decision.salvage is None
    # the carrier then goes as a failover's does: a re-partition down, or a standby node
    assert decide(d.layout, set(), []).layout.grid == (("a0", "b1"),)
    d = decide(_three_by_two("x"), lost, [])
    assert d.layout.grid == (("a0", "b1", "b1"),) and d.layout.standby == ("x",)
    after = decide(d.layout, set(), [])
    assert after.action == Action.REBALANCE and after.layout.grid == (("a0", "b1", "x"),)


def test_survivors_and_spares_assemble_as_many_pipelines_as_they_make_up():
    """With four spares the survivors make two pipelines: pipeline 0 as above, pipeline 1
    copied onto spares from pipeline 0's owners (stage 2 from b1 once it has promoted it).
    Replicas come from a live owner, or from pipeline 0's owner for stage 2, which none owned.
    Three micro-batches do not split over two pipelines: one is assembled, spares wait."""
    from spotpipe.plan.recovery import History, recover
    from spotpipe.plan.transfers import Transfer

    lay = _three_by_two("s0", "s1", "s2", "s3")
    lost = {"a1", "a2", "b0", "b2"}
    d = decide(lay, lost, [], microbatches=4)
    assert d.action == Action.DROP_PIPELINE
    assert d.layout.grid == (("a0", "b1", "b1"), ("s0", "s1", "s2"))
    assert d.layout.standby == ("s3",)
    assert [(m.kind, m.pipeline, m.stage, m.src, m.dst) for m in d.moves] == [
        (MoveKind.PROMOTE, 0, 2, "b1", "b1"), (MoveKind.COPY, 1, 0, "a0", "s0"),
        (MoveKind.COPY, 1, 1, "b1", "s1"), (MoveKind.COPY, 1, 2, "b1", "s2")]
    out = recover(History(lay, ((0, 1), (1, 2), (2, 3))), {}, [], _assemble_rules(), dead=lost)
    assert out.decision.transfers == (
        Transfer("stage", 0, "a0", "s0"), Transfer("stage", 1, "b1", "s1"),
        Transfer("stage", 2, "b1", "s2"), Transfer("replica", 1, "b1", "s0"),
        Transfer("replica", 2, "b1", "s1"), Transfer("replica", 0, "a0", "s2"))
    d = decide(lay, lost, [], microbatches=3)
    assert d.layout.grid == (("a0", "b1", "b1"),)
    assert d.layout.standby == ("s0", "s1", "s2", "s3")


def test_owners_of_two_broken_pipelines_assemble_one_without_replicas():
    """Redundancy off: a1 and b2 lost break both pipelines, yet a0/b0, b1 and a2 own stages
    0, 1 and 2. One pipeline of the owners, in slot order (a0 before b0), nothing moves."""
    d = decide(_three_by_two(), {"a1", "b2"}, [], replicas=False)
    assert d.action == Action.DROP_PIPELINE and d.moves == ()
    assert d.layout.grid == (("a0", "b1", "a2"),) and d.layout.standby == ("b0",)


def test_shadows_repair_rather_than_assemble_fewer_pipelines():
    """With shadows both broken pipelines keep a live node, so a shadow repair keeps D = 2;
    two survivors assemble only one pipeline: the repair is chosen. With four spares the
    assembly keeps D = 2 too, and restores nothing: it is chosen."""
    lost = {"a1", "a2", "b0", "b2"}
    d = decide(_three_by_two(), lost, [], shadows=True, microbatches=4)
    assert d.action == Action.RESTORE_FROM_SHADOW and d.layout.num_pipelines == 2
    d = decide(_three_by_two("s0", "s1", "s2", "s3"), lost, [], shadows=True, microbatches=4)
    assert d.action == Action.DROP_PIPELINE and d.layout.num_pipelines == 2
    assert not d.needs_restore


def test_a_stage_no_survivor_holds_still_restarts_or_stops():
    """Stage 2 is owned by a2 and b2 and its replicas are held by a1 and b1: with all four
    lost no survivor holds it, so the job restores from its shadows/checkpoint (here at
    P = 2 on a0 and b0), or stops when that is below the depth that fits, and `recover`
    without restarts stops, saying so."""
    from spotpipe.plan.recovery import History, recover

    lost = {"a1", "a2", "b1", "b2"}
    d = decide(_three_by_two(), lost, [])
    assert d.action == Action.REPARTITION and d.needs_restore
    assert d.layout.grid == (("a0", "b0"),)
    assert decide(_three_by_two(), lost, [], min_stages=3).action == Action.STOP
    out = recover(History(_three_by_two(), ((0, 1), (1, 2), (2, 3))), {}, [],
                  _assemble_rules(partition_for=lambda p: tuple((s, s + 1) for s in range(p))),
                  dead=lost)
    assert out.decision.stopped
    assert "no layout of the 2 surviving node(s) can hold the job's state" in out.decision.message
    # (it says what stopped it, not what a restart would have restored: nothing was)
    assert ("(no pipeline can be repaired from memory; shadow.enabled would restore the lost "
            "stages from CPU shadows); stopping") in out.decision.message
    assert "restored" not in out.decision.message
    # the lost replica holders matter: with b1 alive, stage 2 is on it, and the job goes on
    d = decide(_three_by_two(), {"a1", "a2", "b0", "b2"}, [])
    assert d.action == Action.DROP_PIPELINE


# -- without redundancy: a loss breaks its own pipeline, not the job -------------------------

def _plain_rules(**extra):
    """A job with `redundancy: none` and no shadows (the runtime's rules; the simulator's add
    `restarts`)."""
    from spotpipe.plan.recovery import Rules

    return Rules(**{"replicas": False, "shadows": False, "repartition": True,
                    "replay_rest": True, "microbatches": 4, **extra})


def _reports_in_flight(nodes, iteration=5):
    """Every survivor was in `iteration` (nothing of it committed) and did part of it."""
    from spotpipe.plan.recovery import NodeReport

    return {n: NodeReport(n, iteration=iteration, committed_through=iteration - 1,
                          flight=iteration, done=(("forward", 0, 0),)) for n in nodes}


def test_without_redundancy_a_loss_drops_its_pipeline_and_the_iteration_is_replayed_whole():
    """P = 2 x D = 2 without redundancy, a0 (pipeline 0, stage 0) lost in iteration 5:
    pipeline 1's owners hold every stage, so pipeline 0 is dropped and the job goes on at
    D = 1 from iteration 5 (the job stopped here before). Nobody holds a replica to take
    a0's share over from, so every survivor replays iteration 5 whole (no salvage), and
    nothing moves. The simulator, which restarts a stopped job, drops it too."""
    from spotpipe.plan.recovery import History, recover

    lay = Layout.build(2, 2, ["a0", "a1", "b0", "b1"])
    for rules in (_plain_rules(), _plain_rules(restarts=True)):
        out = recover(History(lay, ((0, 1), (1, 2)), resumed_at=2),
                      _reports_in_flight(["a1", "b0", "b1"]), [], rules, dead={"a0"})
        d = out.decision
        assert d.action == Action.DROP_PIPELINE and d.message == ""
        assert d.layout.grid == (("b0", "b1"),) and d.layout.standby == ("a1",)
        assert d.resume == 5 and d.salvage is None
        assert d.moves == () and d.transfers == ()
        assert "redundancy is off" in d.reason and "adjacent" not in d.reason


def test_without_redundancy_a_stage_lost_in_every_pipeline_stops_naming_it():
    """a0 and b0, stage 0's only owners, lost: no layout of the survivors holds stage 0, so
    the job stops and says which nodes went, where, and what would have kept the stage. The
    simulator restarts from the checkpoint instead, on the two survivors. With a0 and b1
    lost instead, every pipeline is broken yet b0 and a1 own stages 0 and 1: they make up
    one pipeline, nothing moves."""
    from spotpipe.plan.recovery import History, recover

    lay = Layout.build(2, 2, ["a0", "a1", "b0", "b1"])
    out = recover(History(lay, ((0, 1), (1, 2))), _reports_in_flight(["a1", "b1"]), [],
                  _plain_rules(), dead={"a0", "b0"})
    assert out.decision.stopped
    assert out.decision.message.startswith(
        "lost a0 (pipeline 0, stage 0), b0 (pipeline 1, stage 0) in iteration 5 (the last "
        "committed iteration is 4); redundancy is off, so no other node holds stage 0 "
        "(set redundancy: lazy or eager, or shadow.enabled)")
    out = recover(History(lay, ((0, 1), (1, 2))), _reports_in_flight(["a1", "b1"]), [],
                  _plain_rules(restarts=True), dead={"a0", "b0"})
    assert out.decision.action == Action.RESTORE_FROM_CHECKPOINT
    assert out.decision.layout.grid == (("a1", "b1"),)
    out = recover(History(lay, ((0, 1), (1, 2))), _reports_in_flight(["a1", "b0"]), [],
                  _plain_rules(), dead={"a0", "b1"})
    assert out.decision.action == Action.DROP_PIPELINE
    assert out.decision.layout.grid == (("b0", "a1"),) and out.decision.transfers == ()


def test_without_redundancy_a_loss_in_the_only_pipeline_stops():
    """D = 1: stage 1's one owner lost, nothing else holds it."""
    from spotpipe.plan.recovery import History, NodeReport, recover

    lay = Layout.build(2, 1, ["n0", "n1"])
    out = recover(History(lay, ((0, 1), (1, 2))), _reports_in_flight(["n0"]), [],
                  _plain_rules(), dead={"n1"})
    assert out.decision.stopped
    assert out.decision.message.startswith(
        "lost n1 (pipeline 0, stage 1) in iteration 5 (the last committed iteration is 4); "
        "redundancy is off, so no other node holds stage 1")
    # a survivor at a boundary reports the iteration it committed last: the loss is in the
    # next one (it said "in iteration 5 (the last committed iteration is 5)")
    at_boundary = {"n0": NodeReport("n0", iteration=5, committed_through=5, boundary=True)}
    out = recover(History(lay, ((0, 1), (1, 2))), at_boundary, [], _plain_rules(),
                  dead={"n1"})
    assert "lost n1 (pipeline 0, stage 1) in iteration 6 (the last committed iteration " \
           "is 5); " in out.decision.message, out.decision.message
    # a carrier lost is named with both its stages (it said "stage 2" of one running 1 and 2)
    carrier = Layout.from_mapping(3, 1, {(0, 0): "n0", (0, 1): "n1", (0, 2): "n1"})
    out = recover(History(carrier, ((0, 1), (1, 2), (2, 3))), at_boundary, [],
                  _plain_rules(), dead={"n1"})
    assert out.decision.message.startswith("lost n1 (pipeline 0, stages 1, 2) in iteration 6"), \
        out.decision.message



def test_a_stop_says_a_carrier_holds_no_replica():
    """P = 4 after an earlier loss: n3 runs stages 3 and 0, and a node running two stages
    holds no replica, so n1's stage 1 has none when n1 is lost. The stop says so (it said
    only that no layout could hold the job's state)."""
    from spotpipe.plan.recovery import History, NodeReport, recover

    lay = Layout.from_mapping(4, 1, {(0, 0): "n3", (0, 1): "n1", (0, 2): "n2", (0, 3): "n3"})
    reports = {n: NodeReport(n, iteration=6, committed_through=5) for n in ("n2", "n3")}
    out = recover(History(lay, ((0, 1), (1, 2), (2, 3), (3, 4))), reports, [],
                  _plain_rules(replicas=True), dead={"n1"})
    assert out.decision.stopped
    assert ("lost n1 (pipeline 0, stage 1) in iteration 6 (the last committed iteration is 5): "
            "n3 runs stages 0, 3 and so holds no replica of stage 1 (since an earlier loss); "
            "no layout") in out.decision.message, out.decision.message


def test_a_stop_when_the_last_node_is_lost_says_none_is_left():
    """The last node, running every stage since earlier losses, is lost: the stop says no
    node is left (it said "adjacent stages of one pipeline", true but beside the point)."""
    from spotpipe.plan.recovery import History, recover

    lay = Layout.from_mapping(2, 1, {(0, 0): "n1", (0, 1): "n1"})
    out = recover(History(lay, ((0, 1), (1, 2))), {}, [], _plain_rules(replicas=True),
                  dead={"n1"})
    message = out.decision.message
    assert out.decision.stopped and "adjacent" not in message, message
    assert message.startswith("lost n1 (pipeline 0, stages 0, 1) ") and (
        "no node of the job is left, so no copy of its state survives in memory; ") in message


def test_a_shadow_repair_restores_onto_a_node_that_runs_one_stage():
    """Stage 2 lost with no replica (redundancy off), shadows on: its nearest live node
    forward, d, already carries stages 3 and 4; a third would not fit where a node's memory
    holds its stage and one replica. b, one stage back, takes it instead."""
    layout = Layout.from_mapping(5, 1, {(0, 0): "a", (0, 1): "b", (0, 2): "c", (0, 3): "d",
                                        (0, 4): "d"}, ())
    d = decide(layout, {"c"}, [], shadows=True, replicas=False)
    assert d.action == Action.RESTORE_FROM_SHADOW, d.reason
    assert [(m.kind, m.stage, m.dst) for m in d.moves] == [(MoveKind.RESTORE, 2, "b")]
    assert d.layout.carriers() == {"b": [(0, 1), (0, 2)], "d": [(0, 3), (0, 4)]}


def test_a_shadow_repair_puts_no_more_stages_on_a_node_than_its_memory_holds():
    """P = 4 without redundancy, a carrying stages 0 and 1, b stages 2 and 3; b lost. Its
    two stages come back from the shadows onto a only where the model fits on one node
    (`min_stages` 1: a may run all four). Where it needs two nodes (`min_stages` 2), a has
    room for no third stage: nothing is restored onto it, and the job stops, saying the model
    needs two nodes (before, a took all four whatever its memory)."""
    layout = Layout.from_mapping(4, 1, {(0, 0): "a", (0, 1): "a", (0, 2): "b", (0, 3): "b"},
                                 ())
    d = decide(layout, {"b"}, [], shadows=True, replicas=False)
    assert d.action == Action.RESTORE_FROM_SHADOW, d.reason
    assert d.layout.carriers() == {"a": [(0, 0), (0, 1), (0, 2), (0, 3)]}
    d = decide(layout, {"b"}, [], shadows=True, replicas=False, min_stages=2)
    assert d.action == Action.STOP and "the model needs at least 2" in d.reason, d
