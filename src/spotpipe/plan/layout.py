"""Where each pipeline stage runs: the P x D layout over live nodes, and the replica ring.

A layout is plain, immutable data so that `plan.decide` can be a pure function and the
simulator can replay it against a clock exactly as the runtime replays it against a cluster.

Ownership is a mapping (pipeline d, stage s) -> node id rather than a fixed grid, because after
a takeover one node runs two stages of its pipeline (its own and its successor's). The replica
ring follows Bamboo: the node of stage s holds a replica of stage (s + 1) mod P, so the replica
of stage s lives on the owner of stage (s - 1) mod P.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

Slot = tuple[int, int]  # (pipeline d, stage s)


@dataclass(frozen=True, eq=False)
class Layout:
    """P stages x D pipelines, who owns what, and who waits on standby.

    `owners` is stored as a tuple of ((d, s), node) pairs so the layout stays immutable and
    hashable; equality ignores their order. `target_stages` is the configured depth P
    the job returns to after a re-partition; `max_pipelines` caps growth by ADD_PIPELINE
    (None: as many as nodes allow).
    """

    num_stages: int
    num_pipelines: int
    owners: tuple[tuple[Slot, str], ...]
    standby: tuple[str, ...] = ()
    target_stages: int = 0
    max_pipelines: int | None = None
    _map: dict[Slot, str] = field(init=False, repr=False, compare=False, hash=False)
    _carriers: int = field(init=False, repr=False, compare=False, hash=False)
    _active: frozenset[str] = field(init=False, repr=False, compare=False, hash=False)

    def _key(self) -> tuple:
        return (self.num_stages, self.num_pipelines, frozenset(self._map.items()), self.standby,
                self.target_stages, self.max_pipelines)

    def __eq__(self, other: object) -> bool:
        """Equal when the same nodes own the same stages, whatever the insertion order."""
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __post_init__(self) -> None:
        mapping = dict(self.owners)
        p, width = self.num_stages, self.num_pipelines
        if len(mapping) != len(self.owners) or len(mapping) != p * width or any(
                not (0 <= d < width and 0 <= s < p) for d, s in mapping):
            raise ValueError(f"layout must own every (pipeline, stage) of {width} x {p} "
                             f"exactly once, got {sorted(mapping)}")
        if set(mapping.values()) & set(self.standby) or len(set(self.standby)) != len(self.standby):
            raise ValueError("a standby node is listed twice or also owns a stage")
        self._index(mapping)
        for node, slots in self._slots.items():
            if len({d for d, _ in slots}) > 1:
                raise ValueError(f"node {node} owns stages of more than one pipeline")

    def _index(self, mapping: dict[Slot, str]) -> None:
        active = frozenset(mapping.values())
        object.__setattr__(self, "owners", tuple(mapping.items()))
        object.__setattr__(self, "_map", mapping)
        # how many more stages than nodes: > 0 exactly when some node carries two stages
        object.__setattr__(self, "_carriers", len(mapping) - len(active))
        object.__setattr__(self, "_active", active)
        if self.target_stages <= 0:
            object.__setattr__(self, "target_stages", self.num_stages)

    @property
    def _slots(self) -> dict[str, list[Slot]]:
        """node -> the slots it owns; built on first use (the simulator derives tens of
        layouts per simulated hour and most are never asked who owns what)."""
        slots = self.__dict__.get("_slots_index")
        if slots is None:
            slots = {}
            for slot, node in self._map.items():
                got = slots.get(node)
                if got is None:
                    slots[node] = [slot]
                else:
                    got.append(slot)
            object.__setattr__(self, "_slots_index", slots)
        return slots

    @classmethod
    def _trusted(cls, num_stages: int, num_pipelines: int, mapping: dict[Slot, str],
                 standby: tuple[str, ...], target_stages: int,
                 max_pipelines: int | None) -> "Layout":
        """Build without validation, for layouts derived by `plan.decide` from a valid one.

        Decisions run once per cluster event in the simulator's inner loop; validating every
        derived layout would dominate a 10,000-seed table. Public constructors validate.
        """
        self = object.__new__(cls)
        for name, value in (("num_stages", num_stages), ("num_pipelines", num_pipelines),
                            ("standby", tuple(standby)), ("target_stages", target_stages),
                            ("max_pipelines", max_pipelines)):
            object.__setattr__(self, name, value)
        self._index(mapping)
        return self

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, num_stages: int, num_pipelines: int, mapping: Mapping[Slot, str],
                     standby: Iterable[str] = (), *, target_stages: int = 0,
                     max_pipelines: int | None = None) -> "Layout":
        return cls(num_stages, num_pipelines, tuple(mapping.items()), tuple(standby),
                   target_stages, max_pipelines)

    @classmethod
    def build(cls, num_stages: int, num_pipelines: int, nodes: Iterable[str], *,
              target_stages: int = 0, max_pipelines: int | None = None) -> "Layout":
        """Fill pipeline by pipeline, stage by stage; nodes left over wait on standby."""
        nodes = list(nodes)
        need = num_stages * num_pipelines
        if len(nodes) < need:
            raise ValueError(f"{num_pipelines} pipelines of {num_stages} stages need {need} "
                             f"nodes, got {len(nodes)}")
        mapping = {(d, s): nodes[d * num_stages + s]
                   for d in range(num_pipelines) for s in range(num_stages)}
        return cls.from_mapping(num_stages, num_pipelines, mapping, nodes[need:],
                                target_stages=target_stages, max_pipelines=max_pipelines)

    # -- plain data, for plans published through the store ---------------------------------
    def to_json(self) -> dict:
        return {"stages": self.num_stages, "pipelines": self.num_pipelines,
                "owners": [[d, s, n] for (d, s), n in sorted(self._map.items())],
                "standby": list(self.standby), "target_stages": self.target_stages,
                "max_pipelines": self.max_pipelines}

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        return cls.from_mapping(data["stages"], data["pipelines"],
                                {(d, s): n for d, s, n in data["owners"]}, data.get("standby", ()),
                                target_stages=data.get("target_stages", 0),
                                max_pipelines=data.get("max_pipelines"))

    # -- queries --------------------------------------------------------------------------
    @property
    def mapping(self) -> dict[Slot, str]:
        return dict(self._map)

    @property
    def grid(self) -> tuple[tuple[str, ...], ...]:
        """grid[d][s] = node owning stage s of pipeline d."""
        return tuple(tuple(self._map[(d, s)] for s in range(self.num_stages))
                     for d in range(self.num_pipelines))

    def owner(self, d: int, s: int) -> str:
        return self._map[(d, s % self.num_stages)]

    def replica_holder(self, d: int, s: int) -> str:
        """The node holding stage s's replica: the owner of stage (s - 1) mod P."""
        return self._map[(d, (s - 1) % self.num_stages)]

    def stages_of(self, node: str) -> list[Slot]:
        return sorted(self._slots.get(node, ()))

    @property
    def active_nodes(self) -> frozenset[str]:
        return self._active

    @property
    def all_nodes(self) -> frozenset[str]:
        return self.active_nodes | frozenset(self.standby)

    def carriers(self) -> dict[str, list[Slot]]:
        """Nodes running more than one stage (after a takeover), with their stages."""
        return {n: sorted(slots) for n, slots in self._slots.items() if len(slots) > 1}

    @property
    def has_carriers(self) -> bool:
        return self._carriers > 0

    def with_standby(self, standby: tuple[str, ...]) -> "Layout":
        """The same owners with another standby list; shares the owner index (cheap: joins
        and standby losses are the commonest events and change no stage)."""
        if standby == self.standby:
            return self
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)  # same owners: the shape key stays valid
        object.__setattr__(new, "standby", tuple(standby))
        return new

    def has_replica(self, d: int, s: int) -> bool:
        """Whether stage s of pipeline d can be taken over from memory.

        A node's memory fits its own stage plus one replica. A node already running two
        stages has used the replica's room, so the stage after its pair has no replica, and a
        node's own second stage is not a replica of anything. Both cases return False.
        """
        holder = self.replica_holder(d, s)
        if holder == self.owner(d, s):
            return False
        return not self._carriers or len(self._slots[holder]) == 1

    def shape_key(self) -> tuple[int, int, tuple[tuple, ...]]:
        """(P, D, per pipeline the stages merged onto their predecessor's node).

        Iteration time depends only on this, so the simulator caches timings by it; the key
        is computed once per layout. A pipeline where a node runs stages apart (a stage
        restored from a shadow or copied onto the nearest live node) has no such list: its
        entry is then the stages each node runs, nodes by their first stage (as the runtime
        orders them, `runtime.node.node_schedule`), so that it is timed as the merged
        streams it runs and not as a pipeline without a carrier.
        """
        cached = self.__dict__.get("_shape")
        if cached is not None:
            return cached
        p, width = self.num_stages, self.num_pipelines
        if not self._carriers:
            key = (p, width, ((),) * width)
        else:
            key = (p, width, tuple(self._pipeline_shape(d) for d in range(width)))
        object.__setattr__(self, "_shape", key)
        return key

    def _pipeline_shape(self, d: int) -> tuple:
        """Pipeline d's entry of `shape_key`: its merged stages (stage s is merged when its
        predecessor's owner runs it too), or its nodes' stages when some node runs stages
        that are not one run around the ring."""
        p, own = self.num_stages, self._map
        merged = tuple(s for s in range(p) if own[(d, s)] == own[(d, (s - 1) % p)])
        nodes: dict[str, list[int]] = {}
        for s in range(p):
            nodes.setdefault(own[(d, s)], []).append(s)
        if len(nodes) == max(1, p - len(merged)):  # each node's stages are one run
            return merged
        return tuple(sorted(tuple(stages) for stages in nodes.values()))


