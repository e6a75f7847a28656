"""The rates x seeds table: many synthetic traces per preemption rate, every policy on each.

Runs are independent, so they are split over worker processes (2 by default, the CPUs this
project's machines have); within a worker each seed's trace is generated once and shared by
all policies. Per-run
results travel back as plain floats and are summarised with numpy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from spotpipe.sim.params import SimConfig
from spotpipe.sim import itertime
from spotpipe.sim.policies import Planner
from spotpipe.sim.simulator import instants_of, on_demand, run
from spotpipe.sim.synthetic import SyntheticModel

DEFAULT_RATES = (0.01, 0.05, 0.10, 0.25, 0.50)
SPOT_POLICIES = ("spotpipe", "bamboo", "checkpoint_restart")
METRICS = ("throughput", "cost_per_hour", "value", "preemptions", "fatal_failures")


@dataclass(frozen=True)
class SweepSpec:
    cfg: SimConfig
    rates: tuple[float, ...] = DEFAULT_RATES
    seeds: int = 10000
    hours: float = 3.0  # per run; see bench.py for why the table uses 3 h runs
    nodes: int = 0  # trace target size; 0: the configured P x D
    synthetic: SyntheticModel = SyntheticModel()  # Bamboo's model unless told
    policies: tuple[str, ...] = SPOT_POLICIES + ("on_demand",)
    processes: int = 2
    # spotpipe once more per mode here, on the same traces and sharing its decisions (rows
    # "spotpipe_<mode>"): the planner does not look at the redundancy's speed
    extra_redundancy: tuple[str, ...] = ()


def _chunk(args: tuple[SweepSpec, float, int, int]) -> "dict[str, np.ndarray]":
    import numpy as np

    spec, rate, lo, hi = args
    spot = [p for p in spec.policies if p != "on_demand"]
    extra = {f"spotpipe_{m}": replace(spec.cfg, redundancy=m) for m in spec.extra_redundancy}
    out = {p: np.zeros((hi - lo, len(METRICS))) for p in spot + list(extra)}
    nodes = spec.nodes or spec.cfg.nodes
    end = spec.hours * 3600.0
    for i, seed in enumerate(range(lo, hi)):
        trace = spec.synthetic.trace(rate, spec.hours, nodes, seed)
        planner = Planner()
        instants = instants_of(trace, spec.cfg.params.boot_s, end)
        runs = [(name, name, spec.cfg) for name in spot]
        runs += [(label, "spotpipe", cfg) for label, cfg in extra.items()]
        for label, name, cfg in runs:
            r = run(trace, name, cfg, duration_s=end, record=False, planner=planner,
                    instants=instants)
            out[label][i] = (r.throughput, r.cost_per_hour, r.value, r.preemptions,
                             r.fatal_failures)
    return out


def run_sweep(spec: SweepSpec) -> dict:
    """Summary per rate and policy: mean, p10, p50, p90 of each metric, and the wall time."""
    import numpy as np

    start = time.perf_counter()
    cpu0 = _cpu_seconds()
    procs = max(1, spec.processes)
    cfg = spec.cfg
    if cfg.num_stages > 1 and (cfg.redundancy == "eager" or "bamboo" in spec.policies
                               or "eager" in spec.extra_redundancy):
        # every width at the configured depth, once, before forking (other shapes follow
        # takeovers or a re-partition and are timed on demand, through the shared cache)
        itertime.warm(cfg.model, cfg.schedule, cfg.num_stages,
                      range(1, cfg.num_pipelines + 1), procs)
    per = max(1, -(-spec.seeds // (procs * 4)))  # a few chunks per process, for balance
    # highest rates first: their runs have the most events, and a pool that ends on
    # small tasks keeps both processes busy to the end
    tasks = [(spec, rate, lo, min(spec.seeds, lo + per))
             for rate in sorted(spec.rates, reverse=True) for lo in range(0, spec.seeds, per)]
    if procs > 1:
        with mp.get_context("fork").Pool(procs) as pool:
            parts = pool.map(_chunk, tasks, chunksize=1)
    else:
        parts = [_chunk(t) for t in tasks]
    rows: list[dict] = []
    ond = on_demand(spec.cfg, spec.hours * 3600.0, record=False) \
        if "on_demand" in spec.policies else None
    for rate in spec.rates:
        chunks = [p for t, p in zip(tasks, parts) if t[1] == rate]
        for name in list(spec.policies) + [f"spotpipe_{m}" for m in spec.extra_redundancy]:
            if name == "on_demand":
                assert ond is not None
                vals = np.array([[ond.throughput, ond.cost_per_hour, ond.value, 0, 0]])
            else:
                vals = np.concatenate([c[name] for c in chunks])
            row = {"rate": rate, "policy": name, "runs": int(len(vals))}
            for j, metric in enumerate(METRICS):
                col = vals[:, j]
                row[metric] = float(col.mean())
                row[f"{metric}_p10"], row[f"{metric}_p50"], row[f"{metric}_p90"] = (
                    float(x) for x in np.percentile(col, [10, 50, 90]))
            rows.append(row)
    return {"rows": rows, "seconds": time.perf_counter() - start,
            "cpu_seconds": _cpu_seconds() - cpu0, "seeds": spec.seeds,
            "hours": spec.hours, "rates": list(spec.rates),
            "nodes": spec.nodes or spec.cfg.nodes, "synthetic": spec.synthetic.describe()}


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped workers: wall time on a shared, busy machine
    says little about the simulator's own cost."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
