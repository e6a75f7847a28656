"""One process of `spotpipe bench checkpoint`: a pipeline stage trained once per variant (no
checkpoints, and each checkpoint scheme at each interval), side by side, in interleaved blocks.

Started by :mod:`spotpipe.bench.checkpoint` through :func:`spotpipe.bench.harness.launch`. Each
variant is its own `spotpipe.runtime.worker.Worker` (`harness.bench_worker`, store namespace
``bench-ckpt-VARIANT``) with its own stage, process groups and checkpoint scheme, built from
`checkpoint.scheme` / `checkpoint.every` as a real run builds it; after each iteration the bench
calls the worker's own `_checkpoint`, as `Worker.train` does.

A block is `iters_per_block` iterations of one variant, timed from a barrier to the end of the
block, including the wait for the scheme's last asynchronous write (so no variant's background
work runs into the next one's block, and none is hidden). The iteration counter of each variant
starts at `first_iteration`, which puts a k = 10 checkpoint in the middle of each block, where
its background write overlaps the rest of the block as it would in a long run.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.bench.checkpoint import VARIANTS
from spotpipe.bench.harness import bench_config, bench_worker, worker_main


class CheckpointBench:
    def __init__(self, spec: dict[str, Any], rank: int, world: int, run_dir: Path) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.names = [name for name, _, _ in VARIANTS]
        self.workers = {}
        for name, scheme, every in VARIANTS:
            cfg = bench_config(spec, checkpoint={"scheme": scheme, "every": every, "keep": 2},
                               iterations=10 ** 6)
            self.workers[name] = bench_worker(cfg, rank, run_dir / name,
                                              namespace=f"bench-ckpt-{name}")
            # the baselines write as their systems do: spotpipe's SHA-256 of every file (for
            # its commit and safe resume) is no part of a torch.save, CheckFreq or DCP write
            self.workers[name].checkpoints.checksums = False
        self.mbs = {name: w.batches(0) for name, w in self.workers.items()}
        self.iteration = dict.fromkeys(self.names, spec["first_iteration"])
        self.block_s: dict[str, list[float]] = {name: [] for name in self.names}
        self.timeline: dict[str, list[list[float]]] = {name: [] for name in self.names}
        self.timed_iterations = dict.fromkeys(self.names, 0)

    def iterate(self, name: str, timed: bool) -> None:
        worker, t = self.workers[name], self.iteration[name]
        ex = worker.executor
        ex.set_lr(t)
        start = time.time()
        ex.run(worker.stream, self.mbs[name], t)
        worker._checkpoint(t)
        if timed:
            self.timeline[name].append([t, start, time.time()])
        self.iteration[name] = t + 1

    def block(self, name: str, timed: bool) -> None:
        scheme = self.workers[name].checkpoints
        dist.barrier()
        started = time.perf_counter()
        for _ in range(self.spec["iters_per_block"]):
            self.iterate(name, timed)
        scheme.poll(None, wait=True)  # the block owns its background work
        took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slower rank's clock
        if timed:
            self.block_s[name].append(float(took.item()))
            self.timed_iterations[name] += self.spec["iters_per_block"]
        self._tidy(name)

    def _tidy(self, name: str) -> None:
        """Uncommitted DCP folders pile up without a launcher to commit them: keep the newest
        two (untimed; nothing is in flight after the block's drain)."""
        root = self.workers[name].run_dir / "checkpoints"
        partial = sorted(root.glob(".iter_*.partial")) if root.is_dir() else []
        for old in partial[:-2]:
            shutil.rmtree(old, ignore_errors=True)

    def measure(self) -> dict[str, Any]:
        names = self.names
        for _ in range(self.spec["warmup_blocks"]):
            for name in names:
                self.block(name, timed=False)
        for r in range(self.spec["rounds"]):
            k = r % len(names)
            for name in names[k:] + names[:k]:  # each variant leads in turn
                self.block(name, timed=True)
        out: dict[str, Any] = {"block_s": self.block_s,
                               "iters_per_block": self.spec["iters_per_block"]}
        totals = torch.tensor([[float(self.workers[n].checkpoints.bytes),
                                self.workers[n].checkpoints.blocked_s,
                                float(self.workers[n].checkpoints.checkpoints),
                                float(self.iteration[n] - self.spec["first_iteration"])]
                               for n in names], dtype=torch.float64)
        rows = [torch.empty_like(totals) for _ in range(self.world)]
        dist.all_gather(rows, totals)
        out["per_rank"] = {n: [r[i].tolist() for r in rows] for i, n in enumerate(names)}
        out["records"] = self._gather_records()
        out["timeline"] = self.timeline
        for w in self.workers.values():
            w.checkpoints.close()
        return out

    def _gather_records(self) -> dict[str, list[list[list[Any]]]]:
        """Every rank's completed checkpoints (iteration, stage, kind, wall time), through the
        store as JSON."""
        store = self.workers[self.names[0]].store
        mine = {n: record_rows(n, self.workers[n].checkpoints.records) for n in self.names}
        store.set(f"bench/ckpt-records/{self.rank}", json.dumps(mine))
        dist.barrier()
        ranks = [json.loads(store.get(f"bench/ckpt-records/{r}")) for r in range(self.world)]
        return {n: [rec for rank in ranks for rec in rank[n]] for n in self.names}


def record_rows(name: str, records: list[dict[str, Any]]) -> list[list[Any]]:
    """A variant's completed checkpoints as [iteration, stage, kind, wall time] rows. A
    checkpoint that failed stops the bench, named: its figures would time a write that did
    not happen (and it has no completion time to count lost work from)."""
    failed = [r for r in records if r["kind"] == "checkpoint_failed"]
    if failed:
        r = failed[0]
        raise RuntimeError(f"{name}: the checkpoint of iteration {r['iteration']}, stage "
                           f"{r['stage']} failed ({len(failed)} in all): {r['message']}")
    return [[r["iteration"], r["stage"], r["kind"], r["done_time"]] for r in records]


def _measure(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-ckpt-") as run_dir:
        return CheckpointBench(spec, rank, world, Path(run_dir)).measure()


if __name__ == "__main__":
    sys.exit(worker_main(_measure))
