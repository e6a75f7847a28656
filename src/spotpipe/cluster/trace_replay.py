"""Replays a preemption trace onto the local cluster, through the real failure paths.

Trace nodes are mapped onto worker nodes in the order the trace first makes them available;
a removal of a mapped node at trace time t happens at t / time_scale seconds after training
starts, as a SIGKILL (a crash) or a SIGTERM (a notice), exactly what a real preemption does.
Additions are recorded as events: nodes joining a running job is the membership issue's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotpipe.traces import Trace

REMOVE = "remove"


@dataclass(frozen=True)
class Action:
    at_s: float  # seconds after the replay starts
    kind: str  # "kill", "notice" or "available"
    node: str  # worker node ("" for an unmapped addition)
    trace_node: str


def replay_actions(trace: Trace, nodes: list[str], time_scale: float, *,
                   on_remove: str = "kill", start_s: float | None = None) -> list[Action]:
    """The launcher's schedule of actions; `start_s` skips the trace's quiet beginning
    (default: the time at which the trace first offers enough nodes for the job)."""
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be positive, got {time_scale}")
    mapping: dict[str, str] = {}
    present: set[str] = set()
    begin = None
    for ev in trace.events:
        if ev.kind == REMOVE:
            present.discard(ev.node)
        else:
            present.add(ev.node)
            if ev.node not in mapping and len(mapping) < len(nodes):
                mapping[ev.node] = nodes[len(mapping)]
        if begin is None and len(present) >= len(nodes):
            begin = ev.time_s
    start = begin if start_s is None else start_s
    if start is None:
        raise ValueError(f"the trace never offers {len(nodes)} nodes at once; the job needs them")
    actions = []
    for ev in trace.events:
        if ev.time_s <= start:
            continue
        at = (ev.time_s - start) / time_scale
        if ev.kind == REMOVE and ev.node in mapping:
            actions.append(Action(at, on_remove, mapping[ev.node], ev.node))
        elif ev.kind != REMOVE:
            actions.append(Action(at, "available", mapping.get(ev.node, ""), ev.node))
    return actions
