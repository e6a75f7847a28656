"""The coordinator's journal folds into segments: a successor reads a handful of keys, not one
per iteration of the run, and gets every line back in order."""

from __future__ import annotations

import base64
import types
import zlib
from datetime import timedelta

import pytest

from spotpipe.cluster import journal
from spotpipe.cluster.agent_loop import AgentJobLoop
from spotpipe.cluster.journal import (FOLD_RECORDS, JournalError, JournalFolder, pack, read_back,
                                      unpack)
from spotpipe.protocol import (Channel, CoordinatorState, Journal, JournalSegment, job_key,
                               keys)
from spotpipe.store.etcd import EtcdStore

KEY = job_key(b"sesame", "journal")


def _record(i: int) -> Journal:
    """Turn i's lines: a metrics line, and an event every other turn."""
    events = ({"time_s": i / 10, "kind": "plan", "generation": i},) if i % 2 else ()
    return Journal(({"iter": i, "loss": 5.0 - i / 100, "samples_per_s": 1e3},), events)


def test_a_segment_unpacks_to_its_records_lines_in_order():
    records = [_record(i) for i in range(1, 11)]
    segment = pack(5, records)
    assert (segment.first, segment.last) == (5, 14)
    back = unpack(JournalSegment.from_json(segment.to_json()))
    assert list(back.metrics) == [m for r in records for m in r.metrics]
    assert list(back.events) == [e for r in records for e in r.events]
    raw = sum(len(str(r.metrics)) + len(str(r.events)) for r in records)
    assert len(segment.packed) < raw  # (compressed, even in base64)


@pytest.mark.parametrize("packed,says", [
    ("not base64!", "not packed lines"),
    (base64.b64encode(b"plain bytes").decode(), "not packed lines"),
    (base64.b64encode(zlib.compress(b"[1, 2")[:-4]).decode(), "cut short"),
    (base64.b64encode(zlib.compress(b"\0" * (journal.MAX_RECORD_BYTES + 1))).decode(),
     "over 16777216 bytes unpacked"),
    (base64.b64encode(zlib.compress(b"{\"metrics\": 3")).decode(), "not a JSON record"),
    (base64.b64encode(zlib.compress(b"{\"metrics\": 3}")).decode(), "expected a list"),
    (base64.b64encode(zlib.compress(b"{\"metrics\": [], \"events\": [], \"x\": 1}")).decode(),
     "unknown field"),
])
def test_a_segment_that_does_not_unpack_says_why_and_which(packed, says):
    with pytest.raises(JournalError) as error:
        unpack(JournalSegment(65, 128, packed))
    assert str(error.value).startswith("journal segment of records 65-128: "), error.value
    assert says in str(error.value)


def test_the_folder_folds_every_64_records_or_256_kib_of_lines_and_keeps_the_order():
    folder = JournalFolder()
    for i in range(1, FOLD_RECORDS):
        folder.add(i, _record(i))
        assert folder.due() is None
    folder.add(FOLD_RECORDS, _record(FOLD_RECORDS))
    segment = folder.due()
    assert segment is not None and (segment.first, segment.last) == (1, FOLD_RECORDS)
    assert folder.written(segment) == list(range(1, FOLD_RECORDS + 1))
    assert (folder.segments, folder.folded, folder.pending) == (1, FOLD_RECORDS, [])
    big = Journal(({"iter": 65, "blob": "x" * journal.FOLD_BYTES},), ())
    folder.add(65, big)
    assert (folder.due().first, folder.due().last) == (65, 65)  # (one large turn alone)
    with pytest.raises(ValueError, match="journal record 67 after record 65"):
        folder.add(67, _record(67))


class _Office:
    """The elected agent, as far as writing books needs it."""

    me = 1

    def admission(self) -> dict:
        return {}

    def depose(self) -> None:
        raise AssertionError("deposed")


def _writer(store: EtcdStore, turns: list[Journal]) -> AgentJobLoop:
    """The coordinating agent's loop with only what writing its books needs."""
    loop = AgentJobLoop.__new__(AgentJobLoop)
    loop.rdzv, loop._store, loop.channel = _Office(), store, Channel(KEY, "coordinator")
    loop.coordinator = types.SimpleNamespace(generation=0)
    loop._persisted, loop._marked, loop._journal = None, 0, 0
    loop._folder = JournalFolder()
    loop._now = lambda: 1.0
    books = dict(generation=0, history={}, dead=(), finished=(), fenced=(), left=(),
                 joining=(), over=False, stop_message=None, regroup_asked=-1, collecting=None,
                 last_metrics=None, exited={}, checkpoints={}, cursor=0)
    loop._books = lambda: dict(books)
    pending = iter(turns)

    def take() -> tuple[list, list]:  # (the run files' new lines of a turn)
        turn = next(pending)
        return list(turn.metrics), list(turn.events)
    for _ in turns:
        loop._write_books(types.SimpleNamespace(take=take))
    return loop


