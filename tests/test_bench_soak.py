"""`spotpipe bench soak`: compound faults, each run judged exact, stopped by the planner, or a
bug (an error, an inexact end, a failure without the planner's stop, a run that does not end).
The draw and the summary are checked by hand; three real runs (`spotpipe train` processes)
check the judging: a burst the job survives is exact, one that leaves no copy of a stage is a
stop with the planner's reason, and a run past its limit is killed whole and counted stuck."""

from __future__ import annotations

import pytest

from spotpipe.bench import soak
from spotpipe.bench.chaos import Chaos
from spotpipe.bench.soak import SoakCase, SoakFault, SoakResult, draw_cases, run_case, summarize

from procs import until, workers_of


def test_the_draw_is_seeded_and_every_fault_can_fire():
    cases = draw_cases(40, seed=7)
    assert cases == draw_cases(40, seed=7) and cases != draw_cases(40, seed=8)
    for case in cases:
        assert len(case.faults) == soak.FAULTS_PER_RUN
        initial = {f"node{r}" for r in range(case.stages * case.pipelines)}
        joiners = {f"node{r}" for r in range(len(initial), len(initial) + len(case.joins))}
        first = case.faults[0]
        assert first.node in initial and first.phase in soak.PHASES[:6]
        for f in case.faults:
            assert f.node in initial | joiners
            assert first.iteration <= f.iteration <= first.iteration + 2 < soak.ITERATIONS
            assert f.phase == "start" or f.kind != "notice"
        assert all(0 <= j < soak.ITERATIONS - 1 for j in case.joins)
    assert {c.mode for c in cases} == set(soak.MODES)
    assert {f.kind for c in cases for f in c.faults} == set(soak.KINDS)


def test_the_summary_counts_outcomes_and_names_the_bugs():
    case = draw_cases(1)[0]
    results = [SoakResult(case, "exact", "", 1.0), SoakResult(case, "exact", "", 2.0),
               SoakResult(case, "stopped", "lost node1 (pipeline 0, stage 1) in iteration 4 "
                          "(the last committed iteration is 3): adjacent stages of one pipeline, "
                          "so no replica of one of them survives; no layout", 1.5),
               SoakResult(case, "stuck", "still running after 150 s", 150.0),
               SoakResult(case, "inexact", "lm_head.weight differs", 3.0)]
    out = summarize(results)
    assert (out["runs"], out["exact_runs"], out["stopped_runs"], out["stuck_runs"],
            out["inexact_runs"], out["error_runs"], out["failed_runs"]) == (5, 2, 1, 1, 1, 0, 0)
    assert out["bugs"] == 2 and [b["outcome"] for b in out["bug_runs"]] == ["stuck", "inexact"]
    assert out["stop_reasons"] == {
        "adjacent stages of one pipeline, so no replica of one of them survives": 1}
    assert out["run_wall_s_max"] == 150.0


def _case(mode: str, *faults: SoakFault) -> SoakCase:
    return SoakCase(3, 1, mode, 0, (), tuple(faults))


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    return Chaos(tmp_path_factory.mktemp("soak"), soak.ITERATIONS, "tiny")


def test_a_burst_the_job_survives_is_exact(chaos, tmp_path):
    case = _case("lazy", SoakFault("fail", "node1", 3, "backward"),
                 SoakFault("notice", "node2", 6))
    result = run_case(chaos, case, tmp_path / "run")
    assert (result.outcome, result.detail) == ("exact", ""), result


def test_a_burst_that_leaves_no_copy_is_the_planners_stop(chaos, tmp_path):
    """node1 and node2 crash together: stage 2's only replica was node1's."""
    case = _case("eager", SoakFault("fail", "node1", 3, "backward"),
                 SoakFault("fail", "node2", 3, "backward"))
    result = run_case(chaos, case, tmp_path / "run")
    assert result.outcome == "stopped" and not result.bug, result
    assert "adjacent stages of one pipeline" in result.detail, result


def test_a_run_past_its_limit_is_killed_whole_and_counted_stuck(chaos, tmp_path):
    run = tmp_path / "run"
    result = run_case(chaos, _case("lazy", SoakFault("hang", "node0", 3, "forward")), run,
                      limit_s=1.0)
    assert result.outcome == "stuck" and result.bug, result
    until(lambda: not workers_of(run), "the stuck run's workers to be gone", 10.0)


def test_another_seed_draws_other_faults_and_the_figures_say_which(monkeypatch):
    """`--seed N` reaches the draws and the JSON names it (the runs themselves stubbed)."""
    from spotpipe.bench import run_bench, soak

    seen = []

    def judged(chaos, case, run, **kw):
        seen.append(case)
        return SoakResult(case, "exact", "", 0.0)

    monkeypatch.setattr(soak, "run_case", judged)
    out = soak.run(faults=3, seed=9)
    assert out["seed"] == 9 and seen == draw_cases(3, seed=9) != draw_cases(3)
    given = {}
    monkeypatch.setattr(soak, "run", lambda quick, **kw: given.update(kw) or {})
    assert run_bench("soak", seed=11, faults=2) == 0 and given == {"seed": 11, "faults": 2}
    assert run_bench("pipeline", seed=11) == 2
