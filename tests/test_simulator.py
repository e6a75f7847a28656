"""Simulator invariants: nodes used <= nodes offered, billing, closed forms, determinism."""

import argparse
import json
from pathlib import Path

import pytest

from spotpipe.cli import simulate as cli
from spotpipe.sim.bench import prediction_error_from
from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.models import bert_large, gpt2_1_5b, load_profile
from spotpipe.sim.params import SimConfig, SimParams, calibrate
from spotpipe.sim.prices import load_prices, price_of
from spotpipe.sim.simulator import on_demand_closed_form, run, run_policies
from spotpipe.sim.sweep import SweepSpec, run_sweep
from spotpipe.sim.synthetic import bamboo_trace, simple_trace
from spotpipe.sim.traces import find_trace, load_trace, parse_event_csv

SPOT = ["spotpipe", "bamboo", "checkpoint_restart"]
BATCH = 384  # sequences per iteration of the GPT-2 1.5B preset (96 micro-batches of 4)


def gpt_cfg(**kw) -> SimConfig:
    return SimConfig(gpt2_1_5b(), price_of("p3.2xlarge"), **kw)


def billed(trace, price: float, end: float) -> float:
    """Dollars of the trace's availability step function, integrated independently."""
    times, counts = trace.step_series()
    total = 0.0
    for i, (t, n) in enumerate(zip(times, counts)):
        if t >= end:
            break
        nxt = min(times[i + 1], end) if i + 1 < len(times) else end
        total += n * (nxt - t)
    return total * price / 3600.0


@pytest.mark.parametrize("trace_name", ["bamboo-p3.csv", "bamboo-g4dn.csv", "synthetic"])
def test_never_uses_more_nodes_than_offered_and_bills_only_held(trace_name):
    trace = simple_trace(0.5, 4, 32, seed=7) if trace_name == "synthetic" \
        else load_trace(trace_name)
    cfg = gpt_cfg()
    for name, r in run_policies(trace, SPOT, cfg).items():
        assert r.timeline, name
        for p in r.timeline:
            offered = trace.nodes_available_at(p.time_s)
            assert p.used <= p.held <= offered, (name, p)
            assert p.held == offered
        assert r.dollars == pytest.approx(billed(trace, cfg.price.spot, trace.duration_s))
        assert sum(r.breakdown.values()) == pytest.approx(r.duration_s)
        assert min(r.breakdown.values()) >= -1e-6
        assert r.preemptions == trace.removals


def test_on_demand_equals_closed_form():
    cfg = gpt_cfg(num_stages=8, num_pipelines=2)
    hours = 7.5
    r = run(simple_trace(0.5, hours, 16, 0), "on_demand", cfg, duration_s=hours * 3600)
    it = iteration_time(cfg.model, cfg.schedule, 8, 2, ((),), False)
    start = cfg.params.boot_s + cfg.params.rendezvous_s
    assert r.samples == pytest.approx((hours * 3600 - start) / it * BATCH)
    assert r.dollars == pytest.approx(16 * 3.06 * hours)
    assert r.cost_per_hour == pytest.approx(16 * 3.06)
    assert r.preemptions == 0 and r.fatal_failures == 0
    assert on_demand_closed_form(cfg, hours * 3600)["samples"] == pytest.approx(r.samples)


def test_spot_without_preemptions_runs_at_redundant_speed():
    trace = simple_trace(0.0, 2, 32, 0)
    cfg = gpt_cfg()
    results = run_policies(trace, SPOT, cfg)
    red = iteration_time(cfg.model, "1f1b", 8, 4, ((),), True)
    plain = iteration_time(cfg.model, "1f1b", 8, 4, ((),), False)
    running = 2 * 3600 - cfg.params.boot_s - cfg.params.rendezvous_s
    assert results["spotpipe"].samples == pytest.approx(running / red * BATCH)
    assert results["checkpoint_restart"].samples == pytest.approx(running / plain * BATCH)
    assert results["spotpipe"].breakdown["redundant"] == pytest.approx(running * (1 - plain / red))
    assert red > plain  # FRC does not fit entirely in the bubbles


