"""`spotpipe bench failover`: how long a failover pauses training, against checkpoint-restart.

Runs real local clusters (`spotpipe train` as a subprocess, faults injected through the same
paths as real failures) and reads the pauses from their events:

- crash: SIGKILL of a node; the pause runs from the kill to the first iteration completed
  after it, split into detection (kill -> first report or launcher detection), agreement
  (-> plan published), takeover (-> new generation formed, replica promoted) and replay
  (-> the in-flight iteration completed: by default survivors keep their share of it and only
  the lost stage's work is redone; the full run also measures `failover.replay: iteration`,
  where every node replays the whole iteration);
- notice: SIGTERM; the node leaves at the next iteration boundary, nothing is replayed, and
  with no standby node the job re-partitions onto the others at once (P = 4 -> 3 -> 2), so
  the pause holds the layer exchange (before, a takeover whose re-partition came at the next
  boundary, its pause not counted);
- adjacent notices: two nodes of adjacent stages get theirs at the same iteration; the
  later stage's replica leaves with the other, so its node hands the stage over itself;
- cold restart baseline: the same crash without redundancy stops the job,
  every worker is started again and loads the newest torch.distributed.checkpoint checkpoint
  (written every k iterations), and the pause runs from the kill until the restarted job has
  again completed the iteration that was in flight (a cold restart: a new launcher, torch
  imported again, the checkpoint verified in the launcher and in every worker);
- torchrun-style restart, as torchrun's agent does it: the launcher and its store survive,
  only the workers are stopped and started again from the newest checkpoint
  (`failover.restarts`), timed in the same way. Every ratio is stated against both.

Pauses in iterations (`pause_iterations`, `notice_pause_iterations`) count the crash run's
median iteration before its first fault (`iteration_s`), as `bench chaos` counts its own.

Both baselines start every worker in a fresh interpreter that imports torch, as torchrun does
(`cluster.fork_server=false`). `--quick` (the test of this bench, whose figures nobody reads)
runs the baselines at P=2: their fresh interpreters are most of its time. The full run also
times spotpipe's own restart (`failover.restarts` with the workers forked from the fork
server): what a job without redundancy pays here.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spotpipe.bench.stats import ratio_of_medians
from spotpipe.runfiles import read_jsonl

# what a node reports once it runs in the Decision's generation
REGROUP_EVENTS = ("takeover", "migrated", "regrouped", "repartitioned")

REPO_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt_tiny.yaml"
BASE = ["--set", "model.gpt.n_layer=4", "--set", "model.gpt.n_embd=64",
        "--set", "micro_batch_size=4", "--set", "num_microbatches=4",
        "--set", "failover.heartbeat_s=0.2", "--set", "failover.heartbeat_timeout_s=2",
        "--set", "failover.hang_timeout_s=2", "--no-progress"]
# the restart baselines' workers: fresh interpreters, as torchrun starts them
FRESH = ["--set", "cluster.fork_server=false"]


def _train(out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "spotpipe", "train", str(REPO_EXAMPLE),
                             "--out", str(out), "--overwrite", *BASE, *args],
                            capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise RuntimeError(f"bench job failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


_jsonl = read_jsonl


def failover_pauses(run: Path) -> list[dict[str, float]]:
    """One entry per incident: the pause and its parts, in seconds, from the run's files."""
    events = _jsonl(run / "events.jsonl")
    metrics = _jsonl(run / "metrics.jsonl")
    out = []
    starts = [e for e in events if e["kind"] in ("fault_injected", "trace_kill")]
    for start in starts:
        t0 = start["time_s"]
        after = [e for e in events if e["time_s"] >= t0]
        detect = min((e["time_s"] for e in after if e["kind"] in ("report", "failure_detected")),
                     default=None)
        plan = next((e for e in after if e["kind"] == "plan"), None)
        # (the node's regroup done: a notice with no standby node re-partitions at once)
        takeover = next((e for e in after if e["kind"] in REGROUP_EVENTS), None)
        if detect is None or plan is None or takeover is None:
            continue
        resume = plan.get("resume")
        done = next((m for m in metrics if m["time_s"] >= takeover["time_s"]
                     and m["iter"] >= resume), None)
        if done is None:
            continue
        in_flight = max(e["iteration"] for e in after if e["kind"] == "report"
                        and e["generation"] == plan["generation"] - 1)
        # (not a line the coordinator wrote for it from the reports: its time is the agreement's)
        before = next((m for m in metrics if m["iter"] == resume - 1
                       and not m.get("recovered")), None)
        out.append({"kind": start.get("fault", "kill"), "pause_s": done["time_s"] - t0,
                    "detection_s": detect - t0, "agreement_s": plan["time_s"] - detect,
                    "takeover_s": takeover["time_s"] - plan["time_s"],
                    "replay_s": done["time_s"] - takeover["time_s"],
                    # the stall training sees: between the last iteration completed before
                    # the regroup and the first one after it
                    "stall_s": done["time_s"] - before["time_s"] if before else float("nan"),
                    "replayed_iterations": max(0, in_flight - resume + 1)})
    return out


