"""The simulator's speed-ups change no figure: its outputs on Bamboo's p3 and g4dn traces and on
synthetic seeds, for every policy and redundancy level, with and without shadows, equal the
figures recorded from the code before them (`tests/fixtures/sim_outputs.json`, written by
`python tests/test_sim_speed.py --record` at commit 0ea6e42, before any speed-up, and once
more when the planner's tie-breaks went from name order to slot order: a dropped
pipeline's freed nodes and the carriers a rebalance relieves, and once more when FRC placement
went from parameter counts to the parameters each layer multiplies by,
`model.compute_weights`, and once more when spotpipe's eager FRC left out the last stage's
replica, whose outputs nothing reads: only spotpipe's eager figures moved, Bamboo's did
not, and once more when on-demand kept Bamboo's value integral and the shadows' host was
billed in it: only `value_integral` moved, of on_demand and of spotpipe with shadows, and
once more when a loss without redundancy dropped its pipeline where another survived,
instead of restarting the job: only spotpipe's `none` figures moved, and once more when
durable checkpoints held whole iterations only, as the runtime writes them: only
checkpoint_restart's and spotpipe's without shadows moved, and once more when a node running
stages apart was timed as the merged streams it runs: only spotpipe's g4dn figures with
shadows moved, and once more when the analytic memory model counted the embedding's and the
loss's backward working memory, so that GPT-2 XL's smallest depth with redundancy on V100s
went from 4 to 5: only spotpipe's figures in the entries where it had re-partitioned to
P = 4 moved, g4dn lazy, eager and p12x2_lazy, synthetic 0.25 seeds 1 and 3 and 0.5 seeds
0-3, lazy, and once more when a shadow repair put a restored stage on the nearest live node
that runs one stage, not on a carrier of two: only spotpipe's g4dn figures with shadows
moved, lazy and eager), to the last bit; and
the planner's memo gives the same decisions as no memo.

Rerecord only for a change meant to alter the simulator's figures, and say so in its commit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from spotpipe.plan import Layout
from spotpipe.plan.recovery import History, NodeReport, recover
from spotpipe.sim.bench import bench_config
from spotpipe.sim.planmemo import settle_steps
from spotpipe.sim.policies import Planner, recovery_rules
from spotpipe.sim.simulator import run, run_policies
from spotpipe.sim.synthetic import simple_trace
from spotpipe.sim.traces import load_trace

FIXTURE = Path(__file__).parent / "fixtures" / "sim_outputs.json"
POLICIES = ["spotpipe", "bamboo", "checkpoint_restart", "on_demand"]
SYNTHETIC = [(rate, seed) for rate in (0.05, 0.25, 0.5) for seed in range(4)]


def _configs() -> dict[str, object]:
    lazy = bench_config("lazy")
    return {"lazy": lazy, "eager": bench_config("eager"), "none": bench_config("none"),
            "lazy_shadows": replace(lazy, shadows=True),
            "eager_shadows": replace(bench_config("eager"), shadows=True),
            "p12x2_lazy": replace(lazy, num_stages=12, num_pipelines=2)}


def _figures(trace, cfg, hours: float | None = None) -> dict[str, dict]:
    duration = None if hours is None else hours * 3600.0
    out = {}
    for name, r in run_policies(trace, POLICIES, cfg, duration_s=duration).items():
        out[name] = {"samples": r.samples, "dollars": r.dollars, "preemptions": r.preemptions,
                     "fatal_failures": r.fatal_failures, "breakdown": r.breakdown,
                     "run_window": list(r.run_window), "value_integral": r.value_integral,
                     "shapes": sorted(list(s) for s in r.shapes),
                     # (every point of the timeline, by digest: the figures above say
                     # where a difference is)
                     "timeline": _digest([[p.time_s, p.used, p.throughput, p.samples,
                                           p.dollars] for p in r.timeline])}
    return out


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _cases() -> list[tuple]:
    return list(_generate())


def _generate():
    traces = {name: load_trace(f"bamboo-{name}.csv") for name in ("p3", "g4dn")}
    for cfg_name, cfg in _configs().items():
        for name, trace in traces.items():
            yield f"{name}/{cfg_name}", trace, cfg, None
    lazy, shadows = _configs()["lazy"], _configs()["lazy_shadows"]
    for rate, seed in SYNTHETIC:
        trace = simple_trace(rate, 3.0, lazy.nodes, seed)
        yield f"synthetic-{rate}-{seed}/lazy", trace, lazy, 3.0
        yield f"synthetic-{rate}-{seed}/lazy_shadows", trace, shadows, 3.0


def _outputs() -> dict[str, dict]:
    return {key: _figures(trace, cfg, hours) for key, trace, cfg, hours in _cases()}


def _json(data):
    return json.loads(json.dumps(data))  # (tuples become lists, as in the fixture)


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("key", [k for k, *_ in _cases()])
def test_outputs_equal_the_recorded_figures(key, recorded):
    _, trace, cfg, hours = next(c for c in _cases() if c[0] == key)
    got = _json(_figures(trace, cfg, hours))
    want = recorded[key]
    for policy in POLICIES:
        assert got[policy] == want[policy], f"{key}: {policy} differs from the recorded run"


class _Recording(Planner):
    """The simulator's planner (one per trace, as the simulator makes them), keeping every
    call and what it answered."""

    def __init__(self, calls: list[tuple]) -> None:
        super().__init__(memo=True)
        self.calls = calls

    def plan(self, index, machine, situation, names, lost, ready, leaving=False):
        got = super().plan(index, machine, situation, names, lost, ready, leaving)
        if got is not None:
            self.calls.append((situation.layout(names), frozenset(lost) & set(names),
                               list(ready), machine.rules, got[0], list(names)))
        return got


def _replayed(move, names: list[str], ready: list[str]) -> list[tuple]:
    """A transition's decisions on these names, as the ledger and the layouts see them."""
    outer = names + ready
    return [(step.action, step.needs_restore, step.was_running,
             step.after.layout([outer[i] for i in step.sources]).to_json())
            for step in move.steps]


