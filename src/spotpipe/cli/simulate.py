"""`spotpipe simulate`: predict throughput, cost and value of a job under a trace.

All input is read and checked before anything is computed or written, so a bad argument
exits with code 2 and a message naming it, leaving no half-written plot or output behind.
With --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from spotpipe.cli.argtypes import finite_number, positive_number
from spotpipe.sim.models import model_from_arg
from spotpipe.sim.fit import check_policies
from spotpipe.sim.params import SimConfig, SimParams, calibrate, calibrate_shapes
from spotpipe.sim.policies import ALL_POLICIES
from spotpipe.sim.prices import price_of
from spotpipe.sim.sweep import DEFAULT_RATES, SweepSpec
from spotpipe.sim.synthetic import (ADD_PROBABILITIES, REMOVAL_PROBABILITIES,
                                    SYNTHETIC_MODELS, SyntheticModel, fixed_interval_trace,
                                    poisson_trace)
from spotpipe.sim.traces import Trace, TraceError, load_trace

SYNTHETIC = ("bamboo", "simple", "poisson", "fixed")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate a pipeline-parallel job on spot nodes",
                              description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="preemption trace (event CSV, tick JSON, "
                     "or dated count series)")
    src.add_argument("--synthetic", choices=SYNTHETIC, help="generate a trace instead "
                     "(default for --table and without --trace: bamboo, Bamboo's simulator's "
                     "model; simple: the cluster starts full, each missing node granted "
                     "with probability 0.5 an hour)")
    p.add_argument("--rate", type=finite_number, default=0.1,
                   help="hourly preemption probability (bamboo, simple), rate per hour "
                        "(poisson)")
    p.add_argument("--add-probabilities", choices=ADD_PROBABILITIES, default=None,
                   help="bamboo: each hour of the day's grant probability, drawn uniformly "
                        "per seed as Bamboo's 10,000-seed table does (drawn, the default), or "
                        "Bamboo's fixed table (hourly: 0.05, 0.5 at 3-5 h, 0 at 15-22 h)")
    p.add_argument("--start-hour", type=int, default=None, help="bamboo: the hour of the "
                   "day the trace starts at, 0-23 (default 0, as Bamboo's table)")
    p.add_argument("--removal-probabilities", choices=REMOVAL_PROBABILITIES, default=None,
                   help="bamboo: each hour's removal probability, --rate (flat, the default, "
                        "as Bamboo's table) or Bamboo's hour-of-day table (hourly: 0.05, 0.01 "
                        "at 3-5 h, 0.25 at 15-22 h; --rate is not used)")
    p.add_argument("--interval", type=positive_number, default=1800.0, help="seconds between "
                   "preemptions (--synthetic fixed)")
    p.add_argument("--hours", type=positive_number, default=None, help="simulated hours (default: the "
                   "trace's span; 10 for a synthetic trace; 3 per run for --table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=0, help="synthetic cluster size (default P x D)")
    p.add_argument("--policy", default="all", choices=ALL_POLICIES + ("all",))
    p.add_argument("--model", default="gpt2-1.5b", help="preset (gpt2-1.5b, bert-large) or a "
                   "profile .json")
    p.add_argument("--stages", type=int, default=8, help="pipeline depth P")
    p.add_argument("--pipelines", type=int, default=4, help="data-parallel width D")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    p.add_argument("--redundancy", default="lazy", choices=("none", "lazy", "eager"),
                   help="spotpipe's redundancy (default lazy, what the runtime recommends: "
                        "replicas kept exact by gradient replication, no FRC); bamboo always "
                        "runs eager FRC as published")
    p.add_argument("--notice", type=finite_number, default=0.0, metavar="S",
                   help="seconds of notice before each preemption (AWS 120, GCP 30; default "
                        "0: every preemption a kill); spotpipe acts on it --notice-lead "
                        "before the end and reshapes at an iteration boundary, the other "
                        "policies do not use it")
    p.add_argument("--notice-lead", type=finite_number, default=30.0, metavar="S",
                   help="how long before a notice's end spotpipe acts on it (the runtime's "
                        "failover.notice_lead_s, default 30)")
    p.add_argument("--shadows", action="store_true", help="spotpipe keeps CPU shadows of "
                   "every stage (a fatal failure loses one iteration; their on-demand host "
                   "is billed); without, it rolls back to the last durable checkpoint")
    p.add_argument("--value-formula", default="samples_per_dollar",
                   choices=("samples_per_dollar", "bamboo"),
                   help="value: samples per dollar billed (default), or Bamboo's simulator's "
                        "time average of samples/s per $/h while the job runs")
    p.add_argument("--victims", default="random", choices=("random", "oldest", "newest"),
                   help="which nodes leave when a count series (tick JSON, dated series) "
                        "drops: seeded by --seed (default random)")
    p.add_argument("--instance", default="p3.2xlarge")
    p.add_argument("--prices", metavar="FILE", help="prices JSON (default: packaged)")
    p.add_argument("--calibrate", metavar="FILE", nargs="+",
                   help="JSON output of spotpipe bench failover / reconfigure / checkpoint "
                        "(or a hand-written one with *_pause_s figures); later files win")
    p.add_argument("--table", action="store_true", help="rates x seeds table of synthetic runs")
    p.add_argument("--setup", default="ours", choices=("ours", "bamboo"),
                   help="--table's setup: ours (the configured model at P x D nodes, "
                        "--hours per run, every policy) or bamboo (Bamboo's own table: its "
                        "simulator's BERT job, 12 stages, capacity 48, run to its last step, "
                        "the bamboo policy, its columns)")
    p.add_argument("--advise", action="store_true", help="rank configurations (spot or "
                   "on-demand, P x D, redundancy, shadows, checkpoint interval) by samples "
                   "per dollar on this trace and name the best")
    p.add_argument("--checkpoint-cost", type=float, default=None, metavar="S",
                   help="seconds a durable checkpoint stalls training (default: the "
                        "calibration's, else 0)")
    p.add_argument("--seeds", type=int, default=10000, help="seeds per rate for --table")
    p.add_argument("--rates", default=",".join(str(r) for r in DEFAULT_RATES))
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)
    return p


class UsageError(ValueError):
    """A bad argument: reported in one line, exit code 2."""


def run(args: argparse.Namespace) -> int:
    try:
        cfg, job = _prepare(args)
    except (UsageError, TraceError, ValueError) as exc:
        print(f"spotpipe simulate: error: {exc}", file=sys.stderr)
        return 2
    from spotpipe.sim import report

    if args.advise:
        return _advise(cfg, job, args.json)
    if args.table and args.setup == "bamboo":
        from spotpipe.sim.bamboo_table import run_table, table_text

        table = run_table(*job)
        print(table_text(table))
        if args.json:
            print(report.to_json(table))
        return 0
    if args.table:
        from spotpipe.sim.sweep import run_sweep

        sweep = run_sweep(job)
        print(report.sweep_table(sweep))
        if args.plot:
            from spotpipe.sim.plots import plot_sweep

            print(f"wrote {plot_sweep(sweep, args.plot)}")
        if args.json:
            print(report.to_json(sweep))
        return 0
    from spotpipe.sim.simulator import run as simulate_run

    trace, hours, policies = job
    duration = _duration(trace, hours)
    results = [simulate_run(trace, name, cfg, duration_s=duration) for name in policies]
    victims = f", victims {trace.victims}" if trace.victims else ""
    print(f"{trace!r}: peak {trace.peak_nodes} nodes, {trace.removals} removals{victims}; "
          f"model {cfg.model.name}, P={cfg.num_stages} x D={cfg.num_pipelines}, "
          f"{cfg.price.instance}, spotpipe redundancy {cfg.redundancy}"
          f"{' with shadows' if cfg.shadows else ''}"
          + (f"; {cfg.notice_s:g} s notices, spotpipe acting {cfg.acted_notice_s:g} s ahead"
             if cfg.notice_s else ""))
    print(report.run_table(results))
    if args.plot:
        from spotpipe.sim.plots import plot_run

        print(f"wrote {plot_run(results, args.plot, trace.name)}")
    if args.json:
        print(report.to_json({"trace": trace.name, "duration_s": duration,
                              "victims": trace.victims, "redundancy": cfg.redundancy,
                              "shadows": cfg.shadows, "notice_s": cfg.notice_s,
                              "notice_lead_s": cfg.notice_lead_s,
                              "results": [report.result_dict(r) for r in results]}))
    return 0


def _advise(cfg: SimConfig, job: Any, as_json: bool) -> int:
    from spotpipe.sim import report
    from spotpipe.sim.advise import advice_table, advise, no_advice

    trace, hours, _ = job
    duration = _duration(trace, hours)
    ranked = advise(cfg, trace, duration_s=duration)
    why = no_advice(ranked, trace, cfg, duration)
    if why is not None:
        print(f"spotpipe simulate: error: {trace.name}: {why}", file=sys.stderr)
        return 2
    best = ranked[0]
    print(f"{trace!r}: model {cfg.model.name}, {cfg.price.instance} (spot "
          f"${cfg.price.spot}/h, on demand ${cfg.price.on_demand}/h)")
    print(advice_table(ranked))
    print(f"advice: {best.candidate.label()}: {best.value:.0f} samples/$")
    if as_json:
        print(report.to_json({"trace": trace.name, "duration_s": duration,
                              "victims": trace.victims, "advice": best.row(),
                              "table": [r.row() for r in ranked]}))
    return 0


def _duration(trace: Trace, hours: float | None) -> float:
    """The seconds simulated: --hours, else the trace's span. Past the trace's end the nodes
    it holds then are held, never preempted, to the end: the trace does not say so, and the
    figures (and the advice) may change with it, so it is said."""
    if hours is None:
        return trace.duration_s
    if hours * 3600.0 > trace.duration_s:
        print(f"spotpipe simulate: note: --hours {hours:g} runs past the end of {trace.name} "
              f"({trace.duration_s / 3600.0:.2f} h): the nodes it holds then are taken to be "
              f"held, never preempted, to the end", file=sys.stderr)
    return hours * 3600.0


def _prepare(args: argparse.Namespace) -> tuple[SimConfig, Any]:
    """Check every input; return the config and either a sweep spec or (trace, hours, policies)."""
    if args.setup == "bamboo":
        return _bamboo_setup(args)
    if args.stages < 1 or args.pipelines < 1:
        raise UsageError(f"--stages and --pipelines must be >= 1, got {args.stages}, "
                         f"{args.pipelines}")
    if args.hours is not None and not args.hours > 0:
        raise UsageError(f"--hours must be positive, got {args.hours}")
    if args.nodes < 0:
        raise UsageError(f"--nodes must be >= 0, got {args.nodes}")
    for flag, value in (("--notice", args.notice), ("--notice-lead", args.notice_lead)):
        if value < 0:
            raise UsageError(f"{flag} must be >= 0 seconds, got {value:g}")
    params = calibrate(args.calibrate) if args.calibrate else SimParams()
    if args.checkpoint_cost is not None:
        if not (args.checkpoint_cost >= 0 and args.checkpoint_cost < float("inf")):
            raise UsageError(f"--checkpoint-cost must be >= 0 seconds, got "
                             f"{args.checkpoint_cost}")
        params = replace(params, checkpoint_cost_s=args.checkpoint_cost)
    shapes = calibrate_shapes(args.calibrate) if args.calibrate else ()
    cfg = SimConfig(model_from_arg(args.model), price_of(args.instance, args.prices),
                    args.stages, args.pipelines, args.schedule, params,
                    redundancy=args.redundancy, shadows=args.shadows, shape_times=shapes,
                    value_formula=args.value_formula, notice_s=args.notice,
                    notice_lead_s=args.notice_lead)
    if args.plot:
        _check_dir(args.plot)
    if args.advise and args.table:
        raise UsageError("--advise ranks configurations on one trace; it cannot take --table")
    if args.advise:
        return cfg, (_trace(args, cfg), args.hours, [])
    if args.table:
        if args.trace:
            raise UsageError("--table runs synthetic traces; it cannot take --trace")
        if args.seeds < 1 or args.processes < 1:
            raise UsageError("--seeds and --processes must be >= 1")
        rates = _rates(args.rates)
        hours, nodes = args.hours or 3.0, args.nodes or cfg.nodes
        synthetic = _synthetic_model(args)
        try:
            synthetic.check(max(rates), hours, nodes)
        except ValueError as exc:
            raise UsageError(f"--table --synthetic {synthetic.model} --hours {hours:g} "
                             f"--nodes {nodes}: {exc}") from None
        policies = ALL_POLICIES if args.policy == "all" else ("on_demand", args.policy) \
            if args.policy != "on_demand" else ("on_demand",)
        policies = tuple(dict.fromkeys(policies))
        check_policies(cfg, policies)
        return cfg, SweepSpec(cfg, rates, args.seeds, hours, args.nodes, synthetic,
                              policies=policies, processes=args.processes)
    trace = _trace(args, cfg)
    policies = list(ALL_POLICIES) if args.policy == "all" else [args.policy]
    check_policies(cfg, policies)
    return cfg, (trace, args.hours, policies)


# what --setup bamboo fixes as Bamboo's table has it: refused rather than silently ignored
_BAMBOO_FIXED = (("--trace", "trace", None), ("--synthetic", "synthetic", None),
                 ("--hours", "hours", None), ("--nodes", "nodes", 0),
                 ("--add-probabilities", "add_probabilities", None),
                 ("--start-hour", "start_hour", None), ("--advise", "advise", False),
                 ("--removal-probabilities", "removal_probabilities", None),
                 ("--plot", "plot", None), ("--calibrate", "calibrate", None))


def _bamboo_setup(args: argparse.Namespace) -> tuple[SimConfig, Any]:
    """--table --setup bamboo: its model, capacity and traces are its own; only the rates,
    seeds and processes are taken."""
    from spotpipe.sim.bamboo_table import setup_config

    if not args.table:
        raise UsageError("--setup bamboo sets up Bamboo's table; it needs --table")
    given = [flag for flag, name, unset in _BAMBOO_FIXED if getattr(args, name) != unset]
    if args.policy not in ("all", "bamboo"):
        given.append(f"--policy {args.policy}")
    if given:
        raise UsageError(f"--setup bamboo runs Bamboo's table as its code has it (its model, "
                         f"capacity 48, its traces, to the job's end, the bamboo policy); it "
                         f"does not take {', '.join(given)}")
    if args.seeds < 1 or args.processes < 1:
        raise UsageError("--seeds and --processes must be >= 1")
    return setup_config(), (_rates(args.rates), args.seeds, args.processes)


def _synthetic_model(args: argparse.Namespace) -> SyntheticModel:
    """The generator --table or a synthetic run draws from; Bamboo's settings are refused
    where no Bamboo trace is generated, rather than silently ignored."""
    kind = args.synthetic or "bamboo"
    bamboo_flags = [f for f, v in (("--add-probabilities", args.add_probabilities),
                                   ("--start-hour", args.start_hour),
                                   ("--removal-probabilities", args.removal_probabilities))
                    if v is not None]
    if bamboo_flags and (args.trace or kind != "bamboo"):
        source = f"--trace {args.trace}" if args.trace else f"--synthetic {kind}"
        one = len(bamboo_flags) == 1
        raise UsageError(f"{' and '.join(bamboo_flags)} {'sets' if one else 'set'} Bamboo's "
                         f"synthetic model; {source} does not take "
                         f"{'it' if one else 'them'}")
    if args.table and kind not in SYNTHETIC_MODELS:
        raise UsageError(f"--table draws {' or '.join(SYNTHETIC_MODELS)} traces, not "
                         f"--synthetic {kind}")
    if args.table and args.removal_probabilities == "hourly":
        raise UsageError("--table's rows are removal rates; --removal-probabilities hourly "
                         "removes by Bamboo's hour-of-day table instead: run it without "
                         "--table")
    if args.start_hour is not None and not 0 <= args.start_hour <= 23:
        raise UsageError(f"--start-hour must be an hour of the day, 0 to 23, got "
                         f"{args.start_hour}")
    return SyntheticModel(kind if kind in SYNTHETIC_MODELS else "bamboo",
                          args.add_probabilities or "drawn", args.start_hour or 0,
                          removal_probabilities=args.removal_probabilities or "flat")


def _trace(args: argparse.Namespace, cfg: SimConfig) -> Trace:
    synthetic = _synthetic_model(args)
    if args.trace:
        return load_trace(args.trace, victims=args.victims, seed=args.seed)
    kind = args.synthetic or "bamboo"
    hours = args.hours or 10.0
    nodes = args.nodes or cfg.nodes
    flags = f"--synthetic {kind} --hours {hours:g} --nodes {nodes}"
    try:
        if kind in SYNTHETIC_MODELS:
            return synthetic.trace(args.rate, hours, nodes, args.seed)
        if kind == "poisson":
            return poisson_trace(args.rate, hours, nodes, args.seed)
        return fixed_interval_trace(args.interval, hours, nodes)
    except ValueError as exc:  # the generator's own check, named by the flags that set it
        extra = f" --interval {args.interval:g}" if kind == "fixed" else f" --rate {args.rate:g}"
        raise UsageError(f"{flags}{extra}: {exc}") from None


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not 0 <= r <= 1 for r in rates):
        raise UsageError(f"--rates must be probabilities in [0, 1], got {text!r}")
    return rates


def _check_dir(path: str) -> None:
    """--plot DIR can be a folder: it is one, or the nearest part of it that exists is a
    folder this user may create in (checked before simulating, which may take minutes)."""
    import os
    from pathlib import Path

    from spotpipe.runfiles import blocking_file

    folder = Path(path).absolute()
    blocker = blocking_file(folder)
    if blocker == folder:
        raise UsageError(f"--plot {path}: exists and is not a directory")
    if blocker is not None:
        raise UsageError(f"--plot {path}: {blocker} is a file, not a directory")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--plot {path}: cannot create files in {existing} (permission "
                         f"denied)")
