"""Benchmark figures of the simulator: speed of the table, value and throughput ratios, and
(given a measured run) how far its prediction is from what happened.

Configuration of the figures: GPT-2 1.5B preset, P = 8 x D = 4 (32 p3.2xlarge V100s, the peak
of Bamboo's p3 trace), 1F1B, default pauses; the table is 5 hourly preemption rates
(0.01, 0.05, 0.10, 0.25, 0.50) x `seeds` Bamboo-style synthetic traces of 3 h each (long enough
for many preemptions at every rate but the lowest; 3 h keeps the 10,000-seed table within a
minute on 2 cores). Ratios are taken at rate 0.10 (about Bamboo's measured p3 churn) and
also reported averaged over the rates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spotpipe.runfiles import read_jsonl
from spotpipe.sim.models import ModelCosts, gpt2_1_5b, model_from_arg
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import price_of
from spotpipe.sim.simulator import run
from spotpipe.sim.sweep import SweepSpec, run_sweep
from spotpipe.sim.traces import ADD, REMOVE, Event, Trace, load_trace

REFERENCE_RATE = 0.10
REMOVE_KINDS = {"remove", "preempt", "preempted", "fail", "failure", "kill", "killed", "lost",
                "leave"}
ADD_KINDS = {"add", "join", "joined"}


def bench_config() -> SimConfig:
    return SimConfig(gpt2_1_5b(), price_of("p3.2xlarge"), num_stages=8, num_pipelines=4)


def bench_simulator(seeds: int = 10000, measured_run_dir: str | Path | None = None,
                    processes: int = 2, replay: bool = False,
                    work_dir: str | Path | None = None) -> dict[str, Any]:
    """The table's speed and ratios; with `replay`, also the prediction error of a local
    replay of a real trace segment (see `spotpipe.sim.validate`, about 1.5 minutes)."""
    from spotpipe.sim import itertime

    cfg = bench_config()
    hits0, misses0 = itertime.CACHE_STATS["hits"], itertime.CACHE_STATS["misses"]
    sweep = run_sweep(SweepSpec(cfg, seeds=seeds, processes=processes))
    rows = {(r["rate"], r["policy"]): r for r in sweep["rows"]}
    rates = sweep["rates"]

    def ratio(metric: str, a: str, b: str, rate: float) -> float:
        return rows[(rate, a)][metric] / rows[(rate, b)][metric]

    out: dict[str, Any] = {
        "table_seconds": sweep["seconds"],
        "table_cpu_seconds": sweep["cpu_seconds"],
        "processes": processes,
        "seeds": seeds,
        "rates": rates,
        "hours_per_run": sweep["hours"],
        "reference_rate": REFERENCE_RATE,
        "value_vs_on_demand": ratio("value", "spotpipe", "on_demand", REFERENCE_RATE),
        "value_vs_on_demand_mean": sum(ratio("value", "spotpipe", "on_demand", r)
                                       for r in rates) / len(rates),
        "throughput_vs_checkpoint_restart": ratio("throughput", "spotpipe",
                                                  "checkpoint_restart", REFERENCE_RATE),
        "throughput_vs_checkpoint_restart_mean": sum(
            ratio("throughput", "spotpipe", "checkpoint_restart", r) for r in rates) / len(rates),
        "value_by_rate": {str(r): {p: rows[(r, p)]["value"] for p in
                                   ("spotpipe", "bamboo", "checkpoint_restart", "on_demand")}
                          for r in rates},
    }
    out["shape_cache"] = {"dir": str(itertime.cache_dir()),
                          "parent_hits": itertime.CACHE_STATS["hits"] - hits0,
                          "parent_misses": itertime.CACHE_STATS["misses"] - misses0}
    if replay:
        import tempfile

        from spotpipe.sim.validate import validate

        with tempfile.TemporaryDirectory(prefix="spotpipe-validate-") as tmp:
            v = validate(work_dir or tmp)
        out["prediction_error"] = v["prediction_error"]
        out["prediction"] = {k: v[k] for k in (
            "measured_samples_per_s", "predicted_samples_per_s", "signed_error", "window_s",
            "calibrated_iteration_s", "calibrated_pause_s", "kills", "predicted_failovers",
            "status", "stages", "pipelines", "time_scale", "segment", "replay_wall_s")}
    elif measured_run_dir is None:
        out["prediction_error"] = None
        out["prediction_error_note"] = (
            "quick mode: the local replay of a real trace segment was skipped; run without "
            "--quick (or spotpipe.sim.validate.validate) to measure prediction_error")
    else:
        pe = prediction_error_from(measured_run_dir, None, cfg.model)
        out["prediction_error"] = pe["relative_error"]
        out["prediction"] = pe
    return out


def prediction_error_from(measured_run_dir: str | Path, trace: Trace | str | Path | None,
                          costs: ModelCosts | str, *, num_stages: int | None = None,
                          num_pipelines: int | None = None, params: SimParams | None = None,
                          instance: str = "p3.2xlarge") -> dict[str, Any]:
    """Compare a run's measured goodput (samples/s) with the simulator's prediction.

    metrics.jsonl: one object per iteration with `iter`, `loss`, `samples` (cumulative
    samples consumed; if the values ever decrease they are read as per-iteration counts and
    summed) and `time_s` (since the start). events.jsonl: cluster events with `time_s`,
    `kind`, `node`; when `trace` is None it is rebuilt from them (nodes first seen leaving are
    taken as present from t = 0, and the configured P x D fill up the rest). P and D come from
    arguments or from summary.json (`stages`, `pipelines`) in the run dir.
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
    cumulative = all(b >= a for a, b in zip(values, values[1:]))
    total = values[-1] if cumulative else sum(values)
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
