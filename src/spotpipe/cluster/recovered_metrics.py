"""The metrics line of a committed iteration that no node posted.

Pipeline 0's last stage posts each iteration's `Metrics` once the iteration is committed,
after an all-reduce of the loss over the pipelines. A failure can take that record with it
while the iteration stands: the node lost right after the commit; the node cut short in its
norm gather (the commit point) after a peer had completed it, so the agreement resumes after
the iteration; or a pipeline's last stage lost in the loss's all-reduce. `metrics.jsonl`
would then skip an iteration that training did: a hole in the plot, and a reader counting
lines one short. The coordinator writes the line instead, from what the agreement's reports
say, once the gap shows (`MetricsLines.fill_to`), marked `"recovered": true`; what no report
knows stays null rather than being made up (the loss when a pipeline's loss went with its
node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from spotpipe.config import Config
from spotpipe.plan.layout import Layout
from spotpipe.protocol import Metrics, Report


def recovered_metrics(cfg: Config, iteration: int, *, generation: int, layout: Layout,
                      reports: Mapping[str, Report], previous: Mapping[str, Any] | None,
                      now: float) -> dict[str, Any]:
    """The line of `iteration`, committed in `generation` under `layout`, from that
    generation's reports; `previous` is the line before it (None: the first of the run),
    `now` the coordinator's clock (the run's `time_s`)."""
    last = layout.num_stages - 1
    shares: list[float | None] = []
    for d in range(layout.num_pipelines):
        report = reports.get(layout.owner(d, last))
        if report is None or report.unposted_iteration != iteration:
            break  # this pipeline's loss went with its last stage's node
        shares.append(report.unposted_loss)
    whole = len(shares) == layout.num_pipelines and None not in shares
    loss = _float32_sum(shares) if whole else math.nan  # (finite shares can overflow)
    norms = [r.committed_grad_norm for r in reports.values()
             if r.committed_through == iteration and r.committed_grad_norm is not None]
    # the time since the line before: the iteration, its failure's detection and agreement
    # (hosts' clocks differ a little: never below 0)
    took = max(0.0, round(now - (previous["time_s"] if previous else 0.0), 6))
    record = Metrics(
        iter=iteration, loss=loss if math.isfinite(loss) else None,
        samples=(iteration + 1) * cfg.global_batch, time_s=now, iter_time_s=took,
        samples_per_s=round(cfg.global_batch / took, 3) if took > 0 else 0.0,
        lr=cfg.lr_at(iteration), grad_norm=norms[0] if norms else None,
        live_nodes=len(layout.active_nodes), carriers=len(layout.carriers()),
        generation=generation, standby=len(layout.standby))
    return {**record.to_json(), "recovered": True}


def _float32_sum(shares: list[float | None]) -> float:
    """The shares added as the posted loss is (a float32 all-reduce; in pipeline order,
    which is gloo's for two pipelines)."""
    total = np.float32(0.0)
    with np.errstate(over="ignore"):  # (an overflow is inf, which the caller nulls)
        for share in shares:
            total = np.float32(total + np.float32(share))
    return float(total)
