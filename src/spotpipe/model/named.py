"""Split a whole model by module names, as torchtitan and torch.distributed.pipelining do.

A torchtitan model (and any model written the same way) keeps its blocks in a ModuleDict or
ModuleList and writes its forward so that a missing part is skipped::

    h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
    for layer in self.layers.values():
        h = layer(h, self.freqs_cis)
    h = self.norm(h) if self.norm else h
    return self.output(h) if self.output else h

torchtitan builds a pipeline stage by deleting what the stage does not own. Here every
top-level child, and every entry of a top-level ModuleDict or ModuleList, is a unit ("layer"):
a shallow copy of the model that keeps only that unit (the others set to None, or left out of
the container) and shares its modules and buffers with the original. Running the units in
order runs the model's own forward, piece by piece, with no wrapper written by the user.
Parameter names stay the model's own (``layers.3.attention.wq.weight``), and
``model.split_points`` names where stages begin (``["layers.2"]``), as pipelining's
``SplitPoint.BEGINNING`` does.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from torch import nn

from spotpipe.model.layered import LayeredModel, LossFn, find_tied


class SplitError(ValueError):
    """A model or split point that cannot be split by names."""


def unit_names(model: nn.Module) -> list[str]:
    """The model's units in order: top-level children, containers expanded one level."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            out += [f"{name}.{key}" for key in child._modules]
        else:
            out.append(name)
    if not out:
        raise SplitError(f"{type(model).__name__} has no child modules to split by name")
    return out


def _shell(model: nn.Module, unit: str) -> nn.Module:
    """A shallow copy of `model` holding only `unit` (modules and buffers shared)."""
    top, _, key = unit.partition(".")
    shell = copy.copy(model)
    shell._parameters = OrderedDict(model._parameters)
    shell._buffers = OrderedDict(model._buffers)
    modules: OrderedDict[str, nn.Module | None] = OrderedDict()
    for name, child in model._modules.items():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            part = copy.copy(child)  # the same container type, with the one entry (if any)
            part._modules = OrderedDict((k, m) for k, m in child._modules.items()
                                        if name == top and k == key)
            part._parameters, part._buffers = OrderedDict(), OrderedDict()
            modules[name] = part
        else:
            modules[name] = child if name == unit else None
    shell._modules = modules
    return shell


def split_by_names(model: nn.Module, loss_fn: LossFn) -> LayeredModel:
    """One unit per layer; layer names map back to the model's own for the final weights."""
    names = unit_names(model)
    layers = [_shell(model, unit) for unit in names]
    export: dict[str, str] = {}
    for i, layer in enumerate(layers):
        for key in layer.state_dict(keep_vars=True):
            export[f"{i}.{key}"] = key
    return LayeredModel(layers=layers, loss_fn=loss_fn, tied=find_tied(layers),
                        export_names=export, layer_names=names)


def split_points_map(layer_names: list[str], split_points: list[str]) -> list[int]:
    """The stage of every layer for stages that begin at `split_points` (in order)."""
    if not layer_names:
        raise SplitError("model.split_points: this model's layers have no names to split at")
    index = {name: i for i, name in enumerate(layer_names)}
    starts = []
    for point in split_points:
        if point not in index:
            raise SplitError(f"model.split_points: {point!r} is not a layer of the model; its "
                             f"layers are {', '.join(layer_names)}")
        starts.append(index[point])
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise SplitError(f"model.split_points: {split_points} must name distinct layers in "
                         "model order, after the first")
    stage_of, stage = [], 0
    for i in range(len(layer_names)):
        if stage < len(starts) and i == starts[stage]:
            stage += 1
        stage_of.append(stage)
    return stage_of

