"""How often to checkpoint: the Young/Daly optimum from the checkpoint cost and the failure rate.

Pure arithmetic (no torch), so the simulator and the planner can use it as well as the workers.

A checkpoint that blocks training for C seconds, taken every T seconds of work, on a machine
that fails on average every M seconds, wastes about C/T (the checkpoints) plus T/(2M) (the work
redone after a failure, half an interval on average) of the time. Young (1974) minimised that:
T = sqrt(2 C M). Daly (2006) added the higher-order terms (the restart time aside, which does not
move the optimum): T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2M, else T = M.

C is what the training loop *waits* for (for an asynchronous scheme, the snapshot, not the
persist that overlaps training): that is the cost the interval trades against lost work.
"""

from __future__ import annotations

import math


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: seconds of work between two checkpoints."""
    _check(cost_s, mtbf_s)
    return _root_2cm(cost_s, mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (J. T. Daly, FGCS 22(3), 2006, eq. 37)."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return _root_2cm(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def _root_2cm(cost_s: float, mtbf_s: float) -> float:
    """sqrt(2 C M), taken factor by factor: the product 2 C M overflows to infinity for large
    but finite inputs (an MTBF of 1e308 s, a config's way of saying "never")."""
    return math.sqrt(2.0) * math.sqrt(cost_s) * math.sqrt(mtbf_s)


def interval_iterations(cost_s: float, mtbf_s: float, iteration_s: float, *,
                        formula: str = "daly", max_iterations: int | None = None) -> int:
    """The optimum as a whole number of iterations (at least 1, at most `max_iterations`)."""
    if iteration_s <= 0 or not math.isfinite(iteration_s):
        raise ValueError(f"iteration_s: expected a positive time, got {iteration_s}")
    if formula == "young":
        seconds = young_interval_s(cost_s, mtbf_s)
    elif formula == "daly":
        seconds = daly_interval_s(cost_s, mtbf_s)
    else:
        raise ValueError(f"formula: expected 'young' or 'daly', got {formula!r}")
    iterations = seconds / iteration_s  # (infinite where finite inputs are huge enough)
    if max_iterations and iterations >= max_iterations:
        return max_iterations
    if not math.isfinite(iterations):
        raise ValueError(f"interval_iterations: {seconds} s of work at {iteration_s} s per "
                         f"iteration is no whole number of iterations (give max_iterations)")
    return max(1, round(iterations))


def mtbf_estimate(prior_mtbf_s: float, elapsed_s: float, failures: int) -> float:
    """Mean time between failures from the prior and what the run has seen so far.

    The prior counts as one failure observed over `prior_mtbf_s` seconds (a conjugate
    Gamma prior on the failure rate): with no failures the estimate drifts up from the prior as
    the run survives, each failure pulls it down, and a single early failure cannot make it
    collapse to a few seconds."""
    if not (0 < prior_mtbf_s < math.inf and 0 <= elapsed_s < math.inf and failures >= 0):
        raise ValueError(f"mtbf_estimate: expected a finite prior > 0, a finite elapsed >= 0 "
                         f"and failures >= 0; got "
                         f"{prior_mtbf_s}, {elapsed_s}, {failures}")
    return (prior_mtbf_s + elapsed_s) / (1.0 + failures)


def _check(cost_s: float, mtbf_s: float) -> None:
    if cost_s < 0 or not math.isfinite(cost_s):
        raise ValueError(f"cost_s: expected a time >= 0, got {cost_s}")
    if mtbf_s <= 0 or not math.isfinite(mtbf_s):
        raise ValueError(f"mtbf_s: expected a positive time, got {mtbf_s}")
