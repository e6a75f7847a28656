"""`spotpipe bench checkpoint`: what each checkpoint scheme costs training, and what it saves.

Throughput. Two processes (P = 2, D = 1), each pinned to its own core with one torch thread,
gloo, train the same GPT stages once per variant, side by side in one run: no checkpoints, and
each baseline (`torch_save`, `checkfreq`, `dcp_async`, `gemini`; spotpipe.checkpoint.schemes)
every k = 1 and k = 10 iterations. Variants alternate in blocks of 10 iterations, each leading
in turn, so that drift in the machine's load spreads over all of them (see
`_checkpoint_worker`). `<variant>_ratio` is throughput as a fraction of no checkpointing: in
each round, the block time without checkpoints over the variant's; the median over rounds
(`ratio_quartiles` gives the spread: the rounds' first and third quartiles, nearest rank).
Each process has one core: a background write (checkfreq, dcp_async) competes with training
for it, as it would on a machine without spare cores. Each baseline writes what its system
writes (`Scheme.checksums` false): none of them hashes its files as spotpipe's durable tier
does for its commit and safe resume.

Bytes per iteration: what the variant wrote to disk or sent to a peer, both stages together,
over the iterations it ran. Blocked seconds per checkpoint: what the training loop waited for
(the slower node's); `<variant>_blocking_only_ratio` is the throughput those waits alone would
leave (iteration / (iteration + blocked / k)), which the machine's load does not blur but which
leaves out background work competing for the core.

Lost work per failure (`lost_iterations_per_failure`), computed from the checkpoints the runs
actually completed, not from a formula: `kills` kill times are drawn uniformly at random over
each variant's timed iterations (seeded); a kill at time tau in iteration u loses u - t
iterations, t being the newest iteration whose checkpoint was complete for every stage (written
and, for the asynchronous schemes, persisted; for gemini, received by the peer) before tau:
training resumes at t + 1, so iterations t + 1 .. u, the one in flight included, are run again.
An iteration's time includes its own checkpoint, so a checkpoint every iteration that completes
at once loses the one in flight (1), or nothing when the kill lands after that checkpoint
completed (0).

Recovery time (`recovery_s`): a real restart, as `bench failover` measures it: a P = 2 job with
the durable tier written by `dcp_async` every 5 iterations, no redundancy, one node killed (the
job stops), then every worker started again with `--resume`; the figure runs from the kill to
the first iteration completed by the restarted job (`recovery_with_replay_s` adds the lost
iterations run again). Its workers start in fresh interpreters, as torchrun's and bench
failover's restarts do (`cluster.fork_server=false`).

What the durable tier's safety costs (fsync before the commit, the manifest's MAC, the
commit's checks): `durable_*` figures, measured directly on one stage's write
(`spotpipe.bench.durable_costs`).

The CPU shadows are not a scheme inside the training loop but processes beside it (started by
the launcher, fed over their own links), so they are measured on real local clusters
(`spotpipe.bench.shadow`): `shadow_ratio` from the same job with and without shadows, in
back-to-back pairs of runs (the median of the pairs' ratios);
`lost_iterations_per_failure["shadow"]` and `shadow_recovery_s` from a job without redundancy
killed again and again at random iterations and phases, each loss repaired from the shadows in
place (nothing restarts). `shadow_ratio_own_hosts` is the figure for shadows on CPUs of their
own: only the writers' side of the work is then left on training's path.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spotpipe.bench import durable_costs
from spotpipe.bench.harness import describe_setup, launch, pinned_cores
from spotpipe.bench.pipeline import MODEL
from spotpipe.bench.stats import percentile

BASELINES = ("torch_save", "checkfreq", "dcp_async", "gemini")
INTERVALS = (1, 10)
# (figure name, checkpoint.scheme, checkpoint.every); the first is the reference
VARIANTS: list[tuple[str, str, int]] = [
    ("none", "none", 0),
    *[(f"{b}_k{k}", b, k) for b in BASELINES for k in INTERVALS],
]
FULL = {"rounds": 6, "warmup_blocks": 1, "iters_per_block": 10, "kills": 200}
# --quick (the test): one round of a smaller model
QUICK = {"rounds": 1, "warmup_blocks": 1, "iters_per_block": 10, "kills": 40,
         "gpt": {**MODEL, "n_layer": 2, "n_embd": 64}, "num_microbatches": 4}


def _spec(quick: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"gpt": dict(MODEL), "num_microbatches": 8}
    spec.update(QUICK if quick else FULL)
    # the first k = 10 checkpoint (after iteration 9) falls in the middle of a block
    spec.update(micro_batch_size=4, seed=0, first_iteration=5, timeout_s=120.0,
                cores=pinned_cores(2))
    return spec


def lost_iterations(records: list[list[Any]], timeline: list[list[float]], stages: int,
                    kills: int, seed: int) -> list[int]:
    """Iterations lost by `kills` kills at uniformly random times of the timed iterations.

    `records`: [iteration, stage, kind, wall time] of each completed checkpoint of a stage
    (`checkpoint_held` is gemini's completion: the copy is in the peer's memory);
    `timeline`: [iteration, start, end] wall times of each timed iteration. Kills before the
    first complete checkpoint are drawn again (a long run always has one behind it)."""
    complete_at: dict[int, dict[int, float]] = {}
    held = any(kind == "checkpoint_held" for _, _, kind, _ in records)
    for iteration, stage, kind, when in records:
        if held and kind != "checkpoint_held":
            continue  # gemini: the sender's completion says nothing about the peer's copy
        complete_at.setdefault(int(iteration), {})[int(stage)] = float(when)
    complete = sorted((max(parts.values()), t) for t, parts in complete_at.items()
                      if len(parts) == stages)
    if not complete or not timeline:
        return []
    rng = random.Random(seed)
    total = sum(end - start for _, start, end in timeline)
    out: list[int] = []
    for _ in range(kills * 50):
        if len(out) == kills:
            break
        x = rng.uniform(0.0, total)
        for u, start, end in timeline:
            if x <= end - start:
                tau = start + x
                break
            x -= end - start
        behind = [t for when, t in complete if when <= tau]
        if behind:
            out.append(int(u) - max(behind))
    return out


def summarize(raw: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    blocks = raw["block_s"]
    reference = statistics.median(blocks["none"])
    n = raw["iters_per_block"]
    out: dict[str, Any] = {}
    lost: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    for name, _, _ in VARIANTS[1:]:
        # paired within each round (the blocks of one round run back to back), so that the
        # machine's drift between rounds cancels; the median over rounds
        ratios = sorted(a / b for a, b in zip(blocks["none"], blocks[name]))
        out[f"{name}_ratio"] = round(statistics.median(ratios), 4)
        spread[name] = [round(percentile(ratios, 25), 3), round(percentile(ratios, 75), 3)]
    out["ratio_quartiles"] = spread
    for name, _, every in VARIANTS[1:]:
        per_rank = raw["per_rank"][name]  # [bytes, blocked_s, checkpoints, iterations] by rank
        iterations = max(r[3] for r in per_rank)
        out[f"{name}_bytes_per_iteration"] = int(sum(r[0] for r in per_rank) / iterations)
        blocked = max(r[1] / max(1.0, r[2]) for r in per_rank)
        out[f"{name}_blocked_s_per_checkpoint"] = round(blocked, 5)
        # what the loop's waits alone would cost (no background work, no noise): a figure that
        # a loaded machine cannot blur, beside the measured ratio
        it = reference / n
        out[f"{name}_blocking_only_ratio"] = round(it / (it + blocked / every), 4)
        kills = lost_iterations(raw["records"][name], raw["timeline"][name], 2, spec["kills"],
                                seed=spec["seed"] + len(name))
        if kills:
            lost[name] = round(statistics.mean(kills), 2)
    out["lost_iterations_per_failure"] = lost
    out["kills_per_variant"] = spec["kills"]
    out["none_iter_s"] = round(reference / n, 5)
    out["rounds"] = spec["rounds"]
    out["iters_per_block"] = n
    return out


def recovery(quick: bool) -> dict[str, float]:
    """Kill a node of a job without redundancy that writes the durable tier with dcp_async,
    restart everything from the newest checkpoint (`bench failover`'s restart baseline)."""
    import shutil

    from spotpipe.bench.failover import FRESH, _train, restart_pause

    iters, every, kill_at = (8, 3, 7) if quick else (30, 5, 23)
    tmp = Path(tempfile.mkdtemp(prefix="spotpipe-bench-ckpt-restart-"))
    try:
        # the workers start as torchrun starts them, in fresh interpreters (bench failover's);
        # --quick (the test, whose figures nobody reads; `bench failover --quick` runs the fresh
        # starts) forks them, which saves it most of its time
        common = ["--stages", "2", "--set", f"iterations={iters}", "--set", "redundancy=none",
                  *([] if quick else FRESH)]
        first, second = tmp / "first", tmp / "second"
        _train(first, *common, "--set", f"checkpoint.every={every}",
               "--set", "checkpoint.scheme=dcp_async", "--fail", f"node1@{kill_at}:backward",
               check=False)
        _train(second, *common, "--resume", str(first))
        r = restart_pause(first, second)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"recovery_s": round(r["restart_first_iteration_s"], 3),
            "recovery_with_replay_s": round(r["restart_pause_s"], 3),
            "recovery_lost_iterations": r["restart_lost_iterations"],
            "recovery_checkpoint_every": every}