def test_deterministic_per_seed():
    cfg = gpt_cfg()
    a = run_policies(simple_trace(0.25, 3, 32, 11), SPOT, cfg)
    b = run_policies(simple_trace(0.25, 3, 32, 11), SPOT, cfg)
    c = run_policies(simple_trace(0.25, 3, 32, 12), SPOT, cfg)
    for name in SPOT:
        assert a[name].summary() == b[name].summary()
        assert a[name].samples != c[name].samples
    # sharing decisions between spotpipe and bamboo changes nothing
    alone = run(simple_trace(0.25, 3, 32, 11), "bamboo", cfg)
    assert alone.summary() == a["bamboo"].summary()


def test_spotpipe_runs_its_redundancy_bamboo_eager_as_published():
    trace = simple_trace(0.0, 2, 32, 0)
    lazy = gpt_cfg(redundancy="lazy", params=SimParams(lazy_ratio=0.95))
    res = run_policies(trace, ["spotpipe", "bamboo"], lazy)
    plain = iteration_time(lazy.model, "1f1b", 8, 4, ((),), False)
    # Bamboo's engine runs FRC of every replica, the last stage's too; spotpipe's eager
    # leaves that one out (nothing reads its outputs) and is no slower
    eager = iteration_time(lazy.model, "1f1b", 8, 4, ((),), True, frc_every_stage=True)
    assert plain < iteration_time(lazy.model, "1f1b", 8, 4, ((),), True) <= eager
    running = 2 * 3600 - lazy.params.boot_s - lazy.params.rendezvous_s
    assert res["spotpipe"].samples == pytest.approx(running / (plain / 0.95) * BATCH)
    assert res["spotpipe"].breakdown["redundant"] == pytest.approx(running * 0.05)
    assert res["bamboo"].samples == pytest.approx(running / eager * BATCH)
    # a sweep runs bamboo on its own then, and gets the same as alone
    sweep = run_sweep(SweepSpec(lazy, rates=(0.5,), seeds=3, hours=1, processes=1,
                                policies=("spotpipe", "bamboo")))
    alone = [run(bamboo_trace(0.5, 1, 32, s), "bamboo", lazy, duration_s=3600.0,
                 record=False).throughput for s in range(3)]
    row = next(r for r in sweep["rows"] if r["policy"] == "bamboo")
    assert row["throughput"] == pytest.approx(sum(alone) / 3)
    with pytest.raises(ValueError, match="lazy_ratio"):
        SimParams(lazy_ratio=1.5)


def test_measured_shape_times_replace_the_timing_model():
    trace = simple_trace(0.0, 1, 8, 0)
    cfg = gpt_cfg(num_stages=4, num_pipelines=2, redundancy="none",
                  shape_times=(((4, 2, ((), ())), 2.0),))
    r = run(trace, "spotpipe", cfg)
    running = 3600 - cfg.params.boot_s - cfg.params.rendezvous_s
    assert r.samples == pytest.approx(running / 2.0 * BATCH)
    with pytest.raises(ValueError, match="shape_times"):
        gpt_cfg(shape_times=(((8, 4, ((),) * 4), 0.0),))


def adjacent_loss_trace(t_loss: float) -> str:
    lines = [f"0,add,n{i}" for i in range(7)]  # P = 5, D = 1, two standby
    lines += [f"{int(t_loss * 1000)},remove,n1", f"{int(t_loss * 1000)},remove,n2"]
    return "\n".join(lines)


