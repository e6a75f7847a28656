"""The mailbox from workers to the launcher survives writers killed at any instruction."""

from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from spotpipe.cluster.channel import MAILBOX, WorkerChannel, read_mailbox


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def test_a_writer_killed_after_its_claim_leaves_no_hole():
    store = _store()
    # a writer filled slot 1 and was killed before it counted it
    store.compare_set(f"{MAILBOX}/1", "", json.dumps({"type": "event", "n": 1}))
    WorkerChannel(store, "node0", 0.0)._post({"type": "event", "n": 2})
    records = read_mailbox(store, timeout_s=5)
    assert [next(records)["n"], next(records)["n"]] == [1, 2]


def test_slots_already_read_are_never_claimed_again():
    store = _store()
    channel = WorkerChannel(store, "node0", 0.0)
    for n in range(3):
        channel._post({"type": "event", "n": n})
    records = read_mailbox(store, timeout_s=5)
    assert [next(records)["n"] for _ in range(3)] == [0, 1, 2]
    # the count lags (as after a writer killed between its claim and its count): the next
    # writer starts low, finds the slots read and tombstoned, and moves past them
    store.add(f"{MAILBOX}/count", -2)
    channel._post({"type": "event", "n": 3})
    assert next(records)["n"] == 3
