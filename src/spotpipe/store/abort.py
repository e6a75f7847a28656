"""A generation's abort: the one signal that ends every wait of that generation.

It lives with the store clients because the store is where it comes from (a watcher thread
blocks on the generation's abort key) and because every waiting part of a node, the pipeline's
receives, the replica and shadow updates and the reshaping of the job, must end on the same
signal without importing the runtime.
"""

from __future__ import annotations

import os
import threading


class PeerFailure(RuntimeError):
    """A peer failed, or the job is re-forming: leave the iteration and recover."""


class AbortSignal:
    """Set once per generation; wakes every wait of that generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[threading.Event] = set()
        self._pipe: tuple[int, int] | None = None
        self._linked: list[AbortSignal] = []
        self.reason: str | None = None

    def trigger(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                if self._pipe is not None:
                    os.write(self._pipe[1], b"!")
            waiting, linked = list(self._waiting), self._linked
            self._linked = []
        for event in waiting:
            event.set()
        for signal in linked:
            signal.trigger(reason)

    def linked(self) -> AbortSignal:
        """A signal that this one triggers, and that can also be triggered alone: the groups
        formed ahead for a generation end with the generation's abort, but cancelling them
        (another plan was chosen) must not end the generation."""
        signal = AbortSignal()
        with self._lock:
            if self.reason is None:
                self._linked.append(signal)
                return signal
        signal.trigger(self.reason)
        return signal

    def wakeup_fd(self) -> int:
        """A descriptor that turns readable at the abort, for waits that `select` on sockets
        (runtime/local_link.py) rather than block on an Event."""
        with self._lock:
            if self._pipe is None:
                self._pipe = os.pipe()
                if self.reason is not None:
                    os.write(self._pipe[1], b"!")
            return self._pipe[0]

    def release(self) -> None:
        """Close the descriptor of `wakeup_fd` (the generation is over); a later trigger
        still records its reason."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            os.close(pipe[0])
            os.close(pipe[1])

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
