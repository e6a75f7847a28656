"""Records from workers, shadows and agents to the coordinator, through the store's mailbox.

The store lives in the launcher (or node agent), which is never preempted, so a record written
there survives the worker that wrote it. All records go into one numbered board (see
`spotpipe.store.board`), so the coordinator can block on "the next record" (no polling) and
sees them in the order they happened. Every record is a sealed `spotpipe.protocol` message:
JSON, never unpickled, and dropped with a `record_refused` event when it does not open.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from spotpipe.protocol import (Channel, CheckpointSaved, Event, Message, Opened, Refused,
                               ReplayGuard, StageUpload, keys)
from spotpipe.store import board
from spotpipe.store.waiting import wait


class Outbox:
    """A process's side of the mailbox: seal and post; never waits for the coordinator."""

    def __init__(self, store: dist.Store, channel: Channel, t0: float,
                 generation: Callable[[], int] = lambda: 0) -> None:
        self.store = store
        self.channel = channel
        self.t0 = t0
        self.generation = generation

    @property
    def node(self) -> str:
        return self.channel.writer

    def now(self) -> float:
        return round(time.time() - self.t0, 6)

    def post(self, message: Message) -> None:
        generation = self.generation()
        board.post(self.store, keys.MAILBOX,
                   lambda key: self.channel.seal(message, generation, at=key),
                   count_key=keys.MAILBOX_COUNT)

    def event(self, kind: str, **details: Any) -> None:
        if kind == "checkpoint_saved":  # a checkpoint record: the launcher commits on it
            iteration, stage = details.pop("iteration"), details.pop("stage")
            checksums, partition = details.pop("checksums"), details.pop("partition")
            self.post(CheckpointSaved(self.node, self.now(), iteration, stage, checksums,
                                      tuple((start, end) for start, end in partition),
                                      details))
            return
        if kind == "checkpoint_upload":  # a stage on its way: the launcher takes its pieces
            self.post(StageUpload(self.node, self.now(), details["iteration"], details["stage"],
                                  details["checksums"]))
            return
        self.post(Event(kind, self.node, self.now(), finite(details)))


def finite(value: Any) -> Any:
    """`value` with every non-finite float as None: JSON has no NaN, and a record that a
    reader refuses is a record lost (an event may well carry a NaN loss)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def read_mailbox(store: dist.Store, channel: Channel,
                 on_refused: Callable[[Refused], None],
                 timeout_s: float | None = None, *, start: int = 1,
                 tombstone: bool = True) -> Iterator[Opened]:
    """Yield the mailbox's records in order as they arrive from slot `start` on, blocking
    between them; a record that does not open (no key, malformed, a replay) goes to
    `on_refused` instead.

    Give it a store client of its own: a client blocked in wait() cannot serve other calls.
    Each slot is overwritten once read (a tombstone, not a deletion: see `board.post`), unless
    `tombstone` is False: then the reader's owner marks slots (`mark_read`) once it has kept
    what they changed, so that a successor can read them again."""
    guard = ReplayGuard()
    index = start - 1
    while True:
        index += 1
        key = keys.mailbox_slot(index)
        wait(store, [key], timeout_s)  # (None: as long as the job runs)
        blob = store.get(key)
        if tombstone:
            store.set(key, board.READ)
        try:
            opened = channel.open(blob, at=key, guard=guard)
        except Refused as why:
            on_refused(why)
            continue
        yield opened


def read_marks(first: int, last: int) -> tuple[list[str], list[bytes]]:
    """The keys and values that mark mailbox slots `first`..`last` read (for a multi_set)."""
    slots = [keys.mailbox_slot(i) for i in range(first, last + 1)]
    return slots, [board.READ] * len(slots)


def posted(store: dist.Store) -> int:
    """How many records writers say they posted (a hint: see `board.post`)."""
    return board.hint(store, keys.MAILBOX_COUNT)


def repair_count(store: dist.Store, awaited: int) -> int | None:
    """Put the count back to `awaited` - 1 if it says slot `awaited` (the one the reader
    waits on) was filled while the slot is empty; returns the count found then (None: it was
    sound). Writers fill a slot before they raise the count past it, so this is someone
    without the job's key who moved the count ahead: every writer would post beyond the
    slot the reader waits on, and the coordinator hear nothing again. Records posted at the
    moved count before the repair stay there, unread."""
    count = posted(store)  # (first: a slot filled before the count was raised past it)
    if count < awaited or slot_written(store, awaited):
        return None
    board.lower_hint(store, keys.MAILBOX_COUNT, count, awaited - 1)
    return count


def slot_written(store: dist.Store, index: int) -> bool:
    return store.check([keys.mailbox_slot(index)])


# read slots kept behind the mailbox's count before they are deleted (`ReadSlots`)
KEPT_READ = 16384


class ReadSlots:
    """Deletes the mailbox's read slots once they are `kept` slots behind its count, so that
    the store holds at most that many of them however long the job runs (they were kept for
    its whole life: about 5 a training iteration at P = 2 x D = 2).

    Not as soon as they are read: a writer reads the count, then claims the first free slot
    after it (`board.post`), and one held up between the two would fill a deleted slot the
    reader has passed, its record lost unread. `kept` records behind, that takes a writer held
    up while the job's other writers posted 16,384 records: minutes of training at the
    fastest, and a worker whose training stalls that long is fenced as hung. A few slots a
    turn (`batch`): the coordinator's turns are its recovery's latency."""

    def __init__(self, store: dist.Store, read: int = 0, *, kept: int | None = None,
                 batch: int = 8) -> None:
        """`read`: the slots read when this reader starts (a successor's books): its
        predecessor deleted those up to about `kept` (default `KEPT_READ`) before them."""
        self.store, self.batch = store, batch
        self.kept = KEPT_READ if kept is None else kept
        self.deleted = max(0, read - self.kept - batch)  # every slot up to it is gone

    def turn(self, read: int) -> int:
        """Slots up to `read` are read (and in the books, for a loop that keeps some):
        delete the next few that may go; how many."""
        if read - self.kept <= self.deleted:
            return 0  # (no round trip: the usual case)
        # the count, not only `read`: it lags by a writer killed after its claim, and a slot
        # is deleted only where every writer starts past it
        upto = min(min(read, posted(self.store)) - self.kept, self.deleted + self.batch)
        if upto <= self.deleted:
            return 0
        names = [keys.mailbox_slot(i) for i in range(self.deleted + 1, upto + 1)]
        delete_many = getattr(self.store, "delete_keys", None)  # (etcd: one transaction)
        if delete_many is not None:
            delete_many(names)
        else:
            for name in names:
                self.store.delete_key(name)
        self.deleted = upto
        return len(names)
