"""`spotpipe` command line: train, simulate, bench, plot.

Exit codes: 0 success, 1 the job failed while running, 2 bad input (nothing was started or
written).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from spotpipe.config import ConfigError, load_config


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
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from spotpipe.cluster.launcher import LaunchError, train

    overrides = list(args.overrides)
    if args.stages is not None:
        overrides.append(f"stages={args.stages}")
    if args.pipelines is not None:
        overrides.append(f"pipelines={args.pipelines}")
    try:
        cfg = load_config(args.config, overrides)
        code = train(cfg, Path(args.out), overwrite=args.overwrite,
                     progress=not args.no_progress)
    except (ConfigError, LaunchError) as exc:
        print(f"spotpipe: error: {exc}", file=sys.stderr)
        return 2
    if code == 0:
        print(f"spotpipe: done; results in {args.out} (metrics.jsonl, events.jsonl, summary.json, "
              "final/model.safetensors)")
    return code


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a named benchmark; --json prints one JSON object last")
    p.add_argument("name", help="benchmark name (pipeline, simulator, ...)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from spotpipe.bench import run_bench

    return run_bench(args.name, as_json=args.json, quick=args.quick)


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is None:
        return args.run_command(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
