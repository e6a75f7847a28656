"""A CPU shadow of one stage: a checkpoint of every iteration at no cost to training.

Checkmate's observation (NSDI '26): the final gradient of an iteration says everything a
checkpoint needs, because the optimizer step is deterministic. The stage's writer ships that
gradient (see `spotpipe.runtime.shadow_link` for the protocol); the shadow applies the same
optimizer step to its own copy, on a CPU host that is not preempted (the launcher's, or the
node agent's), and so holds exactly the owner's state after every committed iteration. It
serves that state when two adjacent stages are lost (no replica survives), and writes the
durable checkpoints (every `checkpoint.every` iterations), so workers never stop to save.

Started by the launcher, one process per stage, with the worker's environment plus
SPOTPIPE_SHADOW_STAGE. The optimizer steps (and the durable saves) run on a background thread
(the replica applier) at the lowest priority (SCHED_IDLE), so where the shadow shares a host
with workers it uses only CPU time that training leaves idle; if they fall `shadow.max_lag`
iterations behind, the writer waits, so from that backlog on the thread runs at normal
priority. The thread that receives stays at normal priority: it is nearly always blocked, and
the receive of the next gradient is posted ahead, so a writer's send (which it confirms before
it commits) completes without waiting for a free core.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.protocol import channel_from_env, keys
from spotpipe.store.address import StoreAddress
from spotpipe.store.mailbox import Outbox
from spotpipe.store.sealed import SealedStore
from spotpipe.store.waiting import wait_unbounded
from spotpipe.config import Config, load_config
from spotpipe.runtime.state import flatten
from spotpipe.runtime import node as nodelib
from spotpipe.runtime.digest import DigestLog
from spotpipe.runtime.replica import ReplicaApplier, ReplicaStage, mark_skipped
from spotpipe.runtime.shadow_link import (ACK, COMMIT, END, GRAD, GRAD_TAG, HELLO, applied_key,
                                          header, latest_key, link_key, pair_group,
                                          scale_from_bits)


T = TypeVar("T")


@dataclass
class _Pending:
    """A gradient received and not yet applied. Its writer's COMMIT (`commit`: the clipping
    scale, and whether the step is skipped) says the writer's own norm gather completed, not
    that every node's did: the gather can return on one node and be cut short on another (the
    first killed right after, its part discarded with its socket), and the survivors then
    replay the iteration. So a committed gradient is applied only once the writer's next
    message shows every node committed it: its next gradient (reduced after every node ran
    the next iteration, which none starts before its own gather completes), or an END or a
    new writer's HELLO, which say the iteration the nodes agreed to resume at. Applied at the
    COMMIT, the shadow was an iteration ahead of the job after such a loss, and the new
    writer stopped the job."""

    iteration: int
    flat: torch.Tensor
    commit: tuple[torch.Tensor | None, bool] | None = None


class LinkBroken(Exception):
    """The writer went away mid-link (it crashed); the next writer opens a new link."""


def _on_link(call: Callable[[], T]) -> T:
    """`call()`, an operation on the link to the writer. A writer that is gone makes gloo
    raise, when the operation waits or already when it is posted (the connection closed
    between two messages): either way the link is broken, and the shadow waits for the next
    writer (LinkBroken) rather than failing the job."""
    try:
        return call()
    except RuntimeError as exc:
        raise LinkBroken(str(exc).splitlines()[0]) from None


def _nice() -> int | None:
    """The calling thread's nice value (None where it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


