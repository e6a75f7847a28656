"""A node's training state: its stages, the replica it holds, and their flat form.

One place for what a node holds and how it is turned into one tensor and back (state moves
between nodes, to shadows and from checkpoints in that form), so that every path that moves
state agrees on its layout: parameters first, then the optimizer's tensors in their order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from spotpipe.config import Config
from spotpipe.plan import Layout
from spotpipe.model import LayeredModel, build_stage
from spotpipe.model.template import swap_tensors
from spotpipe.model.ties import cross_stage_tied, norm_param_names
from spotpipe.runtime.digest import optimizer_tensors
from spotpipe.runtime.optim import (build_optimizer, follow_parameters,
                                     materialise_optimizer_state)
from spotpipe.runtime.replica import ReplicaApplier, ReplicaStage


@dataclass
class StageState:
    """An owned stage's module and optimizer, plus what the global-norm clip needs."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    # parameters counted in the global norm, in the unpartitioned model's order (a tied
    # parameter is counted only on the stage of its first occurrence)
    norm_params: list[nn.Parameter]
    tied_params: list[nn.Parameter] = field(default_factory=list)  # summed across stages

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


@dataclass
class Holding:
    """The replica this node holds, and the node that owns (and feeds) that stage."""

    replica: ReplicaStage
    applier: ReplicaApplier
    owner: str


def build_stage_state(model: LayeredModel, partition: list[tuple[int, int]], stage: int,
                      cfg: Config, device: torch.device) -> StageState:
    """Stage `stage` of `model` with a fresh optimizer and its share of the global norm."""
    start, end = partition[stage]
    module = build_stage(model, start, end).to(device)
    return stage_state_from(model, partition, stage, module, build_optimizer(
        module.parameters(), cfg))


def stage_state_from(model: LayeredModel, partition: list[tuple[int, int]], stage: int,
                     module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StageState:
    """Wrap an existing module and optimizer (e.g. a promoted replica) as an owned stage."""
    counted = set(norm_param_names(model, partition)[stage])
    named = dict(module.named_parameters())
    norm_params = [named[n] for n in named if n in counted]
    tied_names = cross_stage_tied(model, partition)
    # in the order of the model's tie pairs, so both ends list their halves alike
    tied = [named[n] for a, b in model.tied for n in (a, b) if n in tied_names and n in named]
    return StageState(stage, module, optimizer, norm_params, tied)


# the one dtype of `flatten`'s buffer: its receivers allocate it so (`shadow_link`), and a
# stage's weights and optimizer state are fp32 whatever the compute precision
FLAT_DTYPE = torch.float32


def flatten(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The stage's parameters, then its optimizer's tensors, as one float32 buffer. What
    float32 cannot hold exactly (a float64 or bf16 tensor, a counter past 2^24) is refused:
    cast, it would arrive as other values than the sender's, and nothing would say so."""
    params = list(module.parameters())
    materialise_optimizer_state(module, optimizer)
    state = optimizer_tensors(optimizer)
    if any(t.dtype != FLAT_DTYPE for t in params + state):
        _check_exact(module, optimizer)
    return torch.cat([t.detach().reshape(-1).to(FLAT_DTYPE) for t in params + state])


def _check_exact(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError naming the first tensor whose values `FLAT_DTYPE` would change."""
    names = {id(p): n for n, p in module.named_parameters()}
    labelled = [(f"parameter {n}", p) for n, p in module.named_parameters()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            labelled += [(f"optimizer state {k!r} of {names.get(id(p), '?')}", state[k])
                         for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    for label, t in labelled:
        if t.dtype == FLAT_DTYPE:
            continue
        if t.is_floating_point() or t.is_complex() or not torch.equal(
                t.detach().to(FLAT_DTYPE).to(t.dtype), t.detach()):
            raise ValueError(f"{label} ({t.dtype}) does not travel exactly as {FLAT_DTYPE}, "
                             "the one dtype of a stage's state on its way to another process")


def unflatten(flat: torch.Tensor, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `flatten` produced on another node into a module and optimizer of the
    same structure (the optimizer state is created first, so the layouts agree)."""
    materialise_optimizer_state(module, optimizer)
    targets = [p for p in module.parameters()] + optimizer_tensors(optimizer)
    offset = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t).to(t.dtype))
            offset += n
    if offset != flat.numel():
        raise RuntimeError(f"state message of {flat.numel()} values, expected {offset}")


@dataclass
class NodeState:
    """Everything a node holds between generations: where it is in the layout, the stages it
    owns and the replica it holds. The worker trains on it; `runtime.reshape` changes it as a
    Decision says."""

    cfg: Config
    model: LayeredModel
    device: torch.device
    node: str
    layout: "Layout"
    partition: list[tuple[int, int]]
    stages: dict[int, StageState] = field(default_factory=dict)
    holding: Holding | None = None
    generation: int = 0
    start_iteration: int = 0

    @property
    def replica_device(self) -> torch.device:
        return self.device if self.cfg.replica.device == "device" else torch.device("cpu")

    @property
    def pipeline(self) -> int:
        return self.layout.stages_of(self.node)[0][0]

    def build_stage(self, stage: int, device: torch.device | None = None) -> tuple[
            nn.Module, torch.optim.Optimizer]:
        """A fresh copy of stage `stage` of the current partition: stages share no Parameter
        with the node's model or with each other. Layers the model no longer holds values
        for (`release_unheld`) come as NaN: every caller loads the stage's state next (from
        a peer, a shadow or a checkpoint), and one that did not would fail loudly."""
        import copy

        start, end = self.partition[stage]
        module = copy.deepcopy(build_stage(self.model, start, end))
        target = device or self.device
        _swap_parameters([module], lambda p: p.is_meta, lambda p: torch.full(
            p.shape, float("nan"), dtype=p.dtype, device=target) if p.is_floating_point()
            else torch.zeros(p.shape, dtype=p.dtype, device=target))
        module = module.to(target)
        return module, build_optimizer(module.parameters(), self.cfg)

    def release_unheld(self) -> None:
        """Let go of the values of every layer this node does not own: the node's model is
        only the template that later stages are built from (shapes, buffers, names), and
        those get their state from elsewhere, so a worker's memory after start is its
        stages, its replica and the model's buffers, not the whole model. (The owned stages
        share their layers with the model, so those stay.)"""
        owned = {id(p) for x in self.stages.values() for p in x.module.parameters()}
        _swap_parameters(self.model.layers, lambda p: id(p) not in owned and not p.is_meta,
                         lambda p: torch.empty_like(p, device="meta"))

    def own(self, stage: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.stages[stage] = stage_state_from(self.model, self.partition, stage, module,
                                              optimizer)

    def hold(self, index: int, module: nn.Module, optimizer: torch.optim.Optimizer,
             resume: int, digests: object = None) -> None:
        """Hold the replica of stage `index` (exact through resume - 1), fed by its owner."""
        self.drop_replica()
        replica = ReplicaStage(index, module.to(self.replica_device),
                               follow_parameters(optimizer), self.replica_device)
        applier = ReplicaApplier(replica, self.cfg, digests)  # type: ignore[arg-type]
        applier.start_at(resume)
        self.holding = Holding(replica, applier, self.layout.owner(self.pipeline, index))

    def held_replica_index(self) -> int | None:
        """The stage whose replica this node holds (None: none), as its report says it."""
        return self.holding.replica.index if self.holding is not None else None

    def drop_replica(self) -> None:
        if self.holding is not None:
            self.holding.applier.close()
            self.holding = None

    def drop_all(self) -> None:
        """Standby: the plan that places the node again sends it whatever it will run."""
        self.drop_replica()
        self.stages = {}


def _swap_parameters(modules: Iterable[nn.Module], which: Callable[[nn.Parameter], bool],
                     make: Callable[[nn.Parameter], torch.Tensor]) -> None:
    """Replace each parameter of `modules` that `which(p)` selects by a new one holding
    `make(p)`, the same new one wherever the old was shared (tied weights stay tied)."""
    swap_tensors(modules, "_parameters", which,  # type: ignore[arg-type]
                 lambda p: nn.Parameter(make(p), requires_grad=p.requires_grad))
