"""Builders of GPipe and 1F1B instruction streams.

Backward passes run in micro-batch order 0..M-1 on every stage, in both schedules: gradient
accumulation then sums in the same order as a plain single-process loop, which is what makes
a D = 1 pipeline bit-identical to it.
"""

from __future__ import annotations

from spotpipe.schedule.ir import Instr, Op, Schedule

SCHEDULE_KINDS = ("gpipe", "1f1b")


def _forward(stage: int, mb: int, num_stages: int) -> list[Instr]:
    out = []
    if stage > 0:
        out.append(Instr(Op.RECV_ACT, stage, mb, stage - 1))
    out.append(Instr(Op.FORWARD, stage, mb))
    if stage < num_stages - 1:
        out.append(Instr(Op.SEND_ACT, stage, mb, stage + 1))
    return out


def _backward(stage: int, mb: int, num_stages: int) -> list[Instr]:
    out = []
    if stage < num_stages - 1:
        out.append(Instr(Op.RECV_GRAD, stage, mb, stage + 1))
    out.append(Instr(Op.BACKWARD, stage, mb))
    if stage > 0:
        out.append(Instr(Op.SEND_GRAD, stage, mb, stage - 1))
    return out


def _finish(stage: int) -> list[Instr]:
    return [Instr(Op.ALL_REDUCE, stage), Instr(Op.OPTIMIZER_STEP, stage)]


def gpipe_stream(stage: int, num_stages: int, num_microbatches: int) -> list[Instr]:
    stream: list[Instr] = []
    for mb in range(num_microbatches):
        stream += _forward(stage, mb, num_stages)
    for mb in range(num_microbatches):
        stream += _backward(stage, mb, num_stages)
    return stream + _finish(stage)


def one_f_one_b_stream(stage: int, num_stages: int, num_microbatches: int) -> list[Instr]:
    """Non-interleaved 1F1B: at most P - stage micro-batches in flight on a stage."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    stream: list[Instr] = []
    for mb in range(warmup):
        stream += _forward(stage, mb, num_stages)
    for i in range(num_microbatches - warmup):
        stream += _forward(stage, warmup + i, num_stages)
        stream += _backward(stage, i, num_stages)
    for mb in range(num_microbatches - warmup, num_microbatches):
        stream += _backward(stage, mb, num_stages)
    return stream + _finish(stage)


def build_schedule(kind: str, num_stages: int, num_microbatches: int) -> Schedule:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got P={num_stages}, "
                         f"M={num_microbatches}")
    if kind == "gpipe":
        make = gpipe_stream
    elif kind == "1f1b":
        make = one_f_one_b_stream
    else:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {SCHEDULE_KINDS}")
    streams = tuple(tuple(make(s, num_stages, num_microbatches)) for s in range(num_stages))
    return Schedule(kind, num_stages, num_microbatches, streams,
                    owners=tuple((s,) for s in range(num_stages)))
