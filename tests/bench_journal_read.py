"""A successor coordinator's read of a long job's journal from etcd. Not a test (pytest does not
collect it):

    PYTHONPATH=$PWD/src:$PWD/tests python tests/bench_journal_read.py [SEGMENTS]

Writes SEGMENTS (default 2,000) folded segments of metrics lines, as the coordinating agent
folds them (`spotpipe.cluster.journal`, 64 iterations a segment), into a local etcd on free
ports, then times, three times each: the segments' reads one key a request (as `read_back`
read them before), the same reads 100 keys a request, and `read_back` whole (reads, opening
each seal, unpacking and checking every line). Prints the medians.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from etcd_server import EtcdServer
from spotpipe.cluster.journal import FOLD_RECORDS, READ_BATCH, JournalFolder, read_back
from spotpipe.protocol import Channel, CoordinatorState, Journal, job_key, keys
from spotpipe.store.etcd import EtcdStore


def _line(i: int) -> Journal:
    """One iteration's metrics line, with the fields a real one has."""
    return Journal(({"iter": i, "loss": 5.0 - i / 1e5, "samples_per_s": 1234.5, "lr": 1e-3,
                     "grad_norm": 0.5, "live_nodes": 8, "time_s": i * 0.1},), ())


def main(segments: int) -> None:
    server = EtcdServer(Path(tempfile.mkdtemp()) / "data")
    server.start()
    try:
        host, port = server.endpoint.split(":")
        store = EtcdStore(host, int(port), "/bench-journal", timeout=timedelta(seconds=30))
        channel = Channel(job_key(b"bench", "journal"), "coordinator")
        folder = JournalFolder()
        for i in range(1, segments * FOLD_RECORDS + 1):
            folder.add(i, _line(i))
            segment = folder.due()
            if segment is not None:
                at = keys.journal_segment(folder.segments + 1)
                store.set(at, channel.seal(segment, at=at))
                folder.written(segment)
        iterations = segments * FOLD_RECORDS
        state = CoordinatorState(
            cursor=0, journal=iterations, generation=0, history={}, dead=(), finished=(),
            fenced=(), left=(), joining=(), over=False, stop_message=None, regroup_asked=-1,
            collecting=None, last_metrics=None, exited={}, checkpoints={}, admission={},
            time_s=0.0, journal_segments=segments, journal_folded=iterations)
        names = [keys.journal_segment(i) for i in range(1, segments + 1)]
        one, batched, whole = [], [], []
        for _ in range(3):
            start = time.perf_counter()
            for name in names:
                store.get(name)
            one.append(time.perf_counter() - start)
            start = time.perf_counter()
            for k in range(0, len(names), READ_BATCH):
                store.multi_get(names[k:k + READ_BATCH])
            batched.append(time.perf_counter() - start)
            start = time.perf_counter()
            read_back(store, channel, state, lambda journal: None, lambda writer, why: None)
            whole.append(time.perf_counter() - start)
        print(f"{segments} segments ({iterations} iterations): reads one key a request "
              f"{statistics.median(one):.3f} s, {READ_BATCH} a request "
              f"{statistics.median(batched):.3f} s; read_back {statistics.median(whole):.3f} s "
              f"(runs {[round(x, 3) for x in one]}, {[round(x, 3) for x in batched]}, "
              f"{[round(x, 3) for x in whole]})")
    finally:
        server.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
