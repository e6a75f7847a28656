"""`spotpipe bench pipeline --json --quick`: runs end to end and reports every figure.

No timing thresholds: the machine is shared and noisy; the figures are checked for being there,
finite and positive, and the two systems for computing the same first loss.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

KEYS = ["ratio_1f1b", "ratio_gpipe", "model_error",
        "spotpipe_1f1b_samples_per_s", "torch_1f1b_samples_per_s",
        "spotpipe_gpipe_samples_per_s", "torch_gpipe_samples_per_s",
        "predicted_iter_s_1f1b", "measured_iter_s_1f1b",
        "predicted_iter_s_gpipe", "measured_iter_s_gpipe", "rounds",
        "limit_ratio_1f1b", "limit_ratio_gpipe", "bound_iter_s", "bound_ratio_1f1b",
        "bound_ratio_gpipe", "ran_bound_iter_s_1f1b", "ran_bound_ratio_1f1b",
        "ran_bound_iter_s_gpipe", "ran_bound_ratio_gpipe"]


def test_bench_pipeline_quick_json():
    proc = subprocess.run([sys.executable, "-m", "spotpipe", "bench", "pipeline", "--json",
                           "--quick"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert key in figures, f"missing {key}"
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert isinstance(figures["config"], str) and figures["config"]
    # both systems start from the same weights on the same micro-batches: same first loss
    assert figures["first_loss_abs_diff"] < 1e-4
    # the op table: every stage's ops and outside_ops add up to its gap from the model
    for kind in ("1f1b", "gpipe"):
        gap = figures[f"gap_by_operation_{kind}"]
        for stage in range(2):
            parts = sum(row[stage] for op, row in gap.items() if op != "total")
            assert abs(parts - gap["total"][stage]) < 1e-4, (kind, stage, gap)
        assert figures[f"op_s_per_iteration_{kind}"]["forward"][0] > 0


def test_predicted_op_seconds_match_a_timeline_worked_by_hand():
    # 1F1B, P=2, M=2, forward 1 s, backward 2 s, free messages, reduction 0.5 s, step 0.25 s.
    # Stage 0: F0 [0,1], F1 [1,2], waits for grad 0 until 4, B0 [4,6], waits for grad 1 until
    # 7, B1 [7,9], reduction [9,9.5], step [9.5,9.75].
    # Stage 1: waits for act 0 until 1, F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7], waits at the
    # barrier until 9, reduction, step: the same 9.75 s.
    from spotpipe.bench.pipeline import gap_by_operation, predicted_op_seconds

    profile = {"forward_s": [1.0, 1.0], "backward_s": [2.0, 2.0], "comm_s": 0.0,
               "reduce_s": [0.5, 0.5], "optimizer_s": [0.25, 0.25]}
    ops = predicted_op_seconds(profile, "1f1b", 2)
    assert ops["forward"] == [2.0, 2.0]
    assert ops["backward"] == [4.0, 4.0]
    assert ops["recv_grad"] == [3.0, 0.0]
    assert ops["recv_act"] == [0.0, 1.0]
    assert ops["send_act"] == [0.0, 0.0] and ops["send_grad"] == [0.0, 0.0]
    assert ops["all_reduce"] == [0.5, 2.5]
    assert ops["optimizer_step"] == [0.25, 0.25]

    # measured: stage 1's forwards 0.5 s slower in all, and 0.25 s of its clock outside the
    # instructions; stage 0 as the model has it
    measured = {k: list(v) for k, v in ops.items()}
    measured["forward"][1] += 0.5
    measured["iteration"] = [9.75, 9.75 + 0.5 + 0.25]
    gap = gap_by_operation(measured, ops)
    assert gap["forward"] == [0.0, 0.5]
    assert gap["backward"] == [0.0, 0.0]
    assert gap["outside_ops"] == [0.0, 0.25]
    assert gap["total"] == [0.0, 0.75]


def test_no_schedule_passes_the_bound_worked_by_hand():
    # forward (1, 2) s, backward (2, 3) s, messages 0.5 s, M = 4, reduction 0.25, step 0.125.
    # Stage 0 works 4 x 3 = 12 s from 0; stage 1 waits for micro-batch 0's forward and its
    # message (1.5 s), then works 4 x 5 = 20 s: 21.5 s, then the reduction and the step.
    from spotpipe.bench.pipeline import bound
    from spotpipe.schedule import (StageCosts, any_schedule_bound, build_schedule, simulate,
                                   with_frc)

    profile = {"forward_s": [1.0, 2.0], "backward_s": [2.0, 3.0], "comm_s": 0.5,
               "reduce_s": [0.25, 0.1], "optimizer_s": [0.125, 0.0]}
    assert bound(profile, 4) == 21.875
    # every schedule the runtime builds stays at or above it, FRC in the bubbles included
    costs = StageCosts((1.0, 2.0, 1.5), (2.0, 3.0, 2.5), comm=0.5, all_reduce=0.25,
                       optimizer=0.125)
    floor = any_schedule_bound(costs, 4)
    for kind in ("1f1b", "gpipe"):
        plain = build_schedule(kind, 3, 4)
        assert simulate(plain, costs).iteration_s >= floor
        assert simulate(with_frc(plain, costs), costs).iteration_s >= floor


def test_the_bound_at_the_speed_the_stages_ran_worked_by_hand():
    # the profile says forward (1, 2) s and backward (2, 3) s; in the pipeline, over M = 4
    # micro-batches, stage 0's forwards took 6 s in all and its backwards 10 s, stage 1's 4 s
    # and 8 s, the steps 0.5 and 0.25 s. Per micro-batch: forward (1.5, 1), backward (2.5, 2).
    # Stage 0: 4 x 4 = 16 s; stage 1: its wait for micro-batch 0 (1.5 + 0.5 s), then
    # 4 x 3 = 12 s: 14 s. The busier, 16 s, plus the reduction (0.25) and the slower step (0.5)
    from spotpipe.bench.pipeline import as_ran, bound

    profile = {"forward_s": [1.0, 2.0], "backward_s": [2.0, 3.0], "comm_s": 0.5,
               "reduce_s": [0.25, 0.1], "optimizer_s": [0.125, 0.0]}
    measured = {"forward": [6.0, 4.0], "backward": [10.0, 8.0], "optimizer_step": [0.5, 0.25],
                "recv_act": [0.0, 3.0], "iteration": [20.0, 20.0]}
    ran = as_ran(profile, measured, 4)
    assert ran["forward_s"] == [1.5, 1.0] and ran["backward_s"] == [2.5, 2.0]
    assert ran["comm_s"] == 0.5 and ran["reduce_s"] == [0.25, 0.1]  # as profiled
    assert bound(ran, 4) == 16.75
    assert profile["forward_s"] == [1.0, 2.0]  # the profile itself is left as it was
