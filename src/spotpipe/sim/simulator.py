"""Discrete-event simulator of one pipeline-parallel job on a spot cluster under a trace.

The loop is event-driven, not time-stepped: the clock jumps from one trace instant to the
next (and to a policy's own timers: Bamboo's rendezvous timeouts), so a 10-hour run costs as
many steps as it has preemptions and grants. Between events the job runs at the iteration
time of its current layout (cached per layout shape; shapes are timed by
`spotpipe.sim.fastsched`), which is why a run costs a fraction of a millisecond to a few.

How the cost grows (`spotpipe bench simulator --json`, key `growth`; `sim.bench.growth`: CPU
ms of one run per policy, GPT-2 XL at P = 8 and D = nodes / 8, hourly removal rate 0.10, the
shapes already timed and the planner's memo filled by another seed's run; load average 1-3
on 2 shared cores, whose speed drifts by +-20 % from minute to minute):

| nodes | events (3 h / 12 h) | spotpipe | bamboo | checkpoint-restart |
|---|---|---|---|---|
| 48 | 61 / 139 | 7.5 / 20 | 0.49 / 2.6 | 0.32 / 0.97 |
| 192 | 272 / 570 | 75 / 193 | 3.5 / 19 | 1.5 / 5.9 |
| 768 | 1088 / 2246 | 1478 / 2740 | 32 / 72 | 14 / 45 |

On 2026-12-02's machine (a VM 2.5x faster, load under 1): 48 nodes 2.4 / 6.7, 0.24 / 1.1,
0.09 / 0.37 ms; 192 nodes 24 / 51, 1.2 / 5.0, 0.49 / 1.8 ms; 768 nodes 485 / 1217, 11 / 40,
4.2 / 17 ms (spotpipe, bamboo, checkpoint-restart; 3 h / 12 h): the same growth.

From 48 to 768 nodes (16x the nodes, 18x the events of a 3 h trace) checkpoint-restart costs
about 40x more per run and bamboo 65x (per event: a walk of the node list at a rendezvous or
restart), spotpipe about 200x, i.e. per event about linear in the nodes: its planner
(`plan.recovery.settle`) builds whole layouts at every decision it has not met before, and
its memo (`spotpipe.sim.planmemo`), which replays nearly every transition of a 24-node table
from situations seen before, rarely meets the same slot map twice among 96 pipelines. A
longer trace costs a little more than its events (3 h -> 12 h: 2.1x the events, 1.9-3x the
time).

Invariants the tests check: the job never uses more nodes than the trace offers at any
instant (used <= held == available), only held instances are billed, on-demand equals its
closed form, and a run is a pure function of (trace, policy, config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spotpipe.sim import fit
from spotpipe.sim.job import Job
from spotpipe.sim.params import SimConfig
from spotpipe.sim.policies import (Planner, SpotpipePolicy, checkpoint_interval,
                                   make_policy, plain_iteration_time, policy_class)
from spotpipe.sim.traces import ADD, Event, Trace

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
    # the time the job ran, from its first to its last progress (Bamboo's averages use it)
    run_window: tuple[float, float] = (0.0, 0.0)
    dollars_in_window: float = 0.0  # billed from 0 to the end of the run window
    value_integral: float = 0.0  # of (samples/s) / ($/h) over the run window
    value_formula: str = "samples_per_dollar"
    shapes: frozenset = frozenset()  # (P, D, a node carries two stages) of every layout run

    @property
    def window_s(self) -> float:
        return self.run_window[1] - self.run_window[0]

    @property
    def window_throughput(self) -> float:
        """Samples per second while the job ran: Bamboo's "average performance"."""
        return self.samples / self.window_s if self.window_s > 0 else 0.0

    @property
    def window_cost_per_hour(self) -> float:
        """$/h from 0 to the end of the run window: Bamboo's "average cost"."""
        end = self.run_window[1]
        return self.dollars_in_window / (end / HOUR) if end > 0 else 0.0

    @property
    def time_average_value(self) -> float:
        """Bamboo's value formula: the time average of samples/s per $/h while running."""
        return self.value_integral / self.window_s if self.window_s > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Samples per second over the whole run."""
        return self.samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cost_per_hour(self) -> float:
        return self.dollars / (self.duration_s / HOUR) if self.duration_s > 0 else 0.0

    @property
    def value(self) -> float:
        """Samples per dollar, or Bamboo's time-averaged value (`SimConfig.value_formula`)."""
        if self.value_formula == "bamboo":
            return self.time_average_value
        return self.samples / self.dollars if self.dollars > 0 else 0.0

    def summary(self) -> dict[str, object]:
        return {"policy": self.policy, "duration_s": self.duration_s, "samples": self.samples,
                "throughput": self.throughput, "cost_per_hour": self.cost_per_hour,
                "dollars": self.dollars, "value": self.value, "preemptions": self.preemptions,
                "fatal_failures": self.fatal_failures, "breakdown": dict(self.breakdown)}


