"""Durable checkpoints committed off the coordinator's loop.

A commit writes the signed manifest, renames the folder into place and applies retention,
which hashes every checkpoint it keeps (so that a damaged one never pushes out a good one):
seconds per commit for a model of a few GB (SHA-256 runs at about 0.8 GB/s here), tens of
seconds for a large one; a stage uploaded through the store by a host that does not see the
checkpoint folder is taken piece by piece, hashed and written first (seconds per GB as well).
On the loop that also reads the workers' reports, every failure in that time waited for them
before its recovery began. So they run here: the loop hands over each upload as it is announced
and each commit when its stages are on disk, writes the outcomes as events on its next turn,
and waits for what is still running when the job ends (a restart reads the newest committed
checkpoint). Commits run in order on one thread of their own; uploads are taken at once, each
on a thread of a pool, since every host streams its stage at the same time and a slow host
must not hold the others' pieces (each sender waits for its pieces to be taken): the pool has
room for every receive that can be under way (`UPLOADS_AT_ONCE`).

Commits can come faster than they run: `checkpoint.every` is set (or worked out) from the
stall a checkpoint costs training, while each commit's retention hashes every checkpoint it
keeps. Queued one after another they would fall further behind at every checkpoint, their
folders filling the disk meanwhile. So a commit with a newer checkpoint ready behind it (its
stages on disk, no upload of it under way or failed) leaves retention to that one: it writes
its manifest and renames its folder (milliseconds), and stays a checkpoint to go back to
should the newer one fail to commit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotpipe.checkpoint import durable


@dataclass(frozen=True)
class Committed:
    """The outcome of one commit: its folder, or why it failed (the previous one stays)."""

    iteration: int
    time_s: float
    path: Path | None = None
    error: str = ""
    # newer checkpoints ready behind it when it was made: its retention was left to them
    retention_left_to: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Commit:
    iteration: int
    info: dict[str, Any]
    checksums: dict[str, str]


@dataclass(frozen=True)
class _Step:
    """Work an iteration's commit needs first (an uploaded stage to receive), under way on the
    pool: it returns what is wrong, "" when done; a problem means the iteration is never
    committed."""

    iteration: int
    result: Future[str]


# receives under way together, at least (each mostly waits for its sender). Every sender
# waits for its pieces to be taken, at most `cluster.timeout_s` for each: a receive queued
# behind others until then lost its checkpoint. So the pool holds as many as can be under way
# at once (`CheckpointIntake`: one per stage of each layout whose reports still count); its
# threads start only as receives need them.
UPLOADS_AT_ONCE = 16


class Committer:
    """One thread committing the checkpoints it is handed, oldest first."""

    def __init__(self, root: Path, keep: int, key: bytes, now: Callable[[], float],
                 uploads_at_once: int = UPLOADS_AT_ONCE) -> None:
        """`uploads_at_once`: the most receives that can be under way together (each runs at
        once, never queued; no fewer than UPLOADS_AT_ONCE)."""
        self.root, self.keep, self.key, self.now = root, keep, key, now
        self.uploads_at_once = max(UPLOADS_AT_ONCE, uploads_at_once)
        self._queue: queue.Queue[_Commit | _Step | None] = queue.Queue()
        self._handed = 0  # items handed over and not yet done (`idle`)
        self._failed: set[int] = set()  # iterations whose step failed (this thread's only)
        self._done: list[Committed] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, iteration: int, info: dict[str, Any], checksums: dict[str, str]) -> None:
        """Commit `iteration` once what was handed over before it is done."""
        self._put(_Commit(iteration, info, checksums))

    def submit_step(self, iteration: int, run: Callable[[], str]) -> None:
        """Start `run` now, beside the others; `iteration`'s commit waits for it, and a
        problem it returns fails the iteration. It runs even when the iteration has failed
        already (an upload's receive: its sender waits for each piece to be taken)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.uploads_at_once, thread_name_prefix="upload")
        self._put(_Step(iteration, self._pool.submit(_problem_of, run)))

    def _put(self, item: _Commit | _Step) -> None:
        if self._thread is None:  # (a job that never checkpoints starts no thread)
            self._thread = threading.Thread(target=self._run, name="checkpoint-commit",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            self._handed += 1
        self._queue.put(item)

    def idle(self) -> bool:
        """Nothing handed over is waiting or under way (a commit, an upload's receive)."""
        with self._lock:
            return self._handed == 0

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._take(item)
            finally:
                with self._lock:
                    self._handed -= 1

    def _take(self, item: _Commit | _Step) -> None:
        failed = item.iteration in self._failed
        if isinstance(item, _Step):
            problem = item.result.result()
            if problem and not failed:
                self._failed.add(item.iteration)
                with self._lock:
                    self._done.append(Committed(item.iteration, self.now(), error=problem))
            return
        if failed:
            return  # said once, by the step that failed
        newer = tuple(self._ready_behind(item.iteration))
        try:
            path = durable.commit(self.root, item.iteration, item.info, item.checksums,
                                  self.keep, self.key, apply_retention=not newer)
            result = Committed(item.iteration, self.now(), path=path, retention_left_to=newer)
        except OSError as exc:  # the disk is full or failing
            result = Committed(item.iteration, self.now(), error=f"commit: {exc}")
        except Exception as exc:  # noqa: BLE001 (a bug or a folder's surprise: see below)
            # Anything else (a damaged checkpoint that retention reads, a bug) must not end
            # this thread: it would go silently, with no checkpoint_failed event, and every
            # later item would stay handed over for ever, so `idle` would never be true again
            # (and a coordinator's hand-over, which waits for it, would never come).
            result = Committed(item.iteration, self.now(),
                               error=f"commit: {type(exc).__name__}: {exc}")
        with self._lock:
            self._done.append(result)

    def _ready_behind(self, iteration: int) -> list[int]:
        """The commits queued behind `iteration`'s that nothing can fail any more: none of
        their steps is under way or went wrong. (A step is handed over before its
        iteration's commit, so one not in the queue has been taken: `_failed` says how.)"""
        with self._queue.mutex:
            behind = list(self._queue.queue)
        unsure = {i.iteration for i in behind if isinstance(i, _Step)
                  and (not i.result.done() or i.result.result())} | self._failed
        return sorted(i.iteration for i in behind if isinstance(i, _Commit)
                      and i.iteration > iteration and i.iteration not in unsure)

    def finished(self) -> list[Committed]:
        """The commits done since the last call, in order."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def abandon(self) -> list[Committed]:
        """This coordinator was deposed: its successor commits from now on (two writers in
        one folder would race), so the commits not started are dropped; the one under way
        ends, and so do the receives (their senders wait on them; what they wrote is never
        committed here, and a successor commits only stage files whose hashes match)."""
        self.drop_pending()
        return self.close()

    def drop_pending(self) -> None:
        """Forget every commit handed over that has not started (receives under way go on)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                with self._lock:
                    self._handed -= 1

    def close(self) -> list[Committed]:
        """Wait for every commit handed over; the ones not yet taken by `finished`."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return self.finished()


def _problem_of(run: Callable[[], str]) -> str:
    """What `run` returns, or the error it raised (a step's failure, not the committer's)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 (the iteration fails, the job goes on)
        return f"{type(exc).__name__}: {exc}"