class Shadow:
    def __init__(self, cfg: Config, spec: job.RunSpec, run_dir: Path, stage: int,
                 store: dist.Store, t0: float, namespace: str = "spotpipe",
                 link_store: dist.Store | None = None) -> None:
        self.cfg, self.run_dir, self.stage = cfg, run_dir, stage
        self.partition = tuple((start, end) for start, end in spec.partition)
        self.store, self.namespace = store, namespace
        # The wait for the next writer's link gets a connection of its own: a TCPStore
        # client serves one request at a time, so on the shared one the applier's marks and
        # checkpoint events would queue behind that wait until a writer came (measured: a
        # set behind another thread's wait returns only when the wait does).
        self.link_store = link_store if link_store is not None else store
        self.name = f"shadow{stage}"
        protocol = channel_from_env(self.name)
        self.channel = Outbox(store, protocol, t0)
        # the links and marks are not protocol messages: sealed all the same (store/sealed.py)
        self.sealed = SealedStore(store, protocol.key, on_refused=lambda why: self.channel.event(
            "record_refused", writer=why.writer, reason=why.reason[:300]))
        model, _ = job.build_model_holding(cfg, run_dir, range(*spec.partition[stage]))
        state = nodelib.build_stage_state(model, spec.partition, stage, cfg, torch.device("cpu"))
        self.module, self.optimizer = state.module, state.optimizer
        replica = ReplicaStage(stage, self.module, self.optimizer, torch.device("cpu"))
        self.grad_size = replica.grad_message_size()
        self.num_params = len(replica.params)
        self.submitted = -1  # the newest iteration handed to the applier
        resume = os.environ.get("SPOTPIPE_RESUME")
        if resume:
            ckpt = durable.verify(Path(resume))
            durable.load_stage(ckpt, self.module, self.optimizer)
            self.submitted = ckpt.next_iteration - 1
        # the newest gradient received and not yet applied, with its writer's COMMIT once that
        # came: applied when the writer's next message shows every node committed it
        self.pending: _Pending | None = None
        self.digests = (DigestLog(run_dir / "logs" / f"digests.{self.name}.jsonl")
                        if cfg.logging.state_digests else None)
        # the writer waits once the backlog reaches shadow.max_lag: from there on the
        # applier runs at normal priority (see `main`)
        self.applier = ReplicaApplier(replica, cfg, self.digests, role="shadow", max_lag=None,
                                      urgent_lag=cfg.shadow.max_lag, on_applied=self._applied)
        self.applier.start_at(self.submitted + 1)
        self.max_lag_seen = 0
        self.links = 0
        self.writer: str | None = None  # the node on the current link (named in refusals)
        self.checkpoint_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")

    @property
    def applied(self) -> int:
        """The iteration whose state the shadow holds, once every submitted step is applied."""
        self.applier.drain()
        return self.applier.applied

    def run(self) -> None:
        last = self.cfg.iterations - 1
        self.channel.event("shadow_ready", stage=self.stage, iteration=self.submitted)
        # From here this thread (and the gloo threads its links start) only moves messages:
        # at the lowest weight (nice 19) it still runs within milliseconds on a host whose
        # cores are busy, unlike at idle priority, yet rarely preempts a worker when a message
        # wakes it (at nice 0 that cost a co-located writer 1.5 ms per iteration). It started
        # at normal priority: beside CPU-bound processes it could not otherwise start at all.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux, or not permitted: it stays normal
            pass
        while True:
            self.links += 1
            key = link_key(self.namespace, self.stage, self.links)
            wait_unbounded(self.link_store, [key])  # (the next writer: as long as the job runs)
            # (a record squatted ahead of the writer waits for the writer's, as long)
            rendezvous = self.sealed.rendezvous(timedelta(days=7).total_seconds())
            info = json.loads(rendezvous.get(key))
            self.writer = info["node"]
            group = pair_group(rendezvous, self.namespace, self.stage, self.links, 0,
                               self.cfg.cluster.timeout_s)
            try:
                ended = self._serve(group)
            except LinkBroken as why:
                self.channel.event("shadow_link_lost", stage=self.stage, writer=info["node"],
                                   iteration=self.applied, reason=str(why)[:200])
                continue
            finally:
                self._forget_link(self.links)
            if ended and self.submitted >= last:
                break
        self.applier.close()
        self.channel.event("shadow_done", stage=self.stage, iteration=self.applied,
                           max_lag=self.max_lag_seen, links=self.links,
                           cpu_s=round(time.process_time(), 3),  # what the shadow costs a host
                           receiver_nice=_nice())

    def _forget_link(self, number: int) -> None:
        """Delete the records of link `number`, which is over: its own, and its gloo
        rendezvous's (each rank's address, under the group's prefix, where torch's gloo puts
        them), so that the store keeps those of the live link only, however many writers
        come (a writer renews its link after every long recovery, too)."""
        group = keys.shadow_groups(self.namespace, self.stage, number)
        for key in (link_key(self.namespace, self.stage, number), f"{group}/0/0",
                    f"{group}/0/1"):
            self.sealed.delete_key(key)

    # ------------------------------------------------------------------ one link

    def _recv(self, group: object, tensor: torch.Tensor) -> torch.Tensor:
        _on_link(lambda: group.recv([tensor], 1, 0).wait())  # type: ignore[attr-defined]
        return tensor

    def _serve(self, group: object) -> bool:
        """Follow one writer until it ends the link (True) or disappears (LinkBroken)."""
        ahead: tuple[Any, torch.Tensor] | None = None  # the next gradient's receive, posted
        try:
            while True:
                kind, t, arg, bits = self._recv(group,
                                                torch.empty(4, dtype=torch.int64)).tolist()
                if kind == HELLO:
                    # a second HELLO would post the gradient's receive again and leave the
                    # first pending, on which the group's teardown can block
                    if ahead is not None:
                        raise self._refused("a second HELLO on the link")
                    self._settle(resume=t, scale=scale_from_bits(bits))
                    applied = self.applied  # (drains the applier: the state sent is of `applied`)
                    flat = flatten(self.module, self.optimizer) if arg else torch.empty(0)
                    _on_link(lambda: group.send(  # type: ignore[attr-defined]
                        [header(ACK, applied, flat.numel())], 1, 0).wait())
                    if arg:
                        _on_link(lambda: group.send(  # type: ignore[attr-defined]
                            [flat], 1, 0).wait())
                        self.channel.event("shadow_restored", stage=self.stage,
                                           iteration=self.applied,
                                           bytes=flat.numel() * flat.element_size())
                    ahead = self._post_gradient(group)
                elif kind == GRAD:
                    if ahead is None:
                        raise self._refused("a gradient before HELLO")
                    flat = self._wait(*ahead)
                    ahead = None
                    if arg != self.grad_size:  # (gloo takes a shorter one without a word)
                        raise self._refused(f"the gradient of iteration {t} has {arg} values, "
                                            f"the stage's has {self.grad_size}")
                    # the writer reduced this gradient: every node committed the iteration
                    # before it (see `_Pending`)
                    self._confirm(t - 1)
                    # kept before the next receive is posted: a writer gone right after this
                    # gradient makes that post raise (LinkBroken), and the new writer's HELLO
                    # settles the pending gradient with the scale the survivors committed
                    self.pending = _Pending(t, flat)
                    self.max_lag_seen = max(self.max_lag_seen, t - self.applier.applied)
                    ahead = self._post_gradient(group)
                elif kind == COMMIT:
                    if self.pending is None or self.pending.iteration != t:
                        raise self._refused(f"commit of iteration {t} without its gradient "
                                            f"(holding {self.pending and self.pending.iteration})")
                    # arg 1: the step is skipped on every node (training.nonfinite: skip)
                    self.pending.commit = (scale_from_bits(bits), bool(arg))
                elif kind == END:  # (with it, what completes the receive posted ahead)
                    self._settle(resume=t, scale=scale_from_bits(bits))
                    if ahead is not None:
                        self._finish_ahead(*ahead)
                    return True
                else:
                    raise self._refused(f"unknown message kind {kind}")
        # Only a broken link has its receive posted ahead completed here (it fails at once).
        # Any other error (a refusal) stops the shadow with that receive left pending: it
        # completes only when the writer sends its next gradient, up to cluster.timeout_s
        # later, and waiting for it held the refusal back, and the job's stop with it. No
        # destructor of the group runs after that: `main` says why the shadow stopped and
        # leaves by os._exit.
        except LinkBroken:
            if ahead is not None:
                self._finish_ahead(*ahead)
            raise

    def _refused(self, what: str) -> RuntimeError:
        """A message that breaks the protocol, from a writer that holds the job's key (a bug,
        not a loss): refused before it touches the state, and the shadow stops, named with
        its writer, so the job stops with that message rather than train on a wrong shadow."""
        return RuntimeError(f"shadow of stage {self.stage}: {what} (writer {self.writer})")

    def _finish_ahead(self, work: Any, buffer: torch.Tensor) -> None:
        """Complete the receive posted ahead on a link that ends, before the link's group is
        dropped: the writer's END comes with a short message under GRAD_TAG that matches it,
        and on a link that broke it fails at once. (A gloo object with an operation pending
        can block in its destructor; kept instead, each link left a gradient's buffer and
        its sockets behind for as long as the shadow ran.)"""
        try:
            work.wait()
        except RuntimeError:
            pass

    def _post_gradient(self, group: Any) -> tuple[Any, torch.Tensor]:
        buffer = torch.empty(self.grad_size)
        return _on_link(lambda: group.recv([buffer], 1, GRAD_TAG)), buffer

    def _wait(self, work: Any, tensor: torch.Tensor) -> torch.Tensor:
        _on_link(work.wait)
        return tensor

    def _confirm(self, iteration: int) -> None:
        """Every node committed `iteration`: apply its gradient if it is the one pending with
        its writer's COMMIT. (A gradient pending without one is replaced by the next, as
        before: the iteration is replayed on this link.)"""
        held = self.pending
        if held is not None and held.commit is not None:
            if held.iteration != iteration:
                raise self._refused(f"gradient of iteration {iteration + 1} after the commit "
                                    f"of {held.iteration}")
            self._submit(held.iteration, held.flat, *held.commit)

    def _settle(self, resume: int, scale: torch.Tensor | None) -> None:
        """A writer starts (HELLO) or ends (END) its link at `resume`, which every node agreed:
        iteration resume - 1 was committed by the survivors, so a gradient of it still pending
        is applied (with its COMMIT's scale, or the one the writer brings where its COMMIT was
        lost); a later one was not, and will be sent again when the iteration is replayed,
        even if its writer, lost since, had committed it alone."""
        held = self.pending
        if resume - 1 not in (self.submitted, self.submitted + 1):
            # no writer the nodes agreed on resumes there (it gets ACK(applied) and refuses
            # it): what the shadow holds waits for the next writer, untouched
            self.channel.event("shadow_refused", stage=self.stage, writer=self.writer,
                               reason=f"resume at iteration {resume}, the shadow holding "
                                      f"{self.submitted}")
            return
        if held is not None:
            if held.iteration == resume - 1 and self.submitted == held.iteration - 1:
                if held.commit is not None:
                    self._submit(held.iteration, held.flat, *held.commit)
                else:
                    self._submit(held.iteration, held.flat, scale)
                    self.channel.event("shadow_settled", stage=self.stage,
                                       iteration=held.iteration)
            self.pending = None

    def _submit(self, iteration: int, flat: torch.Tensor, scale: torch.Tensor | None,
                skip: bool = False) -> None:
        if iteration != self.submitted + 1:
            raise self._refused(f"iteration {iteration} after {self.submitted}")
        nan = scale is not None and bool(torch.isnan(scale))
        if scale is not None and not nan and not 0.0 <= float(scale) <= 1.0:
            # a clipping scale is min(1, max_norm / norm): any other (inf) would corrupt the
            # whole stage in one step
            raise self._refused(f"iteration {iteration} committed with the clipping scale "
                                f"{float(scale)}, not in [0, 1]")
        # a NaN scale, which a HELLO brings for a commit whose COMMIT was lost: a skipped step
        # (fp16's, which backs the loss scale off; else training.nonfinite's, no step at all)
        if skip or (nan and self.cfg.precision != "fp16"):
            self.applier.submit(iteration, "none", None)
        else:
            clip = None
            if nan:  # fp16: skipped, the scale backs off
                mark_skipped(flat, self.num_params)
            elif self.cfg.optimizer.grad_clip > 0:
                if scale is None:
                    raise self._refused(f"iteration {iteration} committed without its "
                                        "clipping scale")
                clip = scale  # applied on the applier's thread, at its priority
            self.applier.submit(iteration, "grad", flat, scale=clip)
        self.submitted = iteration
        self.pending = None

    def _applied(self, iteration: int) -> None:
        """On the applier's thread, after iteration `iteration`'s step."""
        self.sealed.set(applied_key(self.namespace, self.stage, iteration), "")
        self.sealed.set(latest_key(self.namespace, self.stage), str(iteration))
        # a writer waits on no mark older than shadow.max_lag iterations behind the one it
        # sends (`ShadowWriter.post_grad`), which is past this one: older marks go, so that
        # the store holds a few per stage, not one per iteration of the job
        self.sealed.delete_key(applied_key(self.namespace, self.stage,
                                           iteration - self.cfg.shadow.max_lag - 1))
        every = self.cfg.checkpoint.every
        if every and (iteration + 1) % every == 0:
            started = time.perf_counter()
            try:
                sums = durable.save_stage(self.checkpoint_root, iteration, self.stage,
                                          self.module, self.optimizer)
            except durable.WRITE_ERRORS as exc:  # an event; the shadow goes on (see schemes)
                durable.discard_stage(self.checkpoint_root, iteration, self.stage)
                self.channel.event("checkpoint_failed", iteration=iteration, stage=self.stage,
                                   writer="shadow", message=f"{type(exc).__name__}: {exc}"[:300])
                return
            # (shadows keep the job at its launch partition: `cluster.coordinator.rules_for`)
            self.channel.event("checkpoint_saved", iteration=iteration, stage=self.stage,
                               checksums=sums, partition=self.partition,
                               save_s=round(time.perf_counter() - started, 6), writer="shadow")


