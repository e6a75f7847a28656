"""One process of `spotpipe bench redundancy`: a pipeline stage trained four times side by side,
with redundancy none, lazy, eager and eager with FRC of every replica (`replica.frc: every`, as
Bamboo runs it), plus the profile the analytic model needs.

Started by :mod:`spotpipe.bench.redundancy` through :func:`spotpipe.bench.harness.launch`. Each
mode is its own `spotpipe.runtime.worker.Worker` (`harness.bench_worker`, store namespace
``bench-MODE``): its own stage (same initial weights), process groups, executor and, with
redundancy, its own replica of the successor stage with its `ReplicaApplier`; all train on the
same micro-batches, so the redundant modes must end bit-identical, and each replica
bit-identical to its owner.
"""

from __future__ import annotations

import functools
import queue
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.bench.harness import (StageProfiler, TracedStream, bench_config, bench_worker,
                                    gather_op_seconds, times, timed_block,
                                    worker_main)
from spotpipe.bench.redundancy import FRC_OF, MODES, REDUNDANT, REDUNDANCY_OF, update_slot


def _inline(applier: Any) -> None:
    """Prototype of a runtime change: the replica's update runs on the worker's main thread,
    at a point of the stream chosen by the schedule (see `_UpdateFirst`), instead of on the
    background thread (which runs at SCHED_IDLE on the same core). The thread is stopped;
    submitted updates queue up and `apply_due` applies them synchronously, as the applier's
    own loop would."""
    applier.close()

    def apply_due() -> None:
        while True:
            try:
                item = applier._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            iteration, kind, flat, scale, done = item
            if kind == "grad":
                applier._apply_gradient(iteration, flat, scale)
            elif kind == "state":
                applier._load_state(flat)
            if done is not None:
                done()
            with applier._cond:
                applier._applied = iteration
                applier._cond.notify_all()

    def wait_applied(iteration: int, check: Any = None) -> None:
        if applier.applied < iteration:
            start = time.perf_counter()
            apply_due()
            applier.waited_s += time.perf_counter() - start

    applier.apply_due = apply_due
    applier.wait_applied = wait_applied


