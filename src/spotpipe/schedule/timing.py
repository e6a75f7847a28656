"""Analytic timing model: run the instruction streams against a clock.

Given per-stage forward and backward costs and the time of one point-to-point message, the
model replays the streams with the runtime's semantics (async sends, blocking receives, a
barrier at the gradient reduction) and reports iteration time and bubble fraction. The same
function times a plain schedule, one with FRC in its bubbles, and a merged one after a
takeover, which is why the runtime, the benchmarks and the simulator all call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotpipe.schedule.ir import RECV_OPS, SEND_OPS, Op, Schedule
from spotpipe.schedule.validate import _channel


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch per stage, and per message / per iteration overheads."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: float = 0.0  # one activation or gradient message, send to receive
    all_reduce: float = 0.0  # gradient reduction after the barrier
    optimizer: float = 0.0  # optimizer step per stage
    frc: tuple[float, ...] | None = None  # forward of a replica stage, if not `forward`

    def frc_cost(self, stage: int) -> float:
        return self.forward[stage] if self.frc is None else self.frc[stage]

    @classmethod
    def uniform(cls, num_stages: int, forward: float, backward: float, **kw: float) -> "StageCosts":
        return cls((forward,) * num_stages, (backward,) * num_stages, **kw)


@dataclass(frozen=True)
class Timing:
    iteration_s: float
    busy_s: tuple[float, ...]  # per actor: forward, backward and FRC/BRC compute
    bubble_fraction: float  # idle share of the actors' time over the iteration

    def throughput(self, samples_per_iteration: int) -> float:
        return samples_per_iteration / self.iteration_s


def _run(schedule: Schedule, costs: StageCosts
         ) -> tuple[list[float], list[float], list[dict[int, float]]]:
    """Replay the streams; return per-actor finish time, busy time, and idle time per position
    (the wait before a receive or at the barrier, keyed by the instruction's index)."""
    n = schedule.num_actors
    clock = [0.0] * n
    busy = [0.0] * n
    waits: list[dict[int, float]] = [{} for _ in range(n)]
    pcs = [0] * n
    arrivals: dict[tuple[int, int, str], list[float]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    at_barrier: dict[int, float] = {}
    released = False
    while True:
        progressed = False
        for a, stream in enumerate(schedule.streams):
            while pcs[a] < len(stream):
                ins = stream[pcs[a]]
                if ins.op in RECV_OPS:
                    ch = _channel(ins)
                    k = taken.get(ch, 0)
                    if k >= len(arrivals.get(ch, ())):
                        break
                    taken[ch] = k + 1
                    waits[a][pcs[a]] = max(0.0, arrivals[ch][k] - clock[a])
                    clock[a] = max(clock[a], arrivals[ch][k])
                elif ins.op in SEND_OPS:
                    arrivals.setdefault(_channel(ins), []).append(clock[a] + costs.comm)
                elif ins.op == Op.FORWARD:
                    clock[a] += costs.forward[ins.stage]
                    busy[a] += costs.forward[ins.stage]
                elif ins.op == Op.FRC_FORWARD:
                    clock[a] += costs.frc_cost(ins.stage)
                    busy[a] += costs.frc_cost(ins.stage)
                elif ins.op in (Op.BACKWARD, Op.BRC_BACKWARD):
                    clock[a] += costs.backward[ins.stage]
                    busy[a] += costs.backward[ins.stage]
                elif ins.op == Op.ALL_REDUCE:
                    if not released:
                        at_barrier[a] = clock[a]
                        if len(at_barrier) < n:
                            break
                        start = max(at_barrier.values())
                        for b, arrived in at_barrier.items():
                            barrier_pc = next(i for i, x in enumerate(schedule.streams[b])
                                              if x.op == Op.ALL_REDUCE)
                            waits[b][barrier_pc] = start - arrived
                            clock[b] = start
                        released = True
                    clock[a] += costs.all_reduce
                elif ins.op == Op.OPTIMIZER_STEP:
                    clock[a] += costs.optimizer
                pcs[a] += 1
                progressed = True
        if all(pc == len(s) for pc, s in zip(pcs, schedule.streams)):
            break
        if not progressed and not (len(at_barrier) == n and not released):
            raise RuntimeError("timing model stalled: the schedule deadlocks (run validate.check)")
    return clock, busy, waits


def simulate(schedule: Schedule, costs: StageCosts) -> Timing:
    """Time one iteration of `schedule`; every actor starts at 0."""
    clock, busy, _ = _run(schedule, costs)
    total = max(clock)
    n = schedule.num_actors
    idle = 1.0 - sum(busy) / (n * total) if total > 0 else 0.0
    return Timing(iteration_s=total, busy_s=tuple(busy), bubble_fraction=idle)


def simulate_waits(schedule: Schedule, costs: StageCosts) -> list[dict[int, float]]:
    """Per actor, the idle seconds spent before each receive and at the barrier."""
    return _run(schedule, costs)[2]


def any_schedule_bound(costs: StageCosts, num_microbatches: int) -> float:
    """A lower bound on the iteration of every synchronous schedule of these costs, however
    it orders, splits or defers the work (1F1B, GPipe, zero-bubble's B/W split alike): stage s
    cannot start before the first micro-batch's forward has crossed the stages before it, then
    runs all of its own forwards and backwards, and the reduction and the step come after the
    last stage is done. What an engine for this partition could reach at best, which is why
    the pipeline bench states torch's iteration over it."""
    p, m = len(costs.forward), num_microbatches
    busiest = max(sum(costs.forward[j] + costs.comm for j in range(s))
                  + m * (costs.forward[s] + costs.backward[s]) for s in range(p))
    return busiest + costs.all_reduce + costs.optimizer


def closed_form_bubble(num_stages: int, num_microbatches: int) -> float:
    """(P-1)/(M+P-1): the textbook bubble of GPipe and 1F1B with uniform stages, free comm."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
