"""One process of `spotpipe bench redundancy`: a pipeline stage trained three times side by side,
with redundancy none, lazy and eager, plus the profile the analytic model needs.

Started by :mod:`spotpipe.bench.redundancy` through :func:`spotpipe.bench.harness.launch`. Each
mode has its own stage (same initial weights), process groups, executor and, for lazy and eager,
its own replica of the successor stage kept by gradient replication, all built the way
`spotpipe.runtime.worker` builds them; the three train on the same micro-batches, so lazy and
eager must end bit-identical, and each replica bit-identical to its owner.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.bench.harness import (StageProfiler, bench_config, stage_costs, times, timed_block,
                                    worker_main)
from spotpipe.bench.redundancy import MODES, frc_by_stage, update_slot


class TracedStream:
    """An instruction stream that clocks each instruction as the executor runs it: the executor
    takes the next instruction only once the previous one is done, so the time between two
    takes is the previous instruction's (a receive's includes its wait). Seconds per op kind
    accumulate in `totals`; nothing in the runtime is patched."""

    def __init__(self, stream: Sequence[Any], totals: dict[str, float]) -> None:
        self.stream, self.totals = stream, totals

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[Any]:
        last = time.perf_counter()
        for ins in self.stream:
            yield ins
            now = time.perf_counter()
            self.totals[ins.op.value] = self.totals.get(ins.op.value, 0.0) + now - last
            last = now


def _inline(replication: Any) -> None:
    """Prototype of a runtime change: the replica's update runs on the worker's main thread,
    at a point of the stream chosen by the schedule (see `_UpdateFirst`), instead of on a
    background thread that competes for the core. The thread is stopped; posted transfers
    queue up and `_loop` drains them synchronously."""
    replication.close()

    def apply_due() -> None:
        replication._queue.put(None)
        replication._loop()
        replication._raise_if_failed()

    def wait_applied(iteration: int) -> None:
        if replication._applied < iteration:
            start = time.perf_counter()
            apply_due()
            replication.waited_s += time.perf_counter() - start

    replication.apply_due = apply_due
    replication.wait_applied = wait_applied


class _UpdateFirst:
    """A stream that applies the replica's pending update just before its first possible wait
    (`update_slot`): in the bubble, where eager FRC needs it anyway."""

    def __init__(self, stream: Sequence[Any], replication: Any) -> None:
        self.stream, self.replication = stream, replication
        self.slot = update_slot(stream)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[Any]:
        for i, ins in enumerate(self.stream):
            if i == self.slot:
                self.replication.apply_due()
            yield ins


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters plus optimizer state (AdamW: two moments and a step per parameter)."""
    from spotpipe.runtime.digest import optimizer_tensors

    return _nbytes(module.parameters()) + _nbytes(optimizer_tensors(optimizer))