class _UpdateFirst:
    """A stream that applies the replica's pending update just before its first possible wait
    (`update_slot`): in the bubble, where eager FRC needs it anyway."""

    def __init__(self, stream: Sequence[Any], applier: Any) -> None:
        self.stream, self.applier = stream, applier
        self.slot = update_slot(stream)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[Any]:
        for i, ins in enumerate(self.stream):
            if i == self.slot:
                self.applier.apply_due()
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
    def __init__(self, spec: dict[str, Any], rank: int, world: int, run_dir: Path) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.last = rank == world - 1
        cfgs = {mode: bench_config(spec, redundancy=REDUNDANCY_OF[mode], schedule=spec["schedule"],
                                   replica={"max_lag": spec["max_lag"], "frc": FRC_OF[mode]})
                for mode in MODES}
        cfg = self.cfg = cfgs["none"]
        # one runtime worker per mode, each under its own store namespace; a stage shares its
        # layers with its worker's model, so each builds its own (same seed, same weights)
        self.workers = {mode: bench_worker(cfgs[mode], rank, run_dir, namespace=f"bench-{mode}")
                        for mode in MODES}
        self.states = {mode: w.stages[rank] for mode, w in self.workers.items()}
        self.holdings = {mode: w.holding for mode, w in self.workers.items()}
        self.executors = {mode: w.executor for mode, w in self.workers.items()}
        for mode in REDUNDANT:
            if self.holdings[mode] is None:
                raise RuntimeError(f"redundancy {mode}: node{rank} holds no replica")
            if "inline-replica-update" in spec.get("prototypes", ()):
                _inline(self.holdings[mode].applier)
        self.partition = [tuple(r) for r in self.workers["none"].spec.partition]
        # every mode runs the runtime's own stream; eager's has FRC where the runtime places
        # it (`runtime.node.node_schedule`, from `model.compute_weights`: no measurement to be
        # noisy)
        self.streams = {mode: w.stream for mode, w in self.workers.items()}
        self.iteration = dict.fromkeys(MODES, 0)
        # the bench's one global batch, in iteration 0's micro-batches, every iteration; the
        # eager worker's also carry the inputs to the last stage (FRC of its replica of stage 0)
        self.mbs = {mode: w.batches(0) for mode, w in self.workers.items()}
        # the profile steps the optimizer on profiling gradients: the `none` stage, whose
        # weights nothing compares
        self.profiler = StageProfiler(cfg=cfg, rank=rank, world=world, state=self.states["none"],
                                      loss_fn=self.workers["none"].model.loss_fn,
                                      first_input=self.mbs["none"].inputs[0],
                                      target=self.mbs["none"].targets[0],
                                      reduce=self.executors["none"].reduce_gradients,
                                      comm=self.executors["none"].comm)
        self.waited_in_blocks = dict.fromkeys(MODES, 0.0)
        self.op_s: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
        self.timed = dict.fromkeys(MODES, 0)
        self.activation_bytes: dict[str, int] = {}

    # ------------------------------------------------------------------ iterations

    def iterate(self, mode: str, traced: bool = False) -> float:
        t = self.iteration[mode]
        stream = self.streams[mode]
        held = self.holdings[mode]
        if held is not None and "inline-replica-update" in self.spec.get("prototypes", ()):
            stream = _UpdateFirst(stream, held.applier)
        if traced:
            stream = TracedStream(stream, self.op_s[mode])
        ex = self.executors[mode]
        ex.set_lr(t)
        result = ex.run(stream, self.mbs[mode], t)
        self.iteration[mode] = t + 1
        return float(result.loss_sum) if result.loss_sum is not None else float("nan")

    def drain(self, mode: str) -> None:
        """Let the replica catch up (untimed: only before the timed rounds)."""
        held = self.holdings[mode]
        if held is not None:
            held.applier.drain()
        dist.barrier()

    def catch_up(self, mode: str) -> float:
        """Let the replica catch up, timed on the slower rank: the updates still queued at a
        block's end are work of that block's iterations (with max_lag 2, up to 2 of them), so
        they count against the mode, and no mode's backlog runs into the next mode's block."""
        dist.barrier()
        start = time.perf_counter()
        self.drain(mode)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item())

    def block(self, mode: str, n: int) -> tuple[list[float], float]:
        """`n` timed iterations and the timed catching-up after them."""
        held = self.holdings[mode]
        before = held.applier.waited_s if held is not None else 0.0
        durations = timed_block(functools.partial(self.iterate, mode, traced=True), n)
        self.timed[mode] += n
        if held is not None:
            self.waited_in_blocks[mode] += held.applier.waited_s - before
            ex = self.executors[mode]
            self.activation_bytes[mode] = ex.kept_bytes
        return durations, self.catch_up(mode)

    # ------------------------------------------------------------------ profile

    def profile(self, reps: int, samples: dict[str, list[float]]) -> None:
        """The harness's stage profile plus FRC (the eager replica's forward of one micro-batch,
        no grad) and the replica's update (apply one shipped gradient: what the background
        thread does per iteration), on a scratch copy of the replica so it stays exact."""
        from spotpipe.runtime.replica import ReplicaApplier, ReplicaStage

        self.profiler.profile(reps, samples)
        replica = self.holdings["eager_every"].replica
        cfg, b = self.cfg, self.cfg.micro_batch_size
        if replica.index == 0:
            x = self.mbs["eager_every"].inputs[0]
        else:
            x = torch.randn(b, cfg.model.gpt.block_size, cfg.model.gpt.n_embd,
                            generator=torch.Generator().manual_seed(5))

        def frc() -> None:
            with torch.no_grad():
                replica.module(x)

        if not hasattr(self, "_scratch"):
            scratch = ReplicaStage.build(replica.index, replica.module, cfg, replica.device)
            # the applier's own update step, called here on the main thread: its background
            # thread is stopped at once
            self._scratch = ReplicaApplier(scratch, cfg, None)
            self._scratch.close()
            n = scratch.grad_message_size()
            self._flat = torch.cat([torch.randn(n - len(scratch.params)) * 1e-3,
                                    torch.ones(len(scratch.params))])

        def update() -> None:
            self._scratch._apply_gradient(0, self._flat)

        dist.barrier()
        samples.setdefault("frc", []).extend(times(frc, reps))
        dist.barrier()
        samples.setdefault("replica_update", []).extend(times(update, reps))

    # ------------------------------------------------------------------ the measurement

    def measure(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {f"{mode}_streams": self.eager_streams(mode)
                               for mode in ("eager", "eager_every")}
        # iteration 0 of every mode trains on the same batch from the same weights
        first = {}
        for mode in MODES:
            first[mode] = self.iterate(mode)
            self.drain(mode)
        out["first_loss"] = first
        for _ in range(spec["warmup"] - 1):
            for mode in MODES:
                self.iterate(mode)
                self.drain(mode)
        iter_times: dict[str, list[float]] = {mode: [] for mode in MODES}
        catch_up: dict[str, list[float]] = {mode: [] for mode in MODES}
        samples: dict[str, list[float]] = {}
        n = spec["iters_per_round"]
        for r in range(spec["rounds"]):
            k = r % len(MODES)
            for mode in MODES[k:] + MODES[:k]:  # each mode leads a share of the rounds
                durations, caught_up = self.block(mode, n)
                iter_times[mode] += durations
                catch_up[mode].append(caught_up)
            self.profile(spec["profile_reps"], samples)
        out["iter_times"] = iter_times
        out["catch_up_s"] = catch_up
        out["profile"] = self.profiler.summary(samples, self.partition,
                                               extra=("frc", "replica_update"))
        out.update(self.figures())
        return out

    def eager_streams(self, mode: str) -> list[list[list[Any]]]:
        """Every node's stream in an eager mode as the runtime places it, in stage order (for
        the model to time the placement that ran): [op, stage, mb, peer] per instruction."""
        from spotpipe.runtime import node as nodelib

        w = self.workers[mode]
        owners = [w.layout.owner(0, s) for s in range(w.layout.num_stages)]
        return [[[i.op.value, i.stage, i.mb, i.peer]
                 for i in nodelib.node_schedule(w.cfg, w.layout, n, w.model, w.spec.partition)]
                for n in owners]

    def figures(self) -> dict[str, Any]:
        """Memory, bytes shipped, lag, and exactness, per node (gathered on every rank)."""
        from spotpipe.runtime.replica import flatten_grads

        own = self.states["eager"]
        held = self.holdings["eager"]
        own_bytes = _state_bytes(own.module, own.optimizer)
        replica_bytes = _state_bytes(held.replica.module, held.replica.optimizer)
        # what this node ships per iteration: its flat gradient (with presence flags; between
        # iterations there is none, and flatten_grads ships zeros of the same size), against a
        # full state copy (parameters and optimizer state), as `sync: state` would
        grad_bytes = _nbytes([flatten_grads(own.params)])
        mine = [float(own_bytes), float(replica_bytes), float(grad_bytes), float(own_bytes)]
        mine += [float(self.activation_bytes.get(mode, 0)) for mode in REDUNDANT]
        for mode in REDUNDANT:
            applier = self.holdings[mode].applier
            mine += [float(applier.max_lag_seen), applier.waited_s, self.waited_in_blocks[mode]]
        row = torch.tensor(mine, dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        names = ["own_state_bytes", "replica_state_bytes", "gradient_bytes_per_iteration",
                 "state_bytes"] + [f"{mode}_activation_bytes" for mode in REDUNDANT]
        names += [f"{mode}_{k}" for mode in REDUNDANT
                  for k in ("max_lag_seen", "waited_s", "waited_in_timed_s")]
        out: dict[str, Any] = {name: [r[i] for r in map(torch.Tensor.tolist, rows)]
                               for i, name in enumerate(names)}
        # exactness: each replica against its owner, per mode, and the modes' states alike
        for mode in REDUNDANT:
            applier = self.holdings[mode].applier
            applier.drain()
            applier.close()
            state, replica = self.states[mode], self.holdings[mode].replica
            owners = _gather_digests(_fingerprint(state.module, state.optimizer), self.world)
            replicas = _gather_digests(_fingerprint(replica.module, replica.optimizer),
                                       self.world)
            # rank r holds the replica of stage r + 1
            out[f"{mode}_replicas_exact"] = all(replicas[r] == owners[(r + 1) % self.world]
                                                for r in range(self.world))
        same = {_fingerprint(self.states[m].module, self.states[m].optimizer)
                for m in REDUNDANT}
        flags = torch.tensor([float(len(same) == 1)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        out["lazy_eager_states_identical"] = bool(flags.item() == 1.0)
        # per-instruction trace: seconds per timed iteration by op kind, per node
        for mode in MODES:
            out[f"{mode}_op_s"] = gather_op_seconds(self.op_s[mode], self.timed[mode],
                                                    self.world)
        out["iterations"] = dict(self.iteration)
        return out


def _measure(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-") as run_dir:
        return RedundancyBench(spec, rank, world, Path(run_dir)).measure()


if __name__ == "__main__":
    sys.exit(worker_main(_measure))