def iteration_time(run: Path, before_s: float | None = None) -> float:
    times = [m["iter_time_s"] for m in _jsonl(run / "metrics.jsonl")[3:]
             if before_s is None or m["time_s"] < before_s]
    return statistics.median(times)


def iteration_before_faults(run: Path) -> float:
    """The run's median iteration before its first fault (after the first 3, warm-up): what a
    pause is counted in. Iterations after a loss run on another layout (a node carrying two
    stages), and the ones around a recovery hold part of the pause itself."""
    first = min(e["time_s"] for e in _jsonl(run / "events.jsonl")
                if e["kind"] in ("fault_injected", "trace_kill"))
    return iteration_time(run, before_s=first)


def restart_pause(first: Path, second: Path) -> dict[str, float]:
    """Cold restart: kill in `first` (no redundancy, so it stops) -> `second`, a new `spotpipe
    train` from the newest checkpoint, completes the iteration that was in flight."""
    ev1 = _jsonl(first / "events.jsonl")
    kill = next(e for e in ev1 if e["kind"] == "fault_injected")
    ev2 = _jsonl(second / "events.jsonl")
    # both on the second run's clock
    return _restart_figures(ev1[0]["t0"] + kill["time_s"] - ev2[0]["t0"], kill["iteration"],
                            ev2[0], _jsonl(second / "metrics.jsonl"))


def torchrun_restart_pause(run: Path) -> dict[str, float]:
    """torchrun-style restart (`failover.restarts`): in one run, the kill -> the launcher stops
    the workers and starts them again from the newest checkpoint (its store stays up) -> the
    iteration that was in flight is completed again."""
    events = _jsonl(run / "events.jsonl")
    kill = next(e for e in events if e["kind"] == "fault_injected")
    again = next(e for e in events if e["kind"] == "launch" and e.get("restart"))
    metrics = [m for m in _jsonl(run / "metrics.jsonl") if m["time_s"] >= again["time_s"]]
    return _restart_figures(kill["time_s"], kill["iteration"], again, metrics)


def _restart_figures(kill_s: float, killed_in: int, launch: dict[str, Any],
                     metrics: list[dict[str, Any]]) -> dict[str, float]:
    """From the kill (`kill_s`, on the restarted round's clock) to its first completed iteration
    and to the iteration that was in flight completed again."""
    back = next(m for m in metrics if m["iter"] >= killed_in)
    return {"restart_pause_s": back["time_s"] - kill_s,
            "restart_first_iteration_s": metrics[0]["time_s"] - kill_s,
            "restart_lost_iterations": killed_in - launch.get("start_iteration", 0)}


