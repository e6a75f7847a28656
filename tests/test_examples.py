"""The shipped examples run as README says (shortened with --set)."""

from __future__ import annotations

import json

from conftest import REPO
from test_cli_errors import spotpipe


def test_user_factory_example_trains(tmp_path):
    out = tmp_path / "run"
    result = spotpipe("train", str(REPO / "examples" / "user_factory.yaml"), "--out", str(out),
                      "--no-progress", "--set", "iterations=40", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(metrics) == 40
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["stages"] == 3


def test_gpt_example_trains_with_tensorboard(tmp_path):
    out = tmp_path / "run"
    result = spotpipe("train", str(REPO / "examples" / "gpt_tiny.yaml"), "--out", str(out),
                      "--stages", "2", "--no-progress", "--set", "iterations=15",
                      "--set", "logging.tensorboard=true", "--set", "model.gpt.n_layer=2")
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert any((out / "tensorboard").iterdir())
