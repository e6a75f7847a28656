"""The schedule package's timing model, FRC placement and merged streams, at the simulator's
speed and with the same results (tests compare them instruction by instruction).

Why: `spotpipe.schedule.with_frc` re-times the whole schedule after every one of its P x M
insertions, which made a cold `spotpipe simulate` on the p3 trace take about a minute (four
placements at M = 32..128). Most insertions need no re-timing at all:
- an FRC that fits the wait before a receive leaves every clock as it was (the node still
  waits for the same message, only less), so only that wait changes;
- an FRC put before the end-of-iteration barrier changes only this node's arrival there (and
  so its wait at the barrier); nothing before the barrier moves;
- only an FRC that overflows the wait before a receive shifts later work, and waits only
  shrink as work is added, so that happens at most once per receive with a wait.
The replay itself runs over precompiled integer instructions, compiled once per schedule.
Merged schedules (after a takeover) reuse one global order per (kind, P, M) instead of
replaying the base schedule for every merged shape, and the simulator times them straight
from that order compiled (`merged_iteration_s`), without building their streams.

Cost (one p3.2xlarge GPT-2 run on the p3 trace: `python -m spotpipe.sim.fastsched`): see
the README's simulator section.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from spotpipe.schedule import (Instr, Op, Schedule, StageCosts, build_schedule, global_order,
                               replica_of, runs_frc)

RECV, SEND, FWD, FRC, BWD, ALLRED, OPT, NOP = range(8)
_CODE = {Op.RECV_ACT: RECV, Op.RECV_GRAD: RECV, Op.SEND_ACT: SEND, Op.SEND_GRAD: SEND,
         Op.FORWARD: FWD, Op.FRC_FORWARD: FRC, Op.BACKWARD: BWD, Op.BRC_BACKWARD: BWD,
         Op.ALL_REDUCE: ALLRED, Op.OPTIMIZER_STEP: OPT}


class _Channels:
    """Integer ids of (from stage, to stage, act|grad) message channels."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int, bool], int] = {}


_SENDS = {Op.SEND_ACT: True, Op.SEND_GRAD: False}
_RECVS = {Op.RECV_ACT: True, Op.RECV_GRAD: False}


def _compile(stream: Sequence[Instr], chans: _Channels) -> list[tuple[int, int, int]]:
    out = []
    append, ids, code_of = out.append, chans.ids, _CODE.get
    for ins in stream:
        op = ins.op
        act = _SENDS.get(op)
        if act is not None:
            key = (ins.stage, ins.peer, act)
        else:
            act = _RECVS.get(op)
            if act is None:
                append((code_of(op, NOP), ins.stage, -1))
                continue
            key = (ins.peer, ins.stage, act)
        ch = ids.get(key)
        if ch is None:
            ch = ids[key] = len(ids)
        append((SEND if op in _SENDS else RECV, ins.stage, ch))
    return out


class _Replay:
    """One replay of compiled streams: per actor its finish time, and per receive position
    the message's arrival and the clock before it; the barrier arrivals and release."""

    def __init__(self, code: list[list[tuple[int, int, int]]], n_channels: int,
                 costs: StageCosts) -> None:
        n = len(code)
        fwd, bwd = costs.forward, costs.backward
        frc = costs.frc if costs.frc is not None else costs.forward
        comm, all_reduce, optimizer = costs.comm, costs.all_reduce, costs.optimizer
        clock = [0.0] * n
        pcs = [0] * n
        arrivals: list[list[float]] = [[] for _ in range(n_channels)]
        taken = [0] * n_channels
        self.recv: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
        at_barrier: dict[int, float] = {}
        released = False
        while True:
            progressed = False
            for a in range(n):
                stream = code[a]
                pc, clk, end = pcs[a], clock[a], len(stream)
                recv = self.recv[a]
                while pc < end:
                    op, st, ch = stream[pc]
                    if op == RECV:
                        k = taken[ch]
                        arr = arrivals[ch]
                        if k >= len(arr):
                            break
                        taken[ch] = k + 1
                        t = arr[k]
                        recv[pc] = (t, clk)
                        if t > clk:
                            clk = t
                    elif op == SEND:
                        arrivals[ch].append(clk + comm)
                    elif op == FWD:
                        clk += fwd[st]
                    elif op == FRC:
                        clk += frc[st]
                    elif op == BWD:
                        clk += bwd[st]
                    elif op == ALLRED:
                        if not released:
                            at_barrier[a] = clk
                            if len(at_barrier) < n:
                                break
                            start = max(at_barrier.values())
                            for b in at_barrier:
                                clock[b] = start
                            clk = start
                            released = True
                        clk += all_reduce
                    elif op == OPT:
                        clk += optimizer
                    pc += 1
                    progressed = True
                pcs[a], clock[a] = pc, clk
            if all(pc == len(s) for pc, s in zip(pcs, code)):
                break
            if not progressed and not (len(at_barrier) == n and not released):
                raise RuntimeError("timing model stalled: the schedule deadlocks")
        self.finish = clock
        self.barrier = at_barrier


