"""Which layouts fit the instances' memory: the simulator's use of `spotpipe.plan.memory`.

A layout (P stages x D pipelines) fits when every stage's estimate fits one node's device and
host memory; with redundancy, a node that carries two stages after a takeover (its own and
its successor's, without a replica) must fit too, so a failover never needs memory the node
lacks, and so must one with shadows, onto which a stage is restored when no node waits.
Memory per stage does not fall monotonically with P (1F1B's first stage keeps P micro-batches
in flight), so the smallest depth a policy may re-partition to is the smallest P from which
every depth up to the configured one fits. D = 1 is checked because one pipeline
runs the most micro-batches (the kept inputs of lazy/eager redundancy grow with them): what
fits at D = 1 fits at every D.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from spotpipe.plan.layout import uniform_partition
from spotpipe.plan.memory import (LayerMemory, MemoryRules, carried, estimate_stage, instance,
                                  merge_facts, refusal, stage_facts)
from spotpipe.sim.itertime import microbatches_per_pipeline
from spotpipe.sim.memo import PerObject
from spotpipe.sim.params import SimConfig

# per config object: refusals per (P, D, redundancy, replica placement, FRC of every replica);
# smallest depths
_REFUSALS: PerObject[str | None] = PerObject(limit=4096)
_MIN: PerObject[int] = PerObject()


def layout_refusal(cfg: SimConfig, num_stages: int, num_pipelines: int, redundancy: str,
                   replica_on_host: bool | None = None, *,
                   frc_every_stage: bool = False, carriers: bool | None = None) -> str | None:
    """Why P x D does not fit (one line naming the stage and the figures), or None.
    `frc_every_stage`: eager FRC of every replica, as Bamboo runs it (its outputs held too).
    `carriers`: a node may have to run two stages (None: with redundancy, after a takeover)."""
    if carriers is None:
        carriers = redundancy != "none"
    return _REFUSALS.get(cfg, (num_stages, num_pipelines, redundancy, replica_on_host,
                               frc_every_stage, carriers),
                         _refusal, cfg, num_stages, num_pipelines, redundancy, replica_on_host,
                         frc_every_stage, carriers)


def _refusal(cfg: SimConfig, p: int, d: int, redundancy: str, replica_on_host: bool | None,
             frc_every_stage: bool, carriers: bool) -> str | None:
    layers = cfg.model.layer_memory
    if cfg.memory is None or not layers:
        return None
    node = instance(cfg.price.instance)
    parts = uniform_partition(len(layers), p)
    rules = replace(cfg.memory, schedule=cfg.schedule, num_stages=p,
                    microbatches=microbatches_per_pipeline(cfg.model, d),
                    redundancy=redundancy if p > 1 else "none", shadows=False,
                    replica_on_host=cfg.memory.replica_on_host if replica_on_host is None
                    else replica_on_host, frc_every_stage=frc_every_stage)
    plain = replace(rules, redundancy="none")
    facts = [stage_facts(layers, parts, s, redundancy != "none") for s in range(p)]
    where = f"P={p} x D={d} on {node.name}"
    for s in range(p):
        why = refusal(estimate_stage(s, facts[s], rules), node.device_bytes,
                      node.host_bytes_per_gpu)
        if why:
            return f"{where}: {why}"
        if carriers and p > 1:
            carrier = estimate_stage(s, merge_facts(facts[s], facts[(s + 1) % p]), plain)
            why = refusal(carrier, node.device_bytes, node.host_bytes_per_gpu)
            if why:
                after = ("a takeover" if rules.redundancy != "none"
                         else "a shadow restore onto it")
                return (f"{where}: a node carrying stages {s} and {(s + 1) % p} after "
                        f"{after} " + why.split(": it ", 1)[1])
    return None


@dataclass(frozen=True)
class NodeRoom:
    """`plan.policy.Room` on the instances' memory: whether one node holds these stages of
    the uniform partition at a depth, each without a replica (a node running several holds
    none) and with every micro-batch on its pipeline (D = 1, as `layout_refusal` checks).
    A value, not a closure, so that equal configs make equal (shared) rules."""

    layers: tuple[LayerMemory, ...]
    rules: MemoryRules
    device_bytes: float
    host_bytes: float

    def __call__(self, depth: int, stages: tuple[int, ...]) -> bool:
        return _holds(self, depth, stages)


@lru_cache(maxsize=4096)
def _holds(room: NodeRoom, depth: int, stages: tuple[int, ...]) -> bool:
    estimates = carried(room.layers, uniform_partition(len(room.layers), depth), stages,
                        replace(room.rules, num_stages=depth))
    return (sum(e.device_bytes for e in estimates) <= room.device_bytes
            and sum(e.host_bytes for e in estimates) <= room.host_bytes)


def node_room(cfg: SimConfig) -> NodeRoom | None:
    """The room the planner gives a node in this simulated job; None without a memory model
    (the planner's count rule stands in, as in a run whose memory was not measured)."""
    layers = cfg.model.layer_memory
    if cfg.memory is None or not layers:
        return None
    node = instance(cfg.price.instance)
    rules = replace(cfg.memory, schedule=cfg.schedule, redundancy="none", shadows=False,
                    microbatches=microbatches_per_pipeline(cfg.model, 1))
    return NodeRoom(tuple(layers), rules, node.device_bytes, node.host_bytes_per_gpu)


def min_stages(cfg: SimConfig, redundancy: str, replica_on_host: bool | None = None) -> int:
    """The smallest depth from which every depth up to `cfg.num_stages` fits (D = 1); raises
    ValueError with the refusal when the configured depth itself does not fit. A node may
    carry two stages with redundancy (a takeover) and with shadows too (`plan.policy`
    restores a stage no replica holds onto the nearest live node when no node waits)."""
    return _MIN.get(cfg, (redundancy, replica_on_host),
                    _min_stages, cfg, cfg.num_stages, redundancy, replica_on_host)


def _min_stages(cfg: SimConfig, target: int, redundancy: str,
                replica_on_host: bool | None) -> int:
    carriers = redundancy != "none" or cfg.shadows
    why = layout_refusal(cfg, target, 1, redundancy, replica_on_host, carriers=carriers)
    if why:
        raise ValueError(f"the configured layout does not fit: {why}")
    low = target
    while low > max(1, cfg.min_stages) and layout_refusal(
            cfg, low - 1, 1, redundancy, replica_on_host, carriers=carriers) is None:
        low -= 1
    return max(low, cfg.min_stages)


def require_fit(cfg: SimConfig, num_stages: int, num_pipelines: int, redundancy: str,
                replica_on_host: bool | None = None, *, frc_every_stage: bool = False) -> None:
    why = layout_refusal(cfg, num_stages, num_pipelines, redundancy, replica_on_host,
                         frc_every_stage=frc_every_stage)
    if why:
        raise ValueError(f"the configured layout does not fit: {why}")


def shadow_host_refusal(cfg: SimConfig, num_stages: int) -> str | None:
    """The shadows of all P stages share one CPU host: its memory must hold them all."""
    layers = cfg.model.layer_memory
    if cfg.memory is None or not layers or not cfg.shadows:
        return None
    host = instance(cfg.shadow_host)
    rules = replace(cfg.memory, num_stages=num_stages, shadows=True, redundancy="none")
    parts = uniform_partition(len(layers), num_stages)
    need = sum(estimate_stage(s, stage_facts(layers, parts, s, False), rules).shadow_host_bytes
               for s in range(num_stages))
    if need > host.host_bytes:
        return (f"the shadows of {num_stages} stages need {need / 2 ** 30:.2f} GiB, the shadow "
                f"host {host.name} has {host.host_bytes / 2 ** 30:.2f} GiB")
    return None


def check_policies(cfg: SimConfig, policies: "list[str] | tuple[str, ...]") -> None:
    """Refuse, before anything runs, a configuration some policy could not run in memory."""
    for name in policies:
        if name == "spotpipe":
            min_stages(cfg, cfg.redundancy)
            why = shadow_host_refusal(cfg, cfg.num_stages)
            if why and cfg.shadows:
                raise ValueError(f"spotpipe with shadows: {why}")
        elif name == "bamboo":
            require_fit(cfg, cfg.num_stages, 1, "eager" if cfg.num_stages > 1 else "none",
                        replica_on_host=False, frc_every_stage=True)
        elif name == "checkpoint_restart":
            require_fit(cfg, cfg.num_stages, 1, "none")
        elif name == "on_demand":
            require_fit(cfg, cfg.num_stages, cfg.num_pipelines, "none")
