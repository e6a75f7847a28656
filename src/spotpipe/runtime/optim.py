"""Optimizer and LR schedule from the config.

One builder serves the workers, the single-process reference loop and (later) replicas and
shadows: an exact replica needs the identical optimizer class, hyperparameters and schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from spotpipe.config import Config
from spotpipe.runtime.precision import init_loss_scale


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    """The configured optimizer; in fp16, with the loss scaler's state in every parameter's
    state (`spotpipe.runtime.precision`)."""
    optimizer = _optimizer(list(params), cfg)
    if cfg.precision == "fp16":
        materialise_optimizer_state(torch.nn.Module(), optimizer)
        init_loss_scale(optimizer, cfg)
    return optimizer


def _optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "adamw":
        # fused: one kernel that updates each tensor on its own, so partitioned and
        # unpartitioned steps match bitwise whatever the grouping of tensors into stages (as
        # the per-tensor loop, foreach=False, does); on CPU it is 4-5x faster than that loop,
        # which matters to the CPU shadows that apply every iteration's step beside training
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 weight_decay=o.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                           foreach=False)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of optimizer.lr at `step` (0-based): warmup, then constant/cosine/linear."""
    s = cfg.lr_schedule
    total = cfg.iterations
    if s.warmup_iters and step < s.warmup_iters:
        return (step + 1) / s.warmup_iters
    if s.kind == "constant":
        return 1.0
    floor = s.min_lr / cfg.optimizer.lr
    span = max(1, total - s.warmup_iters)
    progress = min(1.0, (step - s.warmup_iters) / span)
    if s.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def set_lr(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float:
    """Set the LR for iteration `step` explicitly, so any process can resume at any step."""
    lr = cfg.optimizer.lr * lr_factor(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def materialise_optimizer_state(module: torch.nn.Module,
                                optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give every parameter its optimizer state (zeros), so loading has tensors to fill.

    AdamW's step count sits on the parameter's device when the optimizer is fused (its kernel
    reads it there), on the CPU otherwise, as the optimizer itself would place it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
                on_device = group.get("fused") or group.get("capturable")
                state.setdefault("step", torch.zeros((), dtype=torch.float32,
                                                     device=p.device if on_device else "cpu"))
                state.setdefault("exp_avg", torch.zeros_like(p))
                state.setdefault("exp_avg_sq", torch.zeros_like(p))
            elif group.get("momentum", 0):
                state.setdefault("momentum_buffer", torch.zeros_like(p))
    return optimizer
