"""The run's output files as the coordinator writes them: metrics.jsonl, events.jsonl and
TensorBoard's scalars (`spotpipe.cluster.run_files`)."""

from __future__ import annotations

import json

from spotpipe.cluster.run_files import RunFiles


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows from `folder`, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def _line(t: int, loss: float | None, grad_norm: float | None = 1.0) -> dict:
    return {"iter": t, "loss": loss, "samples": 8 * (t + 1), "time_s": 0.1 * (t + 1),
            "iter_time_s": 0.1, "samples_per_s": 80.0, "lr": 0.01, "grad_norm": grad_norm,
            "live_nodes": 2, "carriers": 0, "generation": 0}


def test_a_null_figure_is_a_missing_point_in_tensorboard_not_a_crash(tmp_path):
    """A loss no report knows (a recovered line) or a non-finite one, and a non-finite
    gradient norm (`training.nonfinite: skip`), are null in metrics.jsonl. TensorBoard was
    given the null, raised, and the job loop died with a traceback mid-run
    (`--nan node1@2 --set training.nonfinite=skip --set logging.tensorboard=true`)."""
    from torch.utils.tensorboard import SummaryWriter

    files = RunFiles(tmp_path)
    files.tensorboard = SummaryWriter(str(tmp_path / "tensorboard"))
    files.metric(_line(0, 5.5))
    files.metric(_line(1, None, grad_norm=None))
    files.metric(_line(2, 5.25))
    files.close()
    assert [json.loads(x)["loss"] for x in open(tmp_path / "metrics.jsonl")] == [5.5, None, 5.25]
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["loss"] == [(0, 5.5), (2, 5.25)]
    assert scalars["grad_norm"] == [(0, 1.0), (2, 1.0)]
    assert [step for step, _ in scalars["lr"]] == [0, 1, 2]
