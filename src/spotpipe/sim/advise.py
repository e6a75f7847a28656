"""`spotpipe simulate --advise`: the configuration with the most samples per dollar on a trace.

Every candidate is simulated on the same trace with the same prices, model and pauses, and
ranked by samples per dollar (every dollar billed: the spot instances the trace grants, the
shadows' on-demand CPU host, or the on-demand instances):
- spot: the spotpipe policy with depth P (it may re-partition down to the smallest depth
  that fits memory) and at most D pipelines, redundancy none | lazy | eager, with or without
  CPU shadows, and without shadows a durable checkpoint interval (the candidates given, plus
  Young/Daly's sqrt(2 x cost x MTBF) from the trace's preemption rate when checkpoints cost
  something);
- on demand: P x D instances at the on-demand price, never preempted.
Layouts that do not fit memory are never candidates: they are listed as refused, with the
reason, and never ranked. A configuration's value is only as good as the trace: the
advice is for workloads whose preemptions look like it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from spotpipe.plan import splits_evenly
from spotpipe.sim import fit
from spotpipe.sim.params import SimConfig
from spotpipe.sim.simulator import Result, run
from spotpipe.sim.traces import Trace

DEPTHS = (2, 3, 4, 6, 8, 12, 16, 24)
INTERVALS_S = (600.0, 1800.0, 3600.0)


@dataclass(frozen=True)
class Candidate:
    market: str  # "spot" | "on_demand"
    stages: int
    pipelines: int
    redundancy: str = "none"
    shadows: bool = False
    checkpoint_interval_s: float = math.inf  # inf: none needed (shadows, or on demand)

    def label(self) -> str:
        if self.market == "on_demand":
            return f"on-demand {self.stages}x{self.pipelines}"
        ckpt = "shadows" if self.shadows else f"ckpt {self.checkpoint_interval_s:.0f}s"
        return f"spot {self.stages}x{self.pipelines} {self.redundancy} {ckpt}"


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    samples: float = 0.0
    dollars: float = 0.0
    throughput: float = 0.0
    fatal_failures: int = 0
    refused: str | None = None  # why the candidate cannot run (memory)

    @property
    def value(self) -> float:
        return self.samples / self.dollars if self.dollars > 0 else 0.0

    def row(self) -> dict[str, object]:
        c = self.candidate
        return {"market": c.market, "stages": c.stages, "pipelines": c.pipelines,
                "redundancy": c.redundancy, "shadows": c.shadows,
                "checkpoint_interval_s": c.checkpoint_interval_s, "label": c.label(),
                "samples": self.samples, "dollars": self.dollars, "value": self.value,
                "throughput": self.throughput, "fatal_failures": self.fatal_failures,
                "refused": self.refused}


def candidates(cfg: SimConfig, trace: Trace, depths: Sequence[int] = DEPTHS,
               intervals: Sequence[float] = INTERVALS_S) -> list[Candidate]:
    """The search space for this trace: every depth the model allows, every width the
    trace's peak allows at that depth."""
    peak = max(1, trace.peak_nodes)
    out: list[Candidate] = []
    ivals = list(intervals)
    young = young_daly_interval(cfg, trace)
    if young is not None and all(abs(young - i) > 1 for i in ivals):
        ivals.append(young)
    for p in depths:
        if p > cfg.model.num_layers or p > peak:
            continue
        for d in range(1, peak // p + 1):
            if not splits_evenly(cfg.model.global_microbatches, d):
                continue
            out.append(Candidate("on_demand", p, d))
            for red in ("none", "lazy", "eager"):
                if p == 1 and red != "none":
                    continue
                out.append(Candidate("spot", p, d, red, True))
                out += [Candidate("spot", p, d, red, False, i) for i in ivals]
    return out


def young_daly_interval(cfg: SimConfig, trace: Trace) -> float | None:
    """sqrt(2 C M) (Young 1974; Daly 2006): C the checkpoint's cost, M the mean time between
    preemptions of the trace; None when checkpoints are free or nothing is preempted."""
    cost = cfg.params.checkpoint_cost_s
    if cost <= 0 or trace.removals == 0 or trace.duration_s <= 0:
        return None
    return math.sqrt(2.0 * cost * trace.duration_s / trace.removals)


def evaluate(cfg: SimConfig, trace: Trace, c: Candidate,
             duration_s: float | None = None) -> Ranked:
    one = replace(cfg, num_stages=c.stages, num_pipelines=c.pipelines,
                  redundancy=c.redundancy, shadows=c.shadows,
                  params=replace(cfg.params, checkpoint_interval_s=c.checkpoint_interval_s
                                 if math.isfinite(c.checkpoint_interval_s)
                                 else cfg.params.checkpoint_interval_s))
    policy = "on_demand" if c.market == "on_demand" else "spotpipe"
    try:
        fit.check_policies(one, [policy])
    except ValueError as exc:
        return Ranked(c, refused=str(exc))
    r: Result = run(trace, policy, one, duration_s=duration_s, record=False)
    return Ranked(c, r.samples, r.dollars, r.throughput, r.fatal_failures)


def advise(cfg: SimConfig, trace: Trace, *, duration_s: float | None = None,
           space: Sequence[Candidate] | None = None) -> list[Ranked]:
    """Every candidate, ranked: the best first; refused ones last, in search order."""
    ranked = [evaluate(cfg, trace, c, duration_s) for c in (space or candidates(cfg, trace))]
    ok = sorted((r for r in ranked if r.refused is None), key=lambda r: -r.value)
    return ok + [r for r in ranked if r.refused is not None]


def no_advice(ranked: list[Ranked], trace: Trace, cfg: SimConfig,
              duration_s: float) -> str | None:
    """Why no configuration can be advised, or None. Advice must train something: were every
    configuration worth 0 samples/$, the first in search order would be named the best."""
    if not ranked:
        return (f"no configuration to try: the trace offers at most {trace.peak_nodes} nodes "
                f"at once and the model has {cfg.model.num_layers} layers, and the smallest "
                f"depth tried is {min(DEPTHS)}")
    ok = [r for r in ranked if r.refused is None]
    if not ok:
        return f"no configuration fits memory: {ranked[0].refused}"
    if ok[0].value <= 0:
        return (f"no configuration trains a sample in the {duration_s:g} s simulated (a "
                f"spot or on-demand node boots for {cfg.params.boot_s:g} s first)")
    return None


def advice_table(ranked: list[Ranked], top: int = 15) -> str:
    from spotpipe.sim.report import format_table

    rows = [r for r in ranked if r.refused is None][:top]
    head = ["rank", "configuration", "samples/$", "samples/s", "$", "fatal"]
    body = [[str(i + 1), r.candidate.label(), f"{r.value:.0f}", f"{r.throughput:.2f}",
             f"{r.dollars:.2f}", str(r.fatal_failures)] for i, r in enumerate(rows)]
    refused = sum(1 for r in ranked if r.refused is not None)
    text = format_table(head, body)
    if refused:
        text += f"\n{refused} configurations refused: they do not fit memory (see --json)"
    return text
