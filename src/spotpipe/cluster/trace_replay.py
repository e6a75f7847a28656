"""Replays a preemption trace onto the local cluster, through the real failure paths.

The job's worker nodes stand for the trace's nodes present when the replay starts, in the
order they were granted; a removal of one at trace time t happens at t / time_scale seconds
after training starts, as a SIGKILL (a crash) or a SIGTERM (a notice), exactly what a real
preemption does. A node the trace grants later, while the job has fewer nodes than it
started with, is started as a new worker (`node<N>`, N counting on from the job's nodes)
that stands for it from then on, so its own removal is replayed too; other grants are only
recorded. A trace node is followed by its grant, not its name: a name granted again after
its removal is a new instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from spotpipe.traces import Trace

REMOVE = "remove"


@dataclass(frozen=True)
class Action:
    at_s: float  # seconds after the replay starts
    kind: str  # "kill", "notice" or "available"
    node: str  # worker node ("" for an addition no worker stands for)
    trace_node: str


def replay_actions(trace: Trace, nodes: list[str], time_scale: float, *,
                   on_remove: str = "kill", start_s: float | None = None) -> list[Action]:
    """The launcher's schedule of actions; `start_s` skips the trace's quiet beginning
    (default: the first instant after which the trace offers enough nodes for the job)."""
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be positive, got {time_scale}")
    start = first_full_instant(trace, len(nodes)) if start_s is None else start_s
    mapping = dict(zip(present_at(trace, start), nodes))  # trace node -> worker node
    names = count(len(nodes))
    actions = []
    for ev in trace.events:
        if ev.time_s <= start:
            continue
        at = (ev.time_s - start) / time_scale
        if ev.kind == REMOVE:
            node = mapping.pop(ev.node, None)
            if node is not None:
                actions.append(Action(at, on_remove, node, ev.node))
            continue
        node = ""
        if len(mapping) < len(nodes):  # the job is short of nodes: a new worker stands for it
            node = mapping[ev.node] = f"node{next(names)}"
        actions.append(Action(at, "available", node, ev.node))
    return actions


def first_full_instant(trace: Trace, needed: int) -> float:
    """The first time at which, all its events applied, the trace offers `needed` nodes (a
    node granted and taken in the same instant is not offered)."""
    times, counts = trace.step_series()
    for t, n in zip(times, counts):
        if n >= needed:
            return t
    raise ValueError(f"the trace never offers {needed} nodes at once; the job needs them")


def present_at(trace: Trace, t: float) -> list[str]:
    """The trace's nodes present at time `t` (its events applied), oldest grant first."""
    present: dict[str, None] = {}
    for ev in trace.events:
        if ev.time_s > t:
            break
        if ev.kind == REMOVE:
            present.pop(ev.node, None)
        else:
            present[ev.node] = None
    return list(present)
