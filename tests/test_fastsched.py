"""The simulator's fast placement, merge and timing give exactly what spotpipe.schedule gives."""

import random

import pytest

from spotpipe.schedule import StageCosts, build_schedule, merged_schedule, simulate, with_frc
from spotpipe.sim import fastsched


def costs_for(kind: int, p: int, rng: random.Random) -> StageCosts:
    if kind == 0:  # the runtime's placement costs: parameter counts, integral floats
        sizes = tuple(float(rng.randint(1, 10 ** 6)) for _ in range(p))
        return StageCosts(sizes, tuple(2 * s for s in sizes))
    if kind == 1:  # uniform: waits are exact multiples of the FRC cost (ties everywhere)
        return StageCosts.uniform(p, 1.0, 2.0)
    return StageCosts(tuple(rng.random() for _ in range(p)),
                      tuple(3 * rng.random() for _ in range(p)), comm=0.1 * rng.random(),
                      all_reduce=0.3, optimizer=0.1)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_frc_placement_and_timing_match_the_schedule_package(kind, p):
    rng = random.Random(p)
    for m in (1, 2, 7, 16):
        for which in range(3):
            costs = costs_for(which, p, rng)
            base = build_schedule(kind, p, m)
            placed = with_frc(base, costs)
            assert fastsched.with_frc(base, costs) == placed, (m, which)
            every = with_frc(base, costs, every_stage=True)  # as Bamboo places it
            assert fastsched.with_frc(base, costs, every_stage=True) == every, (m, which)
            for sched in (base, placed, every):
                assert fastsched.iteration_s(sched, costs) == simulate(sched, costs).iteration_s


@pytest.mark.parametrize("owners", [[[0, 1], [2], [3]], [[0], [1, 2], [3]], [[3, 0], [1], [2]],
                                    [[0, 1, 2, 3]], [[0], [1], [2], [3]]])
def test_merged_schedules_match(owners):
    costs = StageCosts((1.0, 2.0, 1.5, 1.0), (2.0, 4.0, 3.0, 2.0), comm=0.05)
    for kind in ("1f1b", "gpipe"):
        ref = merged_schedule(kind, 6, owners)
        assert fastsched.merged_schedule(kind, 6, owners) == ref
        assert fastsched.iteration_s(ref, costs) == simulate(ref, costs).iteration_s
        # timed straight from the compiled global order, without building the streams
        assert fastsched.merged_iteration_s(kind, 6, owners, costs) == \
            simulate(ref, costs).iteration_s
    with pytest.raises(ValueError, match="cover"):
        fastsched.merged_schedule("1f1b", 2, [[0], [2]])
    with pytest.raises(ValueError, match="cover"):
        fastsched.merged_iteration_s("1f1b", 2, [[0], [2]], costs)


def test_merged_timing_matches_on_random_owners():
    """Random carriers of a deeper pipeline, random costs: the same seconds, to the bit."""
    rng = random.Random(7)
    for _ in range(30):
        p, m = rng.randint(2, 9), rng.randint(1, 12)
        cuts = sorted(rng.sample(range(1, p), rng.randint(0, p - 1)))
        groups = [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [p])]
        costs = costs_for(2, p, rng)
        for kind in ("1f1b", "gpipe"):
            ref = merged_schedule(kind, m, groups)
            assert fastsched.merged_iteration_s(kind, m, groups, costs) == \
                simulate(ref, costs).iteration_s, (kind, m, groups)
