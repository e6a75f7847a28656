"""The mailbox from workers to the coordinator survives writers killed at any instruction, and
drops what does not open under the job's key."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from spotpipe.protocol import Channel, DecisionRecord, Event, job_key, keys
from spotpipe.store import board, mailbox
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
    slot = keys.mailbox_slot(1)
    store.compare_set(slot, "", writer.seal(Event("e", "node0", 0.0, {"n": 1}), at=slot))
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
    store.compare_set(keys.mailbox_slot(5), "", first)  # a valid record, copied to a new slot
    store.add(keys.MAILBOX_COUNT, 3)
    outbox.event("e", n=2)
    refused = []
    records = read_mailbox(store, Channel(KEY, "coordinator"), refused.append, timeout_s=5)
    assert [_n(next(records)), _n(next(records))] == [1, 2]
    reasons = [why.reason for why in refused]
    assert len(reasons) == 4, reasons
    assert "bad MAC" in reasons[0] and "no MAC" in reasons[1]
    assert "not a JSON record" in reasons[2] and "a copy" in reasons[3]


def test_a_count_that_is_not_a_number_cuts_no_writer_off():
    """The count is unsealed: anyone who reaches the store can write "x" there. A TCPStore
    server asked to add to it drops the asker's connection (checked first, so that the test
    fails if torch changes and the guard is no longer needed)."""
    store = _store()
    store.set(keys.MAILBOX_COUNT, "x")
    asker = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                          timeout=timedelta(seconds=10))
    with pytest.raises(dist.DistNetworkError):
        asker.add(keys.MAILBOX_COUNT, 1)
    outbox = Outbox(store, Channel(KEY, "node0"), 0.0)
    for n in range(3):
        outbox.event("e", n=n)
    records = read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None, timeout_s=5)
    assert [_n(next(records)) for _ in range(3)] == [0, 1, 2]
    assert mailbox.posted(store) == 3  # (the next writer put a number back)


def test_a_count_moved_ahead_is_put_back_where_the_reader_waits():
    store = _store()
    outbox = Outbox(store, Channel(KEY, "node0"), 0.0)
    outbox.event("e", n=0)
    records = read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None, timeout_s=5)
    assert _n(next(records)) == 0
    assert mailbox.repair_count(store, 2) is None  # sound: slot 2 is empty, the count 1
    store.add(keys.MAILBOX_COUNT, 1000)  # by someone without the key
    assert mailbox.repair_count(store, 2) == 1001
    assert mailbox.posted(store) == 1
    outbox.event("e", n=1)
    assert _n(next(records)) == 1  # (in slot 2, where the reader waits)
    outbox.event("e", n=2)  # a count one behind a filled slot is no tampering
    store.add(keys.MAILBOX_COUNT, -1)
    assert mailbox.repair_count(store, 3) is None


def test_a_decision_copied_to_a_later_generations_board_is_refused():
    store = _store()
    coordinator = Channel(KEY, "coordinator")
    board.publish(store, coordinator, keys.decision_board(3), DecisionRecord(3, {"n": 3}), 3)
    genuine = store.get(keys.board_slot(keys.decision_board(3), 1))
    store.compare_set(keys.board_slot(keys.decision_board(5), 1), "", genuine)
    board.publish(store, coordinator, keys.decision_board(5), DecisionRecord(5, {"n": 5}), 5)
    refused: list[str] = []
    opened = board.first(store, keys.decision_board(5), Channel(KEY, "node0"),
                         on_refused=lambda why, _: refused.append(why.reason), timeout_s=5,
                         expect=DecisionRecord, writers={"coordinator"})
    assert opened.message == DecisionRecord(5, {"n": 5})
    assert len(refused) == 1 and "a copy" in refused[0]


def test_the_count_keeps_up_with_a_burst_of_writers():
    """Writers posting at once: every slot is filled once, and the count ends at the last
    one (a count left behind makes each later writer try the filled slots again)."""
    import threading

    store = _store()
    port = store.port

    def writer(n: int) -> None:
        mine = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        outbox = Outbox(mine, Channel(KEY, f"node{n}"), 0.0)
        for i in range(25):
            outbox.event("e", n=n * 100 + i)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mailbox.posted(store) == 150
    records = read_mailbox(store, Channel(KEY, "coordinator"), lambda why: None, timeout_s=5)
    assert sorted(_n(next(records)) for _ in range(150)) == sorted(
        n * 100 + i for n in range(6) for i in range(25))
