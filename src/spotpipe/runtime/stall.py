"""A node's own hang detector: its main thread computing at one instruction, never waiting,
for the hang timeout.

The coordinator also judges hangs, from heartbeats, but only as finely as it sees them: a
beat shows a stall up to one beat period after it began, and the coordinator reads beats once
per check, so a hang was acted on up to two beat periods late (a 2 s timeout became 2.2-2.5 s
in `spotpipe bench chaos`). The node knows to the instant when its instruction began (the
executor stamps each one) and when its last wait on a peer ended (the comm's waiter stamps
that), so it can tell at the timeout itself, on its own clock (a duration: no clock is
compared across hosts). Its report goes through the mailbox, which the coordinator reads as
records arrive. A stall only ever counts from the later of those stamps and the last time the
watch saw the node not busy, so it is never longer than the real one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Still:
    """Where the main thread is, and since when (monotonic seconds) nothing has changed there:
    the instruction (or the `step` between instructions, `runtime.activity`) began, or its last
    wait on a peer ended."""

    generation: int
    iteration: int
    position: int
    since: float
    step: str = ""


class StallWatch:
    """Looks at the node's progress when `look` is called (by the heartbeat's thread) and
    reports a stall of `timeout_s` once; `look` says when it wants to look again, so the
    report goes at the timeout, not at the next beat."""

    def __init__(self, timeout_s: float, poll_s: float, snapshot: Callable[[], Still | None],
                 report: Callable[[Still, float], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.snapshot, self.report, self.clock = snapshot, report, clock
        self._calm_at = -math.inf  # the last look that found the node not busy
        self._reported: Still | None = None

    def look(self) -> float:
        """Seconds until the next look is due."""
        now = self.clock()
        still = self.snapshot()  # None: waiting on something, or not computing at all
        if still is None:
            self._calm_at = now
            return self.poll_s
        if still.since < self._calm_at:
            still = Still(still.generation, still.iteration, still.position, self._calm_at,
                          still.step)
        due = still.since + self.timeout_s - now
        if due > 0:
            return min(self.poll_s, due)
        if still != self._reported:
            self.report(still, now - still.since)  # may raise (store away): tried again next look
            self._reported = still
        return self.poll_s
