"""How a layer list runs in a given precision, with or without activation checkpointing.

One definition shared by the pipeline stages, the replicas' FRC, the profiler and the
single-process reference loop, so that all of them compute the same bits:

* each layer runs under ``torch.autocast`` to the compute dtype, and its (floating) output is
  cast to that dtype: what a stage ships to the next (activations, and their gradients on the
  way back) is in the compute dtype, and because the cast happens at every layer, not only at
  stage cuts, the arithmetic does not depend on where the model is cut;
* parameters stay fp32 (master weights), so their gradients and the optimizer state are fp32;
* the loss is computed in fp32 from the upcast logits;
* activation checkpointing (``torch.utils.checkpoint``, non-reentrant, RNG state preserved)
  wraps each layer or the whole stage: the backward recomputes the same forward, so the bits
  do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How layers run: compute dtype and activation checkpointing."""

    name: str = "fp32"
    checkpointing: str = "none"  # none | layers | stage

    @classmethod
    def of(cls, cfg: Any) -> "Precision":
        """From a `spotpipe.config.Config` (its `precision` and activation checkpointing)."""
        return cls(cfg.precision, cfg.model.activation_checkpointing)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def scaled(self) -> bool:
        return self.name == "fp16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)


def _layer_call(layer: nn.Module, precision: Precision) -> Callable[[Tensor], Tensor]:
    def call(x: Tensor) -> Tensor:
        with precision.autocast(x.device):
            y = layer(x)
        return y.to(precision.dtype) if y.is_floating_point() else y
    return call


def _layers_call(layers: list[nn.Module], precision: Precision,
                 per_layer: bool) -> Callable[[Tensor], Tensor]:
    calls = [_layer_call(layer, precision) for layer in layers]
    if per_layer:
        calls = [_checkpointed(c) for c in calls]

    def call(x: Tensor) -> Tensor:
        for c in calls:
            x = c(x)
        return x
    return call


def _checkpointed(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def call(x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():  # FRC and evaluation: nothing to keep anyway
            return fn(x)
        return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)
    return call


def run_layers(module: nn.Module, x: Tensor, precision: Precision) -> Tensor:
    """Run a stage (an ``nn.Sequential`` of layers, or the whole model) on ``x``."""
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    if precision.name == "fp32" and precision.checkpointing == "none":
        return module(x)  # exactly what the runtime always did
    call = _layers_call(layers, precision, per_layer=precision.checkpointing == "layers")
    if precision.checkpointing == "stage":
        call = _checkpointed(call)
    return call(x)


def loss_of(loss_fn: Callable[[Tensor, Tensor], Tensor], output: Tensor, target: Tensor,
            precision: Precision) -> Tensor:
    """The loss in fp32, from the (upcast) output of the last layer."""
    if precision.name == "fp32":
        return loss_fn(output, target)
    return loss_fn(output.float(), target)
