"""Global gradient-norm clipping, computed exactly as torch.nn.utils.clip_grad_norm_ does.

The norms of every parameter of the whole model are gathered in the unpartitioned model's
parameter order and reduced with the same kernels, so clipping in a pipeline gives the same
bits as clipping the unpartitioned model (a custom sum of squares across stages would not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def local_norms(grads: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Per-parameter L2 norms (zeros for parameters without a gradient)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float32, device=like.device)
    present = [g for g in grads if g is not None]
    # torch._foreach_norm is the kernel clip_grad_norm_ itself uses on CPU and CUDA.
    norms = iter(torch._foreach_norm(present, 2.0)) if present else iter(())
    zero = torch.zeros((), dtype=torch.float32, device=like.device)
    return torch.stack([next(norms) if g is not None else zero for g in grads])


def total_norm(all_norms: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(all_norms, 2.0)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ computes it."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clipped(grads: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """Gradients times `scale` (`clip_scale`), like clip_grad_norm_ (the same kernel, out of
    place): `grads` stay as they were, so that a reduction cut short by a failure can be
    redone from them. A shadow applies the same scale to the same bits
    (`replica.apply_flat_gradient`)."""
    if not grads:
        return []
    return list(torch._foreach_mul(list(grads), scale.to(grads[0].device)))


def gather_norms(mine: torch.Tensor, counts: Sequence[int], my_index: int,
                 all_gather: Callable[[list[torch.Tensor], torch.Tensor], None]) -> torch.Tensor:
    """Concatenate per-stage norm vectors in stage order; `counts[i]` is stage i's length.

    Vectors are padded to the longest so one fixed-size all_gather suffices.
    """
    width = max(counts) if counts else 0
    padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
    padded[: counts[my_index]] = mine
    parts = [torch.empty_like(padded) for _ in counts]
    all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])
