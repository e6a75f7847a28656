"""Validation: replay a segment of a real trace on the local cluster, then predict it.

1. `write_segment` cuts a window out of a real trace (Bamboo's p3 or g4dn) for a P x D job:
   P x D nodes live at the window's start, the ones the trace removes inside the window placed
   at non-adjacent stages (so every loss can fail over), the others surviving it. Only those
   nodes are written (no additions), so the window exercises failovers, not joins.
2. `calibration_run` runs the same job with the same losses injected at fixed iterations
   (`--fail NODE@ITER`): four short runs, separate from the one predicted, two before it
   and two after. `calibration_from` reads from them what the simulator needs: seconds per
   iteration of every layout shape the losses lead to (median over the runs), and the
   failover pause.
3. `replay` runs `spotpipe train --trace SEGMENT --time-scale X` as a subprocess.
4. `compare` simulates the same segment (times / X) for the same wall window and layout
   with those figures and reports prediction_error = |predicted - measured| / measured of
   goodput (samples per second from the first iteration to the last), and the phases
   between losses (`format_phases`): samples, iteration time and pause (detection,
   agreement, regroup, restart, in-flight work lost), measured and predicted, so that one
   can see where the error comes from. `python -m spotpipe.sim.validate` runs all of it
   and prints the table.

Why a calibration run and not the timing model: the local cluster runs P x D worker
processes on one machine's few cores. Measured on 2 cores (P = 4, tiny GPT): 0.070 s per
iteration with 4 workers, 0.053 s after one takeover (3 workers), 0.048 s after two; the
timing model, scaled to the first phase, predicts the opposite (a node running two stages is
slower), because it assumes one machine per node. That prediction was 40% low on such a run
although pauses and failovers were predicted right. On a machine shared with other work,
what remains is the machine: the same shape ran at 0.07 s and at 0.24 s per iteration in
runs minutes apart (lazy replicas are applied by SCHED_IDLE threads, which starve under
load until the worker waits on them), and the per-phase table shows it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spotpipe.runfiles import read_jsonl
from spotpipe.sim.itertime import pipeline_time
from spotpipe.sim.models import ModelCosts
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import price_of
from spotpipe.sim.simulator import run
from spotpipe.sim.traces import ADD, REMOVE, Event, Trace, find_trace, load_trace

SHARED_TRACE = find_trace("bamboo-p3.csv")  # beside the checkout, else the bundled copy
DEFAULT_WINDOW = (3000.0, 360.0)  # p3: 32 nodes at 3000 s, removals at 3060 s and 3180 s


def write_segment(trace_path: str | Path, out_csv: str | Path, *, start_s: float,
                  span_s: float, stages: int, pipelines: int, losses: int = 2) -> dict[str, Any]:
    """Write the window [start_s, start_s + span_s] of a trace for a P x D job (event CSV)."""
    tr = load_trace(trace_path)
    live: dict[str, None] = {}
    for ev in tr.events:
        if ev.time_s > start_s:
            break
        (live.__setitem__(ev.node, None) if ev.kind == ADD else live.pop(ev.node, None))
    end = start_s + span_s
    removed: dict[str, float] = {}
    for ev in tr.events:
        if start_s < ev.time_s <= end and ev.kind == REMOVE and ev.node in live:
            removed.setdefault(ev.node, ev.time_s)
    victims: list[str] = []
    for node, t in sorted(removed.items(), key=lambda kv: kv[1]):
        if len(victims) < losses and all(removed[v] != t for v in victims):
            victims.append(node)  # distinct instants: one failover at a time
    survivors = [n for n in live if n not in removed]
    nodes = stages * pipelines
    slots = _loss_slots(stages, pipelines, len(victims))
    if len(victims) < losses or len(survivors) < nodes - len(victims) or len(slots) < losses:
        raise ValueError(f"window {start_s:g}+{span_s:g} s of {trace_path} does not give "
                         f"{losses} separate losses for P={stages} x D={pipelines}")
    order: list[str] = []
    vi, si = iter(victims), iter(survivors)
    for k in range(nodes):
        order.append(next(vi) if k in slots else next(si))
    lines = ["delta_ms,kind,node"] + [f"0,add,{n}" for n in order]
    lines += [f"{round((removed[v] - start_s) * 1000)},remove,{v}"
              for v in sorted(victims, key=removed.get)]
    Path(out_csv).write_text("\n".join(lines) + "\n")
    return {"source": str(trace_path), "start_s": start_s, "span_s": span_s, "nodes": order,
            "losses": {v: removed[v] - start_s for v in victims}}


def _loss_slots(stages: int, pipelines: int, losses: int) -> list[int]:
    """Worker indices (pipeline-major) to lose: stage 1 of each pipeline first, then stage 3
    and so on (never two neighbours in one ring)."""
    out = []
    for s in range(1, stages, 2):  # odd stages: in a ring of P >= 2 no two are neighbours
        for d in range(pipelines):
            out.append(d * stages + s)
    return out[:losses]


_LOSS_KINDS = ("trace_kill", "trace_notice", "fault_injected")


def calibration_run(config: str | Path, out_dir: str | Path, *, stages: int, pipelines: int,
                    losses: int, iterations_per_phase: int = 60, sets: list[str] = (),
                    timeout_s: float = 240.0, repeats: int = 3,
                    first: int = 0) -> list[dict[str, Any]]:
    """The job of the validation with its losses injected at fixed iterations instead of
    trace times: the same nodes (`_loss_slots`) crash, one every `iterations_per_phase`;
    `repeats` short runs, in out_dir/<first>, out_dir/<first + 1>, ... (see
    `calibration_from`)."""
    nodes = _loss_slots(stages, pipelines, losses)
    faults = [f"node{n}@{(i + 1) * iterations_per_phase}" for i, n in enumerate(nodes)]
    extra: list[str] = []
    for f in faults:
        extra += ["--fail", f]
    return [_train(config, Path(out_dir) / str(r), stages=stages, pipelines=pipelines,
                   iterations=(len(faults) + 1) * iterations_per_phase, sets=sets,
                   extra=extra, timeout_s=timeout_s) for r in range(first, first + repeats)]


def replay(config: str | Path, out_dir: str | Path, segment: str | Path, *, time_scale: float,
           stages: int, pipelines: int, iterations: int, sets: list[str] = (),
           timeout_s: float = 240.0) -> dict[str, Any]:
    """Run `spotpipe train` on the segment; returns rc, wall seconds and the output tail."""
    return _train(config, out_dir, stages=stages, pipelines=pipelines, iterations=iterations,
                  sets=sets, extra=["--trace", str(segment), "--time-scale", str(time_scale)],
                  timeout_s=timeout_s)


def _train(config: str | Path, out_dir: str | Path, *, stages: int, pipelines: int,
           iterations: int, sets: list[str], extra: list[str],
           timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "spotpipe", "train", str(config), "--stages", str(stages),
           "--pipelines", str(pipelines), "--out", str(out_dir), "--overwrite", "--no-progress",
           *extra, "--set", f"iterations={iterations}"]
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - t, "command": cmd,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


# -- what a run measured ------------------------------------------------------------------

def generation_shapes(events: list[dict]) -> dict[int, tuple]:
    """Layout shape (`Layout.shape_key()`) of each generation of a run, rebuilt from its
    launch and plan events with `plan.decide`, the function the launcher used."""
    from spotpipe.plan import Action, Layout, decide

    launch = next((e for e in events if e.get("kind") == "launch"), None)
    if launch is None:
        raise ValueError("events.jsonl has no launch event")
    p, d = int(launch["stages"]), int(launch["pipelines"])
    repartition = bool(launch.get("repartition", True))
    microbatches = launch.get("microbatches")  # (absent from runs before it was recorded)
    shapes = {0: Layout.build(p, d, [f"node{i}" for i in range(p * d)]).shape_key()}
    lost_by_gen = {int(e["generation"]): set(e.get("lost", ())) for e in events
                   if e.get("kind") == "agreement"}
    for e in events:
        if e.get("kind") != "plan" or "previous_layout" not in e:
            continue
        gen = int(e["generation"])
        layout = Layout.from_json(e["previous_layout"])
        # the agreement of the generation before this plan names who was lost
        lost = frozenset(lost_by_gen.get(gen - 1, ())) & layout.active_nodes
        for _ in range(8):
            dec = decide(layout, lost, (), repartition=repartition,
                         microbatches=None if microbatches is None else int(microbatches))
            layout, lost = dec.layout, frozenset()
            if dec.action in (Action.KEEP, Action.STOP):
                break
        shapes[gen] = layout.shape_key()
    return shapes


def iteration_times(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per generation: mean and median seconds between consecutive completed iterations of
    that generation (the interval that spans a failover belongs to no generation), and
    their count. The mean, not the median, is what goodput follows on a noisy machine."""
    return {g: {"mean_s": statistics.fmean(v), "median_s": statistics.median(v), "n": len(v)}
            for g, v in _gaps(rows).items() if v}


