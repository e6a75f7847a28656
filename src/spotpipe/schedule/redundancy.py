"""Redundant computation (Bamboo): the replica ring and FRC placed in pipeline bubbles.

The node of stage s holds a replica of stage (s + 1) mod P. In eager mode it runs the forward
of that replica for every micro-batch (forward redundant computation, FRC), so that after its
successor is lost it already has the successor's outputs to send on. FRC is only worth it if it
is nearly free, so it is placed where the node would otherwise wait: before a blocking receive,
or before the end-of-iteration barrier. Placement uses the timing model, so a bubble is only
filled with as much FRC as it can hold; what does not fit anywhere runs at the end and is the
predicted cost of eager redundancy.

FRC runs only where it serves a takeover (`frc_serves`): where the replica's outputs go on to
a node other than the heir. Not for the last stage's replica (its outputs go to the loss, which
the takeover recomputes with autograd, BRC, whatever FRC held), and not at all on two stages
(stage 0's successor is its heir itself, which would recompute the same forward with autograd
for the backward). Bamboo's engine runs FRC of every replica (its eager schedule merges the
successor's whole forward); `with_frc(..., every_stage=True)` places it as Bamboo does, for the
simulator's reproduction of Bamboo.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spotpipe.schedule.ir import RECV_OPS, Instr, Op, Schedule
from spotpipe.schedule.timing import StageCosts, simulate_waits

REDUNDANCY_MODES = ("none", "lazy", "eager")


def replica_of(stage: int, num_stages: int) -> int:
    """The stage whose replica the node of `stage` holds."""
    return (stage + 1) % num_stages


def holder_of(stage: int, num_stages: int) -> int:
    """The stage whose node holds the replica of `stage` (its predecessor in the ring)."""
    return (stage - 1) % num_stages


def frc_serves(replica: int, num_stages: int) -> bool:
    """Whether eager FRC of `replica` serves a takeover: the heir (the replica's holder, the
    node of its predecessor) sends the outputs on to the replica's successor, which would
    otherwise wait for the heir's forward. The last stage has no successor: its FRC outputs
    would never be read (`schedule.replay` skips them). On two stages the successor of stage 0
    is the heir itself, which forwards it with autograd for the backward in any case: the
    outputs would save it nothing, and FRC there was all of eager's cost."""
    return num_stages > 2 and replica != num_stages - 1


def runs_frc(replica: int, num_stages: int, every_stage: bool = False) -> bool:
    """Whether eager mode runs FRC of `replica`: where it serves, or for every replica as
    Bamboo's engine does (`every_stage`, `replica.frc: every`)."""
    return every_stage or frc_serves(replica, num_stages)


def _frc_ready_after(stream: tuple[Instr, ...], replica: int, mb: int) -> int:
    """Index in `stream` after which FRC of (replica, mb) has its input.

    The replica's input is the node's own output for the micro-batch, except for the replica
    of stage 0, whose input is the data, available from the start.
    """
    if replica == 0:
        return 0
    for i, ins in enumerate(stream):
        if ins.op == Op.FORWARD and ins.mb == mb:
            return i + 1
    raise ValueError(f"stream never forwards micro-batch {mb}")


def _slots(stream: list[Instr], start: int) -> list[int]:
    """Positions (>= start) where a node may wait: before a receive or the final barrier."""
    return [i for i in range(start, len(stream))
            if stream[i].op in RECV_OPS or stream[i].op == Op.ALL_REDUCE]


def with_frc(schedule: Schedule, costs: StageCosts, *, every_stage: bool = False) -> Schedule:
    """Insert FRC of each actor's replica stage, for every micro-batch, into its bubbles: of
    the replicas it serves (`frc_serves`), or of every replica (`every_stage`, as Bamboo).

    Greedy and cost-aware: micro-batches in order, each into the earliest slot (after its
    input exists) whose measured wait can absorb its cost, re-timing after every insertion;
    an FRC that fits nowhere goes into the slot with the longest wait, else before the barrier.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    if p < 2:
        raise ValueError("redundant computation needs at least 2 stages")
    streams = [list(s) for s in schedule.streams]
    for actor in range(p):
        replica = replica_of(actor, p)
        if not runs_frc(replica, p, every_stage):
            continue
        cost = costs.frc_cost(replica)
        for mb in range(m):
            current = replace(schedule, streams=tuple(tuple(s) for s in streams))
            waits = simulate_waits(current, costs)[actor]  # position -> idle seconds there
            stream = streams[actor]
            ready = _frc_ready_after(tuple(stream), replica, mb)
            # FRCs of one replica stay in micro-batch order: after the previous one
            prev = max((i + 1 for i, ins in enumerate(stream)
                        if ins.op == Op.FRC_FORWARD), default=0)
            slots = _slots(stream, max(ready, prev))
            fitting = [i for i in slots if waits.get(i, 0.0) >= cost - 1e-12]
            if fitting:
                at = fitting[0]
            else:
                roomy = [i for i in slots if waits.get(i, 0.0) > 1e-12]
                at = max(roomy, key=lambda i: waits[i]) if roomy else slots[-1]
            stream.insert(at, Instr(Op.FRC_FORWARD, replica, mb))
    return replace(schedule, streams=tuple(tuple(s) for s in streams),
                   replicas=tuple((replica_of(a, p),) for a in range(p)))


@dataclass(frozen=True)
class RedundancyPrediction:
    mode: str
    iteration_s: float  # with redundancy
    baseline_iteration_s: float  # without
    bubble_fraction: float  # of the plain schedule
    frc_s: float  # FRC compute per node, summed over micro-batches (max over nodes)
    bubble_filled_s: float  # of that, what ran inside bubbles (max over nodes)
    excess_s: float  # added to the iteration

    @property
    def throughput_ratio(self) -> float:
        return self.baseline_iteration_s / self.iteration_s


def predict(schedule: Schedule, costs: StageCosts, mode: str, *,
            every_stage: bool = False) -> RedundancyPrediction:
    """What redundancy costs in throughput for this schedule and these stage costs.

    Lazy mode computes nothing extra on the critical path (gradient replication runs in the
    background), so its prediction is the plain schedule's time.
    """
    from spotpipe.schedule.timing import simulate

    if mode not in REDUNDANCY_MODES:
        raise ValueError(f"unknown redundancy mode {mode!r}; expected one of {REDUNDANCY_MODES}")
    base = simulate(schedule, costs)
    if mode != "eager":
        return RedundancyPrediction(mode, base.iteration_s, base.iteration_s,
                                    base.bubble_fraction, 0.0, 0.0, 0.0)
    p = schedule.num_stages
    eager = simulate(with_frc(schedule, costs, every_stage=every_stage), costs)
    frc = max((schedule.num_microbatches * costs.frc_cost(replica_of(a, p))
               for a in range(p) if runs_frc(replica_of(a, p), p, every_stage)),
              default=0.0)
    excess = eager.iteration_s - base.iteration_s
    return RedundancyPrediction(mode, eager.iteration_s, base.iteration_s, base.bubble_fraction,
                                frc, max(0.0, frc - excess), excess)
