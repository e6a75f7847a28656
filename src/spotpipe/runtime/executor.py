"""Executes one node's instruction stream for one iteration.

The executor does what the stream from `spotpipe.schedule` says, in order, for every stage the
node owns (one normally, two after a takeover), and owns only the per-iteration buffers. Which
stream to run, on which layout, and what to do when a peer disappears are decided elsewhere
(plan, worker): a failure surfaces here as a `PeerFailure` from any wait, and the iteration is
simply abandoned.

Each iteration ends with a commit: the node confirms it holds the gradients its replica (and
its shadows) need, then the all-gather of the gradient norms, which every node takes part in
anyway and which also carries preemption notices, marks the iteration committed everywhere.
Optimizer steps happen only after it, so after any failure the survivors either all complete
the iteration or all replay it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from spotpipe.config import Config
from spotpipe.plan.memory import replica_link_slots
from spotpipe.runtime import grads as gradlib
from spotpipe.runtime.comm import ACT, GRAD, REPLICA, TIED, Comm, tag
from spotpipe.runtime.digest import DigestLog, stage_digest, tensors_digest
from spotpipe.runtime.local_link import Lease
from spotpipe.runtime.optim import set_lr
from spotpipe.runtime import precision as amp
from spotpipe.runtime.replica import (flatten_grads, grad_parts,
                                      flatten_state, mark_skipped)
from spotpipe.runtime.shadow_link import ShadowWriter
from spotpipe.runtime.state import Holding, StageState  # noqa: F401 (re-exported)
from spotpipe.schedule import Instr, Op
from spotpipe.schedule.replay import KEPT_OPS, done_key


@dataclass
class Microbatches:
    """First-stage inputs and last-stage targets of this pipeline, per micro-batch."""

    inputs: Sequence[torch.Tensor | None]
    targets: Sequence[torch.Tensor | None]
    indices: Sequence[Sequence[int]] = ()
    first: int = 0  # the global index of micro-batch 0 (pipeline * M): its draws' key


@dataclass
class Wiring:
    """Who is where in this generation, from this node's point of view."""

    pipeline: int
    num_stages: int
    node_of_stage: dict[int, str]  # stages of this node's pipeline -> owner
    replica_holder: dict[int, str]  # owned stage -> node holding its replica (if any)
    norm_segments: list[tuple[int, int, int]]  # per stage in order: (rank, offset, count)
    norm_width: int
    tied_partner: dict[int, str]  # owned first/last stage -> owner of the other one


@dataclass
class InFlight:
    """The iteration in flight on this node: its buffers, and which work is done.

    Kept across a failure so that a takeover replays only the lost node's share: survivors
    continue from here, the heir sends FRC outputs and runs BRC, the successor re-sends the
    input gradients it kept (`sent_grads`)."""

    iteration: int
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    out_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # stages whose gradients accumulate where they will be sent (`_accumulate_where_sent`)
    accumulating: set[int] = field(default_factory=set)
    local: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    kept_outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    frc_outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    sent_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    microbatches: int = 0  # this pipeline's, in this iteration
    done: set[tuple[str, int, int]] = field(default_factory=set)
    # each owned parameter's gradient before the reduction (which replaces, never mutates,
    # them): a reduction cut short by a failure is redone from these
    local_grads: dict[int, list[torch.Tensor | None]] | None = None

    def activation(self, stage: int, mb: int) -> torch.Tensor:
        """Stage's output for mb: live, kept after its backward, or from FRC (a takeover)."""
        for kept in (self.outputs, self.kept_outputs, self.frc_outputs):
            if (stage, mb) in kept:
                return kept[(stage, mb)]
        raise KeyError(f"no output of stage {stage} for micro-batch {mb} to send")

    def keep_local_gradients(self, stages: dict[int, StageState]) -> None:
        if self.local_grads is None:
            self.local_grads = {s: [p.grad for p in st.params] for s, st in stages.items()}
        else:
            self.restore_local_gradients(stages)

    def restore_local_gradients(self, stages: dict[int, StageState]) -> None:
        for s, grads in (self.local_grads or {}).items():
            if s in stages:
                for p, g in zip(stages[s].params, grads):
                    p.grad = g

    def kept_bytes(self) -> int:
        """Memory held for a takeover: FRC outputs, kept outputs and sent gradients."""
        return sum(t.numel() * t.element_size() for kept in
                   (self.frc_outputs, self.kept_outputs, self.sent_grads) for t in kept.values())

    def done_list(self) -> list[list[Any]]:
        return [list(k) for k in sorted(self.done)]

    def whole_loss(self, last: int) -> float | None:
        """This pipeline's loss of the iteration once every micro-batch has gone through the
        last stage (`last`) here (NaN when not finite); None before that: a part of it would
        be a wrong loss, not a smaller one."""
        if self.loss_sum is None or any(
                (Op.FORWARD.value, last, mb) not in self.done for mb in range(self.microbatches)):
            return None
        return float(self.loss_sum)