def _shadows(quick: bool) -> dict[str, Any]:
    import shutil

    from spotpipe.bench import shadow

    tmp = Path(tempfile.mkdtemp(prefix="spotpipe-bench-shadow-"))
    try:
        out: dict[str, Any] = shadow.throughput(tmp, rounds=1 if quick else 8,
                                                iters=12 if quick else 60)
        kills = shadow.recovery(tmp, kills=2 if quick else 20, runs=1 if quick else 2, seed=0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["shadow_lost_iterations_max"] = kills.pop("shadow_lost_iterations_max")
    out["shadow_recovery_s"] = kills.pop("shadow_recovery_s")
    out["shadow_failures"] = kills.pop("shadow_failures")
    out["shadow_lost_iterations_per_failure"] = kills.pop("shadow_lost_iterations_per_failure")
    return out


def run(quick: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]  # the machine's load: the ratios' noise grows with it
    spec = _spec(quick)
    raw = launch(spec, 2, 600.0 if quick else 1200.0,
                 worker_module="spotpipe.bench._checkpoint_worker", name="checkpoint")
    figures = summarize(raw, spec)
    figures.update(recovery(quick))
    figures.update(durable_costs.run(repeats=3 if quick else 10))
    figures.update(_shadows(quick))
    figures["lost_iterations_per_failure"]["shadow"] = figures.pop(
        "shadow_lost_iterations_per_failure")
    figures["config"] = describe_setup(spec, "uniform") + (
        f"; micro-batch {spec['micro_batch_size']} x M={spec['num_microbatches']}, AdamW; "
        f"blocks of {spec['iters_per_block']} iterations, {spec['rounds']} rounds")
    figures["load_average"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures
