"""`spotpipe bench chaos [--faults N]`: recovery as a distribution, under randomized faults.

Each sample is one real local cluster (`spotpipe.cluster.launcher.train`, worker processes,
faults injected through the same paths as real failures) with one fault drawn from a seeded
generator: a crash (SIGKILL) at a random phase of a random iteration, a notice (SIGTERM,
handled at the next iteration boundary) or a hang (the main thread stops; the coordinator
fences the node after `failover.hang_timeout_s`), on P in {2, 3, 4} x D in {1, 2}, with lazy
redundancy, eager redundancy, or CPU shadows without redundancy.

Per run, from its events and metrics: the pause (from the fault to the first iteration
completed after the recovery's plan, in seconds and in iterations of the run's own median
iteration time; past the job's detection of the fault also in seconds, which does not scale
with the model's iteration) and the iterations lost (from their start or in part: the
in-flight one counts one; a notice loses none). Beside it, the part of the pause past the
fault's wait by design, which the issue's target bounds: a hang is one only after
`failover.hang_timeout_s`, and a notice is acted on at the next iteration boundary (the
iteration in flight runs on at full speed and is kept), so for a notice the pause past its wait
starts at that boundary. The pause past the job's detection is split into its parts: the
agreement (detection to the Decision), the regroup (to the last node running in the new
generation) and the replay (to the first iteration completed), beside the new layout's
slowdown (its iteration time over the old one's), which bounds the replay from below: after a
crash in a P=2 job one node runs both stages. Every run is checked against its failure-free run
(`spotpipe.bench.checks`): final parameters bit for bit (to float tolerance where D changed),
every sample consumed exactly once. Per fault kind the figures are p50, p90, p99 and the
maximum (nearest rank, `spotpipe.bench.stats`); `exact_runs` of `runs` passed every check.

The full bench draws the faults once and runs them on two models (MODELS): the GPT of `bench
pipeline` and `bench redundancy`, whose figures are the headline, then a tiny one, reported
under "tiny". Recovery's own costs (detection, agreement, regroup) are much the same in seconds
on both; in iterations, the tiny model's short iterations make them look several times larger.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotpipe.bench import BenchInputError
from spotpipe.bench.failover import REGROUP_EVENTS
from spotpipe.bench.pipeline import MICROBATCHES as PIPELINE_MICROBATCHES
from spotpipe.bench.pipeline import MODEL as PIPELINE_GPT
from spotpipe.bench.stats import distribution, percentile
from spotpipe.faults import Fault

REPO_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt_tiny.yaml"
KINDS = ("crash", "notice", "hang")
DEPTHS, WIDTHS = (2, 3, 4), (1, 2)
MODES = ("lazy", "eager", "shadows")
PHASES = ("start", "forward", "backward", "all-reduce", "optimizer")  # of an iteration
ITERATIONS = 8
SEED = 15
# The pause's target is in iterations, and what recovery costs is mostly fixed in seconds
# (the kernel's teardown of a killed process, the agreement, forming the new groups: tens of
# ms here, whatever the model), so the figure in iterations depends on how long an iteration
# is. Two models, both run by the full bench: "gpt", the GPT of `bench pipeline` and `bench
# redundancy` (the headline figures; 0.2-0.6 s per iteration here, with up to 12 processes on
# 2 cores: still under real training's seconds), and "tiny", small enough that up to 8 workers
# (+ 4 shadows) train in seconds on 2 cores (20-100 ms per iteration: the fixed costs are
# about one iteration there).
MODELS = {
    "gpt": {**{f"model.gpt.{k}": v for k, v in PIPELINE_GPT.items()}, **PIPELINE_MICROBATCHES},
    "tiny": {"model.gpt.n_layer": 2, "model.gpt.n_embd": 32, "model.gpt.n_head": 2,
             "model.gpt.block_size": 16, "micro_batch_size": 2, "num_microbatches": 4},
}
TARGET_PAST_TIMEOUT = 2.0  # iterations past the detection timeout, for the p99 pause
LIVENESS = {"failover.heartbeat_s": 0.2, "failover.heartbeat_timeout_s": 2.0,
            "failover.hang_timeout_s": 2.0}


@dataclass(frozen=True)
class ChaosCase:
    """One sample: a job layout, a redundancy mode and the one fault injected into it."""

    kind: str  # one of KINDS
    stages: int
    pipelines: int
    mode: str  # one of MODES
    node: str
    iteration: int
    phase: str = "start"

    def fault(self) -> Fault:
        return Fault("fail" if self.kind == "crash" else self.kind, self.node, self.iteration,
                     self.phase)

    def label(self) -> str:
        at = f"{self.node}@{self.iteration}" + (f":{self.phase}" if self.kind != "notice" else "")
        return f"{self.kind} {at} P={self.stages} D={self.pipelines} {self.mode}"


@dataclass
class CaseResult:
    case: ChaosCase
    completed: bool
    problems: list[str]
    pauses: list[dict[str, float]]

    @property
    def exact(self) -> bool:
        return self.completed and not self.problems


def draw_cases(n: int, seed: int = SEED, iterations: int = ITERATIONS) -> list[ChaosCase]:
    """`n` faults, each uniform over kind, P, D, mode, node, iteration (one with an iteration
    before and after it) and, for crashes and hangs, phase."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        kind = rng.choice(KINDS)
        p, d, mode = rng.choice(DEPTHS), rng.choice(WIDTHS), rng.choice(MODES)
        node = f"node{rng.randrange(p * d)}"
        phase = "start" if kind == "notice" else rng.choice(PHASES)
        cases.append(ChaosCase(kind, p, d, mode, node, rng.randint(1, iterations - 3), phase))
    return cases


