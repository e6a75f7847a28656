"""Bamboo's own table setup (`spotpipe simulate --table --setup bamboo`): its simulator's
10,000-seed table as uclasystem/bamboo computes it (project_pactum/simulation/api.py,
`generate_table`), run with the `bamboo` policy.

Why a setup of its own: this project's table runs 3 h at P x D nodes of a GPT-2 preset, so
its figures cannot be set beside Bamboo's. Bamboo's table runs its simulator's default model
(BERT: 264 samples a step, 22,194 steps, 12 stages, a step table per number of pipelines) on
a cluster of capacity 48 until the job's last step, at start hour 0 with the add
probabilities drawn per seed, and reports per rate the mean over seeds of: preemptions,
hours between removals ("interruptions"), node lifetimes, fatal failures, instances,
performance (samples/s from the first rendezvous to the last
step), cost ($/h from 0 to the last step) and value (the time average of samples/s per $/h
while running). The constants below are read from its `Simulator.__init__`;
tests/test_bamboo_table.py checks them against the ones its code reported
(tests/fixtures/bamboo_table_reference.json) and our figures against its per-seed ones.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

from spotpipe.sim.bamboo_reference import reference_config
from spotpipe.sim.params import SimConfig
from spotpipe.sim.simulator import HOUR, Result, run
from spotpipe.sim.synthetic import SyntheticModel
from spotpipe.sim.traces import ADD, Trace

# Simulator(model='BERT'), its default, as generate_table runs it
SETUP: dict = {
    "model": "BERT", "samples_per_step": 264, "steps_per_run": 22_194, "num_stages": 12,
    "capacity": 48,
    # bert_simulate_step_delta at 12 stages, seconds per step by number of pipelines
    "step_s_by_pipelines": {"1": 4.31, "2": 2.39, "3": 1.805, "4": 1.45},
    "spot_price": 0.91, "on_demand_price": 3.06,  # $/h per instance
    "creation_s": 45.0, "global_rendezvous_s": 30.0, "local_rendezvous_s": 20.0,
    "fallback_slowdown": 1.5,
    # its on-demand comparison: 4 x 5 instances at 264 samples per 2.51 s
    "on_demand": {"instances": 20, "performance": 264 / 2.51, "cost": 20 * 3.06,
                  "value": 264 / 2.51 / (20 * 3.06)},
}
# its table's synthetic traces: generate_addition_probabilities=True, start_hour=0
SYNTHETIC = SyntheticModel("bamboo", "drawn", 0, boot_order=True)
FIRST_HOURS = 48.0  # trace length tried first; doubled until the job ends within it
MAX_HOURS = 3072.0


def setup_config() -> SimConfig:
    """The simulator configuration of Bamboo's table: its model's step table and batch,
    its prices, boot and rendezvous times, and its value formula."""
    return reference_config({"config": SETUP}, name="bamboo-bert")


def run_to_end(rate: float, seed: int, cfg: SimConfig | None = None,
               synthetic: SyntheticModel = SYNTHETIC) -> tuple[Result, Trace]:
    """One seed of its table: the `bamboo` policy on its synthetic trace until the job's
    last step. The trace is generated hour by hour, so a longer one starts with the same
    events: it is lengthened until the job ends within it (up to MAX_HOURS: a job that has
    not ended then is cut there)."""
    cfg = cfg or setup_config()
    hours = FIRST_HOURS
    while True:
        trace = synthetic.trace(rate, hours, SETUP["capacity"], seed)
        r = run(trace, "bamboo", cfg, duration_s=hours * HOUR, record=False,
                iterations=SETUP["steps_per_run"])
        if r.duration_s < hours * HOUR or hours >= MAX_HOURS:
            return r, trace
        hours *= 2


# the columns of its table (api.generate_table), in its order, by `Result` field
COLUMNS = (("num_preemptions", "Preemptions"), ("preemption_mean", "Interruptions"),
           ("lifetime_mean", "Lifetimes"), ("num_fatal_failures", "Fatal Failures"),
           ("average_instances", "Instances"), ("average_performance", "Performance"),
           ("average_cost", "Cost"), ("average_value", "Value"))


def figures(r: Result, trace: Trace) -> dict[str, float]:
    """A run's figures under the names of Bamboo's `Result`, by its formulas."""
    interruptions, lifetimes = _lifetimes(trace, r.duration_s)
    end = r.run_window[1]
    cost = r.window_cost_per_hour + (_backdated(trace) / (end / HOUR) if end > 0 else 0.0)
    return {"num_preemptions": r.preemptions, "preemption_mean": interruptions,
            "lifetime_mean": lifetimes, "num_fatal_failures": r.fatal_failures,
            "average_instances": cost / SETUP["spot_price"],
            "average_performance": r.window_throughput,
            "average_cost": cost,
            "average_value": r.time_average_value,
            "end_hours": r.duration_s / HOUR, "start_hours": r.run_window[0] / HOUR}


def _backdated(trace: Trace) -> float:
    """Dollars its cost curve counts that were not billed: it starts at 0 with the number
    of instances held after its first event past 0 (the first grant or removal, or the
    boots of the nodes granted at 0, 45 s on), so a change at that event counts from 0."""
    boot = SETUP["creation_s"]
    first = boot if any(e.time_s == 0.0 for e in trace.events) else float("inf")
    changed = 0
    for ev in trace.events:
        if ev.time_s > first:
            break
        if ev.time_s > 0.0:
            first = ev.time_s
            changed += 1 if ev.kind == ADD else -1
    return changed * first * SETUP["spot_price"] / HOUR if changed else 0.0


def _lifetimes(trace: Trace, end: float) -> tuple[float, float]:
    """Its mean hours between removals, and its mean lifetime of a node granted (to its
    removal, or to the end for one still held), over the events up to `end`."""
    start: dict[str, float] = {}
    removals: list[float] = []
    lives: list[float] = []
    for ev in trace.events:
        if ev.time_s > end:
            break
        if ev.kind == ADD:
            start[ev.node] = ev.time_s
        elif ev.node in start:
            lives.append(ev.time_s - start.pop(ev.node))
            removals.append(ev.time_s)
    lives += [end - t for t in start.values()]
    gaps = [b - a for a, b in zip(removals, removals[1:])]
    return (statistics.mean(gaps) / HOUR if gaps else 0.0,
            statistics.mean(lives) / HOUR if lives else 0.0)


def _seeds(args: tuple[float, int, int]) -> list[dict[str, float]]:
    rate, lo, hi = args
    cfg = setup_config()
    return [figures(*run_to_end(rate, seed, cfg)) for seed in range(lo, hi)]


def run_table(rates: tuple[float, ...], seeds: int, processes: int = 2) -> dict:
    """Its table: per rate the mean over seeds 1..`seeds` of each of its columns (it runs
    10,000), split over `processes`."""
    begin = time.perf_counter()
    per = max(1, -(-seeds // (max(1, processes) * 4)))
    tasks = [(rate, lo, min(seeds + 1, lo + per)) for rate in rates
             for lo in range(1, seeds + 1, per)]
    if processes > 1:
        with mp.get_context("fork").Pool(processes) as pool:
            parts = pool.map(_seeds, tasks, chunksize=1)
    else:
        parts = [_seeds(t) for t in tasks]
    rows = []
    for rate in rates:
        runs = [f for t, part in zip(tasks, parts) if t[0] == rate for f in part]
        rows.append({"rate": rate, "runs": len(runs),
                     **{k: statistics.mean(f[k] for f in runs) for k, _ in COLUMNS},
                     "hours": statistics.mean(f["end_hours"] for f in runs)})
    return {"setup": "bamboo", "rows": rows, "seeds": seeds, "rates": list(rates),
            "on_demand": SETUP["on_demand"], "seconds": time.perf_counter() - begin}


def table_text(table: dict) -> str:
    """Its table's columns, one row per rate, and its on-demand comparison."""
    from spotpipe.sim.report import format_table

    head = ["rate", "runs"] + [name for _, name in COLUMNS] + ["hours"]
    rows = [[f"{r['rate']:.2f}", str(r["runs"])] + [f"{r[k]:.2f}" for k, _ in COLUMNS]
            + [f"{r['hours']:.2f}"] for r in table["rows"]]
    ond = table["on_demand"]
    return (format_table(head, rows)
            + f"\non demand ({ond['instances']} instances): performance "
              f"{ond['performance']:.2f}, cost {ond['cost']:.2f}, value {ond['value']:.2f}"
            + f"\nBamboo's table setup ({SETUP['model']}, {SETUP['num_stages']} stages, "
              f"capacity {SETUP['capacity']}, {SETUP['steps_per_run']} steps to the end), "
              f"bamboo policy, {table['seeds']} seeds x {len(table['rates'])} rates: "
              f"{table['seconds']:.1f} s")


def reproduction_errors(ref: dict) -> dict[str, dict[str, float]]:
    """Per rate, the relative error of the mean of each of its figures over the reference's
    seeds (tests/fixtures/bamboo_table_reference.json), and the largest per seed."""
    out: dict[str, dict[str, float]] = {}
    cfg = setup_config()
    for rate, runs in ref["runs"].items():
        ours = [figures(*run_to_end(float(rate), x["seed"], cfg)) for x in runs]
        errs: dict[str, float] = {}
        for key, _ in COLUMNS:
            want = statistics.mean(x[key] for x in runs)
            got = statistics.mean(o[key] for o in ours)
            errs[key] = (got - want) / want if want else got - want
            errs[key + "_worst_seed"] = max(
                abs(o[key] - x[key]) / x[key] if x[key] else abs(o[key] - x[key])
                for o, x in zip(ours, runs))
        out[rate] = errs
    return out
