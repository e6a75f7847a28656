"""`spotpipe bench redundancy --json --quick`: runs end to end and reports every figure.

No timing thresholds: the machine is shared and noisy; the figures are checked for being there,
finite and positive, and the correctness the benchmark sees on the way for holding: every mode
starts from the same loss, replicas stay bit-identical to their owners, and the redundant modes
(lazy, eager, eager with Bamboo's FRC) train to the same state.
"""

from __future__ import annotations

import math

from spotpipe.bench.redundancy import update_slot, with_update
from spotpipe.schedule import Op, StageCosts, build_schedule, simulate

from conftest import bench_figures, positive

KEYS = ["lazy_ratio", "eager_ratio", "eager_predicted_ratio", "lazy_predicted_ratio",
        "replica_memory_multiple", "none_iter_s", "lazy_iter_s", "eager_iter_s",
        "predicted_iter_s_none", "predicted_iter_s_eager", "gradient_over_state_bytes",
        "eager_predicted_ratio_with_update", "rounds", "wall_s",
        "lazy_predicted_ratio_in_run_costs", "eager_predicted_ratio_in_run_costs",
        "eager_every_ratio", "eager_every_predicted_ratio", "eager_every_iter_s",
        "predicted_iter_s_eager_every", "eager_every_predicted_ratio_in_run_costs",
        "frc_s_per_iteration_predicted"]
PER_NODE = ["replica_memory_multiple_per_node", "gradient_bytes_per_iteration", "state_bytes",
            "replica_activation_bytes_eager", "replica_activation_bytes_eager_every",
            "profile_frc_s_by_stage", "profile_replica_update_s"]


def test_bench_redundancy_quick_json():
    figures = bench_figures("redundancy", timeout=120)
    for key in KEYS:
        assert key in figures, f"missing {key}"
        assert positive(figures[key]), (key, figures[key])
    for key in PER_NODE:
        assert len(figures[key]) == 2 and all(positive(v) for v in figures[key]), (key,
                                                                                   figures[key])
    assert math.isfinite(figures["eager_gap_pp"]) and math.isfinite(figures["eager_every_gap_pp"])
    assert figures["lazy_predicted_ratio"] == 1.0  # replication is off the modelled path
    # on two stages eager runs no FRC (it would serve no takeover); Bamboo's FRC costs
    assert figures["eager_predicted_ratio"] == 1.0
    assert "frc_forward" not in figures["eager_op_s_per_iteration"]
    assert all(s > 0 for s in figures["eager_every_op_s_per_iteration"]["frc_forward"])
    assert figures["eager_every_predicted_ratio"] < 1.0
    # the gradient is a third of fp32 AdamW's state (params + two moments), flags aside
    assert abs(figures["gradient_over_state_bytes"] - 1 / 3) < 0.01
    assert figures["first_loss_max_abs_diff"] == 0.0
    assert figures["lazy_replicas_exact"] and figures["eager_replicas_exact"]
    assert figures["eager_every_replicas_exact"]
    assert figures["lazy_eager_states_identical"]
    assert isinstance(figures["config"], str) and figures["config"]


def test_update_slot_and_model():
    plain = build_schedule("1f1b", 2, 4)
    # stage 0 may first wait for a gradient, after its warm-up forwards; stage 1 at once
    assert plain.streams[0][update_slot(plain.streams[0])].op == Op.RECV_GRAD
    assert update_slot(plain.streams[1]) == 0
    costs = StageCosts.uniform(2, 1.0, 2.0, comm=0.1)
    base = simulate(plain, costs).iteration_s
    # an update shorter than the first bubble is free; a longer one costs its excess
    assert simulate(*with_update(plain, costs, 0.5)).iteration_s == base
    assert simulate(*with_update(plain, costs, 10.0)).iteration_s > base


def test_block_means_count_the_catching_up():
    from spotpipe.bench.redundancy import block_means

    # two blocks of 2 iterations: (1 + 3 + 0.5) / 2 and (2 + 2 + 0) / 2, by hand
    assert block_means([1.0, 3.0, 2.0, 2.0], [0.5, 0.0], 2) == [2.25, 2.0]
    import pytest

    with pytest.raises(ValueError, match="3 iteration times for 2 blocks of 2"):
        block_means([1.0, 2.0, 3.0], [0.0, 0.0], 2)


def test_in_run_costs_are_the_traced_seconds_per_micro_batch():
    from spotpipe.bench.redundancy import in_run_costs

    # per iteration, M = 8: node 0 spent 8 s forward, 16 s backward, 4 s on FRC of stage 1;
    # node 1 16, 24 and 8 s (its FRC is of stage 0); messages and reduction as profiled
    op_s = {"forward": [8.0, 16.0], "backward": [16.0, 24.0], "frc_forward": [4.0, 8.0],
            "optimizer_step": [0.25, 0.5], "recv_grad": [3.0, 0.0]}
    profile = {"forward_s": [9.0, 9.0], "backward_s": [9.0, 9.0], "comm_s": 0.125,
               "reduce_s": [0.75, 0.5], "optimizer_s": [9.0, 9.0]}
    costs = in_run_costs(op_s, profile, 8)
    assert costs.forward == (1.0, 2.0) and costs.backward == (2.0, 3.0)
    assert costs.frc == (1.0, 0.5)
    assert (costs.comm, costs.all_reduce, costs.optimizer) == (0.125, 0.75, 0.5)
    assert in_run_costs({k: v for k, v in op_s.items() if k != "frc_forward"},
                        profile, 8).frc is None


