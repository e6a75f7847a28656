"""What the worker calls at its boundaries, given to it by its entry point.

The runtime executes; what happens to state at the end of an iteration (a checkpoint scheme)
and where a resumed run's state comes from (the durable tier) belong to `spotpipe.checkpoint`,
which sits above the runtime. The entry point (`spotpipe.cli.worker`) builds them and hands
them in as these small interfaces, so the runtime never imports the checkpoint package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

StagePair = tuple[nn.Module, torch.optim.Optimizer]


@dataclass
class Boundary:
    """The end of one iteration on one node: its stepped stages and its generation."""

    iteration: int
    stages: dict[int, StagePair]  # the ones this node writes
    comm: Any  # spotpipe.runtime.comm.Comm of the current generation
    layout: Any  # spotpipe.plan.Layout of the current generation
    # the layer ranges of the generation's stages: what a checkpoint of this iteration is cut
    # by (a re-partition may come before the coordinator hears of every stage written)
    partition: tuple[tuple[int, int], ...]


class BoundaryHook(Protocol):
    """A checkpoint scheme, as the worker sees it."""

    def after_iteration(self, boundary: Boundary) -> None: ...

    def close(self) -> None: ...


class NoHook:
    def after_iteration(self, boundary: Boundary) -> None:
        return None

    def close(self) -> None:
        return None


# Loads the given (module, optimizer) pairs from the checkpoint at `path`; returns the
# iteration to resume at. Raises with a message naming the problem when it cannot.
Restore = Callable[[Path, list[StagePair]], int]


# Sends one stage's final parameters, written at `path`, to where the job's result is kept
# (under `spotpipe agent`: the coordinating agent's --out, through the store). Called by the
# stage's writer while its beats still say "finishing", so that a long send is judged as the
# node is; raises with the reason when the stage did not go.
SendFinal = Callable[[int, Path], None]