def test_fatal_failure_with_shadows_loses_at_most_one_iteration_without_rolls_back():
    trace = parse_event_csv(adjacent_loss_trace(1500.0))
    trace.duration_s = 3000.0
    # (P = 5: GPT-2 XL's smallest depth on V100s with redundancy, a carrier of two stages
    # must fit)
    base = dict(num_stages=5, num_pipelines=1, params=SimParams(checkpoint_interval_s=1000.0))
    sp = run(trace, "spotpipe", gpt_cfg(shadows=True, **base))
    cp = run(trace, "spotpipe", gpt_cfg(shadows=False, **base))
    assert sp.fatal_failures == 1 and cp.fatal_failures == 1
    it = iteration_time(sp_model := gpt2_1_5b(), "1f1b", 5, 1, ((),), True)
    params = base["params"]
    # the shadows repair the broken pipeline (stage 1's replica promoted, stage 2 loaded from
    # its shadow), then a standby node relieves the carrier: two pauses, and only the
    # iteration in flight is lost
    assert sp.breakdown["recovering"] == pytest.approx(params.shadow_restore_pause_s
                                                       + params.reconfig_pause_s)
    assert 0 < sp.breakdown["restarting"] <= it + 1e-6
    lost_cp = cp.breakdown["restarting"] - params.restart_pause_s
    # without shadows: back to the checkpoint due after 1000 s of running, which holds the
    # iterations completed by then (the runtime checkpoints at iteration boundaries)
    running_at_loss = 1500.0 - params.boot_s - params.rendezvous_s
    assert lost_cp == pytest.approx(running_at_loss - (1000.0 // it) * it, rel=1e-6)
    assert sp.samples > cp.samples
    # the shadows' CPU host is billed for the whole run
    assert sp.dollars - cp.dollars == pytest.approx(1.008 * 3000.0 / 3600.0)
    assert sp_model.num_layers == 50


def test_checkpoint_restart_restarts_on_each_hit():
    lines = [f"0,add,n{i}" for i in range(8)] + ["2000000,remove,n0", "2500000,remove,n7", "3000000,remove,n2"]
    trace = parse_event_csv("\n".join(lines))
    trace.duration_s = 4000.0
    cfg = gpt_cfg(num_stages=4, num_pipelines=2)
    r = run(trace, "checkpoint_restart", cfg)
    assert r.fatal_failures == 2  # n7 was a spare (not in use): no restart for it
    assert r.timeline[-1].used == 4  # 5 nodes left: one pipeline of 4


def test_calibrate(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"pause_s": 1.5, "restart_pause_s": 90, "other_figure": 3}))
    params = calibrate(p)
    assert params.pause_s == 1.5 and params.restart_pause_s == 90
    assert params.boot_s == SimParams().boot_s
    p.write_text(json.dumps({"warp_pause_s": 1}))
    with pytest.raises(ValueError, match="warp_pause_s"):
        calibrate(p)
    p.write_text(json.dumps({"pause_s": -1}))
    with pytest.raises(ValueError, match="pause_s"):
        calibrate(p)
    # the benches' own outputs, together: failover, reconfigure, checkpoint
    fo, rc, ck = (tmp_path / f"{n}.json" for n in ("failover", "reconfigure", "checkpoint"))
    fo.write_text(json.dumps({"pause_s": 0.1, "notice_pause_s": 0.08, "restart_pause_s": 7.8,
                              "iteration_replay_pause_s": 0.12}))
    rc.write_text(json.dumps({"figures": {"rebalance_pause_s": 0.02, "add_pipeline_pause_s": 0.04,
                                          "drop_pipeline_pause_s": 0.09,
                                          "repartition_pause_s": 0.05, "restart_pause_s": 7.2}}))
    ck.write_text(json.dumps({"shadow_recovery_s": 0.28, "recovery_s": 5.4}))
    params = calibrate([fo, rc, ck])
    assert params.pause_s == 0.1 and params.restart_pause_s == 7.2  # the later file wins
    assert params.notice_pause_s == 0.08
    assert params.reconfig_pause_s == pytest.approx(0.05)
    assert params.shadow_restore_pause_s == 0.28


def test_prices_and_models():
    prices = load_prices()
    assert prices["p3.2xlarge"].spot == 0.918 and prices["p3.2xlarge"].on_demand == 3.06
    assert all(p.spot < p.on_demand for p in prices.values())
    g, b = gpt2_1_5b(), bert_large()
    assert g.num_layers == 50 and b.num_layers == 26
    assert g.forward_s[1] > b.forward_s[1] / 16 * 4  # GPT-2 blocks are bigger per sample
    with pytest.raises(ValueError):
        price_of("x1.nope")


