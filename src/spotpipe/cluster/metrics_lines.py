"""metrics.jsonl's lines: one per committed iteration, in order, whatever failures took.

Pipeline 0's last stage posts each committed iteration's `Metrics`. A failure can take a
record with it while the iteration stands; the agreement that follows knows, from its reports,
what the record would have said (`recovered_metrics`). This keeps the two apart until the gap
shows: a line made at the agreement is written only once the record of a later iteration
arrives (or the job ends), since the real record may still be on its way and wins. A record
of an iteration already written (a replay's, or a node counted out) is refused, naming it.

The loop that owns the files decides what a written line does (the progress bar, standby
released at the last iteration); this holds only the order and what a successor needs of it
(`books`, `restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spotpipe.cluster.coordinator import Agreed
from spotpipe.cluster.recovered_metrics import recovered_metrics
from spotpipe.config import Config
from spotpipe.plan.layout import Layout
from spotpipe.protocol import CoordinatorState, Metrics

Line = dict[str, Any]


class MetricsLines:
    def __init__(self, cfg: Config, first: int, *, write: Callable[[Line], None],
                 event: Callable[[Line], None], refused: Callable[[str, str], None],
                 now: Callable[[], float], current: Callable[[], tuple[int, Layout]]) -> None:
        """`first`: the job's first iteration (a resumed checkpoint's next): no line is made
        below it. `write` writes a line, `event` an event, `refused` tells of a record refused
        (writer, reason); `current`: the coordinator's generation and layout now."""
        self.cfg, self.first = cfg, first
        self.write, self.event, self.refused, self.now, self.current = (write, event, refused,
                                                                         now, current)
        self.last: Line | None = None  # the newest line written
        # lines of committed iterations whose records a failure took, made at the agreement
        # and written once the gap shows, by iteration
        self.recovered: dict[int, Line] = {}

    def next_line(self) -> int:
        """The iteration whose line comes next."""
        return self.last["iter"] + 1 if self.last is not None else self.first

    def posted(self, message: Metrics, writer: str) -> None:
        """A Metrics record read from the mailbox."""
        if self.last is not None and message.iter <= self.last["iter"]:
            # the iteration run again: its poster committed it alone and was lost, and the
            # survivors replayed it (to the same figures); or a record of a node counted out
            # (cut off), later than the line written for it (`fill_to`)
            self.refused(writer, f"metrics of iteration {message.iter} (generation "
                                 f"{message.generation}), which metrics.jsonl has already")
            return
        self.fill_to(message.iter)
        self._write(message.to_json())

    def agreed(self, agreed: Agreed) -> None:
        """Make the lines of the iterations the agreement counts committed that no record has
        brought yet, from its reports. The first agreement that covers an iteration makes its
        line: a later one (a second failure during the recovery) has another layout, whose
        last stages do not hold its loss."""
        now = self.now()
        for t in range(self.next_line(), agreed.resume):
            if t not in self.recovered:
                self.recovered[t] = recovered_metrics(
                    self.cfg, t, generation=agreed.generation, layout=agreed.layout,
                    reports=agreed.reports, previous=self.recovered.get(t - 1, self.last),
                    now=now)

    def fill_to(self, upto: int) -> None:
        """Write the lines of the iterations before `upto` that no record brought, once the
        gap shows (at the record of `upto`, or at the job's end): an iteration's record may
        still be on its way at the agreement (a lost poster's exit comes from its supervisor,
        outside the mailbox, and can complete the agreement before the poster's last record
        is read), but not after the resumed iteration's record, posted after the agreement.
        The real record wins over the agreement's line."""
        for t in range(self.next_line(), upto):
            line = self.recovered.pop(t, None)
            if line is None:  # no agreement here covers it (a successor's whose predecessor
                # agreed after its last books): what is known without the reports
                generation, layout = self.current()
                line = recovered_metrics(self.cfg, t, generation=generation, layout=layout,
                                         reports={}, previous=self.last, now=self.now())
            self.event({"time_s": self.now(), "kind": "metrics_recovered", "node": "launcher",
                        "iteration": t, "loss_known": line["loss"] is not None,
                        "generation": line["generation"]})
            self._write(line)
        for t in [t for t in self.recovered if t <= upto]:
            del self.recovered[t]

    def drain(self) -> None:
        """The lines still held: the last iterations', if a failure took them (the job's
        end, after its last records)."""
        if self.recovered:
            self.fill_to(max(self.recovered) + 1)

    def books(self) -> dict[str, Any]:
        """What a successor needs (`CoordinatorState`'s fields of it)."""
        return {"last_metrics": self.last,
                "recovered_lines": tuple(self.recovered[t] for t in sorted(self.recovered)),
                "first_iteration": self.first}

    def restore(self, state: CoordinatorState) -> None:
        self.last = state.last_metrics
        self.recovered = {int(line["iter"]): dict(line) for line in state.recovered_lines}
        self.first = state.first_iteration  # (a successor is given no checkpoint to resume)

    def _write(self, line: Line) -> None:
        self.write(line)
        self.last = line