def _aligned(recv: dict[int, tuple[float, float]], n: int) -> list:
    out: list = [None] * n
    for i, v in recv.items():
        out[i] = v
    return out


# compiled streams of the schedules timed lately, by identity (the schedule is kept with
# them, so its id cannot be reused): the simulator times each placed or plain schedule once
# per width, and the compile costs as much as a replay
_COMPILED: dict[int, tuple[Schedule, list[list[tuple[int, int, int]]], int]] = {}


def _code_of(schedule: Schedule) -> tuple[list[list[tuple[int, int, int]]], int]:
    hit = _COMPILED.get(id(schedule))
    if hit is None or hit[0] is not schedule:
        if len(_COMPILED) >= 256:
            _COMPILED.clear()
        chans = _Channels()
        code = [_compile(s, chans) for s in schedule.streams]
        hit = _COMPILED[id(schedule)] = (schedule, code, len(chans.ids))
    return hit[1], hit[2]


def iteration_s(schedule: Schedule, costs: StageCosts) -> float:
    """`spotpipe.schedule.simulate(schedule, costs).iteration_s`, faster."""
    code, n_channels = _code_of(schedule)
    return max(_Replay(code, n_channels, costs).finish)


@lru_cache(maxsize=64)
def base_schedule(kind: str, num_stages: int, num_microbatches: int) -> Schedule:
    """`build_schedule`, once per (kind, P, M): plain timing, FRC placement and merged
    streams all start from it."""
    return build_schedule(kind, num_stages, num_microbatches)


def with_frc(schedule: Schedule, costs: StageCosts, *, every_stage: bool = False) -> Schedule:
    """`spotpipe.schedule.with_frc`: the same greedy, the same streams (see the module doc)."""
    p, m = schedule.num_stages, schedule.num_microbatches
    if p < 2:
        raise ValueError("redundant computation needs at least 2 stages")
    chans = _Channels()
    streams = [list(s) for s in schedule.streams]
    code = [_compile(s, chans) for s in streams]
    n_ch = len(chans.ids)
    frc_cost = costs.frc_cost
    for actor in range(p):
        replica = replica_of(actor, p)
        if not runs_frc(replica, p, every_stage):
            continue
        cost = frc_cost(replica)
        stream, ops = streams[actor], code[actor]
        replay = _Replay(code, n_ch, costs)
        # per position of `ops`: (arrival, clock before) of a receive, None for the rest; a
        # list kept aligned with `ops` (an insertion shifts both)
        recv = _aligned(replay.recv[actor], len(ops))
        barrier = dict(replay.barrier)
        bar_pos = next(i for i, x in enumerate(ops) if x[0] == ALLRED)
        forward_at: dict[int, int] = {}  # mb -> position of this node's first forward of it
        for i, ins in enumerate(stream):
            if ins.op == Op.FORWARD:
                forward_at.setdefault(ins.mb, i)
        prev = 0
        for mb in range(m):
            if replica != 0 and mb not in forward_at:
                raise ValueError(f"stream never forwards micro-batch {mb}")
            ready = 0 if replica == 0 else forward_at[mb] + 1
            lo = max(ready, prev)
            start = max(barrier.values())
            best, best_wait, fit = -1, 0.0, -1
            last = -1
            for i in range(lo, len(ops)):
                op = ops[i][0]
                if op == RECV:
                    t, clk = recv[i]
                    w = t - clk if t > clk else 0.0
                elif op == ALLRED:
                    w = start - barrier[actor]
                else:
                    continue
                last = i
                if w >= cost - 1e-12:
                    fit = i
                    break
                if w > 1e-12 and w > best_wait:
                    best, best_wait = i, w
            at = fit if fit >= 0 else best if best >= 0 else last
            stream.insert(at, Instr(Op.FRC_FORWARD, replica, mb))
            ops.insert(at, (FRC, replica, -1))
            recv.insert(at, None)
            for k in range(mb + 1, m):  # forwards still to be found move with the insertion
                if forward_at.get(k, -1) >= at:
                    forward_at[k] += 1
            prev = at + 1
            bar_pos += 1
            if at == bar_pos - 1 and ops[bar_pos][0] == ALLRED:
                barrier[actor] += cost  # only this node's arrival at the barrier moves
                continue
            t, clk = recv[at + 1]  # the receive the FRC went before
            if clk + cost <= t:  # the wait absorbs it: every clock stays as it was
                recv[at + 1] = (t, clk + cost)
                continue
            replay = _Replay(code, n_ch, costs)
            recv = _aligned(replay.recv[actor], len(ops))
            barrier = dict(replay.barrier)
    return Schedule(schedule.kind, p, m, tuple(tuple(s) for s in streams), schedule.owners,
                    replicas=tuple((replica_of(a, p),) for a in range(p)))


