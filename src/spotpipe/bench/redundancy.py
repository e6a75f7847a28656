"""`spotpipe bench redundancy`: what Bamboo-style redundancy costs, measured against the model.

Two processes (P = 2, D = 1), each pinned to its own core with one torch thread, gloo (so the
pipeline's bubbles are real idle time on the core), train the same GPT stages four times side
by side: redundancy none, lazy (a replica of the successor stage kept exact by gradient
replication, whose update runs on a background thread of the same process, on the same core),
eager (lazy plus forward redundant computation of the replicas it serves, in the bubbles where
the runtime places it: `runtime.node.node_schedule`, by `spotpipe.schedule.with_frc` from the
parameters each stage multiplies by, `model.compute_weights`; on two stages FRC serves no
takeover, `schedule.frc_serves`, so eager runs none here and costs what lazy does) and
eager_every (FRC of every replica, `replica.frc: every`, as Bamboo's engine runs it: where
FRC's cost meets the model on two stages). The modes alternate in blocks of
iterations, each leading in turn, and the replica catches up at the end of each block, timed,
so that no mode's background work lands in another's block nor falls outside the clock. Per
mode the figure is the median over rounds of a block's seconds per iteration (the slower rank's
clock, the catching-up included); the ratios are throughput over `none`'s.

The analytic model's prediction comes from a profile taken between the rounds (per-stage
forward, backward, optimizer step, gradient reduction, one message, and FRC: the replica's
forward of one micro-batch without grad): `spotpipe.schedule.predict(..., "eager")`.
`eager_gap_pp` (and `eager_every_gap_pp`) is the measured ratio minus the predicted one, in
percentage points. The
prediction places FRC from the profile itself (the best the greedy placement finds for those
costs); `eager_predicted_ratio_executed_stream` times the runtime's placement, which ran, with
the same profile. (Placing from a profile instead, as this bench once did, made the figure swing
by up to 10 points: a placement fitted to one noisy profile can be far from the best for the
costs of the iterations that follow, where the runtime's placement, from no measurement at all,
stays within a point of the best for every profile measured here.)

Memory: the replica's parameters and optimizer state over the node's own stage's, per node; the
activations kept per iteration for a takeover (the node's outputs, and FRC outputs in eager
mode); the gradient bytes shipped per iteration against a full state copy.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from spotpipe.bench import BenchInputError
from spotpipe.bench.harness import (describe_setup, launch_and_summarize, pinned_cores,
                                    stage_costs)
from spotpipe.bench.pipeline import MICROBATCHES, MODEL
from spotpipe.bench.stats import fastest_tenth_ratio

# `eager_every`: eager with FRC of every replica (`replica.frc: every`), as Bamboo's engine runs
# it. On the bench's two stages `eager` runs no FRC at all (`schedule.frc_serves`: stage 0's
# successor is its own heir), so this mode is where FRC's cost meets the model here.
MODES = ("none", "lazy", "eager", "eager_every")
REDUNDANT = MODES[1:]
REDUNDANCY_OF = {"none": "none", "lazy": "lazy", "eager": "eager", "eager_every": "eager"}
FRC_OF = dict.fromkeys(MODES, "served") | {"eager_every": "every"}
FULL = {"warmup": 3, "rounds": 12, "iters_per_round": 5, "profile_reps": 3}
QUICK = {"warmup": 1, "rounds": 2, "iters_per_round": 2, "profile_reps": 2}


# runtime changes the bench can try out (SPOTPIPE_BENCH_PROTOTYPES, comma-separated):
# "inline-replica-update" runs the replica's update on the main thread at `update_slot`. The
# former "idle-replica-thread" is what the runtime itself does now (ReplicaApplier's thread runs
# at SCHED_IDLE), so it is refused rather than silently ignored.
PROTOTYPES = ("inline-replica-update",)


def _prototypes() -> list[str]:
    names = [x for x in os.environ.get("SPOTPIPE_BENCH_PROTOTYPES", "").split(",") if x]
    unknown = sorted(set(names) - set(PROTOTYPES))
    if unknown:
        raise BenchInputError(f"SPOTPIPE_BENCH_PROTOTYPES: unknown {unknown}; known: "
                              f"{list(PROTOTYPES)}")
    return names


def _spec(quick: bool) -> dict[str, Any]:
    spec: dict[str, Any] = dict(QUICK if quick else FULL)
    spec.update(gpt=dict(MODEL), **MICROBATCHES, seed=0,
                schedule="1f1b", max_lag=2, timeout_s=120.0, cores=pinned_cores(2),
                prototypes=_prototypes())
    return spec


def frc_by_stage(frc_per_rank: list[float]) -> tuple[float, ...]:
    """FRC cost indexed by the replica's stage: rank r measured its replica, of stage r + 1."""
    from spotpipe.schedule import replica_of

    p = len(frc_per_rank)
    out = [0.0] * p
    for r, cost in enumerate(frc_per_rank):
        out[replica_of(r, p)] = cost
    return tuple(out)


