"""The instruction set of a pipeline schedule, as plain data.

A schedule is one stream of instructions per *actor* (a worker process). Normally actor s runs
stage s; after a takeover one actor runs two stages, so every instruction names the stage whose
layers and buffers it touches. Keeping schedules as data (no torch, no processes) lets the same
streams drive the runtime, be checked for deadlocks in unit tests, and be timed by the analytic
model and the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    RECV_ACT = "recv_act"  # receive micro-batch mb's input activation from stage `peer`
    FORWARD = "forward"
    SEND_ACT = "send_act"  # send mb's output activation to stage `peer`
    RECV_GRAD = "recv_grad"  # receive the gradient of mb's output from stage `peer`
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"  # send the gradient of mb's input to stage `peer`
    FRC_FORWARD = "frc_forward"  # forward redundant computation of a replica stage (Bamboo)
    BRC_BACKWARD = "brc_backward"  # backward redundant computation, only after a failure
    ALL_REDUCE = "all_reduce"  # data-parallel gradient reduction, tied weights, global norm
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.FRC_FORWARD, Op.BRC_BACKWARD})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})


@dataclass(frozen=True)
class Instr:
    op: Op
    stage: int
    mb: int = -1
    peer: int = -1

    def __str__(self) -> str:
        parts = [self.op.value, f"s{self.stage}"]
        if self.mb >= 0:
            parts.append(f"m{self.mb}")
        if self.peer >= 0:
            parts.append(f"->{self.peer}" if self.op in SEND_OPS else f"<-{self.peer}")
        return " ".join(parts)


@dataclass(frozen=True)
class Schedule:
    """Per-actor instruction streams for one training iteration.

    `owners[a]` lists the stages actor a owns (normally just (a,)); `replicas[a]` the stages
    whose replica it holds and may run FRC for.
    """

    kind: str
    num_stages: int
    num_microbatches: int
    streams: tuple[tuple[Instr, ...], ...]
    owners: tuple[tuple[int, ...], ...]
    replicas: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def num_actors(self) -> int:
        return len(self.streams)

    def actor_of_stage(self, stage: int) -> int:
        for actor, stages in enumerate(self.owners):
            if stage in stages:
                return actor
        raise KeyError(f"stage {stage} has no owner in this schedule")

    def describe(self) -> str:
        lines = [f"{self.kind}: P={self.num_stages} M={self.num_microbatches}"]
        for actor, stream in enumerate(self.streams):
            lines.append(f"  actor {actor} (stages {list(self.owners[actor])}): "
                         + ", ".join(str(i) for i in stream))
        return "\n".join(lines)
