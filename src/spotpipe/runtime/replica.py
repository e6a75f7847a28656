"""Replicas kept exact by gradient replication (Checkmate's idea applied to Bamboo's replicas).

After the data-parallel and tied-weight sums a stage's gradient is final but for the clipping
scale, which the all-gather of the norms gives every node alike. The owner ships that gradient
to the node holding its replica, which clips it by the same scale, with the same kernel, and
applies the same optimizer (same class, hyperparameters, step count and LR) to its copy. The
same update on the same state gives the same bits, so the replica is exact after every
iteration, while only the gradient's bytes travel (a third of fp32 Adam's state).

The transfer is posted by the executor before the norm gather and its arrival confirmed before
it, so that the gather is the commit (a committed iteration can always be completed on the
replica, whoever dies next) and no collective of its own is needed; the optimizer step on the
replica runs on a background thread (`ReplicaApplier`), off the critical path unless it falls
`max_lag` iterations behind.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from spotpipe.config import Config
from spotpipe.runtime import grads as gradlib
from spotpipe.runtime.digest import DigestLog, optimizer_tensors, stage_digest
from spotpipe.runtime import precision as amp
from spotpipe.runtime.optim import build_optimizer, materialise_optimizer_state, set_lr


@dataclass
class ReplicaStage:
    """A copy of another stage's module and optimizer, held by this node."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    @classmethod
    def build(cls, index: int, module: nn.Module, cfg: Config,
              device: torch.device) -> "ReplicaStage":
        # a deep copy: with tied weights the replica of stage 0 would otherwise share the
        # embedding Parameter with this node's own head
        module = copy.deepcopy(module).to(device)
        return cls(index, module, build_optimizer(module.parameters(), cfg), device)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def grad_message_size(self) -> int:
        return sum(p.numel() for p in self.params) + len(self.params)

    def state_message_size(self, cfg: Config) -> int:
        n = sum(p.numel() for p in self.params)
        if cfg.optimizer.name == "adamw":
            # params, exp_avg, exp_avg_sq, step (and fp16's two scaler values)
            return n + 2 * n + len(self.params) * (3 if cfg.precision == "fp16" else 1)
        return n + (n if cfg.optimizer.momentum else 0)


def flatten_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """All gradients in one buffer, then one presence flag per parameter (a parameter the loss
    did not reach has no gradient, and the optimizer must skip it on both sides). fp16: the
    receiver marks a step skipped for a non-finite gradient (`mark_skipped`) once the norm
    gather has said so."""
    return torch.cat(grad_parts(params))


def grad_parts(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The pieces of `flatten_grads`' buffer, in order, uncopied (for a transport that copies
    them into its own buffer: `Comm.send_concatenated`)."""
    parts = [p.grad.reshape(-1) if p.grad is not None
             else torch.zeros(p.numel(), device=p.device, dtype=p.dtype) for p in params]
    flags = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype,
                         device=params[0].device)
    return parts + [flags]


def mark_skipped(flat: torch.Tensor, num_params: int) -> None:
    """Mark a `flatten_grads` message as a skipped step (fp16 found a non-finite gradient):
    the receiver applies no step, only the loss scaler's back-off."""
    flat[flat.numel() - num_params:] = -1.0