def run_policies(trace: Trace, policies: list[str], cfg: SimConfig, *,
                 duration_s: float | None = None, record: bool = True) -> dict[str, Result]:
    """Several policies on one trace, which is turned into instants once."""
    planner = Planner()
    end = trace.duration_s if duration_s is None else float(duration_s)
    # policy-independent: once (spotpipe told of removals ahead makes its own, `run`)
    instants = instants_of(trace, cfg.params.boot_s, end)
    return {name: run(trace, name, cfg, duration_s=duration_s, record=record, planner=planner,
                      instants=instants) for name in policies}


def run(trace: Trace, policy: str, cfg: SimConfig, *, duration_s: float | None = None,
        record: bool = True, planner: Planner | None = None,
        instants: Instants | None = None, iterations: float | None = None) -> Result:
    """Simulate `policy` on `trace` for `duration_s` (default: the trace's span).

    `instants` (from `instants_of`, for this `duration_s`) may be passed in when several
    policies run on one trace: what the trace does to the instances held is the same for
    every spot policy. With `iterations` the run ends when the job has run that many (as
    Bamboo's table runs its job to the end), or at `duration_s` if that comes first: the
    result's `duration_s` says which.
    """
    end = trace.duration_s if duration_s is None else float(duration_s)
    if policy == "on_demand":
        return on_demand(cfg, end, record=record)
    job = Job(cfg.model.samples_per_iteration, checkpoint_interval(policy, cfg),
              cfg.params.checkpoint_cost_s)
    if iterations is not None:
        job.goal = float(iterations)
    pol = make_policy(policy, cfg, job, planner)
    # (only spotpipe uses notices: see SimConfig.notice_s)
    notice = cfg.acted_notice_s if issubclass(policy_class(policy), SpotpipePolicy) else 0.0
    if instants is None or instants.end != end or instants.notice_s != notice:
        instants = instants_of(trace, cfg.params.boot_s, end, notice)
    if trace.boot_order and hasattr(pol, "grants"):
        # (otherwise nodes become ready in the order granted, and Bamboo's rendezvous need
        # not sort them)
        pol.grants = instants.grants
    price = cfg.price.spot
    timeline: list[TimelinePoint] = []
    held = 0
    node_seconds = 0.0  # (only the timeline needs it as it goes)
    last_t = 0.0
    resume: TimelinePoint | None = None  # where a pause ends before the next event
    timers = hasattr(pol, "wakeup")  # a policy with clocks of its own (bamboo)
    # the shadows' CPU host runs on demand for the whole job
    fixed = cfg.shadow_host_price if policy == "spotpipe" and cfg.shadows else 0.0
    for index, (t, lost, ready, held_after) in enumerate(instants.points):
        if timers and pol.wakeup < t:
            _wake(pol, job, t, False)
        job.advance(t)
        if job.done_at is not None:
            break
        job.cost_rate = held_after * price + fixed  # $/h billed now, the shadows' host too
        if lost or ready:
            pol.on_events(t, lost, ready, index)
        if timers and pol.wakeup <= t:
            _wake(pol, job, t, True)  # after the trace's events of the same instant
        if record:
            node_seconds += held * (t - last_t)
            last_t = t
            held = held_after
            if resume is not None and resume.time_s < t:
                timeline.append(resume)
            resume = None
            dollars = (node_seconds * price + fixed * t) / HOUR
            timeline.append(TimelinePoint(t, held, held, pol.used_nodes(),
                                          job.throughput_now(), job.samples, dollars))
            if job.paused_until > t and job.iter_s:
                until = job.paused_until
                resume = TimelinePoint(until, held, held, pol.used_nodes(),
                                       cfg.model.samples_per_iteration / job.iter_s,
                                       job.samples,
                                       dollars + (held * price + fixed) * (until - t) / HOUR)
    if timers and job.done_at is None:
        _wake(pol, job, end, False)
    job.advance(end)  # (the goal may come after the trace's last instant)
    if job.done_at is not None:  # the goal was reached: the run ends there
        end = job.done_at
        instants = instants_of(trace, cfg.params.boot_s, end, notice)
    if resume is not None and resume.time_s < end:
        timeline.append(resume)
    held = instants.held_at_end
    dollars = (instants.node_seconds * price + fixed * end) / HOUR
    breakdown = job.finish(end)
    if record:
        timeline.append(TimelinePoint(end, held, held, pol.used_nodes(),
                                      job.throughput_now(), job.samples, dollars))
    window = (job.first_run_s, job.last_run_s) if job.first_run_s is not None else (0.0, 0.0)
    return Result(policy, end, job.samples, dollars, instants.preemptions, pol.fatal_failures,
                  breakdown, timeline, window, job.dollars_at_last_run, job.value_integral,
                  cfg.value_formula, frozenset(pol.shapes))


