"""What a user watches of a run that resumes from a checkpoint: the progress bar, the summary
and the report `spotpipe train` prints, checked against figures counted by hand."""

from __future__ import annotations

import json

from spotpipe.cluster.launcher import train
from spotpipe.cluster.story import describe

from conftest import tiny_config

# 6 iterations of 8 samples (4 micro-batches of 2), checkpointed after iterations 1 and 3
RUN = {"iterations": 6, "checkpoint.every": 2, "model.gpt.n_layer": 2}


def test_a_resumed_run_is_counted_from_where_it_resumed(tmp_path, corpus, capsys):
    """Resumed at iteration 4 of 6, the job trains 2 iterations. The bar ran from 0 of 6 and
    ended at 2/6 (its ETA counting 4 iterations too many), and the summary's samples_per_s
    counted the 32 samples of iterations 0-3, trained by another run, in this one's time."""
    saved = tmp_path / "saved"
    assert train(tiny_config(corpus, stages=2, **RUN), saved, progress=False) == 0
    resumed = tmp_path / "resumed"
    cfg = tiny_config(corpus, stages=2, **{**RUN, "logging.progress": True})
    capsys.readouterr()
    assert train(cfg, resumed, resume=saved / "checkpoints" / "iter_00000003") == 0
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "6/6" in bar and "100%" in bar, bar
    metrics = [json.loads(line) for line in open(resumed / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == [4, 5]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["iterations"] == 6 and summary["samples"] == 48
    assert summary["first_iteration"] == 4
    trained = 2 * cfg.global_batch  # iterations 4 and 5, in this run's time
    assert summary["samples_per_s"] == round(trained / metrics[-1]["time_s"], 3)
    head = describe([], summary)[0]
    assert head.startswith("spotpipe: completed: 6 iterations, 48 samples, resumed at "
                           f"iteration 4: 2 iterations in {summary['wall_s']} s"), head
