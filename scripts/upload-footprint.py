"""Memory and time of one durable stage carried through the job's store (checkpoint/transfer.py),
as a host that does not see the checkpoint folder sends it: the sender's and the receiver's peak
memory over their start, and the store server's peak (what it holds of the stage), each in a
process of its own.

    python scripts/upload-footprint.py [--mb 256]

Prints one JSON line. The stage is one file of random bytes (a DCP stage file's size), its
SHA-256 the checksum the worker would report."""

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
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