def _wake(pol, job: Job, t: float, inclusive: bool) -> None:
    """Fire the policy's own timers due before t (or at t, after t's events)."""
    while job.done_at is None:
        w = pol.wakeup
        if w > t or (w == t and not inclusive):
            return
        job.advance(w)
        if job.done_at is not None:  # the job's goal came before this timer
            return
        pol.on_wakeup(w)


@dataclass(frozen=True)
class Instants:
    """What the trace does to the instances held, once per trace, for every spot policy."""

    end: float
    # per instant (t, lost, ready, held): the held nodes removed (in trace order), the nodes
    # whose boot completed (in trace order), how many instances are held (billed) after it
    points: list[tuple[float, tuple[str, ...], list[str], int]]
    preemptions: int  # held instances taken away
    node_seconds: float  # instance-seconds held from 0 to `end`
    held_at_end: int
    # node -> the place of its latest grant among the trace's grants (Bamboo's rendezvous
    # lists nodes in the order they were granted)
    grants: dict[str, int] = field(default_factory=dict)
    notice_s: float = 0.0  # removals are lost this long before they happen (billed to them)


def instants_of(trace: Trace, boot_s: float, end: float, notice_s: float = 0.0) -> Instants:
    """The trace's instants up to `end`; events at `end` are applied, so the last state is
    exact. A sweep calls this once per trace, hence the hand-made merge of the trace with
    its boot completions (both sorted by time).

    With `notice_s`, each removal is told (`lost`) that long before it, or when its node was
    granted if that came later: the job stops using the node there, and the cloud bills it
    until the removal (`held`). A node told before its boot completes is never ready."""
    out: list[tuple[float, tuple[str, ...], list[str], int]] = []
    held: set[str] = set()
    # node -> when its boot completes: a node taken away and granted again under the same
    # name boots anew, and the first grant's completion must not make it ready early
    booting: dict[str, float] = {}
    events = trace.events
    if notice_s > 0:
        events = _with_notices(events, notice_s)
    boots = [(ev.time_s + boot_s, ev.node) for ev in events if ev.kind == ADD]
    grants = {node: i for i, (_, node) in enumerate(boots)}
    tied = {node: i for i, node in enumerate(trace.boot_order)}
    i = j = 0
    n_ev, n_boot = len(events), len(boots)
    preemptions = 0
    node_seconds = 0.0
    last_t = 0.0
    count = 0
    while i < n_ev or j < n_boot:
        t = events[i].time_s if i < n_ev else math.inf
        if j < n_boot and boots[j][0] < t:
            t = boots[j][0]
        if t > end:
            break
        # trace events first, in trace order (a node may be granted and taken away in the
        # same millisecond: it is held, for no time, and lost), then boots
        removed: list[str] = []
        while i < n_ev and events[i].time_s == t:
            ev = events[i]
            if ev.kind == ADD:
                held.add(ev.node)
                booting[ev.node] = t + boot_s
            elif ev.kind == NOTICE:  # the node is lost to the job, still billed
                if ev.node in held:
                    booting.pop(ev.node, None)
                    removed.append(ev.node)
            elif ev.node in held:
                held.discard(ev.node)
                if booting.pop(ev.node, None) is not None or not notice_s:
                    removed.append(ev.node)
            i += 1
        lost = tuple(removed)
        preemptions += len(lost)
        readies: list[str] = []
        while j < n_boot and boots[j][0] == t:
            readies.append(boots[j][1])
            j += 1
        ready = [n for n in readies if booting.get(n) == t]
        if tied and len(ready) > 1:
            ready.sort(key=lambda n: tied.get(n, len(tied)))
        for n in ready:
            del booting[n]
        node_seconds += count * (t - last_t)
        last_t = t
        count = len(held)
        out.append((t, lost, ready, count))
    node_seconds += count * (end - last_t)
    return Instants(end, out, preemptions, node_seconds, count, grants, notice_s)


