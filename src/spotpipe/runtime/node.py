"""What one node holds and how it is wired, for a given layout.

Everything here is derived from (model, partition, layout, node): every node computes the same
wiring without talking, which is what lets a new generation start right after the plan is
published. The worker owns the long-lived state (stages, the replica); this module builds it
and rebuilds the per-generation wiring around it.
"""

from __future__ import annotations


from spotpipe.config import Config
from spotpipe.model import LayeredModel, compute_weights
from spotpipe.model.ties import cross_stage_tied, norm_param_names
from spotpipe.plan import Layout, splits_evenly
from spotpipe.plan import held_replica as plan_held_replica
from spotpipe.runtime.executor import Wiring
from spotpipe.runtime.state import build_stage_state, stage_state_from  # noqa: F401
from spotpipe.schedule import Schedule, StageCosts, build_schedule, merged_schedule, with_frc


def microbatches(cfg: Config, layout: Layout) -> int:
    """Micro-batches per pipeline in `layout`: the global batch stays the configured one when
    pipelines are dropped, so each remaining pipeline accumulates over more micro-batches."""
    total = cfg.num_microbatches * cfg.pipelines
    if not splits_evenly(total, layout.num_pipelines):
        raise ValueError(f"{total} micro-batches per iteration do not split over "
                         f"{layout.num_pipelines} pipelines")
    return total // layout.num_pipelines


def stage_members(layout: Layout) -> dict[int, list[str]]:
    """Per stage, its owners across pipelines, in pipeline order (its data-parallel group)."""
    return {s: [layout.owner(d, s) for d in range(layout.num_pipelines)]
            for s in range(layout.num_stages)}


def pipeline_of(layout: Layout, node: str) -> int:
    return layout.stages_of(node)[0][0]


def owned_stages(layout: Layout, node: str) -> list[int]:
    return sorted(s for _, s in layout.stages_of(node))


def held_replica(layout: Layout, node: str) -> int | None:
    """The stage whose replica `node` holds in this layout (see `plan.held_replica`)."""
    return plan_held_replica(layout, node)


def wiring(layout: Layout, node: str, nodes: list[str], model: LayeredModel,
           partition: list[tuple[int, int]], redundancy: bool) -> Wiring:
    d = pipeline_of(layout, node)
    p = layout.num_stages
    mine = owned_stages(layout, node)
    counts = [len(n) for n in norm_param_names(model, partition)]
    # the global-norm vector: each node contributes its stages' norms, in stage order
    offsets: dict[int, tuple[int, int]] = {}
    width = 0
    for other in nodes:
        offset = 0
        for s in owned_stages(layout, other):
            if pipeline_of(layout, other) == d:
                offsets[s] = (nodes.index(other), offset)
            offset += counts[s]
        width = max(width, offset)
    segments = [(offsets[s][0], offsets[s][1], counts[s]) for s in range(p)]
    holder = {}
    if redundancy:
        holder = {s: layout.replica_holder(d, s) for s in mine if layout.has_replica(d, s)}
    tied: dict[int, str] = {}
    if cross_stage_tied(model, partition) and p > 1:
        first, last = layout.owner(d, 0), layout.owner(d, p - 1)
        if first != last:
            if node == first:
                tied[0] = last
            if node == last:
                tied[p - 1] = first
    return Wiring(pipeline=d, num_stages=p,
                  node_of_stage={s: layout.owner(d, s) for s in range(p)},
                  replica_holder=holder, norm_segments=segments, norm_width=max(width, 1),
                  tied_partner=tied)


def node_schedule(cfg: Config, layout: Layout, node: str, model: LayeredModel,
                  partition: list[tuple[int, int]]) -> list:
    """This node's stream: the plain schedule, merged after takeovers, FRC when eager.

    FRC placement needs per-stage costs: the parameters each stage multiplies by stand in for
    its forward cost (`model.compute_weights`: an embedding's table is looked up, a tied head's
    weight is multiplied; backward taken as twice that), which is what decides how many FRCs
    fit a bubble when stages are unequal. After a takeover FRC stops until the layout is
    rebalanced: the node that holds the replica of a merged pair's successor no longer exists.
    """
    d = pipeline_of(layout, node)
    p = layout.num_stages
    owners: dict[str, list[int]] = {}
    for s in range(p):
        owners.setdefault(layout.owner(d, s), []).append(s)
    actors = sorted(owners.values(), key=lambda stages: stages[0])
    actor = next(i for i, stages in enumerate(actors) if node == layout.owner(d, stages[0]))
    if all(len(stages) == 1 for stages in actors):
        schedule: Schedule = build_schedule(cfg.schedule, p, microbatches(cfg, layout))
        if cfg.redundancy == "eager":
            weights = compute_weights(model)
            sizes = [max(1, sum(weights[a:b])) for a, b in partition]
            costs = StageCosts(tuple(float(n) for n in sizes), tuple(2.0 * n for n in sizes))
            schedule = with_frc(schedule, costs, every_stage=cfg.replica.frc == "every")
    else:
        schedule = merged_schedule(cfg.schedule, microbatches(cfg, layout), actors)
    return list(schedule.streams[actor])