def test_a_successor_reads_the_folded_journal_whole_from_a_few_keys(etcd):
    """150 turns of lines written as the coordinating agent writes its books: two segments of
    64 and 22 records after them, the folded records' keys deleted. A successor reads every
    line back in order from 24 keys instead of 150, and goes on folding where its
    predecessor stopped."""
    host, port = etcd.endpoint.split(":")
    store = EtcdStore(host, int(port), "/journal-test", timeout=timedelta(seconds=10))
    store.set(keys.LEADER, "1")
    turns = [_record(i) for i in range(1, 151)]
    writer = _writer(store, turns)
    opened = Channel(KEY, "agent2").open(store.get(keys.COORDINATOR_STATE),
                                         at=keys.COORDINATOR_STATE, expect=CoordinatorState,
                                         writers={"coordinator"})
    state = opened.message
    assert (state.journal, state.journal_segments, state.journal_folded) == (150, 2, 128)
    assert not store.check([keys.journal(i) for i in (1, 64, 65, 128)])  # folded: deleted
    assert all(store.check([keys.journal(i)]) for i in range(129, 151))
    replayed: list[Journal] = []
    refused: list[tuple[str, str]] = []
    folder = read_back(store, Channel(KEY, "coordinator"), state, replayed.append,
                       lambda writer_, why: refused.append((writer_, why)))
    assert not refused
    assert [m for r in replayed for m in r.metrics] == [m for t in turns for m in t.metrics]
    assert [e for r in replayed for e in r.events] == [e for t in turns for e in t.events]
    assert (folder.segments, folder.folded, len(folder.pending)) == (2, 128, 22)
    assert folder.pending == writer._folder.pending
    # the successor folds on: records 129..192 in the third segment
    for i in range(151, 193):
        folder.add(i, _record(i))
    segment = folder.due()
    assert segment is not None and (segment.first, segment.last) == (129, 192)
    assert [m["iter"] for m in unpack(segment).metrics] == list(range(129, 193))


def test_a_forged_segment_is_refused_and_the_rest_replayed(etcd):
    """A segment written without the job's key is refused, naming it; its lines are lost
    (the event says so) and the rest of the journal still comes back."""
    host, port = etcd.endpoint.split(":")
    store = EtcdStore(host, int(port), "/journal-forged", timeout=timedelta(seconds=10))
    store.set(keys.LEADER, "1")
    _writer(store, [_record(i) for i in range(1, 131)])
    state = Channel(KEY, "agent2").open(store.get(keys.COORDINATOR_STATE),
                                        at=keys.COORDINATOR_STATE, expect=CoordinatorState,
                                        writers={"coordinator"}).message
    forged = Channel(job_key(b"guess", "journal"), "coordinator").seal(
        pack(1, [_record(0)]), at=keys.journal_segment(1))
    store.set(keys.journal_segment(1), forged)
    replayed: list[Journal] = []
    refused: list[tuple[str, str]] = []
    read_back(store, Channel(KEY, "coordinator"), state, replayed.append,
              lambda writer_, why: refused.append((writer_, why)))
    assert [why.split(":")[0] for _, why in refused] == ["journal segment 1"]
    assert [m["iter"] for r in replayed for m in r.metrics] == list(range(65, 131))


class _Counted:
    """A store that counts its reads: one request per `get`, one per `multi_get`."""

    def __init__(self, inner) -> None:
        self.inner, self.requests = inner, 0

    def get(self, key):
        self.requests += 1
        return self.inner.get(key)

    def multi_get(self, keys_):
        self.requests += 1
        return self.inner.multi_get(keys_)


def test_a_long_jobs_journal_is_read_a_hundred_keys_a_request():
    """250 segments and 30 records after them (16,030 turns): read back in 3 + 1 requests,
    not 280, every line in order."""
    from torch.distributed import HashStore

    store, channel = HashStore(), Channel(KEY, "coordinator")
    folder = JournalFolder()
    for i in range(1, 250 * FOLD_RECORDS + 31):
        folder.add(i, _record(i))
        segment = folder.due()
        if segment is not None:
            at = keys.journal_segment(folder.segments + 1)
            store.set(at, channel.seal(segment, at=at))
            folder.written(segment)
    for i, record in enumerate(folder.pending, start=folder.folded + 1):
        store.set(keys.journal(i), channel.seal(record, at=keys.journal(i)))
    state = CoordinatorState(
        cursor=0, journal=250 * FOLD_RECORDS + 30, generation=0, history={}, dead=(),
        finished=(), fenced=(), left=(), joining=(), over=False, stop_message=None,
        regroup_asked=-1, collecting=None, last_metrics=None, exited={}, checkpoints={},
        admission={}, time_s=0.0, journal_segments=250, journal_folded=250 * FOLD_RECORDS)
    counted = _Counted(store)
    replayed: list[Journal] = []
    read_back(counted, channel, state, replayed.append, lambda w, why: None)
    assert counted.requests == 4
    assert [m["iter"] for r in replayed for m in r.metrics] == list(range(1, 16031))