def case_config(case: ChaosCase, *, failure_free: bool = False, iterations: int = ITERATIONS,
                model: str = "tiny"):
    """The job of a case on `model` (one of MODELS); `failure_free`: its reference (same
    training, no redundancy work)."""
    from spotpipe.config import load_config

    mode = "none" if failure_free or case.mode == "shadows" else case.mode
    shadows = case.mode == "shadows" and not failure_free
    sets = {**MODELS[model], **LIVENESS, "stages": case.stages, "pipelines": case.pipelines,
            "iterations": iterations, "redundancy": mode, "shadow.enabled": shadows,
            "logging.sample_log": True, "logging.progress": False}
    return load_config(REPO_EXAMPLE, [f"{k}={v}" for k, v in sets.items()])


def detection_timeout_s(case: ChaosCase) -> float:
    """How long the fault takes to detect by design: a hang is one only after the hang
    timeout; a crash is one at once (a notice waits for its boundary: `incidents`)."""
    return LIVENESS["failover.hang_timeout_s"] if case.kind == "hang" else 0.0


def incidents(run: Path, timeout_s: float = 0.0,
              at_boundary: bool = False) -> list[dict[str, float]]:
    """One entry per injected fault that the job recovered from: its pause and loss. Beside the
    pause, in iterations: the part past the fault's wait by design (the issue's target is 2
    iterations): `timeout_s`, or with `at_boundary` (a notice) until the iteration in flight
    completed, the last one before the plan; and the part past the job's knowing of the fault
    (its `failure_detected` event: for a crash, after the kernel's teardown of the process)."""
    from spotpipe.runfiles import read_jsonl

    events, metrics = read_jsonl(run / "events.jsonl"), read_jsonl(run / "metrics.jsonl")
    out = []
    for start in (e for e in events if e["kind"] == "fault_injected"):
        t0 = start["time_s"]
        plan = next((e for e in events if e["kind"] == "plan" and e["time_s"] >= t0), None)
        if plan is None:
            continue
        done = next((m for m in metrics
                     if m["time_s"] >= plan["time_s"] and m["iter"] >= plan["resume"]), None)
        if done is None:
            continue
        detected = next((e["time_s"] for e in events if e["kind"] == "failure_detected"
                         and e["time_s"] >= t0), plan["time_s"])
        # a hang's verdict (the node fenced), before its kill, exit and the failure's start:
        # tells a late verdict from a slow end of the fenced process
        fenced = next((e["time_s"] for e in events if e["kind"] == "node_fenced"
                       and t0 <= e["time_s"] <= plan["time_s"]), None)
        normal = [m["iter_time_s"] for m in metrics if m["time_s"] < t0][1:] or \
            [m["iter_time_s"] for m in metrics]
        in_flight = max([e["iteration"] for e in events if e["kind"] == "report"
                         and e.get("generation") == plan["generation"] - 1],
                        default=start["iteration"])
        iteration_s = statistics.median(normal)
        # every node has formed the new generation (the slowest one's event)
        regrouped = max((e["time_s"] for e in events if e["kind"] in REGROUP_EVENTS
                         and e.get("generation") == plan["generation"]),
                        default=plan["time_s"])
        # the new layout's own speed (one node running two stages after a takeover is slower)
        later = [m["iter_time_s"] for m in metrics if m["time_s"] > done["time_s"]]
        after_s = statistics.median(later) if later else done["iter_time_s"]
        if at_boundary:  # the boundary: iteration resume - 1 completed, after the notice
            boundary = next((m["time_s"] for m in metrics if m["iter"] == plan["resume"] - 1
                             and m["time_s"] >= t0), t0)
            timeout_s = boundary - t0
        out.append({"pause_s": done["time_s"] - t0,
                    "pause_iterations": (done["time_s"] - t0) / iteration_s,
                    "wait_by_design_s": timeout_s,
                    "past_timeout_iterations": (done["time_s"] - t0 - timeout_s) / iteration_s,
                    "detection_s": detected - t0,
                    "past_detection_iterations": (done["time_s"] - detected) / iteration_s,
                    # the same in seconds: what recovery costs whatever the model's iteration
                    "past_detection_s": done["time_s"] - detected,
                    "iterations_lost": max(0, in_flight - plan["resume"] + 1),
                    # the pause past detection in its parts: the Decision, every node in the
                    # new generation, then the rest of the lost iteration and the first one
                    # of the new layout, at its speed (`slowdown`: its iteration over the old)
                    "agreement_s": plan["time_s"] - detected,
                    "regroup_s": regrouped - plan["time_s"],
                    "replay_s": done["time_s"] - regrouped,
                    "slowdown": after_s / iteration_s,
                    "iteration_s": iteration_s, "action": plan["action"],
                    "fenced_s": None if fenced is None else fenced - t0,
                    # the coordinator found its store slow to answer (over half the heartbeat
                    # timeout) and judged the nodes afresh: a hang's verdict waits that long
                    "store_stalls": sum(1 for e in events if e["kind"] == "store_stalled"
                                        and t0 <= e["time_s"] <= done["time_s"])})
    return out


