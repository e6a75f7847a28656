"""Which layers travel, from whom to whom, when the depth P changes: the layer-ownership diff.

A re-partition gives every node new stages (and a new replica) made of other layer ranges.
Most of those layers are already in the node's memory, as part of a stage it owned or of the
replica it held; only the rest travel, each from one node that holds it now. Every node
computes the same list from the same inputs (old and new layout, old and new partition), so
nothing is announced. The unit is a layer because a layer is what both partitions share:
stages of different depths have no common unit larger than that.

`exchange_order` then says in which order each node posts its messages so that the exchange
cannot deadlock even if every operation blocked until its peer took part (NCCL's point-to-point
operations on one stream behave that way for large messages); whole stages moving between
nodes (`runtime.migrate.run`) take the same order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from spotpipe.plan.layout import Layout


@dataclass(frozen=True)
class LayerMove:
    layer: int
    src: str
    dst: str


class HandedStage(Protocol):
    """A whole stage sent to a node (a `plan.transfers.Transfer`)."""

    @property
    def stage(self) -> int: ...

    @property
    def dst(self) -> str: ...


def held_replica(layout: Layout, node: str) -> int | None:
    """The stage whose replica `node` holds in this layout (None when it carries two, is not
    running a stage, or the pipeline has one stage)."""
    if node not in layout.active_nodes:
        return None
    slots = layout.stages_of(node)
    if len(slots) != 1 or layout.num_stages < 2:
        return None
    d, s = slots[0]
    successor = (s + 1) % layout.num_stages
    return successor if layout.has_replica(d, successor) else None


def node_layers(layout: Layout, partition: list[tuple[int, int]], node: str,
                redundancy: bool) -> set[int]:
    """Layers whose state `node` holds under `layout`: its owned stages' and its replica's."""
    stages = [s for _, s in layout.stages_of(node)]
    replica = held_replica(layout, node) if redundancy else None
    if replica is not None:
        stages.append(replica)
    return {layer for s in stages for layer in range(*partition[s])}


def layer_plan(old: Layout, new: Layout, old_partition: list[tuple[int, int]],
               new_partition: list[tuple[int, int]], redundancy: bool,
               unreplicated: Collection[str] = (),
               handed: Collection[HandedStage] = ()) -> list[LayerMove]:
    """Every layer transfer the change needs, in a deterministic order.

    A node keeps what it already holds. Any holder is a valid source, since all data-parallel
    owners of a stage and its (exact) replica hold identical state; only nodes of the new
    layout can send (the others leave). Among the holders the least loaded is taken, then one
    that already sends to the same node (fewer messages), then the first by name. Nodes in
    `unreplicated` lack the replica `old` gives them (a plan failed before it arrived): its
    layers are not theirs to send or keep. `handed`: stages of `old_partition` that nodes
    leaving on a notice hand whole to a node of `new` before the layers move (their
    `.stage` and `.dst`): that node holds their layers too.
    """
    if old.num_pipelines != new.num_pipelines:
        raise ValueError(f"a re-partition keeps the number of pipelines, got "
                         f"{old.num_pipelines} -> {new.num_pipelines}")
    for name, lay, part in (("old", old, old_partition), ("new", new, new_partition)):
        if len(part) != lay.num_stages:
            raise ValueError(f"{name} partition has {len(part)} stages, its layout "
                             f"{lay.num_stages}")
    nodes = sorted(new.active_nodes)
    have = {n: node_layers(old, old_partition, n, redundancy and n not in unreplicated)
            if n in old.active_nodes else set() for n in nodes}
    for h in handed:
        if h.dst not in have or not 0 <= h.stage < len(old_partition):
            raise ValueError(f"stage {h.stage} is handed to {h.dst}, which is no node of the "
                             "new layout, or no stage of the old partition")
        have[h.dst] |= set(range(*old_partition[h.stage]))
    load = {n: 0 for n in nodes}
    pairs: set[tuple[str, str]] = set()
    moves: list[LayerMove] = []
    for dst in nodes:
        for layer in sorted(node_layers(new, new_partition, dst, redundancy) - have[dst]):
            holders = [n for n in nodes if layer in have[n]]
            if not holders:
                raise ValueError(f"layer {layer}, needed by {dst}, is held by no node of the "
                                 "new layout")
            src = min(holders, key=lambda n: (load[n], (n, dst) not in pairs, n))
            load[src] += 1
            pairs.add((src, dst))
            moves.append(LayerMove(layer, src, dst))
    return moves


class Edge(Protocol):
    """A message between two nodes: a layer's (`LayerMove`) or a stage's (`Transfer`)."""

    @property
    def src(self) -> str: ...

    @property
    def dst(self) -> str: ...


def exchange_order(moves: Sequence[Edge], me: str,
                   ranks: dict[str, int]) -> list[tuple[str, str]]:
    """This node's messages as ("send" | "recv", peer), one per peer and direction.

    Pairs of nodes are taken in one global order (by their ranks, lower first), and within a
    pair the lower rank sends first while the higher receives first. Every node meets its
    pairs in the same relative order, so the lowest unfinished pair can always proceed: no
    cycle of waits can form, whatever the transport blocks on.
    """
    sends = {m.dst for m in moves if m.src == me and m.dst != me}
    recvs = {m.src for m in moves if m.dst == me and m.src != me}
    mine = ranks[me]
    out: list[tuple[str, str]] = []
    for peer in sorted(sends | recvs, key=lambda p: (min(mine, ranks[p]), max(mine, ranks[p]))):
        first, second = ("send", "recv") if mine < ranks[peer] else ("recv", "send")
        for op in (first, second):
            if (op == "send" and peer in sends) or (op == "recv" and peer in recvs):
                out.append((op, peer))
    return out