def main() -> int:
    run_dir = Path(os.environ["SPOTPIPE_RUN_DIR"])
    t0 = float(os.environ.get("SPOTPIPE_T0", time.time()))
    stage = int(os.environ["SPOTPIPE_SHADOW_STAGE"])
    cfg = load_config(os.environ.get("SPOTPIPE_CONFIG") or run_dir / "config.yaml")
    # Only the applier's thread (the optimizer steps and the durable saves: the shadow's CPU
    # work) runs at idle priority, and at normal priority once its backlog reaches the
    # writer's shadow.max_lag. This thread and gloo's stay at normal priority: they only move
    # messages, and a writer's send completes only once this thread has posted the receive,
    # so at idle priority on a busy host every writer's commit would wait for a free core.
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (its supervisor's to stop: see cli.worker)
    spec = job.RunSpec.from_json(json.loads((run_dir / "run.json").read_text()))
    address = StoreAddress.from_env()
    store = address.connect(cfg.cluster.timeout_s)
    channel = Outbox(store, channel_from_env(f"shadow{stage}"), t0)
    try:
        with ThreadPoolExecutor(max_workers=1) as opener:
            # the links' connection opens while the stage is built: a connection can take
            # seconds where the resolver drops a lookup (README, "Not yet")
            links = opener.submit(address.connect, cfg.cluster.timeout_s)
            shadow = Shadow(cfg, spec, run_dir, stage, store, t0)
            shadow.link_store = links.result()
        shadow.run()
    except Exception as exc:
        traceback.print_exc()
        channel.event("shadow_error", stage=stage, message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(main())  # teardown of torch and gloo decides nothing (see cli.worker)
