"""What a run with failures must show against its failure-free run, as problems found (an empty
list when it holds): the tests assert on these and `bench chaos` counts them.

- every sample of every iteration consumed exactly once (from the sample log, discounting
  iterations a plan rolled back: they were replayed);
- one metrics line per iteration, in order (a line a failure kept from being posted is
  written by the coordinator, `recovered`);
- the final parameters equal the failure-free run's bit for bit, or to float tolerance where
  the data-parallel width changed (only the order of summation differs then).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from spotpipe.runfiles import read_jsonl

# where D changed: the order of summation differs, nothing else (DESIGN.md's invariants).
# Compared per tensor by norm, not element by element: a coordinate whose gradient is zero in
# exact arithmetic (the key part of an attention's c_attn bias: softmax ignores a constant added
# to every key) gets only rounding noise, which Adam scales up to steps of up to lr, so another
# summation order moves it by as much as 1e-6 while its tensor stays within 1e-4 (seen on
# 2026-12-02: 4.5e-5 relative, one element 1.15e-6 away, every other tensor within 1e-7). A real
# fault (a sample lost or counted twice, a stale replica) moves every tensor by 1e-3 or more.
RTOL, ATOL = 1e-4, 1e-6


def sample_problems(run: Path, cfg: Any) -> list[str]:
    """Each iteration consumed exactly its global batch, once, whatever the layout did."""
    from spotpipe import job

    sampler = job.build_sampler(cfg, job.build_dataset(cfg))
    rolled_back = {ev["generation"]: ev["resume"] for ev in read_jsonl(run / "events.jsonl")
                   if ev["kind"] == "agreement"}
    per_iter: dict[int, list[int]] = {}
    entries: Counter[tuple[int, int]] = Counter()
    for path in sorted((run / "logs").glob("samples.*.jsonl")):
        for line in open(path):
            r = json.loads(line)
            g = r["generation"]
            if g in rolled_back and r["iter"] >= rolled_back[g]:
                continue  # consumed by an iteration that was replayed
            entries[(r["iter"], r["pipeline"])] += 1
            per_iter.setdefault(r["iter"], []).extend(i for mb in r["samples"] for i in mb)
    problems = []
    if sorted(per_iter) != list(range(cfg.iterations)):
        missing = sorted(set(range(cfg.iterations)) - set(per_iter))
        problems.append(f"iterations without logged samples: {missing}")
    twice = [(k, n) for k, n in entries.most_common(3) if n > 1]
    if twice:
        problems.append(f"(iteration, pipeline) logged more than once: {twice}")
    for t, samples in sorted(per_iter.items()):
        if sorted(samples) != sorted(sampler.indices(t)):
            problems.append(f"iteration {t}: samples differ from its global batch")
    return problems


def metrics_problems(run: Path, cfg: Any) -> list[str]:
    """metrics.jsonl has one line per iteration, in order."""
    logged = [m["iter"] for m in read_jsonl(run / "metrics.jsonl")]
    if logged == list(range(cfg.iterations)):
        return []
    missing = sorted(set(range(cfg.iterations)) - set(logged))
    twice = sorted(t for t, n in Counter(logged).items() if n > 1)
    return [f"metrics.jsonl: iterations {logged[:3]}...{logged[-3:]} ({len(logged)} lines)"
            + (f", without a line: {missing}" if missing else "")
            + (f", with more than one: {twice}" if twice else "")
            + ("" if missing or twice else ", out of order")]


def parameter_problems(got: dict[str, Any], want: dict[str, Any], *,
                       exact: bool = True) -> list[str]:
    """Tensors of `got` that differ from `want`: bit for bit, or (`exact` False) by more than
    RTOL of the tensor's norm plus ATOL."""
    import torch

    problems = [f"{key}: missing" for key in want if key not in got]
    for key in want:
        if key not in got:
            continue
        if torch.equal(got[key], want[key]):
            continue
        a, b = got[key].double(), want[key].double()
        if not exact and a.shape == b.shape and \
                float((a - b).norm()) <= RTOL * float(b.norm()) + ATOL:
            continue
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)}, the failure-free run's "
                            f"{tuple(b.shape)}")
            continue
        rel = float((a - b).norm()) / max(float(b.norm()), 1e-30)
        problems.append(f"{key} differs from the failure-free run (max abs diff "
                        f"{(a - b).abs().max().item():.3g}, {rel:.3g} of its norm)")
    return problems