def flatten_state(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Parameters, then the optimizer state in parameter and key order (baseline sync)."""
    return torch.cat([p.detach().reshape(-1) for p in params]
                     + [t.reshape(-1).to(params[0].dtype) for t in optimizer_tensors(optimizer)])


def apply_flat_gradient(params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                        cfg: Config, iteration: int, flat: torch.Tensor,
                        scale: torch.Tensor | None = None) -> None:
    """The owner's optimizer step of `iteration`, replayed from what `flatten_grads` sent.
    `scale`: the owner's clipping, applied here with the kernel and operands of its own
    (`grads.clipped`), hence the same bits, and out of place: `flat` may be lent, in memory
    that its sender still reads."""
    flags = flat[-len(params):].tolist()
    if cfg.precision == "fp16" and flags and flags[0] < 0:  # the owner skipped this step
        amp.update_scale(params, optimizer, True, cfg)
        return
    grads, offset = [], 0
    for i, p in enumerate(params):
        n = p.numel()
        # a view, not a copy: every message arrives in a buffer of its own, never reused
        grads.append(flat[offset: offset + n].view_as(p) if flags[i] else None)
        offset += n
    if scale is not None:
        present = [g for g in grads if g is not None]
        it = iter(gradlib.clipped(present, scale))
        grads = [None if g is None else next(it) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    set_lr(optimizer, cfg, iteration)
    optimizer.step()
    if cfg.precision == "fp16":
        amp.update_scale(params, optimizer, False, cfg)
    optimizer.zero_grad(set_to_none=True)


# Injected in tests (SPOTPIPE_TEST_REPLICA_DELAY, set by the worker's entry point): seconds
# each replica update is held back, as on a node whose idle-priority thread gets no CPU.
DELAY_S = 0.0


class ReplicaApplier:
    """Applies committed updates to a replica on a background thread, in iteration order."""

    def __init__(self, replica: ReplicaStage, cfg: Config, digests: DigestLog | None, *,
                 role: str = "replica", max_lag: int | None = -1,
                 urgent_lag: int | None = None,
                 on_applied: Callable[[int], None] | None = None) -> None:
        """`max_lag`: how far behind `submit` lets it fall before the caller waits (-1: the
        configured `replica.max_lag`; None: never wait). `urgent_lag`: from this backlog on
        (submitted less applied) the thread runs at normal priority, before anyone waits: a
        CPU shadow's writer, in another process, waits once the backlog reaches its
        `shadow.max_lag`, and cannot raise this thread itself. `on_applied(t)` runs on the
        background thread after iteration t is applied (a CPU shadow marks it, and writes
        its durable checkpoints there)."""
        self.replica = replica
        self.cfg = cfg
        self.digests = digests
        self.role = role
        self.max_lag = cfg.replica.max_lag if max_lag == -1 else max_lag
        self.urgent_lag = urgent_lag
        self.on_applied = on_applied
        self._queue: queue.Queue[tuple[int, str, torch.Tensor | None, torch.Tensor | None,
                                       Callable[[], None] | None] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._applied = -1
        self._submitted = -1
        self._error: BaseException | None = None
        self.waited_s = 0.0
        self.waiting = False  # the caller is held back by this replica (read by heartbeats)
        self.max_lag_seen = 0
        self._native_id: int | None = None  # the thread's, once it runs at idle priority
        self._idle: bool | None = None  # the priority it runs at (None: not set yet)
        self._thread = threading.Thread(target=self._loop, name="replica", daemon=True)
        self._thread.start()

    @property
    def applied(self) -> int:
        with self._cond:
            return self._applied

    def start_at(self, iteration: int) -> None:
        """The replica holds the state after `iteration` - 1 (at build, or after a rebuild)."""
        with self._cond:
            self._applied = self._submitted = iteration - 1

    def submit(self, iteration: int, kind: str, flat: torch.Tensor | None,
               check: Callable[[], None] | None = None, *,
               scale: torch.Tensor | None = None,
               done: Callable[[], None] | None = None) -> None:
        """kind: "grad" (apply an optimizer step), "state" (load a full copy), "none".
        `check` as for `wait_applied`: a node held back by a slow replica still answers an
        abort (otherwise it looks hung and is fenced). `scale`: a "grad" still to be clipped
        (`apply_flat_gradient`), on this thread rather than the caller's. `done`: called on
        this thread once `flat` is no longer needed (a lent buffer goes back, before the
        iteration counts as applied)."""
        self.raise_if_failed()
        with self._cond:
            self._submitted = iteration
            lag = iteration - self._applied
            self._reprioritize()
        self.max_lag_seen = max(self.max_lag_seen, lag)
        self._queue.put((iteration, kind, flat, scale, done))
        if self.max_lag is not None and lag > self.max_lag:  # the documented policy: wait
            self.wait_applied(iteration - self.max_lag, check)

    def wait_applied(self, iteration: int, check: Callable[[], None] | None = None) -> None:
        """Block until `iteration` is applied. `check` is called while waiting and may raise to
        leave the wait (an abort): the applier runs at idle priority, so on a busy machine it
        can be seconds behind, and a node waiting on it must still answer a failure."""
        start = time.perf_counter()
        with self._cond:
            self.waiting = True
            self._reprioritize()
        try:
            with self._cond:
                while self._applied < iteration and self._error is None:
                    if check is None:
                        self._cond.wait()
                    else:
                        check()
                        self._cond.wait(0.05)
        finally:
            with self._cond:
                self.waiting = False
                self._reprioritize()
        self.waited_s += time.perf_counter() - start
        self.raise_if_failed()

    def drain(self) -> None:
        with self._cond:
            target = self._submitted
        self.wait_applied(target)

    def lag(self, iteration: int) -> int:
        with self._cond:
            return iteration - self._applied

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"replica update failed: {self._error}") from self._error

    def close(self) -> None:
        """End the thread, waited for at normal priority: a takeover waits here, and an
        idle-priority thread gets a busy core only when nothing else wants it (1.2 ms of a
        takeover's regroup on this machine, before)."""
        with self._cond:
            self.waiting = True
            self._reprioritize()
        self._queue.put(None)
        self._thread.join()
        self.waiting = False
        self._native_id = None  # (a thread id the kernel may give to another thread)
        self.raise_if_failed()

    # ------------------------------------------------------------------ background thread

    def _reprioritize(self) -> None:
        """Under `_cond`: idle while it has work nobody waits for; normal while the node waits
        on it (`wait_applied`), while the backlog reaches `urgent_lag`, and while it has
        nothing to do. An idle-priority thread that someone waits for gets the core only when
        nothing else wants it: with more processes than cores, the waiter would wait until
        every other process blocks (a priority inversion). And one that merely sleeps at idle
        priority delays its process's death where the cores are busy: a killed process is
        torn down once every thread has run its exit (measured, two busy loops on 2 cores: a
        bare process holding torch and a sleeping idle-priority thread took 12 s to die in 1
        of 5 kills, and 20-60 ms with the thread at normal priority). A thread starved with
        work in hand still does; the supervisor's crash watch does not wait for that."""
        backlog = self._submitted - self._applied
        urgent = self.urgent_lag is not None and backlog >= self.urgent_lag
        idle = backlog > 0 and not (self.waiting or urgent)
        if idle != self._idle and self._priority(idle):
            self._idle = idle

    def _priority(self, idle: bool) -> bool:
        """Set the thread's CPU priority; whether it took."""
        if self._native_id is None:
            return False
        try:
            os.sched_setscheduler(self._native_id, os.SCHED_IDLE if idle else os.SCHED_OTHER,
                                  os.sched_param(0))
        except (AttributeError, OSError):  # not Linux, or not permitted: leave it
            return False
        return True

    def _loop(self) -> None:
        # Lowest CPU priority: the replica's step should only use time the node would idle,
        # never delay the node's own work (measured by `spotpipe bench redundancy`); raised
        # while the node waits on it. Where idle priority is refused, it stays normal.
        self._native_id = threading.get_native_id()
        with self._cond:
            if not self._priority(idle=True):
                self._native_id = None
            self._idle = True
            self._reprioritize()  # someone may wait already
        try:
            while (item := self._queue.get()) is not None:
                iteration, kind, flat, scale, done = item
                if DELAY_S and self.role == "replica":
                    time.sleep(DELAY_S)  # an injected starvation (see DELAY_S), not a wait
                if kind == "grad":
                    self._apply_gradient(iteration, flat, scale)
                elif kind == "state":
                    self._load_state(flat)
                item = flat = None
                if done is not None:
                    done()
                if self.digests is not None:
                    self.digests.write(iter=iteration, stage=self.replica.index, role=self.role,
                                       **stage_digest(self.replica.module, self.replica.optimizer))
                if self.on_applied is not None:
                    self.on_applied(iteration)
                with self._cond:
                    self._applied = iteration
                    self._reprioritize()
                    self._cond.notify_all()
        except BaseException as exc:  # surfaced to the main thread at its next call
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _apply_gradient(self, iteration: int, flat: torch.Tensor,
                        scale: torch.Tensor | None = None) -> None:
        apply_flat_gradient(self.replica.params, self.replica.optimizer, self.cfg, iteration,
                            flat.to(self.replica.device), scale)

    def _load_state(self, flat: torch.Tensor) -> None:
        """Inverse of `flatten_state`: parameters, then every state tensor in key order."""
        params = self.replica.params
        flat = flat.to(self.replica.device)
        materialise_optimizer_state(self.replica.module, self.replica.optimizer)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
            for t in optimizer_tensors(self.replica.optimizer):
                t.copy_(flat[offset: offset + t.numel()].view_as(t).to(t.dtype))
                offset += t.numel()
