"""Which nodes are dead or hung, judged on the coordinator's own clock.

A heartbeat carries no time. The coordinator notes when it first sees each new beat (a new
sequence number from the node's writer) on its own monotonic clock, so the age of a node's
newest beat is the time since it arrived here: clock skew between hosts cannot fence a
healthy node, nor hide a dead one. A beat that does not open under the job's key, or an older
beat written back (a replay), is refused and changes nothing.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from spotpipe.protocol import Channel, Heartbeat, Refused, keys


# arrivals kept per node, one per heartbeat check that found a new beat: while the store is
# slow those checks are over half a heartbeat timeout apart, so this spans many timeouts (one
# dropped only delays `outpaced`'s verdict, never hastens it)
ARRIVALS_KEPT = 64


@dataclass
class _Seen:
    incarnation: str
    seq: int
    at: float  # when the newest beat arrived (coordinator's monotonic clock)
    beat: Heartbeat
    progress: tuple[int, int, int, str] = (-1, -1, 0, "")
    since: float = 0.0  # when its progress last changed (or it last waited)
    # when its recent beats arrived, on the same clock but never restarted: the evidence, while
    # the store is slow, that the store took this node's beats in (`Liveness.outpaced`)
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVALS_KEPT))


@dataclass
class Liveness:
    store: dist.Store
    channel: Channel
    refused: Callable[[str, str], None]  # (writer, reason)
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def restart_clocks(self) -> None:
        """The store was away: beats could not arrive meanwhile, which says nothing about the
        nodes; judge them afresh from now."""
        now = self.clock()
        for seen in self._seen.values():
            seen.at = seen.since = now

    def read(self, node: str) -> _Seen | None:
        """Take in `node`'s current beat; its record as seen here, or None before its first."""
        key = keys.heartbeat(node)
        seen = self._seen.get(node)
        if not self.store.check([key]):
            return seen
        try:
            opened = self.channel.open(self.store.get(key), at=key, expect=Heartbeat,
                                       writers={node})
        except Refused as why:
            self.refused(why.writer, f"heartbeat: {why.reason}")
            return seen
        sealed, beat = opened.sealed, opened.message
        assert isinstance(beat, Heartbeat)
        now = self.clock()
        if seen is None or seen.incarnation != sealed.incarnation:
            # a first beat, or a new process under this node's name (a node that came back)
            self._seen[node] = seen = _Seen(sealed.incarnation, sealed.seq, now, beat,
                                            _progress(beat), now)
            seen.arrivals.append(now)
            return seen
        if sealed.seq < seen.seq:
            self.refused(node, f"heartbeat: a replay (sequence number {sealed.seq} after "
                               f"{seen.seq})")
            return seen
        if sealed.seq == seen.seq:
            return seen
        seen.seq, seen.at, seen.beat = sealed.seq, now, beat
        seen.arrivals.append(now)
        progress = _progress(beat)
        if progress != seen.progress or beat.state != "busy":
            seen.progress, seen.since = progress, now
        return seen

    def verdict(self, node: str, heartbeat_timeout_s: float, hang_timeout_s: float) -> str | None:
        """Why `node` must be fenced, or None."""
        seen = self.read(node)
        if seen is None:
            return None
        now = self.clock()
        age = now - seen.at
        if age > heartbeat_timeout_s:
            return f"no heartbeat for {age:.1f} s"
        # only a node whose newest beat says it computes can be hung: one whose beats stopped
        # while it waited or finished (its host lost, or its process gone with its exit on
        # its way) is judged by their age alone, as silent, whichever timeout is shorter
        if seen.beat.state == "busy" and now - seen.since > hang_timeout_s:
            return hung(now - seen.since, seen.beat.iteration, seen.beat.position,
                        seen.beat.step)
        return None

    def outpaced(self, node: str, heartbeat_timeout_s: float,
                 since: float = 0.0) -> str | None:
        """Why `node` must be fenced while the store is too slow to judge beats by their age
        (the coordinator restarts every clock then, `restart_clocks`), or None. `since`: when
        the store began to answer, slowly (the coordinator's second late check in a row).

        A slow store still takes beats in, only late. So a node is silent, not delayed, when
        other nodes' beats kept arriving for longer than the heartbeat timeout after its own
        newest one and after `since`: the store demonstrably took writes all that while, and
        none of its. Before, a store that stayed slower than half the heartbeat timeout
        suspended the fencing of silent nodes for as long as it stayed slow. The window starts
        at the first beat that arrived after both, so neither an outage before `since` nor a
        node's own backoff from it counts against the node. With no other node beating there
        is no evidence, and nothing is judged."""
        seen = self._seen.get(node)
        if seen is None or not seen.arrivals:
            return None
        last = max(seen.arrivals[-1], since)
        first_after: float | None = None
        newest = last
        for other, o in self._seen.items():
            if other == node or not o.arrivals or o.arrivals[-1] <= last:
                continue
            # (a node's arrivals are in order; with older ones dropped, its first kept arrival
            # after `last` comes no earlier than its true first one: the window only shrinks)
            after = o.arrivals[bisect.bisect_right(o.arrivals, last)]
            first_after = after if first_after is None else min(first_after, after)
            newest = max(newest, o.arrivals[-1])
        if first_after is None or newest - first_after <= heartbeat_timeout_s:
            return None
        return (f"no heartbeat for {self.clock() - seen.arrivals[-1]:.1f} s while the store "
                f"was slow, though other nodes' beats arrived for {newest - first_after:.1f} s "
                f"of it")


@dataclass
class StoreWatch:
    """Whether the store answers the coordinator's heartbeat checks in time: what says when
    beats may be judged by their age at all. A check answered more than half the heartbeat
    timeout late means the store was away (etcd restarting) or is slow: beats could not
    arrive meanwhile, so for one timeout after it none is judged by its age (the grace). From
    the second late check in a row the store is answering, slowly (`slow_since`: when that
    check began), and a silent node is judged by the other nodes' beats instead
    (`Liveness.outpaced`); one late check alone is an outage, after which each node's store
    client comes back on its own backoff, and no beats landed during it to tell anything."""

    heartbeat_timeout_s: float
    grace_until: float = 0.0
    late_in_a_row: int = 0
    slow_since: float = 0.0

    def answered(self, before: float, now: float) -> bool:
        """A check that began at `before` was answered at `now`: whether it came late."""
        if now - before <= self.heartbeat_timeout_s / 2:
            self.late_in_a_row = 0
            return False
        self.grace_until = now + self.heartbeat_timeout_s
        self.late_in_a_row += 1
        if self.late_in_a_row == 2:
            self.slow_since = before
        return True

    def in_grace(self, now: float) -> bool:
        return now < self.grace_until

    @property
    def slow(self) -> bool:
        return self.late_in_a_row >= 2


def _progress(beat: Heartbeat) -> tuple[int, int, int, str]:
    return (beat.generation, beat.iteration, beat.position, beat.step)


def hung(still_s: float, iteration: int, position: int, step: str = "") -> str:
    """Why a node is fenced as hung (the beats' judgement and the node's own `Stalled`); `step`:
    where between instructions (carrying out a Decision, `runtime.activity`)."""
    if step:
        return f"hung: no progress for {still_s:.1f} s {step} (the job at iteration {iteration})"
    return f"hung: no progress for {still_s:.1f} s at iteration {iteration}, instruction {position}"
