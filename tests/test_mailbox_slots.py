"""The mailbox's read slots are deleted once far behind its count (`store.mailbox.ReadSlots`),
and never one that a writer can still claim.

The references are the store's own: which slot keys exist (`check`), after records posted by
the writers' own code (`Outbox.post`) and read by the coordinator's (`read_mailbox`)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from spotpipe.protocol import Channel, Event, keys
from spotpipe.store import mailbox

KEY = b"k" * 32


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _post(store: dist.Store, n: int) -> None:
    outbox = mailbox.Outbox(store, Channel(KEY, "node0"), 0.0)
    for i in range(n):
        outbox.post(Event("e", "node0", float(i), {}))


def _read(store: dist.Store, n: int) -> None:
    records = mailbox.read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None)
    for _ in range(n):
        next(records)


def _present(store: dist.Store, last: int) -> list[int]:
    return [i for i in range(1, last + 1) if store.check([keys.mailbox_slot(i)])]


def test_read_slots_go_once_kept_slots_behind_the_count_a_batch_a_turn():
    store = _store()
    _post(store, 40)
    _read(store, 30)
    slots = mailbox.ReadSlots(store, kept=10, batch=8)
    assert slots.turn(30) == 8 and _present(store, 40) == list(range(9, 41))
    assert slots.turn(30) == 8 and _present(store, 40) == list(range(17, 41))
    assert slots.turn(30) == 4 and _present(store, 40) == list(range(21, 41))  # 30 - 10
    assert slots.turn(30) == 0
    # the next writer still finds its slot after the count, none of the deleted ones
    _post(store, 1)
    assert _present(store, 41) == list(range(21, 42))


def test_a_slot_is_not_deleted_past_a_count_that_lags_behind_the_reader():
    """A writer killed between its claim and raising the count leaves the count behind: the
    next writer starts at the count and would fill a deleted slot there (its record never
    read), so the count bounds what goes, not only what was read."""
    store = _store()
    _post(store, 20)
    # slots 21-25 filled by writers killed before they raised the count
    channel = Channel(KEY, "node1")
    for i in range(21, 26):
        key = keys.mailbox_slot(i)
        store.set(key, channel.seal(Event("e", "node1", 0.0, {}), 0, at=key))
    _read(store, 25)
    assert mailbox.posted(store) == 20
    slots = mailbox.ReadSlots(store, kept=10, batch=100)
    assert slots.turn(25) == 10  # up to 20 - 10, not 25 - 10
    assert _present(store, 25) == list(range(11, 26))


def test_a_successor_starts_where_its_predecessor_left_off():
    """A successor coordinator reads on from its books; the slots far behind them went with
    its predecessor's turns, and it does not walk them again from slot 1."""
    slots = mailbox.ReadSlots(dist.HashStore(), 100_000, kept=16384, batch=8)
    assert slots.deleted == 100_000 - 16384 - 8
    assert mailbox.ReadSlots(dist.HashStore(), 50).deleted == 0
