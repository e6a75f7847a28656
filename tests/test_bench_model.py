"""`spotpipe bench model --json --quick`: the GPT-2 example's three runs end to end (a small
GPT-2 in quick mode), every figure reported. No timing thresholds (the machine is shared)."""

from __future__ import annotations

from conftest import bench_figures, positive


def test_bench_model_quick_json():
    figures = bench_figures("model", timeout=900)
    for key in ("fp32_samples_per_s", "bf16_samples_per_s", "bf16_over_fp32",
                "failover_pause_s", "failover_pause_iterations", "failover_iteration_s"):
        assert positive(figures[key]), key
    for precision in ("fp32", "bf16"):
        rows = figures[f"{precision}_memory_per_stage"]
        assert [r["stage"] for r in rows] == [0, 1, 2, 3]
        for row in rows:
            assert positive(row["estimate_mib"]) and positive(row["peak_rss_mib"])
            assert row["peak_rss_mib"] >= row["rss_built_mib"] > 0
    assert set(figures["failover_parts_s"]) >= {"detection_s", "agreement_s", "takeover_s",
                                                "replay_s"}
