"""Discrete-event simulator of one pipeline-parallel job on a spot cluster under a trace.

The loop is event-driven, not time-stepped: the clock jumps from one trace instant to the
next, so a 10-hour run costs as many steps as it has preemptions and grants. Between events
the job runs at the iteration time of its current layout (cached per layout shape), which is
why a run costs microseconds to a millisecond and a 10,000-seed table fits in a minute.

Invariants the tests check: the job never uses more nodes than the trace offers at any
instant (used <= held == available), only held instances are billed, on-demand equals its
closed form, and a run is a pure function of (trace, policy, config).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.job import Job
from spotpipe.sim.params import SimConfig
from spotpipe.sim.policies import Planner, checkpoint_interval, make_policy
from spotpipe.sim.traces import ADD, Trace

HOUR = 3600.0


@dataclass
class TimelinePoint:
    time_s: float
    available: int  # nodes the trace offers
    held: int  # instances billed
    used: int  # nodes running stages
    throughput: float  # samples/s at this instant (0 while paused)
    samples: float  # cumulative
    dollars: float  # cumulative


@dataclass
class Result:
    policy: str
    duration_s: float
    samples: float
    dollars: float
    preemptions: int  # held instances taken away
    fatal_failures: int  # restarts from shadows / checkpoints
    breakdown: dict[str, float]
    timeline: list[TimelinePoint] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Samples per second over the whole run."""
        return self.samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cost_per_hour(self) -> float:
        return self.dollars / (self.duration_s / HOUR) if self.duration_s > 0 else 0.0

    @property
    def value(self) -> float:
        """Samples per dollar."""
        return self.samples / self.dollars if self.dollars > 0 else 0.0

    def summary(self) -> dict[str, object]:
        return {"policy": self.policy, "duration_s": self.duration_s, "samples": self.samples,
                "throughput": self.throughput, "cost_per_hour": self.cost_per_hour,
                "dollars": self.dollars, "value": self.value, "preemptions": self.preemptions,
                "fatal_failures": self.fatal_failures, "breakdown": dict(self.breakdown)}


def run_policies(trace: Trace, policies: list[str], cfg: SimConfig, *,
                 duration_s: float | None = None, record: bool = True) -> dict[str, Result]:
    """Several policies on one trace; spotpipe and bamboo share their (identical) decisions."""
    planner = Planner()
    end = trace.duration_s if duration_s is None else float(duration_s)
    instants = list(_instants(trace, cfg.params.boot_s, end))  # policy-independent: once
    return {name: run(trace, name, cfg, duration_s=duration_s, record=record, planner=planner,
                      instants=instants) for name in policies}


def run(trace: Trace, policy: str, cfg: SimConfig, *, duration_s: float | None = None,
        record: bool = True, planner: Planner | None = None,
        instants: list | None = None) -> Result:
    """Simulate `policy` on `trace` for `duration_s` (default: the trace's span)."""
    end = trace.duration_s if duration_s is None else float(duration_s)
    if policy == "on_demand":
        return on_demand(cfg, end, record=record)
    job = Job(cfg.model.samples_per_iteration, checkpoint_interval(policy, cfg))
    pol = make_policy(policy, cfg, job, planner)
    price = cfg.price.spot
    timeline: list[TimelinePoint] = []
    held: set[str] = set()
    booting: set[str] = set()
    dollars = 0.0
    preemptions = 0
    last_t = 0.0
    if instants is None:
        instants = list(_instants(trace, cfg.params.boot_s, end))
    resume: TimelinePoint | None = None  # where a pause ends before the next event
    for index, (t, removes, adds, readies) in enumerate(instants):
        if resume is not None and resume.time_s < t:
            timeline.append(resume)
        resume = None
        dollars += len(held) * price * (t - last_t) / HOUR
        last_t = t
        job.advance(t)
        lost = frozenset(removes)
        preemptions += len(lost & held)
        held -= lost
        booting -= lost
        held.update(adds)
        booting.update(adds)
        ready = [n for n in readies if n in booting]
        booting.difference_update(ready)
        pol.on_events(t, lost, ready, index)
        if record:
            timeline.append(TimelinePoint(t, len(held), len(held), pol.used_nodes(),
                                          job.throughput_now(), job.samples, dollars))
            if job.paused_until > t and job.iter_s:
                until = job.paused_until
                resume = TimelinePoint(until, len(held), len(held), pol.used_nodes(),
                                       cfg.model.samples_per_iteration / job.iter_s,
                                       job.samples, dollars + len(held) * price * (until - t) / HOUR)
    if resume is not None and resume.time_s < end:
        timeline.append(resume)
    dollars += len(held) * price * (end - last_t) / HOUR
    breakdown = job.finish(end)
    if record:
        timeline.append(TimelinePoint(end, len(held), len(held), pol.used_nodes(),
                                      job.throughput_now(), job.samples, dollars))
    return Result(policy, end, job.samples, dollars, preemptions, pol.fatal_failures,
                  breakdown, timeline)


def _instants(trace: Trace, boot_s: float, end: float):
    """Group trace events and boot completions by instant: (t, removed, added, ready)."""
    trace_events = ((ev.time_s, 0, ev.kind, ev.node) for ev in trace.events)
    ready_events = ((ev.time_s + boot_s, 1, "ready", ev.node)
                    for ev in trace.events if ev.kind == ADD)
    cur_t = None
    removes: list[str] = []
    adds: list[str] = []
    readies: list[str] = []
    for t, _, kind, node in heapq.merge(trace_events, ready_events):
        if t > end:  # events at the end instant are applied, so the last state is exact
            break
        if t != cur_t:
            if cur_t is not None:
                yield cur_t, removes, adds, readies
            cur_t, removes, adds, readies = t, [], [], []
        if kind == ADD:
            adds.append(node)
        elif kind == "ready":
            readies.append(node)
        else:
            removes.append(node)
    if cur_t is not None:
        yield cur_t, removes, adds, readies


def on_demand_closed_form(cfg: SimConfig, duration_s: float) -> dict[str, float]:
    """P x D on-demand nodes, never preempted: boot, one rendezvous, then steady iterations."""
    start = cfg.params.boot_s + cfg.params.rendezvous_s
    it = iteration_time(cfg.model, cfg.schedule, cfg.num_stages, cfg.num_pipelines, ((),), False)
    running = max(0.0, duration_s - start)
    samples = running / it * cfg.model.samples_per_iteration
    dollars = cfg.nodes * cfg.price.on_demand * duration_s / HOUR
    return {"samples": samples, "dollars": dollars, "iteration_s": it,
            "idle_s": min(duration_s, start), "useful_s": running}


def on_demand(cfg: SimConfig, duration_s: float, *, record: bool = True) -> Result:
    form = on_demand_closed_form(cfg, duration_s)
    breakdown = {"useful": form["useful_s"], "redundant": 0.0, "recovering": 0.0,
                 "restarting": 0.0, "idle": form["idle_s"]}
    timeline = []
    if record:
        n = cfg.nodes
        start = form["idle_s"]
        rate = cfg.model.samples_per_iteration / form["iteration_s"]
        per_s = n * cfg.price.on_demand / HOUR
        timeline = [TimelinePoint(0.0, n, n, 0, 0.0, 0.0, 0.0),
                    TimelinePoint(start, n, n, n, rate, 0.0, per_s * start),
                    TimelinePoint(duration_s, n, n, n, rate, form["samples"], form["dollars"])]
    return Result("on_demand", duration_s, form["samples"], form["dollars"], 0, 0, breakdown,
                  timeline)
