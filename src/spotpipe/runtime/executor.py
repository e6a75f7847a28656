"""Executes one stage's instruction stream for one iteration.

The executor is deliberately dumb: it does what the stream from `spotpipe.schedule` says, in
order, and owns only the per-iteration buffers. Which stream to run, on which layout, and what
to do when a peer disappears are decided elsewhere (plan, worker), so that a takeover can run a
merged stream through this same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from spotpipe.runtime import grads as gradlib
from spotpipe.runtime.comm import Groups, PeerLink
from spotpipe.runtime.digest import DigestLog, stage_digest, tensors_digest
from spotpipe.runtime.replica import GradientReplication, ReplicaStage
from spotpipe.schedule import Instr, Op

TAG_ACT, TAG_GRAD = 0, 1


@dataclass
class StageState:
    """A stage's module and optimizer, plus what the global-norm clip needs to know."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    # parameters counted in the global norm, in the unpartitioned model's order (a tied
    # parameter is counted only on the stage of its first occurrence)
    norm_params: list[nn.Parameter]
    tied_params: list[nn.Parameter] = field(default_factory=list)  # gradients summed across stages

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


@dataclass
class Microbatches:
    """Inputs of the first stage and targets of the last, per local micro-batch."""

    inputs: Sequence[torch.Tensor | None]
    targets: Sequence[torch.Tensor | None]


@dataclass
class Redundancy:
    """This node's replica of its successor stage and how it is kept and used."""

    mode: str  # "lazy" or "eager"
    replica: ReplicaStage
    replication: GradientReplication
    offload_frc: bool = False


@dataclass
class IterationResult:
    loss_sum: torch.Tensor | None  # sum of this pipeline's scaled micro-batch losses (last stage)
    grad_norm: float


class Executor:
    def __init__(self, *, state: StageState, num_stages: int, rank_of_stage: Callable[[int], int],
                 link: PeerLink, groups: Groups, num_pipelines: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 loss_scale_div: int, grad_clip: float, norm_counts: list[int],
                 redundancy: Redundancy | None = None, digests: DigestLog | None = None) -> None:
        self.state = state
        self.num_stages = num_stages
        self.rank_of_stage = rank_of_stage
        self.link = link
        self.groups = groups
        self.num_pipelines = num_pipelines
        self.loss_fn = loss_fn
        self.loss_scale_div = loss_scale_div  # M * D: each micro-batch loss is a share of the mean
        self.grad_clip = grad_clip
        self.norm_counts = norm_counts
        self.redundancy = redundancy
        self.digests = digests
        # what a takeover of the successor needs, kept until the next iteration starts:
        # this node's outputs (the successor's inputs) and, in eager mode, the FRC outputs
        self.kept_outputs: dict[int, torch.Tensor] = {}
        self.frc_outputs: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ one iteration

    def run(self, stream: Sequence[Instr], batches: Microbatches,
            iteration: int = 0) -> IterationResult:
        s = self.state.index
        last = s == self.num_stages - 1
        red = self.redundancy
        self.kept_outputs, self.frc_outputs = {}, {}
        replica_current = False
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        out_grads: dict[int, torch.Tensor] = {}
        loss_sum: torch.Tensor | None = None
        grad_norm = 0.0
        for ins in stream:
            op, mb = ins.op, ins.mb
            if op == Op.RECV_ACT:
                inputs[mb] = self.link.recv(self.rank_of_stage(ins.peer), TAG_ACT).requires_grad_()
            elif op == Op.FORWARD:
                x = inputs[mb] if s > 0 else batches.inputs[mb]
                y = self.state.module(x)
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=s, mb=mb, role="output",
                                       digest=tensors_digest([y]))
                if red is not None and not last:
                    self.kept_outputs[mb] = y.detach()
                if last:
                    y = self.loss_fn(y, batches.targets[mb]) / self.loss_scale_div
                    detached = y.detach()
                    loss_sum = detached if loss_sum is None else loss_sum + detached
                outputs[mb] = y
            elif op == Op.SEND_ACT:
                self.link.send(outputs[mb], self.rank_of_stage(ins.peer), TAG_ACT)
            elif op == Op.RECV_GRAD:
                out_grads[mb] = self.link.recv(self.rank_of_stage(ins.peer), TAG_GRAD)
            elif op == Op.BACKWARD:
                y = outputs.pop(mb)
                if last:
                    y.backward()
                else:
                    torch.autograd.backward(y, out_grads.pop(mb))
            elif op == Op.SEND_GRAD:
                x = inputs.pop(mb)
                self.link.send(x.grad, self.rank_of_stage(ins.peer), TAG_GRAD)
            elif op == Op.FRC_FORWARD:
                assert red is not None and ins.stage == red.replica.index
                if not replica_current:  # FRC must see the replica as of the last iteration
                    red.replication.wait_applied(iteration - 1)
                    replica_current = True
                x = batches.inputs[mb] if ins.stage == 0 else self.kept_outputs[mb]
                with torch.no_grad():
                    out = red.replica.module(x.to(red.replica.device))
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=ins.stage, mb=mb, role="frc",
                                       digest=tensors_digest([out]))
                self.frc_outputs[mb] = out.to("cpu") if red.offload_frc else out
            elif op == Op.ALL_REDUCE:
                self.link.wait_sends()
                grad_norm = self.reduce_gradients()
                if red is not None:
                    red.replication.post(iteration)
            elif op == Op.OPTIMIZER_STEP:
                self.state.optimizer.step()
                self.state.optimizer.zero_grad(set_to_none=True)
                if red is not None:
                    red.replication.post_state(iteration)
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=s, role="owner",
                                       **stage_digest(self.state.module, self.state.optimizer))
            else:
                raise NotImplementedError(f"instruction {ins} is not executed by this runtime")
        return IterationResult(loss_sum=loss_sum, grad_norm=grad_norm)

    # ------------------------------------------------------------------ gradient reduction

    def reduce_gradients(self) -> float:
        """Data-parallel sum, tied-weight sum, then clipping by the global norm.

        The loss was already divided by M * D, so a plain sum over pipelines gives the mean.
        With one pipeline no reduction runs at all, which keeps D = 1 bit-identical to the
        unpartitioned model.
        """
        st = self.state
        params = st.params
        # a parameter the loss does not reach keeps grad None, as in a plain loop (the optimizer
        # then skips it); which ones is the same on every pipeline, so the buffers line up
        grads = [p.grad for p in params if p.grad is not None]
        if self.num_pipelines > 1 and grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.groups.data_parallel)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        if st.tied_params and self.groups.tied is not None:
            for p in st.tied_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.groups.tied)
        norm_grads = [p.grad for p in st.norm_params]
        like = params[0] if params else torch.zeros(1)
        mine = gradlib.local_norms(norm_grads, like)
        if self.num_stages > 1:
            everything = gradlib.gather_norms(
                mine, self.norm_counts, st.index,
                lambda out, t: dist.all_gather(out, t, group=self.groups.pipeline))
        else:
            everything = mine
        total = gradlib.total_norm(everything)
        if self.grad_clip > 0:
            gradlib.clip_(grads, total, self.grad_clip)
        return float(total)
