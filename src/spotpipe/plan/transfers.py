"""Which stage and replica states travel between nodes when the layout changes (not its depth).

Part of a Decision: every node carries out the same list, so nobody announces anything. A
replica comes from a node that owned its stage before the change (all data-parallel owners of
a stage hold identical state), preferring the receiver itself; the replica of a stage that no
survivor owned comes from the node that restores it from its shadow, after the restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from spotpipe.plan.layers import held_replica
from spotpipe.plan.layout import Layout

STAGE, REPLICA = "stage", "replica"


@dataclass(frozen=True)
class Transfer:
    kind: str  # "stage" or "replica"
    stage: int
    src: str
    dst: str

    def to_json(self) -> list:
        return [self.kind, self.stage, self.src, self.dst]

    @classmethod
    def from_json(cls, data: list) -> "Transfer":
        kind, stage, src, dst = data
        if kind not in (STAGE, REPLICA):
            raise ValueError(f"transfer kind {kind!r}")
        return cls(str(kind), int(stage), str(src), str(dst))


def transfers(old: Layout, new: Layout, copies: Iterable[tuple[int, str, str]],
              promoted: set[str], replicas: bool,
              unreplicated: Iterable[str] = ()) -> list[Transfer]:
    """Every state transfer the change needs, in a deterministic order.

    `copies` are the decision's stage copies (stage, src, dst); `promoted` the nodes that
    turned their replica into an owned stage (their replica is gone); without `replicas`
    (redundancy off) only stages move. A copy's source outside the new layout is a node
    leaving on a notice that hands its stage over (`departing`): it sends the stage's
    replica too when no node that stays owned the stage. `unreplicated`: nodes of `old` that
    lack the replica it gave them (a plan failed before it arrived): sent again.
    """
    copies = list(copies)
    out = [Transfer(STAGE, s, src, dst) for s, src, dst in copies]
    if not replicas:
        return out
    alive = set(new.active_nodes)
    handed = {s: src for s, src, _ in copies if src not in alive}
    lacking = set(promoted) | set(unreplicated)
    for node in sorted(new.active_nodes):
        want = held_replica(new, node)
        if want is None:
            continue
        had = (held_replica(old, node) if node in old.active_nodes and node not in lacking
               else None)
        if had == want:
            continue
        sources = sorted(n for (d, s), n in old.mapping.items() if s == want and n in alive)
        if not sources and want in handed:  # (from the node that hands the stage over)
            sources = [handed[want]]
        if not sources:
            # no owner of the stage survived: the change restores it from its shadow, and
            # its new owner in pipeline 0 sends the replica once it has (see `after_restores`)
            sources = [new.owner(0, want)]
        src = node if node in sources else sources[0]
        out.append(Transfer(REPLICA, want, src, node))
    return out


def departing(moves: Iterable[Transfer], new: Layout) -> list[str]:
    """The nodes that leave the job once they have sent their part of `moves`: sources
    outside the new layout (nodes leaving on a notice, handing their stages over). Their
    transfers go over groups of their own (`runtime.reshape`), since they are in none of
    the new generation's."""
    return sorted({t.src for t in moves if t.src not in new.all_nodes})


def after_restores(moves: Iterable[Transfer], old: Layout, restored: set[int]) -> list[Transfer]:
    """The replica transfers of `moves` whose source holds the state only once it has restored
    it from its shadow: stages in `restored` that the source did not own before."""
    return [t for t in moves if t.kind == REPLICA and t.stage in restored
            and t.src not in {n for (_, s), n in old.mapping.items() if s == t.stage}]