def splits_evenly(microbatches: int, pipelines: int) -> bool:
    """Whether an iteration's micro-batches split evenly over `pipelines`: each pipeline takes
    an equal share of the same global batch, so the runtime runs no other number of them, and
    the planner and the simulator plan none."""
    return microbatches % pipelines == 0


def uniform_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers 0..L-1 into P contiguous [start, end) ranges, sizes differing by <= 1."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def layer_moves(old_partition: list[tuple[int, int]],
                new_partition: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Layers whose stage changes in a re-partition, as (layer, from_stage, to_stage).

    Ranges are [start, end). Only layers that change stage need their weights and optimizer
    state moved, which is what makes a re-partition cheaper than a reload.
    """
    old_of = _stage_of_layer(old_partition, "old")
    new_of = _stage_of_layer(new_partition, "new")
    if set(old_of) != set(new_of):
        raise ValueError(f"partitions cover different layers: old {min(old_of)}..{max(old_of)}, "
                         f"new {min(new_of)}..{max(new_of)}")
    return [(layer, old_of[layer], new_of[layer]) for layer in sorted(old_of)
            if old_of[layer] != new_of[layer]]


def _stage_of_layer(partition: list[tuple[int, int]], name: str) -> dict[int, int]:
    out: dict[int, int] = {}
    expect = partition[0][0] if partition else 0
    for stage, (start, end) in enumerate(partition):
        if start != expect or end <= start:
            raise ValueError(f"{name} partition is not contiguous and non-empty at stage "
                             f"{stage}: {partition}")
        for layer in range(start, end):
            out[layer] = stage
        expect = end
    if not out:
        raise ValueError(f"{name} partition is empty")
    return out
