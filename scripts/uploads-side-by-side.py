"""Two hosts' stages carried through the job's store at once (checkpoint/transfer.py), received
by the coordinator's committer (cluster/committer.py) and committed: how long from the senders'
start to the commit, and how long each sender took.

    python scripts/uploads-side-by-side.py [--mb 128]

Each sender, the store server and the committing side run in processes of their own; the
stages are files of random bytes. Prints one JSON line. Run it against another tree with
PYTHONPATH=OTHER/src to compare committers."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

KEY = b"k" * 32


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


def _send(port, stage, folder, checksums, start, out) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=128)
    args = parser.parse_args()
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
        procs = [ctx.Process(target=_send, args=(port, s, str(Path(tmp) / f"host{s}"),
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


if __name__ == "__main__":
    main()
