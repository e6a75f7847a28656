"""What the multi-process benchmarks share: spawning pinned workers, timing interleaved blocks of
iterations, and profiling a stage for the analytic model.

Parent side (`pinned_cores`, `launch`): the parent hosts a TCPStore and starts one process per
rank with SPOTPIPE_BENCH_SPEC (JSON) in its environment; the last rank posts its result as JSON
under ``bench/result``, a failing rank posts ``bench/error/RANK``. Worker side (`worker_main`):
each process pins itself to one core with one torch thread, joins a gloo group and runs the
benchmark. `bench_worker` builds a `spotpipe.runtime.worker.Worker` (model, stage, replica,
process groups, executor, stream) for one variant under its own store namespace, so that several
variants live side by side in one process; the default group the harness joins serves only the
benchmark's own barriers and gathers (and torch.distributed.pipelining). `timed_block` times
iterations with both ranks in step (the slower rank's clock counts) and `StageProfiler` measures
per-stage forward, backward, optimizer step, gradient reduction and one activation message, with
both ranks busy at once as in the pipeline.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from spotpipe.cluster.supervisor import huge_page_tunables, resolver_options

# the profiler's ping, on a tag no runtime message kind uses (kinds are tag // 1024)
_PING_TAG = 15 * 1024


# ---------------------------------------------------------------------- parent side

def pinned_cores(count: int = 2) -> list[int]:
    """`count` cores to pin one worker each to, when there are enough; else [] (the OS places
    them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores[:count] if len(cores) >= count else []


def launch(spec: dict[str, Any], world: int, deadline_s: float, *, worker_module: str,
           name: str) -> dict[str, Any]:
    """Run `python -m worker_module` once per rank against a store hosted here; return the last
    rank's JSON.

    Every child is killed (and reaped) on the way out, whatever happened.
    """
    from spotpipe.store.address import host_tcp_store

    # (an IPv4 listener: a dual-stack one sees every peer as a v4-mapped address whose name
    # lookup /etc/hosts does not answer, and that lookup holds the store's serving loop)
    store = host_tcp_store("127.0.0.1", 0, timedelta(seconds=spec["timeout_s"]))
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        try:
            for rank in range(world):
                # the environment of spotpipe's workers (malloc in huge pages), which the
                # engines compared in these processes share
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           GLIBC_TUNABLES=huge_page_tunables(os.environ.get("GLIBC_TUNABLES")),
                           RES_OPTIONS=resolver_options(os.environ),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           SPOTPIPE_BENCH_SPEC=json.dumps(spec), OMP_NUM_THREADS="1",
                           TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", worker_module], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logs[rank]))
            _wait(procs, deadline_s, name)
            codes = [p.returncode for p in procs]
            if any(c != 0 for c in codes) or not store.check(["bench/result"]):
                errors = [store.get(f"bench/error/{r}").decode() for r in range(world)
                          if store.check([f"bench/error/{r}"])]
                raise RuntimeError(f"bench {name}: workers failed (exit codes {codes}): "
                                   f"{'; '.join(errors) or 'no result'}\n" + _tails(logs))
            return json.loads(store.get("bench/result"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


def launch_and_summarize(spec: dict[str, Any], deadline_s: float, *, worker_module: str,
                         name: str, summarize: Callable[[dict[str, Any], dict[str, Any]],
                                                        dict[str, Any]]) -> dict[str, Any]:
    """Two pinned workers (P = 2), their result summarized, plus the wall time it all took."""
    t0 = time.perf_counter()
    raw = launch(spec, 2, deadline_s, worker_module=worker_module, name=name)
    out = summarize(raw, spec)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _wait(procs: list[subprocess.Popen], deadline_s: float, name: str) -> None:
    end = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            return  # one failed: the others would only wait for it
        if time.monotonic() > end:
            raise RuntimeError(f"bench {name}: workers still running after {deadline_s:.0f} s")
        time.sleep(0.05)


def _tails(logs: list[Any]) -> str:
    tails = []
    for rank, log in enumerate(logs):
        log.seek(0)
        text = log.read().decode(errors="replace").strip()
        if text:
            tails.append(f"--- rank {rank} stderr ---\n{text[-3000:]}")
    return "\n".join(tails)


def describe_setup(spec: dict[str, Any], partition: Any) -> str:
    """The processes and the model, for a benchmark's `config` figure."""
    g = spec["gpt"]
    return (f"P=2 D=1 gloo, 1 thread/stage pinned to cores {spec['cores'] or 'unpinned'}; "
            f"GPT n_layer={g['n_layer']} n_embd={g['n_embd']} n_head={g['n_head']} "
            f"block={g['block_size']} vocab={g['vocab_size']}, partition {partition}")


def stage_costs(profile: dict[str, Any], **extra: Any):
    """The analytic model's StageCosts from a `StageProfiler.summary` (plus e.g. frc=...)."""
    from spotpipe.schedule.timing import StageCosts

    return StageCosts(forward=tuple(profile["forward_s"]), backward=tuple(profile["backward_s"]),
                      comm=profile["comm_s"], all_reduce=max(profile["reduce_s"]),
                      optimizer=max(profile["optimizer_s"]), **extra)


# ---------------------------------------------------------------------- worker side

def bench_config(spec: dict[str, Any], **overrides: Any):
    """The Config a benchmark's stages are built from: GPT from the spec, AdamW, no clipping,
    P = 2, D = 1, gloo with one thread, data from `bench_dataset`; `overrides` are further
    top-level keys."""
    from spotpipe.config import from_dict

    m, b = spec["num_microbatches"], spec["micro_batch_size"]
    return from_dict({
        "model": {"kind": "gpt", "gpt": dict(spec["gpt"]), "partition": "uniform"},
        "data": {"kind": "factory", "factory": "spotpipe.bench.harness:bench_dataset",
                 "factory_kwargs": {"vocab_size": spec["gpt"]["vocab_size"],
                                    "block_size": spec["gpt"]["block_size"],
                                    "count": m * b, "seed": spec["seed"] + 1}},
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "grad_clip": 0.0},
        "schedule": "1f1b", "stages": 2, "pipelines": 1,
        "micro_batch_size": b, "num_microbatches": m,
        "iterations": 1, "seed": spec["seed"],
        "cluster": {"backend": "gloo", "threads_per_worker": 1,
                    "timeout_s": spec["timeout_s"]},
        **overrides,
    })


class _Tokens:
    """Samples (x, y) of one fixed tensor of random tokens."""

    def __init__(self, tokens: Any) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


def bench_dataset(vocab_size: int, block_size: int, count: int, seed: int) -> _Tokens:
    """The benchmarks' data (a `data.factory`): exactly one global batch of random tokens,
    fixed by the seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return _Tokens(torch.randint(0, vocab_size, (count, block_size + 1), generator=gen))


def bench_worker(cfg: Any, rank: int, run_dir: Any, *, namespace: str) -> Any:
    """A formed `Worker` for node `rank` of this benchmark, the runtime's own construction:
    its stages, replica (per `cfg.redundancy`), process groups under `namespace`, executor and
    stream. The benchmark drives `worker.executor.run` itself; no coordinator runs, so the
    heartbeat is stopped at once (it would only add store traffic to the timings)."""
    import torch.distributed as dist

    from spotpipe import job
    from spotpipe.checkpoint import registry, schemes
    from spotpipe.protocol import Channel, job_key
    from spotpipe.runtime.worker import Worker
    from spotpipe.store.address import StoreAddress

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=timedelta(seconds=cfg.cluster.timeout_s))
    model = job.build_model(cfg)
    profile = job.profile_model(cfg, model, job.build_dataset(cfg))
    spec = job.RunSpec(job.compute_partition(cfg, profile), cfg.global_batch, profile)
    # no coordinator runs: a key of the benchmark's own seals what the worker writes
    channel = Channel(job_key(b"bench", namespace), f"node{rank}")
    worker = Worker(cfg, spec, run_dir, f"node{rank}", store, time.time(), [],
                    address=StoreAddress("tcp", host, port), channel=channel,
                    namespace=namespace)
    # the checkpoint scheme, as the worker's entry point gives it (spotpipe.cli.worker)
    worker.checkpoints = registry.build(schemes.SchemeContext(
        cfg, worker.node, run_dir, worker.channel.event, worker.sealed, namespace,
        lambda: worker.failures, inject=worker.inject))
    worker.heartbeat.stop()
    worker._form()
    return worker


def times(fn: Callable[[], Any], reps: int,
          before: Callable[[], Any] | None = None) -> list[float]:
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def timed_block(iterate: Callable[[], Any], n: int) -> list[float]:
    """Run `iterate` n times after a barrier; each iteration's duration on the slower rank."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    stamps = [time.perf_counter()]
    for _ in range(n):
        iterate()
        stamps.append(time.perf_counter())
    durations = torch.tensor([b - a for a, b in itertools.pairwise(stamps)], dtype=torch.float64)
    dist.all_reduce(durations, op=dist.ReduceOp.MAX)  # the slower rank's clock
    return durations.tolist()


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


def gather_op_seconds(totals: dict[str, float], iterations: int,
                      world: int) -> dict[str, list[float]]:
    """`TracedStream` totals as seconds per iteration, gathered from every rank: op kind ->
    one figure per rank (kinds that no rank ran are left out). An ``iteration`` total, the
    caller's own clock around each traced iteration, is gathered too where one was kept."""
    import torch
    import torch.distributed as dist

    from spotpipe.schedule import Op

    kinds = [op.value for op in Op] + ["iteration"]
    row = torch.tensor([totals.get(k, 0.0) / max(1, iterations) for k in kinds],
                       dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    table = [r.tolist() for r in rows]
    return {k: [r[i] for r in table] for i, k in enumerate(kinds) if any(r[i] for r in table)}


class StageProfiler:
    """Samples of what the analytic model needs, for one stage: forward and backward of one
    micro-batch, optimizer step, gradient reduction, and one activation message.

    It steps the stage's optimizer on profiling gradients: profile a stage whose weights the
    benchmark does not compare afterwards.
    """

    def __init__(self, *, cfg: Any, rank: int, world: int, state: Any,
                 loss_fn: Callable[[Any, Any], Any], first_input: Any, target: Any,
                 reduce: Callable[[], Any], comm: Any) -> None:
        import torch

        self.cfg, self.rank, self.world = cfg, rank, world
        self.last = rank == world - 1
        self.state, self.loss_fn = state, loss_fn
        b, t, c = cfg.micro_batch_size, cfg.model.gpt.block_size, cfg.model.gpt.n_embd
        # stage 0 takes tokens; a later stage a hidden state of the boundary's shape
        self.x_in = (first_input if rank == 0
                     else torch.randn(b, t, c, generator=torch.Generator().manual_seed(3)))
        self.target = target
        self.reduce = reduce
        self.comm = comm  # the runtime's Comm: the activation message goes the executor's way
        self._pinged = False
        self.activation_bytes = 0

    def profile(self, reps: int, samples: dict[str, list[float]]) -> None:
        """Append `reps` samples of each figure to `samples`, with both ranks at once as in the
        pipeline (one busy core each). Call it once per round, so that the profile sees the same
        drift of the machine's speed as the timed iterations."""
        import torch
        import torch.distributed as dist

        cfg = self.cfg
        b, t, c = cfg.micro_batch_size, cfg.model.gpt.block_size, cfg.model.gpt.n_embd
        module, loss_fn, x_in, target = self.state.module, self.loss_fn, self.x_in, self.target
        m = cfg.num_microbatches

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
            samples.setdefault(key, []).extend(times(fn, reps, before))

        add("forward", forward)
        add("backward", backward, before=prepare_backward)
        add("reduce", self.reduce, before=lambda: (grads(), dist.barrier()))
        add("optimizer", step, before=grads)

        # one activation message through spotpipe's own comm: half a ping-pong's round trip
        act = torch.randn(b, t, c)
        if not self._pinged:
            self._pinged = True
            self._ping(act)  # the first message carries the shape header
        for _ in range(reps):
            samples.setdefault("comm", []).append(self._ping(act) / 2)
        self.activation_bytes = act.numel() * act.element_size()

    def _ping(self, act: Any) -> float:
        import torch.distributed as dist

        comm = self.comm
        dist.barrier()
        start = time.perf_counter()
        if self.rank == 0:
            comm.send(act, comm.nodes[1], _PING_TAG)
            comm.recv(comm.nodes[1], _PING_TAG)
        elif self.rank == 1:
            comm.send(comm.recv(comm.nodes[0], _PING_TAG), comm.nodes[0], _PING_TAG)
        rtt = time.perf_counter() - start
        comm.wait_sends()
        return rtt

    def summary(self, samples: dict[str, list[float]], partition: list[tuple[int, int]],
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Per rank medians, gathered on every rank: `KEY_s` lists indexed by rank, for the
        standard figures and for any `extra` keys the caller sampled itself."""
        import torch
        import torch.distributed as dist

        keys = ("forward", "backward", "optimizer", "reduce", "comm") + tuple(extra)
        mine = torch.tensor([statistics.median(samples[k]) for k in keys], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        rows = [p.tolist() for p in parts]
        out: dict[str, Any] = {f"{k}_s": [r[i] for r in rows] for i, k in enumerate(keys)}
        out["comm_s"] = rows[0][4]  # rank 0 timed the whole round trip
        out["activation_bytes"] = self.activation_bytes
        out["partition"] = partition
        out["samples_per_rank"] = len(samples["forward"])
        return out


def _post(store: Any, key: str, value: str) -> None:
    """Set `key` and wait for the store to hold it: a TCPStore client's set does not wait for
    the server, and the parent reads through its own connection once this process exits."""
    store.set(key, value)
    store.check([key])


def worker_main(measure: Callable[[dict[str, Any], int, int], dict[str, Any]]) -> int:
    """A benchmark worker's process: pin, join the group, run `measure(spec, rank, world)`; the
    last rank posts the result. Nothing is printed on stdout."""
    import torch
    import torch.distributed as dist

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
        result = measure(spec, rank, world)
        if rank == world - 1:  # the last stage holds the losses; times and profile are global
            _post(store, "bench/result", json.dumps(result))
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the parent
        traceback.print_exc()
        _post(store, f"bench/error/{rank}", f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
