"""`spotpipe bench reconfigure`: the pause of each layout change, against checkpoint-restart.

Real local clusters (`spotpipe train` subprocesses), changes driven through the real paths:

- rebalance: P=2, D=1; a crash leaves one node carrying both stages, a joining node takes one
  back (stage and replicas move peer to peer);
- drop_pipeline: P=2, D=2; both nodes of pipeline 0 crash, the job goes on with one pipeline;
- add_pipeline: then two nodes join and form a second pipeline again;
- drop_to_split and add_pipelines: P=2, D=4 (16 micro-batches); both nodes of pipeline 0
  crash, and since 16 do not split over 3 pipelines, pipeline 3 goes to standby with them
  (D=2); then two nodes join and, with pipeline 3's two, form two pipelines in one change
  (D=4 again). Reported beside the others, not in the median the restart ratios divide;
- repartition: P=4, D=1; two non-adjacent nodes crash, their predecessors carry two stages
  each, and the job re-partitions onto the two nodes left (P=2, layers and optimizer state
  move peer to peer); then two nodes join and it re-partitions back to P=4. Both changes are
  measured; `repartition_*` is the slower of the two.

The pause of a change is the stall training sees: from the last iteration completed before the
change to the first one completed after it, less one ordinary iteration. The restart baseline
does what torchrun does for any change of membership: stop everything, start every worker again
and load the newest torch.distributed.checkpoint checkpoint (written every k iterations), and is
measured once, on the same P=2 x D=2 job, from the kill to the first iteration completed after
the restart (both owners of stage 1 killed: without redundancy one loss drops its pipeline).
Beside it, the torchrun-style restart (`failover.restarts`: the launcher and its store
survive, only the workers start again from the newest checkpoint), timed the same way; every
ratio is stated against both. Both baselines' workers are fresh interpreters, as
torchrun's are (`cluster.fork_server=false`).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spotpipe.bench.failover import (FRESH, REGROUP_EVENTS, _jsonl, _train, restart_pause,
                                     torchrun_restart_pause)
from spotpipe.bench.stats import ratio_of_medians

# the restart baselines' loss: stage 1 in both pipelines of P=2 x D=2 (without redundancy one
# loss only drops its pipeline; with stage 1 on no survivor the job stops and restarts)
STAGE_1_LOST = ("--fail", "node1@16:backward", "--fail", "node3@16:backward")


def _stall(run: Path, action: str, nth: int = 0) -> dict[str, float]:
    """The pause around the `nth` plan with `action`, and the bytes it moved.

    Lines the coordinator recovered at a failure (`"recovered": true`) are written when the
    failure is agreed, not when their iteration completed: taken for the last iteration
    before the change they cut the stall short, so only the workers' own lines count. The
    ordinary iteration taken off is the new layout's (the median of the iterations after the
    first one of the change, up to the next plan), which the first iteration after it runs
    on; the run's median mixed every layout the run went through."""
    events = _jsonl(run / "events.jsonl")
    metrics = [m for m in _jsonl(run / "metrics.jsonl") if not m.get("recovered")]
    plans = [e for e in events if e["kind"] == "plan"]
    plan = [e for e in plans if e["action"] == action][nth]
    resume = plan["resume"]
    before = max((m for m in metrics if m["time_s"] <= plan["time_s"]), key=lambda m: m["time_s"])
    after = next(m for m in metrics if m["time_s"] > plan["time_s"] and m["iter"] >= resume)
    following = [p["time_s"] for p in plans if p["time_s"] > after["time_s"]]
    until = min(following, default=float("inf"))
    layout = [m["iter_time_s"] for m in metrics if after["time_s"] < m["time_s"] < until]
    normal = statistics.median(layout if len(layout) >= 3 else
                               [m["iter_time_s"] for m in metrics[3:]
                                if m["time_s"] <= plan["time_s"]])
    moved = sum(e.get("bytes_received", 0) for e in events
                if e["kind"] in REGROUP_EVENTS
                and e.get("generation") == plan["generation"])
    return {"pause_s": max(0.0, after["time_s"] - before["time_s"] - normal),
            "bytes": moved, "iteration_s": normal}


