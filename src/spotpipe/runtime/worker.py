"""The worker process: one per node, started by the launcher (or agent) as torchrun starts one.

Environment, as torchrun sets it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK; plus
SPOTPIPE_STORE and SPOTPIPE_STORE_PREFIX (tcp, or etcd at MASTER_ADDR:MASTER_PORT with the
job's key prefix), SPOTPIPE_RUN_DIR (the run's output folder, holding config.yaml and
run.json written by the launcher), SPOTPIPE_T0 (the launcher's start time, so all records
share one clock) and SPOTPIPE_FAULTS (injected faults, JSON).

The worker trains generation by generation. Within a generation the layout is fixed; a failure
or a notice ends it: the worker reports where it stands, waits for the plan that the launcher's
coordinator computes with `spotpipe.plan`, carries it out in memory (finish or drop the
in-flight iteration, promote a replica) and starts the next generation under a new store prefix.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spotpipe import job
from spotpipe.cluster.channel import WorkerChannel
from spotpipe.cluster.membership import (AbortWatcher, Heartbeat, KeyWatcher, NoticeWatcher,
                                         abort_key, client, join_key, plan_key, regroup_key)
from spotpipe.checkpoint import durable, schemes
from spotpipe.cluster.store import StoreAddress
from spotpipe.config import Config, load_config
from spotpipe.data import collate
from spotpipe.model import build_stage
from spotpipe.plan import Layout, held_replica, layer_plan
from spotpipe.runtime import migrate
from spotpipe.runtime import node as nodelib
from spotpipe.runtime.comm import AbortSignal, Comm, PeerFailure
from spotpipe.runtime.digest import DigestLog
from spotpipe.runtime.executor import Executor, Holding, Microbatches, StageState
from spotpipe.runtime.faults import Fault, Injector
from spotpipe.runtime.optim import build_optimizer
from spotpipe.runtime.replica import ReplicaApplier, ReplicaStage
from spotpipe.runtime.shadow_link import ShadowWriter
from spotpipe.schedule import Op
from spotpipe.schedule.replay import done_from, rest_of_iteration


class Leave(Exception):
    """A node got a preemption notice; the job reshapes at this iteration boundary."""


class JobStopped(Exception):
    """The coordinator decided the job cannot go on (e.g. adjacent stages lost)."""


class JoinRefused(Exception):
    """The job refused this node (token, model or configuration differ)."""


class Worker:
    def __init__(self, cfg: Config, spec: job.RunSpec, run_dir: Path, node: str,
                 store: dist.Store, t0: float, faults: list[Fault], *, address: StoreAddress,
                 namespace: str = "spotpipe") -> None:
        """`namespace` prefixes this job's keys in the store, so that several jobs (e.g. the
        variants a benchmark compares) can share one store."""
        self.cfg, self.spec, self.run_dir, self.node = cfg, spec, run_dir, node
        self.namespace = namespace
        self.address = address
        self.store = store
        self.t0 = t0
        self.channel = WorkerChannel(store, node, t0)
        self.backend = job.resolve_backend(cfg)
        self.device = job.device_for(self.backend, int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = job.build_model(cfg)
        self.dataset = job.build_dataset(cfg)
        self.sampler = job.build_sampler(cfg, self.dataset)
        self.layout = Layout.build(cfg.stages, cfg.pipelines,
                                   [f"node{r}" for r in range(cfg.stages * cfg.pipelines)])
        self.generation = 0
        self.digests = (DigestLog(run_dir / "logs" / f"digests.{node}.jsonl")
                        if cfg.logging.state_digests else None)
        self.stages: dict[int, StageState] = {
            s: nodelib.build_stage_state(self.model, spec.partition, s, cfg, self.device)
            for s in nodelib.owned_stages(self.layout, node)}
        self.holding = self._build_holding()
        self.start_iteration = 0
        self.failures = 0  # failures and notices this node has recovered from
        self.checkpoints = schemes.build(schemes.SchemeContext(
            cfg, node, run_dir, self.channel.event, store, namespace, lambda: self.failures,
            inject=lambda phase, iteration: self.inject(phase, iteration),
            upload=os.environ.get("SPOTPIPE_CHECKPOINT_UPLOAD") == "1"))
        resume = os.environ.get("SPOTPIPE_RESUME")
        if resume:
            self._restore(Path(resume))
        self.sample_log: TextIO | None = None
        self.inject = Injector(faults, node, lambda f: self.channel.event(
            "fault_injected", fault=f.kind, iteration=f.iteration, phase=f.phase))
        self.inject.poison = self._poison_gradient
        # "{node}" in a URL is replaced by the node's name (one metadata service per host in
        # the cloud; one loopback server for all nodes in tests)
        self.notices = NoticeWatcher(aws_url=cfg.failover.aws_notice_url.replace("{node}", node),
                                     gcp_url=cfg.failover.gcp_notice_url.replace("{node}", node),
                                     poll_s=cfg.failover.notice_poll_s,
                                     on_notice=lambda src: self.channel.event("notice",
                                                                              source=src))
        timeout = cfg.cluster.timeout_s
        self.executor: Executor | None = None
        self.bytes_received = 0  # state received in the last change of layout
        self.shadow = (ShadowWriter(store, namespace, node, max_lag=cfg.shadow.max_lag,
                                    timeout_s=timeout) if cfg.shadow.enabled else None)
        self.heartbeat = Heartbeat(client(address, timeout), node, cfg.failover.heartbeat_s,
                                   self._progress)

    # ------------------------------------------------------------------ state

    def _build_holding(self) -> Holding | None:
        if self.cfg.redundancy == "none":
            return None
        index = nodelib.held_replica(self.layout, self.node)
        if index is None:
            return None
        start, end = self.spec.partition[index]
        device = self.device if self.cfg.replica.device == "device" else torch.device("cpu")
        replica = ReplicaStage.build(index, build_stage(self.model, start, end), self.cfg, device)
        d = nodelib.pipeline_of(self.layout, self.node)
        return Holding(replica, ReplicaApplier(replica, self.cfg, self.digests),
                       self.layout.owner(d, index))

    def _restore(self, path: Path) -> None:
        """Load owned stages and the held replica from a durable checkpoint (any P x D)."""
        ckpt = durable.verify(path)
        for state in self.stages.values():
            durable.load_stage(ckpt, state.module, state.optimizer)
        if self.holding is not None:
            durable.load_stage(ckpt, self.holding.replica.module, self.holding.replica.optimizer)
            self.holding.applier.start_at(ckpt.next_iteration)
        self.start_iteration = ckpt.next_iteration
        self.channel.event("restored", checkpoint=str(path), iteration=ckpt.next_iteration,
                           stages=sorted(self.stages))

    def _poison_gradient(self) -> None:
        """An injected `nan`: one gradient element of this node's first stage becomes NaN
        (replaced, not changed in place, as the executor keeps the local gradients)."""
        for s in sorted(self.stages):
            for p in self.stages[s].params:
                if p.grad is not None:
                    poisoned = p.grad.clone()
                    poisoned.view(-1)[0] = float("nan")
                    p.grad = poisoned
                    return

    def _checkpoint(self, iteration: int) -> None:
        """The checkpoint scheme's turn at the end of an iteration; pipeline 0's owners write
        their stages (spotpipe.checkpoint.schemes)."""
        mine = {s: (state.module, state.optimizer) for s, state in sorted(self.stages.items())
                if self.layout.owner(0, s) == self.node}
        self.checkpoints.after_iteration(schemes.Boundary(iteration, mine, self.executor.comm,
                                                          self.layout))

    def _progress(self) -> dict[str, Any]:
        ex = self.executor
        if ex is None:
            return {"state": "starting", "generation": self.generation}
        busy = (not ex.comm.waiter.waiting and not self._recovering
                and not (self.shadow is not None and self.shadow.waiting))
        return {"state": "busy" if busy else "waiting", "generation": self.generation,
                "iteration": ex.iteration, "position": ex.position}

    _recovering = False
    rest: list | None = None  # after a takeover: the rest of the in-flight iteration

    def _open_comm(self) -> Comm:
        """The generation's process groups among the nodes of the current layout."""
        nodes = sorted(self.layout.active_nodes, key=lambda n: int(n[4:]) if n[4:].isdigit()
                       else n)
        # each watcher blocks in its own store connection (a waiting client serves no one
        # else); a generation that ended at an iteration boundary was never aborted, and the
        # coordinator sets its abort key only with the plan, so its watcher may still be waiting
        abort = AbortSignal()
        AbortWatcher(client(self.address, self.cfg.cluster.timeout_s), self.generation,
                     abort)
        self.regroup = threading.Event()
        KeyWatcher(client(self.address, self.cfg.cluster.timeout_s),
                   regroup_key(self.generation), self.regroup.set)
        # the groups form over a connection of their own (see Comm._form_groups)
        return Comm(store=client(self.address, self.cfg.cluster.timeout_s),
                    generation=self.generation, nodes=nodes, me=self.node,
                    namespace=self.namespace,
                    stage_members=nodelib.stage_members(self.layout), backend=self.backend,
                    device=self.device, timeout_s=self.cfg.cluster.timeout_s, abort=abort)

    def _form(self, comm: Comm | None = None) -> None:
        """Start a generation: groups among the live nodes, the wiring, the stream."""
        comm = comm or self._open_comm()
        nodes = comm.nodes
        wiring = nodelib.wiring(self.layout, self.node, nodes, self.model, self.spec.partition,
                                redundancy=self.cfg.redundancy != "none")
        if self.cfg.logging.sample_log and self.layout.num_stages - 1 in self.stages \
                and self.sample_log is None:
            (self.run_dir / "logs").mkdir(exist_ok=True)
            self.sample_log = open(self.run_dir / "logs" / f"samples.{self.node}.jsonl", "a")
        previous = self.executor
        self.executor = Executor(
            cfg=self.cfg, me=self.node, stages=self.stages, wiring=wiring, comm=comm,
            loss_fn=self.model.loss_fn,
            loss_scale_div=nodelib.microbatches(self.cfg, self.layout) * self.layout.num_pipelines,
            holding=self.holding, digests=self.digests, sample_log=self.sample_log,
            hook=self.inject, shadow=self.shadow)
        if previous is not None:  # (a node back from standby starts where the plan resumes)
            self.executor.committed_through = max(previous.committed_through,
                                                  self.start_iteration - 1)
            self.executor.stepped_through = max(previous.stepped_through,
                                                self.start_iteration - 1)
        else:
            self.executor.committed_through = self.start_iteration - 1
            self.executor.stepped_through = self.start_iteration - 1
        self.stream = nodelib.node_schedule(self.cfg, self.layout, self.node, self.model,
                                            self.spec.partition)

    def batches(self, iteration: int) -> Microbatches:
        p, m = self.layout.num_stages, nodelib.microbatches(self.cfg, self.layout)
        d = nodelib.pipeline_of(self.layout, self.node)
        indices = self.sampler.pipeline_microbatches(iteration, d, self.layout.num_pipelines, m)
        frc_zero = (self.cfg.redundancy == "eager" and self.holding is not None
                    and self.holding.replica.index == 0)
        want_x = 0 in self.stages or frc_zero
        want_y = p - 1 in self.stages
        inputs: list[torch.Tensor | None] = [None] * m
        targets: list[torch.Tensor | None] = [None] * m
        if want_x or want_y:
            for k, idx in enumerate(indices):
                x, y = collate(self.dataset, idx)
                inputs[k] = x.to(self.device) if want_x else None
                targets[k] = y.to(self.device) if want_y else None
        return Microbatches(inputs, targets, indices)

    # ------------------------------------------------------------------ training

    def join(self) -> int:
        """A node arriving in a running job: present the token and the configuration, wait to
        be placed, receive its state from peers; return the iteration to start at."""
        # The first optimizer a process builds costs it over a second (torch imports its
        # compiler hooks lazily), and the job would wait for that while the node takes its
        # stage; pay it while booting, as the nodes that started with the job did.
        build_optimizer([torch.nn.Parameter(torch.zeros(1, device=self.device))], self.cfg)
        gate = f"spotpipe/join_gate/{self.node}"
        if os.environ.get("SPOTPIPE_JOIN_GATED") == "1":  # started early by the local launcher
            self.store.wait([gate], timedelta(days=7))
        self._ask_to_join()
        return self._await_placement()

    def _ask_to_join(self) -> None:
        self.channel._post({
            "type": "join", "node": self.node, "time_s": self.channel.now(),
            "token": os.environ.get("SPOTPIPE_JOIN_TOKEN", ""),
            "config_digest": self.cfg.digest(), "model_digest": self.cfg.model_digest()})

    def _await_placement(self) -> int:
        """Wait on standby until a plan places this node (-1: the job ended first). The answer
        is taken out of the store, so that a node placed, put on standby and placed again
        waits for its new answer."""
        self._recovering = True
        key = join_key(self.node)
        self.store.wait([key], timedelta(days=7))
        answer = json.loads(self.store.get(key))
        self.store.delete_key(key)
        if "refused" in answer:
            raise JoinRefused(answer["refused"])
        if "finished" in answer:
            return -1
        g = int(answer["generation"])
        plan = json.loads(self.store.get(plan_key(g)))
        self.layout = Layout.from_json(plan["previous_layout"])
        resume = int(plan["resume"])
        self.start_iteration = resume
        try:
            return self._apply_plan(plan, resume)
        except PeerFailure as why:  # a peer lost while this node was being placed
            self.formed = False
            return self.recover(why)

    def train(self, joining: bool = False) -> None:
        cfg = self.cfg
        if joining:
            if self.join() < 0:
                self.heartbeat.stop()
                return
        else:
            self._form()
            self._recovering = True  # waiting on the shadows, not computing (heartbeat)
            self._relink(self.start_iteration, set())
            self._recovering = False
        d = nodelib.pipeline_of(self.layout, self.node)
        self.channel.event("worker_ready", pipeline=d, stages=sorted(self.stages),
                           layers=[list(self.spec.partition[s]) for s in sorted(self.stages)],
                           joined=joining)
        t = self.start_iteration
        resumed_at: float | None = None
        while t < cfg.iterations:
            ex = self.executor
            try:
                self.inject("start", t)
                t_start = time.perf_counter()
                lr = ex.set_lr(t)
                stream = self.rest if self.rest is not None else self.stream
                self.rest = None
                result = ex.run(stream, self.batches(t), t,
                                leaving=lambda: self.notices.is_set() or self.regroup.is_set())
                self._report(t, result, lr, time.perf_counter() - t_start)
                self._checkpoint(t)
                if resumed_at is not None:
                    self.channel.event("resumed", generation=self.generation, iteration=t,
                                       pause_end_s=self.channel.now())
                    resumed_at = None
                t += 1
                if result.leave_requested:
                    raise Leave("the layout changes at this iteration boundary (a notice or a "
                                "joining node)")
            except (PeerFailure, Leave) as why:
                if isinstance(why, PeerFailure) or self.notices.is_set():
                    self.failures += 1
                t = self.recover(why)
                if t < 0:
                    return  # this node left the job
                resumed_at = time.time()
        self._finish()

    def _report(self, t: int, result: Any, lr: float, dt: float) -> None:
        p = self.layout.num_stages
        if p - 1 not in self.stages:
            return
        loss = result.loss_sum
        self.executor.comm.all_reduce_dp(p - 1, loss)
        if self.layout.owner(0, p - 1) != self.node:
            return
        cfg = self.cfg
        if result.skipped_stage is not None:  # one node says it; every node skipped alike
            self.channel.event("step_skipped", iteration=t, stage=result.skipped_stage,
                               grad_norm=result.grad_norm, loss=float(loss))
        self.channel.metrics({
            "iter": t, "loss": float(loss), "samples": (t + 1) * cfg.global_batch,
            "time_s": self.channel.now(), "iter_time_s": round(dt, 6),
            "samples_per_s": round(cfg.global_batch / dt, 3), "lr": lr,
            "grad_norm": result.grad_norm, "live_nodes": len(self.layout.active_nodes),
            "carriers": len(self.layout.carriers()), "generation": self.generation,
            **({"replica_lag": self.holding.applier.lag(t)} if self.holding else {})})

    # ------------------------------------------------------------------ recovery

    # what this node was to receive under the plan it is carrying out and does not hold yet
    # (stages, replicas); non-empty only while a plan is carried out, or after one failed
    lacking: list[str] = []
    formed = True  # False from a plan that failed before this node's generation formed
    # nothing of the plan being carried out has changed this node's state yet (no promotion,
    # no state received or given up): if every survivor says so, the coordinator can roll the
    # failed plan back and decide again from the layout before it
    untouched = True

    def recover(self, why: Exception) -> int:
        """Report, wait for the plan, carry it out; return the iteration to resume at (or -1
        when this node leaves the job).

        A peer may be lost while the plan is carried out (groups forming, states moving):
        then this node reports again, in the new generation, saying what it did not receive,
        and carries out the next plan, which the coordinator decides from those reports."""
        while True:
            try:
                return self._recover_once(why)
            except PeerFailure as again:
                self.formed = False
                why = again

    def _where(self) -> dict[str, Any]:
        """Where this node stands, for its report after a failure."""
        ex = self.executor
        if ex is None:  # a joining node whose placement failed: it has committed nothing
            return {"iteration": -1, "position": 0, "instruction": "", "committed_through": -1,
                    "stepped_through": -1, "done": [], "clip_scale": None, "flight": -1}
        return {
            "iteration": ex.iteration, "position": ex.position,
            "instruction": (str(ex.current[ex.position]) if ex.position < len(ex.current)
                            else ""),
            "committed_through": ex.committed_through, "stepped_through": ex.stepped_through,
            # what this node finished of the iteration in flight: the plan's rest builds on it
            "done": ex.flight.done_list() if ex.flight is not None else [],
            # the committed iteration's clipping scale: a new shadow writer brings it along
            "clip_scale": ex.committed_clip_scale,
            "flight": ex.flight.iteration if ex.flight is not None else -1}

    def _recover_once(self, why: Exception) -> int:
        self._recovering = True
        ex = self.executor
        g = self.generation
        # a node with a notice leaves, whether it saw the commit's flag or was woken by the
        # abort of a faster node first
        leaving = self.notices.is_set()
        boundary = isinstance(why, Leave)  # every node saw the same flag: no one to wake
        if not boundary:
            self.store.set(abort_key(g), f"{self.node}: {why}")
        flight = ex.flight if ex is not None else None
        self.channel._post({
            "type": "report", "generation": g, "node": self.node, "boundary": boundary,
            **self._where(),
            # after a plan this node could not carry out: what it misses (the coordinator
            # counts it out of the layout; it joins again) and that nothing in flight is kept
            "formed": self.formed, "lacking": self.lacking, "untouched": self.untouched,
            "leaving": leaving, "reason": str(why)[:300], "time_s": self.channel.now()})
        self.formed = True
        self.store.wait([plan_key(g)], timedelta(seconds=self.cfg.cluster.timeout_s * 4))
        plan = json.loads(self.store.get(plan_key(g)))
        if plan["action"] == "stop":
            raise JobStopped(plan["message"])
        new_layout = Layout.from_json(plan["layout"])
        resume = int(plan["resume"])
        # finish the committed iteration; drop the one in flight, unless the plan continues it
        if ex is not None and ex.stepped_through < resume - 1:
            ex.step(resume - 1)
        salvage = "salvage" in plan and flight is not None and flight.iteration == resume
        if salvage:
            ex.abandon_messages()
        elif ex is not None:
            ex.discard()
        if self.node in new_layout.standby:  # e.g. one node more than the new depth needs
            self.channel.event("standby", generation=plan["generation"])
            return self._wait_unplaced()
        if self.node not in new_layout.active_nodes:
            if self.lacking:
                # counted out for what it missed: it holds states the job no longer counts
                # on, and comes back as a new node (placed at a later boundary)
                self.channel.event("rejoining", generation=plan["generation"],
                                   lacked=self.lacking)
                self._ask_to_join()
                return self._wait_unplaced()
            self._finish(left=True)
            return -1
        return self._apply_plan(plan, resume)

    def _wait_unplaced(self) -> int:
        """Drop every state (the plan that places this node again sends it whatever it will
        run) and wait to be placed; -1 when the job ended first."""
        if self.holding is not None:
            self.holding.applier.close()
            self.holding = None
        self.stages = {}
        self.lacking = []
        resume = self._await_placement()
        if resume < 0:
            self._finish(left=True)
        return resume

    def _apply_plan(self, plan: dict[str, Any], resume: int) -> int:
        """Carry out a plan in memory: promote replicas, move stage and replica states peer to
        peer, then start the new generation."""
        started = time.perf_counter()
        # (the layout the plan starts from: after a failed plan was rolled back, not the one
        # this node was last carrying out)
        old = Layout.from_json(plan["previous_layout"])
        new_layout = Layout.from_json(plan["layout"])
        self.untouched = True
        repartition = plan["action"] == "repartition"
        if "partition" in plan and not repartition:  # a joiner learns the job's current depth
            self.spec = dataclasses.replace(self.spec, partition=[tuple(r) for r in
                                                                  plan["partition"]])
        promoted_nodes = {m["dst"] for m in plan["moves"] if m["kind"] == "promote"}
        promoted = []
        for move in plan["moves"]:
            if move["kind"] == "promote" and move["dst"] == self.node:
                self.untouched = False
                self._promote(move["stage"], resume)
                promoted.append(move["stage"])
        copies = [m for m in plan["moves"] if m["kind"] == "copy"]
        moves = [] if repartition else migrate.transfers(old, new_layout, copies, promoted_nodes)
        if self.cfg.redundancy == "none":  # nobody holds replicas: only stages move
            moves = [t for t in moves if t.kind != "replica"]
        self.layout = new_layout
        self.generation = plan["generation"]
        # shadows are fed by pipeline 0's owners: those restore from them; a lost stage of
        # another pipeline is the same state (data parallel), copied from pipeline 0's owner
        # once that one holds it
        restores = [m for m in plan["moves"] if m["kind"] == "restore"]
        self.lacking = ([f"stage {s}" for s in nodelib.owned_stages(new_layout, self.node)]
                        if repartition else
                        [f"{t.kind} {t.stage}" for t in moves if t.dst == self.node]
                        + [f"stage {m['stage']}" for m in restores if m["dst"] == self.node])
        self.inject("regroup", resume)
        comm = self._open_comm()
        formed = time.perf_counter()
        if repartition or self.lacking or any(self.node in (t.src, t.dst) for t in moves):
            self.inject("transfer", resume)  # (only a plan that moves this node's state)
        held = ({s: id(st) for s, st in self.stages.items()}, id(self.holding))
        moved = (self._repartition(plan, old, comm, resume) if repartition
                 else self._migrate(moves, comm, resume))
        self.untouched = self.untouched and held == (
            {s: id(st) for s, st in self.stages.items()}, id(self.holding))
        exchanged = time.perf_counter()
        restored = sorted(m["stage"] for m in restores
                          if m["dst"] == self.node and m["pipeline"] == 0)
        if restored:
            self.untouched = False
        for s in restored:
            self.stages[s] = nodelib.build_stage_state(self.model, self.spec.partition, s,
                                                       self.cfg, self.device)
        self._relink(resume, set(restored), plan.get("clip_scale"))
        moved += [f"stage {s} from its shadow" for s in restored]
        copies_after = [migrate.Transfer("stage", m["stage"], new_layout.owner(0, m["stage"]),
                                         m["dst"]) for m in restores if m["pipeline"] != 0]
        if copies_after:
            self.untouched = False
            before = self.bytes_received
            moved += self._migrate(copies_after, comm, resume)
            self.bytes_received += before
        # kept only when `recover` took the plan to continue it (a joiner has none)
        flight = self.executor.flight if self.executor is not None else None
        self._form(comm)
        self.lacking = []
        if flight is not None:
            self.executor.flight = flight
            self.rest = self._rest_of_iteration(plan, promoted, flight)
        self._recovering = False
        kind = "takeover" if promoted else ("migrated" if moved else "regrouped")
        rest = ({"rest": {"instructions": len(self.rest), "of": len(self.stream),
                          "brc": sum(i.op == Op.BRC_BACKWARD for i in self.rest)}}
                if self.rest is not None else {})
        self.channel.event("repartitioned" if repartition else kind,
                           generation=self.generation, stages=sorted(self.stages),
                           promoted=promoted, received=moved, resume=resume,
                           bytes_received=self.bytes_received,
                           regroup_s=round(time.perf_counter() - started, 6), **rest,
                           **({"depth": new_layout.num_stages,
                               "layers": [list(self.spec.partition[s]) for s in
                                          sorted(self.stages)],
                               "groups_s": round(formed - started, 6),
                               "exchange_s": round(exchanged - formed, 6)}
                              if repartition else {}))
        return resume

    def _rest_of_iteration(self, plan: dict[str, Any], promoted: list[int],
                           flight: Any) -> list:
        """This node's share of the in-flight iteration still to run after a takeover: what
        it finished stays, the promoted stages are redone (FRC outputs sent, BRC), and sends
        its peers already received are left out (`spotpipe.schedule.replay`)."""
        done = {n: done_from(entries) for n, entries in plan["salvage"].items()}
        d = nodelib.pipeline_of(self.layout, self.node)
        frc: dict[int, list[int]] = {}
        for stage, mb in flight.frc_outputs:
            frc.setdefault(stage, []).append(mb)
        return rest_of_iteration(
            self.stream, done.get(self.node, frozenset()),
            lambda q: done.get(self.layout.owner(d, q), frozenset()), fresh=promoted,
            frc_ready=frc, last_stage=self.layout.num_stages - 1)

    def _commit_exchange(self, comm: Comm) -> None:
        """Switch to the new partition only once every node of it holds its new layers.

        A re-partition cut short by a loss must leave the nodes either all on the old
        partition (the coordinator then rolls the plan back) or all on the new one, never
        mixed. Each node marks in the store that its exchange is complete, then waits for
        every mark; the last mark written is the commit point. A node woken by the abort
        before it saw every mark looks once more: if they are all there, every node holds its
        new state and it switches over too."""
        prefix = f"{self.namespace}/gen{self.generation}/exchanged"
        nodes = sorted(self.layout.active_nodes)
        self.store.set(f"{prefix}/{self.node}", "1")
        try:
            comm.wait_keys([f"{prefix}/{node}" for node in nodes], self.cfg.cluster.timeout_s,
                           "every node's exchange")
        except PeerFailure:
            if not self.store.check([f"{prefix}/{node}" for node in nodes]):
                raise

    def _repartition(self, plan: dict[str, Any], old: Layout, comm: Comm,
                     resume: int) -> list[str]:
        """Change the depth in place: build this node's new stage(s) and replica from layers,
        each layer's parameters and optimizer state taken from this node's memory when it holds
        them and from a peer that does otherwise (`plan.layer_plan`); returns what it received.
        """
        new_partition = [tuple(r) for r in plan["partition"]]
        old_partition = [tuple(r) for r in plan["previous_partition"]]
        redundancy = self.cfg.redundancy != "none"
        expected = held_replica(old, self.node) if redundancy else None
        actual = self.holding.replica.index if self.holding is not None else None
        if self.node in old.active_nodes and expected != actual:
            raise RuntimeError(f"{self.node} holds the replica of stage {actual}, the layout "
                               f"says {expected}: cannot re-partition from it")
        held = [(st.module, st.optimizer) for st in self.stages.values()]
        if self.holding is not None:
            self.holding.applier.drain()  # the replica is exact through resume - 1
            held.append((self.holding.replica.module, self.holding.replica.optimizer))

        def build(stage: int, device: torch.device) -> tuple[torch.nn.Module,
                                                              torch.optim.Optimizer]:
            # a copy: stages share no Parameter with the node's model or with each other
            module = copy.deepcopy(build_stage(self.model, *new_partition[stage])).to(device)
            return module, build_optimizer(module.parameters(), self.cfg)

        owned = {s: build(s, self.device) for s in nodelib.owned_stages(self.layout, self.node)}
        want = held_replica(self.layout, self.node) if redundancy else None
        replica_device = (self.device if self.cfg.replica.device == "device"
                          else torch.device("cpu"))
        replica = build(want, replica_device) if want is not None else None
        moves = layer_plan(old, self.layout, old_partition, new_partition, redundancy)
        self.bytes_received = migrate.exchange_layers(
            moves, self.node, comm, self.store,
            f"{self.namespace}/gen{self.generation}/layers", self.model,
            have=migrate.state_index(held),
            want=migrate.state_index(list(owned.values()) + ([replica] if replica else [])),
            timeout_s=self.cfg.cluster.timeout_s)
        self._commit_exchange(comm)
        if self.holding is not None:
            self.holding.applier.close()
            self.holding = None
        self.spec = dataclasses.replace(self.spec, partition=new_partition)
        self.stages = {s: nodelib.stage_state_from(self.model, new_partition, s, module, opt)
                       for s, (module, opt) in owned.items()}
        if replica is not None and want is not None:
            stage = ReplicaStage(want, replica[0], replica[1], replica_device)
            applier = ReplicaApplier(stage, self.cfg, self.digests)
            applier.start_at(resume)
            d = nodelib.pipeline_of(self.layout, self.node)
            self.holding = Holding(stage, applier, self.layout.owner(d, want))
        return sorted({f"layer {m.layer} from {m.src}" for m in moves if m.dst == self.node})

    def _migrate(self, moves: list[migrate.Transfer], comm: Comm, resume: int) -> list[str]:
        """This node's part of the state moves; returns what it received."""
        self.bytes_received = 0
        if self.holding is not None and nodelib.held_replica(self.layout, self.node) is None:
            # this node now carries several stages: no room (and no feed) for a replica
            self.untouched = False
            self.holding.applier.close()
            self.holding = None
        mine = set(nodelib.owned_stages(self.layout, self.node))
        if not any(self.node in (t.src, t.dst) for t in moves):
            for s in [s for s in self.stages if s not in mine]:  # kept by a plan that failed
                del self.stages[s]
            return []
        have: dict[tuple[str, int], Any] = {("stage", s): (st.module, st.optimizer)
                                             for s, st in self.stages.items()}
        if self.holding is not None:
            self.holding.applier.drain()
            have[("replica", self.holding.replica.index)] = (self.holding.replica.module,
                                                             self.holding.replica.optimizer)

        def build(stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            start, end = self.spec.partition[stage]
            module = copy.deepcopy(build_stage(self.model, start, end)).to(self.device)
            return module, build_optimizer(module.parameters(), self.cfg)

        got = migrate.run(moves, self.node, comm, have, build)
        self.bytes_received = got.pop(("bytes", -1))
        for s in [s for s in self.stages if s not in mine]:  # handed over to another node
            del self.stages[s]
        for (kind, s), (module, optimizer) in got.items():
            if kind == "stage":
                self.stages[s] = nodelib.stage_state_from(self.model, self.spec.partition, s,
                                                          module, optimizer)
        want = (nodelib.held_replica(self.layout, self.node)
                if self.cfg.redundancy != "none" else None)
        if ("replica", want) in got:
            if self.holding is not None:
                self.holding.applier.close()
            module, optimizer = got[("replica", want)]
            device = self.device if self.cfg.replica.device == "device" else torch.device("cpu")
            replica = ReplicaStage(want, module.to(device), optimizer, device)
            applier = ReplicaApplier(replica, self.cfg, self.digests)
            applier.start_at(resume)
            d = nodelib.pipeline_of(self.layout, self.node)
            self.holding = Holding(replica, applier, self.layout.owner(d, want))
        elif self.holding is not None and want is None:
            self.holding.applier.close()
            self.holding = None
        return [f"{kind} {s}" for kind, s in sorted(got)]

    def _relink(self, resume: int, restore: set[int], scale: float | None = None) -> None:
        """Point the shadow links at the stages this node now writes (pipeline 0's owners);
        stages in `restore` are loaded from their shadow."""
        if self.shadow is None:
            if restore:
                raise RuntimeError(f"{self.node} was asked to restore stages {sorted(restore)} "
                                   "from shadows, but shadows are off")
            return
        writes = {s: (st.module, st.optimizer) for s, st in self.stages.items()
                  if self.layout.owner(0, s) == self.node}
        missing = restore - set(writes)
        if missing:
            raise RuntimeError(f"{self.node} must restore stages {sorted(missing)} from shadows "
                               "but does not write them (only pipeline 0's owners link to shadows)")
        before = self.shadow.bytes_received
        self.shadow.relink(writes, resume, restore, scale)
        self.bytes_received += self.shadow.bytes_received - before

    def _promote(self, stage: int, resume: int) -> None:
        """The replica becomes an owned stage: it is already exact, nothing is transferred."""
        holding = self.holding
        if holding is None or holding.replica.index != stage:
            raise RuntimeError(f"{self.node} was asked to take over stage {stage} but holds no "
                               "replica of it")
        holding.applier.drain()
        if holding.applier.applied != resume - 1:
            raise RuntimeError(f"replica of stage {stage} is at iteration "
                               f"{holding.applier.applied}, expected {resume - 1}")
        holding.applier.close()
        holding.replica.optimizer.zero_grad(set_to_none=True)
        module = holding.replica.module.to(self.device)
        self.stages[stage] = nodelib.stage_state_from(self.model, self.spec.partition, stage,
                                                      module, holding.replica.optimizer)
        self.holding = None

    def _finish(self, left: bool = False) -> None:
        self.checkpoints.close()
        self.heartbeat.stop()
        if self.shadow is not None:
            self.shadow.close()  # the next writer (or nobody, at the end) takes over the links
            if self.shadow.writer_s or self.shadow.waited_s:
                self.channel.event("shadow_waits", waited_s=round(self.shadow.waited_s, 6),
                                   confirm_s=round(self.shadow.parts.get("confirm", 0.0), 6),
                                   writer_s=round(self.shadow.writer_s, 6),
                                   parts={k: round(v, 6) for k, v in self.shadow.parts.items()})
        if self.sample_log is not None:
            self.sample_log.close()
        if self.holding is not None:
            self.holding.applier.close()
            self.channel.event("replica_done", stage=self.holding.replica.index,
                               max_lag=self.holding.applier.max_lag_seen,
                               waited_s=round(self.holding.applier.waited_s, 6))
        if self.digests is not None:
            self.digests.close()
        if not left:
            self.save_final()
        self.channel.event("worker_left" if left else "worker_done", stages=sorted(self.stages),
                           cpu_s=round(time.process_time(), 3))

    def save_final(self) -> None:
        """Pipeline 0's owners write their stages; the launcher merges them."""
        out = self.run_dir / "final"
        out.mkdir(exist_ok=True)
        for s, state in self.stages.items():
            if self.layout.owner(0, s) != self.node:
                continue
            # clone: tied tensors share storage, which safetensors refuses to write twice
            tensors = {k: v.detach().to("cpu").contiguous().clone()
                       for k, v in state.module.state_dict().items()}
            save_file(tensors, str(out / f".stage{s}.safetensors.tmp"))
            os.replace(out / f".stage{s}.safetensors.tmp", out / f"stage{s}.safetensors")


def main() -> int:
    rank = int(os.environ["RANK"])
    run_dir = Path(os.environ["SPOTPIPE_RUN_DIR"])
    t0 = float(os.environ.get("SPOTPIPE_T0", time.time()))
    cfg = load_config(os.environ.get("SPOTPIPE_CONFIG") or run_dir / "config.yaml")
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    spec = job.RunSpec.from_json(json.loads((run_dir / "run.json").read_text()))
    faults = [Fault(**f) for f in json.loads(os.environ.get("SPOTPIPE_FAULTS", "[]"))]
    address = StoreAddress.from_env()
    store = address.connect(cfg.cluster.timeout_s)
    node = f"node{rank}"
    channel = WorkerChannel(store, node, t0)
    try:
        Worker(cfg, spec, run_dir, node, store, t0, faults, address=address).train(
                   joining=os.environ.get("SPOTPIPE_JOIN") == "1")
    except JoinRefused as exc:
        print(f"spotpipe: {exc}", file=sys.stderr)
        return 2
    except JobStopped as exc:
        channel.event("worker_stopped", message=str(exc))
        return 3
    except Exception as exc:  # reported to the launcher, which stops the job with the message
        traceback.print_exc()
        channel.event("worker_error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def exit_now(code: int) -> None:
    """Every file is closed and every record posted by now. Interpreter teardown of torch and
    gloo takes seconds on a small machine and decides nothing, so skip it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
