"""A model as an ordered list of single-tensor layers, the unit that spotpipe partitions.

Pipeline parallelism cuts a model between layers and ships exactly one activation tensor
across each cut, so the model is described as a list of layers with a narrow contract:

* every layer is an ``nn.Module`` whose ``forward`` takes ONE tensor and returns ONE tensor
  (the first layer gets the batch input ``x``; the last layer's output goes to the loss);
* ``loss_fn(last_output, target)`` returns a scalar, the MEAN loss over the micro-batch (the
  runtime averages micro-batch losses, so a sum would scale the gradient by the batch size);
* parameter names are those of ``nn.Sequential(*layers)``, ``"{layer_index}.{param_name}"``,
  which is also what a stage built by :func:`spotpipe.model.partition.build_stage` uses, so
  checkpoints of the partitioned and the unpartitioned model share their keys.

``tied`` lists pairs of global parameter names that are one tensor (e.g. GPT's token
embedding and output head). Inside one process they are the same ``Parameter``; when the two
layers land on different stages, each stage holds its own copy and the runtime keeps the
copies equal by summing their gradients before the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class LayeredModel:
    """Ordered single-tensor layers, a mean loss, and the names of tied parameter pairs."""

    layers: list[nn.Module]
    loss_fn: LossFn
    tied: list[tuple[str, str]] = field(default_factory=list)
    # layer names -> the names the model is known by outside spotpipe (e.g. a transformers
    # model's own), used for the final model.safetensors; names not listed are kept
    export_names: dict[str, str] = field(default_factory=dict)
    # each layer's name in the model it came from ("layers.3"), for model.split_points
    layer_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layers:
            raise ValueError("a LayeredModel needs at least one layer, got none")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
        if not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(self.loss_fn).__name__}")
        self.tied = [tuple(pair) for pair in self.tied]  # type: ignore[misc]
        if self.layer_names and len(self.layer_names) != len(self.layers):
            raise ValueError(f"{len(self.layer_names)} layer names for {len(self.layers)} layers")
        names = dict(self.to_sequential().named_parameters(remove_duplicate=False))
        for pair in self.tied:
            if len(pair) != 2:
                raise ValueError(f"a tied entry must be a pair of parameter names, got {pair!r}")
            for name in pair:
                if name not in names:
                    raise ValueError(f"tied parameter {name!r} is not a parameter of the model")

    def export_name(self, name: str) -> str:
        return self.export_names.get(name, name)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_sequential(self) -> nn.Sequential:
        """The unpartitioned reference model; it shares the layer objects (no copies)."""
        return nn.Sequential(*self.layers)


def find_tied(layers: list[nn.Module]) -> list[tuple[str, str]]:
    """Pairs of global names that are the same Parameter object, first name first.

    Lets a user factory tie weights simply by assigning one Parameter to two layers, the way
    PyTorch code usually does, without naming the pair by hand.
    """
    first: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    for name, param in nn.Sequential(*layers).named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((first[id(param)], name))
        else:
            first[id(param)] = name
    return pairs
