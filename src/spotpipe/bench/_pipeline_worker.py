"""One process of `spotpipe bench pipeline`: a pipeline stage timed under spotpipe and under
torch.distributed.pipelining, side by side, plus the profile the analytic model needs.

Started by :mod:`spotpipe.bench.pipeline` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
SPOTPIPE_BENCH_SPEC (JSON) in the environment; the parent hosts the TCPStore. The last rank writes
everything measured, as JSON, to the store key ``bench/result``; any rank that fails writes
``bench/error``. Nothing is printed on stdout.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.bench.harness import StageProfiler, bench_config, timed_block, worker_main

SPOTPIPE, TORCH = "spotpipe", "torch"


class Bench:
    def __init__(self, spec: dict[str, Any], rank: int, world: int) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
        )

        from spotpipe import job
        from spotpipe.model import partition
        from spotpipe.model.ties import norm_param_names
        from spotpipe.runtime.comm import Groups, PeerLink, Topology
        from spotpipe.runtime.executor import Executor, Microbatches
        from spotpipe.runtime.optim import build_optimizer
        from spotpipe.runtime.worker import stage_state
        from spotpipe.schedule import build_schedule

        self.spec, self.rank, self.world = spec, rank, world
        self.last = rank == world - 1
        cfg = self.cfg = bench_config(spec)
        m, b = cfg.num_microbatches, cfg.micro_batch_size
        device = self.device = torch.device("cpu")
        self.model = job.build_model(cfg)
        self.partition = [(int(a), int(e)) for a, e in partition(self.model, world, "uniform")]

        # spotpipe: the worker's own construction of a stage and its executor
        self.state = stage_state(self.model, self.partition, rank, cfg, device)
        topo = Topology(world, 1)
        self.groups = Groups(topo, rank)
        self.executor = Executor(
            state=self.state, num_stages=world, rank_of_stage=lambda s: topo.rank_of(0, s),
            link=PeerLink(device), groups=self.groups, num_pipelines=1,
            loss_fn=self.model.loss_fn, loss_scale_div=m, grad_clip=cfg.optimizer.grad_clip,
            norm_counts=[len(n) for n in norm_param_names(self.model, self.partition)])
        self.streams = {k: build_schedule(k, world, m).streams[rank] for k in spec["schedules"]}

        # torch.distributed.pipelining: its own copy of the same initial weights
        self.torch_module = copy.deepcopy(self.state.module)
        self.torch_opt = build_optimizer(self.torch_module.parameters(), cfg)
        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        self.torch_schedules = {}
        for k in spec["schedules"]:
            stage = PipelineStage(self.torch_module, rank, world, device)
            self.torch_schedules[k] = kinds[k](stage, m, loss_fn=self.model.loss_fn)

        # the same data for both: one global batch of random tokens, fixed by the seed
        gen = torch.Generator().manual_seed(spec["seed"] + 1)
        tokens = torch.randint(0, cfg.model.gpt.vocab_size, (m * b, cfg.model.gpt.block_size + 1),
                               generator=gen)
        self.x = tokens[:, :-1].contiguous()
        self.y = tokens[:, 1:].contiguous()
        xs, ys = list(self.x.split(b)), list(self.y.split(b))
        self.mbs = Microbatches(inputs=xs if rank == 0 else [None] * m,
                                targets=ys if self.last else [None] * m)
        self.profiler = StageProfiler(cfg=cfg, rank=rank, world=world, state=self.state,
                                      loss_fn=self.model.loss_fn, first_input=self.mbs.inputs[0],
                                      target=self.y[:b], reduce=self.executor.reduce_gradients,
                                      device=device)

    # ------------------------------------------------------------------ one iteration each

    def spotpipe_iter(self, kind: str) -> float:
        result = self.executor.run(self.streams[kind], self.mbs)
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
        for r in range(spec["rounds"]):
            order = (SPOTPIPE, TORCH) if r % 2 == 0 else (TORCH, SPOTPIPE)
            for kind in kinds:
                for system in order:
                    times[f"{system}_{kind}"] += timed_block(
                        functools.partial(self.iterate, system, kind), n)
            # the profile steps the spotpipe state's optimizer on profiling gradients: harmless
            # for timing, and the two systems' weights have diverged since iteration 0 anyway
            self.profiler.profile(spec["profile_reps"], samples)
        out["iter_times"] = times
        out["profile"] = self.profiler.summary(samples, self.partition)
        return out


def _measure(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    return Bench(spec, rank, world).measure()


if __name__ == "__main__":
    sys.exit(worker_main(_measure))