def run(quick: bool = False) -> dict[str, Any]:
    iters = 24 if quick else 60
    k = 10
    crash_at, notice_at = (8, 14) if quick else (20, 40)
    tmp = Path(tempfile.mkdtemp(prefix="spotpipe-bench-failover-"))
    started = time.time()
    common = ["--stages", "4", "--set", f"iterations={iters}", "--set", "redundancy=lazy"]
    crash = tmp / "crash"
    _train(crash, *common, "--fail", f"node1@{crash_at}:backward",
           "--fail", f"node3@{notice_at}:forward")
    notice = tmp / "notice"
    _train(notice, *common, "--notice", f"node1@{crash_at}", "--notice", f"node3@{notice_at}")
    adjacent = tmp / "adjacent-notices"
    _train(adjacent, *common, "--notice", f"node1@{crash_at}", "--notice", f"node2@{crash_at}")
    crashes = failover_pauses(crash)
    variants: dict[str, float] = {}
    if not quick:
        # the same crashes with every node replaying the whole in-flight iteration, and both
        # ways with eager FRC (whose outputs the rest of the iteration sends on at once)
        for mode in ("lazy", "eager"):
            for replay in ("rest", "iteration"):
                if (mode, replay) == ("lazy", "rest"):
                    continue  # the main run
                out = tmp / f"crash-{mode}-{replay}"
                _train(out, "--stages", "4", "--set", f"iterations={iters}",
                       "--set", f"redundancy={mode}", "--set", f"failover.replay={replay}",
                       "--fail", f"node1@{crash_at}:backward",
                       "--fail", f"node3@{notice_at}:forward")
                got = failover_pauses(out)
                name = f"{mode}_{replay}" if mode == "eager" else replay
                variants[f"{name}_replay_pause_s"] = round(
                    statistics.median(p["pause_s"] for p in got), 4)
                variants[f"{name}_replay_s"] = round(
                    statistics.median(p["replay_s"] for p in got), 4)
    notices = failover_pauses(notice)
    pair = failover_pauses(adjacent)[:1]  # (both notices ride one commit: one incident)
    if not pair:
        raise RuntimeError(f"{adjacent}: no recovery from the adjacent notices in its events")
    # the baseline: no redundancy, a checkpoint every k iterations, restart everything
    first, second = tmp / "restart-1", tmp / "restart-2"
    kill_at = crash_at + k // 2 + 1  # mid-interval: the expected loss of periodic checkpoints
    baseline = ["--stages", "2" if quick else "4", "--set", f"iterations={iters}",
                "--set", "redundancy=none"]
    _train(first, *baseline, "--set", f"checkpoint.every={k}",
           "--fail", f"node1@{kill_at}:backward", *FRESH, check=False)
    _train(second, *baseline, "--resume", str(first), *FRESH)
    restart = restart_pause(first, second)
    # torchrun-style: the same loss, the launcher restarts only the workers
    torchrun = tmp / "restart-torchrun"
    restarts = [*baseline,
                "--set", f"checkpoint.every={k}", "--set", "failover.restarts=1",
                "--fail", f"node1@{kill_at}:backward"]
    _train(torchrun, *restarts, *FRESH)
    warm = torchrun_restart_pause(torchrun)
    if not quick:  # spotpipe's own restart: the same, its workers forked from the fork server
        forked = tmp / "restart-forked"
        _train(forked, *restarts)
        forked_pause = torchrun_restart_pause(forked)["restart_pause_s"]
        variants["forked_restart_pause_s"] = round(forked_pause, 3)
        variants["forked_restart_over_failover_ratio"] = round(ratio_of_medians(
            [forked_pause], [p["pause_s"] for p in crashes]), 1)
    it = iteration_before_faults(crash)
    pause = statistics.median(p["pause_s"] for p in crashes)
    figures: dict[str, Any] = {
        "pause_s": round(pause, 4),
        "pause_iterations": round(pause / it, 2),
        "detection_s": round(statistics.median(p["detection_s"] for p in crashes), 4),
        "agreement_s": round(statistics.median(p["agreement_s"] for p in crashes), 4),
        "takeover_s": round(statistics.median(p["takeover_s"] for p in crashes), 4),
        "replay_s": round(statistics.median(p["replay_s"] for p in crashes), 4),
        **variants,
        # a notice arrives at an iteration's start and rides that iteration's commit, which is
        # useful work: the pause is the stall between the iteration that carried it and the
        # first one after the regroup
        "notice_pause_s": round(statistics.median(p["stall_s"] for p in notices), 4),
        "notice_pause_iterations": round(statistics.median(p["stall_s"] for p in notices) / it,
                                         2),
        "notice_signal_to_resume_s": round(statistics.median(p["pause_s"] for p in notices), 4),
        "notice_replayed_iterations": max(p["replayed_iterations"] for p in notices),
        "adjacent_notices_pause_s": round(pair[0]["stall_s"], 4),
        "adjacent_notices_pause_iterations": round(pair[0]["stall_s"] / it, 2),
        "adjacent_notices_replayed_iterations": pair[0]["replayed_iterations"],
        "iteration_s": round(it, 4),
        "restart_pause_s": round(restart["restart_pause_s"], 3),
        "restart_first_iteration_s": round(restart["restart_first_iteration_s"], 3),
        "restart_lost_iterations": restart["restart_lost_iterations"],
        "torchrun_restart_pause_s": round(warm["restart_pause_s"], 3),
        "torchrun_restart_first_iteration_s": round(warm["restart_first_iteration_s"], 3),
        "torchrun_restart_lost_iterations": warm["restart_lost_iterations"],
        "restart_over_failover_ratio": round(ratio_of_medians(
            [restart["restart_pause_s"]], [p["pause_s"] for p in crashes]), 1),
        "torchrun_restart_over_failover_ratio": round(ratio_of_medians(
            [warm["restart_pause_s"]], [p["pause_s"] for p in crashes]), 1),
        "crash_failovers": len(crashes), "notice_failovers": len(notices),
        "checkpoint_every": k,
        "config": "P=4 D=1 gloo, GPT n_layer=4 n_embd=64, micro-batch 4 x M=4, redundancy lazy; "
                  f"{iters} iterations; crashes at {crash_at} (backward) and {notice_at} (forward)"
                  + ("; the restart baselines at P=2 (--quick)" if quick else ""),
        "wall_s": round(time.time() - started, 1),
        "runs": str(tmp),
    }
    if os.environ.get("SPOTPIPE_BENCH_KEEP") != "1":
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        figures["runs"] = "(removed; SPOTPIPE_BENCH_KEEP=1 keeps them)"
    return figures
