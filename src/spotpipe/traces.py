"""Preemption traces: three public formats normalised into one event model.

Shared by the simulator and by trace replay on a real job (`spotpipe train --trace`), so it
is a top-level module (standard library only); `spotpipe.sim.traces` re-exports it.

Every format becomes a `Trace`: a time-sorted tuple of (time_s, "add"|"remove", node). The
simulator only ever sees that model, so a new format needs only a loader. Loaders validate as
they read, because a silently wrong trace gives a confidently wrong prediction: each error is a
`TraceError` naming the file, the line and what was wrong.

Formats (see shared/traces/README.md):
- event CSV `delta_ms,add|remove,node` (Bamboo's AWS traces);
- tick series JSON `{"metadata": {"gap_seconds": N}, "data": [n0, n1, ...]}` (spot-traces);
- dated count series `YYYY-MM-DD, HH:MM:SS, n` (Bamboo's GCP traces). As published, each
  reading is followed by padding lines that repeat its count 1 and 2 minutes later, which may
  lie after the next reading: a line that repeats the last reading's count 60 or 120 s after
  it is padding (it changes nothing), the readings themselves must not go back in time, and
  the series spans to its last line.
Count series carry no node identities: nodes get generated names, and when the count drops,
which nodes leave is a choice (`victims`): `random` (seeded, the default: a count says
nothing about which, and a fixed order would always hit the same stages), `oldest` or
`newest`. The choice is recorded in `Trace.victims`.

Bundled traces: Bamboo's two AWS traces ship with the package (MIT, see
data/traces/LICENSE-bamboo-traces); `find_trace` looks a name up beside the checkout
(`../shared/traces`, or $SPOTPIPE_SHARED/traces) and then in the package, never at an absolute
path of one machine.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import re
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Iterable, NamedTuple

ADD = "add"
REMOVE = "remove"
VICTIMS = ("random", "oldest", "newest")
PADDING_S = (60.0, 120.0)  # Bamboo's dated series repeat each reading 1 and 2 minutes later
BUNDLED = ("bamboo-p3.csv", "bamboo-g4dn.csv")
# the most nodes a count series may offer at once: far above any spot trace (Bamboo's peak
# 32), and a count beyond it is a typo that would take hours to turn into node events
MAX_NODES = 100_000


class TraceError(ValueError):
    """A malformed trace; the message names the file, the line and the problem."""

    def __init__(self, source: str, line: int, problem: str) -> None:
        super().__init__(f"{source}:{line}: {problem}")
        self.source, self.line, self.problem = source, line, problem


class Event(NamedTuple):
    time_s: float
    kind: str  # ADD or REMOVE
    node: str


class Trace:
    """Sorted events plus fast availability queries (counts as a step function of time)."""

    def __init__(self, events: Iterable[Event], name: str = "trace",
                 duration_s: float | None = None, victims: str | None = None,
                 boot_order: tuple[str, ...] = ()) -> None:
        self.events: tuple[Event, ...] = tuple(events)
        self.name = name
        self.victims = victims  # how a count series chose who leaves (None: events name them)
        # the order boots that complete at one instant are taken in, where it is not the
        # grants' (Bamboo's simulator's heap order, `synthetic.bamboo_boot_order`)
        self.boot_order = boot_order
        last = self.events[-1].time_s if self.events else 0.0
        self.duration_s = float(duration_s) if duration_s is not None else last
        self._series: tuple[list[float], list[int]] | None = None

    def _steps(self) -> tuple[list[float], list[int]]:
        """The availability step function, built on first use (a sweep makes tens of
        thousands of traces and asks none of them)."""
        if self._series is None:
            times: list[float] = []
            counts: list[int] = []
            n = 0
            for ev in self.events:
                n += 1 if ev.kind == ADD else -1
                if times and times[-1] == ev.time_s:
                    counts[-1] = n
                else:
                    times.append(ev.time_s)
                    counts.append(n)
            self._series = times, counts
        return self._series

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self.events)} events, {self.duration_s:.0f} s)"

    def nodes_available_at(self, t: float) -> int:
        """How many nodes the trace offers at time t (events at t already applied)."""
        times, counts = self._steps()
        i = bisect.bisect_right(times, t)
        return counts[i - 1] if i else 0

    def nodes_at(self, t: float) -> frozenset[str]:
        """Which nodes the trace offers at time t."""
        live: set[str] = set()
        for ev in self.events:
            if ev.time_s > t:
                break
            (live.add if ev.kind == ADD else live.discard)(ev.node)
        return frozenset(live)

    def step_series(self) -> tuple[list[float], list[int]]:
        """(times, counts): the availability step function, one point per distinct time."""
        times, counts = self._steps()
        return list(times), list(counts)

    @property
    def peak_nodes(self) -> int:
        return max(self._steps()[1], default=0)

    @property
    def removals(self) -> int:
        return sum(1 for ev in self.events if ev.kind == REMOVE)


# -- loaders ------------------------------------------------------------------------------

def find_trace(name: str | Path) -> Path:
    """A trace file: `name` itself if it exists, else a bundled or shared trace of that name
    ("bamboo-p3.csv", or "p3" / "g4dn" for Bamboo's), looked up beside the checkout first."""
    path = Path(name)
    if path.exists():
        return path
    file = f"bamboo-{name}.csv" if f"bamboo-{name}.csv" in BUNDLED else path.name
    places = []
    if os.environ.get("SPOTPIPE_SHARED"):
        places.append(Path(os.environ["SPOTPIPE_SHARED"]) / "traces")
    places.append(Path(__file__).resolve().parents[2].parent / "shared" / "traces")
    for place in places:
        if (place / file).is_file():
            return place / file
    if file in BUNDLED:
        with resources.as_file(resources.files("spotpipe.sim") / "data" / "traces" / file) as p:
            return Path(p)
    return path  # not found: load_trace reports it, naming what was asked for


def load_trace(path: str | Path, victims: str = "random", seed: int = 0) -> Trace:
    """Load any supported format, chosen by content (JSON object, dated lines, or events);
    `victims` and `seed` say who leaves when a count series drops (see the module doc)."""
    if victims not in VICTIMS:
        raise ValueError(f"victims must be one of {', '.join(VICTIMS)}, got {victims!r}")
    path = find_trace(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(str(path), 0, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(str(path), 0, f"not a text file: {exc.reason}") from None
    head = text.lstrip()
    if head.startswith("{"):
        return parse_tick_json(text, str(path), victims, seed)
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first.split(",")[0].strip().count("-") == 2:
        return parse_dated_series(text, str(path), victims, seed)
    return parse_event_csv(text, str(path))


def parse_event_csv(text: str, source: str = "<string>") -> Trace:
    """`delta_ms,add|remove,node` lines; blank lines and a `delta_ms,...` header are skipped."""
    events: list[Event] = []
    live: set[str] = set()
    last = 0.0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or (lineno == 1 and line.lower().startswith("delta")):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(source, lineno, f"expected 3 fields delta_ms,add|remove,node, got "
                                             f"{len(parts)}: {line!r}")
        t = _number(parts[0], source, lineno, "delta_ms") / 1000.0
        kind, node = parts[1].lower(), parts[2]
        if t < last:
            raise TraceError(source, lineno, f"time goes backwards: {parts[0]} ms after "
                                             f"{last * 1000:g} ms")
        if kind not in (ADD, REMOVE):
            raise TraceError(source, lineno, f"bad kind {parts[1]!r}, expected add or remove")
        if not node:
            raise TraceError(source, lineno, "empty node name")
        if kind == ADD and node in live:
            raise TraceError(source, lineno, f"node {node!r} added while already present")
        if kind == REMOVE and node not in live:
            raise TraceError(source, lineno, f"node {node!r} removed but not present")
        (live.add if kind == ADD else live.remove)(node)
        events.append(Event(t, kind, node))
        last = t
    if not events:
        raise TraceError(source, 1, "no data lines")
    return Trace(events, Path(source).name)


def parse_tick_json(text: str, source: str = "<string>", victims: str = "random",
                    seed: int = 0) -> Trace:
    """`{"metadata": {"gap_seconds": N}, "data": [n0, n1, ...]}`: count n_i from i*N."""
    def refuse_constant(name: str) -> None:  # JSON has no NaN/Infinity; Python's parser does
        match = re.search(r"(?<![\w\"])-?(NaN|Infinity)\b", text)
        line = text.count("\n", 0, match.start()) + 1 if match else 1
        raise TraceError(source, line, f"{name} is not a count (JSON has no NaN or Infinity)")

    try:
        raw = json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise TraceError(source, exc.lineno, f"invalid JSON: {exc.msg}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise TraceError(source, 1, "expected an object with 'metadata' and 'data'")
    gap = raw["metadata"].get("gap_seconds")
    # (json reads a number too big for a float, like 1e400, as inf without parse_constant)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 < gap < math.inf:
        raise TraceError(source, _line_of(text, '"gap_seconds"'),
                         f"metadata.gap_seconds must be a finite positive number, got {gap!r}")
    data = raw.get("data")
    if not isinstance(data, list):
        raise TraceError(source, _line_of(text, '"data"'), "'data' must be a list of counts")
    if not data:
        raise TraceError(source, _line_of(text, '"data"'), "no data: 'data' is an empty list")
    span = len(data) * float(gap)
    if not math.isfinite(span):
        raise TraceError(source, _line_of(text, '"gap_seconds"'),
                         f"metadata.gap_seconds {gap!r} x {len(data)} counts is not a finite "
                         f"span of time")
    counts = [_count(n, source, _element_line(text, i), f"data[{i}]")
              for i, n in enumerate(data)]
    times = [i * float(gap) for i in range(len(counts))]
    return counts_to_trace(times, counts, Path(source).name, span, victims, seed)


def parse_dated_series(text: str, source: str = "<string>", victims: str = "random",
                       seed: int = 0) -> Trace:
    """`YYYY-MM-DD, HH:MM:SS, n` lines; times relative to the first line; padding lines
    (see the module doc) change nothing but the span."""
    times: list[float] = []
    counts: list[int] = []
    start: datetime | None = None
    span = 0.0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(source, lineno, f"expected 'YYYY-MM-DD, HH:MM:SS, n', got {line!r}")
        try:
            when = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise TraceError(source, lineno, f"bad date or time {parts[0]!r}, {parts[1]!r}") from None
        n = _count(_number(parts[2], source, lineno, "instance count"), source, lineno,
                   "instance count", parts[2])
        start = start or when
        t = (when - start).total_seconds()
        span = max(span, t)
        if times and int(n) == counts[-1] and t - times[-1] in PADDING_S:
            continue  # a padding line
        if times and t < times[-1]:
            raise TraceError(source, lineno, f"time goes backwards: {parts[0]} {parts[1]} is "
                                             f"before the reading at +{times[-1]:g} s")
        times.append(t)
        counts.append(int(n))
    if not times:
        raise TraceError(source, 1, "no data lines")
    return counts_to_trace(times, counts, Path(source).name, span, victims, seed)


def counts_to_trace(times: list[float], counts: list[int], name: str,
                    duration_s: float | None = None, victims: str = "random",
                    seed: int = 0) -> Trace:
    """Turn a count series into add/remove events; `victims` picks who leaves on a drop
    (random: seeded by `seed`; oldest; newest)."""
    if victims not in VICTIMS:
        raise ValueError(f"victims must be one of {', '.join(VICTIMS)}, got {victims!r}")
    rng = random.Random(seed)
    events: list[Event] = []
    live: list[str] = []  # oldest first
    next_id = 0
    for t, n in zip(times, counts):
        while len(live) < n:
            node = f"n{next_id}"
            next_id += 1
            live.append(node)
            events.append(Event(t, ADD, node))
        drop = len(live) - n
        if drop > 0:
            if victims == "oldest":
                gone = live[:drop]
            elif victims == "newest":
                gone = live[-drop:]
            else:
                gone = rng.sample(live, drop)
            leaving = set(gone)
            live = [x for x in live if x not in leaving]
            events += [Event(t, REMOVE, node) for node in gone]
    label = f"random(seed={seed})" if victims == "random" else victims
    return Trace(events, name, duration_s, victims=label)


# -- helpers ------------------------------------------------------------------------------

def _number(text: str, source: str, lineno: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(source, lineno, f"bad number for {what}: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(source, lineno, f"{what} must be a finite non-negative number, "
                                         f"got {text!r}")
    return value


def _count(value: object, source: str, lineno: int, what: str, text: str | None = None) -> int:
    """A node count: a finite whole number from 0 to MAX_NODES (`text`: as the file wrote it)."""
    shown = repr(text) if text is not None else repr(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < math.inf) or value != int(value):
        raise TraceError(source, lineno, f"{what} must be a non-negative whole count, "
                                         f"got {shown}")
    if value > MAX_NODES:
        raise TraceError(source, lineno, f"{what} is {shown} nodes, more than the {MAX_NODES} "
                                         f"a trace may offer")
    return int(value)


def _line_of(text: str, needle: str) -> int:
    pos = text.find(needle)
    return text.count("\n", 0, pos) + 1 if pos >= 0 else 1


def _element_line(text: str, index: int) -> int:
    """Line of element `index` of the top-level "data" list (only used to report errors)."""
    decoder = json.JSONDecoder()
    pos = text.find("[", text.find('"data"'))
    if pos < 0:
        return 1
    pos += 1
    for i in range(index + 1):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if i == index:
            return text.count("\n", 0, pos) + 1
        try:
            _, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
    return text.count("\n", 0, pos) + 1
