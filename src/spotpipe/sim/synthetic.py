"""Synthetic preemption traces: seeded, deterministic, cheap enough for 10,000-seed tables.

Each generator returns a `Trace` in the same event model as the loaders, so the simulator
cannot tell synthetic from real. They use `random.Random(seed)` (not numpy): at a few hundred
draws per trace the pure-Python generator is faster than numpy's per-call overhead, and it is
deterministic across platforms for a given seed.

- `bamboo_trace`: the model of Bamboo's simulator (uclasystem/bamboo,
  project_pactum/simulation/simulator.py, `Simulator.generate_spot_instance_events`), rule
  for rule and, as it also draws from `random.Random(seed)`, draw for draw (and, where its
  heap orders simultaneous events, in its heap's order: `applied_order`). At t = 0 each
  node is granted with the start hour's add probability. At each whole hour every node held
  draws its removal (probability `rate`, a whole second of the hour); one grant is drawn per
  missing node plus per removal drawn, with the hour of day's add probability (24 drawn per
  seed, or Bamboo's fixed table); in time order, a grant while the cluster is full is
  dropped, and a node granted may be removed in the same hour.
- `simple_trace`: the model this project used before (not Bamboo's): the cluster starts
  full; hour by hour every node held at the start of the hour is preempted with probability
  `rate` at a uniform time in that hour, and every node missing at the start is granted
  with probability `add_probability` (0.5). The simulator's recorded figures use it.
- `poisson_trace`: exponential lifetimes (mean 1/rate hours) per node slot, a replacement
  after an exponential wait.
- `fixed_interval_trace`: one preemption every `interval_s`, the oldest node first, its
  replacement after `replace_s`; a deterministic stress pattern.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from spotpipe.sim.traces import ADD, MAX_NODES, REMOVE, Event, Trace

HOUR = 3600.0
# the most steps a generator may take (preemption times, node-hours, node lifetimes):
# thousands of times what a real trace needs (Bamboo's have a few hundred events); beyond it
# generating the trace would not finish in reason
MAX_STEPS = 1_000_000


def _validate(rate: float, hours: float, nodes: int) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be a probability in [0, 1], got {rate}")
    if hours <= 0 or nodes < 1:
        raise ValueError(f"need hours > 0 and nodes >= 1, got hours={hours}, nodes={nodes}")


def _bound(steps: float, what: str, fix: str, nodes: int) -> None:
    """Refuse a trace of more nodes than a loaded trace may offer, or whose generator would
    take about `steps` steps, beyond MAX_STEPS."""
    if nodes > MAX_NODES:
        raise ValueError(f"{nodes} nodes: more than the {MAX_NODES} a trace may offer")
    if not steps <= MAX_STEPS:
        raise ValueError(f"{what} {steps:.3g}, more than the {MAX_STEPS} a synthetic trace "
                         f"may take; {fix}")


# Bamboo's probability that a missing node is granted, by hour of day: the table its
# Simulator.__init__ uses unless generate_addition_probabilities is set
# (project_pactum/simulation/simulator.py; hours 3-5 are 0.5, 15-22 are 0)
BAMBOO_HOURLY_ADD: tuple[float, ...] = (0.05,) * 3 + (0.5,) * 3 + (0.05,) * 9 + (0.0,) * 8 \
    + (0.05,)
# "drawn": 24 uniform draws per seed (generate_addition_probabilities=True, what Bamboo's own
# 10,000-seed table, api.generate_table, runs); "hourly": BAMBOO_HOURLY_ADD
ADD_PROBABILITIES = ("drawn", "hourly")
# Bamboo's probability that a node held is removed, by hour of day: the table its
# Simulator.__init__ uses when no removal_probability is given (hours 3-5 are 0.01, 15-22 are
# 0.25, the rest 0.05); its own table (api.generate_table) always gives one
BAMBOO_HOURLY_REMOVE: tuple[float, ...] = (0.05,) * 3 + (0.01,) * 3 + (0.05,) * 9 \
    + (0.25,) * 8 + (0.05,)
# "flat": the rate at every hour; "hourly": BAMBOO_HOURLY_REMOVE (the rate is not used)
REMOVAL_PROBABILITIES = ("flat", "hourly")
SECONDS_PER_HOUR = 3600  # Bamboo draws event times as whole seconds: randrange(0, 3600)


class Stream(Protocol):
    """The two draws Bamboo's generator makes (`random.Random`'s), so a test can script them."""

    def random(self) -> float: ...

    def randrange(self, start: int, stop: int) -> int: ...


def bamboo_trace(rate: float, hours: float, nodes: int, seed: int,
                 add_probabilities: str = "drawn", start_hour: int = 0,
                 boot_order: bool = False, removal_probabilities: str = "flat") -> Trace:
    """Bamboo's synthetic preemptions, rule for rule and draw for draw: its simulator seeded
    with `seed` (`Simulator(seed, start_hour, generate_addition_probabilities=
    add_probabilities == "drawn", removal_probability=rate)` at capacity `nodes`) generates
    these events, the same times, kinds and names (`node1`, `node2`, ...); the nodes granted
    at t = 0 come in the order its heap applies them (`applied_order`), which is the order
    they draw their removals in. Unlike `simple_trace` the cluster does not start full: each node is granted at t = 0
    with the start hour's add probability. With `boot_order` the trace also says in which
    order its simulator takes the boots of those nodes, which all complete at 45 s
    (`bamboo_boot_order`): it decides the first layout. `removal_probabilities="hourly"`
    removes by its hour-of-day table instead of `rate` (its `removal_probability=None`)."""
    check_bamboo(rate, hours, nodes, add_probabilities, start_hour, removal_probabilities)
    events, initial = _generate(random.Random(seed), rate, hours, nodes, add_probabilities,
                                start_hour, removal_probabilities)
    removal = "hourly" if removal_probabilities == "hourly" else rate
    order = bamboo_boot_order(events, initial) if boot_order and initial else ()
    return Trace(events, f"bamboo(rate={removal},seed={seed},add={add_probabilities},"
                         f"start_hour={start_hour})", hours * HOUR, boot_order=order)


def check_bamboo(rate: float, hours: float, nodes: int, add_probabilities: str = "drawn",
                 start_hour: int = 0, removal_probabilities: str = "flat") -> None:
    """The arguments of `bamboo_trace`, checked without generating (a sweep checks them
    before it starts its processes)."""
    _validate(rate, hours, nodes)
    if removal_probabilities not in REMOVAL_PROBABILITIES:
        raise ValueError(f"removal_probabilities must be one of "
                         f"{', '.join(REMOVAL_PROBABILITIES)}, got {removal_probabilities!r}")
    if add_probabilities not in ADD_PROBABILITIES:
        raise ValueError(f"add_probabilities must be one of {', '.join(ADD_PROBABILITIES)}, "
                         f"got {add_probabilities!r}")
    if isinstance(start_hour, bool) or not isinstance(start_hour, int) \
            or not 0 <= start_hour <= 23:
        raise ValueError(f"start_hour must be an hour of the day, 0 to 23, got {start_hour!r}")
    # (a node-hour takes at most three pairs of draws: its removal, its replacement's grant
    # and that one's removal)
    _bound(nodes * math.ceil(hours), f"{nodes} nodes for {hours:g} h are node-hours to draw:",
           "use fewer hours or nodes", nodes)


def bamboo_events(rng: Stream, rate: float, hours: float, nodes: int,
                  add_probabilities: str = "drawn", start_hour: int = 0) -> list[Event]:
    """The events of `bamboo_trace` from any stream of draws, in Bamboo's order of draws:
    the add probabilities (Simulator.__init__), the grants at t = 0
    (generate_spot_instance_initial_events), then hour by hour
    (generate_spot_instance_events, run at each whole hour); events at or after the end
    are left out, as its event loop stops there."""
    return _generate(rng, rate, hours, nodes, add_probabilities, start_hour)[0]


def _generate(rng: Stream, rate: float, hours: float, nodes: int, add_probabilities: str,
              start_hour: int, removal_probabilities: str = "flat") -> tuple[list[Event], int]:
    """`bamboo_events`, and how many of them are the grants at t = 0 (the first)."""
    add = hourly_add_probabilities(rng, add_probabilities)
    remove = BAMBOO_HOURLY_REMOVE if removal_probabilities == "hourly" else (rate,) * 24
    names = (f"node{i}" for i in itertools.count(1))  # Simulator.get_spot_instance_next_name
    held: dict[str, None] = {}  # insertion-ordered, as its spot_instances dict
    events = _initial_grants(rng, add[start_hour], nodes, names, held)
    initial = len(events)
    end = hours * HOUR
    h = 0
    while h * HOUR < end:
        of_day = (start_hour + h) % 24
        hour = _bamboo_hour(rng, held, h * HOUR, add[of_day], remove[of_day], nodes, names)
        events += [e for e in hour if e.time_s < end]
        h += 1
    return events, initial


def hourly_add_probabilities(rng: Stream, add_probabilities: str) -> tuple[float, ...]:
    """The add probability of each hour of the day. "drawn" takes the stream's first 24
    draws, as Simulator.generate_probabilities does in its constructor before any event."""
    if add_probabilities == "hourly":
        return BAMBOO_HOURLY_ADD
    return tuple(rng.random() for _ in range(24))


def _draw_time(rng: Stream, p: float, base: float) -> float | None:
    """Simulator.generate_spot_instance_probability_delta: with probability p (one draw,
    `p > random()`), a whole second of the hour starting at `base` (a second draw)."""
    if p > rng.random():
        return base + rng.randrange(0, SECONDS_PER_HOUR)
    return None


def _initial_grants(rng: Stream, p: float, nodes: int, names: Iterator[str],
                    held: dict[str, None]) -> list[Event]:
    """generate_spot_instance_initial_events: each of the `nodes` slots is granted at t = 0
    with the start hour's add probability, one draw each. They are named in that order but
    held (and later draw their removals) in the order its event loop applies them
    (`applied_order`), and are given in that order."""
    granted = [next(names) for _ in range(nodes) if p > rng.random()]
    order = [granted[i] for i in applied_order(len(granted))]
    held.update(dict.fromkeys(order))
    return [Event(0.0, ADD, name) for name in order]


class _Tied:
    """An entry of Bamboo's event heap, ordered as its `Event` dataclass is: by (time, kind)
    only (its data has compare=False), so among equals heapq's own layout decides."""

    __slots__ = ("key", "index")

    def __init__(self, key: tuple[int, int], index: int) -> None:
        self.key, self.index = key, index

    def __lt__(self, other: "_Tied") -> bool:
        return self.key < other.key


