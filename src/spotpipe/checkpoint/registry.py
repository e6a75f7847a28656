"""Checkpoint schemes by their config name (`checkpoint.scheme`), and the one that a worker runs.

Separate from `schemes` so that schemes defined in other modules (gemini's peer copies) can
build on `schemes` without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable

from spotpipe.checkpoint.peer import GeminiScheme
from spotpipe.checkpoint.schemes import (CheckFreqScheme, DcpAsyncScheme, DurableScheme, Scheme,
                                         SchemeContext, TorchSaveScheme)
from spotpipe.config import CHECKPOINT_SCHEMES

# config name -> constructor; CHECKPOINT_SCHEMES in spotpipe.config lists the same names (the
# config is read before torch is imported). Adding a scheme is one entry in each.
SCHEMES: dict[str, Callable[[SchemeContext], Scheme]] = {
    "none": Scheme,
    "durable": DurableScheme,
    "dcp_async": DcpAsyncScheme,
    "torch_save": TorchSaveScheme,
    "checkfreq": CheckFreqScheme,
    "gemini": GeminiScheme,
}
assert set(SCHEMES) == set(CHECKPOINT_SCHEMES), "schemes and config disagree"


def build(ctx: SchemeContext) -> Scheme:
    """The scheme `ctx.cfg.checkpoint.scheme` names (`none` when nothing is checkpointed, and
    for the durable tier when shadows write it)."""
    c = ctx.cfg.checkpoint
    name = c.scheme if c.every else "none"
    if ctx.cfg.shadow.enabled and name in ("durable", "dcp_async"):
        name = "none"  # the CPU shadows write the durable tier (spotpipe.checkpoint.shadow)
    return SCHEMES[name](ctx)
