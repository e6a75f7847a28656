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
