"""The coordinator's journal in the store, folded into segments as the run goes on.

Every turn that writes run-file lines seals them as a `Journal` record under its own key, so a
successor on another host can write the run's files again whole (`spotpipe.cluster.run_files`).
One record per turn is one key per training iteration, kept for the whole run: a successor of
a long job read hundreds of thousands of keys, one store call each, before it could
coordinate, and etcd kept every record at its full size. So every `FOLD_RECORDS` records (or
`FOLD_BYTES` of lines, whichever comes first) are folded into one compressed `JournalSegment`,
written with the books that name it, and the records it covers are deleted. A successor reads
the segments, then the records after the last of them.

Packing, unpacking and the bookkeeping of what is folded are pure; `read_back` reads a
predecessor's journal from the store; the coordinating agent's loop writes it with its books
(`spotpipe.cluster.agent_loop`).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

from spotpipe.protocol import (Channel, CoordinatorState, Journal, JournalSegment, MessageError,
                               Refused, keys)
from spotpipe.protocol.bounds import MAX_RECORD_BYTES, Unreadable, load_record

FOLD_RECORDS = 64  # within etcd's 128 operations a transaction, when their keys are deleted
FOLD_BYTES = 256 * 1024  # of lines, uncompressed: a segment stays far below etcd's 1.5 MiB


class JournalError(ValueError):
    """A segment that cannot be read back (named by its first and last record)."""


def pack(first: int, records: list[Journal]) -> JournalSegment:
    """Records `first`..`first + len(records) - 1` as one segment, their lines in order."""
    lines = {"metrics": [m for r in records for m in r.metrics],
             "events": [e for r in records for e in r.events]}
    raw = json.dumps(lines, separators=(",", ":"), allow_nan=False).encode()
    packed = base64.b64encode(zlib.compress(raw, 6)).decode("ascii")
    return JournalSegment(first, first + len(records) - 1, packed)


def unpack(segment: JournalSegment) -> Journal:
    """The segment's lines as one `Journal`; JournalError naming what is wrong. It opened
    under the job's key, so only a key holder wrote it; its size is bounded all the same, as
    every record's is (`protocol.bounds`)."""
    where = f"journal segment of records {segment.first}-{segment.last}"
    if segment.last < segment.first:
        raise JournalError(f"{where}: its last record comes before its first")
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(segment.packed, validate=True),
                                 MAX_RECORD_BYTES)
    except (binascii.Error, zlib.error) as exc:
        raise JournalError(f"{where}: not packed lines ({exc})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise JournalError(f"{where}: over {MAX_RECORD_BYTES} bytes unpacked, or cut short")
    try:
        lines = load_record(raw)
    except Unreadable as exc:
        raise JournalError(f"{where}: {exc}") from None
    try:
        return Journal.from_json(lines)
    except MessageError as exc:
        raise JournalError(f"{where}: {exc}") from None


def _size(record: Journal) -> int:
    return sum(len(json.dumps(x)) for x in (*record.metrics, *record.events))


@dataclass
class JournalFolder:
    """What of the journal is folded (records 1..`folded`, in `segments` segments) and the
    records written since, kept here to fold them without reading them back."""

    segments: int = 0
    folded: int = 0
    pending: list[Journal] = field(default_factory=list)
    pending_bytes: int = 0

    def add(self, index: int, record: Journal) -> None:
        """Record `index` is written (or read back by a successor): it follows the last."""
        if index != self.folded + len(self.pending) + 1:
            raise ValueError(f"journal record {index} after record "
                             f"{self.folded + len(self.pending)}")
        self.pending.append(record)
        self.pending_bytes += _size(record)

    def due(self) -> JournalSegment | None:
        """The segment to write with this turn's books, or None while too little is pending."""
        if len(self.pending) >= FOLD_RECORDS or (self.pending and
                                                 self.pending_bytes >= FOLD_BYTES):
            return pack(self.folded + 1, self.pending)
        return None

    def named_with(self, segment: JournalSegment | None) -> tuple[int, int]:
        """(segments, records folded) as the books name them with `segment` written too."""
        if segment is None:
            return self.segments, self.folded
        return self.segments + 1, segment.last

    def written(self, segment: JournalSegment) -> list[int]:
        """`segment` is in the store with the books that name it: the records it folded, whose
        keys can go."""
        assert segment.first == self.folded + 1, (segment.first, self.folded)
        covered = list(range(segment.first, segment.last + 1))
        self.pending = self.pending[len(covered):]
        self.pending_bytes = sum(_size(r) for r in self.pending)
        self.segments += 1
        self.folded = segment.last
        return covered


def read_back(store: dist.Store, channel: Channel, state: CoordinatorState,
              replay: Callable[[Journal], None],
              refused: Callable[[str, str], None]) -> JournalFolder:
    """A predecessor's journal, as its books `state` name it: every segment, then every record
    after them, each passed to `replay` in order; what is folded, for this coordinator to go
    on folding. A record or segment that does not open under the job's key, or does not
    unpack, is refused (`refused(writer, reason)`: an event) and its lines are lost, which the
    event says; the rest are replayed. Read `READ_BATCH` keys a request: a successor of a long
    job reads thousands of segments before it can coordinate."""
    folder = JournalFolder(state.journal_segments, state.journal_folded)
    segments = [(i, keys.journal_segment(i)) for i in range(1, state.journal_segments + 1)]
    for (index, key), blob in _batched(store, segments):
        try:
            opened = channel.open(blob, at=key, expect=JournalSegment, writers={channel.writer})
            assert isinstance(opened.message, JournalSegment)
            replay(unpack(opened.message))
        except Refused as why:
            refused(why.writer, f"journal segment {index}: {why.reason}")
        except JournalError as why:
            refused(channel.writer, str(why))
    records = [(i, keys.journal(i)) for i in range(state.journal_folded + 1, state.journal + 1)]
    for (index, key), blob in _batched(store, records):
        record = Journal((), ())
        try:
            opened = channel.open(blob, at=key, expect=Journal, writers={channel.writer})
            assert isinstance(opened.message, Journal)
            record = opened.message
        except Refused as why:
            refused(why.writer, f"journal {index}: {why.reason}")
        replay(record)
        folder.add(index, record)
    return folder


READ_BATCH = 100  # keys a request (etcd bounds a transaction's operations: 128 by default)


def _batched(store: dist.Store, named: list[tuple[int, str]]
             ) -> Iterator[tuple[tuple[int, str], bytes]]:
    """Each (index, key) of `named` with its value, read `READ_BATCH` keys a request (one
    etcd transaction each; one at a time cost a round trip per key)."""
    for start in range(0, len(named), READ_BATCH):
        batch = named[start:start + READ_BATCH]
        yield from zip(batch, store.multi_get([key for _, key in batch]))
