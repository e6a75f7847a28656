"""The simulator's figures on tiny traces, against sums worked by hand.

Each config has a measured iteration time (10 s at P = 2 x D = 1), 4 samples per iteration,
spot $1/h and on-demand $3/h, so every figure below is a few lines of arithmetic.
"""

from dataclasses import replace

import pytest

from spotpipe.sim.models import gpt2_1_5b
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import Price
from spotpipe.sim.simulator import instants_of, run
from spotpipe.sim.traces import parse_event_csv

SPOT = ("spotpipe", "bamboo", "checkpoint_restart")


def tiny_cfg(**kw) -> SimConfig:
    model = replace(gpt2_1_5b(), micro_batch_size=1, global_microbatches=4)
    kw.setdefault("params", SimParams(boot_s=100.0, rendezvous_s=10.0))
    return SimConfig(model, Price("tiny", 1.0, 3.0), 2, 1,
                     shape_times=(((2, 1, ((),)), 10.0),), memory=None, redundancy="none",
                     **kw)


def test_a_node_granted_and_taken_in_one_millisecond_is_not_held_after_it():
    # a and b for the whole hour; c is granted and preempted at the same millisecond (the
    # event CSV allows it, in this order): 2 instance-hours at $1/h, one preemption
    trace = parse_event_csv("0,add,a\n0,add,b\n500000,add,c\n500000,remove,c\n")
    instants = instants_of(trace, 100.0, 3600.0)
    assert instants.held_at_end == 2 == trace.nodes_available_at(3600.0)
    assert instants.node_seconds == pytest.approx(2 * 3600.0)
    assert instants.preemptions == 1 == trace.removals
    for policy in SPOT:
        r = run(trace, policy, tiny_cfg(), duration_s=3600.0)
        assert r.dollars == pytest.approx(2.0), policy
        assert r.preemptions == 1, policy


def test_a_node_granted_again_under_its_name_boots_anew():
    # c is granted at 0, taken at 50 s and granted again at 80 s: with a 100 s boot it is
    # ready at 180 s, not at 100 s (when its first grant would have been). A job of fixed
    # depth P = 2 needs a and c: it starts at 180 s, runs from 190 s after the 10 s rendezvous, and
    # makes (3600 - 190) / 10 iterations of 4 samples by the end of the hour
    trace = parse_event_csv("0,add,a\n0,add,c\n50000,remove,c\n80000,add,c\n")
    ready = [(t, r) for t, _, r, _ in instants_of(trace, 100.0, 3600.0).points if r]
    assert ready == [(100.0, ["a"]), (180.0, ["c"])]
    for policy in ("bamboo", "checkpoint_restart"):
        r = run(trace, policy, tiny_cfg(), duration_s=3600.0)
        assert r.samples == pytest.approx((3600.0 - 190.0) / 10.0 * 4), policy


def test_bamboos_value_formula_applies_to_on_demand_too():
    # P x D = 2 on-demand nodes at $3/h: after the 100 s boot and 10 s rendezvous, 4 samples
    # every 10 s; Bamboo's value is samples/s per $/h while running: 0.4 / 6 (its simulator's
    # `on_demand_value = on_demand_performance / on_demand_cost`), not samples per dollar
    trace = parse_event_csv("0,add,a\n0,add,b\n")
    r = run(trace, "on_demand", tiny_cfg(value_formula="bamboo"), duration_s=3600.0)
    assert r.value == pytest.approx(0.4 / 6.0)
    per_dollar = run(trace, "on_demand", tiny_cfg(), duration_s=3600.0)
    assert per_dollar.value == pytest.approx((3600.0 - 110.0) / 10.0 * 4 / 6.0)
    from spotpipe.sim.report import run_table

    table = run_table([r])
    assert "(samples/s)/($/h)" in table and "0.0667" in table


def test_the_shadows_host_is_in_every_cost_figure():
    # two spot nodes at $1/h and the shadows' CPU host at $2/h: $4/h all along. The job
    # runs from 110 s (boot, rendezvous) at 0.4 samples/s, so Bamboo's average cost is
    # $4/h and its value 0.4 / 4, as the dollars billed say
    trace = parse_event_csv("0,add,a\n0,add,b\n")
    cfg = tiny_cfg(shadows=True, shadow_host_price=2.0, value_formula="bamboo")
    r = run(trace, "spotpipe", cfg, duration_s=3600.0)
    assert r.dollars == pytest.approx(4.0)
    assert r.run_window == (110.0, 3600.0)
    assert r.window_cost_per_hour == pytest.approx(4.0)
    assert r.value == pytest.approx(0.4 / 4.0)


def test_a_rollback_keeps_only_the_iterations_a_checkpoint_holds():
    # P = 2: a and b run from 110 s, c waits. A checkpoint is due after 25 s of running, at
    # 2.5 iterations; the runtime writes checkpoints at iteration boundaries, so it holds 2.
    # b is lost at 145 s, after 3.5 iterations: back to 2, the 15 s since the second
    # iteration's end are lost, and the restart takes 300 s (to the end of the run)
    trace = parse_event_csv("0,add,a\n0,add,b\n0,add,c\n145000,remove,b\n")
    cfg = tiny_cfg(params=SimParams(boot_s=100.0, rendezvous_s=10.0,
                                    checkpoint_interval_s=25.0))
    for policy in ("spotpipe", "checkpoint_restart"):
        r = run(trace, policy, cfg, duration_s=445.0)
        assert r.samples == pytest.approx(2 * 4), policy
        assert r.breakdown["useful"] == pytest.approx(20.0), policy
        assert r.breakdown["restarting"] == pytest.approx(15.0 + 300.0), policy


