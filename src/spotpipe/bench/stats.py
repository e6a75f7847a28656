"""The few statistics the benchmarks report, pure so that tests can check them by hand:
nearest-rank percentiles (a figure that is one of the samples, as p99 of 50 pauses should be;
every percentile a bench reports is one of these) and ratios of medians (a restart's pause
over a failover's, each measured several times)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the smallest sample with at least q percent of the samples
    at or below it (q in (0, 100])."""
    if not values:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q}: expected 0 < q <= 100")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ratio_of_medians(slow: Sequence[float], fast: Sequence[float]) -> float:
    """median(slow) / median(fast), e.g. how many failover pauses one restart costs."""
    if not slow or not fast:
        raise ValueError("a ratio needs samples on both sides")
    base = statistics.median(fast)
    if base <= 0:
        raise ValueError(f"a ratio over a median of {base}")
    return statistics.median(slow) / base


def fastest_tenth_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """p10(base) / p10(other), nearest rank: `other`'s throughput over `base`'s, each side
    judged on its fastest tenth (other processes taking the cores only ever add time)."""
    return percentile(base, 10) / percentile(other, 10)


def distribution(values: Sequence[float], digits: int = 4) -> dict[str, float]:
    """p50, p90, p99 and the maximum, rounded."""
    return {"p50": round(percentile(values, 50), digits),
            "p90": round(percentile(values, 90), digits),
            "p99": round(percentile(values, 99), digits),
            "max": round(max(values), digits)}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One figure set from several runs of a bench: each figure that every run gave as a
    finite number is the median over the runs, with the runs' own values under `per_run`;
    any other figure (text, lists, flags) is the first run's. On shared cores one run's ratio
    moves by several percent from run to run; the median of a few does not."""
    if not runs:
        raise ValueError("a median of no runs")
    first = runs[0]
    out: dict[str, Any] = {}
    per_run: dict[str, list[Any]] = {}
    for key, value in first.items():
        values = [run.get(key) for run in runs]
        if all(_number(v) for v in values):
            out[key] = statistics.median(values)
            per_run[key] = values
        else:
            out[key] = value
    out["runs_combined"] = len(runs)
    out["per_run"] = per_run
    return out
