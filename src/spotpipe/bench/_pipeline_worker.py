"""One process of `spotpipe bench pipeline`: a pipeline stage timed under spotpipe and under
torch.distributed.pipelining, side by side, plus the profile the analytic model needs.

Started by :mod:`spotpipe.bench.pipeline` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
SPOTPIPE_BENCH_SPEC (JSON) in the environment; the parent hosts the TCPStore. The last rank writes
everything measured, as JSON, to the store key ``bench/result``; any rank that fails writes
``bench/error``. Nothing is printed on stdout.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SPOTPIPE, TORCH = "spotpipe", "torch"
_PING_TAG = 7


def _config(spec: dict[str, Any]):
    from spotpipe.config import from_dict

    return from_dict({
        "model": {"kind": "gpt", "gpt": dict(spec["gpt"]), "partition": "uniform"},
        # the bench makes its own tokens; the path is never read
        "data": {"kind": "text", "path": "unused-by-bench"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "grad_clip": 0.0},
        "schedule": "1f1b", "stages": 2, "pipelines": 1,
        "micro_batch_size": spec["micro_batch_size"],
        "num_microbatches": spec["num_microbatches"],
        "iterations": 1, "seed": spec["seed"],
        "cluster": {"backend": "gloo", "threads_per_worker": 1},
    })


def _times(fn: Callable[[], Any], reps: int,
           before: Callable[[], Any] | None = None) -> list[float]:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


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
        cfg = self.cfg = _config(spec)
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
        self._peerlink = PeerLink
        self._link = None
        self.activation_bytes = 0

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
                    dist.barrier()
                    stamps = [time.perf_counter()]
                    for _ in range(n):
                        self.iterate(system, kind)
                        stamps.append(time.perf_counter())
                    durations = torch.tensor([b - a for a, b in itertools.pairwise(stamps)],
                                             dtype=torch.float64)
                    dist.all_reduce(durations, op=dist.ReduceOp.MAX)  # the slower rank's clock
                    times[f"{system}_{kind}"] += durations.tolist()
            self.profile(spec["profile_reps"], samples)
        out["iter_times"] = times
        out["profile"] = self.profile_summary(samples)
        return out

    # ------------------------------------------------------------------ the analytic model's inputs

    def profile(self, reps: int, samples: dict[str, list[float]]) -> None:
        """Append `reps` samples each of per-stage forward and backward of one micro-batch,
        optimizer step, gradient reduction and one activation message's round trip, with both
        ranks at once as in the pipeline (one busy core each). Called once per round, so that
        the profile sees the same drift of the machine's speed as the timed iterations."""
        cfg = self.cfg
        b, t, c = cfg.micro_batch_size, cfg.model.gpt.block_size, cfg.model.gpt.n_embd
        module, loss_fn = self.state.module, self.model.loss_fn
        m = cfg.num_microbatches
        if self.rank == 0:
            x_in: torch.Tensor = self.mbs.inputs[0]  # type: ignore[assignment]
        else:
            x_in = torch.randn(b, t, c, generator=torch.Generator().manual_seed(3))
        target = self.y[:b]

        def forward() -> torch.Tensor:
            x = x_in if self.rank == 0 else x_in.detach().requires_grad_()
            y = module(x)
            if self.last:
                y = loss_fn(y, target) / m
            return y

        holder: dict[str, torch.Tensor] = {}
        out_grad = None
        if not self.last:
            out_grad = torch.randn_like(forward().detach())

        def prepare_backward() -> None:
            holder["y"] = forward()

        def backward() -> None:
            y = holder.pop("y")
            if self.last:
                y.backward()
            else:
                torch.autograd.backward(y, out_grad)

        def grads() -> None:
            prepare_backward()
            backward()

        def step() -> None:
            self.state.optimizer.step()
            self.state.optimizer.zero_grad(set_to_none=True)

        def add(key: str, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> None:
            dist.barrier()
            samples.setdefault(key, []).extend(_times(fn, reps, before))

        add("forward", forward)
        add("backward", backward, before=prepare_backward)
        add("reduce", self.executor.reduce_gradients, before=lambda: (grads(), dist.barrier()))
        add("optimizer", step, before=grads)
        # the spotpipe state's weights moved (optimizer steps on profiling gradients): harmless
        # for timing, and the two systems' weights have diverged since iteration 0 anyway

        # one activation message through spotpipe's own link: half a ping-pong's round trip
        act = torch.randn(b, t, c)
        if self._link is None:
            self._link = self._peerlink(self.device)
            self._ping(act)  # the first message carries the shape header
        for _ in range(reps):
            samples.setdefault("comm", []).append(self._ping(act) / 2)
        self.activation_bytes = act.numel() * act.element_size()

    def _ping(self, act: torch.Tensor) -> float:
        link = self._link
        dist.barrier()
        start = time.perf_counter()
        if self.rank == 0:
            link.send(act, 1, _PING_TAG)
            link.recv(1, _PING_TAG)
        elif self.rank == 1:
            link.send(link.recv(0, _PING_TAG), 0, _PING_TAG)
        rtt = time.perf_counter() - start
        link.wait_sends()
        return rtt

    def profile_summary(self, samples: dict[str, list[float]]) -> dict[str, Any]:
        keys = ("forward", "backward", "optimizer", "reduce", "comm")
        mine = torch.tensor([statistics.median(samples[k]) for k in keys], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        rows = [p.tolist() for p in parts]
        out: dict[str, Any] = {f"{k}_s": [r[i] for r in rows] for i, k in enumerate(keys)}
        out["comm_s"] = rows[0][4]  # rank 0 timed the whole round trip
        out["activation_bytes"] = self.activation_bytes
        out["partition"] = self.partition
        out["samples_per_rank"] = len(samples["forward"])
        return out


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = json.loads(os.environ["SPOTPIPE_BENCH_SPEC"])
    cores = spec.get("cores")
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=spec["timeout_s"]))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=spec["timeout_s"]))
        bench = Bench(spec, rank, world)
        result = bench.measure()
        if rank == world - 1:  # the last stage holds the losses; times and profile are global
            store.set("bench/result", json.dumps(result))
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the parent
        traceback.print_exc()
        store.set(f"bench/error/{rank}", f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
