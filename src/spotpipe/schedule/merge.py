"""Schedules for layouts where one node runs several stages (after a takeover).

A node that took over its successor's stage must run both stages' instructions in one stream.
Rather than hand-write merged variants of every schedule, the merge is derived: run the plain
P-stage schedule once under the checker's semantics to get one global order in which every
receive follows its send, then give each node the instructions of its stages in that order.
Because that global order is a valid execution of the merged streams, they cannot deadlock
(sends never block), whichever stages are merged, adjacent (s, s+1) or wrapped (P-1, 0).
Transfers between two stages of the same node stay in the stream and become local hand-offs;
the per-stage reductions and optimizer steps become one of each per node, at the end.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

from spotpipe.schedule.builders import build_schedule
from spotpipe.schedule.ir import RECV_OPS, SEND_OPS, Instr, Op, Schedule
from spotpipe.schedule.validate import _channel


def global_order(schedule: Schedule) -> list[Instr]:
    """One execution of `schedule` (actors advance until blocked, round robin), flattened."""
    queues: dict[tuple[int, int, str], deque[int]] = defaultdict(deque)
    pcs = [0] * schedule.num_actors
    order: list[Instr] = []
    while any(pc < len(s) for pc, s in zip(pcs, schedule.streams)):
        progressed = False
        for actor, stream in enumerate(schedule.streams):
            while pcs[actor] < len(stream):
                ins = stream[pcs[actor]]
                if ins.op in RECV_OPS:
                    if not queues[_channel(ins)]:
                        break
                    queues[_channel(ins)].popleft()
                elif ins.op in SEND_OPS:
                    queues[_channel(ins)].append(ins.mb)
                order.append(ins)
                pcs[actor] += 1
                progressed = True
        if not progressed:
            raise ValueError("the base schedule deadlocks; it cannot be merged")
    return order


def merged_schedule(kind: str, num_microbatches: int,
                    owners: Sequence[Sequence[int]]) -> Schedule:
    """Streams for actors owning the given stages (together exactly 0..P-1, each once)."""
    stages = sorted(s for own in owners for s in own)
    p = len(stages)
    if stages != list(range(p)):
        raise ValueError(f"owners {list(owners)} must cover stages 0..{p - 1} exactly once")
    base = build_schedule(kind, p, num_microbatches)
    actor_of = {s: a for a, own in enumerate(owners) for s in own}
    streams: list[list[Instr]] = [[] for _ in owners]
    for ins in global_order(base):
        if ins.op in (Op.ALL_REDUCE, Op.OPTIMIZER_STEP):
            continue
        streams[actor_of[ins.stage]].append(ins)
    for a, own in enumerate(owners):
        first = min(own)
        streams[a] += [Instr(Op.ALL_REDUCE, first), Instr(Op.OPTIMIZER_STEP, first)]
    return Schedule(kind, p, num_microbatches, tuple(tuple(s) for s in streams),
                    owners=tuple(tuple(sorted(own)) for own in owners))
