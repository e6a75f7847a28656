"""The mailbox from workers to the coordinator survives writers killed at any instruction, and
drops what does not open under the job's key."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from spotpipe.protocol import Channel, Event, job_key, keys
from spotpipe.store.mailbox import Outbox, read_mailbox

KEY = job_key(b"sesame", "instance-1")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _n(opened) -> int:
    return opened.message.details["n"]


def test_a_writer_killed_after_its_claim_leaves_no_hole():
    store = _store()
    writer = Channel(KEY, "node0")
    # a writer filled slot 1 and was killed before it counted it
    store.compare_set(keys.mailbox_slot(1), "", writer.seal(Event("e", "node0", 0.0, {"n": 1})))
    Outbox(store, writer, 0.0).event("e", n=2)
    records = read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None, timeout_s=5)
    assert [_n(next(records)), _n(next(records))] == [1, 2]


def test_slots_already_read_are_never_claimed_again():
    store = _store()
    outbox = Outbox(store, Channel(KEY, "node0"), 0.0)
    for n in range(3):
        outbox.event("e", n=n)
    records = read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None, timeout_s=5)
    assert [_n(next(records)) for _ in range(3)] == [0, 1, 2]
    # the count lags (as after a writer killed between its claim and its count): the next
    # writer starts low, finds the slots read and tombstoned, and moves past them
    store.add(keys.MAILBOX_COUNT, -2)
    outbox.event("e", n=3)
    assert _n(next(records)) == 3


def test_forged_malformed_and_replayed_records_are_dropped_not_fatal():
    store = _store()
    outbox = Outbox(store, Channel(KEY, "node0"), 0.0)
    stranger = Outbox(store, Channel(job_key(b"guess", "instance-1"), "node0"), 0.0)
    outbox.event("e", n=1)
    stranger.event("e", n=666)  # the wrong key
    store.compare_set(keys.mailbox_slot(3), "", b'{"type": "exit"}')  # no seal, no type check
    store.compare_set(keys.mailbox_slot(4), "", b"\xff\xfe not json")
    first = store.get(keys.mailbox_slot(1))
    store.compare_set(keys.mailbox_slot(5), "", first)  # a valid record, replayed
    store.add(keys.MAILBOX_COUNT, 3)
    outbox.event("e", n=2)
    refused = []
    records = read_mailbox(store, Channel(KEY, "coordinator"), refused.append, timeout_s=5)
    assert [_n(next(records)), _n(next(records))] == [1, 2]
    reasons = [why.reason for why in refused]
    assert len(reasons) == 4, reasons
    assert "bad MAC" in reasons[0] and "no MAC" in reasons[1]
    assert "not a JSON record" in reasons[2] and "replay" in reasons[3]
