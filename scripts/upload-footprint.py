"""Memory and time of one durable stage carried through the job's store (checkpoint/transfer.py),
as a host that does not see the checkpoint folder sends it: the sender's and the receiver's peak
memory over their start, and the store server's peak (what it holds of the stage), each in a
process of its own.

    python scripts/upload-footprint.py [--mb 256]
    python scripts/upload-footprint.py --side-by-side [--mb 128]

Prints one JSON line. The stage is one file of random bytes (a DCP stage file's size), its
SHA-256 the checksum the worker would report. With --side-by-side, two hosts' stages instead,
sent at once and received by the coordinator's committer (cluster/committer.py), each sender,
the store server and the committing side in processes of their own: how long each sender took
and how long to the commit (run it with PYTHONPATH=OTHER/src to compare committers)."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import tempfile
import time
from datetime import timedelta
from pathlib import Path

KEY = b"k" * 32


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _store(port: int):
    import torch.distributed as dist

    from spotpipe.store.sealed import SealedStore

    inner = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    return SealedStore(inner, KEY)


def _server(port_q, done) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port_q.put(store.port)
    done.wait()
    status = Path("/proc/self/status").read_text()
    hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    port_q.put(hwm / 1024)


def _send(port, folder, checksums, out) -> None:
    from spotpipe.checkpoint import transfer

    store = _store(port)
    start_rss, t = _rss_mib(), time.perf_counter()
    transfer.send_stage(store, 1, 0, Path(folder), checksums, timeout_s=300)
    out.put({"send_s": time.perf_counter() - t, "send_peak_over_start_mib": _rss_mib() - start_rss})


def _receive(port, checksums, dest, out) -> None:
    from spotpipe.checkpoint import transfer

    store = _store(port)
    start_rss, t = _rss_mib(), time.perf_counter()
    problem = transfer.receive_stage(store, 1, 0, checksums, Path(dest), timeout_s=300)
    out.put({"receive_s": time.perf_counter() - t, "problem": problem,
             "receive_peak_over_start_mib": _rss_mib() - start_rss})


def _send_at_once(port, stage, folder, checksums, start, out) -> None:
    from spotpipe.checkpoint import transfer

    store = _store(port)
    start.wait()
    t = time.perf_counter()
    transfer.send_stage(store, 1, stage, Path(folder), checksums, timeout_s=300)
    out.put((f"send_s_stage{stage}", time.perf_counter() - t))


def _commit(port, stages, root, start, out) -> None:
    from spotpipe.checkpoint import durable, transfer
    from spotpipe.cluster.committer import Committer

    committer = Committer(Path(root), keep=2, key=KEY, now=time.time)
    folder = durable.iter_dir(Path(root), 1, partial=True)
    stores = {s: _store(port) for s in stages}
    start.wait()
    t = time.perf_counter()
    for s, checksums in stages.items():  # announced together, as two hosts' StageUploads are
        committer.submit_step(1, lambda s=s, c=checksums: transfer.receive_stage(
            stores[s], 1, s, c, folder, timeout_s=300))
    committer.submit(1, {"stages": len(stages)},
                     {k: v for c in stages.values() for k, v in c.items()})
    done = committer.close()
    out.put(("commit_s", time.perf_counter() - t))
    out.put(("committed", [c.path is not None for c in done] == [True]))


def side_by_side(args) -> None:
    """Two hosts' stages at once into the committer: the senders' times and the commit's."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        stages = {}
        for s in (0, 1):
            folder = Path(tmp) / f"host{s}" / f"stage{s}"
            folder.mkdir(parents=True)
            data = os.urandom(args.mb << 20)
            (folder / "data.distcp").write_bytes(data)
            stages[s] = {f"stage{s}/data.distcp": hashlib.sha256(data).hexdigest()}
        port_q, done, out = ctx.Queue(), ctx.Event(), ctx.Queue()
        start = ctx.Barrier(3)  # the two senders and the committing side, each connected
        server = ctx.Process(target=_server, args=(port_q, done))
        server.start()
        port = port_q.get()
        procs = [ctx.Process(target=_send_at_once, args=(port, s, str(Path(tmp) / f"host{s}"),
                                                 stages[s], start, out)) for s in stages]
        procs.append(ctx.Process(target=_commit, args=(port, stages, f"{tmp}/ckpt", start, out)))
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        figures = dict(out.get() for _ in range(4))
        done.set()
        server.join()
    figures["mb_per_stage"] = args.mb
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in figures.items()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--side-by-side", action="store_true")
    args = parser.parse_args()
    if args.side_by_side:
        side_by_side(args)
        return
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "sent"
        (folder / "stage0").mkdir(parents=True)
        data = os.urandom(args.mb << 20)
        (folder / "stage0" / "data.distcp").write_bytes(data)
        checksums = {"stage0/data.distcp": hashlib.sha256(data).hexdigest()}
        del data
        port_q, done, out = ctx.Queue(), ctx.Event(), ctx.Queue()
        server = ctx.Process(target=_server, args=(port_q, done))
        server.start()
        port = port_q.get()
        # both at once, as in a job: the receiver starts on the sender's announcement, and
        # the sender waits for it at each window (transfer.WINDOW pieces in the store)
        sender = ctx.Process(target=_send, args=(port, str(folder), checksums, out))
        receiver = ctx.Process(target=_receive, args=(port, checksums, f"{tmp}/got", out))
        sender.start()
        receiver.start()
        sender.join()
        receiver.join()
        figures = {**out.get(), **out.get()}
        done.set()
        figures["store_server_peak_mib"] = port_q.get()
        server.join()
        figures["mb"] = args.mb
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in figures.items()}))


if __name__ == "__main__":
    main()