@lru_cache(maxsize=64)
def _global_order(kind: str, num_stages: int, num_microbatches: int) -> tuple[Instr, ...]:
    return tuple(global_order(base_schedule(kind, num_stages, num_microbatches)))


@lru_cache(maxsize=64)
def _compiled_order(kind: str, num_stages: int, num_microbatches: int
                    ) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """The base schedule's global order less its all-reduce and optimizer steps, compiled
    once: every merged shape's streams are slices of it."""
    order = [ins for ins in _global_order(kind, num_stages, num_microbatches)
             if ins.op not in (Op.ALL_REDUCE, Op.OPTIMIZER_STEP)]
    chans = _Channels()
    return tuple(_compile(order, chans)), len(chans.ids)


def merged_iteration_s(kind: str, num_microbatches: int, owners: Sequence[Sequence[int]],
                       costs: StageCosts) -> float:
    """`iteration_s(merged_schedule(kind, M, owners), costs)` without building the streams:
    each actor's compiled stream is the compiled global order's instructions of its stages
    (a channel's number does not change any time)."""
    stages = sorted(s for own in owners for s in own)
    p = len(stages)
    if stages != list(range(p)):
        raise ValueError(f"owners {list(owners)} must cover stages 0..{p - 1} exactly once")
    order, n_channels = _compiled_order(kind, p, num_microbatches)
    actor_of = [0] * p
    for a, own in enumerate(owners):
        for s in own:
            actor_of[s] = a
    code: list[list[tuple[int, int, int]]] = [[] for _ in owners]
    appends = [c.append for c in code]
    for ins in order:
        appends[actor_of[ins[1]]](ins)
    for a, own in enumerate(owners):
        first = min(own)
        code[a] += [(ALLRED, first, -1), (OPT, first, -1)]
    return max(_Replay(code, n_channels, costs).finish)


def merged_schedule(kind: str, num_microbatches: int,
                    owners: Sequence[Sequence[int]]) -> Schedule:
    """`spotpipe.schedule.merged_schedule`, with the base schedule's order computed once per
    (kind, P, M) rather than once per merged shape."""
    stages = sorted(s for own in owners for s in own)
    p = len(stages)
    if stages != list(range(p)):
        raise ValueError(f"owners {list(owners)} must cover stages 0..{p - 1} exactly once")
    order = [ins for ins in _global_order(kind, p, num_microbatches)
             if ins.op not in (Op.ALL_REDUCE, Op.OPTIMIZER_STEP)]
    streams = tuple(tuple([ins for ins in order if ins.stage in own]
                          + [Instr(Op.ALL_REDUCE, min(own)), Instr(Op.OPTIMIZER_STEP, min(own))])
                    for own in map(set, owners))
    return Schedule(kind, p, num_microbatches, streams,
                    owners=tuple(tuple(sorted(own)) for own in owners))