def test_profile_and_prediction_error(tmp_path):
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"forward_s": [0.01] * 4, "backward_s": [0.02] * 4,
                                "micro_batch_size": 2, "global_microbatches": 8}))
    model = load_profile(prof)
    assert model.samples_per_iteration == 16
    # a fake measured run going exactly at the predicted speed: error ~ 0
    it = iteration_time(model, "1f1b", 4, 1, ((),), True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("\n".join(
        json.dumps({"iter": i, "loss": 1.0, "samples": 16 * (i + 1), "time_s": it * (i + 1)})
        for i in range(100)))
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "summary.json").write_text(json.dumps({"stages": 4, "pipelines": 1}))
    pe = prediction_error_from(run_dir, None, model)
    assert abs(pe["relative_error"]) < 1e-6
    # the same run measured at half speed: the prediction is 100 % too high
    (run_dir / "metrics.jsonl").write_text("\n".join(
        json.dumps({"iter": i, "loss": 1.0, "samples": 16 * (i + 1), "time_s": 2 * it * (i + 1)})
        for i in range(100)))
    assert prediction_error_from(run_dir, None, model)["relative_error"] == pytest.approx(1.0)
    # a run that restarted from its checkpoint of iteration 49 after iteration 59, and then
    # trained to 99: 100 iterations' samples at the end, in the time of 110 (a hand sum; the
    # redone lines were summed as per-iteration counts, 65 times the work)
    lines = [(i, 16 * (i + 1)) for i in range(60)] + [(i, 16 * (i + 1)) for i in range(50, 100)]
    (run_dir / "metrics.jsonl").write_text("\n".join(
        json.dumps({"iter": i, "loss": 1.0, "samples": n, "time_s": it * (k + 1)})
        for k, (i, n) in enumerate(lines)))
    pe = prediction_error_from(run_dir, None, model)
    assert pe["measured_samples_per_s"] == pytest.approx(16 * 100 / (it * 110))


def test_small_sweep_orders_policies():
    sweep = run_sweep(SweepSpec(gpt_cfg(), rates=(0.01, 0.5), seeds=20, hours=3, processes=1))
    rows = {(r["rate"], r["policy"]): r for r in sweep["rows"]}
    # more churn hurts checkpoint-restart far more than spotpipe
    assert rows[(0.5, "spotpipe")]["value"] > rows[(0.5, "checkpoint_restart")]["value"]
    assert rows[(0.01, "spotpipe")]["value"] > rows[(0.5, "spotpipe")]["value"]
    assert rows[(0.5, "on_demand")]["value"] == rows[(0.01, "on_demand")]["value"]


# -- CLI ------------------------------------------------------------------------------------

def cli_run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spotpipe")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate"] + argv)
    return args.func(args)


