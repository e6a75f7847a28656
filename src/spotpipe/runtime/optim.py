"""Optimizer and LR schedule from the config.

One builder serves the workers, the single-process reference loop and (later) replicas and
shadows: an exact replica needs the identical optimizer class, hyperparameters and schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from spotpipe import job
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


def optimizer_kernel(cfg: Config) -> str:
    """`optimizer.kernel` decided: "portable" where a CPU copy (a shadow, a replica with
    `replica.device: cpu`) applies the updates of a stage trained on GPUs, "fused" elsewhere.
    Every process decides alike: the backend is settled at launch and is in the config."""
    kernel = cfg.optimizer.kernel
    if kernel != "auto":
        return kernel
    cpu_copies = cfg.shadow.enabled or (cfg.redundancy != "none" and cfg.replica.device == "cpu")
    return "portable" if cpu_copies and job.resolve_backend(cfg) == "nccl" else "fused"


def _optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if optimizer_kernel(cfg) == "portable":
        if o.name == "adamw":
            return PortableAdamW(params, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps,
                                 weight_decay=o.weight_decay)
        return PortableSGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "adamw":
        # fused: one kernel that updates each tensor on its own, so partitioned and
        # unpartitioned steps match bitwise whatever the grouping of tensors into stages (as
        # the per-tensor loop, foreach=False, does); on CPU it is 4-5x faster than that loop,
        # which matters to the CPU shadows that apply every iteration's step beside training
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 weight_decay=o.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                           foreach=False)


class PortableAdamW(torch.optim.AdamW):
    """AdamW whose step gives the same bits on the CPU and on a GPU.

    torch's fused and per-tensor AdamW gave other bits on an H200 than on the CPU from the
    same state and gradients (`spotpipe bench gpu`): their kernels contract multiplies and
    adds into fused multiply-adds differently, and CUDA's float32 square root and division
    are not the CPU's. A CPU shadow or replica applying a GPU owner's gradients with them
    drifts from its owner. Here every operation is one that IEEE 754 rounds once, each its own
    kernel: float32 multiplies, adds and divisions, and a square root that is correctly
    rounded on every device (`rounded_sqrt`); every constant is computed in Python's double.
    It keeps AdamW's state layout (step on the CPU, exp_avg, exp_avg_sq), so
    checkpoints, replicas and shadows read it as AdamW's; the cost is a dozen passes over the
    state where the fused kernel makes one."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False, fused=False)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            decay = 1.0 - lr * group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                root_scale = 1.0 / math.sqrt(1.0 - beta2 ** t)
                step_size = lr / (1.0 - beta1 ** t)
                for w, g, m, v in _pieces(p, p.grad, state["exp_avg"], state["exp_avg_sq"]):
                    w.mul_(decay)
                    m.mul_(beta1).add_(g * (1.0 - beta1))
                    v.mul_(beta2).add_((g * g).mul_(1.0 - beta2))
                    denom = rounded_sqrt(v).mul_(root_scale).add_(eps)
                    w.sub_(torch.div(m, denom).mul_(step_size))
        return loss


# elements per piece: on the CPU a piece's dozen temporaries stay in a core's cache; on a GPU
# a piece is large enough that one kernel per operation fills the device, and bounds the
# temporaries of the square root's float64 correction (about 60 bytes an element) under 1 GiB
PIECE = {"cpu": 1 << 16}
DEVICE_PIECE = 1 << 24


def _pieces(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Equal-shaped tensors in matching flat pieces. Each operation of the portable update is
    elementwise, so the pieces change no bits. On the CPU they keep its temporaries in the
    cache (a dozen fresh tensors of the parameter's size, each faulting its pages in, made
    the update 80x slower than the fused kernel on GPT-2 small); on a GPU they bound the
    temporaries, which for a large embedding would otherwise be tens of GiB."""
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    size = PIECE.get(tensors[0].device.type, DEVICE_PIECE)
    flat = [t.view(-1) for t in tensors]
    for start in range(0, flat[0].numel(), size):
        yield tuple(f[start:start + size] for f in flat)


def rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float32 tensor, on any device.

    torch's CPU square root is not (it goes through MKL's vector math: 179392 of a million
    float32 results differ from numpy's here). On the CPU, numpy's is: the processor's own
    instruction (sqrtps), which IEEE 754 rounds correctly. Elsewhere `corrected_sqrt`, which
    relies on nothing but correctly rounded float64 products (0 of a million elements
    differed between an H200 and the CPU)."""
    if x.device.type != "cpu":
        return corrected_sqrt(x)
    out = torch.empty_like(x)
    np.sqrt(x.numpy(), out=out.numpy())
    return out


def corrected_sqrt(x: torch.Tensor) -> torch.Tensor:
    """A float64 root rounded to float32, which is within one step of the right answer,
    moved to the neighbour whose square brackets x: a test that float64 makes exactly (the
    midpoints between float32 neighbours have 25 significant bits, their squares 50). The
    neighbours of a positive float are its bit pattern plus and minus one."""
    r = x.double().sqrt().to(torch.float32)
    bits = r.view(torch.int32)
    down, up = (bits - 1).view(torch.float32), (bits + 1).view(torch.float32)
    wide, exact = x.double(), r.double()
    low = (exact + down.double()).mul_(0.5)
    high = (exact + up.double()).mul_(0.5)
    r = torch.where(wide < low.mul_(low), down, r)
    return torch.where(wide > high.mul_(high), up, r)


class PortableSGD(torch.optim.SGD):
    """SGD (momentum, weight decay, no dampening) in operations rounded once each, as
    `PortableAdamW`, and in its pieces: torch's kernels add `alpha * b` with a fused
    multiply-add on the GPU."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, momentum: float,
                 weight_decay: float) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         foreach=False)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                first = momentum and state.get("momentum_buffer") is None
                if first:  # torch's first step takes the direction itself as the buffer
                    state["momentum_buffer"] = torch.empty_like(p)
                buf = state.get("momentum_buffer", p)  # (p: unused without momentum)
                for w, g, b in _pieces(p, p.grad, buf):
                    d = g + w * decay if decay else g
                    if momentum:
                        if first:
                            b.copy_(d)
                        else:
                            b.mul_(momentum).add_(d)
                        d = b
                    w.sub_(d * lr)
        return loss


def set_lr(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float:
    """Set the LR for iteration `step` explicitly, so any process can resume at any step."""
    lr = cfg.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def state_device(group: dict[str, Any], key: str, p: torch.Tensor) -> torch.device:
    """Where torch's optimizer keeps a state tensor of `p`: beside it, except AdamW's step
    count, which stays on the CPU unless the group is fused or capturable (its kernel then
    reads it on the device; torch's `_process_value_according_to_param_policy`)."""
    if key == "step" and not (group.get("fused") or group.get("capturable")):
        return torch.device("cpu")
    return p.device


def follow_parameters(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Move the optimizer's state to where `state_device` puts it, after its parameters moved
    (`module.to` moves parameters, not the state the optimizer holds for them): a replica
    kept on the CPU for a GPU stage is promoted onto the GPU, a stage received on the GPU is
    held as a CPU replica. Left behind, the next step fails, or each step waits on the device
    for a step count it reads."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor):
                    device = state_device(group, key, p)
                    if value.device != device:
                        state[key] = value.to(device)
    return optimizer


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