BOOT_MS = 45_000  # its spot_instance_creation_time: a node is ready 45 s after its grant
# its event kinds (project_pactum/simulation/simulator.py, EventKind)
_ADD, _REMOVE, _GENERATE, _READY, _GLOBAL_TIMEOUT = 1, 2, 3, 4, 5


def bamboo_boot_order(events: list[Event], initial: int) -> tuple[str, ...]:
    """The order Bamboo's event loop takes the boots of the nodes granted at t = 0 in (their
    ready events all fall at 45 s): the order its heap pops them, replayed from what it holds
    until then. Its heap compares (time, kind) only, so among equal entries the order
    depends on everything pushed before: the grants at t = 0 and their ready events, the
    first hour's events in the order they were made, the next hour's generate event, ready
    events of the grants before 45 s and the global rendezvous timeout the first ready node
    starts. `events` are `bamboo_events`' (its first `initial` the grants at t = 0, then the
    first hour's in the order made); nothing but the trace is pushed before 45 s, as no
    step runs before a node is ready."""
    names = [""] * initial  # in the order made (events has them in the order applied)
    for place, made in enumerate(applied_order(initial)):
        names[made] = events[place].node
    heap: list[_Tied] = []
    for i in range(initial):
        heapq.heappush(heap, _Tied((0, _ADD), i))
    heapq.heappush(heap, _Tied((0, _GENERATE), -1))
    hour = [e for e in events[initial:] if e.time_s < HOUR]
    nodes = names + [e.node for e in hour]
    held: set[str] = set()
    stopped, order = True, []
    while heap and heap[0].key <= (BOOT_MS, _READY):
        entry = heapq.heappop(heap)
        t, kind = entry.key
        if kind == _ADD:
            held.add(nodes[entry.index])
            heapq.heappush(heap, _Tied((t + BOOT_MS, _READY), entry.index))
        elif kind == _REMOVE:
            held.discard(nodes[entry.index])
        elif kind == _GENERATE:
            heapq.heappush(heap, _Tied((int(HOUR) * 1000, _GENERATE), -1))
            for j, e in enumerate(hour, start=initial):
                heapq.heappush(heap, _Tied((int(e.time_s * 1000), _ADD if e.kind == ADD
                                            else _REMOVE), j))
        elif kind == _READY:
            order.append(nodes[entry.index])
            if stopped and nodes[entry.index] in held:  # the first ready node starts a rendezvous
                stopped = False
                heapq.heappush(heap, _Tied((t + 30_000, _GLOBAL_TIMEOUT), -1))
    return tuple(order)


