"""Checkpoint schemes behind one interface: what a worker does at the end of each iteration.

The worker calls `Scheme.after_iteration(Boundary(...))` once per completed iteration on every
node (the step of that iteration is applied) and `Scheme.close()` when it finishes. A scheme
decides with its `Cadence` whether this iteration is checkpointed, copies or writes the stages
this node writes (pipeline 0's owners, as for the durable tier), and records what that cost:

- `blocked_s`: seconds the training loop waited for the checkpoint (copy, write, or a wait for
  the previous asynchronous one), the figure that slows training;
- `bytes`: bytes written to disk or sent to a peer.

A checkpoint that cannot be written (a full disk, a permission, an I/O error) becomes a
`checkpoint_failed` event and nothing else: training goes on, the launcher commits nothing of
that iteration (the previous checkpoint stays the newest), and the next one is tried as
scheduled.

Each completed checkpoint of a stage becomes one event (`checkpoint_saved` for the durable tier,
which the launcher commits once every stage of the iteration has reported; `checkpoint_done`
for the baselines; `checkpoint_held` on a peer that received a copy) and one entry of
`Scheme.records`, which in-process benchmarks read directly.

Schemes (config `checkpoint.scheme`; `checkpoint.every: k | auto`):

- `none`: nothing.
- `durable` (default): the resumable DCP tier (`durable.py`) written synchronously.
- `dcp_async`: the same tier written with `torch.distributed.checkpoint.async_save`: the state
  is staged (copied to CPU memory) at the boundary and written by DCP's thread; this node's
  `checkpoint_saved` (with the files' SHA-256) is reported only once the write has finished, so
  the launcher commits nothing unfinished. Each stage saves on its own (`no_dist=True`, one DCP
  folder per stage, the layout `durable.load_stage` reshards from), so no process group is
  involved: async_save would otherwise need a CPU (gloo) backend in its group, which a
  NCCL-only generation lacks. The next checkpoint waits for the previous one.
- `torch_save`: synchronous `torch.save` of the stage state every k (`snapshot.write_file`).
- `checkfreq`: CheckFreq (Mohan et al., FAST '21): snapshot to CPU memory at the boundary, then
  persist in a background thread; the next snapshot waits for the previous persist.
- `gemini`: Gemini (Wang et al., SOSP '23): a copy in a peer's CPU memory (`peer.py`).

A new scheme is a subclass registered in `spotpipe.checkpoint.registry.SCHEMES` under its
config name.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spotpipe.checkpoint import durable, snapshot
from spotpipe.checkpoint.interval import interval_iterations, mtbf_estimate
from spotpipe.protocol import keys
from spotpipe.config import Config
from spotpipe.runtime.hooks import Boundary  # noqa: F401 (re-exported)
from spotpipe.protocol.auth import Refused

WRITE_ERRORS = durable.WRITE_ERRORS


@dataclass
class SchemeContext:
    """What a scheme needs from its worker, fixed for the worker's life."""

    cfg: Config
    node: str
    run_dir: Path
    event: Callable[..., None]  # (kind, **fields) -> one line of events.jsonl
    store: Any  # the job's store, sealed (store/sealed.py): agreed cadence, peer-copy layouts
    namespace: str = "spotpipe"
    failures: Callable[[], int] = lambda: 0  # failures this node has seen so far
    # the fault injector's hook, called as ("checkpoint", iteration) where a write starts
    inject: Callable[[str, int], None] = lambda phase, iteration: None
    # the committing host does not see this node's checkpoint folder (spotpipe agent's probe):
    # durable stages travel through the store (transfer.py), on a connection of the uploader's
    # own that `upload_store` opens (None: `store`)
    upload: bool = False
    upload_store: Callable[[], Any] | None = None

    @property
    def root(self) -> Path:
        """Where this scheme writes: the durable tier's folder, or one per baseline."""
        c = self.cfg.checkpoint
        if c.scheme in ("durable", "dcp_async"):
            return Path(c.dir or self.run_dir / "checkpoints")
        return Path(c.dir or self.run_dir / f"checkpoints_{c.scheme}")


