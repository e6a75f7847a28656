"""Tied parameters and the global-norm bookkeeping of a partitioned model.

Pure functions of (model, partition): every process computes the same answer without talking.
"""

from __future__ import annotations

from spotpipe.model.layered import LayeredModel
from spotpipe.plan.profile import cross_stage_tied as plan_cross_stage_tied


def cross_stage_tied(model: LayeredModel, partition: list[tuple[int, int]]) -> set[str]:
    """Names of tied parameters whose partner lives on another stage (`plan.profile`'s rule,
    on the model's pairs)."""
    return plan_cross_stage_tied(model.tied, partition)


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
