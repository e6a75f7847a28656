"""Schedules as data: deadlock freedom, ordering, memory bound, and the timing model."""

import itertools

import pytest

from spotpipe.schedule import (Instr, Op, Schedule, ScheduleError, StageCosts, build_schedule,
                               check, closed_form_bubble, simulate)

CASES = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]))


@pytest.mark.parametrize("kind,p,m", CASES)
def test_streams_are_deadlock_free_and_ordered(kind, p, m):
    schedule = build_schedule(kind, p, m)
    report = check(schedule)  # raises on deadlock, mismatched messages, B before F
    for stage, stream in enumerate(schedule.streams):
        ops = [(i.op, i.mb) for i in stream]
        for mb in range(m):
            assert ops.index((Op.FORWARD, mb)) < ops.index((Op.BACKWARD, mb))
        assert [i.mb for i in stream if i.op == Op.BACKWARD] == list(range(m)), \
            "backwards must run in micro-batch order so gradients accumulate as in a plain loop"
    if kind == "1f1b":
        for stage, peak in report.max_in_flight.items():
            assert peak <= min(p - stage, m) <= p
    else:
        assert all(peak == m for peak in report.max_in_flight.values())


def test_checker_finds_a_deadlock():
    # both stages receive before they send: a cycle
    s0 = (Instr(Op.RECV_GRAD, 0, 0, 1), Instr(Op.FORWARD, 0, 0), Instr(Op.SEND_ACT, 0, 0, 1))
    s1 = (Instr(Op.RECV_ACT, 1, 0, 0), Instr(Op.FORWARD, 1, 0), Instr(Op.SEND_GRAD, 1, 0, 0))
    bad = Schedule("bad", 2, 1, (s0, s1), owners=((0,), (1,)))
    with pytest.raises(ScheduleError, match="deadlock"):
        check(bad)


def test_checker_finds_reordered_messages():
    good = build_schedule("gpipe", 2, 2)
    s1 = list(good.streams[1])
    i, j = s1.index(Instr(Op.RECV_ACT, 1, 0, 0)), s1.index(Instr(Op.RECV_ACT, 1, 1, 0))
    s1[i], s1[j] = s1[j], s1[i]
    bad = Schedule("bad", 2, 2, (good.streams[0], tuple(s1)), owners=good.owners)
    with pytest.raises(ScheduleError, match="matched a message"):
        check(bad)


def test_checker_finds_backward_before_forward():
    good = build_schedule("gpipe", 1, 2)
    stream = list(good.streams[0])
    stream.insert(0, stream.pop(stream.index(Instr(Op.BACKWARD, 0, 1))))
    with pytest.raises(ScheduleError, match="backward before its forward"):
        check(Schedule("bad", 1, 2, (tuple(stream),), owners=good.owners))


