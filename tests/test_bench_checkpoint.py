"""`spotpipe bench checkpoint --json --quick`: runs end to end and reports every figure; the
lost-work computation on hand-made timelines.

No timing thresholds: the machine is shared and noisy; figures are checked for being there,
finite and positive.
"""

from __future__ import annotations

from spotpipe.bench.checkpoint import BASELINES, INTERVALS, VARIANTS, lost_iterations

from conftest import bench_figures, positive


def test_bench_checkpoint_quick_json():
    figures = bench_figures("checkpoint", timeout=600)
    names = [f"{b}_k{k}" for b in BASELINES for k in INTERVALS]
    for name in names:
        for key in (f"{name}_ratio", f"{name}_bytes_per_iteration"):
            assert positive(figures.get(key)), (key, figures.get(key))
        assert figures[f"{name}_blocked_s_per_checkpoint"] >= 0
        # k = 1 loses the one in flight (or nothing, after the checkpoint); k = 10 more
        assert figures["lost_iterations_per_failure"][name] > (0.5 if name.endswith("1") else 1)
    # every k = 1 scheme moves about ten times the bytes of its k = 10 run
    for b in BASELINES:
        ratio = figures[f"{b}_k1_bytes_per_iteration"] / figures[f"{b}_k10_bytes_per_iteration"]
        assert 8 <= ratio <= 12, (b, ratio)
    for key in ("durable_blocked_s_per_checkpoint", "durable_blocked_s_per_checkpoint_nofsync",
                "durable_mac_s_per_checkpoint", "durable_commit_s_per_checkpoint"):
        assert positive(figures[key]), (key, figures.get(key))
    for key in ("recovery_s", "recovery_with_replay_s", "none_iter_s", "wall_s",
                "shadow_ratio", "shadow_recovery_s"):
        assert positive(figures[key]), (key, figures.get(key))
    # shadows: every loss repaired in place, losing at most the iteration in flight
    assert figures["shadow_failures"] == 2
    assert figures["shadow_lost_iterations_max"] <= 1
    assert 0 <= figures["lost_iterations_per_failure"]["shadow"] <= 1


def test_durable_costs_are_measured_on_a_real_stage_write():
    import math

    from spotpipe.bench import durable_costs

    figures = durable_costs.run(repeats=2)
    for key in ("durable_blocked_s_per_checkpoint", "durable_blocked_s_per_checkpoint_nofsync",
                "durable_mac_s_per_checkpoint", "durable_commit_s_per_checkpoint"):
        assert positive(figures[key]), (key, figures[key])
    assert math.isfinite(figures["durable_fsync_s_per_checkpoint"])  # a difference: noisy
    assert figures["durable_stage_bytes"] > 1_000_000  # the benchmark GPT's stage, with AdamW


def test_variants_are_the_reference_and_each_baseline_at_each_interval():
    assert VARIANTS[0] == ("none", "none", 0)
    assert {(s, k) for _, s, k in VARIANTS[1:]} >= {(b, k) for b in BASELINES for k in INTERVALS}


def _timeline(n: int) -> list[list[float]]:
    return [[t, float(t), float(t + 1)] for t in range(n)]  # iteration t runs [t, t + 1)


def test_lost_iterations_of_a_checkpoint_every_iteration_is_the_one_in_flight():
    # both stages of iteration t complete right at its end
    records = [[t, s, "checkpoint_done", t + 1.0] for t in range(20) for s in (0, 1)]
    lost = lost_iterations(records, _timeline(20), 2, kills=30, seed=1)
    assert len(lost) == 30 and set(lost) == {1}
    # complete half-way through the iteration (its own checkpoint is part of it): a kill after
    # that loses nothing
    records = [[t, s, "checkpoint_done", t + 0.5] for t in range(20) for s in (0, 1)]
    assert set(lost_iterations(records, _timeline(20), 2, kills=200, seed=1)) == {0, 1}


def test_lost_iterations_every_k_and_late_or_partial_checkpoints():
    # every 10, complete at once: a kill in iteration u loses u - 9 (u in 10..19), mean 5.5
    records = [[t, s, "checkpoint_done", t + 1.0] for t in (9, 19) for s in (0, 1)]
    lost = lost_iterations(records, _timeline(30)[10:20], 2, kills=400, seed=2)
    assert set(lost) <= set(range(1, 11)) and abs(sum(lost) / len(lost) - 5.5) < 0.5
    # a checkpoint persisted 2.5 iterations late counts only from then on
    late = [[9, s, "checkpoint_done", 12.5] for s in (0, 1)] + \
           [[4, s, "checkpoint_done", 5.0] for s in (0, 1)]
    lost = lost_iterations(late, _timeline(14)[10:14], 2, kills=400, seed=3)
    # iteration 10: 6, 11: 7, 12: 8 before 12.5 and 3 after, 13: 4
    assert set(lost) == {6, 7, 8, 3, 4}
    # a stage missing: that iteration is not a checkpoint
    half = [[9, 0, "checkpoint_done", 10.0]]
    assert lost_iterations(half, _timeline(14), 2, kills=5, seed=4) == []
    # gemini: only the peer's copy counts
    sent = [[9, s, "checkpoint_done", 10.0] for s in (0, 1)]
    held = [[9, s, "checkpoint_held", 11.0] for s in (0, 1)]
    lost = lost_iterations(sent + held, _timeline(14)[10:14], 2, kills=200, seed=5)
    assert set(lost) == {2, 3, 4}  # a kill during iteration 10 finds nothing complete yet


