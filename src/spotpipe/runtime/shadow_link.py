"""The writer's side of the links to the CPU shadows (Checkmate's per-iteration checkpoints).

A shadow holds one stage and applies that stage's final gradient every iteration, so it holds
the state after every committed iteration without the workers ever writing a checkpoint. It
outlives generations and layouts, so it cannot sit in the generation's process groups, which
are re-formed among the live nodes after every change. Instead each stage has a numbered
sequence of links: a two-rank gloo group between the shadow (rank 0) and the stage's current
writer (rank 1, the owner of the stage in pipeline 0), made when the writer changes and kept
across generations otherwise.

Messages on a link are a header of four int64 `[kind, iteration, arg, 0]`, some followed by
a payload:

- HELLO(resume, want_state), writer -> shadow: the writer starts writing at iteration
  `resume`. The shadow settles a gradient it holds unapplied (applies it if it is of
  `resume - 1`, which survivors committed, drops it otherwise, even one whose lost writer
  committed it alone), answers ACK(applied, size), and if
  `want_state` sends the stage's state (a restore onto a node that lost it), `size` values,
  which the writer checks against its stage's before it takes any (as for GRAD's size). A
  `resume` that neither follows what the shadow applied nor the gradient it holds settles
  nothing: the writer refuses the ACK, and the next writer finds the shadow as it was.
- GRAD(t, size) + the flat gradient (`replica.flatten_grads`, `size` values): iteration t's
  final gradient (gloo takes a shorter message into a receive, so the shadow checks `size`
  against its stage's, and refuses a gradient that is not the stage's whole one). Sent
  when the gradient is reduced and confirmed before the iteration commits, as for replicas, so
  a committed iteration is always in the shadow's hands even if the writer dies next. The
  gradient travels under its own tag (GRAD_TAG), so that the shadow can post the receive of
  the next one ahead of time: the writer's send then completes as soon as the bytes are
  copied, without waiting for the shadow's process to be scheduled (the confirm is on the
  training's critical path).
- COMMIT(t, scale): the writer committed iteration t (its norm gather completed): the shadow
  will scale the gradient by the clipping scale (sent before clipping, because the scale
  needs the global norm, which the commit's own collective gathers) and apply it, once the
  writer's next message shows that every node committed t too (the next GRAD, or an END or
  HELLO resuming after t: `checkpoint.shadow._Pending` says why). A HELLO carries the scale
  of iteration `resume - 1`, for a gradient whose COMMIT its writer did not live to send.
  A scale is NaN (a skipped step) or in [0, 1] (`grads.clip_scale`); the shadow refuses any
  other before it touches its state.
- END(resume, scale) + one value under GRAD_TAG: the writer hands the stage over (or the job
  is over), every node having agreed to resume at `resume`; the shadow settles what it holds
  as at a HELLO and waits for the next link. The value completes the shadow's receive of the
  next gradient, posted ahead (gloo takes a shorter message into a receive), which it then
  drops.

The shadow gives up a link whose writer has said nothing for `cluster.timeout_s` (its receive
times out, as it fails at once for a writer that is gone), and waits for the next link. A
writer that was silent half that long (a recovery that kept its link, a slow final save)
therefore opens a new link before its next message (`ShadowWriter._current`): its HELLO
settles what the shadow holds, as a new writer's does.

Gloo carries the links whatever the job's backend: shadows live on CPU hosts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spotpipe.runtime.state import unflatten
from spotpipe.protocol import keys
from spotpipe.runtime.digest import optimizer_tensors
from spotpipe.runtime.optim import materialise_optimizer_state
from spotpipe.protocol.auth import Refused
from spotpipe.store.sealed import SealedStore

HELLO, ACK, GRAD, COMMIT, END = 1, 2, 3, 4, 5
GRAD_TAG = 1  # headers travel under tag 0
_HEADER = 4


def links_key(namespace: str, stage: int) -> str:
    return keys.shadow_links(namespace, stage)


def link_key(namespace: str, stage: int, number: int) -> str:
    return keys.shadow_link(namespace, stage, number)


def applied_key(namespace: str, stage: int, iteration: int) -> str:
    return keys.shadow_applied(namespace, stage, iteration)


def latest_key(namespace: str, stage: int) -> str:
    """The newest iteration the shadow applied: one read tells the writer how far ahead it may
    run without asking again (the per-iteration keys are for waiting on)."""
    return keys.shadow_applied(namespace, stage, "latest")


def pair_group(store: SealedStore, namespace: str, stage: int, number: int, rank: int,
               timeout_s: float) -> Any:
    """The link's gloo pair, its rendezvous sealed (`store` must outlive the group)."""
    prefix = keys.shadow_groups(namespace, stage, number)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2,
                                 timedelta(seconds=timeout_s))