@pytest.mark.parametrize("kind,p,m", [(k, p, m) for k, p, m in CASES if p > 1])
def test_timing_matches_the_closed_form_for_uniform_stages(kind, p, m):
    t = simulate(build_schedule(kind, p, m), StageCosts.uniform(p, 1.0, 2.0))
    assert t.iteration_s == pytest.approx((m + p - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx(closed_form_bubble(p, m))


def test_timing_accounts_for_communication_and_slow_stages():
    sched = build_schedule("1f1b", 2, 4)
    base = simulate(sched, StageCosts.uniform(2, 1.0, 2.0)).iteration_s
    with_comm = simulate(sched, StageCosts.uniform(2, 1.0, 2.0, comm=0.5)).iteration_s
    assert with_comm > base
    slow = simulate(sched, StageCosts((1.0, 2.0), (2.0, 4.0))).iteration_s
    # the slow stage dominates: M * (f + b) of it plus the fill and drain of the other
    assert slow == pytest.approx(4 * 6.0 + 1.0 + 2.0)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown schedule kind"):
        build_schedule("zigzag", 2, 2)


# ---------------------------------------------------------------- FRC placement (redundancy)

from spotpipe.schedule import predict, replica_of, with_frc  # noqa: E402
from spotpipe.schedule.ir import RECV_OPS  # noqa: E402


@pytest.mark.parametrize("kind,p,m", [(k, p, m) for k, p, m in CASES if p > 1 and m <= 8])
@pytest.mark.parametrize("every_stage", [False, True])
def test_frc_schedules_are_deadlock_free_and_complete(kind, p, m, every_stage):
    """Every micro-batch's FRC of the node's replica, except where the replica is the last
    stage (its outputs go to no successor) and on two stages (stage 0's successor is its heir);
    Bamboo runs it all the same (`every_stage`)."""
    sched = with_frc(build_schedule(kind, p, m), StageCosts.uniform(p, 1.0, 2.0, comm=0.1),
                     every_stage=every_stage)
    check(sched)  # also checks: each FRC after its input, each micro-batch once, in order
    for actor, stream in enumerate(sched.streams):
        frc = [i for i in stream if i.op == Op.FRC_FORWARD]
        # the node of stage P - 2 holds the last stage's replica
        runs = every_stage or (p > 2 and actor != p - 2)
        assert [i.mb for i in frc] == (list(range(m)) if runs else [])
        assert {i.stage for i in frc} == ({replica_of(actor, p)} if runs else set())
        for i, ins in enumerate(stream):
            if ins.op == Op.FRC_FORWARD:  # always placed where the node would otherwise wait
                nxt = next(x for x in stream[i:] if x.op != Op.FRC_FORWARD)
                assert nxt.op in RECV_OPS or nxt.op == Op.ALL_REDUCE
            if ins.op == Op.BRC_BACKWARD:
                pytest.fail("backward redundant computation is never scheduled eagerly")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_two_stages_run_no_frc(kind):
    """On two stages FRC would serve no takeover: eager costs what lazy does."""
    base = StageCosts.uniform(2, 1.0, 2.0)
    assert predict(build_schedule(kind, 2, 4), base, "eager").throughput_ratio == 1.0
    as_bamboo = with_frc(build_schedule(kind, 2, 4), base, every_stage=True)
    assert simulate(as_bamboo, base).iteration_s > simulate(build_schedule(kind, 2, 4),
                                                            base).iteration_s


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(5, 10), (4, 8), (3, 6)])
def test_frc_fills_bubbles_first(kind, p, m):
    """FRC small enough to fit in the bubbles costs nothing; bigger FRC costs only the excess."""
    base = StageCosts.uniform(p, 1.0, 2.0)
    plain = simulate(build_schedule(kind, p, m), base).iteration_s
    # a replica forward of 0.1 of a stage's: all M of them fit in the bubbles, for free
    cheap = StageCosts(base.forward, base.backward, frc=tuple(0.1 for _ in range(p)))
    assert simulate(with_frc(build_schedule(kind, p, m), cheap), cheap).iteration_s == \
        pytest.approx(plain)
    pred = predict(build_schedule(kind, p, m), base, "eager")
    assert 0 < pred.bubble_filled_s <= pred.frc_s
    assert pred.excess_s == pytest.approx(pred.iteration_s - plain)
    # filling: the excess is less than running all FRC after the iteration would cost
    assert pred.excess_s < pred.frc_s
    assert predict(build_schedule(kind, p, m), base, "lazy").throughput_ratio == 1.0


# ---------------------------------------------------------------- merged streams (takeover)

from spotpipe.schedule import merged_schedule  # noqa: E402

MERGES = [
    (2, [(0, 1)]),  # P=2: stage 1 taken over by node 0
    (2, [(1, 0)]),  # P=2: stage 0 taken over by node 1 (the last stage holds stage 0's replica)
    (3, [(0, 1), (2,)]),
    (3, [(0,), (1, 2)]),
    (3, [(2, 0), (1,)]),  # wrapped: last node runs stages 2 and 0
    (4, [(0, 1), (2, 3)]),
    (4, [(3, 0), (1, 2)]),
    (4, [(0,), (1, 2), (3,)]),
]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
@pytest.mark.parametrize("p,owners", MERGES)
def test_merged_streams_are_deadlock_free(kind, m, p, owners):
    sched = merged_schedule(kind, m, owners)
    check(sched)  # each send meets its receive, F before B, one step per node
    for actor, own in enumerate(sched.owners):
        stream = sched.streams[actor]
        assert stream[-2].op == Op.ALL_REDUCE and stream[-1].op == Op.OPTIMIZER_STEP
        for s in own:  # each merged stage still runs every micro-batch, backwards in order
            assert [i.mb for i in stream if i.op == Op.BACKWARD and i.stage == s] == list(range(m))
    # the merged node carries two stages' work: the iteration cannot be faster than before
    costs = StageCosts.uniform(p, 1.0, 2.0)
    assert simulate(sched, costs).iteration_s >= simulate(build_schedule(kind, p, m),
                                                          costs).iteration_s


def test_merge_rejects_incomplete_ownership():
    with pytest.raises(ValueError, match="cover stages"):
        merged_schedule("1f1b", 4, [(0, 1), (3,)])
