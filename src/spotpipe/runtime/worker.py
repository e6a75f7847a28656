"""The worker: one per node; it boots, trains generation by generation, and recovers.

Within a generation the layout is fixed; a failure or a notice ends it: the worker reports
where it stands (a sealed `protocol.Report`), waits for the coordinator's Decision on the
generation's decision board, has `runtime.reshape` carry it out in memory, and starts the next
generation under a new store prefix. It decides nothing about recovery itself.

What it is given by its entry point (`spotpipe.cli.worker`): the configuration, the run spec,
the store and the job's protocol channel, injected faults, and the boundary hooks of
`spotpipe.checkpoint` (a checkpoint scheme, the durable tier's restore).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spotpipe import job
from spotpipe.config import Config
from spotpipe.data import collate
from spotpipe.faults import Fault
from spotpipe.notices import NoticeWatcher, leaving_needs_s
from spotpipe.plan import Layout
from spotpipe.plan.memory import state_bytes_per_param
from spotpipe.plan.recovery import Decision
from spotpipe.protocol import (Channel, JoinAnswer, JoinRequest, Notice, Prepare, Refused,
                               Stalled, keys)
from spotpipe.runtime import node as nodelib
from spotpipe.runtime import stacks
from spotpipe.runtime.activity import Activity
from spotpipe.runtime.comm import AbortSignal, Comm, PeerFailure
from spotpipe.runtime.digest import DigestLog
from spotpipe.runtime.generations import GenerationGroups
from spotpipe.runtime.executor import Executor, Microbatches
from spotpipe.runtime.faults import Injector
from spotpipe.runtime.hooks import Boundary, BoundaryHook, NoHook, Restore, SendFinal
from spotpipe.runtime.metrics_post import MetricsPost
from spotpipe.runtime.optim import build_optimizer
from spotpipe.runtime.recovery import (COORDINATOR, read_decision, report_failure,
                                       rest_after_takeover, standing)
from spotpipe.runtime.reshape import Reshaper
from spotpipe.runtime.shadow_link import ShadowError, ShadowWriter
from spotpipe.runtime.standby import Standby
from spotpipe.runtime.stall import StallWatch, Still
from spotpipe.runtime.state import NodeState, build_stage_state
from spotpipe.store.address import StoreAddress
from spotpipe.store.mailbox import Outbox
from spotpipe.store.sealed import SealedStore
from spotpipe.store.waiting import wait_unbounded
from spotpipe.store.watchers import BoardReader, Heartbeat, SpareConnections, client


class Leave(Exception):
    """A node got a preemption notice; the job reshapes at this iteration boundary."""


class JobStopped(Exception):
    """The coordinator decided the job cannot go on (e.g. adjacent stages lost)."""


class Worker:
    def __init__(self, cfg: Config, spec: job.RunSpec, run_dir: Path, node: str,
                 store: dist.Store, t0: float, faults: list[Fault], *, address: StoreAddress,
                 channel: Channel, checkpoints: BoundaryHook | None = None,
                 restore: Restore | None = None, namespace: str = "spotpipe",
                 send_final: SendFinal | None = None) -> None:
        """`namespace` prefixes this job's keys in the store, so that several jobs (e.g. the
        variants a benchmark compares) can share one store. `send_final`: where the final
        stages go besides `run_dir/final` (under an agent, to the coordinating agent)."""
        self.cfg, self.spec, self.run_dir, self.node = cfg, spec, run_dir, node
        self.namespace = namespace
        self.send_final = send_final
        self.address = address
        self.store = store
        self.t0 = t0
        self.protocol = channel
        self.channel = Outbox(store, channel, t0, lambda: self.state.generation)
        # the records that are not protocol messages (layer metadata, shadow links and marks,
        # a scheme's cadence): sealed under the job's key all the same (store/sealed.py)
        self.sealed = SealedStore(store, channel.key, on_refused=self._refused)
        # a generation's connections, opened while the job trains (see SpareConnections); the
        # first ones while the model is built, so that a regroup soon after the start (a
        # notice in the first iterations) finds them ready rather than waiting for one that a
        # dropped name lookup holds (`cluster.supervisor.RESOLVER_OPTIONS`)
        self.spares = SpareConnections(address, cfg.cluster.timeout_s)
        self.spares.refill()
        self.backend = job.resolve_backend(cfg)
        self.device = job.device_for(self.backend, int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        layout = job.first_layout(cfg)
        # (the layers a --resume copy sent to this host holds: `cluster.resume_copy`)
        self.model, self.built = job.build_model_holding(
            cfg, run_dir, job.start_layers(cfg, spec.partition, [node]))
        self.dataset = job.build_job_dataset(cfg, spec.num_samples)
        self.sampler = job.build_sampler(cfg, self.dataset)
        self.digests = (DigestLog(run_dir / "logs" / f"digests.{node}.jsonl")
                        if cfg.logging.state_digests else None)
        self.state = NodeState(cfg, self.model, self.device, node, layout, list(spec.partition))
        st = self.state
        for s in nodelib.owned_stages(layout, node):
            st.stages[s] = build_stage_state(self.model, st.partition, s, cfg, self.device)
        self._build_holding()
        st.release_unheld()
        self.rss_built_mib = _rss_mib()  # stages and replica built, nothing run yet
        self.peak_built_mib = _peak_rss_mib()  # the start's high-water mark
        self.failures = 0  # failures and notices this node has recovered from
        self.metrics = MetricsPost(cfg, self.state, self.channel)
        self.checkpoints: BoundaryHook = checkpoints or NoHook()
        resume = os.environ.get("SPOTPIPE_RESUME")
        if resume:
            if restore is None:
                raise RuntimeError("SPOTPIPE_RESUME is set but no restore hook was given")
            self._restore(Path(resume), restore)
        self.sample_log: TextIO | None = None
        self.inject = Injector(faults, node, lambda f: self.channel.event(
            "fault_injected", fault=f.kind, iteration=f.iteration, phase=f.phase))
        self.inject.poison = self._poison_gradient
        # (under a node agent, the agent tells the cloud once every worker of the host is
        # gone: the first of several to say so let Azure take the host from the others)
        self.notices = NoticeWatcher.of_node(
            cfg.failover, node, on_notice=lambda src: self.channel.post(Notice(
                node, self.state.generation, src, self.channel.now())),
            host_acknowledges=os.environ.get("SPOTPIPE_HOST_ACKNOWLEDGES") == "1",
            on_deferred=lambda src, wait_s, lead_s: self.channel.event(
                "notice_deferred", source=src, leaves_in_s=round(wait_s, 3),
                lead_s=round(lead_s, 3)),
            needs_s=lambda: leaving_needs_s(self.iteration_s, self.held_bytes,
                                            cfg.failover.handover_gbps))
        timeout = cfg.cluster.timeout_s
        self.executor: Executor | None = None
        self.shadow = (ShadowWriter(self.sealed, namespace, node, max_lag=cfg.shadow.max_lag,
                                    timeout_s=timeout) if cfg.shadow.enabled else None)
        # the main thread's steps between instructions, for the hang watches
        self.activity = Activity()
        self.reshaper = Reshaper(st, store=store, sealed=self.sealed, namespace=namespace,
                                 channel=channel, shadow=self.shadow, digests=self.digests,
                                 inject=self.inject, refused=self._refused,
                                 activity=self.activity)
        self.groups = GenerationGroups(node=node, protocol=self.protocol, spares=self.spares,
                                       namespace=namespace, form=self._new_comm,
                                       coordinator=COORDINATOR, refused=self._refused)
        self._standby: Standby | None = None  # this node's join board, once it waits
        beats = client(address, timeout)
        # the node's own hang watch runs on the heartbeat's thread and posts on its connection
        stalls = Outbox(beats, channel, t0, lambda: self.state.generation)
        watch = StallWatch(cfg.failover.hang_timeout_s, cfg.failover.heartbeat_s, self._still,
                           lambda still, secs: self._stalled(stalls, still, secs))
        self.heartbeat = Heartbeat(beats, channel, node, cfg.failover.heartbeat_s,
                                   self._progress, on_trouble=lambda why: self.channel.event(
                                       "heartbeat_trouble", reason=why), watch=watch.look)

    # ------------------------------------------------------------------ state

    @property
    def layout(self) -> Layout:
        return self.state.layout

    @property
    def stages(self) -> dict:
        return self.state.stages

    @property
    def holding(self) -> Any:
        return self.state.holding

    @property
    def generation(self) -> int:
        return self.state.generation

    def _build_holding(self) -> None:
        st = self.state
        if self.cfg.redundancy == "none":
            return
        index = nodelib.held_replica(st.layout, self.node)
        if index is None:
            return
        module, optimizer = st.build_stage(index, st.replica_device)
        st.hold(index, module, optimizer, 0, self.digests)

    def _held_bytes(self) -> int:
        """What this node would send on a notice: the weights and optimizer state of its
        stages and of the replica it holds, at the memory model's bytes a parameter (the
        optimizer makes its state at the first step, after the generation starts)."""
        per = state_bytes_per_param(self.cfg.precision, self.cfg.optimizer.name)
        params = sum(p.numel() for x in self.stages.values() for p in x.params)
        if self.holding is not None:
            params += sum(p.numel() for p in self.holding.replica.module.parameters())
        return params * (per["weights"] + per["optimizer"])

    def _restore(self, path: Path, restore: Restore) -> None:
        """Load owned stages and the held replica from a durable checkpoint (any P x D)."""
        st = self.state
        pairs = [(x.module, x.optimizer) for x in st.stages.values()]
        if st.holding is not None:
            pairs.append((st.holding.replica.module, st.holding.replica.optimizer))
        st.start_iteration = restore(path, pairs)
        if st.holding is not None:
            st.holding.applier.start_at(st.start_iteration)
        self.channel.event("restored", checkpoint=str(path), iteration=st.start_iteration,
                           stages=sorted(st.stages))

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
        mine = {s: (x.module, x.optimizer) for s, x in sorted(self.stages.items())
                if self.layout.owner(0, s) == self.node}
        self.checkpoints.after_iteration(Boundary(
            iteration, mine, self.executor.comm, self.layout,
            tuple((start, end) for start, end in self.state.partition)))

    def _progress(self) -> dict[str, Any]:
        ex, act = self.executor, self.activity
        where = {"iteration": ex.iteration, "position": ex.position} if ex else {}
        if self._finishing:  # the final save and the shadows' last writes are no hang
            return {"state": "finishing", "generation": self.generation, **where}
        # waits of the main thread on this node's other threads (they keep their own flags)
        on_threads = ((self.shadow is not None and self.shadow.waiting)
                      or (self.holding is not None and self.holding.applier.waiting))
        step = act.step
        if step:  # between instructions: the step's own clock (`runtime.activity`)
            return {"state": "busy" if act.busy and not on_threads else "waiting",
                    "generation": self.generation, "step": step, **where}
        if ex is None:
            return {"state": "starting", "generation": self.generation}
        busy = not ex.comm.waiter.waiting and not on_threads
        return {"state": "busy" if busy else "waiting", "generation": self.generation,
                **where}

    def _still(self) -> Still | None:
        """Where the main thread computes, and since when, for the hang watch; None while it
        waits on something or does not compute (read in the order the stamps are written)."""
        ex, act = self.executor, self.activity
        progress = self._progress()
        if progress["state"] != "busy":
            return None
        if progress.get("step"):
            return Still(act.generation, progress.get("iteration", -1),
                         progress.get("position", 0), act.since, progress["step"])
        assert ex is not None
        generation, iteration, position = self.generation, ex.iteration, ex.position
        return Still(generation, iteration, position,
                     max(ex.position_at, ex.comm.waiter.idle_at))

    def _stalled(self, outbox: Outbox, still: Still, secs: float) -> None:
        """The hang watch saw the main thread stuck: leave the stacks in the log, the one
        trace of the hang that survives, then tell the coordinator (which fences this node)."""
        where = (still.step if still.step else
                 f"at iteration {still.iteration}, instruction {still.position}")
        stacks.dump(f"{self.node} stalled {secs:.1f} s {where} of generation {still.generation}")
        outbox.post(Stalled(self.node, still.generation, still.iteration, still.position,
                            round(secs, 6), outbox.now(), step=still.step))

    def _refused(self, why: Refused) -> None:
        self.channel.event("record_refused", writer=why.writer, reason=why.reason[:300])

    _finishing = False
    left = False  # a plan let this node go (a notice, or a layout without it)
    iteration_s = 0.0  # the last iteration's time
    held_bytes = 0  # what a hand-over of this node's state sends (`_held_bytes`)
    _said_local_off = False
    rest: list | None = None  # after a takeover: the rest of the in-flight iteration

    def _open_comm(self, prepared: bool = False) -> Comm:
        """The generation's process groups among the nodes of the current layout: the ones
        formed ahead for it when the Decision says `prepared` (`runtime.generations`),
        else formed now."""
        with self.activity.waiting():  # on the peers (or on their formation ahead)
            comm = self.groups.open(self.generation, self.layout, prepared)
        if comm.local_off and not self._said_local_off:  # (said once, not per generation)
            self._said_local_off = True
            self.channel.event("local_links_off", reason=comm.local_off[:300])
        return comm

    def _new_comm(self, generation: int, layout: Layout, abort: AbortSignal,
                  namespace: str) -> Comm:
        """Form the groups of `layout` for `generation` (over a store connection of their
        own, got on the groups' waiter thread: see Comm._form_groups)."""
        nodes = sorted(layout.active_nodes, key=lambda n: int(n[4:]) if n[4:].isdigit() else n)
        return self._comm(generation, nodes, abort, namespace=namespace,
                          stage_members=nodelib.stage_members(layout),
                          local_slots=job.link_slots(self.cfg))

    def _comm(self, generation: int, nodes: list[str], abort: AbortSignal,
              **groups: Any) -> Comm:
        """Groups of this node's among `nodes`, with the job's key, store connections,
        backend and timeout (`groups`: which groups, under which names)."""
        return Comm(store=self.spares.take, key=self.protocol.key, on_refused=self._refused,
                    generation=generation, nodes=nodes, me=self.node, backend=self.backend,
                    device=self.device, timeout_s=self.cfg.cluster.timeout_s, abort=abort,
                    activity=self.activity, **groups)

    def _form(self, comm: Comm | None = None) -> None:
        """Start a generation: groups among the live nodes, the wiring, the stream."""
        comm = comm or self._open_comm()
        st = self.state
        wiring = nodelib.wiring(self.layout, self.node, comm.nodes, self.model, st.partition,
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
        self.held_bytes = self._held_bytes()
        start = st.start_iteration - 1
        if previous is not None:  # (a node back from standby starts where the plan resumes)
            self.executor.committed_through = max(previous.committed_through, start)
            self.executor.stepped_through = max(previous.stepped_through, start)
        else:
            self.executor.committed_through = self.executor.stepped_through = start
        self.stream = nodelib.node_schedule(self.cfg, self.layout, self.node, self.model,
                                            st.partition)

    def batches(self, iteration: int) -> Microbatches:
        p, m = self.layout.num_stages, nodelib.microbatches(self.cfg, self.layout)
        d = self.state.pipeline
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
        return Microbatches(inputs, targets, indices, first=d * m)

    # ------------------------------------------------------------------ training

    def join(self) -> int:
        """A node arriving in a running job: ask to join (the request's seal proves it holds
        the job's key), wait to be placed, receive its state from peers; return the iteration
        to start at."""
        # The first optimizer a process builds costs it over a second (torch imports its
        # compiler hooks lazily), and the job would wait for that while the node takes its
        # stage; pay it while booting, as the nodes that started with the job did.
        build_optimizer([torch.nn.Parameter(torch.zeros(1, device=self.device))], self.cfg)
        if os.environ.get("SPOTPIPE_JOIN_GATED") == "1":  # started early by the local launcher
            self.channel.event("join_waiting")  # (booted: the job's first nodes may start)
            self.store.set(keys.join_booted(self.node), "1")
            wait_unbounded(self.store, [keys.join_gate(self.node)])  # (its iteration may be far)
        self._ask_to_join()
        return self._await_placement()

    def _await_early_joiners(self) -> None:
        """The local launcher starts the nodes that are to join at a given iteration together
        with the job's first ones (SPOTPIPE_START_AFTER). Training starts once they have
        booted, as a spot instance that becomes available has booted before it asks: a node
        then asks at the iteration its test or benchmark names, however slowly a loaded
        machine boots it (else a job of a few seconds can end before a late boot asks)."""
        early = [n for n in os.environ.get("SPOTPIPE_START_AFTER", "").split(",") if n]
        if early:  # (the launcher sets a node's key itself if it exits before it boots)
            wait_unbounded(self.store, [keys.join_booted(n) for n in early])

    def _ask_to_join(self) -> None:
        self.channel.post(JoinRequest(self.node, self.channel.now(), self.cfg.digest(),
                                      self.cfg.model_digest(), self.cfg.key_digests()))

    def _await_placement(self) -> int:
        """Wait on standby until a Decision places this node (`runtime.standby`), and take
        its place; -1: the job ended first, or a notice came while it waited."""
        self.activity.begin("waiting to be placed", self.generation)
        if self._standby is None:  # one reader for the node's life, reading ahead in order
            answers = BoardReader(self.spares.take(), self.protocol, keys.join_board(self.node),
                                  expect=(JoinAnswer, Prepare), writers={COORDINATOR})
            self._standby = Standby(answers, self.protocol.sealer.incarnation,
                                    outbox=self.channel, notices=self.notices,
                                    activity=self.activity, prepare=self.groups.prepare,
                                    refused=self._refused)
        generation = self._standby.wait()
        if generation is None:
            return -1
        with self.activity.waiting():
            decision, prepared = self._decision(generation)
        self.state.layout = decision.previous_layout
        self.state.start_iteration = decision.resume
        try:
            return self._apply(decision, prepared)
        except PeerFailure as why:  # a peer lost while this node was being placed
            self.formed = False
            return self.recover(why)

    def train(self, joining: bool = False) -> None:
        cfg = self.cfg
        if joining:
            if self.join() < 0:
                self.heartbeat.stop()
                self.notices.acknowledge()  # Azure: a notice's eviction may start now
                return
        else:
            self._await_early_joiners()
            self._form()
            self.activity.begin("linking the shadows", self.generation)
            self.reshaper.relink_at_start(self.state.start_iteration)
            self.activity.end()
        self.channel.event("worker_ready", pipeline=self.state.pipeline,
                           stages=sorted(self.stages),
                           layers=[list(self.state.partition[s]) for s in sorted(self.stages)],
                           joined=joining, built=self.built)
        t = self.state.start_iteration
        resumed_at: float | None = None
        finished = False  # every node of the generation completed the last iteration
        while not finished:
            ex = self.executor
            try:
                if t >= cfg.iterations:
                    self._await_the_others_finished()
                    finished = True
                    continue
                self.inject("start", t)
                t_start = time.perf_counter()
                lr = ex.set_lr(t)
                stream = self.rest if self.rest is not None else self.stream
                self.rest = None
                result = ex.run(stream, self.batches(t), t,
                                leaving=lambda: (self.notices.is_set()
                                                 or self.groups.regroup.is_set()))
                self.iteration_s = time.perf_counter() - t_start
                self.metrics.post(t, result, lr, self.iteration_s, ex.comm,
                                  self.holding.applier.lag if self.holding else None)
                self._checkpoint(t)
                self.spares.refill()  # (after the iteration: off a regroup's critical path)
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

    def _await_the_others_finished(self) -> None:
        """Wait until every node of the generation has completed the last iteration, before
        any saves its final stages and leaves. A node lost in the last iteration after its
        commit (in its optimizer step, posting its metrics) is then met by the usual
        recovery: a survivor holding its replica takes its stages over and saves them. Before,
        the others had saved theirs and left by the time its loss was seen: its stages'
        final parameters were lost with it, and the job failed, counting every node lost."""
        with self.activity.waiting():
            self.executor.comm.all_reduce(torch.zeros(1))

    # ------------------------------------------------------------------ recovery

    formed = True  # False from a plan that failed before this node's generation formed

    def recover(self, why: Exception) -> int:
        """Report, wait for the Decision, carry it out; return the iteration to resume at (or
        -1 when this node leaves the job).

        A peer may be lost while the Decision is carried out (groups forming, states moving):
        then this node reports again, in the new generation, saying what it did not receive,
        and carries out the next Decision, which the coordinator makes from those reports."""
        while True:
            try:
                resume = self._recover_once(why)
                self.metrics.reported()
                return resume
            except PeerFailure as again:
                self.formed = False
                why = again

    def _decision(self, generation: int) -> tuple[Decision, bool]:
        """The coordinator's Decision for `generation` and whether its nodes take the groups
        formed ahead for it; when they do not, those formed ahead for it and before are
        cancelled (they are nobody's)."""
        decision, prepared = read_decision(self.store, self.protocol, generation,
                                           self.cfg.cluster.timeout_s * 4, self._refused)
        if not prepared:
            self.groups.early.discard(f"the plan for generation {decision.generation} did "
                                      "not take the groups formed ahead", decision.generation)
        return decision, prepared

    def _recover_once(self, why: Exception) -> int:
        act = self.activity
        act.begin("reporting the failure", self.generation)
        ex = self.executor
        g = self.generation
        # a node with a notice leaves, whether it saw the commit's flag or was woken by the
        # abort of a faster node first
        leaving = self.notices.is_set()
        boundary = isinstance(why, Leave)  # every node saw the same flag: no one to wake
        flight = ex.flight if ex is not None else None
        progress = self.reshaper.progress
        with act.waiting():  # the store's, then the coordinator's (for every survivor's report)
            report_failure(self.store, self.protocol, self.channel, self.node, g, why,
                           boundary=boundary, leaving=leaving, formed=self.formed,
                           progress=progress, replica=self.state.held_replica_index(),
                           where=standing(ex, self.metrics))
            self.formed = True
            decision, prepared = self._decision(g)
        if decision.stopped:
            raise JobStopped(decision.message)
        resume = decision.resume
        act.begin("finishing the committed iteration", decision.generation)
        # finish the committed iteration; drop the one in flight, unless the plan continues it
        if ex is not None and ex.stepped_through < resume - 1:
            ex.step(resume - 1, decision.clip_scale)
        salvage = (decision.salvage is not None and flight is not None
                   and flight.iteration == resume)
        if salvage:
            ex.abandon_messages()
        elif ex is not None:
            ex.discard()
        if self.node in decision.rejoin:
            # counted out for what it missed: it holds states the job no longer counts on,
            # and comes back as a new node (placed at a later boundary)
            self.channel.event("rejoining", generation=decision.generation,
                               lacked=list(progress.lacking))
            self._ask_to_join()
            return self._wait_unplaced(keep_state=False)
        if self.node in decision.layout.standby:  # e.g. one node more than the new depth needs
            # it keeps its state: if the plan fails before it commits, the plan is rolled back
            # and this node takes its old place again (the state is replaced when a later
            # plan places it elsewhere)
            self.channel.event("standby", generation=decision.generation)
            return self._wait_unplaced(keep_state=True)
        if self.node not in decision.layout.active_nodes:
            if self.node in decision.departing:
                self._hand_over(decision)
            self._finish(left=True)
            return -1
        return self._apply(decision, prepared)

    def _hand_over(self, decision: Decision) -> None:
        """Send this node's stages to the nodes the plan gives them to, before it leaves on
        its notice. A receiver lost meanwhile is the next plan's business, not this node's:
        it goes either way."""
        try:
            with stacks.watchdog(self.cfg.failover.hang_timeout_s):
                sent = self.reshaper.hand_over(decision, self._handover_comm)
            self.channel.event("handed_over", generation=decision.generation, sent=sent)
        except PeerFailure as why:
            self.channel.event("handover_failed", generation=decision.generation,
                               reason=str(why)[:300])

    def _handover_comm(self, decision: Decision) -> Comm:
        """The group of the nodes leaving on a notice that hand stages over, and of their
        receivers, beside the generation's own (`Decision.handover_group`)."""
        with self.activity.waiting():
            return self._comm(decision.generation, decision.handover_group(),
                              self.groups.abort_of(decision.generation),
                              namespace=self.namespace, stage_members={},
                              group=keys.HANDOVER_GROUP)

    def _wait_unplaced(self, keep_state: bool) -> int:
        """Wait to be placed (without `keep_state`, having dropped every state); -1 when the
        job ended first. A node that wrote shadows hands their links over first (END), so that
        their new writers are not held until this node's links time out."""
        if self.shadow is not None:
            try:
                with self.activity.waiting():
                    self.shadow.close()
            except ShadowError as exc:  # the shadow is gone too: nothing to hand over
                self.channel.event("shadow_link_lost", reason=str(exc)[:300])
                self.shadow.links.clear()
        if not keep_state:
            self.state.drop_all()
        # the stream it ran is over: a plan that places it builds a new one, and a recovery
        # while it is placed must not finish an iteration on this one (its stages and replica
        # are the ones it kept, or none, and it missed every iteration since)
        self.executor = None
        self.groups.early.discard("the node waits to be placed", self.generation)
        self.reshaper.progress.lacking = []
        resume = self._await_placement()
        if resume < 0:
            self._finish(left=True)
        return resume

    def _apply(self, decision: Decision, prepared: bool = False) -> int:
        """Carry out a Decision in memory, then start the new generation (over the groups
        formed ahead for it when `prepared`)."""
        started = time.perf_counter()
        resume = decision.resume
        with stacks.watchdog(self.cfg.failover.hang_timeout_s):  # (its stacks, if it is slow)
            comm, carried = self.reshaper.carry_out(
                decision, lambda: self._open_comm(prepared), self._handover_comm)
        # kept only when `recover` took the Decision to continue it (a joiner has none)
        flight = self.executor.flight if self.executor is not None else None
        self.activity.begin("starting the generation", decision.generation)
        self._form(comm)
        ex = self.executor
        if ex.committed_through == resume - 1 and ex.committed_clip_scale is None:
            # the new executor reports the committed iteration's clipping scale as the old
            # one did (a joiner: as the Decision recorded it), for a shadow whose new writer
            # is lost before it relinks: the next Decision takes the scale from the reports
            ex.committed_clip_scale = (float("nan") if decision.clip_scale == "skip"
                                       else decision.clip_scale)
        if flight is not None:
            self.executor.flight = flight
            d = self.state.pipeline
            self.rest = rest_after_takeover(
                decision, self.node, self.stream, lambda q: self.layout.owner(d, q),
                carried.promoted, flight.frc_outputs, self.layout.num_stages - 1)
        self.activity.end()
        repartition = decision.action.value == "repartition"
        kind = "takeover" if carried.promoted else ("migrated" if carried.received
                                                    else "regrouped")
        rest = ({"rest": {"instructions": len(self.rest), "of": len(self.stream),
                          "brc": sum(i.op.value == "brc_backward" for i in self.rest)}}
                if self.rest is not None else {})
        self.channel.event("repartitioned" if repartition else kind,
                           generation=self.generation, stages=sorted(self.stages),
                           promoted=carried.promoted, received=carried.received, resume=resume,
                           bytes_received=self.reshaper.progress.bytes_received,
                           regroup_s=round(time.perf_counter() - started, 6), **rest,
                           groups_s=round(carried.groups_s, 6), early_groups=prepared,
                           exchange_s=round(carried.exchange_s, 6),
                           **({"depth": decision.layout.num_stages,
                               "layers": [list(self.state.partition[s]) for s in
                                          sorted(self.stages)]}
                              if repartition else {}))
        return resume

    def _finish(self, left: bool = False) -> None:
        # the beats go on until the end, saying "finishing": a final save longer than the hang
        # timeout (a real model's) must not be fenced as a hang, nor one longer than the
        # heartbeat timeout as a death
        self._finishing, self.left = True, left
        self.groups.close()
        self.checkpoints.close()
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
        self.spares.close()
        self.heartbeat.stop()
        self.channel.event("worker_left" if left else "worker_done", stages=sorted(self.stages),
                           cpu_s=round(time.process_time(), 3),
                           rss_built_mib=self.rss_built_mib,
                           peak_built_mib=self.peak_built_mib, built=self.built,
                           peak_rss_mib=_peak_rss_mib(), **_device_peak(self.device))
        if left:
            self.notices.acknowledge()  # Azure: the eviction may start now

    def save_final(self) -> None:
        """Pipeline 0's owners write their stages (and send them, `send_final`); the
        coordinator merges them."""
        out = self.run_dir / "final"
        out.mkdir(exist_ok=True)
        for s, state in self.stages.items():
            if self.layout.owner(0, s) != self.node:
                continue
            # clone: tied tensors share storage, which safetensors refuses to write twice
            tensors = {self.model.export_name(k): v.detach().to("cpu").contiguous().clone()
                       for k, v in state.module.state_dict().items()}
            save_file(tensors, str(out / f".stage{s}.safetensors.tmp"))
            os.replace(out / f".stage{s}.safetensors.tmp", out / f"stage{s}.safetensors")
            if self.send_final is not None:
                try:
                    self.send_final(s, out / f"stage{s}.safetensors")
                except Exception as exc:  # noqa: BLE001 - said; the job's end names the stage
                    self.channel.event("final_upload_failed", stage=s,
                                       message=f"{type(exc).__name__}: {exc}"[:300])


def _device_peak(device: torch.device) -> dict[str, float]:
    """On a GPU, the allocator's high-water mark (what the launch's memory estimate predicts:
    the RSS of a GPU worker says nothing of its stage)."""
    if device.type != "cuda":
        return {}
    return {"peak_device_mib": round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2 ** 20, 1)}


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _rss_mib() -> float:
    """This process's resident memory now (Linux), MiB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20, 1)
