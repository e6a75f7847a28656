"""fp16's dynamic loss scaler, and the layer precision the runtime runs with.

The scaler is ``torch.amp.GradScaler``'s arithmetic (the same kernels) with its state kept in
the optimizer state of every parameter (``loss_scale``, ``loss_scale_growth``). That is where
everything that moves a stage already looks: replicas (digests compare it), shadows, layer
moves of a re-partition and durable checkpoints carry it without knowing about it. Every copy
holds the same value, because every node takes the same skip decision (from the gathered
found-inf flags, like the gradient norm) and applies the same update. How layers run in a
precision is `spotpipe.model.precision`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from spotpipe.config import Config
from spotpipe.model.precision import DTYPES, Draws, Precision, loss_of, run_layers

__all__ = ["DTYPES", "Draws", "Precision", "SCALER_STATE", "current_scale", "init_loss_scale",
           "loss_of", "run_layers", "unscale", "update_scale"]


SCALER_STATE = ("loss_scale", "loss_scale_growth")  # its names in a parameter's state


def init_loss_scale(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    """Give every parameter the scaler's initial state. The optimizer's own state must exist
    already (`optim.build_optimizer` creates it): torch's optimizers initialise a parameter's
    state only when they find it empty."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            scale, growth = SCALER_STATE
            state.setdefault(scale, torch.full((), cfg.loss_scale.init, dtype=torch.float32,
                                               device=p.device))
            state.setdefault(growth, torch.zeros((), dtype=torch.int32, device=p.device))


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