def loss_pauses(events: list[dict], rows: list[dict]) -> list[dict[str, float]]:
    """Per loss: when it happened and how long each part of the failover took, in seconds:
    detection (loss to the launcher's failure_detected), agreement, regroup (takeover and
    new process groups), restart (to the workers' resume), `pause_s` (loss to resume), and
    `lost_work_s` (loss minus the last iteration completed before it: the in-flight work
    replayed)."""
    out = []
    losses = [e for e in events if e.get("kind") in _LOSS_KINDS]
    for i, ev in enumerate(losses):
        t = float(ev["time_s"])
        nxt = float(losses[i + 1]["time_s"]) if i + 1 < len(losses) else math.inf

        def first(kind: str, after: float, nxt: float = nxt) -> float | None:
            ts = [float(e["time_s"]) for e in events
                  if e.get("kind") == kind and after <= float(e["time_s"]) < nxt]
            return min(ts) if ts else None

        detected = first("failure_detected", t)
        agreed = first("agreement", detected if detected is not None else t)
        regroups = [float(e["time_s"]) for e in events if e.get("kind") in
                    ("takeover", "regrouped") and (agreed or t) <= float(e["time_s"]) < nxt]
        resumed = first("resumed", t)
        if resumed is None:
            continue
        regrouped = max(regroups) if regroups else (agreed or t)
        before = [float(r["time_s"]) for r in rows if float(r["time_s"]) <= t]
        out.append({"time_s": t, "node": str(ev.get("node", "")),
                    "detection_s": (detected if detected is not None else t) - t,
                    "agreement_s": (agreed or detected or t) - (detected or t),
                    "regroup_s": regrouped - (agreed or detected or t),
                    "restart_s": resumed - regrouped, "pause_s": resumed - t,
                    "lost_work_s": t - before[-1] if before else 0.0})
    return out


