"""`spotpipe bench NAME`: named benchmarks, each a module with `run(quick) -> dict`.

Every benchmark prints a human-readable table while it runs and, with --json, one JSON object
of named figures as the last line of stdout, which is what scripts and issue notes rely on.
Every figure set carries the machine's load average before and after the run
(`load_average_before_after`): on shared cores, timings mean little without it. `--repeat N`
runs the bench N times, one after the other, and reports each numeric figure's median over
the runs (`bench.stats.median_of_runs`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from spotpipe.bench.stats import median_of_runs

BENCHES = {
    "chaos": "spotpipe.bench.chaos",
    "checkpoint": "spotpipe.bench.checkpoint",
    "failover": "spotpipe.bench.failover",
    "gpu": "spotpipe.bench.gpu",
    "model": "spotpipe.bench.model",
    "pipeline": "spotpipe.bench.pipeline",
    "reconfigure": "spotpipe.bench.reconfigure",
    "redundancy": "spotpipe.bench.redundancy",
    "simulator": "spotpipe.bench.simulator",
    "soak": "spotpipe.bench.soak",
}


# benchmarks that take a number of faults (--faults N) and the seed they are drawn from
TAKES_FAULTS = ("chaos", "soak")


class BenchInputError(ValueError):
    """Bad input to a bench (a flag's value, an environment variable it reads), found before
    anything runs: a usage error (exit 2, one line naming it), not a traceback."""


def run_bench(name: str, *, as_json: bool = False, quick: bool = False,
              faults: int | None = None, repeat: int = 1, seed: int | None = None) -> int:
    if name not in BENCHES:
        print(f"spotpipe: error: unknown benchmark {name!r}; choose one of "
              f"{', '.join(sorted(BENCHES))}", file=sys.stderr)
        return 2
    for flag, value in (("--faults", faults), ("--seed", seed)):
        if value is not None and name not in TAKES_FAULTS:
            print(f"spotpipe: error: {flag} is for {', '.join(TAKES_FAULTS)}, not {name!r}",
                  file=sys.stderr)
            return 2
    if faults is not None and faults < 1:
        print(f"spotpipe: error: --faults {faults}: expected at least 1", file=sys.stderr)
        return 2
    if repeat < 1:
        print(f"spotpipe: error: --repeat {repeat}: expected at least 1", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(BENCHES[name])
    except ImportError as exc:
        print(f"spotpipe: error: benchmark {name!r} is not available: {exc}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    try:
        given = {k: v for k, v in (("faults", faults), ("seed", seed)) if v is not None}
        runs = [module.run(quick=quick, **given) for _ in range(repeat)]
    except BenchInputError as exc:
        print(f"spotpipe: error: bench {name}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a job that failed, a machine without what the bench needs
        print(f"spotpipe: error: bench {name}: {exc}", file=sys.stderr)
        return 1
    figures = runs[0] if repeat == 1 else median_of_runs(runs)
    # over all the runs, set here only (no bench records its own)
    figures["load_average_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if as_json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:40s} {value}")
    return 0
