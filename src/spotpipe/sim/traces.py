"""Preemption traces: three public formats normalised into one event model.

Every format becomes a `Trace`: a time-sorted tuple of (time_s, "add"|"remove", node). The
simulator only ever sees that model, so a new format needs only a loader. Loaders validate as
they read, because a silently wrong trace gives a confidently wrong prediction: each error is a
`TraceError` naming the file, the line and what was wrong.

Formats (see shared/traces/README.md):
- event CSV `delta_ms,add|remove,node` (Bamboo's AWS traces);
- tick series JSON `{"metadata": {"gap_seconds": N}, "data": [n0, n1, ...]}` (spot-traces);
- dated count series `YYYY-MM-DD, HH:MM:SS, n` (Bamboo's GCP traces).
Count series carry no node identities: nodes get generated names, and when the count drops
the longest-held nodes leave first (a count says nothing about which; oldest-first is a fixed,
documented choice that does not favour keeping the original pipeline intact).
"""

from __future__ import annotations

import bisect
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Iterable, NamedTuple

ADD = "add"
REMOVE = "remove"


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
                 duration_s: float | None = None) -> None:
        self.events: tuple[Event, ...] = tuple(events)
        self.name = name
        last = self.events[-1].time_s if self.events else 0.0
        self.duration_s = float(duration_s) if duration_s is not None else last
        self._times: list[float] = []
        self._counts: list[int] = []
        n = 0
        for ev in self.events:
            n += 1 if ev.kind == ADD else -1
            if self._times and self._times[-1] == ev.time_s:
                self._counts[-1] = n
            else:
                self._times.append(ev.time_s)
                self._counts.append(n)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self.events)} events, {self.duration_s:.0f} s)"

    def nodes_available_at(self, t: float) -> int:
        """How many nodes the trace offers at time t (events at t already applied)."""
        i = bisect.bisect_right(self._times, t)
        return self._counts[i - 1] if i else 0

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
        return list(self._times), list(self._counts)

    @property
    def peak_nodes(self) -> int:
        return max(self._counts, default=0)

    @property
    def removals(self) -> int:
        return sum(1 for ev in self.events if ev.kind == REMOVE)


# -- loaders ------------------------------------------------------------------------------

def load_trace(path: str | Path) -> Trace:
    """Load any supported format, chosen by content (JSON object, dated lines, or events)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(str(path), 0, f"cannot read: {exc.strerror or exc}") from None
    head = text.lstrip()
    if head.startswith("{"):
        return parse_tick_json(text, str(path))
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first.split(",")[0].strip().count("-") == 2:
        return parse_dated_series(text, str(path))
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
    return Trace(events, Path(source).name)


def parse_tick_json(text: str, source: str = "<string>") -> Trace:
    """`{"metadata": {"gap_seconds": N}, "data": [n0, n1, ...]}`: count n_i from i*N."""
    try:
        raw = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise TraceError(source, exc.lineno, f"invalid JSON: {exc.msg}") from None
    except _NonFinite as exc:
        raise TraceError(source, _line_of(text, exc.args[0]),
                         f"{exc.args[0]} is not a finite number") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise TraceError(source, 1, "expected an object with 'metadata' and 'data'")
    gap = raw["metadata"].get("gap_seconds")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap > 0:
        raise TraceError(source, _line_of(text, '"gap_seconds"'),
                         f"metadata.gap_seconds must be a positive number, got {gap!r}")
    data = raw.get("data")
    if not isinstance(data, list):
        raise TraceError(source, _line_of(text, '"data"'), "'data' must be a list of counts")
    counts = []
    for i, n in enumerate(data):
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0 or n != int(n):
            raise TraceError(source, _element_line(text, i),
                             f"data[{i}] must be a non-negative whole count, got {n!r}")
        counts.append(int(n))
    times = [i * float(gap) for i in range(len(counts))]
    return counts_to_trace(times, counts, Path(source).name, len(counts) * float(gap))


def parse_dated_series(text: str, source: str = "<string>") -> Trace:
    """`YYYY-MM-DD, HH:MM:SS, n` lines; times relative to the first line."""
    times: list[float] = []
    counts: list[int] = []
    start: datetime | None = None
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
        n = _number(parts[2], source, lineno, "instance count")
        if n < 0 or n != int(n):
            raise TraceError(source, lineno, f"instance count must be a non-negative whole "
                                             f"number, got {parts[2]!r}")
        start = start or when
        t = (when - start).total_seconds()
        if times and t < times[-1]:
            raise TraceError(source, lineno, f"time goes backwards: {parts[0]} {parts[1]}")
        times.append(t)
        counts.append(int(n))
    if not times:
        raise TraceError(source, 1, "no data lines")
    return counts_to_trace(times, counts, Path(source).name)


def counts_to_trace(times: list[float], counts: list[int], name: str,
                    duration_s: float | None = None) -> Trace:
    """Turn a count series into add/remove events; the oldest nodes leave first."""
    events: list[Event] = []
    live: list[str] = []  # oldest first
    next_id = 0
    for t, n in zip(times, counts):
        while len(live) < n:
            node = f"n{next_id}"
            next_id += 1
            live.append(node)
            events.append(Event(t, ADD, node))
        while len(live) > n:
            events.append(Event(t, REMOVE, live.pop(0)))
    return Trace(events, name, duration_s)


# -- helpers ------------------------------------------------------------------------------

class _NonFinite(ValueError):
    """NaN or Infinity in a JSON trace (Python's json reads them by default)."""


def _refuse_constant(name: str) -> float:
    raise _NonFinite(name)


def _number(text: str, source: str, lineno: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(source, lineno, f"bad number for {what}: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(source, lineno, f"{what} must be a finite non-negative number, "
                                         f"got {text!r}")
    return value


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