def update_slot(stream: Any) -> int:
    """Where in a stream the replica's update of the previous iteration fits best: before the
    first point where the node may wait (a receive) or needs the replica current (an FRC)."""
    from spotpipe.schedule import Op
    from spotpipe.schedule.ir import RECV_OPS

    return next(i for i, ins in enumerate(stream)
                if ins.op in RECV_OPS or ins.op == Op.FRC_FORWARD)


def with_update(schedule: Any, costs: Any, update_s: float) -> tuple[Any, Any]:
    """The schedule and costs with the replica's update as a timed step at `update_slot` of
    every stream: an FRC of a pseudo-stage P whose cost is `update_s` (the timing model has
    no instruction for it)."""
    from dataclasses import replace

    from spotpipe.schedule import Instr, Op

    p = schedule.num_stages
    streams = tuple(s[:update_slot(s)] + (Instr(Op.FRC_FORWARD, p),) + s[update_slot(s):]
                    for s in schedule.streams)
    frc = tuple(costs.frc_cost(x) for x in range(p)) + (update_s,)
    return replace(schedule, streams=streams), replace(costs, frc=frc)


def executed_schedule(plain: Any, streams: list[list[list[Any]]]) -> Any:
    """The schedule whose streams the nodes ran, from the [op, stage, mb, peer] lists the
    worker reports."""
    from dataclasses import replace

    from spotpipe.schedule import Instr, Op, replica_of

    p = plain.num_stages
    return replace(plain, streams=tuple(tuple(Instr(Op(op), stage, mb, peer)
                                              for op, stage, mb, peer in stream)
                                        for stream in streams),
                   replicas=tuple((replica_of(a, p),) for a in range(p)))


def _costs(profile: dict[str, Any]):
    return stage_costs(profile, frc=frc_by_stage(profile["frc_s"]))


def in_run_costs(op_s: dict[str, list[float]], profile: dict[str, Any], m: int):
    """The model's costs as the ops took them inside the timed iterations (`TracedStream`'s
    seconds per iteration over M; node r runs stage r and FRC of stage r + 1), messages and
    the reduction as profiled. The profile times each op back to back on warm caches; inside
    an iteration the same op runs after others (and in eager mode beside the replica's
    weights), and on this machine it takes 10-25% longer there. Timing the stream that ran
    with these costs separates that from what the placement and the executor add."""
    from dataclasses import replace

    def per_mb(op: str) -> tuple[float, ...]:
        return tuple(v / m for v in op_s[op])

    costs = replace(stage_costs(profile), forward=per_mb("forward"),
                    backward=per_mb("backward"), optimizer=max(op_s["optimizer_step"]))
    if "frc_forward" in op_s:
        costs = replace(costs, frc=frc_by_stage(list(per_mb("frc_forward"))))
    return costs


def block_means(durations: list[float], catch_up: list[float], n: int) -> list[float]:
    """Seconds per iteration of each timed block: its `n` iterations plus the replica's
    catching-up after them (`catch_up[i]` follows block i), over `n`."""
    if len(durations) != n * len(catch_up):
        raise ValueError(f"{len(durations)} iteration times for {len(catch_up)} blocks of {n}")
    return [(sum(durations[i * n:(i + 1) * n]) + c) / n for i, c in enumerate(catch_up)]


def ratio_q10(per_block: dict[str, list[float]], mode: str) -> float:
    """none's over `mode`'s seconds per iteration in their fastest tenth of blocks (less
    sensitive to other processes taking the cores). Blocks, not iterations: a block's figure
    holds the replica's catching-up after it, which single iterations leave out (with
    max_lag 2, the updates still queued at a block's end run there), so the fastest
    iterations of a redundant mode would be those that paid for no update."""
    return fastest_tenth_ratio(per_block["none"], per_block[mode])