def _fingerprint(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    from spotpipe.runtime.digest import stage_digest

    digest = stage_digest(module, optimizer)
    return digest["params"] + digest["optim"]


def _gather_digests(digest: str, world: int) -> list[str]:
    """Every rank's digest (hex digits, the same length on all), as tensors (nothing is
    unpickled)."""
    mine = torch.tensor(list(digest.encode("ascii")), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [bytes(p.tolist()).decode("ascii") for p in parts]


class RedundancyBench:
    def __init__(self, spec: dict[str, Any], rank: int, world: int) -> None:
        from spotpipe import job
        from spotpipe.model import partition
        from spotpipe.model.ties import norm_param_names
        from spotpipe.runtime.comm import Groups, PeerLink, Topology
        from spotpipe.runtime.executor import Executor, Microbatches
        from spotpipe.runtime.worker import Worker, stage_state
        from spotpipe.schedule import build_schedule

        self.spec, self.rank, self.world = spec, rank, world
        self.last = rank == world - 1
        cfgs = {mode: bench_config(spec, redundancy=mode, schedule=spec["schedule"],
                                   replica={"max_lag": spec["max_lag"]})
                for mode in MODES}
        cfg = self.cfg = cfgs["none"]
        m, b = cfg.num_microbatches, cfg.micro_batch_size
        device = self.device = torch.device("cpu")
        self.model = job.build_model(cfg)
        self.partition = [(int(a), int(e)) for a, e in partition(self.model, world, "uniform")]
        topo = Topology(world, 1)
        counts = [len(n) for n in norm_param_names(self.model, self.partition)]
        self.states, self.executors, self.redundancy = {}, {}, {}
        for mode in MODES:
            # the worker's own construction: stage, groups, replica and its replication; a
            # stage shares its layers with the model, so each mode builds its own (same seed,
            # same initial weights)
            model = job.build_model(cfgs[mode])
            state = stage_state(model, self.partition, rank, cfgs[mode], device)
            groups = Groups(topo, rank, replication=mode != "none")
            red = None
            if mode != "none":
                host = SimpleNamespace(cfg=cfgs[mode], topo=topo, stage=rank, pipeline=0,
                                       spec=SimpleNamespace(partition=self.partition),
                                       model=model, device=device, state=state,
                                       groups=groups, digests=None)
                red = Worker._build_redundancy(host)  # type: ignore[arg-type]
                if "idle-replica-thread" in spec.get("prototypes", ()):
                    # prototype of a runtime change: the replica's update runs only when the
                    # worker's main thread leaves the core idle (Linux SCHED_IDLE, per thread)
                    os.sched_setscheduler(red.replication._thread.native_id, os.SCHED_IDLE,
                                          os.sched_param(0))
                if "inline-replica-update" in spec.get("prototypes", ()):
                    _inline(red.replication)
            self.states[mode], self.redundancy[mode] = state, red
            self.executors[mode] = Executor(
                state=state, num_stages=world, rank_of_stage=lambda s: topo.rank_of(0, s),
                link=PeerLink(device), groups=groups, num_pipelines=1,
                loss_fn=self.model.loss_fn, loss_scale_div=m, grad_clip=cfg.optimizer.grad_clip,
                norm_counts=counts, redundancy=red)
        self.plain = build_schedule(spec["schedule"], world, m)
        # eager's stream is placed by measured costs once the first profile is in
        self.streams = {"none": self.plain.streams[rank], "lazy": self.plain.streams[rank]}
        self.iteration = dict.fromkeys(MODES, 0)

        gen = torch.Generator().manual_seed(spec["seed"] + 1)
        tokens = torch.randint(0, cfg.model.gpt.vocab_size, (m * b, cfg.model.gpt.block_size + 1),
                               generator=gen)
        xs = list(tokens[:, :-1].contiguous().split(b))
        ys = list(tokens[:, 1:].contiguous().split(b))
        # the last stage also needs the inputs: FRC of its replica of stage 0 starts from them
        self.mbs = Microbatches(inputs=xs if rank in (0, world - 1) else [None] * m,
                                targets=ys if self.last else [None] * m)
        # the profile steps the optimizer on profiling gradients: the `none` stage, whose
        # weights nothing compares
        self.profiler = StageProfiler(cfg=cfg, rank=rank, world=world, state=self.states["none"],
                                      loss_fn=self.model.loss_fn, first_input=xs[0],
                                      target=ys[0], reduce=self.executors["none"].reduce_gradients,
                                      device=device)
        self.waited_in_blocks = dict.fromkeys(MODES, 0.0)
        self.op_s: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
        self.timed = dict.fromkeys(MODES, 0)
        self.activation_bytes: dict[str, int] = {}

    # ------------------------------------------------------------------ iterations

    def iterate(self, mode: str, traced: bool = False) -> float:
        t = self.iteration[mode]
        stream = self.streams[mode]
        red = self.redundancy[mode]
        if red is not None and "inline-replica-update" in self.spec.get("prototypes", ()):
            stream = _UpdateFirst(stream, red.replication)
        if traced:
            stream = TracedStream(stream, self.op_s[mode])
        result = self.executors[mode].run(stream, self.mbs, iteration=t)
        self.iteration[mode] = t + 1
        return float(result.loss_sum) if result.loss_sum is not None else float("nan")

    def drain(self, mode: str) -> None:
        """Let the replica catch up (untimed), so that one mode's background work never runs
        into the next mode's block."""
        red = self.redundancy[mode]
        if red is not None:
            red.replication.wait_applied(self.iteration[mode] - 1)
        dist.barrier()

    def block(self, mode: str, n: int) -> list[float]:
        red = self.redundancy[mode]
        before = red.replication.waited_s if red is not None else 0.0
        durations = timed_block(functools.partial(self.iterate, mode, traced=True), n)
        self.timed[mode] += n
        if red is not None:
            self.waited_in_blocks[mode] += red.replication.waited_s - before
            ex = self.executors[mode]
            self.activation_bytes[mode] = _nbytes(list(ex.frc_outputs.values())
                                                  + list(ex.kept_outputs.values()))
        self.drain(mode)
        return durations

    # ------------------------------------------------------------------ profile

    def profile(self, reps: int, samples: dict[str, list[float]]) -> None:
        """The harness's stage profile plus FRC (the eager replica's forward of one micro-batch,
        no grad) and the replica's update (apply one shipped gradient: what the background
        thread does per iteration), on a scratch copy of the replica so it stays exact."""
        from spotpipe.runtime.replica import GradientReplication, ReplicaStage

        self.profiler.profile(reps, samples)
        replica = self.redundancy["eager"].replica
        cfg, b = self.cfg, self.cfg.micro_batch_size
        if replica.index == 0:
            x = self.mbs.inputs[0]
        else:
            x = torch.randn(b, cfg.model.gpt.block_size, cfg.model.gpt.n_embd,
                            generator=torch.Generator().manual_seed(5))

        def frc() -> None:
            with torch.no_grad():
                replica.module(x)

        if not hasattr(self, "_scratch"):
            scratch = ReplicaStage.build(replica.index, replica.module, cfg, replica.device)
            self._scratch = SimpleNamespace(replica=scratch, cfg=cfg)
            n = sum(p.numel() for p in scratch.params) + len(scratch.params)
            self._flat = torch.cat([torch.randn(n - len(scratch.params)) * 1e-3,
                                    torch.ones(len(scratch.params))])

        def update() -> None:
            GradientReplication._apply_gradient(self._scratch, 0, self._flat)  # type: ignore

        dist.barrier()
        samples.setdefault("frc", []).extend(times(frc, reps))
        dist.barrier()
        samples.setdefault("replica_update", []).extend(times(update, reps))

    # ------------------------------------------------------------------ the measurement

    def measure(self) -> dict[str, Any]:
        from spotpipe.schedule import with_frc

        spec = self.spec
        out: dict[str, Any] = {}
        first = {mode: self.iterate(mode) for mode in ("none", "lazy")}
        for mode in ("none", "lazy"):
            self.drain(mode)
        samples: dict[str, list[float]] = {}
        self.profile(spec["profile_reps"], samples)
        initial = self.profiler.summary(samples, self.partition, extra=("frc", "replica_update"))
        out["initial_profile"] = initial
        costs = stage_costs(initial, frc=frc_by_stage(initial["frc_s"]))
        self.streams["eager"] = with_frc(self.plain, costs).streams[self.rank]
        # eager's iteration 0 trains on the same batch as the others' did
        first["eager"] = self.iterate("eager")
        self.drain("eager")
        out["first_loss"] = first
        for _ in range(spec["warmup"] - 1):
            for mode in MODES:
                self.iterate(mode)
                self.drain(mode)
        iter_times: dict[str, list[float]] = {mode: [] for mode in MODES}
        samples = {}
        n = spec["iters_per_round"]
        for r in range(spec["rounds"]):
            k = r % len(MODES)
            for mode in MODES[k:] + MODES[:k]:  # each mode leads a third of the rounds
                iter_times[mode] += self.block(mode, n)
            self.profile(spec["profile_reps"], samples)
        out["iter_times"] = iter_times
        out["profile"] = self.profiler.summary(samples, self.partition,
                                               extra=("frc", "replica_update"))
        out.update(self.figures())
        return out

    def figures(self) -> dict[str, Any]:
        """Memory, bytes shipped, lag, and exactness, per node (gathered on every rank)."""
        from spotpipe.runtime.replica import _flatten_grads

        own = self.states["eager"]
        red = self.redundancy["eager"]
        own_bytes = _state_bytes(own.module, own.optimizer)
        replica_bytes = _state_bytes(red.replica.module, red.replica.optimizer)
        # what this node ships per iteration: its flat gradient (with presence flags), against
        # a full state copy (parameters and optimizer state), as `sync: state` would
        for p in own.params:
            p.grad = torch.zeros_like(p)
        grad_bytes = _nbytes([_flatten_grads(own.params)])
        for p in own.params:
            p.grad = None
        mine = [float(own_bytes), float(replica_bytes), float(grad_bytes), float(own_bytes),
                float(self.activation_bytes.get("lazy", 0)),
                float(self.activation_bytes.get("eager", 0))]
        for mode in ("lazy", "eager"):
            rep = self.redundancy[mode].replication
            mine += [float(rep.max_lag_seen), rep.waited_s, self.waited_in_blocks[mode]]
        row = torch.tensor(mine, dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        names = ["own_state_bytes", "replica_state_bytes", "gradient_bytes_per_iteration",
                 "state_bytes", "lazy_activation_bytes", "eager_activation_bytes"]
        names += [f"{mode}_{k}" for mode in ("lazy", "eager")
                  for k in ("max_lag_seen", "waited_s", "waited_in_timed_s")]
        out: dict[str, Any] = {name: [r[i] for r in map(torch.Tensor.tolist, rows)]
                               for i, name in enumerate(names)}
        # exactness: each replica against its owner, per mode, and lazy against eager
        for mode in ("lazy", "eager"):
            self.redundancy[mode].replication.close()
            state, replica = self.states[mode], self.redundancy[mode].replica
            owners = _gather_digests(_fingerprint(state.module, state.optimizer), self.world)
            replicas = _gather_digests(_fingerprint(replica.module, replica.optimizer),
                                       self.world)
            # rank r holds the replica of stage r + 1
            out[f"{mode}_replicas_exact"] = all(replicas[r] == owners[(r + 1) % self.world]
                                                for r in range(self.world))
        same = [_fingerprint(self.states[m].module, self.states[m].optimizer)
                for m in ("lazy", "eager")]
        flags = torch.tensor([float(same[0] == same[1])])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        out["lazy_eager_states_identical"] = bool(flags.item() == 1.0)
        # per-instruction trace: seconds per timed iteration by op kind, per node
        from spotpipe.schedule import Op

        kinds = [op.value for op in Op]
        for mode in MODES:
            row = torch.tensor([self.op_s[mode].get(k, 0.0) / max(1, self.timed[mode])
                                for k in kinds], dtype=torch.float64)
            rows = [torch.empty_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row)
            out[f"{mode}_op_s"] = {k: [r[i] for r in map(torch.Tensor.tolist, rows)]
                                   for i, k in enumerate(kinds)
                                   if any(r[i] for r in map(torch.Tensor.tolist, rows))}
        out["iterations"] = dict(self.iteration)
        return out


def _measure(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    return RedundancyBench(spec, rank, world).measure()


if __name__ == "__main__":
    sys.exit(worker_main(_measure))