def calibration_from(run_dirs: str | Path | list[str | Path]) -> dict[str, Any]:
    """Seconds per iteration of each layout shape some runs went through, and their pause.

    A shape's time is the mean interval between its iterations in a run, and the median of
    that over the runs: on a machine shared with other work the load moves by tens of
    percent over tens of seconds, and a median of short runs taken minutes apart is the
    steadiest figure we found (local ratios either side of each change, chained, and the
    replayed run's own first phase as the level both did worse on the runs in README.md).
    """
    dirs = [Path(d) for d in (run_dirs if isinstance(run_dirs, (list, tuple)) else [run_dirs])]
    per_shape: dict[tuple, list[float]] = {}
    pauses: list[dict[str, float]] = []
    generations = []
    for run_dir in dirs:
        rows = _jsonl(run_dir / "metrics.jsonl")
        events = _jsonl(run_dir / "events.jsonl")
        if len(rows) < 10:
            raise ValueError(f"{run_dir}: too few iterations ({len(rows)}) to calibrate")
        shapes = generation_shapes(events)
        gaps = _gaps(rows)
        for gen, v in sorted(gaps.items()):
            if gen in shapes and len(v) >= 5:
                per_shape.setdefault(shapes[gen], []).append(statistics.fmean(v))
        pauses += loss_pauses(events, rows)
        generations.append({g: {"mean_s": statistics.fmean(v), "n": len(v),
                                "shape": list(shapes.get(g, ()))} for g, v in gaps.items()})
    if not per_shape:
        raise ValueError(f"{dirs[0]}: no layout ran long enough to calibrate from")
    return {"run_dir": ", ".join(str(d) for d in dirs),
            "shape_times": {k: statistics.median(v) for k, v in per_shape.items()},
            "pause_s": statistics.fmean(p["pause_s"] for p in pauses) if pauses else 0.0,
            "pauses": pauses, "generations": generations,
            "runs_per_shape": {str(k): len(v) for k, v in per_shape.items()}}