def _round_ratios(per_block: dict[str, list[float]], mode: str) -> list[float]:
    """none's over `mode`'s seconds per iteration within each round (back to back there)."""
    ratios = sorted(a / b for a, b in zip(per_block["none"], per_block[mode]))
    return [round(ratios[0], 4), round(statistics.median(ratios), 4), round(ratios[-1], 4)]


def _r(values: list[float], digits: int = 6) -> list[float]:
    return [round(v, digits) for v in values]


def summarize(raw: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    from spotpipe.schedule import build_schedule, closed_form_bubble, predict, simulate, with_frc

    m, b = spec["num_microbatches"], spec["micro_batch_size"]
    times = raw["iter_times"]
    n = spec["iters_per_round"]
    # per mode: the median over rounds of a block's seconds per iteration, catching-up included
    per_block = {mode: block_means(times[mode], raw["catch_up_s"][mode], n) for mode in MODES}
    med = {mode: statistics.median(per_block[mode]) for mode in MODES}
    prof = raw["profile"]
    costs = _costs(prof)
    plain = build_schedule(spec["schedule"], 2, m)
    base_s = simulate(plain, costs).iteration_s
    # the model with the replica's update as a step in the first bubble (what the runtime would
    # do if the update were an instruction placed by the schedule rather than a thread)
    update_s = max(prof["replica_update_s"])
    none_in_run = simulate(plain, in_run_costs(raw["none_op_s"], prof, m)).iteration_s
    preds: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for mode in REDUNDANT:
        every, eager = FRC_OF[mode] == "every", REDUNDANCY_OF[mode] == "eager"
        pred = preds[mode] = predict(plain, costs, REDUNDANCY_OF[mode], every_stage=every)
        placed = with_frc(plain, costs, every_stage=every) if eager else plain
        # the streams that ran; timed with each mode's ops at their cost inside its own
        # iterations, what is left of the gap is the placement's and the executor's
        ran = executed_schedule(plain, raw[f"{mode}_streams"]) if eager else plain
        in_run = none_in_run / simulate(ran, in_run_costs(raw[f"{mode}_op_s"], prof,
                                                           m)).iteration_s
        out[f"{mode}_ratio"] = round(med["none"] / med[mode], 4)
        out[f"{mode}_predicted_ratio"] = round(pred.throughput_ratio, 4)
        out[f"{mode}_gap_pp"] = round(100 * (out[f"{mode}_ratio"]
                                             - out[f"{mode}_predicted_ratio"]), 2)
        if eager:
            out[f"{mode}_predicted_ratio_executed_stream"] = round(
                base_s / simulate(ran, costs).iteration_s, 4)
            out[f"predicted_iter_s_{mode}"] = round(pred.iteration_s, 6)
        out[f"{mode}_predicted_ratio_in_run_costs"] = round(in_run, 4)
        out[f"{mode}_gap_pp_in_run_costs"] = round(
            100 * (out[f"{mode}_ratio"] - out[f"{mode}_predicted_ratio_in_run_costs"]), 2)
        out[f"{mode}_predicted_ratio_with_update"] = round(
            base_s / simulate(*with_update(placed, costs, update_s)).iteration_s, 4)
    out["prototypes"] = spec["prototypes"]
    for mode in REDUNDANT:
        out[f"{mode}_ratio_rounds_min_median_max"] = _round_ratios(per_block, mode)
        out[f"{mode}_ratio_q10"] = round(ratio_q10(per_block, mode), 4)
    for mode in MODES:
        out[f"{mode}_iter_s"] = round(med[mode], 6)
        out[f"{mode}_catch_up_s_per_iteration"] = round(
            sum(raw["catch_up_s"][mode]) / len(times[mode]), 6)
        out[f"{mode}_samples_per_s"] = round(m * b / med[mode], 2)
    out["predicted_iter_s_none"] = round(base_s, 6)
    out["model_error_none"] = round(abs(base_s - med["none"]) / med["none"], 4)
    out["bubble_fraction_predicted"] = round(preds["lazy"].bubble_fraction, 4)
    out["bubble_fraction_closed_form"] = round(closed_form_bubble(2, m), 4)
    # FRC where it runs on these two stages: every replica's, as Bamboo
    frc = preds["eager_every"]
    out["frc_s_per_iteration_predicted"] = round(frc.frc_s, 6)
    out["frc_in_bubbles_s_predicted"] = round(frc.bubble_filled_s, 6)
    out["frc_excess_s_predicted"] = round(frc.excess_s, 6)

    # memory and bytes, per node (index = rank = stage)
    own, rep = raw["own_state_bytes"], raw["replica_state_bytes"]
    multiples = [r / o for r, o in zip(rep, own)]
    out["replica_memory_multiple"] = round(max(multiples), 4)
    out["replica_memory_multiple_per_node"] = _r(multiples, 4)
    out["own_state_bytes_per_node"] = [int(v) for v in own]
    out["replica_state_bytes_per_node"] = [int(v) for v in rep]
    for mode in REDUNDANT:
        out[f"replica_activation_bytes_{mode}"] = [int(v) for v in raw[f"{mode}_activation_bytes"]]
    out["gradient_bytes_per_iteration"] = [int(v) for v in raw["gradient_bytes_per_iteration"]]
    out["state_bytes"] = [int(v) for v in raw["state_bytes"]]
    out["gradient_over_state_bytes"] = round(max(g / s for g, s in zip(
        raw["gradient_bytes_per_iteration"], raw["state_bytes"])), 4)
    for mode in REDUNDANT:
        out[f"{mode}_max_lag_seen"] = [int(v) for v in raw[f"{mode}_max_lag_seen"]]
        out[f"{mode}_waited_s"] = _r(raw[f"{mode}_waited_in_timed_s"])
        out[f"{mode}_replicas_exact"] = raw[f"{mode}_replicas_exact"]
    out["lazy_eager_states_identical"] = raw["lazy_eager_states_identical"]
    # per-instruction trace: seconds per iteration by op kind, per node; a receive's time is
    # mostly its wait, FRC's includes waiting for the replica to be current
    for mode in MODES:
        out[f"{mode}_op_s_per_iteration"] = {k: _r(v) for k, v in raw[f"{mode}_op_s"].items()}
    first = raw["first_loss"]
    out["first_loss_max_abs_diff"] = max(abs(first[a] - first["none"]) for a in MODES)

    out["profile_forward_s"] = _r(prof["forward_s"])
    out["profile_backward_s"] = _r(prof["backward_s"])
    out["profile_optimizer_s"] = _r(prof["optimizer_s"])
    out["profile_reduce_s"] = _r(prof["reduce_s"])
    out["profile_comm_s"] = round(prof["comm_s"], 6)
    out["profile_frc_s_by_stage"] = _r(list(frc_by_stage(prof["frc_s"])))
    out["profile_replica_update_s"] = _r(prof["replica_update_s"])
    out["profile_samples"] = prof["samples_per_rank"]
    out["rounds"] = spec["rounds"]
    out["iters_per_round"] = n
    out["iterations_per_mode"] = raw["iterations"]
    out["config"] = (f"{describe_setup(spec, prof['partition'])}; replica thread on the same "
                     f"core; {spec['schedule']}, micro-batch {b} x M={m}; AdamW, no clipping; "
                     f"replica on cpu, sync gradient, max_lag {spec['max_lag']}; median over "
                     f"{spec['rounds']} rounds of {n} iterations plus the replica's catching-up "
                     "after them (timed), modes interleaved")
    return out


def run(quick: bool = False) -> dict[str, Any]:
    spec = _spec(quick)
    out = launch_and_summarize(spec, 120 if quick else 900, name="redundancy",
                               worker_module="spotpipe.bench._redundancy_worker",
                               summarize=summarize)
    print(f"{'mode':11s} {'iter_s':>8s} {'samples/s':>10s} {'ratio':>6s} {'predicted':>9s}")
    print(f"{'none':11s} {out['none_iter_s']:8.4f} {out['none_samples_per_s']:10.1f} "
          f"{1.0:6.3f} {1.0:9.3f}")
    for mode in REDUNDANT:
        print(f"{mode:11s} {out[f'{mode}_iter_s']:8.4f} {out[f'{mode}_samples_per_s']:10.1f} "
              f"{out[f'{mode}_ratio']:6.3f} {out[f'{mode}_predicted_ratio']:9.3f} "
              f"(ops at their in-run cost: {out[f'{mode}_predicted_ratio_in_run_costs']:.3f})")
    print(f"replica memory: {out['replica_memory_multiple_per_node']} x own stage; gradient "
          f"bytes {out['gradient_bytes_per_iteration']} vs state {out['state_bytes']}")
    return out
