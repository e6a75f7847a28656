"""The benchmarks' statistics and restart timings, against figures worked out by hand."""

from __future__ import annotations

import json

import pytest

from spotpipe.bench.failover import torchrun_restart_pause
from spotpipe.bench.stats import distribution, median_of_runs, percentile, ratio_of_medians


def test_ratio_of_two_known_timing_lists():
    # medians 9.0 (of 8, 9, 30) and 0.5 (of 0.4, 0.5, 0.6, 0.5 -> 0.5)
    assert ratio_of_medians([8.0, 30.0, 9.0], [0.4, 0.5, 0.6, 0.5]) == pytest.approx(18.0)
    with pytest.raises(ValueError, match="samples on both sides"):
        ratio_of_medians([], [1.0])


def test_percentiles_of_a_known_list():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, shuffled order does not matter
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    # nearest rank on 5 samples: p50 is the 3rd, p90 and p99 the 5th
    assert distribution([0.3, 0.1, 0.5, 0.2, 0.4]) == {"p50": 0.3, "p90": 0.5, "p99": 0.5,
                                                       "max": 0.5}
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 0)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_torchrun_restart_is_timed_from_the_kill_to_the_iteration_in_flight(tmp_path):
    _write(tmp_path / "events.jsonl", [
        {"time_s": 0.0, "kind": "launch", "node": "launcher", "t0": 1000.0},
        {"time_s": 5.0, "kind": "fault_injected", "node": "node1", "fault": "fail",
         "iteration": 7, "phase": "backward"},
        {"time_s": 6.5, "kind": "launch", "node": "launcher", "restart": 1, "t0": 1000.0,
         "start_iteration": 5}])
    _write(tmp_path / "metrics.jsonl", [
        {"iter": 6, "time_s": 4.8}, {"iter": 5, "time_s": 8.0}, {"iter": 6, "time_s": 8.5},
        {"iter": 7, "time_s": 9.25}])
    got = torchrun_restart_pause(tmp_path)
    assert got == {"restart_pause_s": 4.25, "restart_first_iteration_s": 3.0,
                   "restart_lost_iterations": 2}


