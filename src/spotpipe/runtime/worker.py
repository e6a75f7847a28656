"""The worker process: one per node, started by the launcher (or agent) like torchrun starts one.

Environment, as torchrun sets it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK; plus
SPOTPIPE_RUN_DIR (the run's output folder, holding config.yaml and run.json written by the
launcher) and SPOTPIPE_T0 (the launcher's start time, so all records share one clock).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spotpipe.config import Config, load_config
from spotpipe.cluster.channel import WorkerChannel
from spotpipe.data import collate
from spotpipe.model import LayeredModel, build_stage
from spotpipe.model.ties import cross_stage_tied, norm_param_names
from spotpipe import job
from spotpipe.runtime.comm import Groups, PeerLink, Topology
from spotpipe.runtime.digest import DigestLog
from spotpipe.runtime.executor import Executor, Microbatches, Redundancy, StageState
from spotpipe.runtime.replica import GradientReplication, ReplicaStage
from spotpipe.runtime.optim import build_optimizer, set_lr
from spotpipe.schedule import (Schedule, StageCosts, build_schedule, holder_of, replica_of,
                               with_frc)


def stage_state(model: LayeredModel, partition: list[tuple[int, int]], stage: int, cfg: Config,
                device: torch.device) -> StageState:
    """Build stage `stage` of `model` with its optimizer and its share of the global norm."""
    start, end = partition[stage]
    module = build_stage(model, start, end).to(device)
    params = list(module.parameters())
    counted = set(norm_param_names(model, partition)[stage])
    named = dict(module.named_parameters())
    norm_params = [named[n] for n in named if n in counted]
    tied = [named[n] for n in cross_stage_tied(model, partition) if n in named]
    return StageState(stage, module, build_optimizer(params, cfg), norm_params, tied)


class Worker:
    def __init__(self, cfg: Config, spec: job.RunSpec, run_dir: Path, rank: int, world: int,
                 store: dist.Store, t0: float) -> None:
        self.cfg, self.spec, self.run_dir = cfg, spec, run_dir
        self.rank = rank
        self.topo = Topology(len(spec.partition), world // len(spec.partition))
        self.pipeline, self.stage = self.topo.coords(rank)
        self.node = f"node{rank}"
        self.channel = WorkerChannel(store, self.node, t0)
        backend = job.resolve_backend(cfg)
        self.device = job.device_for(backend, int(os.environ.get("LOCAL_RANK", rank)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, store=dist.PrefixStore("gen0", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg.cluster.timeout_s))
        self.groups = Groups(self.topo, rank, replication=cfg.redundancy != "none")
        self.model = job.build_model(cfg)
        self.dataset = job.build_dataset(cfg)
        self.sampler = job.build_sampler(cfg, self.dataset)
        self.state = stage_state(self.model, spec.partition, self.stage, cfg, self.device)
        counts = [len(n) for n in norm_param_names(self.model, spec.partition)]
        p = self.topo.num_stages
        self.digests = (DigestLog(run_dir / "logs" / f"digests.{self.node}.jsonl")
                        if cfg.logging.state_digests else None)
        self.redundancy = self._build_redundancy() if cfg.redundancy != "none" else None
        self.executor = Executor(
            state=self.state, num_stages=p,
            rank_of_stage=lambda s: self.topo.rank_of(self.pipeline, s),
            link=PeerLink(self.device), groups=self.groups, num_pipelines=self.topo.num_pipelines,
            loss_fn=self.model.loss_fn,
            loss_scale_div=cfg.num_microbatches * self.topo.num_pipelines,
            grad_clip=cfg.optimizer.grad_clip, norm_counts=counts, redundancy=self.redundancy,
            digests=self.digests)
        self.stream = self._schedule().streams[self.stage]
        self.sample_log = None
        if cfg.logging.sample_log and self.stage == p - 1:
            (run_dir / "logs").mkdir(exist_ok=True)
            self.sample_log = open(run_dir / "logs" / f"samples.{self.node}.jsonl", "a")

    def _build_redundancy(self) -> Redundancy:
        cfg, p = self.cfg, self.topo.num_stages
        index = replica_of(self.stage, p)
        start, end = self.spec.partition[index]
        device = self.device if cfg.replica.device == "device" else torch.device("cpu")
        replica = ReplicaStage.build(index, build_stage(self.model, start, end), cfg, device)
        replication = GradientReplication(
            cfg=cfg, own_params=self.state.params, own_optimizer=self.state.optimizer,
            replica=replica,
            send_to=self.topo.rank_of(self.pipeline, holder_of(self.stage, p)),
            send_group=self.groups.replica_send,
            recv_from=self.topo.rank_of(self.pipeline, index),
            recv_group=self.groups.replica_recv, digests=self.digests)
        return Redundancy(cfg.redundancy, replica, replication, cfg.replica.offload_frc)

    def _schedule(self) -> Schedule:
        """The plain schedule, or with FRC placed in its bubbles by the timing model.

        Placement needs per-stage costs: the stages' parameter counts stand in for their
        forward cost (backward taken as twice that), which is what decides how many FRCs fit
        in a bubble when stages are unequal.
        """
        cfg, p = self.cfg, self.topo.num_stages
        schedule = build_schedule(cfg.schedule, p, cfg.num_microbatches)
        if cfg.redundancy != "eager":
            return schedule
        sizes = [max(1, sum(x.numel() for i in range(a, b)
                            for x in self.model.layers[i].parameters()))
                 for a, b in self.spec.partition]
        costs = StageCosts(tuple(float(n) for n in sizes), tuple(2.0 * n for n in sizes))
        return with_frc(schedule, costs)

    def batches(self, iteration: int) -> tuple[Microbatches, list[list[int]]]:
        p, m = self.topo.num_stages, self.cfg.num_microbatches
        indices = self.sampler.pipeline_microbatches(iteration, self.pipeline,
                                                     self.topo.num_pipelines, m)
        inputs: list[torch.Tensor | None] = [None] * m
        targets: list[torch.Tensor | None] = [None] * m
        # the last stage also needs inputs for FRC of its replica of stage 0
        wants_inputs = self.stage == 0 or (self.stage == p - 1 and self.cfg.redundancy == "eager")
        if self.stage == 0 or self.stage == p - 1:
            for k, idx in enumerate(indices):
                x, y = collate(self.dataset, idx)
                if wants_inputs:
                    inputs[k] = x.to(self.device)
                if self.stage == p - 1:
                    targets[k] = y.to(self.device)
        return Microbatches(inputs, targets), indices

    def train(self) -> None:
        cfg = self.cfg
        p = self.topo.num_stages
        reporter = self.stage == p - 1 and self.pipeline == 0
        last = self.stage == p - 1
        self.channel.event("worker_ready", pipeline=self.pipeline, stage=self.stage,
                           layers=list(self.spec.partition[self.stage]))
        samples = 0
        for t in range(cfg.iterations):
            t_start = time.perf_counter()
            lr = set_lr(self.state.optimizer, cfg, t)
            batches, indices = self.batches(t)
            result = self.executor.run(self.stream, batches, iteration=t)
            samples += cfg.global_batch
            if last:
                loss = result.loss_sum
                if self.topo.num_pipelines > 1:
                    dist.all_reduce(loss, group=self.groups.data_parallel)
                if self.sample_log is not None:
                    self.sample_log.write(json.dumps({"iter": t, "pipeline": self.pipeline,
                                                      "samples": indices}) + "\n")
                if reporter:
                    dt = time.perf_counter() - t_start
                    self.channel.metrics({
                        "iter": t, "loss": float(loss), "samples": samples,
                        "time_s": self.channel.now(), "iter_time_s": round(dt, 6),
                        "samples_per_s": round(cfg.global_batch / dt, 3), "lr": lr,
                        "grad_norm": result.grad_norm, "live_nodes": self.topo.world_size,
                        "generation": 0,
                        **({"replica_lag": self.redundancy.replication.lag(t)}
                           if self.redundancy is not None else {})})
        if self.sample_log is not None:
            self.sample_log.close()
        if self.redundancy is not None:
            self.redundancy.replication.close()
            self.channel.event("replica_done", stage=self.redundancy.replica.index,
                               max_lag=self.redundancy.replication.max_lag_seen,
                               waited_s=round(self.redundancy.replication.waited_s, 6))
        if self.digests is not None:
            self.digests.close()
        self.save_final()
        self.channel.event("worker_done", pipeline=self.pipeline, stage=self.stage)

    def save_final(self) -> None:
        """Pipeline 0 writes its stage; the launcher merges the stages into model.safetensors."""
        if self.pipeline != 0:
            return
        out = self.run_dir / "final"
        out.mkdir(exist_ok=True)
        # clone: tied tensors share storage, which safetensors refuses to write twice
        tensors = {k: v.detach().to("cpu").contiguous().clone()
                   for k, v in self.state.module.state_dict().items()}
        save_file(tensors, str(out / f".stage{self.stage}.safetensors.tmp"))
        os.replace(out / f".stage{self.stage}.safetensors.tmp",
                   out / f"stage{self.stage}.safetensors")


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(os.environ["SPOTPIPE_RUN_DIR"])
    t0 = float(os.environ.get("SPOTPIPE_T0", time.time()))
    cfg = load_config(run_dir / "config.yaml")
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    spec = job.RunSpec.from_json(json.loads((run_dir / "run.json").read_text()))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=cfg.cluster.timeout_s))
    channel = WorkerChannel(store, f"node{rank}", t0)
    try:
        worker = Worker(cfg, spec, run_dir, rank, world, store, t0)
        worker.train()
    except Exception as exc:  # reported to the launcher, which stops the job with the message
        traceback.print_exc()
        channel.event("worker_error", message=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every file is closed and every record posted by now. Interpreter teardown of torch and
    # gloo takes seconds on a small machine and decides nothing, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
