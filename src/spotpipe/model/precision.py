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
  do not change;
* random draws (dropout) come from a stream of their own per (seed, iteration, micro-batch,
  layer) (`Draws`): a layer draws the same masks whichever node runs it, in whichever stage,
  however often (a replica's redundant forward, a heir's replay, a recompute), so dropout does
  not break bit-identical results across layouts and failovers.
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


_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Draws:
    """Where one micro-batch's forward draws its random numbers from (dropout's masks).

    Each process's global RNG would give a layer different masks on the node that owns it,
    on the node holding its replica (FRC), on a heir replaying it after a takeover, and after
    a re-partition moved it to another stage: with dropout, no failover would be exact. So each
    layer starts from a seed of its own, a hash of the job's seed, the iteration, the global
    micro-batch (pipeline * M + m, as the reference loop counts them) and the layer's global
    index; the single-process reference loop draws the same way. The global generator is
    reseeded (1 us on CPU), not forked: nothing else in a worker draws from it (the data order
    and the initial weights have generators of their own)."""

    seed: int
    iteration: int
    microbatch: int

    def begin_layer(self, layer: int, device: torch.device) -> None:
        h = 0x9E3779B97F4A7C15
        for part in (self.seed, self.iteration, self.microbatch, layer):  # (splitmix64 rounds)
            h = ((h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
            h ^= h >> 31
        seed = h >> 1  # (non-negative, as manual_seed wants)
        if device.type == "cpu":
            torch.default_generator.manual_seed(seed)
        elif device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        else:
            torch.manual_seed(seed)  # (every device's generator: slower, same masks)


def _layer_call(layer: nn.Module, precision: Precision, index: int = 0,
                draws: Draws | None = None) -> Callable[[Tensor], Tensor]:
    def call(x: Tensor) -> Tensor:
        if draws is not None:  # (inside the call: a checkpoint's recompute draws alike)
            draws.begin_layer(index, x.device)
        with precision.autocast(x.device):
            y = layer(x)
        return y.to(precision.dtype) if y.is_floating_point() else y
    return call


def _layers_call(layers: list[tuple[int, nn.Module]], precision: Precision,
                 per_layer: bool, draws: Draws | None = None) -> Callable[[Tensor], Tensor]:
    calls = [_layer_call(layer, precision, index, draws) for index, layer in layers]
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


def run_layers(module: nn.Module, x: Tensor, precision: Precision,
               draws: Draws | None = None) -> Tensor:
    """Run a stage (an ``nn.Sequential`` of layers named by their global index, as
    `build_stage` and `LayeredModel.to_sequential` make them, or the whole model) on ``x``;
    with `draws`, each layer's random draws are its own (see `Draws`)."""
    layers = ([(int(name) if name.isdigit() else i, layer)
               for i, (name, layer) in enumerate(module.named_children())]
              if isinstance(module, nn.Sequential) else [(0, module)])
    if precision.name == "fp32" and precision.checkpointing == "none" and draws is None:
        return module(x)  # exactly what the runtime always did
    call = _layers_call(layers, precision, per_layer=precision.checkpointing == "layers",
                        draws=draws)
    if precision.checkpointing == "stage":
        call = _checkpointed(call)
    return call(x)


def loss_of(loss_fn: Callable[[Tensor, Tensor], Tensor], output: Tensor, target: Tensor,
            precision: Precision) -> Tensor:
    """The loss in fp32, from the (upcast) output of the last layer."""
    if precision.name == "fp32":
        return loss_fn(output, target)
    return loss_fn(output.float(), target)