def run(quick: bool = False) -> dict[str, Any]:
    iters = 40 if quick else 80
    tmp = Path(tempfile.mkdtemp(prefix="spotpipe-bench-reconfigure-"))
    started = time.time()
    rebalance = tmp / "rebalance"
    _train(rebalance, "--stages", "2", "--set", f"iterations={iters}",
           "--set", "redundancy=lazy", "--fail", "node1@10", "--join", "20")
    widths = tmp / "widths"
    _train(widths, "--stages", "2", "--pipelines", "2", "--set", f"iterations={iters}",
           "--set", "redundancy=lazy", "--set", "optimizer.name=sgd",
           "--fail", "node0@10:backward", "--fail", "node1@10:backward",
           "--join", "20", "--join", "20")
    wide = tmp / "wide"
    _train(wide, "--stages", "2", "--pipelines", "4", "--set", f"iterations={iters}",
           "--set", "redundancy=lazy", "--set", "optimizer.name=sgd",
           "--fail", "node0@10:backward", "--fail", "node1@10:backward",
           "--join", "20", "--join", "20")
    depth = tmp / "depth"
    _train(depth, "--stages", "4", "--set", f"iterations={iters}", "--set", "redundancy=lazy",
           "--fail", "node1@10:backward", "--fail", "node3@10:backward",
           "--join", "20", "--join", "20")
    first, second = tmp / "restart-1", tmp / "restart-2"
    common = ["--stages", "2", "--pipelines", "2", "--set", f"iterations={iters}",
              "--set", "redundancy=none", "--set", "optimizer.name=sgd", *FRESH]
    _train(first, *common, "--set", "checkpoint.every=10", *STAGE_1_LOST, check=False)
    _train(second, *common, "--resume", str(first))
    restart = restart_pause(first, second)["restart_first_iteration_s"]
    torchrun_run = tmp / "restart-torchrun"
    _train(torchrun_run, *common, "--set", "checkpoint.every=10", "--set", "failover.restarts=1",
           *STAGE_1_LOST)
    torchrun = torchrun_restart_pause(torchrun_run)["restart_first_iteration_s"]
    figures: dict[str, Any] = {}
    pauses: list[float] = []

    def against_restarts(name: str, pause_s: float, counted: bool = True) -> None:
        if counted:
            pauses.append(pause_s)
        for key, baseline in (("restart", restart), ("torchrun_restart", torchrun)):
            figures[f"{name}_{key}_ratio"] = round(baseline / max(pause_s, 1e-3), 1)

    for name, run_dir, action in (("rebalance", rebalance, "rebalance"),
                                  ("drop_pipeline", widths, "drop_pipeline"),
                                  ("add_pipeline", widths, "add_pipeline"),
                                  ("drop_to_split", wide, "drop_pipeline"),
                                  ("add_pipelines", wide, "add_pipeline")):
        s = _stall(run_dir, action)
        figures[f"{name}_pause_s"] = round(s["pause_s"], 4)
        figures[f"{name}_pause_iterations"] = round(s["pause_s"] / s["iteration_s"], 2)
        figures[f"{name}_bytes_moved"] = s["bytes"]
        against_restarts(name, s["pause_s"], counted=run_dir is not wide)
    down, up = _stall(depth, "repartition", 0), _stall(depth, "repartition", 1)
    for name, s in (("repartition_down", down), ("repartition_up", up),
                    ("repartition", max(down, up, key=lambda x: x["pause_s"]))):
        figures[f"{name}_pause_s"] = round(s["pause_s"], 4)
        figures[f"{name}_pause_iterations"] = round(s["pause_s"] / s["iteration_s"], 2)
        figures[f"{name}_bytes_moved"] = s["bytes"]
        against_restarts(name, s["pause_s"])
    changes = pauses[:-1]  # (the last is `repartition`, the slower of the two counted already)
    figures.update({
        "restart_pause_s": round(restart, 3),
        "torchrun_restart_pause_s": round(torchrun, 3),
        # over the median pause of the five changes
        "restart_over_failover_ratio": round(ratio_of_medians(
            [restart], [max(p, 1e-3) for p in changes]), 1),
        "torchrun_restart_over_failover_ratio": round(ratio_of_medians(
            [torchrun], [max(p, 1e-3) for p in changes]), 1),
        "config": "GPT n_layer=4 n_embd=64 (examples/gpt_tiny.yaml), micro-batch 4 x M=4, "
                  f"{iters} iterations; drop_to_split and add_pipelines P=2 x D=4 -> 2 -> 4; "
                  "repartition P=4 -> 2 -> 4 at D=1; restart baseline "
                  "P=2 x D=2 with a DCP checkpoint every 10 iterations",
        "wall_s": round(time.time() - started, 1),
    })
    shutil.rmtree(tmp, ignore_errors=True)
    return figures


if __name__ == "__main__":
    print(json.dumps(run()))
