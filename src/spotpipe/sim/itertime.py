"""Iteration time of a layout, from the same schedule code the runtime executes.

A layout's shape (depth P, width D, which stages run merged on their predecessor's node, and
whether replicas run forward redundant computation) fixes its iteration time, so times are
computed once per shape with `spotpipe.schedule` (build_schedule + simulate) and cached: the
simulator then pays a dictionary lookup per reconfiguration, not a schedule replay.

Modelling choices, and why:
- a node that took over its successor runs both stages' layers as one fused stage: the
  message between them becomes local, compute adds up (when the last stage's node takes over
  stage 0, the fused stage sits at position 0: an approximation, its two halves really run
  at the two ends of the pipeline);
- forward redundant computation (FRC) of the successor's stage is placed just before each
  receive of a gradient (the bubble where the node would wait), and on the last stage before
  the gradient reduction; a node carrying two stages has no replica, so runs no FRC;
- the global batch is fixed: D pipelines each run ceil(G / D) micro-batches;
- data-parallel all-reduce is a ring over D pipelines of the largest stage's gradient bytes.
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil

from spotpipe.plan.layout import uniform_partition
from spotpipe.schedule import Instr, Op, Schedule, StageCosts, build_schedule, simulate
from spotpipe.sim.models import ModelCosts


@lru_cache(maxsize=None)
def stage_costs(model: ModelCosts, num_stages: int) -> tuple[tuple[float, ...], tuple[float, ...],
                                                            tuple[float, ...]]:
    """Per-stage forward, backward seconds and gradient bytes, layers split uniformly."""
    parts = uniform_partition(model.num_layers, num_stages)
    fwd = tuple(sum(model.forward_s[a:b]) for a, b in parts)
    bwd = tuple(sum(model.backward_s[a:b]) for a, b in parts)
    byt = tuple(sum(model.param_bytes[a:b]) for a, b in parts)
    return fwd, bwd, byt


def microbatches_per_pipeline(model: ModelCosts, num_pipelines: int) -> int:
    return max(1, ceil(model.global_microbatches / max(1, num_pipelines)))


@lru_cache(maxsize=None)
def pipeline_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                  merged: tuple[int, ...], redundant: bool) -> float:
    """Seconds of one iteration of one pipeline of this shape (merged: stages run by the
    predecessor's node)."""
    fwd, bwd, byt = stage_costs(model, num_stages)
    groups = _fuse(num_stages, merged)
    f = [sum(fwd[s] for s in g) for g in groups]
    b = [sum(bwd[s] for s in g) for g in groups]
    n = len(groups)
    m = microbatches_per_pipeline(model, num_pipelines)
    sched = build_schedule(kind, n, m)
    if redundant and num_stages > 1:
        sched, frc_costs = _with_frc(sched, groups, fwd, num_stages)
        f = f + frc_costs
        b = b + [0.0] * len(frc_costs)
    biggest = max(sum(byt[s] for s in g) for g in groups)
    ring = 2.0 * (num_pipelines - 1) / num_pipelines if num_pipelines > 1 else 0.0
    costs = StageCosts(tuple(f), tuple(b), comm=model.activation_bytes / model.network_bytes_s,
                       all_reduce=ring * biggest / model.network_bytes_s,
                       optimizer=biggest * model.optimizer_s_per_byte)
    return simulate(sched, costs).iteration_s


def iteration_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                   merged: tuple[tuple[int, ...], ...], redundant: bool) -> float:
    """A synchronous data-parallel step waits for the slowest pipeline."""
    if num_pipelines < 1:
        raise ValueError("no pipeline runs")
    return max(pipeline_time(model, kind, num_stages, num_pipelines, m, redundant)
               for m in set(merged))


def _fuse(num_stages: int, merged: tuple[int, ...]) -> list[list[int]]:
    """Group stages by the node that runs them; a merged stage joins its predecessor."""
    merged_set = set(merged)
    if len(merged_set) >= num_stages:
        return [list(range(num_stages))]
    groups: list[list[int]] = []
    for s in range(num_stages):
        if s in merged_set and groups:
            groups[-1].append(s)
        else:
            groups.append([s])
    if 0 in merged_set:  # stage 0 runs on the last stage's node: fold the last group into it
        last = groups.pop()
        groups[0] = last + groups[0]
    return groups


def _with_frc(sched: Schedule, groups: list[list[int]], fwd: tuple[float, ...],
              num_stages: int) -> tuple[Schedule, list[float]]:
    """Insert each actor's FRC of its successor's stage into its bubbles.

    FRC cost of actor a sits at virtual stage index n + a of the cost vector, so an actor
    that replicates one original stage is charged that stage's forward, not a fused group's.
    """
    n = len(groups)
    streams = []
    frc_costs = []
    for a, stream in enumerate(sched.streams):
        if len(groups[a]) > 1:  # a carrier has used its replica memory: no FRC
            streams.append(stream)
            frc_costs.append(0.0)
            continue
        succ = (groups[a][-1] + 1) % num_stages
        frc_costs.append(fwd[succ])
        virtual = n + a
        out: list[Instr] = []
        done = 0
        for ins in stream:
            if ins.op == Op.RECV_GRAD:
                out.append(Instr(Op.FRC_FORWARD, virtual, ins.mb))
                done += 1
            elif ins.op == Op.ALL_REDUCE:
                out += [Instr(Op.FRC_FORWARD, virtual, mb)
                        for mb in range(done, sched.num_microbatches)]
                done = sched.num_microbatches
            out.append(ins)
        streams.append(tuple(out))
    return Schedule(sched.kind, sched.num_stages, sched.num_microbatches, tuple(streams),
                    sched.owners), frc_costs
