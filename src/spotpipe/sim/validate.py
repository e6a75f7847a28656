"""Validation: replay a segment of a real trace on the local cluster, then predict it.

1. `write_segment` cuts a window out of a real trace (Bamboo's p3 or g4dn) for a P x D job:
   P x D nodes live at the window's start, the ones the trace removes inside the window placed
   at non-adjacent stages (so every loss can fail over), the others surviving it. Only those
   nodes are written: the runtime cannot take joining nodes yet (additions are only logged),
   so the simulator must not see them either.
2. `replay` runs `spotpipe train --trace SEGMENT --time-scale X` as a subprocess.
3. `compare` calibrates the simulator from the run itself (iteration time: median before the
   first loss; failover pause: from each `trace_kill` to the next `resumed`), simulates the
   same segment (times / X) for the same wall window and layout, and reports
   prediction_error = |predicted - measured| / measured of goodput (samples per second from
   the first iteration to the last).
"""

from __future__ import annotations

import json
import os
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
from spotpipe.sim.traces import ADD, REMOVE, Event, Trace, load_trace

SHARED_TRACE = Path(os.environ.get("SPOTPIPE_SHARED", "/work/shared")) / "traces" / "bamboo-p3.csv"
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


def replay(config: str | Path, out_dir: str | Path, segment: str | Path, *, time_scale: float,
           stages: int, pipelines: int, iterations: int, sets: list[str] = (),
           timeout_s: float = 240.0) -> dict[str, Any]:
    """Run `spotpipe train` on the segment; returns rc, wall seconds and the output tail."""
    cmd = [sys.executable, "-m", "spotpipe", "train", str(config), "--stages", str(stages),
           "--pipelines", str(pipelines), "--out", str(out_dir), "--overwrite", "--no-progress",
           "--trace", str(segment), "--time-scale", str(time_scale),
           "--set", f"iterations={iterations}"]
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - t, "command": cmd,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


def compare(run_dir: str | Path, segment: str | Path, time_scale: float, *,
            redundancy: str = "lazy") -> dict[str, Any]:
    """Calibrate from the run, simulate the same segment, and compare goodput."""
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
    kills = [float(e["time_s"]) for e in events if e.get("kind") == "trace_kill"]
    resumed = sorted(float(e["time_s"]) for e in events if e.get("kind") == "resumed")
    first_loss = min(kills, default=t1)
    before = [float(r["iter_time_s"]) for r in rows[5:] if float(r["time_s"]) < first_loss]
    if len(before) < 3:
        before = [float(r["iter_time_s"]) for r in rows if float(r["time_s"]) < first_loss]
    iter_s = statistics.median(before)
    pauses = [next(r for r in resumed if r >= k) - k for k in kills
              if any(r >= k for r in resumed)]
    pause_s = statistics.mean(pauses) if pauses else 0.0
    spi = (s1 - s0) / max(1, int(rows[-1]["iter"]) - int(rows[0]["iter"]))
    m = int(launch.get("num_microbatches") or _config_value(run_dir, "num_microbatches") or 4)
    # per-stage forward f, backward 2 f: fitted so the plain P-stage schedule takes iter_s
    unit = _uniform_model(p, 1.0, m * d, spi / (m * d))
    scale = iter_s / pipeline_time(unit, "1f1b", p, d, (), False)
    model = _uniform_model(p, scale, m * d, spi / (m * d))
    params = SimParams(boot_s=0.0, rendezvous_s=0.0, pause_s=pause_s, reconfig_pause_s=pause_s)
    cfg = SimConfig(model, price_of("p3.2xlarge"), p, d, params=params, redundancy=redundancy)
    seg = load_trace(segment)
    trace = Trace([Event(e.time_s / time_scale, e.kind, e.node) for e in seg.events],
                  f"{Path(segment).name} / {time_scale:g}", duration)
    sim = run(trace, "spotpipe", cfg, duration_s=duration, record=False)
    measured = (s1 - s0) / duration
    predicted = sim.samples / duration
    return {"measured_samples_per_s": measured, "predicted_samples_per_s": predicted,
            "prediction_error": abs(predicted - measured) / measured,
            "signed_error": (predicted - measured) / measured,
            "window_s": duration, "calibrated_iteration_s": iter_s,
            "calibrated_pause_s": pause_s, "pauses_s": pauses, "kills": len(kills),
            "measured_samples": s1 - s0, "predicted_samples": sim.samples,
            "predicted_failovers": sim.preemptions, "predicted_fatal": sim.fatal_failures,
            "status": summary.get("status"), "stages": p, "pipelines": d,
            "time_scale": time_scale}


def validate(work_dir: str | Path, *, trace_path: str | Path = SHARED_TRACE,
             window: tuple[float, float] = DEFAULT_WINDOW, time_scale: float = 4.0,
             stages: int = 4, pipelines: int = 1, iterations: int = 1200, losses: int = 2,
             config: str | Path | None = None, timeout_s: float = 240.0) -> dict[str, Any]:
    """Segment, replay, compare; the whole validation in one call."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    seg = work / "segment.csv"
    info = write_segment(trace_path, seg, start_s=window[0], span_s=window[1], stages=stages,
                         pipelines=pipelines, losses=losses)
    cfg = Path(config) if config else _example_config()
    rep = replay(cfg, work / "run", seg, time_scale=time_scale, stages=stages,
                 pipelines=pipelines, iterations=iterations,
                 sets=["model.gpt.n_layer=2", "redundancy=lazy"], timeout_s=timeout_s)
    if rep["rc"] != 0 and not (work / "run" / "metrics.jsonl").exists():
        raise RuntimeError(f"replay failed (rc {rep['rc']}): {rep['tail']}")
    out = compare(work / "run", seg, time_scale)
    out.update(segment=info, replay_wall_s=rep["wall_s"], replay_rc=rep["rc"])
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