def test_cli_json_last_line_and_plot(tmp_path, capsys):
    out = tmp_path / "plots"
    assert cli_run(["--trace", str(find_trace("bamboo-g4dn.csv")), "--stages", "8",
                    "--pipelines", "2", "--instance", "g4dn.xlarge", "--json",
                    "--plot", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    assert {r["policy"] for r in data["results"]} == {"spotpipe", "bamboo",
                                                     "checkpoint_restart", "on_demand"}
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_notices_are_said_and_change_only_spotpipe(capsys):
    """The p3 trace with redundancy off: every preemption a kill, some fatal; told 120 s
    ahead and acted on 30 s before (the runtime's lead), spotpipe has none, and the
    policies that do not use notices keep their figures."""
    base = ["--trace", "p3", "--redundancy", "none", "--json"]
    assert cli_run(base) == 0
    killed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_run(base + ["--notice", "120"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "120 s notices, spotpipe acting 30 s ahead" in out[0]
    told = json.loads(out[-1])
    assert (told["notice_s"], told["notice_lead_s"]) == (120.0, 30.0)
    before = {r["policy"]: r for r in killed["results"]}
    after = {r["policy"]: r for r in told["results"]}
    assert before["spotpipe"]["fatal_failures"] > 0 == after["spotpipe"]["fatal_failures"]
    assert after["spotpipe"]["samples"] > before["spotpipe"]["samples"]
    for policy in ("bamboo", "checkpoint_restart", "on_demand"):
        assert after[policy] == before[policy], policy


def test_cli_synthetic_and_table(tmp_path, capsys):
    assert cli_run(["--synthetic", "bamboo", "--rate", "0.1", "--hours", "2", "--seed", "0",
                    "--policy", "spotpipe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["results"][0]["policy"] == "spotpipe"
    assert cli_run(["--table", "--seeds", "4", "--processes", "1", "--rates", "0.1,0.5",
                    "--json", "--plot", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["seeds"] == 4 and len(data["rows"]) == 8
    assert (tmp_path / "value_vs_rate.png").exists()


@pytest.mark.parametrize("argv,words", [
    (["--trace", "/nonexistent/trace.csv"], "cannot read"),
    (["--stages", "0"], "--stages"),
    (["--pipelines", "5"], "96 micro-batches per iteration do not split over 5 pipelines"),
    (["--model", "gpt5"], "unknown model"),
    (["--instance", "z9.huge"], "unknown instance"),
    (["--table", "--rates", "0.1,2"], "--rates"),
    (["--stages", "60"], "layers"),
    (["--notice", "-30"], "--notice must be >= 0 seconds, got -30"),
])
def test_cli_bad_input_exit_2(tmp_path, capsys, argv, words):
    plots = tmp_path / "never"
    assert cli_run(argv + ["--plot", str(plots)]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert not plots.exists()


def test_cli_bad_trace_names_line(tmp_path, capsys):
    bad = tmp_path / "t.csv"
    bad.write_text("0,add,a\n5,remove,zz\n")
    assert cli_run(["--trace", str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:2:" in captured.err and captured.out == ""


def test_cli_redundancy_shadows_victims(tmp_path, capsys):
    gcp = Path(__file__).parent / "fixtures" / "traces" / "bamboo-gcp-v100x1-east1c.txt"
    by_mode = {}
    for extra in (["--redundancy", "none"], ["--redundancy", "lazy"], [],
                  ["--redundancy", "eager"], ["--shadows"]):
        assert cli_run(["--trace", str(gcp), "--hours", "3", "--policy", "spotpipe",
                        "--stages", "8", "--pipelines", "8", "--json", "--seed", "3"]
                       + extra) == 0
        data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert data["victims"] == "random(seed=3)"
        res = data["results"][0]
        by_mode[" ".join(extra)] = (data["redundancy"], data["shadows"], res["samples"],
                                    res["dollars"])
    assert by_mode[""] == by_mode["--redundancy lazy"]  # lazy is the default
    assert by_mode["--shadows"][:2] == ("lazy", True)
    samples = {k: v[2] for k, v in by_mode.items() if k != "--shadows"}
    assert len(set(samples.values())) == 3  # none, lazy, eager differ
    # the shadows' host is billed (no fatal failure here, so the samples are lazy's)
    assert by_mode["--shadows"][3] == pytest.approx(by_mode[""][3] + 1.008 * 3)
    assert cli_run(["--trace", str(gcp), "--hours", "1", "--victims", "oldest", "--json",
                    "--policy", "spotpipe"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["victims"] == "oldest"


def test_cli_layout_that_does_not_fit_exits_2(capsys):
    assert cli_run(["--synthetic", "bamboo", "--hours", "1", "--stages", "1",
                    "--pipelines", "8", "--policy", "on_demand"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "stage 0" in err and "16.00 GiB" in err


def test_calibrated_shape_times_apply_to_every_policy(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"pause_s": 2.0, "shape_times": [[[8, 2, [[], []]], 3.0]]}))
    from spotpipe.sim.params import calibrate_shapes
    shapes = calibrate_shapes(cal)
    assert shapes == (((8, 2, ((), ())), 3.0),)
    cfg = gpt_cfg(num_stages=8, num_pipelines=2, shape_times=shapes, params=calibrate(cal))
    od = on_demand_closed_form(cfg, 3600.0)
    assert od["iteration_s"] == 3.0
    trace = simple_trace(0.0, 1, 16, 0)
    cr = run(trace, "checkpoint_restart", cfg)
    running = 3600 - cfg.params.boot_s - cfg.params.rendezvous_s
    assert cr.samples == pytest.approx(running / 3.0 * BATCH)
    cal.write_text(json.dumps({"shape_times": [[[8, 2], 3.0]]}))
    with pytest.raises(ValueError, match=r"shape_times\[0\]"):
        calibrate_shapes(cal)


def test_sweep_eager_rows_share_decisions_yet_equal_separate_runs():
    cfg = gpt_cfg(num_stages=8, num_pipelines=3, redundancy="lazy")
    sweep = run_sweep(SweepSpec(cfg, rates=(0.5,), seeds=3, hours=1, processes=1,
                                policies=("spotpipe",), extra_redundancy=("eager",)))
    rows = {r["policy"]: r for r in sweep["rows"]}
    eager = gpt_cfg(num_stages=8, num_pipelines=3, redundancy="eager")
    for name, c in (("spotpipe", cfg), ("spotpipe_eager", eager)):
        alone = [run(bamboo_trace(0.5, 1, 24, s), "spotpipe", c, duration_s=3600.0,
                     record=False).throughput for s in range(3)]
        assert rows[name]["throughput"] == pytest.approx(sum(alone) / 3)
    assert rows["spotpipe_eager"]["throughput"] < rows["spotpipe"]["throughput"]


def test_cli_value_formula_bamboo(capsys):
    base = ["--trace", "bamboo-g4dn.csv", "--stages", "8", "--pipelines", "2", "--policy",
            "bamboo", "--instance", "g4dn.xlarge", "--json"]
    values = {}
    for formula in ("samples_per_dollar", "bamboo"):
        assert cli_run(base + ["--value-formula", formula]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][0]
        values[formula] = res
    per_dollar = values["samples_per_dollar"]
    assert per_dollar["value"] == pytest.approx(per_dollar["samples"] / per_dollar["dollars"])
    # Bamboo's: samples/s per $/h, time-averaged while running (not samples per dollar)
    assert values["bamboo"]["samples"] == per_dollar["samples"]
    assert values["bamboo"]["value"] != pytest.approx(per_dollar["value"])
    assert 0 < values["bamboo"]["value"] < per_dollar["value"]


def test_the_simulators_frc_placement_sees_what_the_runtimes_does():
    # the runtime places FRC by `model.compute_weights`; the simulator's transformer preset
    # carries the same figures per layer, so both place FRC alike for the same model
    from spotpipe.model import GPTConfig, build_gpt, compute_weights
    from spotpipe.sim.itertime import placement_sizes
    from spotpipe.sim.models import transformer

    real = build_gpt(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16,
                               tie_embeddings=True), seed=0)
    costs = transformer("tiny", layers=3, hidden=16, seq=8, vocab=32, micro_batch=1,
                        global_batch=4, heads=2)
    assert list(costs.placement_weights) == compute_weights(real)
    # per stage, as the runtime sums them (uniform partition, 5 layers on 2 stages: 3 + 2)
    weights = compute_weights(real)
    assert placement_sizes(costs, 2) == (float(sum(weights[:3])), float(sum(weights[3:])))


def test_cli_says_when_hours_run_past_the_trace(capsys):
    """Bamboo's p3 trace ends at 40,920 s (11.37 h, its last event): --hours 12 holds its
    last nodes, never preempted, for 0.63 h the trace says nothing about, which used to pass
    in silence; --hours 11 stays inside it."""
    assert cli_run(["--trace", "p3", "--hours", "12", "--policy", "on_demand"]) == 0
    assert ("note: --hours 12 runs past the end of bamboo-p3.csv (11.37 h)"
            in capsys.readouterr().err)
    assert cli_run(["--trace", "p3", "--hours", "11", "--policy", "on_demand"]) == 0
    assert "note" not in capsys.readouterr().err


def test_a_node_running_stages_apart_is_timed_as_the_streams_it_runs(tmp_path):
    # a shadow repair onto the nearest live node can leave n1 running stages 1 and 3 of 4
    # (tests/test_settle.py): the runtime runs the merged streams of [[0], [1, 3], [2]]
    # (`runtime.node.node_schedule`), not the plain schedule that no carrier would run
    from spotpipe.plan import Layout
    from spotpipe.schedule import StageCosts, merged_schedule, simulate
    from spotpipe.sim.itertime import microbatches_per_pipeline, stage_costs
    from spotpipe.sim.params import calibrate_shapes

    apart = Layout.from_mapping(4, 1, {(0, 0): "n4", (0, 1): "n1", (0, 2): "n2", (0, 3): "n1"})
    plain = Layout.build(4, 1, ["a", "b", "c", "d"])
    assert apart.shape_key() != plain.shape_key()
    model = gpt2_1_5b()
    fwd, bwd, nbytes = stage_costs(model, 4)
    costs = StageCosts(fwd, bwd, comm=model.activation_bytes / model.network_bytes_s,
                       optimizer=max(nbytes[0], nbytes[1] + nbytes[3], nbytes[2])
                       * model.optimizer_s_per_byte)
    streams = merged_schedule("1f1b", microbatches_per_pipeline(model, 1), [[0], [1, 3], [2]])
    want = simulate(streams, costs).iteration_s
    p, width, merged = apart.shape_key()
    for eager in (False, True):  # (a pipeline with a carrier runs no FRC)
        assert iteration_time(model, "1f1b", p, width, merged, eager) == pytest.approx(want)
    assert want > iteration_time(model, "1f1b", 4, 1, plain.shape_key()[2], False)
    # a measured time of such a shape (as `sim.validate` writes it) reads back under its key
    cal = tmp_path / "shapes.json"
    cal.write_text(json.dumps({"shape_times": [[apart.shape_key(), 30.0]]}))
    assert calibrate_shapes(cal) == ((apart.shape_key(), 30.0),)
