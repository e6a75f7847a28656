"""One process of `spotpipe bench pipeline`: a pipeline stage timed under spotpipe and under
torch.distributed.pipelining, side by side, plus the profile the analytic model needs.

Started by :mod:`spotpipe.bench.pipeline` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
SPOTPIPE_BENCH_SPEC (JSON) in the environment; the parent hosts the TCPStore. The spotpipe side is
the runtime's own `Worker` (`harness.bench_worker`, redundancy none, its process groups under the
store namespace ``bench-pipeline``); the torch side runs on the default group the harness joins.
The last rank writes everything measured, as JSON, to the store key ``bench/result``; any rank
that fails writes ``bench/error``. Nothing is printed on stdout.
"""

from __future__ import annotations

import copy
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.bench.harness import (StageProfiler, TracedStream, bench_config, bench_worker,
                                    gather_op_seconds, timed_block, worker_main)

SPOTPIPE, TORCH = "spotpipe", "torch"


class Bench:
    def __init__(self, spec: dict[str, Any], rank: int, world: int, run_dir: Path) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
        )

        from spotpipe.runtime.optim import build_optimizer
        from spotpipe.schedule import build_schedule

        self.spec, self.rank, self.world = spec, rank, world
        self.last = rank == world - 1
        cfg = self.cfg = bench_config(spec)
        m = cfg.num_microbatches
        device = torch.device("cpu")

        # spotpipe: the runtime's own worker (stage, process groups, executor), driven here one
        # iteration at a time; one executor runs both schedules' streams
        self.worker = bench_worker(cfg, rank, run_dir, namespace="bench-pipeline")
        self.executor = self.worker.executor
        self.state = self.worker.stages[rank]
        self.partition = [tuple(r) for r in self.worker.spec.partition]
        self.streams = {k: build_schedule(k, world, m).streams[rank] for k in spec["schedules"]}
        self.iteration = 0
        # seconds per op kind of spotpipe's timed iterations, per schedule (`TracedStream`),
        # and how many iterations they cover: where the time goes against the model
        self.op_s: dict[str, dict[str, float]] = {k: {} for k in spec["schedules"]}
        self.traced = dict.fromkeys(spec["schedules"], 0)
        self.tracing = False

        # torch.distributed.pipelining: its own copy of the same initial weights
        self.torch_module = copy.deepcopy(self.state.module)
        self.torch_opt = build_optimizer(self.torch_module.parameters(), cfg)
        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        self.torch_schedules = {}
        for k in spec["schedules"]:
            stage = PipelineStage(self.torch_module, rank, world, device)
            self.torch_schedules[k] = kinds[k](stage, m, loss_fn=self.worker.model.loss_fn)

        # the same data for both: the bench's one global batch (fixed by the seed), in the
        # micro-batches the worker's sampler cuts for iteration 0, every iteration
        self.mbs = self.worker.batches(0)
        self.x = torch.cat(self.mbs.inputs) if rank == 0 else None
        self.y = torch.cat(self.mbs.targets) if self.last else None
        self.profiler = StageProfiler(cfg=cfg, rank=rank, world=world, state=self.state,
                                      loss_fn=self.worker.model.loss_fn,
                                      first_input=self.mbs.inputs[0], target=self.mbs.targets[0],
                                      reduce=self.executor.reduce_gradients,
                                      comm=self.executor.comm)

    # ------------------------------------------------------------------ one iteration each

    def spotpipe_iter(self, kind: str) -> float:
        t = self.iteration
        start = time.perf_counter()
        self.executor.set_lr(t)
        stream = self.streams[kind]
        if self.tracing:
            stream = TracedStream(stream, self.op_s[kind])
        result = self.executor.run(stream, self.mbs, t)
        if self.tracing:
            totals = self.op_s[kind]
            totals["iteration"] = totals.get("iteration", 0.0) + time.perf_counter() - start
            self.traced[kind] += 1
        self.iteration = t + 1
        return float(result.loss_sum) if result.loss_sum is not None else float("nan")

    def torch_iter(self, kind: str) -> float:
        sched = self.torch_schedules[kind]
        loss = float("nan")
        if self.rank == 0:
            sched.step(self.x, return_outputs=False)
        elif self.last:
            losses: list[torch.Tensor] = []
            sched.step(target=self.y, losses=losses, return_outputs=False)
            loss = float(torch.stack([t.detach() for t in losses]).mean())
        else:
            sched.step(return_outputs=False)
        self.torch_opt.step()
        self.torch_opt.zero_grad(set_to_none=True)
        return loss

    def iterate(self, system: str, kind: str) -> float:
        return self.spotpipe_iter(kind) if system == SPOTPIPE else self.torch_iter(kind)

    # ------------------------------------------------------------------ the measurement

    def measure(self) -> dict[str, Any]:
        spec = self.spec
        kinds = spec["schedules"]
        out: dict[str, Any] = {}
        # iteration 0 of both systems starts from the same weights on the same data: the losses
        # must agree, which checks that the two pipelines compute the same thing
        first = {}
        for kind in kinds:
            for system in (SPOTPIPE, TORCH):
                dist.barrier()
                loss = self.iterate(system, kind)
                first.setdefault(system, loss)
        out["first_loss"] = first
        for _ in range(spec["warmup"] - 1):
            for kind in kinds:
                for system in (SPOTPIPE, TORCH):
                    dist.barrier()
                    self.iterate(system, kind)
        times: dict[str, list[float]] = {f"{s}_{k}": [] for s in (SPOTPIPE, TORCH) for k in kinds}
        n = spec["iters_per_round"]
        samples: dict[str, list[float]] = {}
        self.tracing = True  # one clock read per instruction: nothing the timing can see
        for r in range(spec["rounds"]):
            order = (SPOTPIPE, TORCH) if r % 2 == 0 else (TORCH, SPOTPIPE)
            for kind in kinds:
                for system in order:
                    times[f"{system}_{kind}"] += timed_block(
                        functools.partial(self.iterate, system, kind), n)
            # the profile steps the spotpipe state's optimizer on profiling gradients: harmless
            # for timing, and the two systems' weights have diverged since iteration 0 anyway
            self.profiler.profile(spec["profile_reps"], samples)
        self.tracing = False
        out["op_s"] = {k: gather_op_seconds(self.op_s[k], self.traced[k], self.world)
                       for k in kinds}
        out["iter_times"] = times
        out["profile"] = self.profiler.summary(samples, self.partition)
        return out


def _measure(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-") as run_dir:
        return Bench(spec, rank, world, Path(run_dir)).measure()


if __name__ == "__main__":
    sys.exit(worker_main(_measure))
