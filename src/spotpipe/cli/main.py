"""`spotpipe` command line: train, agent, simulate, bench, plot.

Exit codes: 0 success, 1 the job failed while running, 2 bad input (nothing was started or
written), 130 interrupted by Ctrl-C, 143 by SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from spotpipe.cli.argtypes import add_fault_flags, positive_number
from spotpipe.cluster.supervisor import interruption, resolver_options
from spotpipe.config import ConfigError, load_config
from spotpipe.faults import FaultSpecError


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on a local cluster of worker processes")
    p.add_argument("config", help="YAML configuration file")
    p.add_argument("--stages", type=int, help="pipeline depth P (overrides stages)")
    p.add_argument("--pipelines", type=int, help="data-parallel pipelines D (overrides pipelines)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a configuration key, e.g. --set optimizer.lr=3e-4")
    p.add_argument("--out", default="runs/latest", help="output folder (default runs/latest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", metavar="PATH",
                   help="resume from a durable checkpoint: a checkpoint folder, a checkpoints "
                        "folder or a run folder (its newest valid checkpoint); any P x D")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="resume from a checkpoint whose manifest has no valid MAC under this "
                        "job's key (recorded as an event)")
    faults = p.add_argument_group("fault injection (the same paths as real failures)")
    add_fault_flags(faults)
    faults.add_argument("--nan", action="append", default=[], metavar="NODE@ITER",
                        help="put a NaN into one of NODE's gradients at iteration ITER, before "
                             "the reduction (see training.nonfinite)")
    faults.add_argument("--io-error", dest="ioerror", action="append", default=[],
                        metavar="NODE@ITER",
                        help="make NODE's checkpoint write at iteration ITER fail as a full "
                             "disk does")
    faults.add_argument("--join", action="append", type=int, default=[], metavar="ITER",
                        help="start one more node when iteration ITER completes; it joins the "
                             "running job (rebalance, or a new pipeline)")
    faults.add_argument("--trace", metavar="FILE",
                        help="replay a preemption trace (event CSV, tick JSON, dated counts)")
    faults.add_argument("--time-scale", type=positive_number, default=60.0,
                        help="trace seconds per real second (default 60)")
    faults.add_argument("--trace-action", choices=["kill", "notice"], default="kill",
                        help="what a trace removal does to its worker (default kill)")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.stages is not None:
        overrides.append(f"stages={args.stages}")
    if args.pipelines is not None:
        overrides.append(f"pipelines={args.pipelines}")
    try:
        cfg = load_config(args.config, overrides)
        faults, actions = _faults(args, cfg)
    except (ConfigError, FaultSpecError) as exc:
        print(f"spotpipe: error: {exc}", file=sys.stderr)
        return 2
    from spotpipe.cluster.supervisor import prestart, stop_on_sigterm

    stop_on_sigterm()  # (a scheduler's stop: the job stops as on a Ctrl-C, and says so)
    prestart(cfg)  # the workers' fork server imports torch while this process does
    from spotpipe.cluster.launcher import LaunchError, train

    try:
        code = train(cfg, Path(args.out), overwrite=args.overwrite,
                     progress=not args.no_progress, faults=faults, trace_actions=actions,
                     resume=Path(args.resume) if args.resume else None, joins=args.join,
                     trust_checkpoint=args.trust_checkpoint, config_path=Path(args.config))
    except (ConfigError, LaunchError, FaultSpecError) as exc:
        print(f"spotpipe: error: {exc}", file=sys.stderr)
        return 2
    _tell_story(Path(args.out))
    if code == 0:
        print(f"spotpipe: results in {args.out} (metrics.jsonl, events.jsonl, summary.json, "
              f"final/model.safetensors); draw them with: spotpipe plot {args.out}")
    return code


def _tell_story(out: Path) -> None:
    import json

    from spotpipe.cluster.story import describe

    try:
        events = [json.loads(line) for line in open(out / "events.jsonl")]
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return
    print("\n".join(describe(events, summary)))


def _faults(args: argparse.Namespace, cfg):
    """Fault specs and trace actions, checked against the job's nodes before anything runs."""
    from spotpipe.cluster.trace_replay import replay_actions
    from spotpipe.faults import KINDS, Fault, FaultSpecError

    # nodes joining with --join are named after the initial ones, in order
    nodes = [f"node{r}" for r in range(cfg.stages * cfg.pipelines + len(args.join or []))]
    faults = [Fault.parse(kind, text, nodes)
              for kind in KINDS for text in getattr(args, kind)]
    for f in faults:
        if f.iteration >= cfg.iterations:
            raise FaultSpecError(f"--{f.kind} {f.node}@{f.iteration}: the job runs iterations "
                                 f"0..{cfg.iterations - 1}")
    last = cfg.iterations - 1
    for at in args.join or []:
        if not 0 <= at < last:  # (it trains the iterations after `at`)
            expected = f"ITER must be 0..{last - 1}" if last else "no node can join"
            raise FaultSpecError(f"--join {at}: a node joins when iteration ITER completes and "
                                 f"trains the ones after it; the job runs iterations 0..{last},"
                                 f" so {expected}")
    actions = None
    if args.trace:
        from spotpipe.sim.traces import TraceError, load_trace

        try:
            actions = replay_actions(load_trace(args.trace), nodes, args.time_scale,
                                     on_remove=args.trace_action)
        except (TraceError, ValueError, OSError) as exc:
            raise FaultSpecError(f"--trace {args.trace}: {exc}") from None
    return faults, actions


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a named benchmark; --json prints one JSON object last")
    p.add_argument("name", help="benchmark name (pipeline, simulator, ...)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    p.add_argument("--faults", type=int, metavar="N",
                   help="bench chaos: how many faults (one a run); bench soak: how many runs "
                        "(three faults each)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="bench chaos, soak: the seed their faults are drawn from (default: the "
                        "bench's own, so that runs compare)")
    p.add_argument("--repeat", type=int, metavar="N", default=1,
                   help="run the bench N times; each figure is the median over the runs")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from spotpipe.bench import run_bench

    return run_bench(args.name, as_json=args.json, quick=args.quick, faults=args.faults,
                     repeat=args.repeat, seed=args.seed)


def _optional(sub: argparse._SubParsersAction, module: str) -> None:
    """Subcommands that live in their own modules register themselves."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    mod.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_bench(sub)
    _optional(sub, "spotpipe.cli.simulate")
    _optional(sub, "spotpipe.cli.plot")
    _optional(sub, "spotpipe.cli.agent")
    return parser


def main(argv: list[str] | None = None) -> int:
    # (before this process opens any store connection: see `cluster.supervisor.RESOLVER_OPTIONS`)
    os.environ["RES_OPTIONS"] = resolver_options(os.environ)
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "func", None) is None:
            return args.run_command(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:  # (a running job's loop stops it itself, and says so)
        how, code = interruption(exc)
        print(f"spotpipe: interrupted ({how})", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