class Cadence:
    """Which iterations are checkpointed: every k, or k from Young/Daly (`every: auto`).

    With `auto`, the first checkpoint is taken after iteration `first_at` (the first iteration
    carries warm-up costs, not representative ones); after each checkpoint the nodes agree, by
    an all-gather in the generation's group, on the largest blocked time, iteration time,
    elapsed time and count of failures seen, so that every node picks the same next iteration
    (the launcher commits an iteration only when every stage has written it). The agreed next
    iteration is also put in the store, where a node that joins later reads it.
    """

    def __init__(self, cfg: Config, ctx_failures: Callable[[], int], store: Any,
                 namespace: str, first_at: int = 1, max_k: int = 10_000,
                 event: Callable[..., None] = lambda kind, **fields: None) -> None:
        every = cfg.checkpoint.every
        self.auto = every == "auto"
        self.every = 0 if self.auto else int(every)
        self.mtbf_prior_s = cfg.checkpoint.mtbf_s
        self.failures = ctx_failures
        self.store, self.key = store, keys.checkpoint_next_at(namespace)
        self.first_at, self.max_k = first_at, max_k
        self.event = event
        self.next_at: int | None = None
        self.k: int | None = None if self.auto else self.every
        self.started = time.perf_counter()
        self._last_call: float | None = None
        self._last_blocked = 0.0
        self._iteration_s: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.auto or self.every > 0

    def due(self, iteration: int) -> bool:
        if not self.auto:
            return self.every > 0 and (iteration + 1) % self.every == 0
        if self.next_at is None:
            try:
                stored = self.store.check([self.key]) and self.store.get(self.key)
            except Refused:  # not the job's record (an event says so): start afresh
                stored = b""
            self.next_at = int(stored) if stored else self.first_at
        return iteration >= self.next_at

    def tick(self, now: float) -> None:
        """Called at each boundary: the iteration time is the time between two boundaries less
        what the previous checkpoint blocked."""
        if self._last_call is not None:
            self._iteration_s.append(max(1e-9, now - self._last_call - self._last_blocked))
            del self._iteration_s[:-32]
        self._last_call = now
        self._last_blocked = 0.0

    def checkpointed(self, iteration: int, blocked_s: float, comm: Any) -> None:
        self._last_blocked = blocked_s
        if not self.auto:
            return
        it = statistics.median(self._iteration_s) if self._iteration_s else 0.0  # unknown
        # (the failures too: a node that joined late, or left a generation by a regroup,
        # counts fewer, and a count of its own would give it an interval of its own)
        mine = torch.tensor([blocked_s, it, time.perf_counter() - self.started,
                             self.failures()], dtype=torch.float64, device=comm.device)
        agreed = torch.stack(comm.all_gather(mine)).max(dim=0).values.tolist()
        cost, it, elapsed, failures = agreed
        it = it if it > 0 else 1.0  # no node has timed an iteration yet
        mtbf = mtbf_estimate(self.mtbf_prior_s, elapsed, int(failures))
        self.k = interval_iterations(cost, mtbf, it, max_iterations=self.max_k)
        self.next_at = iteration + self.k
        self.store.set(self.key, str(self.next_at))
        self.event("checkpoint_interval", iteration=iteration, k=self.k, next_at=self.next_at,
                   cost_s=round(cost, 6), iteration_s=round(it, 6), mtbf_s=round(mtbf, 3))


