"""Replicas kept exact by gradient replication (Checkmate's idea applied to Bamboo's replicas).

After the gradient reduction, a stage's gradient is final: the data-parallel sum, the tied-weight
sum and the clipping scale are all in it. The owner ships exactly that to the node holding its
replica, which applies the same optimizer (same class, hyperparameters, step count and LR) to its
copy. Applying the same update to the same state gives the same bits, so the replica is exact
after every iteration while only the gradient's bytes travel (a third of fp32 Adam's state).

The transfers are posted by the main thread (so their order is the same on both ends and no
collective interleaves with them) and completed by a background thread, which also runs the
replica's optimizer step: nothing here sits on the training's critical path unless the update
falls `max_lag` iterations behind.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from spotpipe.config import Config
from spotpipe.runtime.digest import DigestLog, optimizer_tensors, stage_digest
from spotpipe.runtime.optim import build_optimizer, set_lr


@dataclass
class ReplicaStage:
    """A copy of another stage's module and optimizer, owned by this node."""

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


def _flatten_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """All gradients in one buffer, then one presence flag per parameter (a parameter the loss
    did not reach has no gradient and the optimizer must skip it on both sides)."""
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device,
                                                                        dtype=p.dtype)
             for p in params]
    flags = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype,
                         device=params[0].device)
    return torch.cat(parts + [flags])


@dataclass
class _Pending:
    iteration: int
    recv: dist.Work | None
    buffer: torch.Tensor | None
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)


class GradientReplication:
    """Ships this node's final gradient to its replica holder and keeps its own replica (of
    the successor stage) in step with the successor's gradients."""

    def __init__(self, *, cfg: Config, own_params: list[nn.Parameter], replica: ReplicaStage,
                 send_to: int, send_group: dist.ProcessGroup, recv_from: int,
                 recv_group: dist.ProcessGroup, digests: DigestLog | None = None,
                 own_optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = cfg
        self.own_params = own_params
        self.own_optimizer = own_optimizer
        self.replica = replica
        self.send_to, self.send_group = send_to, send_group
        self.recv_from, self.recv_group = recv_from, recv_group
        self.digests = digests
        self.mode = cfg.replica.sync
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._applied = -1
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.waited_s = 0.0  # time the main thread spent waiting on the bound
        self.max_lag_seen = 0
        self._thread = threading.Thread(target=self._loop, name="replica", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread

    def post(self, iteration: int) -> None:
        """Called once the gradients of `iteration` are final, before the optimizer step."""
        if self.mode != "gradient":
            return
        self._raise_if_failed()
        self._wait_for_room(iteration)
        flat = _flatten_grads(self.own_params)
        pending = _Pending(iteration, None, None)
        pending.sends.append((dist.isend(flat, self.send_to, group=self.send_group), flat))
        size = sum(p.numel() for p in self.replica.params) + len(self.replica.params)
        pending.buffer = torch.empty(size, dtype=flat.dtype, device=flat.device)
        pending.recv = dist.irecv(pending.buffer, self.recv_from, group=self.recv_group)
        self._queue.put(pending)

    def post_state(self, iteration: int) -> None:
        """Baseline `sync: state`: after the optimizer step of every k-th iteration, ship the
        whole stage state (parameters and optimizer state)."""
        if self.mode != "state":
            return
        self._raise_if_failed()
        self._wait_for_room(iteration)
        pending = _Pending(iteration, None, None)
        if (iteration + 1) % self.cfg.replica.sync_every == 0:
            flat = torch.cat([p.detach().reshape(-1) for p in self.own_params]
                             + [t.reshape(-1).to(self.own_params[0].dtype)
                                for t in optimizer_tensors(self.own_optimizer)])
            pending.sends.append((dist.isend(flat, self.send_to, group=self.send_group), flat))
            size = self._state_size()
            buffer = torch.empty(size, dtype=flat.dtype, device=flat.device)
            pending.recv = dist.irecv(buffer, self.recv_from, group=self.recv_group)
            pending.buffer = buffer
        self._queue.put(pending)

    def _state_size(self) -> int:
        """Size of a state message: parameters, then the optimizer state as the owner has it
        after a step (the replica's own optimizer has the same layout once it has stepped)."""
        params = self.replica.params
        n = sum(p.numel() for p in params)
        if self.cfg.optimizer.name == "adamw":
            return n + 2 * n + len(params)  # exp_avg, exp_avg_sq, step per parameter
        return n + (n if self.cfg.optimizer.momentum else 0)

    def wait_applied(self, iteration: int) -> None:
        """Block until the replica holds the state after `iteration` (FRC needs it current)."""
        if iteration < 0:
            return
        start = time.perf_counter()
        with self._cond:
            while self._applied < iteration and self._error is None:
                self._cond.wait()
        self.waited_s += time.perf_counter() - start
        self._raise_if_failed()

    def lag(self, iteration: int) -> int:
        with self._cond:
            return iteration - self._applied

    def _wait_for_room(self, iteration: int) -> None:
        lag = self.lag(iteration)
        self.max_lag_seen = max(self.max_lag_seen, lag)
        if lag > self.cfg.replica.max_lag:
            self.wait_applied(iteration - self.cfg.replica.max_lag)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"replica update failed: {self._error}") from self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()

    # ------------------------------------------------------------------ background thread

    def _loop(self) -> None:
        try:
            while (pending := self._queue.get()) is not None:
                if pending.recv is not None:
                    pending.recv.wait()
                    if self.mode == "gradient":
                        self._apply_gradient(pending.iteration, pending.buffer)
                    else:
                        self._load_state(pending.buffer)
                for work, _ in pending.sends:
                    work.wait()
                if self.digests is not None:
                    self.digests.write(iter=pending.iteration, stage=self.replica.index,
                                       role="replica",
                                       **stage_digest(self.replica.module, self.replica.optimizer))
                with self._cond:
                    self._applied = pending.iteration
                    self._cond.notify_all()
        except BaseException as exc:  # surfaced to the main thread at its next call
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _apply_gradient(self, iteration: int, flat: torch.Tensor) -> None:
        params = self.replica.params
        flat = flat.to(self.replica.device)
        flags = flat[-len(params):]
        offset = 0
        for i, p in enumerate(params):
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone() if flags[i] else None
            offset += n
        set_lr(self.replica.optimizer, self.cfg, iteration)
        self.replica.optimizer.step()
        self.replica.optimizer.zero_grad(set_to_none=True)

    def _load_state(self, flat: torch.Tensor) -> None:
        params = self.replica.params
        flat = flat.to(self.replica.device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_(flat[offset: offset + n].view_as(p))
                offset += n
            opt = self.replica.optimizer
            for p in params:
                keys = (["exp_avg", "exp_avg_sq", "step"] if self.cfg.optimizer.name == "adamw"
                        else (["momentum_buffer"] if self.cfg.optimizer.momentum else []))
                state = opt.state.setdefault(p, {})
                for key in sorted(keys):
                    if key == "step":
                        state[key] = flat[offset].clone().reshape(())
                        offset += 1
                    else:
                        state[key] = flat[offset: offset + p.numel()].view_as(p).clone()
                        offset += p.numel()
