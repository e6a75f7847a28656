"""`bamboo_trace` against Bamboo's own simulator and against its rules, worked out by hand.

References that do not come from the code under test: the events Bamboo's simulator
generated for six seeds (tests/fixtures/bamboo_synthetic_reference.json, made by
scripts/bamboo-synthetic-reference.py from uclasystem/bamboo, project_pactum/simulation/
simulator.py run unchanged); traces computed by hand from a scripted stream of draws; and
counts over many seeds against their binomial expectations, the tolerance 5 standard
deviations of the sum (a false alarm about once in 1.7 million runs).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from spotpipe.sim.synthetic import (BAMBOO_HOURLY_ADD, SyntheticModel, bamboo_events,
                                    bamboo_trace, check_bamboo)
from spotpipe.sim.traces import ADD, REMOVE, Event

REF = json.loads((Path(__file__).parent / "fixtures" / "bamboo_synthetic_reference.json")
                 .read_text())
HOUR = 3600.0
SIGMAS = 5.0


def _ours(case: dict) -> list[list]:
    add = "drawn" if case["generate_addition_probabilities"] else "hourly"
    removal = case["removal_probability"]  # None: its hour-of-day removal table
    trace = bamboo_trace(removal or 0.0, case["hours"], case["capacity"], case["seed"], add,
                         case["start_hour"],
                         removal_probabilities="hourly" if removal is None else "flat")
    return [[e.time_s, e.kind, e.node] for e in trace.events]


@pytest.mark.parametrize("case", REF["cases"], ids=lambda c: f"{c['model']}-seed{c['seed']}")
def test_the_same_events_as_bamboos_simulator_for_its_seed(case):
    ours, theirs = _ours(case), case["events"]
    # its heap pops the nodes granted at t = 0 in an order of its own, which is the order
    # they draw their removals in (`applied_order`, replayed): every removal names the same
    # node. The reference lists events by (time, kind, order made), ours lists the grants at
    # t = 0 in the order applied: sorted alike, they are the same
    def made(event):
        t, kind, name = event
        return (t, kind == REMOVE, int(name[4:]) if kind == ADD else 0)

    assert sorted(ours, key=made) == theirs
    initial = [n for t, k, n in ours if t == 0.0 and k == ADD]
    assert initial != sorted(initial, key=lambda n: int(n[4:])) or len(initial) < 3
    if not case["generate_addition_probabilities"]:
        assert case["addition_probabilities"] == list(BAMBOO_HOURLY_ADD)
    else:  # its first 24 draws, before any event
        rng = random.Random(case["seed"])
        assert case["addition_probabilities"] == [rng.random() for _ in range(24)]


def test_the_reference_covers_the_rules():
    """The fixture exercises what this generator could get wrong: nodes granted at t = 0 and
    not, hour-of-day tables drawn and fixed, a node removed in the hour it was granted."""
    cases = REF["cases"]
    assert {c["generate_addition_probabilities"] for c in cases} == {True, False}
    assert any(c["events"] and c["events"][0][0] > 0 for c in cases)
    # its hour-of-day removal table, with removals in its 0.25 hours (15-22 h)
    table = [c for c in cases if c["removal_probability"] is None]
    assert any(k == REMOVE and 15 <= (c["start_hour"] + t // HOUR) % 24 <= 22
               for c in table for t, k, _ in c["events"])
    same_hour = 0
    for c in cases:
        granted = {n: t for t, k, n in c["events"] if k == ADD and t > 0}
        same_hour += sum(1 for t, k, n in c["events"]
                         if k == REMOVE and n in granted and t // HOUR == granted[n] // HOUR)
    assert same_hour > 0


class Scripted:
    """A stream of draws given in advance; it fails on any draw not foreseen."""

    def __init__(self, draws: list[tuple[str, float]]):
        self.draws = list(draws)

    def _next(self, kind: str) -> float:
        assert self.draws, f"an unforeseen {kind} draw"
        want, value = self.draws.pop(0)
        assert want == kind, f"drew {kind} where the script has {want}"
        return value

    def random(self) -> float:
        return self._next("random")

    def randrange(self, start: int, stop: int) -> int:
        assert (start, stop) == (0, 3600)  # a whole second of the hour
        return int(self._next("randrange"))


def R(x):
    return ("random", x)


def S(x):
    return ("randrange", x)


def test_one_hour_worked_by_hand():
    # 2 nodes, hour of day 3 (Bamboo's fixed table: add 0.5), removal 0.5.
    # t = 0: slot 1 granted (0.1 < 0.5): node1; slot 2 not (0.9).
    # hour 0: node1 draws its removal (0.2: at 100 s); grants drawn: 2 missing - 1 held
    #   + 1 removal = 2: at 50 s (0.3) and at 200 s (0.4).
    # in time order: 50 s grant -> node2, whose removal (0.1) at 30 s is before its grant:
    #   dropped; 100 s node1 leaves; 200 s grant -> node3, whose removal (0.45) at 200 s is
    #   not before it: node3 leaves at 200 s, after its grant.
    rng = Scripted([R(.1), R(.9), R(.2), S(100), R(.3), S(50), R(.4), S(200),
                    R(.1), S(30), R(.45), S(200)])
    events = bamboo_events(rng, 0.5, 1.0, 2, "hourly", start_hour=3)
    assert events == [Event(0.0, ADD, "node1"), Event(50.0, ADD, "node2"),
                      Event(100.0, REMOVE, "node1"), Event(200.0, ADD, "node3"),
                      Event(200.0, REMOVE, "node3")]
    assert rng.draws == []


def test_a_grant_while_full_is_dropped_and_uses_no_name():
    # 1 node, start hour 3 (add 0.5), removal 0.5, 2 hours.
    # t = 0: node1. hour 0: node1's removal at 500 s; one grant (1 - 1 + 1) at 500 s: a tie,
    #   and Bamboo takes a removal first only if strictly earlier, so the grant comes while
    #   full and is dropped; node1 leaves at 500 s.
    # hour 1 (hour of day 4, add 0.5): nothing held; one grant at 3600 + 7 s: node2 (no name
    #   was used by the dropped grant); its removal is not drawn (0.99).
    rng = Scripted([R(.0), R(.3), S(500), R(.2), S(500),
                    R(.0), S(7), R(.99)])
    events = bamboo_events(rng, 0.5, 2.0, 1, "hourly", start_hour=3)
    assert events == [Event(0.0, ADD, "node1"), Event(500.0, REMOVE, "node1"),
                      Event(3607.0, ADD, "node2")]
    assert rng.draws == []


def test_drawn_probabilities_are_the_streams_first_24_draws():
    # 1 node, 1 hour, rate 0: the 24 drawn probabilities, then the grant at t = 0 with the
    # start hour's (hour 5: the sixth draw, 0.7 > 0.6: granted), then node1's removal draw
    draws = [R(i / 100) for i in range(24)]
    draws[5] = R(0.7)
    rng = Scripted(draws + [R(0.6), R(0.5)])
    assert bamboo_events(rng, 0.0, 1.0, 1, "drawn", start_hour=5) == [Event(0.0, ADD, "node1")]
    assert rng.draws == []


def _seeds_traces(n_seeds, rate, hours, nodes, add="drawn", start_hour=0):
    for seed in range(n_seeds):
        yield seed, bamboo_trace(rate, hours, nodes, seed, add, start_hour)


@pytest.mark.parametrize("rate,add,start_hour", [(0.5, "drawn", 0), (0.25, "hourly", 2),
                                                 (1.0, "drawn", 7)])
def test_every_event_follows_the_rules(rate, add, start_hour):
    nodes = 12
    same_hour = 0
    for _, trace in _seeds_traces(200, rate, 6, nodes, add, start_hour):
        held: dict[str, float] = {}
        names = 0
        last = (-1.0, "")
        for ev in trace.events:
            assert ev.time_s == int(ev.time_s)  # whole seconds
            assert (ev.time_s, ev.kind == REMOVE) >= (last[0], last[1] == REMOVE)
            last = (ev.time_s, ev.kind)
            if ev.kind == ADD:
                names += 1
                # named in order, none skipped (those at t = 0 in the order applied)
                assert ev.node == f"node{names}" or ev.time_s == 0.0
                held[ev.node] = ev.time_s
                assert len(held) <= nodes  # never beyond capacity
            else:
                granted = held.pop(ev.node)  # only a node held leaves
                same_hour += granted > 0 and granted // HOUR == ev.time_s // HOUR
        initial = {e.node for e in trace.events if e.time_s == 0.0 and e.kind == ADD}
        assert initial == {f"node{i}" for i in range(1, len(initial) + 1)}
    assert same_hour > 0  # a node granted in an hour can leave in that hour


def test_no_grants_in_the_hours_bamboos_table_gives_none():
    # Bamboo's fixed table is 0 from 15 to 22 h: started at 14 h (0.05), no grant after the
    # first hour in a 9 h trace, and none at all when started at 15 h
    late = 0
    for _, trace in _seeds_traces(100, 0.1, 9, 16, "hourly", 14):
        assert all(e.time_s < HOUR for e in trace.events if e.kind == ADD)
        late += sum(1 for e in trace.events if e.kind == ADD and e.time_s > 0)
    assert late > 0  # (the first hour's 0.05 does grant some)
    for _, trace in _seeds_traces(50, 0.1, 8, 16, "hourly", 15):
        assert trace.events == ()


def _within(observed: float, expected: float, variance: float) -> None:
    tol = SIGMAS * math.sqrt(variance)
    assert abs(observed - expected) <= tol, (observed, expected, tol)


def test_grants_at_the_start_are_binomial_in_the_start_hours_probability():
    # start hour 3: add 0.5 in Bamboo's table; 24 nodes, 2000 seeds (the hour's own grants
    # at its second 0 count too: about 12 x 0.5 / 3600 a seed, 0.01 standard deviations)
    n, p, seeds = 24, BAMBOO_HOURLY_ADD[3], 2000
    total = sum(sum(1 for e in t.events if e.time_s == 0.0)
                for _, t in _seeds_traces(seeds, 0.1, 1, n, "hourly", 3))
    _within(total, seeds * n * p, seeds * n * p * (1 - p))


def _held_at_start(events, h):
    """The nodes that draw their removal at hour h's start: those granted at t = 0 for the
    first hour (a grant of that hour at its second 0 counts too: it is removed in that hour
    with the same probability, rate), else those held before the hour."""
    if h == 0:
        return {e.node for e in events if e.time_s == 0.0 and e.kind == ADD}
    held = set()
    for e in events:
        if e.time_s >= h * HOUR:
            break
        (held.add if e.kind == ADD else held.discard)(e.node)
    return held


def test_removals_per_hour_are_rate_times_nodes_held():
    # of the nodes held at an hour's start, each leaves in that hour with probability rate
    rate, hours, nodes = 0.25, 4, 16
    held_total = removed = 0
    offsets = []
    for _, trace in _seeds_traces(500, rate, hours, nodes):
        for h in range(hours):
            held = _held_at_start(trace.events, h)
            held_total += len(held)
            gone = [e for e in trace.events if e.kind == REMOVE and e.node in held
                    and h * HOUR <= e.time_s < (h + 1) * HOUR]
            removed += len(gone)
            offsets += [e.time_s - h * HOUR for e in gone]
    _within(removed, rate * held_total, held_total * rate * (1 - rate))
    # at a uniform whole second: mean 1799.5, variance (3600^2 - 1) / 12 per removal
    _within(sum(offsets) / len(offsets), 1799.5, (3600 ** 2 - 1) / 12 / len(offsets))


def test_grants_per_hour_are_the_hours_probability_times_nodes_missing():
    # at rate 0 no removal is drawn, so the grants drawn never exceed the nodes missing and
    # none is dropped: an hour's grants are Binomial(missing, p) with the hour of day's p,
    # drawn as the seed's first 24 draws of random.Random. (Hour 0 is left out: its grants
    # at second 0 cannot be told from those at t = 0.)
    hours, nodes = 5, 16
    granted = expected = variance = 0.0
    for seed, trace in _seeds_traces(500, 0.0, hours, nodes):
        rng = random.Random(seed)
        p = [rng.random() for _ in range(24)]
        for h in range(1, hours):
            missing = nodes - len(_held_at_start(trace.events, h))
            granted += sum(1 for e in trace.events if e.kind == ADD
                           and h * HOUR <= e.time_s < (h + 1) * HOUR)
            expected += missing * p[h]
            variance += missing * p[h] * (1 - p[h])
    _within(granted, expected, variance)


def test_a_node_granted_leaves_the_same_hour_as_often_as_bamboo_draws_it():
    # a node granted at second g of an hour draws its removal: with probability rate, at a
    # uniform whole second, kept if not before g: rate * (3600 - g) / 3600
    rate = 0.5
    count = expected = variance = 0.0
    for _, trace in _seeds_traces(300, rate, 4, 16):
        gone = {e.node: e.time_s for e in trace.events if e.kind == REMOVE}
        for e in trace.events:
            if e.kind != ADD or e.time_s == 0.0:
                continue
            hour = e.time_s // HOUR
            p = rate * (3600 - (e.time_s - hour * HOUR)) / 3600
            expected += p
            variance += p * (1 - p)
            count += e.node in gone and gone[e.node] // HOUR == hour
    _within(count, expected, variance)


@pytest.mark.parametrize("args,words", [
    ((0.1, 1, 4, "sometimes", 0), "add_probabilities must be one of drawn, hourly"),
    ((0.1, 1, 4, "drawn", 24), "start_hour must be an hour of the day"),
    ((0.1, 1, 4, "drawn", 1.5), "start_hour must be an hour of the day"),
    ((1.5, 1, 4, "drawn", 0), "rate must be a probability"),
])
def test_bad_arguments_are_refused(args, words):
    with pytest.raises(ValueError, match=words):
        check_bamboo(*args)
    with pytest.raises(ValueError, match=words):
        bamboo_trace(args[0], args[1], args[2], 0, args[3], args[4])


def test_the_table_model_chooses_the_generator():
    assert SyntheticModel().trace(0.25, 2, 8, 3).events == bamboo_trace(0.25, 2, 8, 3).events
    simple = SyntheticModel("simple").trace(0.25, 2, 8, 3)
    assert sum(1 for e in simple.events if e.time_s == 0.0) == 8  # the simple one starts full
    assert SyntheticModel("simple").describe() == {"model": "simple", "add_probability": 0.5}
    with pytest.raises(ValueError, match="synthetic model must be one of bamboo, simple"):
        SyntheticModel("poisson").check(0.1, 1, 4)


# -- spotpipe simulate's flags ------------------------------------------------------------------

def _simulate(argv: list[str]) -> int:
    import argparse

    from spotpipe.cli import simulate as cli

    parser = argparse.ArgumentParser(prog="spotpipe")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate"] + argv)
    return args.func(args)


@pytest.mark.parametrize("argv,words", [
    (["--synthetic", "simple", "--start-hour", "3"],
     "--start-hour sets Bamboo's synthetic model; --synthetic simple does not take it"),
    (["--synthetic", "poisson", "--add-probabilities", "hourly", "--start-hour", "1"],
     "--add-probabilities and --start-hour set Bamboo's synthetic model; --synthetic "
     "poisson does not take them"),
    (["--trace", "p3", "--add-probabilities", "drawn"], "--trace p3 does not take it"),
    (["--start-hour", "24"], "--start-hour must be an hour of the day, 0 to 23, got 24"),
    (["--table", "--synthetic", "fixed"], "--table draws bamboo or simple traces"),
    (["--table", "--synthetic", "simple", "--rates", "0.1", "--hours", "1e9"],
     "--table --synthetic simple --hours 1e+09"),
])
def test_bad_synthetic_flags_exit_2(capsys, argv, words):
    assert _simulate(argv + ["--policy", "spotpipe"]) == 2
    assert words in capsys.readouterr().err


def test_the_table_runs_either_model_and_says_which(capsys):
    base = ["--table", "--seeds", "2", "--processes", "1", "--rates", "0.5", "--hours", "1",
            "--policy", "spotpipe", "--json"]
    assert _simulate(base + ["--add-probabilities", "hourly", "--start-hour", "3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["synthetic"] == {"model": "bamboo", "add_probabilities": "hourly",
                                "start_hour": 3}
    assert _simulate(base + ["--synthetic", "simple"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["synthetic"] == {"model": "simple", "add_probability": 0.5}
