"""What partitioning needs of a model, measured once at launch: the layer profile.

A partition at any depth is a function of per-layer facts (names, parameters, forward+backward
time, memory) and of the configuration; none of them depends on the depth. So the launcher
measures them once, on the model it builds to check the job anyway, and ships them in the run
spec: a re-partition while the job trains (or a successor coordinator on another host) derives
its ranges from the same numbers in microseconds, without building the model again, and every
depth is cut from one measurement instead of each from a noisy profiling run of its own.

Pure data and validation (the profile travels in store records and run files, so reading one
checks every field and names the one that is wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spotpipe.plan.memory import LayerMemory


class ProfileError(ValueError):
    """A layer profile that does not describe a model: wrong lengths, types or numbers."""


@dataclass(frozen=True)
class LayerProfile:
    """Per layer of a layer-list model, in order.

    `names` are the layers' names in the model they came from (for `model.split_points`), or
    empty when the model gives none. `times` (median forward+backward seconds on one
    micro-batch) is measured only for the partition methods that use it (`time`, `balanced`),
    None otherwise. `tied` lists the pairs of parameter names that are one tensor (the model's
    `tied`).
    """

    names: tuple[str, ...]
    params: tuple[int, ...]
    memory: tuple[LayerMemory, ...]
    times: tuple[float, ...] | None = None
    tied: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.params)
        if n == 0:
            raise ProfileError("layer profile: the model has no layers")
        for key, values in (("names", self.names or None), ("memory", self.memory),
                            ("times", self.times)):
            if values is not None and len(values) != n:
                raise ProfileError(f"layer profile: {key} has {len(values)} entries for "
                                   f"{n} layers")

    @property
    def num_layers(self) -> int:
        return len(self.params)

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "params": list(self.params),
                "memory": [[m.params, m.activation_bytes, m.output_bytes, m.transient_bytes,
                            m.tied_params, m.tied_to, m.loss_bytes, m.backward_bytes]
                           for m in self.memory],
                "times": None if self.times is None else list(self.times),
                "tied": [list(pair) for pair in self.tied]}

    @classmethod
    def from_json(cls, data: Any) -> "LayerProfile":
        if not isinstance(data, dict):
            raise ProfileError("layer profile: not an object")
        names = tuple(_str(v, f"names[{i}]") for i, v in enumerate(_list(data, "names")))
        params = tuple(_count(v, f"params[{i}]") for i, v in enumerate(_list(data, "params")))
        memory = []
        for i, row in enumerate(_list(data, "memory")):
            # (a profile written before loss_bytes was recorded has 6 entries: no loss part;
            # before backward_bytes, 7: no block's backward working memory)
            if not isinstance(row, list) or len(row) not in (6, 7, 8):
                raise ProfileError(f"layer profile: memory[{i}] is not [params, "
                                   "activation_bytes, output_bytes, transient_bytes, "
                                   f"tied_params, tied_to, loss_bytes, backward_bytes]: {row!r}")
            tied_to = row[5]
            if isinstance(tied_to, bool) or not isinstance(tied_to, int) \
                    or not -1 <= tied_to < i:
                raise ProfileError(f"layer profile: memory[{i}][5] is not -1 or an earlier "
                                   f"layer: {tied_to!r}")
            memory.append(LayerMemory(_count(row[0], f"memory[{i}][0]"),
                                      _amount(row[1], f"memory[{i}][1]"),
                                      _amount(row[2], f"memory[{i}][2]"),
                                      _amount(row[3], f"memory[{i}][3]"),
                                      _count(row[4], f"memory[{i}][4]"), tied_to,
                                      _amount(row[6], f"memory[{i}][6]") if len(row) >= 7
                                      else 0.0,
                                      _amount(row[7], f"memory[{i}][7]") if len(row) == 8
                                      else 0.0))
        times = None
        if data.get("times") is not None:
            times = tuple(_amount(v, f"times[{i}]")
                          for i, v in enumerate(_list(data, "times")))
        tied = []
        for i, pair in enumerate(_list(data, "tied") if "tied" in data else []):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProfileError(f"layer profile: tied[{i}] is not a pair of names: {pair!r}")
            tied.append((_str(pair[0], f"tied[{i}][0]"), _str(pair[1], f"tied[{i}][1]")))
        return cls(names, params, tuple(memory), times, tuple(tied))


def _list(data: dict[str, Any], key: str) -> list[Any]:
    if not isinstance(data.get(key), list):
        raise ProfileError(f"layer profile: {key} is missing or not a list")
    return data[key]


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"layer profile: {where} is not a string: {value!r}")
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProfileError(f"layer profile: {where} is not a count: {value!r}")
    return value


def _amount(value: Any, where: str) -> float:
    """A finite non-negative number (NaN or a negative time would steer the partition)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ProfileError(f"layer profile: {where} is not a finite non-negative number: "
                           f"{value!r}")
    return float(value)


def cross_stage_tied(tied: tuple[tuple[str, str], ...] | list[tuple[str, str]],
                     partition: list[tuple[int, int]]) -> set[str]:
    """Names of tied parameters whose partner lives on another stage: their gradients must be
    summed across stages (ties within one stage are one Parameter already). A parameter's
    layer is the leading index of its global name."""
    def stage_of(name: str) -> int:
        layer = int(name.split(".", 1)[0])
        return next(s for s, (a, b) in enumerate(partition) if a <= layer < b)

    return {n for a, b in tied if stage_of(a) != stage_of(b) for n in (a, b)}