def test_summary_figures_against_hand_computed_values():
    """Four rounds: the ratios, their nearest-rank quartiles (the 1st and 3rd of 4 ratios), the
    bytes, the blocked seconds and the blocking-only ratio, each worked out by hand."""
    from spotpipe.bench.checkpoint import summarize

    names = [name for name, _, _ in VARIANTS]
    # blocks of 10 iterations: none's take 1.0 s; every variant's 1.0, 1.25, 2.0, 1.0 s
    blocks = {name: [1.0, 1.25, 2.0, 1.0] for name in names[1:]}
    blocks["none"] = [1.0] * 4
    # per rank: [bytes, blocked_s, checkpoints, iterations]; the slower rank blocked 0.2 s
    # over 4 checkpoints, 0.05 s each
    per_rank = {name: [[1000.0, 0.1, 4.0, 50.0], [3000.0, 0.2, 4.0, 50.0]] for name in names}
    raw = {"block_s": blocks, "iters_per_block": 10, "per_rank": per_rank,
           "records": {name: [] for name in names}, "timeline": {name: [] for name in names}}
    out = summarize(raw, {"kills": 5, "seed": 0, "rounds": 4})
    # ratios 1.0, 0.8, 0.5, 1.0 -> sorted 0.5, 0.8, 1.0, 1.0: median 0.9; quartiles the 1st
    # (ceil(0.25 * 4) = 1) and the 3rd (ceil(0.75 * 4) = 3)
    assert out["torch_save_k1_ratio"] == 0.9
    assert out["ratio_quartiles"]["torch_save_k1"] == [0.5, 1.0]
    assert out["torch_save_k1_bytes_per_iteration"] == 80  # 4000 bytes over 50 iterations
    assert out["torch_save_k1_blocked_s_per_checkpoint"] == 0.05
    # iteration 0.1 s; k = 1: 0.1 / (0.1 + 0.05); k = 10: 0.1 / (0.1 + 0.005)
    assert out["torch_save_k1_blocking_only_ratio"] == round(0.1 / 0.15, 4)
    assert out["torch_save_k10_blocking_only_ratio"] == round(0.1 / 0.105, 4)
    assert out["none_iter_s"] == 0.1 and out["lost_iterations_per_failure"] == {}


def test_the_restart_baseline_starts_its_workers_as_torchrun_does(monkeypatch):
    """`recovery_s` is bench failover's cold restart: both jobs (the one killed and the one
    that resumes) start every worker in a fresh interpreter, not as forks of a server that
    imported torch already (in the full run: `--quick`, this bench's test, forks them)."""
    from spotpipe.bench import checkpoint, failover

    jobs: list[tuple[str, ...]] = []
    monkeypatch.setattr(failover, "_train", lambda out, *args, check=True: jobs.append(args))
    monkeypatch.setattr(failover, "restart_pause", lambda first, second: {
        "restart_first_iteration_s": 5.0, "restart_pause_s": 6.0,
        "restart_lost_iterations": 4})
    assert checkpoint.recovery(quick=False)["recovery_s"] == 5.0
    assert checkpoint.recovery(quick=True)["recovery_s"] == 5.0
    assert len(jobs) == 4
    for args in jobs[:2]:
        assert "cluster.fork_server=false" in args, args
    for args in jobs[2:]:
        assert "cluster.fork_server=false" not in args, args


def test_a_failed_checkpoint_stops_the_bench_by_name():
    """A scheme's failed write (a record without a completion time) is reported, named, not
    a KeyError from the rows the lost-work figure is computed from."""
    import pytest

    from spotpipe.bench._checkpoint_worker import record_rows

    done = {"kind": "checkpoint_saved", "iteration": 9, "stage": 0, "done_time": 12.5,
            "bytes": 10, "blocked_s": 0.1}
    assert record_rows("dcp_async_k10", [done]) == [[9, 0, "checkpoint_saved", 12.5]]
    failed = {"kind": "checkpoint_failed", "iteration": 19, "stage": 1,
              "message": "OSError: [Errno 28] No space left on device"}
    with pytest.raises(RuntimeError, match=r"dcp_async_k10: the checkpoint of iteration 19, "
                       r"stage 1 failed \(1 in all\): OSError: \[Errno 28\]"):
        record_rows("dcp_async_k10", [done, failed])