def test_a_takeover_after_a_checkpoint_in_the_same_iteration_counts_no_time_twice():
    # P = 3, lazy, no re-partition at the boundary, 10 s per iteration (20 s with a carrier):
    # a, b, c run from 110 s; the checkpoint due at 2.5 iterations (135 s) holds 2. b is lost
    # at 138 s (2.8 iterations): a takes stage 1 over and redoes half of the in-flight 0.8
    # (4 s), pausing 5 s; a is lost at 140 s: stage 1 has no replica left, and c restarts the
    # job alone at P = 1 from the checkpoint (300 s, past the end of the run). Of the 28 s
    # run, 20 s are kept, 4 s redone by the takeover and 4 s rolled back
    trace = parse_event_csv("0,add,a\n0,add,b\n0,add,c\n138000,remove,b\n140000,remove,a\n")
    cfg = replace(tiny_cfg(params=SimParams(boot_s=100.0, rendezvous_s=10.0, pause_s=5.0,
                                            checkpoint_interval_s=25.0)),
                  redundancy="lazy", num_stages=3, repartition=False,
                  shape_times=(((3, 1, ((),)), 10.0), ((3, 1, ((1,),)), 20.0)))
    r = run(trace, "spotpipe", cfg, duration_s=200.0)
    assert r.fatal_failures == 1
    assert r.samples == pytest.approx(2 * 4)
    assert min(r.breakdown.values()) >= 0, r.breakdown
    assert r.breakdown["useful"] == pytest.approx(20.0)
    assert r.breakdown["restarting"] == pytest.approx(4.0 + 60.0)
    assert sum(r.breakdown.values()) == pytest.approx(200.0)


def test_notices_tell_each_removal_ahead_and_bill_it_to_the_end():
    # a, b, c from 0; b taken at 1000 s, d granted at 1050 s and taken at 1060 s. With a
    # 120 s notice b is lost to the job at 880 s and billed to 1000 s; d's notice comes at
    # its grant (1050 s, not 940), before its boot completes, so it is never ready
    trace = parse_event_csv("0,add,a\n0,add,b\n0,add,c\n1000000,remove,b\n"
                            "1050000,add,d\n1060000,remove,d\n")
    told = instants_of(trace, 100.0, 3600.0, notice_s=120.0)
    plain = instants_of(trace, 100.0, 3600.0)
    assert [(t, lost) for t, lost, _, _ in told.points if lost] == [(880.0, ("b",)),
                                                                   (1050.0, ("d",))]
    assert [(t, lost) for t, lost, _, _ in plain.points if lost] == [(1000.0, ("b",)),
                                                                    (1060.0, ("d",))]
    assert [r for _, _, r, _ in told.points if r] == [["a", "b", "c"]]
    assert told.node_seconds == plain.node_seconds == pytest.approx(
        3 * 1000 + 2 * 2600 + 10)
    assert told.preemptions == plain.preemptions == 2
    assert [held for t, _, _, held in told.points if t == 880.0] == [3]  # (still billed)


def test_adjacent_removals_with_notice_hand_over_instead_of_restarting():
    # P = 4, lazy, no re-partition: a, b, c, d run from 110 s at 10 s per iteration; b and
    # c (stages 1, 2) are taken together at 1000 s. Killed, stage 2's replica went with b:
    # a fatal failure. Told 120 s ahead and acted on 30 s before the end, as the runtime
    # does (970 s, after 86 iterations, at a boundary): a promotes stage 1, c hands stage 2
    # to d, a 5 s pause, then 20 s per iteration with two carriers: 4 x (86 + (2000 - 975)
    # / 20) samples by 2000 s, nothing rolled back. Acted on at once (a lead of 120 s): 77
    # iterations before it
    from spotpipe.plan import Layout

    plain = Layout.build(4, 1, ["a", "b", "c", "d"]).shape_key()
    carried = Layout.from_mapping(4, 1, {(0, 0): "a", (0, 1): "a", (0, 2): "d",
                                         (0, 3): "d"}, ()).shape_key()
    trace = parse_event_csv("0,add,a\n0,add,b\n0,add,c\n0,add,d\n1000000,remove,b\n"
                            "1000000,remove,c\n")
    cfg = replace(tiny_cfg(params=SimParams(boot_s=100.0, rendezvous_s=10.0,
                                            notice_pause_s=5.0)),
                  redundancy="lazy", num_stages=4, repartition=False,
                  shape_times=((plain, 10.0), (carried, 20.0)))
    killed = run(trace, "spotpipe", cfg, duration_s=2000.0)
    assert killed.fatal_failures == 1
    told = run(trace, "spotpipe", replace(cfg, notice_s=120.0), duration_s=2000.0)
    assert told.fatal_failures == 0
    assert told.samples == pytest.approx(4 * (86 + (2000 - 975) / 20))
    assert told.breakdown["recovering"] == pytest.approx(5.0)
    at_once = run(trace, "spotpipe", replace(cfg, notice_s=120.0, notice_lead_s=120.0),
                  duration_s=2000.0)
    assert at_once.samples == pytest.approx(4 * (77 + (2000 - 885) / 20))
    assert told.dollars == killed.dollars == pytest.approx((4 * 1000 + 2 * 1000) / 3600)
    # the other policies do not use notices: the same figures with and without
    for policy in ("bamboo", "checkpoint_restart"):
        assert run(trace, policy, replace(cfg, notice_s=120.0), duration_s=2000.0) == run(
            trace, policy, cfg, duration_s=2000.0), policy
