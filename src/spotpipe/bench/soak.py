"""`spotpipe bench soak [--faults N]`: compound faults, checked for what must never happen.

`bench chaos` measures recovery from one fault at a time. Spot capacity goes in bursts, so here
every run takes three: crashes, notices and hangs, drawn over any phase of an iteration and of a
recovery's own (its regroup, its transfers, a leaving node's hand-over), the second and third
within two iterations of the first, with nodes joining meanwhile and durable checkpoints on or
off, on P in {3, 4} x D in {1, 2} with lazy or eager redundancy or CPU shadows. Some such bursts
leave no copy of a stage (two adjacent stages at once, a carrier and the node holding its only
replica): then the job must stop and say why. What must never happen, and is counted in `bugs`
(the target is 0):
- a software error in a worker or a shadow (`worker_error`, `worker_failed`, `shadow_failed`);
- a job that completes but is not its failure-free run (its parameters, bit for bit where D did
  not change; each sample consumed once; a metrics line per iteration: `bench.checks`);
- a job that fails without the planner's stop (no `plan` event with action "stop");
- a job that does not end: each run is `spotpipe train` in a process of its own, as a user
  starts it, and one past `RUN_LIMIT_S` is killed and counted stuck.
The bugs this found while it was a script are tests now (a leaving node hung in its hand-over,
which held the job's end for ever: `tests/test_notice_handover.py`). Runs with a bug keep their
folders; the JSON names them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotpipe.bench import BenchInputError
from spotpipe.bench.chaos import LIVENESS, MODELS, REPO_EXAMPLE, Chaos, width_changed
from spotpipe.runfiles import read_jsonl

SEED = 505
ITERATIONS = 10
FAULTS_PER_RUN = 3
DEPTHS, WIDTHS = (3, 4), (1, 2)
MODES = ("lazy", "eager", "shadows")
KINDS = ("fail", "notice", "hang")
# of an iteration, then of a recovery (which fire only where one follows: `faults.PHASES`)
PHASES = ("start", "forward", "backward", "all-reduce", "optimizer", "checkpoint",
          "regroup", "transfer", "handover")
RUN_LIMIT_S = 150.0  # a run of 10 tiny iterations takes 1-10 s here; a hang is fenced in 2
ERROR_EVENTS = ("worker_error", "worker_failed", "shadow_failed")
FLAG = {"fail": "--fail", "notice": "--notice", "hang": "--hang"}


@dataclass(frozen=True)
class SoakFault:
    kind: str  # one of KINDS
    node: str
    iteration: int
    phase: str = "start"

    def flag(self) -> list[str]:
        at = f"{self.node}@{self.iteration}" + ("" if self.kind == "notice" else
                                                 f":{self.phase}")
        return [FLAG[self.kind], at]


@dataclass(frozen=True)
class SoakCase:
    """One run: a job, the nodes joining it (at iterations) and the faults injected into it."""

    stages: int
    pipelines: int
    mode: str  # one of MODES
    checkpoint_every: int  # 0: none
    joins: tuple[int, ...]
    faults: tuple[SoakFault, ...]

    def label(self) -> str:
        faults = " ".join(f"{f.kind}:{' '.join(f.flag()[1:])}" for f in self.faults)
        return (f"P={self.stages} D={self.pipelines} {self.mode} ckpt={self.checkpoint_every}"
                f" joins={list(self.joins)} {faults}")

    def sets(self, iterations: int) -> dict[str, Any]:
        """The job's `--set`s: bench chaos's tiny model and liveness."""
        return {**MODELS["tiny"], **LIVENESS, "stages": self.stages,
                "pipelines": self.pipelines, "iterations": iterations,
                "redundancy": "none" if self.mode == "shadows" else self.mode,
                "shadow.enabled": self.mode == "shadows", "logging.sample_log": True,
                "logging.progress": False, "checkpoint.every": self.checkpoint_every,
                "cluster.timeout_s": 30}


def draw_cases(n: int, seed: int = SEED, iterations: int = ITERATIONS,
               per_run: int = FAULTS_PER_RUN) -> list[SoakCase]:
    """`n` runs of `per_run` faults each: the first at iteration 2 to `iterations` - 4, the
    others within two iterations after it, on any node of the job or a joiner's."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        p, d, mode = rng.choice(DEPTHS), rng.choice(WIDTHS), rng.choice(MODES)
        first = rng.randint(2, iterations - 4)
        joins = tuple(sorted(rng.choice([(), (first,), (first, first), (first + 1,)])))
        nodes = [f"node{r}" for r in range(p * d + len(joins))]
        faults = []
        for i in range(per_run):
            kind = rng.choice(KINDS)
            # (the first fault falls in an iteration: a recovery's phases need one before)
            phase = "start" if kind == "notice" else rng.choice(PHASES[:6] if i == 0 else PHASES)
            faults.append(SoakFault(kind, rng.choice(nodes[:p * d] if i == 0 else nodes),
                                    first + (0 if i == 0 else rng.randint(0, 2)), phase))
        cases.append(SoakCase(p, d, mode, rng.choice([0, 2, 3]), joins, tuple(faults)))
    return cases