# a detection this much later than the fault's wait by design is an outlier worth reading
SLOW_DETECTION_S = 1.0


def worth_keeping(result: CaseResult) -> bool:
    """A run to keep for reading even when the bench removes its folder: not exact, or
    detected over SLOW_DETECTION_S past the fault's wait (the one hang of 50 detected after
    10 s instead of 2 was never seen again, and its events had gone with its folder)."""
    return not result.exact or any(
        p["detection_s"] - detection_wait_s(result.case, p) > SLOW_DETECTION_S
        for p in result.pauses)


def detection_wait_s(case: ChaosCase, pause: dict[str, float]) -> float:
    """How long the fault's detection may take by design: a hang's timeout; a notice's
    boundary (`incidents`); nothing for a crash."""
    return pause["wait_by_design_s"] if case.kind == "notice" else detection_timeout_s(case)


def width_changed(run: Path) -> bool:
    """Whether the run changed its data-parallel width D (its parameters then match the
    failure-free run's to float tolerance, not bit for bit: other summation orders)."""
    from spotpipe.runfiles import read_jsonl

    return any(e["kind"] == "plan" and e["action"] in ("drop_pipeline", "add_pipeline")
               for e in read_jsonl(run / "events.jsonl"))


class Chaos:
    """Runs cases under one folder, with one failure-free reference per (P, D)."""

    def __init__(self, root: Path, iterations: int = ITERATIONS, model: str = "tiny") -> None:
        if model not in MODELS:
            raise ValueError(f"bench chaos: unknown model {model!r}; expected one of "
                             f"{sorted(MODELS)}")
        self.root, self.iterations, self.model = root, iterations, model
        self._references: dict[tuple[int, int], dict[str, Any]] = {}

    def reference(self, case: ChaosCase) -> dict[str, Any]:
        return self.reference_at(case.stages, case.pipelines)

    def reference_at(self, stages: int, pipelines: int) -> dict[str, Any]:
        """The final parameters of the failure-free P x D run (run once, then kept)."""
        from safetensors.torch import load_file

        from spotpipe.cluster.launcher import train

        key = (stages, pipelines)
        if key not in self._references:
            out = self.root / f"reference-P{stages}-D{pipelines}"
            cfg = case_config(ChaosCase("crash", stages, pipelines, "lazy", "node0", 1),
                              failure_free=True, iterations=self.iterations,
                              model=self.model)
            if train(cfg, out, progress=False) != 0:
                raise RuntimeError(f"bench chaos: the failure-free run {out} failed")
            self._references[key] = load_file(str(out / "final" / "model.safetensors"))
        return self._references[key]

    def run_folder(self, index: int) -> Path:
        return self.root / f"run{index:03d}"

    def run_case(self, index: int, case: ChaosCase) -> CaseResult:
        from safetensors.torch import load_file

        from spotpipe.bench.checks import metrics_problems, parameter_problems, sample_problems
        from spotpipe.cluster.launcher import train

        want = self.reference(case)
        cfg = case_config(case, iterations=self.iterations, model=self.model)
        run = self.run_folder(index)
        code = train(cfg, run, progress=False, faults=[case.fault()])
        if code != 0:
            return CaseResult(case, False, [f"the job failed (exit {code}; see {run})"], [])
        got = load_file(str(run / "final" / "model.safetensors"))
        problems = parameter_problems(got, want, exact=not width_changed(run))
        problems += sample_problems(run, cfg) + metrics_problems(run, cfg)
        return CaseResult(case, True, problems,
                          incidents(run, detection_timeout_s(case),
                                    at_boundary=case.kind == "notice"))


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """Per fault kind the distribution of the pause and the loss; the checks' totals."""
    out: dict[str, Any] = {"runs": len(results), "exact_runs": sum(r.exact for r in results)}
    every = [p for r in results for p in r.pauses]
    out["pauses"] = len(every)
    out["store_stalls"] = sum(p.get("store_stalls", 0) for p in every)
    if every:
        whole = distribution([p["pause_iterations"] for p in every], 2)
        out["pause_p50_iterations"], out["pause_p99_iterations"] = whole["p50"], whole["p99"]
        seconds = distribution([p["pause_s"] for p in every])
        out["pause_p50_s"], out["pause_p99_s"] = seconds["p50"], seconds["p99"]
        recovery = distribution([p["past_detection_s"] for p in every])
        out["past_detection_p50_s"], out["past_detection_p99_s"] = recovery["p50"], recovery["p99"]
        for name in ("past_timeout", "past_detection"):
            past = distribution([p[f"{name}_iterations"] for p in every], 2)
            for stat in ("p50", "p99", "max"):
                out[f"{name}_{stat}_iterations"] = past[stat]
        # the target for the p99 pause: the fault's wait by design plus 2 iterations,
        # judged on the p99 itself (rounded to 2 digits, 2.004 would pass as 2.0)
        out["pause_p99_within_target"] = percentile(
            [p["past_timeout_iterations"] for p in every], 99) <= TARGET_PAST_TIMEOUT
    for kind in KINDS:
        mine = [p for r in results if r.case.kind == kind for p in r.pauses]
        out[f"{kind}_runs"] = sum(r.case.kind == kind for r in results)
        if not mine:
            continue
        for key, name, digits in (("pause_s", "pause_s", 4),
                                  ("pause_iterations", "pause_iterations", 2),
                                  ("past_timeout_iterations", "past_timeout_iterations", 2),
                                  ("detection_s", "detection_s", 4),
                                  ("wait_by_design_s", "wait_by_design_s", 4),
                                  ("past_detection_iterations", "past_detection_iterations",
                                   2),
                                  ("past_detection_s", "past_detection_s", 4),
                                  ("agreement_s", "agreement_s", 4),
                                  ("regroup_s", "regroup_s", 4),
                                  ("replay_s", "replay_s", 4),
                                  ("slowdown", "slowdown", 2),
                                  ("iterations_lost", "iterations_lost", 2)):
            for stat, value in distribution([p[key] for p in mine], digits).items():
                out[f"{kind}_{name}_{stat}"] = value
        fenced = [p["fenced_s"] for p in mine if p.get("fenced_s") is not None]
        if fenced:  # (hangs: their verdicts; the rest of the detection is the kill's)
            for stat, value in distribution(fenced, 4).items():
                out[f"{kind}_fenced_s_{stat}"] = value
    out.update({f"regroup_s_p50_{workers}_workers": value
                for workers, value in regroup_by_workers(results).items()})
    out["not_exact"] = [f"{r.case.label()}: {'; '.join(r.problems)}" for r in results
                        if not r.exact]
    out["without_pause"] = [r.case.label() for r in results if r.completed and not r.pauses]
    return out


