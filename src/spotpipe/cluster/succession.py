"""The coordinator's books as plain data, so that a successor can take over from the store.

The coordinator of an agent job runs on one of the job's hosts, and a spot host can be lost
like any other. Everything a successor needs is then in the store: the generation's boards
(aborts, decisions, regroups, answers), the workers' records not yet taken in (the mailbox
from the cursor on), heartbeats, and what lived only in the coordinator's memory: the plan
history, who is dead, fenced, finished, leaving or waiting to join, the agreement in progress
with the reports it has, the last metrics, checkpoints half committed, the agents admitted.
That last part is written as one sealed `CoordinatorState` per turn (`JobLoop._persist`);
this module turns the live objects into its fields and back. The plan's own types stay
where they are defined (`plan.Layout.to_json`, `protocol.Report`): only the History, which
has no wire form of its own, is spelled here.
"""

from __future__ import annotations

from typing import Any

from spotpipe.plan import Layout
from spotpipe.plan.recovery import History


def _partition(rows: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in rows)


def history_to_json(h: History) -> dict[str, Any]:
    """The recovery history (the `next_choice` cache is left out: it is recomputed)."""
    return {"layout": h.layout.to_json(), "partition": [list(r) for r in h.partition],
            "generation": h.generation,
            "before": None if h.before is None else
            {"layout": h.before[0].to_json(), "partition": [list(r) for r in h.before[1]]},
            "resumed_at": h.resumed_at, "futile": h.futile,
            "lost_before": sorted(h.lost_before),
            "repartition_refused": h.repartition_refused}


def history_from_json(data: dict[str, Any]) -> History:
    before = data.get("before")
    return History(
        Layout.from_json(data["layout"]), _partition(data["partition"]),
        generation=int(data["generation"]),
        before=None if before is None else (Layout.from_json(before["layout"]),
                                            _partition(before["partition"])),
        resumed_at=int(data["resumed_at"]), futile=int(data["futile"]),
        lost_before=frozenset(str(n) for n in data["lost_before"]),
        repartition_refused=data.get("repartition_refused"))


def partitions_to_json(parts: dict[int, tuple[tuple[int, int], ...]]) -> dict[str, Any]:
    """Partitions computed for other depths: a successor must use the same ones (profiling
    is noisy; every node of a re-partition must get the same ranges)."""
    return {str(depth): [list(r) for r in rows] for depth, rows in sorted(parts.items())}


def partitions_from_json(data: dict[str, Any]) -> dict[int, tuple[tuple[int, int], ...]]:
    return {int(depth): _partition(rows) for depth, rows in data.items()}
