"""Metrics and events from workers to the launcher, through the rendezvous store.

The store lives in the launcher (or node agent), which is never preempted, so a record written
there survives the worker that wrote them. All records go into one numbered mailbox, so the
launcher can block on "the next record" (no polling) and sees them in the order they happened.
Records are JSON: nothing crossing a process boundary is unpickled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

MAILBOX = "spotpipe/mail"
COUNT = f"{MAILBOX}/count"
_READ = b"."  # what a slot holds once read: not empty, so no writer can claim it again


class WorkerChannel:
    """The worker's side: publish a record; never waits for the launcher."""

    def __init__(self, store: dist.Store, node: str, t0: float) -> None:
        self.store = store
        self.node = node
        self.t0 = t0

    def now(self) -> float:
        return round(time.time() - self.t0, 6)

    def _post(self, record: dict[str, Any]) -> None:
        """Claim the next free slot and fill it in one atomic store operation.

        Taking a number first and writing the slot second would leave a hole, and stall the
        reader forever, whenever a worker is killed between the two; preemption kills workers
        at any instruction. compare_set writes only a slot that was never written, so a
        record is either whole in its slot or absent. The count is a hint of where to start
        (it may lag behind by the records of writers killed right after their claim)."""
        blob = json.dumps(record).encode()
        index = self.store.add(COUNT, 0) + 1
        while self.store.compare_set(f"{MAILBOX}/{index}", "", blob) != blob:
            index += 1
        self.store.add(COUNT, 1)

    def event(self, kind: str, **details: Any) -> None:
        self._post({"type": "event", "time_s": self.now(), "kind": kind, "node": self.node,
                    **details})

    def metrics(self, record: dict[str, Any]) -> None:
        self._post({"type": "metrics", **record})


def read_mailbox(store: dist.Store, timeout_s: float = 86400.0) -> Iterator[dict[str, Any]]:
    """Yield records in order as they arrive; blocks on the store between records.

    Give it a store client of its own: a client blocked in wait() cannot serve other calls.
    """
    index = 0
    while True:
        index += 1
        key = f"{MAILBOX}/{index}"
        store.wait([key], timedelta(seconds=timeout_s))
        record = json.loads(store.get(key))
        store.set(key, _READ)  # a tombstone, not a deletion: see WorkerChannel._post
        yield record
