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


def test_bf16_over_fp32_is_the_ratio_of_the_speeds_not_of_their_rounded_figures(monkeypatch):
    """On a CPU without bf16 units bf16 runs at 0.0244 samples/s, fp32 at 0.2694: the ratio is
    0.0906, where the figures rounded to 3 decimals (0.024, 0.269) would give 0.0892."""
    from types import SimpleNamespace

    from spotpipe.bench import model

    speeds = {"fp32": (0.2694, 14.85), "bf16": (0.0244, 164.0), "failover": (0.0244, 164.0)}
    monkeypatch.setattr(model, "train_example", lambda out, args: SimpleNamespace(stderr=""))
    monkeypatch.setattr(model, "throughput", lambda run: speeds[run.name])
    monkeypatch.setattr(model, "_rss", lambda run: {})
    monkeypatch.setattr(model, "failover_pauses", lambda run: [])
    figures = model.run(quick=True)
    assert (figures["fp32_samples_per_s"], figures["bf16_samples_per_s"]) == (0.269, 0.024)
    assert figures["bf16_over_fp32"] == round(0.0244 / 0.2694, 3) == 0.091


def test_the_failover_pause_is_counted_in_the_failure_free_runs_iterations(monkeypatch):
    """The fault comes right after the warm-up, so the failover run's median iteration is of
    iterations after the takeover (20 s here, a node carrying two stages); the pause (33 s)
    is 2.0 of the failure-free bf16 run's 16.5 s iterations, not 1.65 of those."""
    from types import SimpleNamespace

    from spotpipe.bench import model

    speeds = {"fp32": (0.27, 14.85), "bf16": (0.24, 16.5), "failover": (0.2, 20.0)}
    monkeypatch.setattr(model, "train_example", lambda out, args: SimpleNamespace(stderr=""))
    monkeypatch.setattr(model, "throughput", lambda run: speeds[run.name])
    monkeypatch.setattr(model, "_rss", lambda run: {})
    monkeypatch.setattr(model, "failover_pauses", lambda run: [{"pause_s": 33.0}])
    figures = model.run(quick=True)
    assert figures["failover_pause_iterations"] == 2.0
