"""The shadow's figures for `spotpipe bench checkpoint`: cost to training, lost work, recovery.

- Throughput: the same job with and without CPU shadows (a checkpoint of every iteration),
  runs interleaved round by round so that drift of a shared machine hits both alike; the
  ratio of median iteration times after warm-up.
- Lost work and recovery: a job without redundancy, so every loss must be repaired from the
  shadows, killed again and again at random iterations and phases (a seeded generator), with a
  node joining after each kill to restore the width. Per failure: the iterations replayed (the
  work lost) and the pause from the kill to the first iteration completed after it.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from spotpipe.bench.failover import _jsonl, _train, failover_pauses

PHASES = ["start", "forward", "backward", "all-reduce", "optimizer"]


def iteration_times(run: Path, skip: int = 3) -> list[float]:
    return [m["iter_time_s"] for m in _jsonl(run / "metrics.jsonl")[skip:]]


def throughput(tmp: Path, *, rounds: int, iters: int,
               redundancy: str = "none") -> dict[str, Any]:
    """Iteration time with and without shadows, in interleaved rounds.

    Runs minutes apart on a shared machine differ by 10% with the same configuration, more
    than the shadows cost, so each round pairs one run without and one with shadows, back to
    back, and the ratio is the median over rounds of each pair's ratio of median iteration
    times (drift between rounds cancels within a pair). Here the shadows share the workers'
    cores; `shadow_ratio_own_hosts` is the same job with the shadows' CPU elsewhere, from the
    time the writers spend on them (`ShadowWriter.writer_s`)."""
    times: dict[str, list[float]] = {"none": [], "shadow": []}
    pairs: list[float] = []
    writer: list[float] = []  # per shadow run: the writers' added time per iteration (max)
    common = ["--stages", "2", "--set", f"iterations={iters}", "--set", f"redundancy={redundancy}"]
    for r in range(rounds):
        medians = {}
        for variant in (("none", "shadow") if r % 2 == 0 else ("shadow", "none")):
            out = tmp / f"tput-{variant}-{r}"
            _train(out, *common, "--set", f"shadow.enabled={variant == 'shadow'}")
            got = iteration_times(out)
            times[variant] += got
            if variant == "shadow":
                writer.append(max(e["writer_s"] for e in _jsonl(out / "events.jsonl")
                                  if e["kind"] == "shadow_waits") / iters)
            medians[variant] = statistics.median(got)
        pairs.append(medians["none"] / medians["shadow"])
    base, shadow = statistics.median(times["none"]), statistics.median(times["shadow"])
    overhead = statistics.median(writer)
    return {"shadow_ratio": round(statistics.median(pairs), 4),
            # what the shadows cost where they run on hosts of their own, as on a cluster:
            # only the writer's side (copy, send, confirm, commit) is left on training's path
            "shadow_writer_s_per_iteration": round(overhead, 6),
            "shadow_ratio_own_hosts": round(base / (base + overhead), 4),
            "shadow_ratio_pooled": round(base / shadow, 4),
            "shadow_ratio_rounds": [round(x, 4) for x in pairs],
            "iteration_s": round(base, 5), "shadow_iteration_s": round(shadow, 5)}


def kill_schedule(kills: int, *, seed: int, first: int = 4, gap: int = 4) -> tuple[list[str], int]:
    """`--fail`/`--join` arguments for `kills` kill-then-join cycles on a P=2 job, and the
    iterations it needs. Node names follow the launcher's numbering: joiners are node2,
    node3, ... in order, each taking the place of the node killed before it."""
    rng = random.Random(seed)
    args: list[str] = []
    live = ["node0", "node1"]
    at = first
    for k in range(kills):
        victim = rng.choice(live)
        args += ["--fail", f"{victim}@{at + rng.randrange(2)}:{rng.choice(PHASES)}",
                 "--join", str(at + 2)]
        live[live.index(victim)] = f"node{2 + k}"
        at += gap
    return args, at + gap


def recovery(tmp: Path, *, kills: int, runs: int, seed: int) -> dict[str, Any]:
    pauses: list[dict[str, float]] = []
    per_run = kills // runs
    for r in range(runs):
        args, iters = kill_schedule(per_run, seed=seed + r)
        out = tmp / f"kills-{r}"
        _train(out, "--stages", "2", "--set", f"iterations={iters}", "--set", "redundancy=none",
               "--set", "shadow.enabled=true", *args)
        pauses += failover_pauses(out)
    lost = [p["replayed_iterations"] for p in pauses]
    return {"shadow_lost_iterations_per_failure": round(statistics.mean(lost), 3),
            "shadow_lost_iterations_max": max(lost),
            "shadow_recovery_s": round(statistics.median(p["pause_s"] for p in pauses), 4),
            "shadow_failures": len(pauses)}