class Scheme:
    """No checkpoints; the base of every scheme (see the module docstring)."""

    name = "none"

    def __init__(self, ctx: SchemeContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.cadence = Cadence(ctx.cfg, ctx.failures, ctx.store, ctx.namespace,
                               event=ctx.event)
        self.records: list[dict[str, Any]] = []  # one per completed checkpoint of a stage
        self.blocked_s = 0.0  # total seconds the loop waited in this scheme
        self.bytes = 0  # total bytes written or sent
        self.checkpoints = 0  # boundaries at which this node checkpointed
        # False: files written as the baseline systems write them, with no SHA-256 of spotpipe's
        # own (bench checkpoint's baselines: a torchrun user's torch.save or DCP save hashes
        # nothing); such a checkpoint is neither committed nor resumed from
        self.checksums = True
        self.uploads = Uploader(ctx) if ctx.upload else None

    def after_iteration(self, b: Boundary) -> None:
        if self.name == "none" or not self.cadence.enabled:
            return
        started = time.perf_counter()
        self.cadence.tick(started)
        self.poll(b, wait=False)
        due = self.cadence.due(b.iteration)
        self._report_uploads(wait=due)  # the next checkpoint waits for the previous upload
        if due:
            self.save(b)
            self.checkpoints += 1
        blocked = time.perf_counter() - started
        self.blocked_s += blocked
        if due:
            self.cadence.checkpointed(b.iteration, blocked, b.comm)

    def save(self, b: Boundary) -> None:
        """Checkpoint `b.stages` at `b.iteration` (blocking only as long as the scheme must)."""

    def poll(self, b: Boundary | None, wait: bool) -> None:
        """Report asynchronous checkpoints that have completed (all of them, if `wait`)."""

    def close(self) -> None:
        """Finish what is in flight (the worker is done)."""
        started = time.perf_counter()
        self.poll(None, wait=True)
        self._report_uploads(wait=True)
        if self.uploads is not None:
            self.uploads.close()
        self.blocked_s += time.perf_counter() - started

    def _failed(self, iteration: int, stage: int, exc: BaseException) -> None:
        """A stage's checkpoint that could not be written: an event, and training goes on."""
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        self.records.append({"kind": "checkpoint_failed", "iteration": iteration,
                             "stage": stage, "message": message})
        self.ctx.event("checkpoint_failed", scheme=self.name, iteration=iteration, stage=stage,
                       message=message)

    def _report_uploads(self, wait: bool) -> None:
        """Report the stages whose upload has finished (all of them, if `wait`)."""
        if self.uploads is None:
            return
        for sent in self.uploads.finished(wait):
            if sent.error is not None:  # the store refused: this one is lost
                self._failed(sent.iteration, sent.stage, sent.error)
            else:
                sent.report(uploaded=True, upload_s=round(sent.seconds, 6))

    def _record(self, kind: str, iteration: int, stage: int, blocked_s: float, nbytes: int,
                counted: bool = True, done_time: float | None = None, **extra: Any) -> None:
        """One completed checkpoint of one stage; `counted` false for bytes another node
        already counted (a copy received); `done_time` (wall clock) when it completed, if
        before now. A durable stage that must travel to the committing host is reported once
        it has (`Uploader`)."""
        report = functools.partial(self._record_now, kind, iteration, stage, blocked_s, nbytes,
                                   counted, done_time, **extra)
        if kind != "checkpoint_saved" or self.uploads is None:
            report()
            return
        # the committing host starts taking the pieces on this (transfer.py)
        self.ctx.event("checkpoint_upload", iteration=iteration, stage=stage,
                       checksums=extra["checksums"])
        self.ctx.inject("upload", iteration)  # (announced, nothing sent yet)
        self.uploads.submit(Upload(iteration, stage, extra["checksums"], report))

    def _record_now(self, kind: str, iteration: int, stage: int, blocked_s: float,
                    nbytes: int, counted: bool, done_time: float | None, **extra: Any) -> None:
        if counted:
            self.bytes += nbytes
        entry = {"iteration": iteration, "stage": stage, "blocked_s": round(blocked_s, 6),
                 "bytes": nbytes, "done_time": done_time or time.time(), **extra}
        self.records.append({"kind": kind, **entry})
        fields = {k: v for k, v in entry.items() if k != "done_time"}
        self.ctx.event(kind, scheme=self.name, k=self.cadence.k, **fields)


@dataclass
class Upload:
    """One written stage on its way to the committing host, and the report it waits to give."""

    iteration: int
    stage: int
    checksums: dict[str, str]
    report: Callable[..., None]  # the scheme's event and record, given the upload's fields
    seconds: float = 0.0
    error: BaseException | None = None


class Uploader:
    """Sends written stages to the committing host (transfer.py) on a thread of its own, one
    after the other, while training goes on: a stage through the store takes seconds per GB,
    which the loop used to wait for. The thread has its own store connection, since a store
    client serialises its calls and the loop's own must not queue behind a stage's pieces.
    The loop announces each stage (`checkpoint_upload`, which starts the committing host's
    receive) and reports it, and so lets it be committed, once all of it has been taken;
    the local copy is not the checkpoint, so it is removed then."""

    def __init__(self, ctx: SchemeContext) -> None:
        self.ctx = ctx
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-upload")
        self._pending: list[tuple[Upload, Future]] = []
        self._store: Any = None

    def submit(self, upload: Upload) -> None:
        self._pending.append((upload, self._pool.submit(self._send, upload)))

    def finished(self, wait: bool) -> list[Upload]:
        """The uploads done, in submission order (all, if `wait`)."""
        out = []
        while self._pending and (wait or self._pending[0][1].done()):
            upload, job = self._pending.pop(0)
            job.result()  # (_send keeps its errors in the upload)
            out.append(upload)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _send(self, upload: Upload) -> None:
        started = time.perf_counter()
        try:
            if self._store is None:
                opener = self.ctx.upload_store
                self._store = opener() if opener is not None else self.ctx.store
            folder = durable.iter_dir(self.ctx.root, upload.iteration, partial=True)
            # (given up once the coordinator it announced the stage to is gone)
            receiver = durable.transfer.ReceiverWatch.of(
                self._store, every_s=self.ctx.cfg.failover.heartbeat_s)
            durable.transfer.send_stage(self._store, upload.iteration, upload.stage, folder,
                                        upload.checksums,
                                        timeout_s=self.ctx.cfg.cluster.timeout_s,
                                        receiver=receiver)
        except Exception as exc:  # noqa: BLE001 - reported by the loop as checkpoint_failed
            upload.error = exc
            if self.ctx.upload_store is not None:
                self._store = None  # (a connection whose wait timed out: the next one is new)
        durable.discard_stage(self.ctx.root, upload.iteration, upload.stage)  # sent or lost
        upload.seconds = time.perf_counter() - started


class DurableScheme(Scheme):
    """The DCP tier, written synchronously (what `checkpoint.every` always did)."""

    name = "durable"

    def save(self, b: Boundary) -> None:
        for s, (module, optimizer) in sorted(b.stages.items()):
            started = time.perf_counter()
            try:
                self.ctx.inject("checkpoint", b.iteration)
                sums = durable.save_stage(self.ctx.root, b.iteration, s, module, optimizer)
            except WRITE_ERRORS as exc:
                durable.discard_stage(self.ctx.root, b.iteration, s)
                self._failed(b.iteration, s, exc)
                continue
            spent = time.perf_counter() - started
            folder = durable.iter_dir(self.ctx.root, b.iteration, partial=True)
            size = sum((folder / name).stat().st_size for name in sums)
            self._record("checkpoint_saved", b.iteration, s, spent, size, checksums=sums,
                         partition=b.partition, save_s=round(spent, 6))


class _Background(Scheme):
    """A scheme whose write runs on a background thread: at most one checkpoint in flight
    (the next one waits for the previous), reported once written."""

    kind = "checkpoint_done"

    def __init__(self, ctx: SchemeContext) -> None:
        super().__init__(ctx)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-persist")
        # (iteration, stage, its partition, seconds blocked, wall-clock start, job returning
        # (bytes, extra fields, wall-clock end))
        self._pending: list[tuple[int, int, tuple[tuple[int, int], ...], float, float,
                                  Future]] = []

    def save(self, b: Boundary) -> None:
        self.poll(b, wait=True)  # the next checkpoint waits for the previous one
        for s, (module, optimizer) in sorted(b.stages.items()):
            started, wall = time.perf_counter(), time.time()
            try:
                self.ctx.inject("checkpoint", b.iteration)
                write = self.start(b.iteration, s, module, optimizer)
            except WRITE_ERRORS as exc:
                self._discard(b.iteration, s)
                self._failed(b.iteration, s, exc)
                continue
            job = self._thread.submit(lambda write=write: (*write(), time.time()))
            self._pending.append((b.iteration, s, b.partition, time.perf_counter() - started,
                                  wall, job))

    def start(self, iteration: int, stage: int, module: nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[], tuple[int, dict[str, Any]]]:
        """Copy what must be copied now; return the write, run on the background thread, which
        returns the bytes written and the event's extra fields."""
        raise NotImplementedError

    def poll(self, b: Boundary | None, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][5].done()):
            iteration, s, partition, spent, started, job = self._pending.pop(0)
            waited = time.perf_counter()
            try:
                nbytes, extra, done_time = job.result()
            except WRITE_ERRORS as exc:  # (the wait is in the caller's span, as any)
                self._discard(iteration, s)
                self._failed(iteration, s, exc)
                continue
            spent += time.perf_counter() - waited
            if self.kind == "checkpoint_saved":
                extra["partition"] = partition
            self._record(self.kind, iteration, s, spent, nbytes, done_time=done_time,
                         persist_s=round(done_time - started, 6), **extra)

    def _discard(self, iteration: int, stage: int) -> None:
        """Remove what a failed write of one stage left (nothing, where the write cleans up)."""

    def close(self) -> None:
        super().close()
        self._thread.shutdown(wait=True)


