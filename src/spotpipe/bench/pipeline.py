"""`spotpipe bench pipeline`: spotpipe's 1F1B and GPipe against torch.distributed.pipelining.

Two processes (P = 2, D = 1), each pinned to its own core with one torch thread, gloo, run
the same GPT stages on the same micro-batches under both systems, alternating in rounds so that
drift in the machine's speed hits both alike. Per system and schedule the figure is the median
iteration time (each iteration timed on both ranks, the slower one counting); throughput is the
global batch over it, and the ratios are spotpipe's throughput over PyTorch's (>= 1.0: spotpipe
is no slower).

The same processes then profile what the analytic model needs (per-stage forward and backward
of one micro-batch, optimizer step, gradient reduction, one activation message) and
`spotpipe.schedule.timing.simulate` predicts spotpipe's iteration time from it; `model_error`
is |predicted - measured| / measured for 1F1B (`model_error_gpipe` for GPipe).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

SCHEDULES = ("1f1b", "gpipe")

FULL = {"warmup": 3, "rounds": 10, "iters_per_round": 5, "profile_reps": 3}
QUICK = {"warmup": 1, "rounds": 2, "iters_per_round": 2, "profile_reps": 2}
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128,
         "dropout": 0.0, "bias": True, "tie_embeddings": False}


def _spec(quick: bool) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    spec: dict[str, Any] = dict(QUICK if quick else FULL)
    spec.update(gpt=dict(MODEL), micro_batch_size=4, num_microbatches=8, seed=0,
                schedules=list(SCHEDULES), timeout_s=120.0,
                # one core per stage when there are enough; otherwise let the OS place them
                cores=cores[:2] if len(cores) >= 2 else [])
    return spec


def _launch(spec: dict[str, Any], world: int, deadline_s: float) -> dict[str, Any]:
    """Run the worker processes against a store hosted here; return the last rank's JSON.

    Every child is killed (and reaped) on the way out, whatever happened.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=timedelta(seconds=spec["timeout_s"]), wait_for_workers=False)
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        try:
            for rank in range(world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           SPOTPIPE_BENCH_SPEC=json.dumps(spec), OMP_NUM_THREADS="1",
                           TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "spotpipe.bench._pipeline_worker"], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logs[rank]))
            _wait(procs, deadline_s)
            codes = [p.returncode for p in procs]
            if any(c != 0 for c in codes) or not store.check(["bench/result"]):
                errors = [store.get(f"bench/error/{r}").decode() for r in range(world)
                          if store.check([f"bench/error/{r}"])]
                raise RuntimeError(f"bench pipeline: workers failed (exit codes {codes}): "
                                   f"{'; '.join(errors) or 'no result'}\n" + _tails(logs))
            return json.loads(store.get("bench/result"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


def _wait(procs: list[subprocess.Popen], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            return  # one failed: the others would only wait for it
        if time.monotonic() > end:
            raise RuntimeError(f"bench pipeline: workers still running after {deadline_s:.0f} s")
        time.sleep(0.05)


def _tails(logs: list[Any]) -> str:
    tails = []
    for rank, log in enumerate(logs):
        log.seek(0)
        text = log.read().decode(errors="replace").strip()
        if text:
            tails.append(f"--- rank {rank} stderr ---\n{text[-3000:]}")
    return "\n".join(tails)


def predict(profile: dict[str, Any], kind: str, num_microbatches: int) -> float:
    """spotpipe's iteration time from the profile, by the analytic model."""
    from spotpipe.schedule import build_schedule
    from spotpipe.schedule.timing import StageCosts, simulate

    costs = StageCosts(forward=tuple(profile["forward_s"]), backward=tuple(profile["backward_s"]),
                       comm=profile["comm_s"], all_reduce=max(profile["reduce_s"]),
                       optimizer=max(profile["optimizer_s"]))
    stages = len(profile["forward_s"])
    return simulate(build_schedule(kind, stages, num_microbatches), costs).iteration_s


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round_ratios(raw: dict[str, Any], kind: str, spec: dict[str, Any]) -> list[float]:
    """The ratio within each round (the two systems ran back to back there): its spread shows
    how much of a ratio's distance from 1.0 is the machine's noise."""
    n = spec["iters_per_round"]
    sp, th = raw["iter_times"][f"spotpipe_{kind}"], raw["iter_times"][f"torch_{kind}"]
    ratios = sorted(statistics.median(th[i:i + n]) / statistics.median(sp[i:i + n])
                    for i in range(0, len(sp), n))
    return [round(ratios[0], 4), round(statistics.median(ratios), 4), round(ratios[-1], 4)]


def summarize(raw: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    m, b = spec["num_microbatches"], spec["micro_batch_size"]
    batch = m * b
    out: dict[str, Any] = {}
    errors = {}
    for kind in spec["schedules"]:
        sp = statistics.median(raw["iter_times"][f"spotpipe_{kind}"])
        th = statistics.median(raw["iter_times"][f"torch_{kind}"])
        pred = predict(raw["profile"], kind, m)
        errors[kind] = abs(pred - sp) / sp
        out[f"ratio_{kind}"] = round(th / sp, 4)
        out[f"ratio_{kind}_rounds_min_median_max"] = _round_ratios(raw, kind, spec)
        # the fastest tenth of each system's iterations: less sensitive to other processes
        # taking the cores, which only ever adds time
        out[f"ratio_{kind}_q10"] = round(_quantile(raw["iter_times"][f"torch_{kind}"], 0.1)
                                         / _quantile(raw["iter_times"][f"spotpipe_{kind}"], 0.1), 4)
        out[f"spotpipe_{kind}_samples_per_s"] = round(batch / sp, 2)
        out[f"torch_{kind}_samples_per_s"] = round(batch / th, 2)
        out[f"measured_iter_s_{kind}"] = round(sp, 6)
        out[f"torch_iter_s_{kind}"] = round(th, 6)
        out[f"predicted_iter_s_{kind}"] = round(pred, 6)
        out[f"model_error_{kind}"] = round(errors[kind], 4)
    out["model_error"] = out.get("model_error_1f1b", max(errors.values()))
    out["model_error_is"] = "1f1b"
    prof = raw["profile"]
    out["profile_forward_s"] = [round(v, 6) for v in prof["forward_s"]]
    out["profile_backward_s"] = [round(v, 6) for v in prof["backward_s"]]
    out["profile_optimizer_s"] = [round(v, 6) for v in prof["optimizer_s"]]
    out["profile_reduce_s"] = [round(v, 6) for v in prof["reduce_s"]]
    out["profile_comm_s"] = round(prof["comm_s"], 6)
    out["profile_samples"] = prof["samples_per_rank"]
    first = raw["first_loss"]
    out["first_loss_abs_diff"] = abs(first["spotpipe"] - first["torch"])
    out["rounds"] = spec["rounds"]
    out["iters_per_round"] = spec["iters_per_round"]
    out["warmup"] = spec["warmup"]
    g = spec["gpt"]
    out["config"] = (f"P=2 D=1 gloo, 1 thread/stage pinned to cores {spec['cores'] or 'unpinned'}; "
                     f"GPT n_layer={g['n_layer']} n_embd={g['n_embd']} n_head={g['n_head']} "
                     f"block={g['block_size']} vocab={g['vocab_size']}, partition "
                     f"{prof['partition']}; micro-batch {b} x M={m} (global batch {batch}); "
                     f"AdamW, no clipping; median over rounds x iters, interleaved")
    return out


def run(quick: bool = False) -> dict[str, Any]:
    spec = _spec(quick)
    t0 = time.perf_counter()
    raw = _launch(spec, world=2, deadline_s=120 if quick else 600)
    out = summarize(raw, spec)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{'schedule':8s} {'spotpipe/s':>11s} {'torch/s':>9s} {'ratio':>6s} "
          f"{'measured':>9s} {'predicted':>9s} {'error':>6s}")
    for kind in spec["schedules"]:
        print(f"{kind:8s} {out[f'spotpipe_{kind}_samples_per_s']:11.1f} "
              f"{out[f'torch_{kind}_samples_per_s']:9.1f} {out[f'ratio_{kind}']:6.3f} "
              f"{out[f'measured_iter_s_{kind}']:9.4f} {out[f'predicted_iter_s_{kind}']:9.4f} "
              f"{out[f'model_error_{kind}']:6.3f}")
    return out
