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

Where the time goes: spotpipe's timed iterations are clocked instruction by instruction
(`harness.TracedStream`), and `op_s_per_iteration_KIND` sets each stage's seconds per op kind
beside what the model gives them (`predicted_op_seconds`: compute at the profiled costs, a
receive or the barrier at the wait the schedule implies, a send at nothing). Their difference,
`gap_by_operation_KIND`, splits the distance from the model's iteration by operation
(``outside_ops``: the executor's own work between instructions and around the stream).
`limit_ratio_KIND` is torch's iteration over the model's: the ratio spotpipe would reach if it
added nothing to the profiled compute, for this partition and schedule. `bound_ratio_KIND` is
torch's iteration over `schedule.timing.any_schedule_bound`: what no schedule of this partition
could pass, however it ordered, split or deferred the work (zero-bubble's B/W split included).
"""

from __future__ import annotations

import statistics
from typing import Any

from spotpipe.bench.harness import (describe_setup, launch_and_summarize, pinned_cores,
                                    stage_costs)
from spotpipe.bench.stats import fastest_tenth_ratio

SCHEDULES = ("1f1b", "gpipe")

FULL = {"warmup": 3, "rounds": 10, "iters_per_round": 5, "profile_reps": 3}
QUICK = {"warmup": 1, "rounds": 2, "iters_per_round": 2, "profile_reps": 2}
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128,
         "dropout": 0.0, "bias": True, "tie_embeddings": False}
MICROBATCHES = {"micro_batch_size": 4, "num_microbatches": 8}  # of one iteration of MODEL


def _spec(quick: bool) -> dict[str, Any]:
    spec: dict[str, Any] = dict(QUICK if quick else FULL)
    spec.update(gpt=dict(MODEL), **MICROBATCHES, seed=0,
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


def bound(profile: dict[str, Any], num_microbatches: int) -> float:
    """The iteration no schedule of this partition can beat, from the profile."""
    from spotpipe.schedule import any_schedule_bound

    return any_schedule_bound(stage_costs(profile), num_microbatches)


def predicted_op_seconds(profile: dict[str, Any], kind: str,
                         num_microbatches: int) -> dict[str, list[float]]:
    """Per op kind, per stage: the seconds the analytic model spends on it in one iteration."""
    from spotpipe.schedule import Op, build_schedule
    from spotpipe.schedule.timing import simulate_waits

    stages = len(profile["forward_s"])
    schedule = build_schedule(kind, stages, num_microbatches)
    costs = stage_costs(profile)
    waits = simulate_waits(schedule, costs)
    own = {Op.FORWARD: lambda s: costs.forward[s], Op.BACKWARD: lambda s: costs.backward[s],
           Op.ALL_REDUCE: lambda s: costs.all_reduce, Op.OPTIMIZER_STEP: lambda s: costs.optimizer}
    out: dict[str, list[float]] = {}
    for actor, stream in enumerate(schedule.streams):
        for pos, ins in enumerate(stream):
            cost = own[ins.op](ins.stage) if ins.op in own else 0.0
            row = out.setdefault(ins.op.value, [0.0] * schedule.num_actors)
            row[actor] += cost + waits[actor].get(pos, 0.0)
    return out


def as_ran(profile: dict[str, Any], measured: dict[str, list[float]],
           num_microbatches: int) -> dict[str, Any]:
    """`profile` with each stage's forward, backward and step at what they took in spotpipe's
    timed iterations (`measured`: seconds per iteration per op kind, as `TracedStream` gathers
    them). The profile times each stage alone; in the pipeline a stage computes beside its
    messages and the other engine's state, and the two differ by 2-25 % here, in either
    direction. The bound of these costs is what no schedule passes at the speed the stages
    actually computed: the limit of an engine that changes the order of the work, not the
    work."""
    m = num_microbatches
    return dict(profile, forward_s=[v / m for v in measured["forward"]],
                backward_s=[v / m for v in measured["backward"]],
                optimizer_s=list(measured["optimizer_step"]))


def gap_by_operation(measured: dict[str, list[float]],
                     predicted: dict[str, list[float]]) -> dict[str, list[float]]:
    """Measured minus predicted seconds per iteration, per op kind and stage; ``outside_ops``
    is each stage's clock around the iteration less its instructions, and ``total`` that clock
    less the model's iteration (the ops' gaps and ``outside_ops`` add up to it)."""
    ops = [k for k in measured if k != "iteration"]
    width = len(measured["iteration"])
    gap = {k: [m - p for m, p in zip(measured[k], predicted.get(k, [0.0] * width))]
           for k in ops}
    gap["outside_ops"] = [measured["iteration"][a] - sum(measured[k][a] for k in ops)
                          for a in range(width)]
    model_iteration = max(sum(row[a] for row in predicted.values()) for a in range(width))
    gap["total"] = [measured["iteration"][a] - model_iteration for a in range(width)]
    return gap


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
    floor = bound(raw["profile"], m)
    out["bound_iter_s"] = round(floor, 6)
    for kind in spec["schedules"]:
        sp = statistics.median(raw["iter_times"][f"spotpipe_{kind}"])
        th = statistics.median(raw["iter_times"][f"torch_{kind}"])
        pred = predict(raw["profile"], kind, m)
        errors[kind] = abs(pred - sp) / sp
        out[f"ratio_{kind}"] = round(th / sp, 4)
        out[f"ratio_{kind}_rounds_min_median_max"] = _round_ratios(raw, kind, spec)
        # the fastest tenth of each system's iterations: less sensitive to other processes
        # taking the cores, which only ever adds time
        out[f"ratio_{kind}_q10"] = round(fastest_tenth_ratio(
            raw["iter_times"][f"torch_{kind}"], raw["iter_times"][f"spotpipe_{kind}"]), 4)
        out[f"spotpipe_{kind}_samples_per_s"] = round(batch / sp, 2)
        out[f"torch_{kind}_samples_per_s"] = round(batch / th, 2)
        out[f"measured_iter_s_{kind}"] = round(sp, 6)
        out[f"torch_iter_s_{kind}"] = round(th, 6)
        out[f"predicted_iter_s_{kind}"] = round(pred, 6)
        out[f"model_error_{kind}"] = round(errors[kind], 4)
        out[f"limit_ratio_{kind}"] = round(th / pred, 4)
        out[f"bound_ratio_{kind}"] = round(th / floor, 4)
        measured_ops = raw["op_s"][kind]
        ran_floor = bound(as_ran(raw["profile"], measured_ops, m), m)
        out[f"ran_bound_iter_s_{kind}"] = round(ran_floor, 6)
        out[f"ran_bound_ratio_{kind}"] = round(th / ran_floor, 4)
        predicted_ops = predicted_op_seconds(raw["profile"], kind, m)
        out[f"op_s_per_iteration_{kind}"] = _rounded(measured_ops)
        out[f"op_s_predicted_{kind}"] = _rounded(predicted_ops)
        out[f"gap_by_operation_{kind}"] = _rounded(gap_by_operation(measured_ops, predicted_ops))
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


def _rounded(table: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: [round(v, 6) for v in row] for k, row in table.items()}


def format_gap(out: dict[str, Any], kind: str) -> str:
    """The op table of one schedule: measured and model seconds per iteration per stage (ms)."""
    measured, model = out[f"op_s_per_iteration_{kind}"], out[f"op_s_predicted_{kind}"]
    gap = out[f"gap_by_operation_{kind}"]
    width = len(measured["iteration"])
    head = "  ".join(f"{'stage ' + str(a) + ' meas/model/gap':>26s}" for a in range(width))
    lines = [f"{kind}: ms per iteration  {head}"]
    for op in list(gap):
        cells = []
        for a in range(width):
            meas = measured.get(op, measured["iteration"] if op == "total" else None)
            pred = model.get(op)
            cells.append(f"{_ms(meas, a):>8s} {_ms(pred, a):>8s} {gap[op][a] * 1e3:+8.2f}")
        lines.append(f"  {op:18s} " + "  ".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)


def _ms(row: list[float] | None, a: int) -> str:
    return "-" if row is None else f"{row[a] * 1e3:.2f}"


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
    for kind in spec["schedules"]:
        print(format_gap(out, kind))
        print(f"  limit: torch's iteration over the model's = {out[f'limit_ratio_{kind}']:.3f}; "
              f"over any schedule's bound = {out[f'bound_ratio_{kind}']:.3f}; over that "
              f"bound at the compute's speed in the pipeline = "
              f"{out[f'ran_bound_ratio_{kind}']:.3f}")
    return out