def test_every_bench_records_the_load_average(tmp_path, monkeypatch, capsys):
    """`spotpipe bench` adds the load average before and after to any bench's figures."""
    import sys

    from spotpipe import bench

    (tmp_path / "fake_bench.py").write_text("def run(quick=False):\n    return {'x': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.BENCHES, "fake", "fake_bench")
    assert bench.run_bench("fake", as_json=True) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before, after = figures["load_average_before_after"]
    assert figures["x"] == 1 and before >= 0 and after >= 0
    sys.modules.pop("fake_bench", None)


def test_runs_combine_into_medians_of_their_numbers():
    runs = [{"ratio": 0.95, "n": 3, "ok": True, "label": "a", "spread": [1, 2]},
            {"ratio": 1.05, "n": 5, "ok": False, "label": "b", "spread": [3, 4]},
            {"ratio": 0.99, "n": 4, "ok": True, "label": "c", "spread": [5, 6]}]
    out = median_of_runs(runs)
    assert out["ratio"] == 0.99 and out["n"] == 4  # the middle of each, by hand
    assert out["per_run"] == {"ratio": [0.95, 1.05, 0.99], "n": [3, 5, 4]}
    # flags, text and lists are not averaged: the first run's
    assert (out["ok"], out["label"], out["spread"]) == (True, "a", [1, 2])
    assert out["runs_combined"] == 3
    # a figure that one run lacks or gave as NaN is not a median of numbers
    out = median_of_runs([{"x": 1.0}, {"x": float("nan")}])
    assert out["x"] == 1.0 and out["per_run"] == {}
    with pytest.raises(ValueError):
        median_of_runs([])


def test_repeat_runs_a_bench_several_times(tmp_path, monkeypatch, capsys):
    import sys

    from spotpipe import bench

    (tmp_path / "counting_bench.py").write_text(
        "calls = []\n"
        "def run(quick=False):\n"
        "    calls.append(1)\n"
        "    return {'x': [5.0, 1.0, 3.0][len(calls) - 1]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.BENCHES, "counting", "counting_bench")
    assert bench.run_bench("counting", as_json=True, repeat=3) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["x"] == 3.0 and figures["per_run"]["x"] == [5.0, 1.0, 3.0]
    assert figures["runs_combined"] == 3 and len(figures["load_average_before_after"]) == 2
    assert bench.run_bench("counting", as_json=True, repeat=0) == 2
    assert "--repeat 0" in capsys.readouterr().err
    sys.modules.pop("counting_bench", None)


def test_bad_bench_input_is_a_usage_error_naming_it(monkeypatch, capsys):
    """An unknown prototype in SPOTPIPE_BENCH_PROTOTYPES stops `bench redundancy` before any
    process starts, with exit 2 and one line naming the variable, not a traceback."""
    from spotpipe import bench

    monkeypatch.setenv("SPOTPIPE_BENCH_PROTOTYPES", "inline-replica-update,bogus")
    assert bench.run_bench("redundancy", as_json=True) == 2
    err = capsys.readouterr().err
    assert "bench redundancy: SPOTPIPE_BENCH_PROTOTYPES: unknown ['bogus']" in err


def test_a_failover_pause_counts_the_iterations_before_the_fault(tmp_path):
    """Iterations of 0.1 s until the kill at 10.0 s, 0.3 s on the smaller layout after it:
    the pause is counted in the 0.1 s iterations (the first 3, warm-up, left out), not in
    the median of the whole run (0.3 s here)."""
    from spotpipe.bench.failover import iteration_before_faults

    _write(tmp_path / "events.jsonl", [
        {"time_s": 0.0, "kind": "launch", "node": "launcher", "t0": 1000.0},
        {"time_s": 10.0, "kind": "fault_injected", "node": "node1", "fault": "fail",
         "iteration": 8, "phase": "backward"},
        {"time_s": 14.0, "kind": "fault_injected", "node": "node3", "fault": "fail",
         "iteration": 16, "phase": "forward"}])
    slow = [0.5, 0.5, 0.5] + [0.1] * 5 + [0.3] * 12  # warm-up, healthy, after the kill
    _write(tmp_path / "metrics.jsonl", [
        {"iter": t, "iter_time_s": it, "time_s": 1.0 + t * 1.2} for t, it in enumerate(slow)])
    assert iteration_before_faults(tmp_path) == 0.1


def test_a_layout_changes_pause_skips_recovered_lines_and_takes_off_the_new_layouts_iteration(
        tmp_path):
    """`bench reconfigure`'s stall, on a run written by hand: iterations of 0.1 s, a crash
    whose agreement recovered iteration 5's line at 1.05 s (after the loss, before the plan
    at 1.1 s), then the new layout's iterations of 0.2 s from 1.6 s. The stall runs from the
    last line a worker wrote (iteration 4 at 0.5 s; iteration 5's is the coordinator's)
    to the first after the plan (1.6 s), less one of the new layout's iterations (0.2 s):
    0.9 s. Before, the recovered line at 1.05 s was taken for the last iteration (0.55 s less
    the run's median iteration, 0.2 s: 0.35 s)."""
    import json

    from spotpipe.bench.reconfigure import _stall

    lines = [{"iter": i, "time_s": round(0.1 * (i + 1), 6), "iter_time_s": 0.1}
             for i in range(5)]
    lines.append({"iter": 5, "time_s": 1.05, "iter_time_s": 0.55, "recovered": True})
    lines += [{"iter": 6 + k, "time_s": round(1.6 + 0.2 * k, 6), "iter_time_s": 0.2}
              for k in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    events = [{"kind": "plan", "action": "drop_pipeline", "time_s": 1.1, "resume": 6,
               "generation": 1},
              {"kind": "regrouped", "generation": 1, "bytes_received": 7}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    got = _stall(tmp_path, "drop_pipeline")
    assert got["iteration_s"] == pytest.approx(0.2)
    assert got["pause_s"] == pytest.approx(1.6 - 0.5 - 0.2)
    assert got["bytes"] == 7
