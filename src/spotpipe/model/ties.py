"""Tied parameters and the global-norm bookkeeping of a partitioned model.

Pure functions of (model, partition): every process computes the same answer without talking.
"""

from __future__ import annotations

from spotpipe.model.layered import LayeredModel


def cross_stage_tied(model: LayeredModel, partition: list[tuple[int, int]]) -> set[str]:
    """Names of tied parameters whose partner lives on another stage: their gradients must be
    summed across stages (ties within one stage are one Parameter already)."""
    def stage_of(name: str) -> int:
        layer = int(name.split(".", 1)[0])
        return next(s for s, (a, b) in enumerate(partition) if a <= layer < b)

    return {n for a, b in model.tied if stage_of(a) != stage_of(b) for n in (a, b)}


def norm_param_names(model: LayeredModel, partition: list[tuple[int, int]]) -> list[list[str]]:
    """Per stage, the parameter names that count towards the global norm, in model order.

    A tied parameter counts once, where the unpartitioned model first meets it; this is what
    `nn.Module.parameters()` does on the unpartitioned model, so the norms agree.
    """
    seen: set[int] = set()
    out: list[list[str]] = [[] for _ in partition]
    for stage, (start, end) in enumerate(partition):
        for index in range(start, end):
            for name, p in model.layers[index].named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                out[stage].append(f"{index}.{name}")
    return out