@lru_cache(maxsize=None)
def applied_order(granted: int) -> tuple[int, ...]:
    """The order Bamboo's event loop applies the `granted` adds at t = 0 in: it pushes them
    and the hour's generate event (kind 3) on its heap, then pops the adds, each pushing its
    ready event (kind 4, 45 s on). Equal entries pop in an order heapq's layout decides, not
    the order of creation; it is replayed here, as it decides which node draws which
    removal at every later hour."""
    heap: list[_Tied] = []
    for i in range(granted):
        heapq.heappush(heap, _Tied((0, 1), i))
    heapq.heappush(heap, _Tied((0, 3), -1))
    order = []
    while heap[0].key == (0, 1):
        order.append(heapq.heappop(heap).index)
        heapq.heappush(heap, _Tied((BOOT_MS, _READY), -1))
    return tuple(order)


def _bamboo_hour(rng: Stream, held: dict[str, None], base: float, p_add: float,
                 p_remove: float, nodes: int, names: Iterator[str]) -> list[Event]:
    """One hour of generate_spot_instance_events. Every node held at the hour's start draws
    its removal; then one grant is drawn per node missing at the start plus per removal
    drawn (the most the hour can use). Both are merged in time order (a removal first only
    if strictly earlier): a grant while `nodes` are held is dropped, else it names the
    next node, which draws its own removal in this hour, kept if not before its grant."""
    removals = []
    for name in held:
        t = _draw_time(rng, p_remove, base)
        if t is not None:
            removals.append((t, name))
    heapq.heapify(removals)
    grants = []
    for _ in range(nodes - len(held) + len(removals)):
        t = _draw_time(rng, p_add, base)
        if t is not None:
            grants.append(t)
    heapq.heapify(grants)
    events = []
    while removals or grants:
        if removals and (not grants or removals[0][0] < grants[0]):
            t, name = heapq.heappop(removals)
            del held[name]
            events.append(Event(t, REMOVE, name))
            continue
        t = heapq.heappop(grants)
        if len(held) == nodes:
            continue  # at capacity: skipped, no name used
        name = next(names)
        held[name] = None
        events.append(Event(t, ADD, name))
        gone = _draw_time(rng, p_remove, base)
        if gone is not None and gone >= t:
            heapq.heappush(removals, (gone, name))
    return events


