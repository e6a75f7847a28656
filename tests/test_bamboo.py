"""The bamboo policy against Bamboo's own simulator (its outputs, kept as test data)."""

import json
from pathlib import Path

import pytest

from spotpipe.sim.bamboo_reference import reference_config, reproduction_errors
from spotpipe.sim.simulator import run
from spotpipe.sim.traces import load_trace, parse_event_csv

REF = json.loads((Path(__file__).parent / "fixtures" / "bamboo_reference.json").read_text())
TRACES = {name: load_trace(f"bamboo-{name}.csv") for name in ("p3", "g4dn")}


def test_reproduces_bamboos_simulator_with_ties_in_trace_order():
    """Bamboo's simulator takes simultaneous events (the p3 trace removes up to 6 nodes in
    one millisecond) in heapq's arbitrary order; with that order fixed to the trace's, the
    same rules must give the same figures."""
    errors = reproduction_errors(REF, TRACES, "results_ties_in_order")
    for name, err in errors.items():
        assert err["fatal_failures"] == 0, name
        for key in ("average_performance", "average_cost", "average_value"):
            assert abs(err[key]) < 0.05, (name, key, err[key])
        # throughput and value follow the steps, which match almost exactly
        assert abs(err["average_performance"]) < 0.001 and abs(err["average_value"]) < 0.001


def test_reproduces_bamboos_published_figures():
    errors = reproduction_errors(REF, TRACES, "results")
    assert errors["g4dn"]["fatal_failures"] == 0
    for name, err in errors.items():
        for key in ("average_performance", "average_value"):
            assert abs(err[key]) < 0.05, (name, key, err[key])
    # its cost figure divides every dollar billed to the end of the trace by the time of its
    # last step; ours bills up to that step: 0.5 % apart on g4dn, where the runs agree
    assert abs(errors["g4dn"]["average_cost"]) < 0.01


def test_bamboo_rules_on_a_hand_made_trace():
    """25 nodes at P = 12 (D = 2, one waiting) and Bamboo's GPT-2 step table: 1.085 s at
    D = 2, 1.2 s at D = 1; 1.5x slower after a takeover; 45 s boot, 30 s global and 20 s
    local rendezvous. Worked by hand, step by step (and run through Bamboo's simulator):
    - 75 s: running 2 x 12. At 1000 s node2 (stage 1) is lost: node1 takes it over; the
      step in flight (853rd, 0.58 s done) ends 0.505 x 1.5 s later, at 1000.7575 s, and
      reconfigures (a waiting node can relieve the carrier): 2 x 12 again at 1020.7575 s;
    - 2000 s: node3 and node4 (stages 1 and 2 of pipeline 0) are lost: a takeover, then a
      fatal failure (the heir carries two stages) which starts a global rendezvous; steps go
      on, the in-flight one (903rd since 1020.76) ends at 2000.768 s and reconfigures (one
      carrier in 23 nodes is above 5 %): 1 x 12 at 2020.768 s. The global rendezvous' timeout
      at 2030 s then completes with nobody: the job stops after 7 more steps;
    - node26, granted at 3000 s, is ready at 3045 s: a global rendezvous, 1 x 12 at 3075 s;
      node5 is lost at 4000 s (in step 771), relieved by a waiting node at 4000.3 + 20 s;
    - then 1.2 s steps to 14400 s: 8649 more."""
    hand = REF["hand_trace"]
    steps = (852 + 1) + 903 + 7 + 771 + 8649
    assert steps == hand["num_steps_complete"]  # what Bamboo's simulator counted
    r = run(parse_event_csv("\n".join(hand["trace"])), "bamboo", reference_config(REF),
            duration_s=14400.0)
    assert int(r.samples // 32) == steps
    assert r.fatal_failures == hand["num_fatal_failures"] == 1
    assert r.window_throughput == pytest.approx(hand["average_performance"], rel=1e-3)
    assert r.time_average_value == pytest.approx(hand["average_value"], rel=1e-3)
    assert (12, 2, True) in r.shapes and (12, 1, False) in r.shapes
    assert all(p == 12 for p, _, _ in r.shapes)  # P never changes


def test_bench_simulator_keys():
    from spotpipe.sim.bench import bench_simulator

    out = bench_simulator(seeds=2, processes=1, growth_sizes=(48,))
    assert 0 <= out["bamboo_reproduction_error"] < 0.06
    assert out["bamboo_reproduction_error_ties_in_order"] < 0.02
    # its own table's setup, to the job's end (tests/test_bamboo_table.py)
    assert 0 <= out["bamboo_table_reproduction_error"] < 1e-4
    assert out["bamboo_table_reproduction_error_worst_seed"] < 1e-3
    assert out["cold_run_s"] > 0 and out["table_seconds"] > 0
    for mode in ("lazy", "eager"):
        for rate in ("0.01", "0.05", "0.1", "0.25", "0.5"):
            row = out["by_rate"][mode][rate]
            for key in ("throughput", "samples_per_dollar", "throughput_vs_checkpoint_restart",
                        "value_vs_checkpoint_restart", "throughput_vs_on_demand",
                        "value_vs_on_demand"):
                assert row[key] > 0, (mode, rate, key)
    assert set(out["growth"]) == {"48_nodes_3h", "48_nodes_12h"}


def test_a_step_slowed_by_a_takeover_is_checked_at_its_deferred_end():
    """24 nodes at P = 12 (D = 2), running from 75 s in 1.085 s steps; node25 is ready at
    545 s (a waiting node: a check at the end of step 434, 545.89 s), then node2 is lost at
    545.5 s: its predecessor carries two stages and the rest of step 434 runs 1.5x slower,
    so the step ends at 545.89 + 0.195 = 546.085 s (Bamboo's simulator defers the step's
    completion event by int(390 ms x 0.5) and checks only then). There the waiting node
    relieves the carrier: a 20 s local rendezvous, then 1.085 s steps again to 600 s."""
    lines = [f"0,add,node{i}" for i in range(1, 25)] + ["500000,add,node25",
                                                       "545500,remove,node2"]
    r = run(parse_event_csv("\n".join(lines)), "bamboo", reference_config(REF),
            duration_s=600.0)
    assert r.samples / 32 == pytest.approx(434 + (600.0 - 566.085) / 1.085)
