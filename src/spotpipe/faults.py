"""Injected faults, as data: what `--fail`, `--notice` and `--hang` name.

Shared by the launcher (which parses and hands them to workers) and the runtime (whose
`Injector` fires them); see `spotpipe.runtime.faults` for how each takes the path of a real
failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PHASES = ("start", "forward", "backward", "all-reduce", "optimizer", "checkpoint", "upload",
          "regroup", "transfer", "handover")
# `upload`: right after a node announces a checkpoint stage it sends through the store (its host
# does not see the committing host's folder), before the first piece goes
# Phases of a recovery rather than of an iteration: they fire while the first generation that
# resumes at or after the fault's iteration forms (`regroup`: before its process groups exist;
# `transfer`: groups formed, before stage and replica states move, in the first such recovery
# that moves state to or from the node). A spot node is as likely to go while the job reshapes
# as at any other moment, and a main thread to stop there (`runtime.activity`). `handover`: a
# node leaving on a notice whose plan takes stages from it, before it sends them (its notice
# cut short).
RECOVERY_PHASES = ("regroup", "transfer", "handover")
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
        if nodes is not None and node not in nodes:
            raise FaultSpecError(f"--{kind} {text!r}: no node {node!r}; the job's nodes are "
                                 f"{', '.join(nodes)}")
        return cls(kind, node, int(m["iter"]), phase)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "node": self.node, "iteration": self.iteration,
                "phase": self.phase}
