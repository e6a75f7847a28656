"""Mixed precision, activation checkpointing and fp16's dynamic loss scaler.

One definition of how a layer list runs, shared by the pipeline stages, the replicas' FRC and
the single-process reference loop, so that all of them compute the same bits:

* each layer runs under ``torch.autocast`` to the compute dtype, and its (floating) output is
  cast to that dtype: what a stage ships to the next (activations, and their gradients on the
  way back) is in the compute dtype, and because the cast happens at every layer, not only at
  stage cuts, the arithmetic does not depend on where the model is cut;
* parameters stay fp32 (master weights), so their gradients and the optimizer state are fp32;
* the loss is computed in fp32 from the upcast logits;
* activation checkpointing (``torch.utils.checkpoint``, non-reentrant, RNG state preserved)
  wraps each layer or the whole stage: the backward recomputes the same forward, so the bits
  do not change.

fp16's loss scaler is ``torch.amp.GradScaler``'s arithmetic (the same kernels) with its state
kept in the optimizer state of every parameter (``loss_scale``, ``loss_scale_growth``). That is
where everything that moves a stage already looks: replicas (digests compare it), shadows,
layer moves of a re-partition and durable checkpoints carry it without knowing about it. Every
copy holds the same value, because every node takes the same skip decision (from the gathered
found-inf flags, like the gradient norm) and applies the same update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from spotpipe.config import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE_KEYS = ("loss_scale", "loss_scale_growth")


@dataclass(frozen=True)
class Precision:
    """How layers run: compute dtype and activation checkpointing."""

    name: str = "fp32"
    checkpointing: str = "none"  # none | layers | stage

    @classmethod
    def of(cls, cfg: Config) -> "Precision":
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


# --------------------------------------------------------------------------- loss scaler


def init_loss_scale(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    """Give every parameter the scaler's initial state. The optimizer's own state must exist
    already (`optim.build_optimizer` creates it): torch's optimizers initialise a parameter's
    state only when they find it empty."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            state.setdefault("loss_scale", torch.full((), cfg.loss_scale.init,
                                                      dtype=torch.float32, device=p.device))
            state.setdefault("loss_scale_growth", torch.zeros((), dtype=torch.int32,
                                                              device=p.device))


def current_scale(optimizer: torch.optim.Optimizer) -> Tensor:
    """The loss scale (a float32 scalar) held with the first parameter's state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return optimizer.state[p]["loss_scale"]
    raise RuntimeError("a stage without parameters has no loss scale")


def unscale(grads: list[Tensor], scale: Tensor) -> tuple[list[Tensor], bool]:
    """Gradients divided by the scale, out of place (the kept local gradients stay as they
    are), with GradScaler.unscale_'s kernel and inverse; and whether any is not finite."""
    if not grads:
        return [], False
    out = [g.clone() for g in grads]
    device = out[0].device
    found = torch.zeros(1, dtype=torch.float32, device=device)
    inv = scale.double().reciprocal().float().to(device)
    torch._amp_foreach_non_finite_check_and_unscale_(out, found, inv)
    return out, bool(found.item() > 0)


def update_scale(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
                 found_inf: bool, cfg: Config) -> None:
    """GradScaler.update's kernel on every parameter's copy of the scaler state."""
    ls = cfg.loss_scale
    for p in params:
        state = optimizer.state[p]
        flag = torch.full((1,), 1.0 if found_inf else 0.0, dtype=torch.float32,
                          device=state["loss_scale"].device)
        torch._amp_update_scale_(state["loss_scale"], state["loss_scale_growth"], flag,
                                 ls.growth_factor, ls.backoff_factor, ls.growth_interval)