def regroup_by_workers(results: list[CaseResult]) -> dict[int, float]:
    """The median regroup (Decision to the last node running the new layout), by the job's
    worker count at launch (P x D), over every fault kind and mode. On one machine the
    workers share its cores and each runs its part of the regroup in turn, so this is where
    a local run's regroup differs from a cluster's, where every node has a host of its own."""
    by: dict[int, list[float]] = {}
    for r in results:
        for p in r.pauses:
            by.setdefault(r.case.stages * r.case.pipelines, []).append(p["regroup_s"])
    return {workers: round(statistics.median(values), 4)
            for workers, values in sorted(by.items())}


def run_cases(cases: list[ChaosCase], root: Path | None = None,
              iterations: int = ITERATIONS, model: str = "tiny") -> dict[str, Any]:
    """Run `cases` (one job each, on `model`) and summarize them; the runs' folder is removed
    unless `root` is given or SPOTPIPE_BENCH_KEEP=1."""
    keep = root is not None or os.environ.get("SPOTPIPE_BENCH_KEEP") == "1"
    root = root or Path(tempfile.mkdtemp(prefix=f"spotpipe-bench-chaos-{model}-"))
    chaos = Chaos(root, iterations, model)
    # (a run that raises keeps the folder: its error names a run in it)
    results = [_run_and_print(chaos, i, case, len(cases)) for i, case in enumerate(cases)]
    out = summarize(results)
    print(f"{model}: regroup median by workers (P x D): " + ", ".join(
        f"{w}: {v * 1e3:.0f} ms" for w, v in regroup_by_workers(results).items()), flush=True)
    kept = [chaos.run_folder(i) for i, r in enumerate(results) if worth_keeping(r)]
    out["kept_runs"] = [str(run) for run in kept]  # (outliers: kept whatever `keep` says)
    out["runs_folder"] = str(root) if keep or kept else \
        "(removed; SPOTPIPE_BENCH_KEEP=1 keeps them)"
    if not keep:
        for run in root.iterdir():
            if run not in kept:
                shutil.rmtree(run, ignore_errors=True)
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _run_and_print(chaos: Chaos, i: int, case: ChaosCase, n: int) -> CaseResult:
    result = chaos.run_case(i, case)
    pause = ", ".join(_pause_line(p) for p in result.pauses) or "no pause"
    print(f"{chaos.model:4s} {i + 1:3d}/{n} {case.label():36s} {pause}  "
          f"{'exact' if result.exact else 'NOT EXACT'}", flush=True)
    return result


