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
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("start", "forward", "backward", "all-reduce", "optimizer", "checkpoint", "regroup",
          "transfer")
# Phases of a recovery rather than of an iteration: they fire while the first generation that
# resumes at or after the fault's iteration forms (`regroup`: before its process groups exist;
# `transfer`: groups formed, before stage and replica states move, in the first such recovery
# that moves state to or from the node). A spot node is as likely to go while the job reshapes
# as at any other moment.
RECOVERY_PHASES = ("regroup", "transfer")
KINDS = ("fail", "notice", "hang", "nan", "ioerror")
# kinds that happen at one place of the iteration: the phase is theirs, not the user's
FIXED_PHASE = {"nan": "all-reduce", "ioerror": "checkpoint"}
_SPEC = re.compile(r"^(?P<node>[A-Za-z0-9_.-]+)@(?P<iter>\d+)(?::(?P<phase>[a-z-]+))?$")


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str
    iteration: int
    phase: str = "start"

    @classmethod
    def parse(cls, kind: str, text: str, nodes: list[str] | None = None) -> "Fault":
        """`NODE@ITER[:PHASE]`, e.g. node2@5:backward; NODE may be a bare index (2)."""
        m = _SPEC.match(text.strip())
        if not m:
            raise FaultSpecError(f"--{kind} {text!r}: expected NODE@ITER[:PHASE], e.g. "
                                 "node1@5:backward")
        node = m["node"] if not m["node"].isdigit() else f"node{m['node']}"
        phase = m["phase"] or "start"
        if phase not in PHASES:
            raise FaultSpecError(f"--{kind} {text!r}: unknown phase {phase!r}; expected one of "
                                 f"{', '.join(PHASES)}")
        if kind in FIXED_PHASE:
            if m["phase"]:
                raise FaultSpecError(f"--{kind.replace('ioerror', 'io-error')} {text!r}: give no "
                                     "phase (expected NODE@ITER)")
            phase = FIXED_PHASE[kind]
        if kind == "notice" and phase != "start":
            raise FaultSpecError(f"--notice {text!r}: a notice arrives between iterations; "
                                 "give no phase")
        if kind == "hang" and phase in RECOVERY_PHASES:
            raise FaultSpecError(f"--hang {text!r}: a hang is injected in an iteration's phases "
                                 f"({', '.join(p for p in PHASES if p not in RECOVERY_PHASES)})")
        if nodes is not None and node not in nodes:
            raise FaultSpecError(f"--{kind} {text!r}: no node {node!r}; the job's nodes are "
                                 f"{', '.join(nodes)}")
        return cls(kind, node, int(m["iter"]), phase)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "node": self.node, "iteration": self.iteration,
                "phase": self.phase}


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
