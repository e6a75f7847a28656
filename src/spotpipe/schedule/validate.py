"""Static checks of a schedule: deadlock freedom, ordering, and memory bound.

The runtime's point-to-point semantics are modelled exactly: sends are asynchronous (buffered),
receives block, and messages between two stages are matched in the order they were posted.
Between two workers of one host a send blocks while its channel's ring is full
(runtime/local_link.py): `check(schedule, ring_slots=n)` models that.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from spotpipe.schedule.ir import RECV_OPS, SEND_OPS, Instr, Op, Schedule


class ScheduleError(ValueError):
    """A schedule that would deadlock, reorder messages or break forward-before-backward."""


@dataclass(frozen=True)
class Report:
    steps: int  # instructions executed in the simulated run
    max_in_flight: dict[int, int]  # stage -> peak micro-batches forwarded but not backwarded


def _channel(instr: Instr) -> tuple[int, int, str]:
    kind = "act" if instr.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad"
    if instr.op in SEND_OPS:
        return (instr.stage, instr.peer, kind)
    return (instr.peer, instr.stage, kind)


def check(schedule: Schedule, ring_slots: int | None = None) -> Report:
    """Run the streams against each other; raise ScheduleError on any violation.
    `ring_slots`: a send to another actor blocks while that many messages of its channel are
    unread (None: sends never block)."""
    p, m = schedule.num_stages, schedule.num_microbatches
    local = {s: a for a, stages in enumerate(schedule.owners) for s in stages}
    queues: dict[tuple[int, int, str], deque[int]] = defaultdict(deque)
    pcs = [0] * schedule.num_actors
    forwarded: dict[int, set[int]] = defaultdict(set)
    backwarded: dict[int, set[int]] = defaultdict(set)
    peak: dict[int, int] = defaultdict(int)
    frc: dict[int, list[int]] = defaultdict(list)
    steps = 0
    while True:
        progressed = False
        for actor, stream in enumerate(schedule.streams):
            while pcs[actor] < len(stream):
                instr = stream[pcs[actor]]
                if instr.op in RECV_OPS:
                    queue = queues[_channel(instr)]
                    if not queue:
                        break  # blocked: try the other actors
                    got = queue.popleft()
                    if got != instr.mb:
                        raise ScheduleError(f"actor {actor}: {instr} matched a message for "
                                            f"micro-batch {got}")
                elif instr.op in SEND_OPS:  # to a stage of the same actor: a local hand-off
                    if instr.peer not in local:
                        raise ScheduleError(f"actor {actor}: {instr} sends to a stage no actor "
                                            "owns")
                    queue = queues[_channel(instr)]
                    if ring_slots is not None and local[instr.peer] != actor \
                            and len(queue) >= ring_slots:
                        break  # blocked on a full ring: try the other actors
                    queue.append(instr.mb)
                elif instr.op == Op.FORWARD:
                    if instr.mb in forwarded[instr.stage]:
                        raise ScheduleError(f"{instr}: micro-batch forwarded twice")
                    forwarded[instr.stage].add(instr.mb)
                    inflight = len(forwarded[instr.stage]) - len(backwarded[instr.stage])
                    peak[instr.stage] = max(peak[instr.stage], inflight)
                elif instr.op == Op.FRC_FORWARD:
                    owner = schedule.owners[actor]
                    if instr.stage not in (schedule.replicas[actor] if schedule.replicas else ()):
                        raise ScheduleError(f"actor {actor}: {instr} on a stage it holds no "
                                            "replica of")
                    prev = (instr.stage - 1) % p
                    if instr.stage != 0 and prev in owner and instr.mb not in forwarded[prev]:
                        raise ScheduleError(f"actor {actor}: {instr} before its input, the "
                                            f"forward of stage {prev}")
                    frc[instr.stage].append(instr.mb)
                elif instr.op == Op.BACKWARD:
                    if instr.mb not in forwarded[instr.stage]:
                        raise ScheduleError(f"{instr}: backward before its forward")
                    if instr.mb in backwarded[instr.stage]:
                        raise ScheduleError(f"{instr}: micro-batch backwarded twice")
                    backwarded[instr.stage].add(instr.mb)
                pcs[actor] += 1
                steps += 1
                progressed = True
        if all(pc == len(s) for pc, s in zip(pcs, schedule.streams)):
            break
        if not progressed:
            stuck = {a: str(s[pcs[a]]) for a, s in enumerate(schedule.streams) if pcs[a] < len(s)}
            raise ScheduleError(f"deadlock: actors blocked at {stuck}")
    leftovers = {k: list(v) for k, v in queues.items() if v}
    if leftovers:
        raise ScheduleError(f"messages sent but never received: {leftovers}")
    for stage in range(p):
        if forwarded[stage] != set(range(m)) or backwarded[stage] != set(range(m)):
            raise ScheduleError(f"stage {stage}: forwards {sorted(forwarded[stage])}, "
                                f"backwards {sorted(backwarded[stage])}, expected 0..{m - 1}")
    for stage, mbs in frc.items():
        if sorted(mbs) != list(range(m)) or mbs != sorted(mbs):
            raise ScheduleError(f"FRC of stage {stage} runs micro-batches {mbs}; expected each "
                                f"of 0..{m - 1} once, in order")
    for actor, stream in enumerate(schedule.streams):
        ops = [i.op for i in stream]
        if ops.count(Op.OPTIMIZER_STEP) != 1 or ops.count(Op.ALL_REDUCE) != 1:
            raise ScheduleError(f"actor {actor}: expected one reduction and one optimizer step "
                                "(covering all the stages it owns)")
    return Report(steps=steps, max_in_flight=dict(peak))