@dataclass
class IterationResult:
    loss_sum: torch.Tensor | None  # this pipeline's scaled micro-batch losses (last stage)
    grad_norm: float
    leave_requested: bool
    skipped_stage: int | None = None  # training.nonfinite: skip: the step was skipped


class NonFiniteStop(RuntimeError):
    """training.nonfinite: stop: the loss or the global gradient norm is not finite. Raised
    on every node at the same iteration (the norm is all-gathered), before its commit, so no
    step of it is applied anywhere and the newest checkpoint stays the newest."""

    def __init__(self, iteration: int, stage: int) -> None:
        super().__init__(f"non-finite loss or gradient norm at iteration {iteration} (stage "
                         f"{stage}); training.nonfinite: stop ended the job before that "
                         "iteration's step")
        self.iteration, self.stage = iteration, stage


Hook = Callable[[str, int], None]


class Executor:
    def __init__(self, *, cfg: Config, me: str, stages: dict[int, StageState], wiring: Wiring,
                 comm: Comm, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 loss_scale_div: int, holding: Holding | None = None,
                 digests: DigestLog | None = None, sample_log: TextIO | None = None,
                 hook: Hook | None = None, shadow: ShadowWriter | None = None) -> None:
        self.cfg = cfg
        self.me = me
        self.stages = stages
        self.w = wiring
        self.comm = comm
        self.loss_fn = loss_fn
        self.loss_scale_div = loss_scale_div  # M * D: each micro-batch loss is a share
        self.holding = holding
        self.digests = digests
        self.sample_log = sample_log
        self.hook = hook or (lambda phase, it: None)
        self.shadow = shadow  # links to the CPU shadows of the stages this node writes
        self.generation = comm.generation
        # the iteration in flight: what a takeover's rest of the iteration continues from
        self.flight: InFlight | None = None
        self.kept_bytes = 0  # of the last iteration (see InFlight.kept_bytes)
        # the last reduction's clipping scale (None: no clipping), which the shadows apply
        self.clip_scale: torch.Tensor | None = None
        # the newest committed iteration's scale, reported at recovery (a new shadow writer's
        # HELLO brings it)
        self.committed_clip_scale: float | None = None
        # and its gradient norm (None: not gathered here, or not finite), reported as well
        self.committed_grad_norm: float | None = None
        self.current: Sequence[Instr] = ()  # the stream being run (a rest after a takeover)
        # progress, read by the heartbeat thread and reported at recovery
        self.iteration = -1
        self.position = 0
        # when the current instruction began (monotonic), stamped before `position` moves, so
        # that a reader of both never sees a new position with an old stamp (the node's own
        # hang watch, `spotpipe.runtime.stall`)
        self.position_at = time.monotonic()
        self.committed_through = -1
        self.stepped_through = -1
        # the iteration whose norm gather this node completed (the commit's facts: the
        # clipping scale, a skipped step), which `step` can take from a Decision instead
        self.gathered_through = -1
        self.gathered_norm: float | None = None  # that gather's total norm (None: not finite)
        self._replica_recv: Lease | None = None  # the held replica's gradient
        self._flags_gathered: bool | None = None
        self.precision = amp.Precision.of(cfg)
        # fp16: the last reduction found a non-finite gradient somewhere (every node learns it
        # from the same gather): the step is skipped everywhere and the loss scale backs off
        self.skipped = False
        # (iteration, first stage) whose gathered norm was not finite, from the last reduction
        self.nonfinite: tuple[int, int] | None = None

    def _local(self, stage: int) -> bool:
        return self.w.node_of_stage[stage] == self.me

    def _draws(self, iteration: int, batches: Microbatches, mb: int) -> amp.Draws:
        """Micro-batch `mb`'s random draws, the same on every node that runs its layers."""
        return amp.Draws(self.cfg.seed, iteration, batches.first + mb)

    # ------------------------------------------------------------------ one iteration

    def run(self, stream: Sequence[Instr], batches: Microbatches, iteration: int,
            leaving: Callable[[], bool] = lambda: False) -> IterationResult:
        """Run `stream` for `iteration`. If this node already worked on the iteration before a
        failure (`self.flight`, carried into this generation by the worker), `stream` is the
        rest of it (`spotpipe.schedule.replay`) and continues on what was kept."""
        p = self.w.num_stages
        last = p - 1
        self.iteration = iteration
        self.current = stream
        if self.flight is None or self.flight.iteration != iteration:
            self.flight = InFlight(iteration, microbatches=len(batches.inputs))
        f = self.flight
        self._flags_gathered = None
        grad_norm, leave = 0.0, False
        seen: set[str] = set()
        replica_current = False
        keep = self.holding is not None and self.cfg.redundancy != "none"
        salvageable = self.cfg.redundancy != "none"
        for pos, ins in enumerate(stream):
            self.position_at = time.monotonic()
            self.position = pos
            op, s, mb = ins.op, ins.stage, ins.mb
            phase = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BRC_BACKWARD: "backward",
                     Op.ALL_REDUCE: "all-reduce"}.get(op)
            if phase and phase not in seen:
                seen.add(phase)
                self.hook(phase, iteration)
            if op == Op.RECV_ACT:
                x = (f.local.pop(("act", s, mb)) if self._local(ins.peer)
                     else self.comm.recv(self.w.node_of_stage[ins.peer], tag(ACT, ins.peer)))
                f.inputs[(s, mb)] = x.requires_grad_()
            elif op == Op.FORWARD:
                x = f.inputs[(s, mb)] if s > 0 else batches.inputs[mb]
                y = amp.run_layers(self.stages[s].module, x, self.precision,
                                   self._draws(iteration, batches, mb))
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=s, mb=mb, role="output",
                                       digest=tensors_digest([y]))
                if keep and s != last:
                    f.kept_outputs[(s, mb)] = y.detach()
                if s == last:
                    y = amp.loss_of(self.loss_fn, y, batches.targets[mb],
                                    self.precision) / self.loss_scale_div
                    f.loss_sum = y.detach() if f.loss_sum is None else f.loss_sum + y.detach()
                    if self.precision.scaled:
                        y = y * amp.current_scale(self.stages[s].optimizer).to(y.device)
                f.outputs[(s, mb)] = y
            elif op == Op.SEND_ACT:
                y = f.activation(s, mb)
                if self._local(ins.peer):
                    f.local[("act", ins.peer, mb)] = y.detach()
                else:
                    self.comm.send(y, self.w.node_of_stage[ins.peer], tag(ACT, s))
            elif op == Op.RECV_GRAD:
                f.out_grads[(s, mb)] = (f.local.pop(("grad", s, mb)) if self._local(ins.peer)
                                        else self.comm.recv(self.w.node_of_stage[ins.peer],
                                                            tag(GRAD, ins.peer)))
            elif op == Op.BACKWARD:
                y = f.outputs.pop((s, mb))
                if s == last:
                    y.backward()
                else:
                    torch.autograd.backward(y, f.out_grads.pop((s, mb)))
                if s == 0 and s not in f.accumulating:
                    f.accumulating.add(s)
                    self._accumulate_where_sent(s)
            elif op == Op.BRC_BACKWARD:
                # backward redundant computation: the forward again, with autograd, from the
                # kept input (its output already went on from FRC), then the backward
                x = f.inputs[(s, mb)] if s > 0 else batches.inputs[mb]
                torch.autograd.backward(amp.run_layers(self.stages[s].module, x, self.precision,
                                                       self._draws(iteration, batches, mb)),
                                        f.out_grads.pop((s, mb)))
                f.done |= {("forward", s, mb), ("backward", s, mb)}
            elif op == Op.SEND_GRAD:
                x = f.inputs.pop((s, mb), None)
                g = x.grad if x is not None else f.sent_grads[(s, mb)]
                if salvageable:  # the successor re-sends it if this stage's new owner needs it
                    f.sent_grads[(s, mb)] = g
                if self._local(ins.peer):
                    f.local[("grad", ins.peer, mb)] = g
                else:
                    self.comm.send(g, self.w.node_of_stage[ins.peer], tag(GRAD, s))
            elif op == Op.FRC_FORWARD:
                red = self.holding
                assert red is not None and s == red.replica.index
                if not replica_current:  # FRC must see the replica as of the last iteration
                    red.applier.wait_applied(iteration - 1, check=self.comm.abort.check)
                    replica_current = True
                x = batches.inputs[mb] if s == 0 else f.kept_outputs[((s - 1) % p, mb)]
                with torch.no_grad():
                    out = amp.run_layers(red.replica.module, x.to(red.replica.device),
                                         self.precision, self._draws(iteration, batches, mb))
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=s, mb=mb, role="frc",
                                       digest=tensors_digest([out]))
                f.frc_outputs[(s, mb)] = out.to("cpu") if self.cfg.replica.offload_frc else out
            elif op == Op.ALL_REDUCE:
                # the samples are logged before the reduction: with the norm gather as the
                # commit point, a node killed after it would otherwise leave a committed
                # iteration unlogged (a record of an iteration that is rolled back instead is
                # ignored by its generation)
                self._log_samples(iteration, batches, last)
                self.comm.wait_sends()
                if salvageable:
                    f.keep_local_gradients(self.stages)
                loss_bad = f.loss_sum is not None and not bool(torch.isfinite(f.loss_sum).all())
                grad_norm = self.reduce_gradients(leaving(), iteration, loss_bad)
            elif op == Op.OPTIMIZER_STEP:
                if self._skips(iteration) and self.cfg.training.nonfinite == "stop":
                    raise NonFiniteStop(iteration, self.nonfinite[1])
                leave = self._commit(iteration, leaving()) or bool(self._flags_gathered)
                self.hook("optimizer", iteration)
                self.step(iteration)
            else:
                raise NotImplementedError(f"instruction {ins} is not executed by this runtime")
            if op in KEPT_OPS:
                f.done.add(done_key(ins))
        loss_sum = f.loss_sum
        self.kept_bytes = f.kept_bytes()
        self.flight = None
        return IterationResult(loss_sum=loss_sum, grad_norm=grad_norm, leave_requested=leave,
                               skipped_stage=self.nonfinite[1] if self._skips(iteration)
                               else None)

    def _skips(self, iteration: int) -> bool:
        """The reduction of `iteration` found a non-finite norm (the same on every node)."""
        return self.nonfinite is not None and self.nonfinite[0] == iteration

    # ------------------------------------------------------------------ commit and step

    def _commit(self, iteration: int, leaving: bool) -> bool:
        """Every node holds final gradients (and its replica's) for `iteration`: commit.

        The gradient-norm all-gather that every node just took part in already says so: each
        node confirmed its replica's and its shadows' gradients before it, and the leave flags
        rode on it (`_flags_gathered`), so no second collective runs. Only a stream without a
        reduction (nothing gathered) commits with an all-reduce of its own."""
        leave = False  # with the gather as the commit, the caller reads its flags
        if self._flags_gathered is None:
            flag = torch.tensor([1.0 if leaving else 0.0], device=self.comm.device)
            self.comm.all_reduce(flag)
            leave = bool(flag.item() > 0)
        self.committed_through = iteration
        self.committed_clip_scale = None if self.clip_scale is None else float(self.clip_scale)
        self.committed_grad_norm = self.gathered_norm if self.gathered_through == iteration \
            else None
        return leave

    def step(self, iteration: int, committed_scale: float | str | None = None) -> None:
        """Apply the committed iteration to owned stages and hand the replica its update.

        Also called during recovery, when the iteration was committed elsewhere before this
        node could step it; `committed_scale` is then the Decision's record of the commit's
        clipping scale ("skip": the step was skipped), for a node whose own gather was cut
        short while others completed theirs."""
        if self.stepped_through >= iteration:
            return
        if self.gathered_through != iteration:
            self._adopt_commit(iteration, committed_scale)
        skip = self._skips(iteration)  # training.nonfinite: skip, alike on every node
        for s in sorted(self.stages):
            state = self.stages[s]
            if not (self.skipped or skip):
                state.optimizer.step()
            if self.precision.scaled:
                amp.update_scale(state.params, state.optimizer, self.skipped, self.cfg)
            state.optimizer.zero_grad(set_to_none=True)
            if self.digests is not None:
                self.digests.write(iter=iteration, stage=s, role="owner",
                                   **stage_digest(state.module, state.optimizer))
        self.stepped_through = iteration
        if self.shadow is not None:
            self.shadow.commit(iteration, self.clip_scale, skip)
        if self.cfg.replica.sync == "state":
            self._exchange_state(iteration)
        elif self.holding is not None:
            lease, self._replica_recv = self._replica_recv, None
            flat = lease.tensor if lease is not None else None
            if flat is not None and self.skipped:  # fp16's skipped step: only the back-off
                flat = flat.clone()  # (a lent buffer is only read: its sender may read it too)
                mark_skipped(flat, len(self.holding.replica.params))
            # the owner's gradient came before clipping: the applier clips it as the owner did
            clip = None if self.skipped else self.clip_scale
            self.holding.applier.submit(iteration, "none" if skip else "grad", flat,
                                        check=self.comm.abort.check, scale=clip,
                                        done=lease.release if lease is not None else None)
        self._drop_replica_message()

    def _adopt_commit(self, iteration: int, scale: float | str | None) -> None:
        """What the norm gather of `iteration` would have told this node, from the record of a
        node that completed it: the gradients here are reduced but not yet clipped (the
        gather is the last thing the reduction does before clipping). The node then reports
        the iteration committed, with that scale, as a node that completed the gather does: if
        those are lost next, before a new shadow writer has relinked, the next Decision takes
        the scale from this node's report."""
        self.skipped, self.nonfinite, self.clip_scale = False, None, None
        if scale == "skip":
            if self.precision.scaled:
                self.skipped = True
                self.clip_scale = torch.tensor(float("nan"))
            else:  # a non-finite norm, skipped alike everywhere (which stage: not recorded)
                self.nonfinite = (iteration, self.w.num_stages - 1)
        elif scale is not None:
            self.clip_scale = torch.tensor(float(scale), dtype=torch.float32)
            self._clip()
        self.gathered_through = iteration
        self.committed_through = max(self.committed_through, iteration)
        self.committed_clip_scale = float("nan") if scale == "skip" else scale

    def _clip(self) -> None:
        """Replace the owned gradients by themselves times `clip_scale` (out of place)."""
        params = [p for st in self.stages.values() for p in st.params if p.grad is not None]
        for p, g in zip(params, gradlib.clipped([p.grad for p in params], self.clip_scale)):
            p.grad = g

    def _log_samples(self, iteration: int, batches: Microbatches, last: int) -> None:
        if self.sample_log is not None and last in self.stages:
            self.sample_log.write(json.dumps({
                "iter": iteration, "pipeline": self.w.pipeline, "generation": self.generation,
                "samples": [list(i) for i in batches.indices]}) + "\n")
            self.sample_log.flush()

    def discard(self) -> None:
        """Drop an uncommitted iteration: gradients, what was kept, replica messages."""
        for state in self.stages.values():
            state.optimizer.zero_grad(set_to_none=True)
        self.flight = None
        self.abandon_messages()

    def abandon_messages(self) -> None:
        """Forget messages posted on the failed generation's groups; the work stays."""
        self._drop_replica_message()
        if self.flight is not None:
            self.flight.local.clear()  # hand-offs are redone with the sends that made them
            self.flight.restore_local_gradients(self.stages)

    def _drop_replica_message(self) -> None:
        """A replica's gradient not handed to the applier goes back to its sender's ring."""
        lease, self._replica_recv = self._replica_recv, None
        if lease is not None:
            lease.release()

    def set_lr(self, iteration: int) -> float:
        lr = 0.0
        for state in self.stages.values():
            lr = set_lr(state.optimizer, self.cfg, iteration)
        return lr

    # ------------------------------------------------------------------ gradient replication

    def _post_shadows(self, iteration: int) -> None:
        """Ship the (reduced, unclipped) gradients to the shadows and confirm they left."""
        assert self.shadow is not None
        for s in sorted(self.shadow.links):
            started = time.perf_counter()
            flat = flatten_grads(self.stages[s].params)  # a skipped step comes with COMMIT
            self.shadow.spent("copy", started)
            self.shadow.post_grad(iteration, s, flat)
        self.shadow.confirm()

    def _accumulate_where_sent(self, s: int) -> None:
        """Stage 0 finishes its backward last, so copying its gradients for the replica ends
        every iteration's critical path. After its first backward its gradients move into
        the buffer they will be sent from (a local link's ring, `Comm.send_buffer`) and the
        later micro-batches accumulate there in place: the copy is paid while stage 0 waits
        for its next gradient, and `_send_to_replicas` finds them in place. Not with data
        parallelism, whose reduction replaces them (a gradient replaced after this, as the
        tied sum does, is simply copied at the send)."""
        holder = self.w.replica_holder.get(s)
        if holder is None or s in self.comm.data_parallel \
                or self.cfg.replica.sync != "gradient":
            return
        buffer = self.comm.send_buffer(holder, tag(REPLICA, s))
        if buffer is None:  # through the process group, or the channel's first message
            return
        at = 0
        for p in self.stages[s].params:
            place = buffer[at: at + p.numel()]
            at += p.numel()
            if p.grad is not None and p.grad.dtype == place.dtype:
                p.grad = place.view_as(p).copy_(p.grad)

    def _send_to_replicas(self) -> None:
        """Ship the (reduced, unclipped) gradients to the replicas' holders. With the receive
        of the one this node holds (`_receive_replica`), confirmed before the norm gather, so
        that the gather can be the commit (as for the shadows). Whether the step is skipped
        and the clipping scale come out of that gather, which the holder takes part in too,
        so nothing else travels."""
        # sent as a channel (`Comm.send_concatenated`): between two workers of one host the
        # gradients go through shared memory, copied once, where the process group's loopback
        # TCP took longer on the iteration's critical path (the last node to finish, stage 0
        # in 1F1B): in `bench redundancy` (1.75 MB each way) this exchange went from 1.37 to
        # 0.88 ms per iteration with lazy, 2.34 to 1.63 ms with eager (medians, one run each),
        # a copy into the ring and one out of it; lending the received one saves the second
        for s, holder in sorted(self.w.replica_holder.items()):
            self.comm.send_concatenated(grad_parts(self.stages[s].params), holder,
                                        tag(REPLICA, s),
                                        replica_link_slots(self.cfg.replica.max_lag))

    def _receive_replica(self) -> None:
        """The gradient of the replica this node holds (see `_send_to_replicas`)."""
        if self.holding is not None:
            # lent, not copied: the replica's thread applies it where it lies and gives the
            # buffer back (a copy here was on the critical path, see above)
            lease = self.comm.recv_lent(self.holding.owner,
                                        tag(REPLICA, self.holding.replica.index))
            self._replica_recv = lease
            if lease.tensor.numel() != self.holding.replica.grad_message_size():
                raise RuntimeError(f"{self.holding.owner} sent a replica gradient of "
                                   f"{lease.tensor.numel()} values for a replica of "
                                   f"{self.holding.replica.grad_message_size()}")

    def _exchange_state(self, iteration: int) -> None:
        """Baseline `replica.sync: state`: a full copy every k iterations, on the critical path."""
        holding = self.holding
        if (iteration + 1) % self.cfg.replica.sync_every:
            if holding is not None:
                holding.applier.submit(iteration, "none", None, check=self.comm.abort.check)
            return
        sends = []
        for s, holder in sorted(self.w.replica_holder.items()):
            flat = flatten_state(self.stages[s].params, self.stages[s].optimizer)
            sends.append((self.comm.post_send(flat, holder, tag(REPLICA, s)), flat))
        if holding is not None:
            buffer = torch.empty(holding.replica.state_message_size(self.cfg),
                                 device=self.comm.device)
            self.comm.wait(self.comm.post_recv(buffer, holding.owner,
                                               tag(REPLICA, holding.replica.index)))
            holding.applier.submit(iteration, "state", buffer, check=self.comm.abort.check)
        for work, _ in sends:
            self.comm.wait(work)

    # ------------------------------------------------------------------ gradient reduction

    def reduce_gradients(self, leaving: bool = False, iteration: int = -1,
                         loss_bad: bool = False) -> float:
        """Data-parallel sum, tied-weight sum, then clipping by the global norm.

        The loss was divided by M * D, so a plain sum over pipelines gives the mean. With one
        pipeline no reduction runs at all, which keeps D = 1 bit-identical to one process.
        A non-finite loss (`loss_bad`, on the last stage) makes that stage's norm NaN, so the
        all-gathered norm says it to every node, and every node decides alike (`nonfinite`).
        """
        # gradients are replaced, never changed in place: InFlight keeps the local ones, and a
        # reduction cut short by a failure is redone from them
        for s in sorted(self.stages):
            # a parameter the loss does not reach keeps grad None, as in a plain loop; which
            # ones is the same on every pipeline, so the flat buffers line up
            params = [p for p in self.stages[s].params if p.grad is not None]
            if params and s in self.comm.data_parallel:
                grads = [p.grad for p in params]
                flat = torch._utils._flatten_dense_tensors(grads)
                self.comm.all_reduce_dp(s, flat)
                for p, r in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
                    p.grad = r
        self._sum_tied()
        found_inf = self._unscale()
        if self.shadow is not None and iteration >= 0:
            # the shadows get the gradient before clipping, and the clipping scale with the
            # commit (Checkmate sends what is not a gradient alongside): the confirm is done
            # before the norm gather, so that the gather can stay the commit
            self._post_shadows(iteration)
        # (iteration < 0: the bench's profiling of a reduction)
        replicate = iteration >= 0 and self.cfg.replica.sync == "gradient"
        if replicate:
            self._send_to_replicas()
        # the norms between the replicas' send and receive: the node that finishes last (the
        # first stage) computes them after its send, while the holder of its replica, which
        # waits for that send, computed them before, and so enters the norm gather first.
        # Two nodes that enter a gloo collective within about 0.1 ms of each other wait in it
        # 2-5 ms in one of ten (measured with two bare processes on this 2-core VM, against
        # 1 in 250 with one of them 0.2 ms ahead); in `bench redundancy` that was 1.3 ms
        # per iteration of lazy's cost
        mine = []
        for s in sorted(self.stages):
            like = self.stages[s].params[0] if self.stages[s].params else torch.zeros(1)
            mine.append(gradlib.local_norms([p.grad for p in self.stages[s].norm_params], like))
        if loss_bad:
            mine[sorted(self.stages).index(self.w.num_stages - 1)].fill_(float("nan"))
        vector = torch.cat(mine) if mine else torch.zeros(0)
        if replicate:
            self._receive_replica()
            self.comm.wait_sends()  # (the replicas' sends, where they went through the group)
        # two slots more than the norms: found-inf (fp16), and this node's leave/regroup flag
        # (see _commit)
        padded = torch.zeros(self.w.norm_width + 2, dtype=torch.float32, device=self.comm.device)
        padded[: vector.numel()] = vector
        padded[-2] = 1.0 if found_inf else 0.0
        padded[-1] = 1.0 if leaving else 0.0
        gathered = self.comm.all_gather(padded)
        self.gathered_through = iteration
        self.skipped = any(float(g[-2]) > 0 for g in gathered)
        # the commit rides on this gather: the replica's and the shadows' gradients were
        # confirmed before it
        self._flags_gathered = any(float(g[-1]) > 0 for g in gathered)
        everything = torch.cat([gathered[rank][offset: offset + count]
                                for rank, offset, count in self.w.norm_segments])
        total = gradlib.total_norm(everything)
        finite = bool(torch.isfinite(total))
        self.gathered_norm = float(total) if finite else None
        self.nonfinite = None
        # (fp16's overflows are the loss scaler's business: skipped and backed off, above)
        if not self.skipped and not finite:
            self.nonfinite = (iteration, next(
                (s for s, (rank, offset, count) in enumerate(self.w.norm_segments)
                 if not bool(torch.isfinite(gathered[rank][offset: offset + count]).all())),
                self.w.num_stages - 1))
        self.clip_scale = None
        if self.skipped or self.nonfinite is not None:
            # no step: NaN says so with COMMIT and in this node's report, whence a new shadow
            # writer's HELLO carries it (a scale of None there would apply the gradient)
            self.clip_scale = torch.tensor(float("nan"))
        elif self.cfg.optimizer.grad_clip > 0:
            self.clip_scale = gradlib.clip_scale(total, self.cfg.optimizer.grad_clip)
            self._clip()
        return float(total)

    def _unscale(self) -> bool:
        """fp16: divide the (reduced, tied-summed) gradients by the loss scale, out of place;
        whether this node found a non-finite one."""
        if not self.precision.scaled:
            return False
        found = False
        for state in self.stages.values():
            params = [p for p in state.params if p.grad is not None]
            grads, inf = amp.unscale([p.grad for p in params],
                                     amp.current_scale(state.optimizer))
            for p, g in zip(params, grads):
                p.grad = g
            found = found or inf
        return found

    def _sum_tied(self) -> None:
        """Keep tied copies on the first and last stage equal: each gets a + b (addition is
        commutative, so both sides compute the same bits)."""
        first, last = 0, self.w.num_stages - 1
        if first in self.stages and last in self.stages and first != last:
            for a, b in zip(self.stages[first].tied_params, self.stages[last].tied_params):
                for p in (a, b):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                total = a.grad + b.grad
                a.grad, b.grad = total, total.clone()
            return
        for s, partner in self.w.tied_partner.items():
            params = self.stages[s].tied_params
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            mine = torch.cat([p.grad.reshape(-1) for p in params])
            theirs = torch.empty_like(mine)
            other = last if s == first else first
            send = self.comm.post_send(mine, partner, tag(TIED, s))
            self.comm.wait(self.comm.post_recv(theirs, partner, tag(TIED, other)))
            self.comm.wait(send)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = p.grad + theirs[offset: offset + n].view_as(p)
                offset += n
