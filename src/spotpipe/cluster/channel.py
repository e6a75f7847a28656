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


class WorkerChannel:
    """The worker's side: publish a record; never waits for the launcher."""

    def __init__(self, store: dist.Store, node: str, t0: float) -> None:
        self.store = store
        self.node = node
        self.t0 = t0

    def now(self) -> float:
        return round(time.time() - self.t0, 6)

    def _post(self, record: dict[str, Any]) -> None:
        index = self.store.add(f"{MAILBOX}/count", 1)
        self.store.set(f"{MAILBOX}/{index}", json.dumps(record))

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
        store.delete_key(key)
        yield record