SYNTHETIC_MODELS = ("bamboo", "simple")


@dataclass(frozen=True)
class SyntheticModel:
    """Which generator draws a rates x seeds table's traces, with its settings (a sweep
    carries it into its worker processes)."""

    model: str = "bamboo"
    add_probabilities: str = "drawn"  # bamboo's
    start_hour: int = 0  # bamboo's
    add_probability: float = 0.5  # simple's
    # bamboo's: the order its simulator takes simultaneous boots at 45 s in (its table)
    boot_order: bool = False
    removal_probabilities: str = "flat"  # bamboo's: "hourly", its hour-of-day table

    def check(self, rate: float, hours: float, nodes: int) -> None:
        if self.model == "bamboo":
            check_bamboo(rate, hours, nodes, self.add_probabilities, self.start_hour,
                         self.removal_probabilities)
        elif self.model == "simple":
            check_simple(rate, hours, nodes, self.add_probability)
        else:
            raise ValueError(f"synthetic model must be one of {', '.join(SYNTHETIC_MODELS)}, "
                             f"got {self.model!r}")

    def trace(self, rate: float, hours: float, nodes: int, seed: int) -> Trace:
        if self.model == "simple":
            return simple_trace(rate, hours, nodes, seed, self.add_probability)
        return bamboo_trace(rate, hours, nodes, seed, self.add_probabilities, self.start_hour,
                            self.boot_order, self.removal_probabilities)

    def describe(self) -> dict:
        """The settings that apply to this model, for a sweep's output."""
        if self.model == "simple":
            return {"model": "simple", "add_probability": self.add_probability}
        out = {"model": "bamboo", "add_probabilities": self.add_probabilities,
               "start_hour": self.start_hour}
        if self.removal_probabilities != "flat":
            out["removal_probabilities"] = self.removal_probabilities
        return out