@pytest.mark.parametrize("cfg_name", ["lazy", "lazy_shadows", "none", "p12x2_lazy"])
def test_the_shape_memo_decides_as_the_planner_does(cfg_name):
    """Every transition the machine replayed (made for other nodes in a situation of the same
    shape) gives what `settle` decides for these very nodes, step by step: the action, the
    rollback, whether the job ran, and the layout after it."""
    cfg = _configs()[cfg_name]
    calls: list[tuple] = []
    made: set[int] = set()
    replays = 0
    for rate in (0.1, 0.5):
        for seed in range(12):
            trace = simple_trace(rate, 3.0, cfg.nodes, 100 + seed)
            run(trace, "spotpipe", cfg, record=False, planner=_Recording(calls))
    for layout, lost, ready, rules, move, names in calls:
        want = [(d.action, d.needs_restore, before.num_pipelines > 0, d.layout.to_json())
                for before, d in settle_steps(layout, lost, ready, rules)]
        assert _replayed(move, names, ready) == want, (layout.to_json(), lost, ready)
        replays += id(move) in made
        made.add(id(move))
    assert len(calls) > 200 and replays > 100  # the table was used, and checked


class _Coordinator:
    """What the runtime's coordinator does with `recover`, apart from `settle` and the memo:
    its history carried from decision to decision, the survivors' reports after a failure
    (at a boundary when nothing running was lost), then one decision per boundary while the
    layout can improve."""

    def __init__(self, rules, depth: int, width: int) -> None:
        self.rules = rules
        empty = Layout.from_mapping(depth, 0, {}, (), max_pipelines=width)
        self.history = History(empty, tuple((s, s + 1) for s in range(depth)))
        self.committed = -1

    def event(self, lost: frozenset[str], joiners: list[str]) -> Layout:
        layout = self.history.layout
        failed = bool(lost & layout.active_nodes)
        self.committed += 3  # iterations committed since the last event
        out = recover(self.history, self._reports(layout, lost, boundary=not failed), joiners,
                      self.rules, dead=lost, with_transfers=False)
        while out.improve and not out.decision.stopped:
            self.committed = out.decision.resume
            out = recover(out.history, self._reports(out.history.layout, frozenset(), True),
                          (), self.rules, with_transfers=False)
        # (a stopped job is restarted later from the survivors it left waiting)
        self.history = (History(out.decision.layout, self.history.partition)
                        if out.decision.stopped else out.history)
        return out.decision.layout

    def _reports(self, layout: Layout, lost: frozenset[str], boundary: bool) -> dict:
        live = sorted((layout.active_nodes | set(layout.standby)) - lost)
        return {n: NodeReport(n, iteration=self.committed + 1,
                              committed_through=self.committed, boundary=boundary,
                              flight=self.committed + 1) for n in live}


@pytest.mark.parametrize("cfg_name", ["lazy", "lazy_shadows", "none"])
def test_the_simulators_layouts_are_the_coordinators(cfg_name):
    """After every instant of a run, the simulator's layout (replayed from its memo) is the
    one a coordinator reaches by calling `recover` on the same events."""
    cfg = _configs()[cfg_name]
    for rate, seed in ((0.25, 300), (0.5, 301), (0.5, 302)):
        calls: list[tuple] = []
        run(simple_trace(rate, 3.0, cfg.nodes + 1, seed), "spotpipe", cfg, record=False,
            planner=_Recording(calls))
        coordinator = _Coordinator(recovery_rules(cfg, cfg.redundancy), cfg.num_stages,
                                   cfg.num_pipelines)
        for before, lost, ready, _, move, names in calls:
            after = move.after.layout(move.names_after(names, ready))
            assert coordinator.history.layout == before
            assert coordinator.event(lost, ready) == after, (before.to_json(), sorted(lost),
                                                             ready)
        assert len(calls) > 20


def test_results_with_and_without_the_memo_are_equal():
    cfg = _configs()["lazy_shadows"]
    for seed in range(6):
        trace = simple_trace(0.25, 3.0, cfg.nodes, 200 + seed)
        on = run(trace, "spotpipe", cfg, planner=Planner(memo=True))
        off = run(trace, "spotpipe", cfg, planner=Planner(memo=False))
        assert (on.samples, on.dollars, on.breakdown, on.shapes) == \
            (off.samples, off.dollars, off.breakdown, off.shapes)
        assert [vars(p) for p in on.timeline] == [vars(p) for p in off.timeline]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    FIXTURE.write_text(json.dumps(_outputs(), sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
