"""Validation of the simulator against a real local replay (spotpipe.sim.validate).

The replay is a real `spotpipe train` run of a tiny GPT with one trace-driven preemption,
about 15-25 s on 2 CPU cores; the comparison is then checked for consistency (what it
measured is what the run's files say; the prediction uses the calibrated figures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotpipe.sim.validate import SHARED_TRACE, _loss_slots, compare, replay, write_segment

ROOT = Path(__file__).resolve().parents[1]


def test_segment_puts_losses_on_non_adjacent_stages(tmp_path):
    if not SHARED_TRACE.exists():
        pytest.skip("shared traces not present")
    info = write_segment(SHARED_TRACE, tmp_path / "seg.csv", start_s=3000, span_s=360,
                         stages=4, pipelines=1)
    lines = (tmp_path / "seg.csv").read_text().splitlines()
    assert lines[0].startswith("delta_ms")
    adds = [ln.split(",")[2] for ln in lines[1:] if ",add," in ln]
    removes = [ln.split(",")[2] for ln in lines[1:] if ",remove," in ln]
    assert len(adds) == 4 and len(removes) == 2
    assert [adds.index(n) for n in removes] == [1, 3]  # stages 1 and 3: not neighbours
    assert info["losses"] == {"node1": 60.0, "node13": 180.0}
    assert _loss_slots(2, 2, 2) == [1, 3]  # one loss per pipeline


def test_compare_on_a_real_tiny_replay(tmp_path):
    if not SHARED_TRACE.exists():
        pytest.skip("shared traces not present")
    seg = tmp_path / "seg.csv"
    write_segment(SHARED_TRACE, seg, start_s=3000, span_s=120, stages=2, pipelines=1, losses=1)
    rep = replay(ROOT / "examples" / "gpt_tiny.yaml", tmp_path / "run", seg, time_scale=12.0,
                 stages=2, pipelines=1, iterations=250,
                 sets=["model.gpt.n_layer=2", "redundancy=lazy"], timeout_s=150)
    assert rep["rc"] == 0, rep["tail"]
    out = compare(tmp_path / "run", seg, 12.0)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
            if x.strip()]
    window = rows[-1]["time_s"] - rows[0]["time_s"]
    assert out["window_s"] == pytest.approx(window)
    assert out["measured_samples_per_s"] == pytest.approx(
        (rows[-1]["samples"] - rows[0]["samples"]) / window)
    assert out["kills"] == 1 and out["predicted_failovers"] == 1
    assert out["predicted_fatal"] == 0 and out["calibrated_pause_s"] > 0
    assert 0 < out["predicted_samples_per_s"]
    assert out["prediction_error"] == pytest.approx(
        abs(out["predicted_samples_per_s"] - out["measured_samples_per_s"])
        / out["measured_samples_per_s"])
    assert out["prediction_error"] < 1.0  # same order of magnitude; the figure is the bench's