NOTICE = "notice"  # (an event kind of the simulator's own: a removal told ahead)


def _with_notices(events: list[Event], notice_s: float) -> list[Event]:
    """The trace's events with a notice `notice_s` before each removal (not before the
    node's grant: a notice at the grant's instant follows it), in time order; a notice and
    a trace event at the same instant keep the trace's order, the notice after."""
    granted: dict[str, float] = {}
    notices = []
    for k, ev in enumerate(events):
        if ev.kind == ADD:
            granted[ev.node] = ev.time_s
        elif ev.node in granted:
            notices.append((max(ev.time_s - notice_s, granted.pop(ev.node)), 1, k,
                            Event(0.0, NOTICE, ev.node)))
    merged = [(ev.time_s, 0, k, ev) for k, ev in enumerate(events)] + notices
    merged.sort(key=lambda item: item[:3])
    return [ev._replace(time_s=t) if ev.kind == NOTICE else ev for t, _, _, ev in merged]


def on_demand_closed_form(cfg: SimConfig, duration_s: float) -> dict[str, float]:
    """P x D on-demand nodes, never preempted: boot, one rendezvous, then steady iterations."""
    start = cfg.params.boot_s + cfg.params.rendezvous_s
    it = plain_iteration_time(cfg, cfg.num_stages, cfg.num_pipelines)
    running = max(0.0, duration_s - start)
    samples = running / it * cfg.model.samples_per_iteration
    dollars = cfg.nodes * cfg.price.on_demand * duration_s / HOUR
    return {"samples": samples, "dollars": dollars, "iteration_s": it,
            "idle_s": min(duration_s, start), "useful_s": running}


def on_demand(cfg: SimConfig, duration_s: float, *, record: bool = True) -> Result:
    fit.require_fit(cfg, cfg.num_stages, cfg.num_pipelines, "none")
    form = on_demand_closed_form(cfg, duration_s)
    breakdown = {"useful": form["useful_s"], "redundant": 0.0, "recovering": 0.0,
                 "restarting": 0.0, "idle": form["idle_s"]}
    n = cfg.nodes
    start = form["idle_s"]
    rate = cfg.model.samples_per_iteration / form["iteration_s"]
    per_hour = n * cfg.price.on_demand
    timeline = []
    if record:
        per_s = per_hour / HOUR
        timeline = [TimelinePoint(0.0, n, n, 0, 0.0, 0.0, 0.0),
                    TimelinePoint(start, n, n, n, rate, 0.0, per_s * start),
                    TimelinePoint(duration_s, n, n, n, rate, form["samples"], form["dollars"])]
    # Bamboo's value formula compares it with the spot policies' (`Result.value`), so it
    # needs the same integral of (samples/s) / ($/h) while running as `Job` keeps for them
    integral = rate / per_hour * form["useful_s"] if per_hour > 0 else 0.0
    return Result("on_demand", duration_s, form["samples"], form["dollars"], 0, 0, breakdown,
                  timeline, (start, duration_s), form["dollars"], integral,
                  cfg.value_formula,
                  shapes=frozenset({(cfg.num_stages, cfg.num_pipelines, False)}))