def _pause_line(p: dict[str, Any]) -> str:
    """One pause and its parts, in milliseconds (`incidents`)."""
    def ms(key: str) -> str:
        return f"{p[key] * 1e3:.0f}"

    fenced = "" if p.get("fenced_s") is None else f" (fenced at {ms('fenced_s')})"
    stalls = f", {p['store_stalls']} store stalls" if p.get("store_stalls") else ""
    return (f"{p['pause_s']:.3f} s = {p['pause_iterations']:.2f} it (detection "
            f"{ms('detection_s')} ms{fenced}, agreement {ms('agreement_s')}, regroup "
            f"{ms('regroup_s')}, replay {ms('replay_s')}; new layout x{p['slowdown']:.2f})"
            f"{stalls}")


def _describe(model: str) -> str:
    m = MODELS[model]
    return (f"n_layer={m['model.gpt.n_layer']} n_embd={m['model.gpt.n_embd']} block "
            f"{m['model.gpt.block_size']}, micro-batch {m['micro_batch_size']} x "
            f"M={m['num_microbatches']}")


def run(quick: bool = False, faults: int | None = None, seed: int = SEED) -> dict[str, Any]:
    """The same seeded faults on each model of MODELS ("gpt" first: its figures are the
    headline; "tiny"'s are under the key "tiny"). `quick` runs the tiny model only. `seed`:
    another draw of faults (the default's runs compare from stop to stop)."""
    n = faults if faults is not None else (3 if quick else 50)
    if n < 1:
        raise BenchInputError(f"--faults {n}: expected at least one fault")
    started = time.time()
    cases = draw_cases(n, seed)
    models = ["tiny"] if quick else ["gpt", "tiny"]
    summaries = {model: run_cases(cases, model=model) for model in models}
    out = summaries[models[0]]  # (`spotpipe bench` adds the load average)
    if len(models) > 1:
        out["tiny"] = summaries["tiny"]
    out.update({
        "faults": n, "seed": seed, "model": models[0],
        "config": "examples/gpt_tiny.yaml with "
                  + "; ".join(f"{m}: {_describe(m)}" for m in models) + "; "
                  f"{ITERATIONS} iterations; heartbeat 0.2 s, heartbeat and hang timeouts 2 s; "
                  "one fault per run",
        "wall_s": round(time.time() - started, 1),
    })
    return out