def simple_trace(rate: float, hours: float, nodes: int, seed: int,
                 add_probability: float = 0.5) -> Trace:
    """Hourly preemption probability `rate` per node, hourly grant probability per missing
    node; the cluster starts full at t = 0. Not Bamboo's model (see `bamboo_trace`): kept
    because the simulator's recorded figures and tests were computed on it."""
    check_simple(rate, hours, nodes, add_probability)
    rng = random.Random(seed)
    rnd = rng.random
    events, held = _full_start(nodes)
    next_id = nodes
    end = hours * HOUR
    h = 0
    while h * HOUR < end:
        base = h * HOUR
        span = min(HOUR, end - base)
        hour_events = []
        keep = []
        for node in held:
            if rnd() < rate:
                t = base + rnd() * HOUR
                if t < end:
                    hour_events.append(Event(t, REMOVE, node))
                    continue
            keep.append(node)
        for _ in range(nodes - len(held)):
            if rnd() < add_probability:
                t = base + rnd() * span
                node = f"n{next_id}"
                next_id += 1
                hour_events.append(Event(t, ADD, node))
                keep.append(node)
        hour_events.sort()
        events += hour_events
        held = keep
        h += 1
    return Trace(events, f"simple(rate={rate},seed={seed})", end)


def check_simple(rate: float, hours: float, nodes: int, add_probability: float = 0.5) -> None:
    """The arguments of `simple_trace`, checked without generating (a sweep checks them
    before it starts its processes)."""
    _validate(rate, hours, nodes)
    if not 0.0 <= add_probability <= 1.0:
        raise ValueError(f"add_probability must be in [0, 1], got {add_probability}")
    _bound(nodes * math.ceil(hours), f"{nodes} nodes for {hours:g} h are node-hours to draw:",
           "use fewer hours or nodes", nodes)


@lru_cache(maxsize=16)
def _start_events(nodes: int) -> tuple[tuple[Event, ...], tuple[str, ...]]:
    return tuple(Event(0.0, ADD, f"n{i}") for i in range(nodes)), \
        tuple(f"n{i}" for i in range(nodes))


def _full_start(nodes: int) -> tuple[list[Event], list[str]]:
    """The cluster's first grants (events are immutable: a sweep's traces share them)."""
    events, names = _start_events(nodes)
    return list(events), list(names)


def poisson_trace(rate: float, hours: float, nodes: int, seed: int,
                  replace_s: float = 600.0) -> Trace:
    """Per node slot: lifetime ~ Exp(mean 1/rate h), then a replacement after ~ Exp(replace_s)."""
    if rate < 0 or hours <= 0 or nodes < 1 or replace_s <= 0:
        raise ValueError("need rate >= 0, hours > 0, nodes >= 1, replace_s > 0")
    # (a slot's lifetimes average 1/rate h)
    _bound(nodes * (1 + rate * hours), f"rate {rate:g}/h on {nodes} nodes for {hours:g} h "
           f"makes node lifetimes: about", "use a lower rate, fewer hours or fewer nodes", nodes)
    rng = random.Random(seed)
    end = hours * HOUR
    events: list[Event] = []
    next_id = 0
    for _ in range(nodes):
        t = 0.0
        while t < end:
            node = f"n{next_id}"
            next_id += 1
            events.append(Event(t, ADD, node))
            if rate == 0:
                break
            t += rng.expovariate(rate / HOUR)
            if t >= end:
                break
            events.append(Event(t, REMOVE, node))
            t += rng.expovariate(1.0 / replace_s)
    events.sort(key=lambda e: (e.time_s, e.kind == ADD))
    return Trace(events, f"poisson(rate={rate},seed={seed})", end)


def fixed_interval_trace(interval_s: float, hours: float, nodes: int,
                         replace_s: float = 600.0) -> Trace:
    """A preemption every `interval_s`, oldest node first, replaced `replace_s` later."""
    if interval_s <= 0 or hours <= 0 or nodes < 1 or replace_s < 0:
        raise ValueError("need interval_s > 0, hours > 0, nodes >= 1, replace_s >= 0")
    _bound(hours * HOUR / interval_s,
           f"a preemption every {interval_s:g} s for {hours:g} h makes preemptions:",
           "use a longer interval or fewer hours", nodes)
    end = hours * HOUR
    events = [Event(0.0, ADD, f"n{i}") for i in range(nodes)]
    held = [f"n{i}" for i in range(nodes)]
    next_id = nodes
    pending: list[float] = []  # replacement times
    t = interval_s
    while t < end:
        while pending and pending[0] <= t:
            node = f"n{next_id}"
            next_id += 1
            events.append(Event(pending.pop(0), ADD, node))
            held.append(node)
        if held:
            events.append(Event(t, REMOVE, held.pop(0)))
            pending.append(t + replace_s)
        t += interval_s
    for when in pending:
        if when < end:
            events.append(Event(when, ADD, f"n{next_id}"))
            next_id += 1
    events.sort(key=lambda e: (e.time_s, e.kind == ADD))
    return Trace(events, f"fixed(interval={interval_s}s)", end)