class DcpAsyncScheme(_Background):
    """The DCP tier, written with async_save; reported (and so committed) once written."""

    name = "dcp_async"
    kind = "checkpoint_saved"

    def start(self, iteration: int, stage: int, module: nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[], tuple[int, dict[str, Any]]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        folder = durable.prepare_stage_folder(self.ctx.root, iteration, stage)
        # stages (copies to CPU memory) now, writes on DCP's own thread
        upload = dcp.async_save(durable.stage_tensors(module, optimizer),
                                storage_writer=durable.stage_writer(folder), no_dist=True)

        def finish() -> tuple[int, dict[str, Any]]:
            try:
                upload.result()
            except CheckpointException as exc:
                raise durable.write_error(folder, exc) from exc
            if not self.checksums:  # as DCP leaves it
                return sum(f.stat().st_size for f in folder.iterdir()), {"checksums": {}}
            sums = durable.stage_checksums(folder, stage)  # hashed here, off the training loop
            size = sum((folder.parent / name).stat().st_size for name in sums)
            return size, {"checksums": sums}

        return finish

    def _discard(self, iteration: int, stage: int) -> None:
        """A failed stage's folder is never committed, but would take space (on a disk that
        may be the full one) until the next job takes the folder up."""
        durable.discard_stage(self.ctx.root, iteration, stage)


class TorchSaveScheme(Scheme):
    """Synchronous torch.save of each stage (the simplest baseline)."""

    name = "torch_save"

    def save(self, b: Boundary) -> None:
        for s, (module, optimizer) in sorted(b.stages.items()):
            started = time.perf_counter()
            snap = snapshot.take(s, b.iteration, module, optimizer, copy=False)
            try:
                self.ctx.inject("checkpoint", b.iteration)
                nbytes = snapshot.write_file(self.ctx.root, snap, self.cfg.model_digest(),
                                             self.cfg.checkpoint.keep, sidecar=self.checksums)
            except WRITE_ERRORS as exc:
                self._failed(b.iteration, s, exc)
                continue
            self._record("checkpoint_done", b.iteration, s, time.perf_counter() - started,
                         nbytes)


class CheckFreqScheme(_Background):
    """Snapshot to CPU memory at the boundary, persist in the background; the next snapshot
    waits for the previous persist (CheckFreq's two phases, without its adaptive tuning)."""

    name = "checkfreq"

    def start(self, iteration: int, stage: int, module: nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[], tuple[int, dict[str, Any]]]:
        snap = snapshot.take(stage, iteration, module, optimizer)

        def persist() -> tuple[int, dict[str, Any]]:
            return snapshot.write_file(self.ctx.root, snap, self.cfg.model_digest(),
                                       self.cfg.checkpoint.keep, sidecar=self.checksums), {}

        return persist
