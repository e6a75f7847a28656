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


def post(store: dist.Store, board: str, seal: Callable[[str], bytes], *,
         count_key: str | None = None) -> int:
    """Claim the next free slot of `board` and fill it with `seal(slot_key)` (a record is
    sealed for its slot: `spotpipe.protocol.auth`); returns the slot's number. `count_key`
    (the mailbox's) is a hint of where to start (`hint`), kept by the writers; it may lag
    behind by the records of writers killed right after their claim."""
    index = hint(store, count_key) + 1 if count_key else 1
    while True:
        key = keys.board_slot(board, index)
        blob = seal(key)
        if store.compare_set(key, "", blob) == blob:
            break
        index += 1
    if count_key:
        _advance(store, count_key, index)
    return index


# what the count is compared with to read it: never a count, so the compare_set only reads
_PEEK = b"spotpipe: a peek"


def hint(store: dist.Store, count_key: str) -> int:
    """The highest slot a writer says it filled (0: none, or a count that is not one)."""
    return _number(_peek(store, count_key)) or 0


def _peek(store: dist.Store, count_key: str) -> bytes | None:
    """The count as the store holds it (None: missing). Read with a compare_set that cannot
    match rather than with `add`: the count is in the store unsealed, and a TCPStore server
    asked to add to a value that is not a number drops the asker's connection, so one write
    of "x" by anyone who reaches the store would cut every writer off from it. Nor with
    `get`, which blocks on a missing key."""
    raw = store.compare_set(count_key, _PEEK, _PEEK)
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    return None if raw == _PEEK else raw


def _number(raw: bytes | None) -> int | None:
    return int(raw) if raw is not None and raw.isdigit() and len(raw) <= 18 else None


def _advance(store: dist.Store, count_key: str, index: int) -> None:
    """Raise the count to `index` unless it is there already. A compare-and-set loop: first
    from `index` - 1 (the count when no other writer came between: one round trip), then
    from whatever the store says it holds, until the count is at `index` or past it. Under a
    burst of writers a single try would leave the count behind by every writer whose raise
    came second, and each later writer would try one filled slot more for each."""
    new = str(index).encode()
    expected = str(index - 1).encode()
    for _ in range(64):  # (a count that keeps changing under it past this is not a writer's)
        now = store.compare_set(count_key, expected, new)
        now = now.encode() if isinstance(now, str) else bytes(now)
        if now == new:
            return
        if now == expected:  # (c10d's answer for a missing key: create it)
            expected = b""
            continue
        count = _number(now)
        if count is not None and count >= index:
            return
        expected = now


def lower_hint(store: dist.Store, count_key: str, found: int, to: int) -> None:
    """Set the count to `to` if it still holds `found` (`mailbox.repair_count`)."""
    store.compare_set(count_key, str(found).encode(), str(to).encode())


def publish(store: dist.Store, channel: Channel, board: str, message: Message,
            generation: int = 0) -> int:
    return post(store, board, lambda key: channel.seal(message, generation, at=key))


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
            opened = channel.open(blob, at=key, **checks)  # type: ignore[arg-type]
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