def test_the_executed_streams_come_back_as_the_schedule_that_ran():
    from spotpipe.bench.redundancy import executed_schedule
    from spotpipe.schedule import with_frc

    plain = build_schedule("1f1b", 3, 4)
    placed = with_frc(plain, StageCosts((1.0, 2.0, 1.5), (2.0, 4.0, 3.0), comm=0.1))
    reported = [[[i.op.value, i.stage, i.mb, i.peer] for i in stream]
                for stream in placed.streams]
    assert executed_schedule(plain, reported) == placed


def _streams(schedule):
    return [[[i.op.value, i.stage, i.mb, i.peer] for i in stream] for stream in schedule.streams]


def test_summary_ratios_count_the_catching_up_against_hand_computed_values():
    """Ten rounds of two-iteration blocks. Every mode's iterations take what none's take
    (block i: 0.10 + 0.01 i s each), but the redundant modes' replicas catch up for 0.02 s
    after each block: 0.01 s per iteration. Both the median ratio and the fastest tenth's
    must show that cost (the fastest tenth of 10 blocks: the fastest block, nearest rank)."""
    from spotpipe.bench.redundancy import MODES, REDUNDANT, summarize
    from spotpipe.schedule import with_frc

    m, n, rounds = 4, 2, 10
    iterations = [0.10 + 0.01 * i for i in range(rounds) for _ in range(n)]
    catch_up = {mode: [0.0 if mode == "none" else 0.02] * rounds for mode in MODES}
    profile = {"forward_s": [1e-3, 1e-3], "backward_s": [2e-3, 2e-3], "comm_s": 1e-4,
               "reduce_s": [0.0, 0.0], "optimizer_s": [1e-4, 1e-4], "frc_s": [5e-4, 5e-4],
               "replica_update_s": [1e-4, 1e-4], "samples_per_rank": 3,
               "partition": [[0, 3], [3, 6]]}
    ops = {"forward": [m * 1e-3] * 2, "backward": [m * 2e-3] * 2, "optimizer_step": [1e-4] * 2}
    plain = build_schedule("1f1b", 2, m)
    every = with_frc(plain, StageCosts((1e-3, 1e-3), (2e-3, 2e-3), comm=1e-4,
                                       frc=(5e-4, 5e-4)), every_stage=True)
    raw = {"iter_times": {mode: list(iterations) for mode in MODES}, "catch_up_s": catch_up,
           "profile": profile, "eager_streams": _streams(plain),
           "eager_every_streams": _streams(every),
           **{f"{mode}_op_s": dict(ops) for mode in MODES},
           "own_state_bytes": [300.0, 300.0], "replica_state_bytes": [300.0, 300.0],
           "gradient_bytes_per_iteration": [100.0, 100.0], "state_bytes": [300.0, 300.0],
           **{f"{mode}_activation_bytes": [1.0, 1.0] for mode in REDUNDANT},
           **{f"{mode}_{k}": [0.0, 0.0] for mode in REDUNDANT
              for k in ("max_lag_seen", "waited_in_timed_s")},
           **{f"{mode}_replicas_exact": True for mode in REDUNDANT},
           "lazy_eager_states_identical": True, "first_loss": dict.fromkeys(MODES, 1.0),
           "iterations": dict.fromkeys(MODES, 23)}
    raw["eager_every_op_s"] = dict(ops, frc_forward=[m * 5e-4] * 2)
    spec = {"num_microbatches": m, "micro_batch_size": 2, "iters_per_round": n,
            "schedule": "1f1b", "max_lag": 2, "prototypes": [], "rounds": rounds, "cores": [],
            "gpt": {"n_layer": 2, "n_embd": 8, "n_head": 2, "block_size": 4, "vocab_size": 16}}
    out = summarize(raw, spec)
    # blocks' seconds per iteration: none 0.10 .. 0.19, medians 0.145; the others + 0.01
    assert out["none_iter_s"] == 0.145 and out["lazy_iter_s"] == 0.155
    assert out["lazy_ratio"] == round(0.145 / 0.155, 4)
    assert out["lazy_ratio_q10"] == round(0.10 / 0.11, 4)
    assert out["lazy_catch_up_s_per_iteration"] == 0.01
    assert out["lazy_ratio_rounds_min_median_max"] == [round(0.10 / 0.11, 4),
                                                       round((0.14 / 0.15 + 0.15 / 0.16) / 2,
                                                             4), round(0.19 / 0.20, 4)]
