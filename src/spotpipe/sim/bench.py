"""Benchmark figures of the simulator: the table's speed, value and throughput ratios of lazy
and eager spotpipe, the cold run, the reproduction of Bamboo's own simulator, how the cost
grows with the cluster, and how far a prediction is from a measured local replay
(`spotpipe.sim.validate`).

Configuration (from the simulator published with Bamboo, uclasystem/bamboo,
project_pactum/simulation/simulator.py, and the paper's abstract in shared/seeds/):
- instances: p3.2xlarge (one V100), $3.06/h on-demand, $0.918/h spot; a granted spot
  instance is ready 45 s later (its simulator's creation time);
- GPT-2 1.5B (384 sequences per iteration, which split over 3 pipelines) at P = 8 stages x
  D <= 3 pipelines (24 instances) under our memory model
  (mixed precision, activation checkpointing per layer: `spotpipe.sim.params.DEFAULT_MEMORY`),
  which lets spotpipe re-partition down to P = 5 and no further (a node carrying two stages
  after a takeover must fit a 16 GB V100: at P = 4 stages 0 and 1 need 16.03 GiB); Bamboo
  keeps P = 8 and its replica on the GPU;
- spotpipe without shadows (a fatal failure rolls back to the last durable checkpoint, every
  30 min); its pauses are our runtime's (rendezvous 10 s, failover 5 s, reconfiguration 30 s);
  checkpoint-restart relaunches in 300 s;
- bamboo is `spotpipe.sim.bamboo`: its simulator's rules and timings (global rendezvous
  30 s, local 20 s, 1.5x slower after a takeover until the next rendezvous), with our timing
  model's eager FRC in place of its measured step table (which exists for P = 12 only).

Table: 5 hourly removal rates (0.01, 0.05, 0.10, 0.25, 0.50) x `seeds` traces of Bamboo's
synthetic model (`spotpipe.sim.synthetic.bamboo_trace`, as its own 10,000-seed table draws
them: add probabilities drawn per seed, starting at hour 0) of 3 h each, every policy on
each; spotpipe once with lazy and once with eager redundancy on the same traces
(`table_seconds` covers both). `by_rate` has, per mode and rate, throughput and samples per
dollar and both over checkpoint-restart and over on-demand.

Why the ratios differ from the paper (3.7x the throughput of checkpointing, 2.4x lower cost
than on-demand): value vs on-demand = (spot price ratio 3.33) x (spot throughput / on-demand
throughput) x (on-demand nodes / spot nodes held). Lazy redundancy costs 3 % (measured) and a
takeover is followed by a re-partition in place, so spotpipe keeps about 2.9x on-demand's value
at every rate (3.0-3.2x on the flat synthetic model before 2026-12-06, whose clusters started
full); with eager FRC our timing model charges FRC its full cost where 1F1B's bubbles
cannot hold it (M = 32 micro-batches per pipeline at D = 3: bubbles are 18 % of the iteration,
FRC a third of the compute, which FRC placed by the parameters each layer multiplies by
partly fits), and value drops to 2.5-2.6x (the paper: 2.4x).
Throughput vs checkpoint-restart depends almost entirely on the rate and on the baseline's
restart (300 s) and checkpoint interval (30 min): about 1.1x at 0.01, 1.8x at 0.10, 15x at 0.5.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from spotpipe.runfiles import read_jsonl
from spotpipe.sim.models import ModelCosts, gpt2_1_5b, model_from_arg
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import price_of
from spotpipe.sim.simulator import run, run_policies
from spotpipe.sim.sweep import SweepSpec, run_sweep
from spotpipe.sim.traces import ADD, REMOVE, Event, Trace, find_trace, load_trace

REFERENCE_RATE = 0.10
REMOVE_KINDS = {"remove", "preempt", "preempted", "fail", "failure", "kill", "killed", "lost",
                "leave"}
ADD_KINDS = {"add", "join", "joined"}
P3_TRACE = find_trace("bamboo-p3.csv")  # beside the checkout, else the bundled copy


def bench_config(redundancy: str = "lazy") -> SimConfig:
    """GPT-2 1.5B, P = 8 x D = 3 p3.2xlarge, boot 45 s (Bamboo's simulator; see above)."""
    return SimConfig(gpt2_1_5b(), price_of("p3.2xlarge"), num_stages=8, num_pipelines=3,
                     params=SimParams(boot_s=45.0), redundancy=redundancy)


def bench_simulator(seeds: int = 10000, measured_run_dir: str | Path | None = None,
                    processes: int = 2, replay: bool = False,
                    work_dir: str | Path | None = None,
                    growth_sizes: tuple[int, ...] = (48, 192, 768)) -> dict[str, Any]:
    """The table's speed and ratios for lazy and eager spotpipe, the cold run, the Bamboo
    reproduction and the growth with cluster size; with `replay`, also the prediction error
    of a local replay of a real trace segment (see `spotpipe.sim.validate`: five runs of a
    tiny GPT, about 3 minutes on an idle machine, 8 on a loaded one)."""
    from spotpipe.sim import itertime

    cfg = bench_config()
    hits0, misses0 = itertime.CACHE_STATS["hits"], itertime.CACHE_STATS["misses"]
    # one table: every policy, and spotpipe once more with eager FRC on the same traces
    # (sharing its decisions with the lazy runs)
    sweep = run_sweep(SweepSpec(cfg, seeds=seeds, processes=processes,
                                extra_redundancy=("eager",)))
    rows = {(r["rate"], r["policy"]): r for r in sweep["rows"]}
    rates = sweep["rates"]

    def ratio(metric: str, a: str, b: str, rate: float) -> float:
        return rows[(rate, a)][metric] / rows[(rate, b)][metric]

    by_rate = {mode: {str(r): {
        "throughput": rows[(r, name)]["throughput"], "samples_per_dollar": rows[(r, name)]["value"],
        "throughput_vs_checkpoint_restart": ratio("throughput", name, "checkpoint_restart", r),
        "value_vs_checkpoint_restart": ratio("value", name, "checkpoint_restart", r),
        "throughput_vs_on_demand": ratio("throughput", name, "on_demand", r),
        "value_vs_on_demand": ratio("value", name, "on_demand", r)} for r in rates}
        for mode, name in (("lazy", "spotpipe"), ("eager", "spotpipe_eager"))}
    out: dict[str, Any] = {
        "table_seconds": sweep["seconds"],
        "table_cpu_seconds": sweep["cpu_seconds"],
        "processes": processes,
        "seeds": seeds,
        "rates": rates,
        "hours_per_run": sweep["hours"],
        "synthetic": sweep["synthetic"],
        "config": {"model": cfg.model.name, "stages": cfg.num_stages,
                   "pipelines": cfg.num_pipelines, "instance": "p3.2xlarge",
                   "redundancy": cfg.redundancy, "shadows": cfg.shadows,
                   "boot_s": cfg.params.boot_s},
        "by_rate": by_rate,
        "reference_rate": REFERENCE_RATE,
        "value_vs_on_demand": by_rate["lazy"][str(REFERENCE_RATE)]["value_vs_on_demand"],
        "throughput_vs_checkpoint_restart":
            by_rate["lazy"][str(REFERENCE_RATE)]["throughput_vs_checkpoint_restart"],
        "value_by_rate": {str(r): {p: rows[(r, p)]["value"] for p in
                                   ("spotpipe", "spotpipe_eager", "bamboo",
                                    "checkpoint_restart", "on_demand")} for r in rates},
    }
    out.update(_trace_figures(cfg))
    out.update(bamboo_reproduction())
    out.update(bamboo_table_reproduction())
    out["cold_run_s"], out["cold_run_cpu_s"] = cold_run()
    out["growth"] = growth(growth_sizes)
    out["shape_cache"] = {"dir": str(itertime.cache_dir()),
                          "parent_hits": itertime.CACHE_STATS["hits"] - hits0,
                          "parent_misses": itertime.CACHE_STATS["misses"] - misses0}
    if replay:
        import tempfile

        from spotpipe.sim.validate import format_phases, validate

        with tempfile.TemporaryDirectory(prefix="spotpipe-validate-") as tmp:
            v = validate(work_dir or tmp)
        print(format_phases(v), file=sys.stderr)
        out["prediction_error"] = v["prediction_error"]
        out["prediction"] = {k: v.get(k) for k in (
            "measured_samples_per_s", "predicted_samples_per_s", "signed_error",
            "error_after_first_loss", "timing_model_error", "prediction_error_own_level",
            "window_s", "calibrated_iteration_s", "calibrated_pause_s", "calibration", "kills",
            "predicted_failovers", "status", "stages", "pipelines", "time_scale", "segment",
            "replay_wall_s", "calibration_wall_s", "calibration_runs", "phases")}
    elif measured_run_dir is None:
        out["prediction_error"] = None
        out["prediction_error_note"] = (
            "quick mode: the local replay of a real trace segment was skipped; run without "
            "--quick (or python -m spotpipe.sim.validate) to measure prediction_error")
    else:
        pe = prediction_error_from(measured_run_dir, None, cfg.model)
        out["prediction_error"] = pe["relative_error"]
        out["prediction"] = pe
    return out


def _trace_figures(cfg: SimConfig) -> dict[str, Any]:
    """Every policy on Bamboo's real p3 trace, once."""
    trace = load_trace(P3_TRACE)
    res = run_policies(trace, ["spotpipe", "bamboo", "checkpoint_restart", "on_demand"], cfg,
                       record=False)
    return {"p3_trace": {
        "hours": trace.duration_s / 3600.0,
        "preemptions": res["spotpipe"].preemptions,
        "value_vs_on_demand": res["spotpipe"].value / res["on_demand"].value,
        "throughput_vs_checkpoint_restart": res["spotpipe"].throughput
        / res["checkpoint_restart"].throughput,
        "bamboo_value_vs_on_demand": res["bamboo"].value / res["on_demand"].value,
        "bamboo_throughput_vs_checkpoint_restart": res["bamboo"].throughput
        / res["checkpoint_restart"].throughput}}


BAMBOO_REFERENCE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / \
    "bamboo_reference.json"


def bamboo_reproduction(reference: Path = BAMBOO_REFERENCE) -> dict[str, Any]:
    """The largest relative error of the bamboo policy against Bamboo's own simulator's
    figures (performance, cost, value) on its p3 and g4dn traces, given its step table: as
    published, and with its simultaneous events taken in trace order (see tests/test_bamboo.py)."""
    from spotpipe.sim.bamboo_reference import reproduction_errors

    if not reference.exists():
        return {"bamboo_reproduction_error": None,
                "bamboo_reproduction_note": f"{reference} not found (a source checkout has it)"}
    ref = json.loads(reference.read_text())
    traces = {name: load_trace(f"bamboo-{name}.csv") for name in ("p3", "g4dn")}
    out: dict[str, Any] = {}
    for key, label in (("results", "bamboo_reproduction_error"),
                       ("results_ties_in_order", "bamboo_reproduction_error_ties_in_order")):
        errs = reproduction_errors(ref, traces, key)
        out[label] = max(abs(v) for e in errs.values() for k, v in e.items()
                         if k != "fatal_failures")
        out[label + "_by_trace"] = errs
    return out


BAMBOO_TABLE_REFERENCE = BAMBOO_REFERENCE.with_name("bamboo_table_reference.json")


def bamboo_table_reproduction(reference: Path = BAMBOO_TABLE_REFERENCE) -> dict[str, Any]:
    """The error of `--table --setup bamboo` against Bamboo's own simulator's table, seed by
    seed (tests/test_bamboo_table.py): per rate, the relative error of the mean of each of
    its columns and the largest of one seed."""
    from spotpipe.sim.bamboo_table import reproduction_errors

    if not reference.exists():
        return {"bamboo_table_reproduction_error": None,
                "bamboo_table_reproduction_note": f"{reference} not found (a source checkout "
                                                  "has it)"}
    errs = reproduction_errors(json.loads(reference.read_text()))
    return {"bamboo_table_reproduction_error": max(
                abs(v) for e in errs.values() for k, v in e.items()
                if not k.endswith("_worst_seed")),
            "bamboo_table_reproduction_error_worst_seed": max(
                v for e in errs.values() for k, v in e.items() if k.endswith("_worst_seed")),
            "bamboo_table_reproduction_by_rate": errs}


def cold_run() -> tuple[float, float]:
    """Wall and CPU seconds of `spotpipe simulate --trace bamboo-p3.csv` in a fresh process
    with the shape cache off: what a user's first run costs."""
    import resource
    import subprocess
    import time

    env = dict(os.environ, SPOTPIPE_SIM_CACHE="off")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "spotpipe", "simulate", "--trace", str(P3_TRACE)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def growth(sizes: tuple[int, ...] = (48, 192, 768), hours: tuple[float, ...] = (3.0, 12.0),
           rate: float = REFERENCE_RATE) -> dict[str, Any]:
    """CPU milliseconds of one run per policy at each cluster size (P = 8, D = nodes / 8) and
    trace length, shapes already timed (the cost a sweep pays per run): a run of the trace
    without the planner's memo times its shapes, a run on another seed's trace fills the
    memo as a sweep's earlier runs would, then the run is measured (a repeat of the same
    trace would find every decision in the memo)."""
    import time

    from spotpipe.sim.policies import Planner
    # the cluster full at the start, so that the cost per size is the cost of that many
    # nodes (Bamboo's model starts from a few and would blur it; the figures were taken so)
    from spotpipe.sim.synthetic import simple_trace

    out: dict[str, Any] = {}
    for n in sizes:
        cfg = replace(bench_config(), num_pipelines=n // 8)
        for h in hours:
            trace = simple_trace(rate, h, n, seed=0)
            row = {"events": len(trace)}
            warm = simple_trace(rate, h, n, seed=1)
            for policy in ("spotpipe", "bamboo", "checkpoint_restart"):
                run(trace, policy, cfg, record=False, planner=Planner(memo=False))  # shapes
                run(warm, policy, cfg, record=False)
                t0 = time.process_time()
                run(trace, policy, cfg, record=False)
                row[policy + "_ms"] = 1e3 * (time.process_time() - t0)
            out[f"{n}_nodes_{h:g}h"] = row
    return out


def prediction_error_from(measured_run_dir: str | Path, trace: Trace | str | Path | None,
                          costs: ModelCosts | str, *, num_stages: int | None = None,
                          num_pipelines: int | None = None, params: SimParams | None = None,
                          instance: str = "p3.2xlarge") -> dict[str, Any]:
    """Compare a run's measured goodput (samples/s) with the simulator's prediction.

    metrics.jsonl: one object per iteration with `iter`, `loss`, `samples` (cumulative
    samples consumed, as spotpipe writes them; a run restarted from a checkpoint writes the
    iterations after it again, with lower counts: the last line's is the work done at the end,
    the redone part counted once) and `time_s` (since the start). events.jsonl: cluster
    events with `time_s`, `kind`, `node`; when `trace` is None it is rebuilt from them (nodes
    first seen leaving are taken as present from t = 0, and the configured P x D fill up the
    rest). P and D come from arguments or from summary.json (`stages`, `pipelines`) in the
    run dir.
    """
    run_dir = Path(measured_run_dir)
    samples, end = _measured(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else {}
    p = int(num_stages or summary.get("stages") or summary.get("num_stages") or 1)
    d = int(num_pipelines or summary.get("pipelines") or summary.get("num_pipelines") or 1)
    model = model_from_arg(costs) if isinstance(costs, str) else costs
    cfg = SimConfig(model, price_of(instance), p, d,
                    params=params or SimParams(boot_s=0.0, rendezvous_s=0.0))
    if trace is None:
        tr = _trace_from_events(run_dir / "events.jsonl", cfg.nodes, end)
    elif isinstance(trace, Trace):
        tr = trace
    else:
        tr = load_trace(trace)
    predicted = run(tr, "spotpipe", cfg, duration_s=end, record=False)
    measured = samples / end
    return {"measured_samples_per_s": measured, "predicted_samples_per_s": predicted.throughput,
            "relative_error": (predicted.throughput - measured) / measured, "duration_s": end,
            "stages": p, "pipelines": d}


def _measured(path: Path) -> tuple[float, float]:
    rows = _jsonl(path)
    if not rows:
        raise ValueError(f"{path}: no iterations")
    try:
        values = [float(r["samples"]) for r in rows]
        end = max(float(r["time_s"]) for r in rows)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: each line needs numeric 'samples' and 'time_s': {exc}") \
            from None
    # (counts that went down were read as per-iteration counts and summed: a restarted
    # run's goodput came out several times what it trained)
    total = values[-1]
    if end <= 0:
        raise ValueError(f"{path}: time_s never exceeds 0")
    return total, end


def _trace_from_events(path: Path, nodes: int, end: float) -> Trace:
    rows = _jsonl(path) if path.exists() else []
    events: list[Event] = []
    live: set[str] = set()
    initial: list[str] = []
    for lineno, r in enumerate(rows, 1):
        kind, node = str(r.get("kind", "")).lower(), str(r.get("node", ""))
        t = float(r.get("time_s", 0.0))
        if kind in REMOVE_KINDS and node:
            if node not in live:
                if any(e.node == node for e in events):
                    continue  # removed twice: the trace keeps the first removal
                initial.append(node)
            live.discard(node)
            events.append(Event(t, REMOVE, node))
        elif kind in ADD_KINDS and node and node not in live:
            live.add(node)
            events.append(Event(t, ADD, node))
    start = [Event(0.0, ADD, n) for n in initial]
    start += [Event(0.0, ADD, f"local{i}") for i in range(max(0, nodes - len(initial)))]
    return Trace(start + sorted(events, key=lambda e: e.time_s), path.parent.name, end)


_jsonl = read_jsonl


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    return data if isinstance(data, dict) else {}
