"""Synthetic preemption traces: seeded, deterministic, cheap enough for 10,000-seed tables.

Each generator returns a `Trace` in the same event model as the loaders, so the simulator
cannot tell synthetic from real. They use `random.Random(seed)` (not numpy): at a few hundred
draws per trace the pure-Python generator is faster than numpy's per-call overhead, and it is
deterministic across platforms for a given seed.

- `bamboo_trace`: the model of Bamboo's simulator. Hour by hour, every node held at the start
  of the hour is preempted with probability `rate` at a uniform time in that hour, and every
  missing node (below the target size) is granted with probability `add_probability`.
- `poisson_trace`: exponential lifetimes (mean 1/rate hours) per node slot, a replacement
  after an exponential wait.
- `fixed_interval_trace`: one preemption every `interval_s`, the oldest node first, its
  replacement after `replace_s`; a deterministic stress pattern.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

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


def bamboo_trace(rate: float, hours: float, nodes: int, seed: int,
                 add_probability: float = 0.5) -> Trace:
    """Hourly preemption probability `rate` per node, hourly grant probability per missing
    node; the cluster starts full at t = 0."""
    check_bamboo(rate, hours, nodes, add_probability)
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
    return Trace(events, f"bamboo(rate={rate},seed={seed})", end)


def check_bamboo(rate: float, hours: float, nodes: int, add_probability: float = 0.5) -> None:
    """The arguments of `bamboo_trace`, checked without generating (a sweep checks them
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
