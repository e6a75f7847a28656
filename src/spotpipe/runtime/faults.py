"""Fault injection that takes the same path as real failures.

A crash is a real SIGKILL of the worker's own process, a notice a real SIGTERM (handled by the
same handler as the cloud's), a hang a main thread that stops making progress while its
heartbeat goes on. A `nan` puts a NaN into one of the node's gradients just before the
reduction (what an overflow does); an `ioerror` makes the node's checkpoint write of that
iteration fail as a full disk does (OSError ENOSPC, raised where the write starts). Nothing in
the recovery path knows a fault was injected.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable

from spotpipe.faults import RECOVERY_PHASES, Fault, FaultSpecError  # noqa: F401 (re-exported)


class Injector:
    """Fires this node's faults at their iteration and phase, once each."""

    def __init__(self, faults: list[Fault], node: str,
                 announce: Callable[[Fault], None]) -> None:
        self.pending = [f for f in faults if f.node == node]
        self.announce = announce
        # puts a NaN into one of the node's gradients (set by the worker, which owns them)
        self.poison: Callable[[], None] = lambda: None

    def __call__(self, phase: str, iteration: int) -> None:
        for fault in list(self.pending):
            if fault.phase == phase and (fault.iteration == iteration or (
                    phase in RECOVERY_PHASES and fault.iteration <= iteration)):
                self.pending.remove(fault)
                self.announce(fault)
                if fault.kind == "fail":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault.kind == "notice":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif fault.kind == "nan":
                    self.poison()
                elif fault.kind == "ioerror":
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                else:
                    threading.Event().wait()  # hung for good: only the launcher ends this


def per_node(spec: str, node: str) -> float:
    """This node's value in a test knob like "node0=1.5,node2=-30" (0.0 when not named)."""
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name == node:
            return float(value)
    return 0.0


def skew_clock(offset_s: float) -> None:
    """Shift this process's wall clock (time.time) by `offset_s`: a host whose clock is off.
    Liveness must not depend on it (the coordinator times heartbeats on its own clock)."""
    import time

    real = time.time
    time.time = lambda: real() + offset_s  # type: ignore[assignment]
