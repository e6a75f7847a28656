"""A generation's abort: the one signal that ends every wait of that generation.

It lives with the store clients because the store is where it comes from (a watcher thread
blocks on the generation's abort key) and because every waiting part of a node, the pipeline's
receives, the replica and shadow updates and the reshaping of the job, must end on the same
signal without importing the runtime.
"""

from __future__ import annotations

import threading


class PeerFailure(RuntimeError):
    """A peer failed, or the job is re-forming: leave the iteration and recover."""


class AbortSignal:
    """Set once per generation; wakes every wait of that generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[threading.Event] = set()
        self.reason: str | None = None

    def trigger(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            waiting = list(self._waiting)
        for event in waiting:
            event.set()

    @property
    def is_set(self) -> bool:
        return self.reason is not None

    def check(self) -> None:
        if self.reason is not None:
            raise PeerFailure(self.reason)

    def wait(self, done: threading.Event) -> None:
        """Block until `done` is set or the abort is; raise PeerFailure on abort."""
        with self._lock:
            self._waiting.add(done)
        try:
            if self.reason is None:
                done.wait()
        finally:
            with self._lock:
                self._waiting.discard(done)
        if not done.is_set() or self.reason is not None:
            raise PeerFailure(self.reason or "aborted")
