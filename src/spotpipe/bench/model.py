"""`spotpipe bench model`: a real model (GPT-2 small, 124M, from its transformers config) at
P = 4 on this machine: throughput in bf16 against fp32, memory per stage (the launch
estimate against each worker's measured peak RSS), and the failover pause in iterations
(of the failure-free bf16 run).

Three runs of `spotpipe train examples/gpt2_small.yaml`, one after the other: fp32, bf16, and
bf16 with one node (stage 2) killed in the forward of an iteration (lazy redundancy: its
predecessor takes the stage over from its replica). Throughput is the median of the
iterations after the first two (warm-up), samples over iteration time. Memory: the estimate
is `spotpipe.plan.memory`'s, the one printed at launch, from the layers' measured facts; the
RSS is each worker process's peak (`ru_maxrss`) and its RSS once its stage and its replica are
built (`rss_built_mib`; each worker reads only the layers it holds from the launcher's initial
weights), which includes the interpreter, torch and transformers (hundreds of MiB) that the
estimate of a stage does not count, so the figure to compare with the estimate is peak - built
plus the stage's own weights. `--quick` runs a 2-layer, 256-wide GPT-2 instead, for the test
suite.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from spotpipe.bench.failover import failover_pauses
from spotpipe.runfiles import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt2_small.yaml"
QUICK = ["--set", "model.hf.overrides={n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 512, "
         "resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}", "--set", "iterations=6"]


def train_example(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "spotpipe", "train", str(EXAMPLE),
                             "--out", str(out), "--overwrite", "--no-progress", *args],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"bench job failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


def throughput(run: Path) -> tuple[float, float]:
    metrics = read_jsonl(run / "metrics.jsonl")
    steady = metrics[2:] or metrics
    it = statistics.median(m["iter_time_s"] for m in steady)
    return statistics.median(m["samples_per_s"] for m in steady), it


def launch_estimates(stderr: str) -> dict[int, float]:
    """Stage -> estimated MiB, from the lines the launch prints."""
    out = {}
    for line in stderr.splitlines():
        if line.startswith("memory: stage "):
            words = line.split()
            out[int(words[2])] = float(words[words.index("needs") + 1])
    return out


def _rss(run: Path) -> dict[int, dict[str, float]]:
    out = {}
    for e in read_jsonl(run / "events.jsonl"):
        if e["kind"] == "worker_done" and len(e["stages"]) == 1:
            out[e["stages"][0]] = {"peak_rss_mib": e["peak_rss_mib"],
                                   "rss_built_mib": e["rss_built_mib"]}
    return out


def run(quick: bool = False) -> dict[str, Any]:
    extra = QUICK if quick else []
    figures: dict[str, Any] = {"model": "gpt2-small (124M)" if not quick else "gpt2 2x64"}
    speed: dict[str, float] = {}  # samples/s unrounded: 0.024 rounded is 2 digits
    iteration: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-model-") as tmp:
        root = Path(tmp)
        for precision in ("fp32", "bf16"):
            out = root / precision
            proc = train_example(out, extra + ["--set", f"precision={precision}",
                                        "--set", "redundancy=none"])
            sps, it = throughput(out)
            speed[precision], iteration[precision] = sps, it
            figures[f"{precision}_samples_per_s"] = round(sps, 3)
            figures[f"{precision}_iteration_s"] = round(it, 3)
            est, rss = launch_estimates(proc.stderr), _rss(out)
            figures[f"{precision}_memory_per_stage"] = [
                {"stage": s, "estimate_mib": est.get(s), **rss.get(s, {})} for s in sorted(est)]
            print(f"{precision}: {sps:.3f} samples/s, {it:.2f} s per iteration", flush=True)
            for row in figures[f"{precision}_memory_per_stage"]:
                print(f"  {row}", flush=True)
        figures["bf16_over_fp32"] = round(speed["bf16"] / speed["fp32"], 3)
        out = root / "failover"
        train_example(out, extra + ["--set", "precision=bf16", "--set", "redundancy=lazy",
                             "--fail", "node2@3:forward"])
        pauses = failover_pauses(out)
        _, it = throughput(out)
        if pauses:
            pause = pauses[0]
            figures["failover_pause_s"] = round(pause["pause_s"], 3)
            # in the failure-free bf16 run's iterations: the fault comes at iteration 3, right
            # after the warm-up, so this run's own median is of the iterations after the
            # takeover (a node carrying two stages), which made the pause look shorter
            figures["failover_pause_iterations"] = round(pause["pause_s"] / iteration["bf16"],
                                                         2)
            figures["failover_parts_s"] = {k: round(v, 3) for k, v in pause.items()
                                           if k.endswith("_s") and k != "pause_s"}
        figures["failover_iteration_s"] = round(it, 3)
        print(json.dumps({k: v for k, v in figures.items() if "failover" in k}), flush=True)
    return figures