@dataclass
class SoakResult:
    case: SoakCase
    outcome: str  # "exact", "stopped" (by the planner, with its reason) or a bug's name
    detail: str
    wall_s: float

    @property
    def bug(self) -> bool:
        return self.outcome not in ("exact", "stopped")


def run_case(chaos: Chaos, case: SoakCase, run: Path, iterations: int = ITERATIONS,
             limit_s: float = RUN_LIMIT_S) -> SoakResult:
    """Run `case` as `spotpipe train` in a process group of its own, then judge it."""
    from safetensors.torch import load_file

    from spotpipe.bench.checks import metrics_problems, parameter_problems, sample_problems
    from spotpipe.config import load_config

    sets = case.sets(iterations)
    cmd = [sys.executable, "-m", "spotpipe", "train", str(REPO_EXAMPLE), "--out", str(run),
           "--overwrite", "--no-progress"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd += [a for f in case.faults for a in f.flag()]
    cmd += [a for it in case.joins for a in ("--join", str(it))]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # (the launcher and every worker it started)
        proc.communicate()
        return SoakResult(case, "stuck", f"still running after {limit_s:.0f} s",
                          time.monotonic() - started)
    took = time.monotonic() - started
    events = _events(run)
    errors = [e for e in events if e.get("kind") in ERROR_EVENTS]
    if errors:
        return SoakResult(case, "error", json.dumps(errors[0])[:300], took)
    if proc.returncode != 0:
        stop = next((e for e in events if e.get("kind") == "plan"
                     and e.get("action") == "stop"), None)
        if stop is None:
            return SoakResult(case, "failed", (err.strip().splitlines() or ["no output"])[-1]
                              [:300], took)
        return SoakResult(case, "stopped", str(stop.get("message", ""))[:300], took)
    cfg = load_config(REPO_EXAMPLE, [f"{k}={v}" for k, v in sets.items()])
    want = chaos.reference_at(case.stages, case.pipelines)
    got = load_file(str(run / "final" / "model.safetensors"))
    problems = parameter_problems(got, want, exact=not width_changed(run))
    problems += sample_problems(run, cfg) + metrics_problems(run, cfg)
    if problems:
        return SoakResult(case, "inexact", "; ".join(problems)[:300], took)
    return SoakResult(case, "exact", "", took)


def _events(run: Path) -> list[dict[str, Any]]:
    """The run's events, none where it wrote none (a launcher killed as it started)."""
    path = run / "events.jsonl"
    return read_jsonl(path, partial_tail=True) if path.exists() else []


def summarize(results: list[SoakResult]) -> dict[str, Any]:
    """Outcomes counted, the stops' reasons by their first clause, the bugs named."""
    out: dict[str, Any] = {"runs": len(results)}
    for outcome in ("exact", "stopped", "error", "inexact", "failed", "stuck"):
        out[f"{outcome}_runs"] = sum(r.outcome == outcome for r in results)
    out["bugs"] = sum(r.bug for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        if r.outcome == "stopped":
            why = r.detail.split(": ", 1)[-1].split(";")[0].split(" (")[0]
            reasons[why] = reasons.get(why, 0) + 1
    out["stop_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    out["bug_runs"] = [{"case": r.case.label(), "outcome": r.outcome, "detail": r.detail}
                       for r in results if r.bug]
    walls = sorted(r.wall_s for r in results)
    out["run_wall_s_max"] = round(walls[-1], 2) if walls else None
    return out


def run(quick: bool = False, faults: int | None = None, seed: int = SEED) -> dict[str, Any]:
    """`faults` runs (default 40; `quick`: 3) of FAULTS_PER_RUN faults each, drawn from
    `seed` (the default's runs compare from stop to stop; another finds other bursts)."""
    n = faults if faults is not None else (3 if quick else 40)
    if n < 1:
        raise BenchInputError(f"--faults {n}: expected at least one run")
    started = time.time()
    keep = os.environ.get("SPOTPIPE_BENCH_KEEP") == "1"
    root = Path(tempfile.mkdtemp(prefix="spotpipe-bench-soak-"))
    chaos = Chaos(root, ITERATIONS, "tiny")
    results = []
    for i, case in enumerate(draw_cases(n, seed)):
        result = run_case(chaos, case, root / f"run{i:03d}")
        results.append(result)
        print(f"soak {i + 1:3d}/{n} {case.label():90s} {result.outcome:8s} "
              f"{result.wall_s:5.1f} s {result.detail[:120]}", flush=True)
        if not result.bug and not keep:
            shutil.rmtree(root / f"run{i:03d}", ignore_errors=True)
    out = summarize(results)
    bugs = [f"run{i:03d}" for i, r in enumerate(results) if r.bug]
    out["runs_folder"] = str(root) if bugs or keep else "(removed; SPOTPIPE_BENCH_KEEP=1 keeps them)"
    if not bugs and not keep:
        shutil.rmtree(root, ignore_errors=True)
    out.update({"faults_per_run": FAULTS_PER_RUN, "seed": seed, "iterations": ITERATIONS,
                "config": "examples/gpt_tiny.yaml with bench chaos's tiny model; heartbeat 0.2 "
                          "s, heartbeat and hang timeouts 2 s, cluster.timeout_s 30",
                "wall_s": round(time.time() - started, 1)})
    return out