def _gaps(rows: list[dict]) -> dict[int, list[float]]:
    """Seconds between consecutive completed iterations, per generation, in order."""
    gaps: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(rows):
        if a.get("generation", 0) == b.get("generation", 0):
            gaps.setdefault(int(b.get("generation", 0)), []).append(
                float(b["time_s"]) - float(a["time_s"]))
    return gaps


# -- the comparison -----------------------------------------------------------------------

def compare(run_dir: str | Path, segment: str | Path, time_scale: float, *,
            redundancy: str = "lazy", calibration: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Simulate the segment with calibrated figures and compare goodput, phase by phase.

    With `calibration` (from `calibration_from` on separate runs) the simulator uses their
    measured seconds per iteration of each layout shape and their failover pause, and
    nothing of this run: that is `prediction_error`. Also reported: the same with this
    run's own speed before its first loss as the level and the calibration's ratios after
    (`prediction_error_own_level`), and the timing model scaled to this run's first phase
    with its own pauses (`timing_model_error`; the only prediction without a calibration).
    """
    run_dir = Path(run_dir)
    rows = _jsonl(run_dir / "metrics.jsonl")
    events = _jsonl(run_dir / "events.jsonl")
    if len(rows) < 10:
        raise ValueError(f"{run_dir}: too few iterations ({len(rows)}) to calibrate")
    summary = json.loads((run_dir / "summary.json").read_text())
    p, d = int(summary["stages"]), int(summary["pipelines"])
    launch = next((e for e in events if e.get("kind") == "launch"), {})
    t0, s0 = float(rows[0]["time_s"]), float(rows[0]["samples"])
    t1, s1 = float(rows[-1]["time_s"]), float(rows[-1]["samples"])
    duration = t1 - t0
    if duration <= 0:
        raise ValueError(f"{run_dir}: no time between the first and last iteration")
    own_pauses = loss_pauses(events, rows)
    kills = [float(e["time_s"]) for e in events if e.get("kind") in _LOSS_KINDS]
    spi = (s1 - s0) / max(1, int(rows[-1]["iter"]) - int(rows[0]["iter"]))
    m = int(launch.get("num_microbatches") or _config_value(run_dir, "num_microbatches") or 4)
    seg = load_trace(segment)
    trace = Trace([Event(e.time_s / time_scale, e.kind, e.node) for e in seg.events],
                  f"{Path(segment).name} / {time_scale:g}", duration)
    first_loss = min(kills, default=t1)
    own = iteration_times([r for r in rows if float(r["time_s"]) < first_loss])
    iter_s = own[0]["mean_s"] if 0 in own else statistics.fmean(
        float(r["iter_time_s"]) for r in rows)
    unit = _uniform_model(p, 1.0, m * d, spi / (m * d))
    model = _uniform_model(p, iter_s / pipeline_time(unit, "1f1b", p, d, (), False), m * d,
                           spi / (m * d))
    own_pause = statistics.fmean(x["pause_s"] for x in own_pauses) if own_pauses else 0.0

    def simulate(pause_s: float, shape_times: dict) -> Any:
        params = SimParams(boot_s=0.0, rendezvous_s=0.0, pause_s=pause_s,
                           reconfig_pause_s=pause_s)
        cfg = SimConfig(model, price_of("p3.2xlarge"), p, d, params=params,
                        redundancy=redundancy, shape_times=tuple(shape_times.items()),
                        repartition=bool(launch.get("repartition", True)))
        return run(trace, "spotpipe", cfg, duration_s=duration, record=True)

    measured = (s1 - s0) / duration
    after_measured = s1 - _samples_before(rows, first_loss, inclusive=False)

    def errors(sim: Any) -> tuple[float, float]:
        whole = (sim.samples / duration - measured) / measured
        after = sim.samples - _sim_samples_at(sim, first_loss - t0)
        return whole, ((after - after_measured) / after_measured if after_measured else 0.0)

    timing_sim = simulate(own_pause, {})
    timing_whole, timing_after = errors(timing_sim)
    out: dict[str, Any] = {
        "measured_samples_per_s": measured, "window_s": duration, "kills": len(kills),
        "measured_samples": s1 - s0, "status": summary.get("status"), "stages": p,
        "pipelines": d, "time_scale": time_scale,
        "timing_model_samples_per_s": timing_sim.samples / duration,
        "timing_model_error": abs(timing_whole), "timing_model_error_after_first_loss":
        abs(timing_after), "calibrated_iteration_s": iter_s, "pauses": own_pauses,
    }
    shape_times: dict[tuple, float] = {}
    sim = timing_sim
    out["calibrated_pause_s"] = own_pause
    if calibration is not None:
        shape_times = dict(calibration["shape_times"])
        sim = simulate(calibration["pause_s"], shape_times)
        base = shape_times.get(_initial_shape(p, d))
        if base:
            own_level = simulate(calibration["pause_s"],
                                 {k: v / base * iter_s for k, v in shape_times.items()})
            out["prediction_error_own_level"] = abs(errors(own_level)[0])
        out["calibrated_pause_s"] = calibration["pause_s"]
        out["calibration"] = {"run_dir": calibration.get("run_dir"),
                              "pause_s": calibration["pause_s"],
                              "shape_times": [[list(k), v] for k, v in shape_times.items()]}
    whole, after = errors(sim)
    predicted = sim.samples / duration
    out.update(predicted_samples_per_s=predicted, predicted_samples=sim.samples,
               prediction_error=abs(whole), signed_error=whole,
               error_after_first_loss=after,
               predicted_failovers=sim.preemptions, predicted_fatal=sim.fatal_failures,
               predicted_breakdown=sim.breakdown)
    out["phases"] = _phases(rows, events, [k - t0 for k in kills], sim, t0, spi,
                            generation_shapes(events), shape_times)
    return out


def _initial_shape(p: int, d: int) -> tuple:
    """The shape of the job before any loss."""
    return (p, d, ((),) * d)


def _phases(rows: list[dict], events: list[dict], kills: list[float], sim: Any, t0: float,
            spi: float, shapes: dict[int, tuple], shape_times: dict) -> list[dict[str, Any]]:
    """The run cut at each loss: per phase, measured against predicted."""
    bounds = [0.0] + kills + [float(rows[-1]["time_s"]) - t0]
    pauses = {round(x["time_s"] - t0, 6): x for x in loss_pauses(events, rows)}
    gens = iteration_times(rows)
    total = float(rows[-1]["samples"]) - float(rows[0]["samples"])
    out = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        last_b = bounds[-1] if i == len(bounds) - 2 else b
        m_a = _samples_before(rows, t0 + a, inclusive=(i == 0))
        m_b = _samples_before(rows, t0 + last_b, inclusive=(i == len(bounds) - 2))
        p_a, p_b = _sim_samples_at(sim, a), _sim_samples_at(sim, last_b)
        in_phase = [r for r in rows if t0 + a <= float(r["time_s"]) < t0 + b + 1e-9]
        gen = int(in_phase[-1].get("generation", 0)) if in_phase else None
        shape = shapes.get(gen) if gen is not None else None
        pause = pauses.get(round(a, 6)) if i > 0 else None
        phase = {"phase": i, "start_s": a, "end_s": last_b,
                 "measured_samples": m_b - m_a, "predicted_samples": p_b - p_a,
                 "error_share": ((p_b - p_a) - (m_b - m_a)) / total if total else 0.0,
                 "measured_iteration_s": gens[gen]["mean_s"] if gen in gens else None,
                 "predicted_iteration_s": _sim_iteration_s(sim, a, last_b, spi),
                 "shape": list(shape) if shape else None,
                 "calibrated": shape in shape_times if shape else False}
        if pause:
            phase.update({k: pause[k] for k in ("detection_s", "agreement_s", "regroup_s",
                                                "restart_s", "pause_s", "lost_work_s")})
        out.append(phase)
    return out


def _samples_before(rows: list[dict], t: float, inclusive: bool) -> float:
    done = [float(r["samples"]) for r in rows
            if float(r["time_s"]) < t or (inclusive and float(r["time_s"]) <= t + 1e-9)]
    return done[-1] if done else 0.0


def _sim_samples_at(sim: Any, t: float) -> float:
    """Samples the simulated job had completed at time t (after the events of instant t):
    between two timeline points the job runs at the earlier point's speed."""
    last = None
    for x in sim.timeline:
        if x.time_s > t + 1e-12:
            break
        last = x
    return 0.0 if last is None else last.samples + last.throughput * (t - last.time_s)


def _sim_iteration_s(sim: Any, a: float, b: float, spi: float) -> float | None:
    speeds = [x.throughput for x in sim.timeline if a - 1e-12 <= x.time_s < b and x.throughput]
    return spi / speeds[-1] if speeds else None


def format_phases(result: dict[str, Any]) -> str:
    """The per-phase table of `compare`, for people: where the prediction and the run part."""
    own = result.get("prediction_error_own_level")
    head = (f"validation: {result['stages']} x {result['pipelines']} over "
            f"{result['window_s']:.1f} s, {result['kills']} loss(es); goodput measured "
            f"{result['measured_samples_per_s']:.1f} samples/s, predicted "
            f"{result['predicted_samples_per_s']:.1f} (error {result['signed_error']:+.1%}, "
            f"after the first loss {result['error_after_first_loss']:+.1%}; timing model "
            f"alone {result['timing_model_error']:.1%}")
    if own is not None:
        head += f"; at this run's own first-phase speed {own:.1%}"
    lines = [head + ")",
             (f"{'phase':>5} {'from s':>7} {'to s':>7} {'samples meas':>12} {'pred':>8} "
              f"{'share':>7} {'iter s meas':>11} {'pred':>7} {'pause meas':>10} "
              f"{'det':>6} {'agree':>6} {'regroup':>7} {'restart':>7} {'lost':>6}")]
    for ph in result["phases"]:
        def f(key: str, fmt: str = "{:.3f}", ph: dict = ph) -> str:
            v = ph.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        lines.append(f"{ph['phase']:>5} {ph['start_s']:>7.1f} {ph['end_s']:>7.1f} "
                     f"{ph['measured_samples']:>12.0f} {ph['predicted_samples']:>8.0f} "
                     f"{ph['error_share']:>+7.1%} {f('measured_iteration_s'):>11} "
                     f"{f('predicted_iteration_s'):>7} {f('pause_s'):>10} "
                     f"{f('detection_s'):>6} {f('agreement_s'):>6} {f('regroup_s'):>7} "
                     f"{f('restart_s'):>7} {f('lost_work_s'):>6}")
    lines.append(f"predicted pause per loss {result['calibrated_pause_s']:.3f} s plus the "
                 f"in-flight iteration; 'share' is each phase's (predicted - measured) "
                 f"samples over all measured samples")
    return "\n".join(lines)


def validate(work_dir: str | Path, *, trace_path: str | Path = SHARED_TRACE,
             window: tuple[float, float] = DEFAULT_WINDOW, time_scale: float = 4.0,
             stages: int = 4, pipelines: int = 1, iterations: int = 1200, losses: int = 2,
             config: str | Path | None = None, timeout_s: float = 240.0,
             calibration_iterations: int = 60, calibration_repeats: int = 4
             ) -> dict[str, Any]:
    """Segment, calibrate, replay, compare: the whole validation in one call.

    The calibration runs bracket the replay (half before it, half after), so that their
    median sees the machine as it was around the replay, not only before it.
    """
    if not (isinstance(time_scale, (int, float)) and 0 < time_scale < math.inf):
        raise ValueError(f"time_scale must be a finite number above 0, got {time_scale!r}")
    if isinstance(calibration_repeats, bool) or not isinstance(calibration_repeats, int) \
            or calibration_repeats < 1:
        raise ValueError(f"calibration_repeats must be a whole number >= 1, got "
                         f"{calibration_repeats!r}")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    seg = work / "segment.csv"
    info = write_segment(trace_path, seg, start_s=window[0], span_s=window[1], stages=stages,
                         pipelines=pipelines, losses=losses)
    cfg = Path(config) if config else _example_config()
    sets = ["model.gpt.n_layer=2", "redundancy=lazy"]
    before = (calibration_repeats + 1) // 2

    def calibrate(first: int, count: int) -> list[dict[str, Any]]:
        return calibration_run(cfg, work / "calibration", stages=stages, pipelines=pipelines,
                               losses=len(info["losses"]),
                               iterations_per_phase=calibration_iterations, sets=sets,
                               timeout_s=timeout_s, repeats=count, first=first)

    cals = calibrate(0, before)
    rep = replay(cfg, work / "run", seg, time_scale=time_scale, stages=stages,
                 pipelines=pipelines, iterations=iterations, sets=sets, timeout_s=timeout_s)
    if rep["rc"] != 0 and not (work / "run" / "metrics.jsonl").exists():
        raise RuntimeError(f"replay failed (rc {rep['rc']}): {rep['tail']}")
    cals += calibrate(before, calibration_repeats - before)
    good = [work / "calibration" / str(r) for r, c in enumerate(cals) if c["rc"] == 0]
    if not good:
        raise RuntimeError(f"calibration runs failed (rc {cals[-1]['rc']}): {cals[-1]['tail']}")
    out = compare(work / "run", seg, time_scale, calibration=calibration_from(good))
    out.update(segment=info, replay_wall_s=rep["wall_s"], replay_rc=rep["rc"],
               calibration_wall_s=sum(c["wall_s"] for c in cals),
               calibration_runs=len(good))
    return out


def _example_config() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "examples" / "gpt_tiny.yaml"
        if cand.exists():
            return cand
    raise FileNotFoundError("examples/gpt_tiny.yaml not found; pass config=")


def _uniform_model(p: int, f: float, microbatches: int, mbs: float) -> ModelCosts:
    return ModelCosts(name="calibrated", forward_s=(f,) * p, backward_s=(2 * f,) * p,
                      param_bytes=(0.0,) * p, activation_bytes=0.0,
                      micro_batch_size=max(1, round(mbs)), global_microbatches=microbatches)


def _config_value(run_dir: Path, key: str) -> Any:
    try:
        import yaml

        return (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get(key)
    except Exception:  # noqa: BLE001 - optional: the caller has a default
        return None


_jsonl = read_jsonl


def _at_least_one(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _above_zero(text: str) -> float:
    """A finite number above 0 (argparse's `float` takes "nan" and "inf"). The simulator's
    layer does not reach `spotpipe.cli.argtypes`, whose `positive_number` this is."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """`python -m spotpipe.sim.validate [--work DIR]`: the per-phase table, then one JSON."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m spotpipe.sim.validate",
                                 description="replay a trace segment locally and compare it "
                                             "with the simulator's prediction")
    ap.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--time-scale", type=_above_zero, default=4.0,
                    help="trace seconds per second of the replay (default 4)")
    ap.add_argument("--calibration-repeats", type=_at_least_one, default=4,
                    help="calibration runs around the replay (default 4)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spotpipe-validate-") as tmp:
        out = validate(args.work or tmp, time_scale=args.time_scale,
                       calibration_repeats=args.calibration_repeats)
    print(format_phases(out))
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
