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

import statistics
from typing import Any

from spotpipe.bench.harness import (describe_setup, launch_and_summarize, pinned_cores,
                                    quantile, stage_costs)

SCHEDULES = ("1f1b", "gpipe")

FULL = {"warmup": 3, "rounds": 10, "iters_per_round": 5, "profile_reps": 3}
QUICK = {"warmup": 1, "rounds": 2, "iters_per_round": 2, "profile_reps": 2}
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128,
         "dropout": 0.0, "bias": True, "tie_embeddings": False}


def _spec(quick: bool) -> dict[str, Any]:
    spec: dict[str, Any] = dict(QUICK if quick else FULL)
    spec.update(gpt=dict(MODEL), micro_batch_size=4, num_microbatches=8, seed=0,
                schedules=list(SCHEDULES), timeout_s=120.0,
                # one core per stage when there are enough; otherwise let the OS place them
                cores=pinned_cores(2))
    return spec


def predict(profile: dict[str, Any], kind: str, num_microbatches: int) -> float:
    """spotpipe's iteration time from the profile, by the analytic model."""
    from spotpipe.schedule import build_schedule
    from spotpipe.schedule.timing import simulate

    stages = len(profile["forward_s"])
    return simulate(build_schedule(kind, stages, num_microbatches),
                    stage_costs(profile)).iteration_s


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
        out[f"ratio_{kind}_q10"] = round(quantile(raw["iter_times"][f"torch_{kind}"], 0.1)
                                         / quantile(raw["iter_times"][f"spotpipe_{kind}"], 0.1), 4)
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
    out["config"] = (f"{describe_setup(spec, prof['partition'])}; micro-batch {b} x M={m} "
                     f"(global batch {batch}); AdamW, no clipping; median over rounds x iters, "
                     f"interleaved")
    return out


def run(quick: bool = False) -> dict[str, Any]:
    spec = _spec(quick)
    out = launch_and_summarize(spec, 120 if quick else 600, name="pipeline",
                               worker_module="spotpipe.bench._pipeline_worker",
                               summarize=summarize)
    print(f"{'schedule':8s} {'spotpipe/s':>11s} {'torch/s':>9s} {'ratio':>6s} "
          f"{'measured':>9s} {'predicted':>9s} {'error':>6s}")
    for kind in spec["schedules"]:
        print(f"{kind:8s} {out[f'spotpipe_{kind}_samples_per_s']:11.1f} "
              f"{out[f'torch_{kind}_samples_per_s']:9.1f} {out[f'ratio_{kind}']:6.3f} "
              f"{out[f'measured_iter_s_{kind}']:9.4f} {out[f'predicted_iter_s_{kind}']:9.4f} "
              f"{out[f'model_error_{kind}']:6.3f}")
    return out
