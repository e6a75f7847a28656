"""Append-only boards of sealed records in the store: the mailbox, decisions, aborts, answers.

A board is a run of numbered slots under one key. A writer claims the first free slot with
one atomic compare_set, so a record is either whole in its slot or absent, whatever instant
the writer is killed at (preemption kills processes at any instruction), and no one can
take a slot away from a later writer: a forged record fills one slot, the real one the next.
A reader goes through the slots in order and skips what does not open under the job's key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch.distributed as dist

from spotpipe.protocol import Channel, Message, Opened, Refused, keys
from spotpipe.store.waiting import wait

READ = b"."  # what a mailbox slot holds once read: not empty, so no writer can claim it again


def post(store: dist.Store, board: str, blob: bytes, *, count_key: str | None = None) -> int:
    """Claim the next free slot of `board` and fill it; returns the slot's number. `count_key`
    (the mailbox's) is a hint of where to start, kept by the writers; it may lag behind by
    the records of writers killed right after their claim."""
    index = (store.add(count_key, 0) if count_key else 0) + 1
    while store.compare_set(keys.board_slot(board, index), "", blob) != blob:
        index += 1
    if count_key:
        store.add(count_key, 1)
    return index


def publish(store: dist.Store, channel: Channel, board: str, message: Message,
            generation: int = 0) -> int:
    return post(store, board, channel.seal(message, generation))


def read(store: dist.Store, board: str, channel: Channel, *,
         on_refused: Callable[[Refused, int], None], start: int = 1,
         timeout_s: float | None = None, **checks: object) -> Iterator[tuple[int, Opened]]:
    """Yield (slot, record) for every slot that opens, in order, blocking between slots (up
    to `timeout_s` for each; None: as long as the job runs, `spotpipe.store.waiting`).

    Give it a store client of its own: a client blocked in wait() cannot serve other calls.
    `checks` go to `Channel.open` (expect, guard, min_generation, writers)."""
    index = start - 1
    while True:
        index += 1
        key = keys.board_slot(board, index)
        wait(store, [key], timeout_s)
        blob = store.get(key)
        if blob == READ:
            continue
        try:
            opened = channel.open(blob, **checks)  # type: ignore[arg-type]
        except Refused as why:
            on_refused(why, index)
            continue
        yield index, opened


def first(store: dist.Store, board: str, channel: Channel, *,
          on_refused: Callable[[Refused, int], None], timeout_s: float,
          **checks: object) -> Opened:
    """The first record of `board` that opens (blocks until there is one)."""
    for _, opened in read(store, board, channel, on_refused=on_refused, timeout_s=timeout_s,
                          **checks):
        return opened
    raise AssertionError("unreachable")
