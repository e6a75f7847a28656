"""One recovery decision: the coordinator of a run and the simulator's spotpipe policy, given
the same losses, notices and joins, make the same sequence of Decisions (both call
`plan.recovery`; before it, the simulator called `plan.decide` without the coordinator's
rules, and the two disagreed, e.g. on re-partitions with shadows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from spotpipe.cluster.coordinator import Coordinator
from spotpipe.plan import Layout
from spotpipe.protocol import Channel, DecisionRecord, JoinRequest, Report, job_key, keys
from spotpipe.sim.models import gpt2_1_5b
from spotpipe.sim.params import SimConfig
from spotpipe.sim.policies import Planner, recovery_rules
from spotpipe.sim.prices import price_of
from spotpipe.store import board

from conftest import tiny_config

KEY = job_key(b"sesame", "same-decisions")
P, D = 3, 2


def _report(coord: Coordinator, node: str, *, boundary: bool, leaving: bool = False) -> None:
    coord.report(Report(node=node, generation=coord.generation, boundary=boundary,
                        iteration=7, position=0, instruction="", committed_through=6,
                        stepped_through=6, done=(), clip_scale=None, flight=-1, formed=True,
                        lacking=(), untouched=True, replica=None, leaving=leaving,
                        reason="test",
                        time_s=0.0), node)


def _decided(coord: Coordinator, generation: int) -> dict:
    opened = board.first(coord.store, keys.decision_board(generation), Channel(KEY, "x"),
                         on_refused=lambda why, _: None, timeout_s=5, expect=DecisionRecord)
    return opened.message.decision


def _shape(decision: dict) -> tuple:
    lay = Layout.from_json(decision["layout"])
    return (decision["action"], lay.num_stages, lay.num_pipelines,
            tuple(sorted((d, s, n) for (d, s), n in lay.mapping.items())),
            tuple(sorted(lay.standby)))


class Run:
    """The coordinator driven as a run drives it: the event's reports, then a boundary round
    whenever it asks for a regroup."""

    def __init__(self, corpus, shadows: bool) -> None:
        # (iterations past the reports': a boundary with none after it improves nothing)
        cfg = tiny_config(corpus, stages=P, pipelines=D, redundancy="lazy",
                          **{"shadow.enabled": shadows, "model.gpt.n_layer": 4,
                             "iterations": 50})
        self.emitted: list[dict] = []
        nodes = [f"node{r}" for r in range(P * D)]
        self.coord = Coordinator(
            cfg=cfg, store=dist.HashStore(), layout=Layout.build(P, D, nodes),
            kill=lambda node: None, emit=self.emitted.append, now=lambda: 0.0,
            channel=Channel(KEY, "coordinator"), partition=[(s, s + 1) for s in range(P)],
            partition_for=lambda depth: [(s, s + 1) for s in range(depth)])
        self.cfg = cfg

    def decisions_after(self, event) -> list[tuple]:
        """The decisions that `event` and the boundary rounds after it bring, each read as
        it is published (as workers read them): a generation's records are deleted once the
        generation after it ends (`cluster.collect`)."""
        coord = self.coord

        def step(act) -> list[tuple]:
            start = coord.generation
            act(coord)
            return [_shape(_decided(coord, g)) for g in range(start, coord.generation)]

        decided = step(event)
        # the generation the coordinator asked to end at the next boundary, as workers do
        while not coord.stop_message and any(
                e["kind"] == "regroup_requested" and e["generation"] == coord.generation
                for e in self.emitted):
            decided += step(lambda coord: [_report(coord, node, boundary=True)
                                           for node in sorted(coord.live)])
        return decided


def _sim_planner(shadows: bool):
    sim = SimConfig(gpt2_1_5b(), price_of("p3.2xlarge"), num_stages=P, num_pipelines=D,
                    redundancy="lazy", shadows=shadows, memory=None)
    sim = dataclasses.replace(sim, model=dataclasses.replace(sim.model,
                                                             global_microbatches=8))
    return Planner(), recovery_rules(sim, "lazy")


def _planned(planner: Planner, layout: Layout, rules, lost=(), ready=(),
             leaving: bool = False) -> tuple[list, Layout]:
    """The simulator's transition for this event (from its numbered situation), as layouts;
    `leaving`: the nodes `lost` go on a notice."""
    machine = planner.machine(rules)
    situation, names = machine.situation(layout)
    move, after = planner.plan(-1, machine, situation, names, tuple(lost), list(ready),
                               leaving)
    outer = names + list(ready)
    shapes = [_shape({"action": step.action.value,
                      "layout": step.after.layout([outer[i] for i in step.sources]).to_json()})
              for step in move.steps]
    return shapes, move.after.layout(after)


@pytest.mark.parametrize("shadows", [False, True], ids=["replicas", "replicas+shadows"])
def test_coordinator_and_simulator_decide_alike(corpus, shadows):
    run = Run(corpus, shadows)
    planner, rules = _sim_planner(shadows)
    layout = run.coord.layout
    # 1. node1 crashes: every survivor reports the failure
    def crash(coord):
        coord.node_exited("node1", -9)
        for node in sorted(coord.live):
            _report(coord, node, boundary=False)
    got = run.decisions_after(crash)
    want, layout = _planned(planner, layout, rules, lost={"node1"})
    assert got == want and got, (got, want)
    # 2. a node joins
    def join(coord):
        coord.join(JoinRequest("node9", 0.0, run.cfg.digest(), run.cfg.model_digest()),
                   "node9")
        for node in sorted(coord.live):
            _report(coord, node, boundary=True)
    got = run.decisions_after(join)
    want, layout = _planned(planner, layout, rules, ready=["node9"])
    assert got == want and got, (got, want)
    # 3. a notice: node4 leaves at the boundary
    def notice(coord):
        for node in sorted(coord.live):
            _report(coord, node, boundary=True, leaving=node == "node4")
    got = run.decisions_after(notice)
    want, layout = _planned(planner, layout, rules, lost={"node4"}, leaving=True)
    assert got == want and got, (got, want)
    actions = [e["action"] for e in run.emitted if e["kind"] == "plan"]
    # with shadows the job never re-partitions (the shadows hold the launch partition)
    assert ("repartition" in actions) != shadows, actions