def header(kind: int, iteration: int = 0, arg: int = 0,
           scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """`scale`, a clipping scale (float32), rides in the last slot as its bits, 1 << 32
    meaning none (no clipping, or not known)."""
    return torch.tensor([kind, iteration, arg, scale_bits(scale)], dtype=torch.int64)


_NO_SCALE = 1 << 32


def scale_bits(scale: torch.Tensor | float | None) -> int:
    if scale is None:
        return _NO_SCALE
    value = torch.tensor([float(scale)], dtype=torch.float32)  # float32 -> float is exact
    return int(value.view(torch.int32).item())


def scale_from_bits(bits: int) -> torch.Tensor | None:
    if bits == _NO_SCALE:
        return None
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]


def state_size(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Values in `state.flatten(module, optimizer)`."""
    materialise_optimizer_state(module, optimizer)
    return sum(p.numel() for p in module.parameters()) + sum(
        t.numel() for t in optimizer_tensors(optimizer))


class ShadowError(RuntimeError):
    """A shadow cannot provide what the job needs (it fell out of step, or is gone)."""


def _unreachable(stage: int, exc: RuntimeError) -> ShadowError:
    """A failed operation on a link, named for the shadow (gloo's own words blame "a remote
    worker crashing")."""
    return ShadowError(f"the shadow of stage {stage} is unreachable: "
                       f"{str(exc).splitlines()[0][:200]}")


@dataclass
class _Link:
    stage: int
    number: int
    group: Any
    applied: int  # the newest iteration known applied by the shadow
    store: SealedStore  # the group's rendezvous (referenced while the group lives)
    resume: int  # the next iteration to commit on it (its HELLO's, then each COMMIT's + 1)
    scale: torch.Tensor | float | None  # the clipping scale of iteration resume - 1
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    used: float = field(default_factory=time.monotonic)  # when its last message was posted


class ShadowWriter:
    """This node's links to the shadows of the stages it writes."""

    def __init__(self, store: SealedStore, namespace: str, node: str, *, max_lag: int,
                 timeout_s: float) -> None:
        """`store`: the job's, sealed (the links and the shadows' marks are records too)."""
        self.store, self.namespace, self.node = store, namespace, node
        self.max_lag, self.timeout_s = max_lag, timeout_s
        # a link silent this long is renewed before its next message: the shadow gives it up
        # after timeout_s (`_current`)
        self.silent_s = timeout_s / 2
        self.links: dict[int, _Link] = {}
        self.waited_s = 0.0  # time spent waiting on a shadow beyond max_lag
        # all the time shadows add to the writer's critical path, lag waits aside: copying and
        # posting the gradient, confirming its send, the commit message
        self.writer_s = 0.0
        self.parts: dict[str, float] = {}  # writer_s by part, for the breakdown
        self.waiting = False  # blocked on a shadow, not computing (read by the heartbeat)
        self.bytes_received = 0

    def spent(self, part: str, started: float) -> None:
        """Count the time since `started` as the writer's, under `part`."""
        took = time.perf_counter() - started
        self.writer_s += took
        self.parts[part] = self.parts.get(part, 0.0) + took

    def relink(self, writes: dict[int, tuple[nn.Module, torch.optim.Optimizer]], resume: int,
               restore: set[int], scale: float | None = None) -> None:
        """Write exactly the stages in `writes` from iteration `resume` on. Stages in `restore`
        are loaded from their shadow (the node has an empty module for them). `scale`: the
        clipping scale of iteration resume - 1 (see COMMIT)."""
        for s in sorted(set(self.links) - set(writes)):
            self._end(self.links.pop(s))
        for s in sorted(set(writes)):
            if s in self.links:
                if s not in restore:
                    continue
                # a link kept from a plan that failed and was rolled back, whose stage this
                # node restored then: the node has an empty module for it now, so the state
                # comes again, over a new link (skipping it trained on that empty module)
                self._end(self.links.pop(s))
            self.links[s] = self._open(s, resume, scale, writes[s] if s in restore else None)

    def _open(self, stage: int, resume: int, scale: torch.Tensor | float | None,
              state: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> _Link:
        """A new link to the shadow of `stage`, from iteration `resume` on; with `state`, the
        stage's (empty) module and optimizer, loaded from the shadow."""
        want_state = state is not None
        number = self.store.add(links_key(self.namespace, stage), 1)
        self.store.set(link_key(self.namespace, stage, number),
                       json.dumps({"node": self.node, "resume": resume}))
        rendezvous = self.store.rendezvous(self.timeout_s)
        ack = torch.empty(_HEADER, dtype=torch.int64)
        try:
            group = pair_group(rendezvous, self.namespace, stage, number, 1, self.timeout_s)
            group.send([header(HELLO, resume, int(want_state), scale)], 0, 0).wait()
            group.recv([ack], 0, 0).wait()
        except RuntimeError as exc:
            raise _unreachable(stage, exc) from None
        applied, size = int(ack[1]), int(ack[2])
        link = _Link(stage, number, group, applied, rendezvous, resume, scale)
        if applied != resume - 1:
            raise ShadowError(f"the shadow of stage {stage} holds iteration {applied}, but the "
                              f"job resumes at iteration {resume}")
        if state is not None:
            module, optimizer = state
            flat = torch.empty(state_size(module, optimizer))
            if size != flat.numel():  # (gloo would take a shorter state, its tail unwritten)
                raise ShadowError(f"the shadow of stage {stage} holds a state of {size} values, "
                                  f"{self.node}'s stage has {flat.numel()}: nothing restored")
            try:  # (whole or not at all: a cut link leaves the module unloaded, and fails)
                group.recv([flat], 0, 0).wait()
            except RuntimeError as exc:
                raise _unreachable(stage, exc) from None
            device = next(module.parameters()).device
            unflatten(flat.to(device), module, optimizer)
            self.bytes_received += flat.numel() * flat.element_size()
        return link

    def _end(self, link: _Link) -> None:
        link = self._current(link)
        self._finish_sends(link)
        try:
            self._say_end(link)
        except RuntimeError as exc:
            raise _unreachable(link.stage, exc) from None

    @staticmethod
    def _say_end(link: _Link) -> None:
        """END(resume), and the value that completes the gradient's receive posted ahead. A
        link ends after every node agreed where the job resumes (at a Decision, at the job's
        end, or before a gradient: see `_Pending` in the shadow), so END's `resume` settles a
        commit the shadow holds."""
        ends = [link.group.send([header(END, link.resume, scale=link.scale)], 0, 0),
                link.group.send([torch.zeros(1)], 0, GRAD_TAG)]
        for work in ends:
            work.wait()

    def _current(self, link: _Link) -> _Link:
        """`link`, or a new link in its place if it has been silent for half of the timeout
        after which the shadow gives it up (see the module doc). The old one is ended, in
        case the shadow still follows it; one it gave up already fails, and needs no END."""
        if not self._silent(link):
            return link
        try:
            self._finish_sends(link)
            self._say_end(link)
        except RuntimeError:  # (given up: the shadow waits for the next link)
            link.sends.clear()
        self.waiting = True
        try:
            fresh = self._open(link.stage, link.resume, link.scale)
        finally:
            self.waiting = False
        if self.links.get(link.stage) is link:
            self.links[link.stage] = fresh
        return fresh

    def _silent(self, link: _Link) -> bool:
        """Whether `link` has been silent so long that the shadow may give it up before the
        next message arrives (`_current` renews it)."""
        return time.monotonic() - link.used >= self.silent_s

    def post_grad(self, iteration: int, stage: int, flat: torch.Tensor) -> None:
        """Ship iteration `iteration`'s final gradient of `stage` (asynchronously)."""
        started = time.perf_counter()
        link = self.links[stage]
        # (one more than max_lag: the shadow applies an iteration once this gradient confirms
        # that every node committed it, so it is always at least one behind what it received)
        behind = iteration - self.max_lag - 1
        if behind > link.applied:  # the shadow marks each iteration it applies in the store
            latest = latest_key(self.namespace, stage)
            if self.store.check([latest]):
                try:
                    link.applied = max(link.applied, int(self.store.get(latest)))
                except Refused:  # (an event says so) the per-iteration marks still tell
                    pass
        if behind > link.applied:  # the documented policy: the writer waits
            waited = time.perf_counter()
            self.waiting = True
            try:
                self._await_mark(stage, behind)
                link.store.get(applied_key(self.namespace, stage, behind))  # (a genuine one)
            finally:
                self.waiting = False
            link.applied = behind
            self.waited_s += time.perf_counter() - waited
            started += time.perf_counter() - waited
        # (after the wait, which leaves the link silent too)
        link = self._current(link)
        flat = flat.detach().to("cpu")
        h = header(GRAD, iteration, flat.numel())
        link.sends.append((link.group.send([h], 0, 0), h))
        link.sends.append((link.group.send([flat], 0, GRAD_TAG), flat))
        link.used = time.monotonic()
        self.spent("post", started)

    def _await_mark(self, stage: int, iteration: int) -> None:
        """Until the shadow of `stage` has applied `iteration`; a shadow that does not within
        cluster.timeout_s stops the job, named (the store's own error names only a key)."""
        try:
            self.store.wait([applied_key(self.namespace, stage, iteration)],
                            timedelta(seconds=self.timeout_s))
        except dist.DistStoreError as exc:
            raise ShadowError(
                f"the shadow of stage {stage} has not applied iteration {iteration} within "
                f"cluster.timeout_s ({self.timeout_s:g} s): it lags more than shadow.max_lag "
                f"({self.max_lag}) iterations behind its writer, and is hung or too slow for "
                f"this job ({str(exc).splitlines()[0][:120]})") from None

    def confirm(self) -> None:
        """Every gradient posted so far has left this node (before the commit)."""
        started = time.perf_counter()
        for link in self.links.values():
            self._finish_sends(link)
        self.spent("confirm", started)

    def commit(self, iteration: int, scale: torch.Tensor | None, skip: bool = False) -> None:
        """`skip`: the step of `iteration` is skipped on every node (a non-finite norm)."""
        started = time.perf_counter()
        said = float("nan") if skip else scale  # (a HELLO says a skip with a NaN scale)
        for stage in sorted(self.links):
            link = self.links[stage]
            link.resume, link.scale = iteration + 1, said
            if self._silent(link):
                # not renewed here: a new link's HELLO(resume) settles the iteration before it
                # as agreed by every node, which this node's commit alone does not say. The
                # link is renewed before its next message (a gradient, once every node is past
                # this commit, or END), whose HELLO brings this commit.
                continue
            h = header(COMMIT, iteration, int(skip), scale=scale)
            link.sends.append((link.group.send([h], 0, 0), h))
            link.used = time.monotonic()
        self.spent("commit_message", started)

    def close(self) -> None:
        for stage in sorted(self.links):
            self._end(self.links[stage])
        self.links.clear()

    def _finish_sends(self, link: _Link) -> None:
        self.waiting = True
        try:
            for work, _ in link.sends:
                work.wait()
        except RuntimeError as exc:
            raise _unreachable(link.stage, exc) from None
        finally:
            self.waiting = False
        link.sends.clear()
