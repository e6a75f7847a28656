"""The local multi-node launcher: `spotpipe train` on one machine.

It plays the part torchrun's agent plays: hosts the store (so the store outlives any worker),
starts one worker process per node with torchrun's environment variables (`Supervisor`),
watches them, and runs the coordinator's loop (`JobLoop`), the single writer of the run's
output files. Everything that can be wrong with the input is checked here before the output
folder exists or a process starts. `spotpipe agent` (agent.py) runs the same two pieces split
over hosts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from spotpipe.checkpoint import durable
from spotpipe.config import Config, parse_endpoint
from spotpipe.cluster.inbox import Inbox, NodeExit
from spotpipe.cluster.jobloop import JobLoop
from spotpipe.cluster.run_files import RunFiles
from spotpipe.protocol import keys, new_instance_id
from spotpipe.store.address import StoreAddress, host_tcp_store, job_prefix
from spotpipe.store.tls import EtcdTLS, TLSConfError, parse_conf
from spotpipe.cluster.supervisor import (STOP_GRACE_S, WORKER, Supervisor, search_path,
                                         starter, worker_env)
from spotpipe.cluster.trace_replay import Action as TraceAction
from spotpipe.faults import Fault
from spotpipe.runfiles import blocking_file
from spotpipe import job
from spotpipe.model import LayeredModel, template


class LaunchError(RuntimeError):
    """Input that cannot run; raised before anything is written or started."""


@dataclass
class Prepared:
    """The checked job. `model`, the one this process built to check it, is kept only until
    its tensors are written to the run folder (`write_initial`)."""

    cfg: Config
    spec: job.RunSpec
    model: LayeredModel | None = field(default=None, repr=False, compare=False)

    def write_initial(self, out: Path) -> list[dict[str, Any]]:
        """The initial weights, for this host's workers to read only the layers they hold
        (model/template.py); then the model goes. A disk that cannot take them costs only
        that: the workers build the model whole, and the note returned says why."""
        if self.model is None:
            return []
        path = out / template.INITIAL_FILE
        try:
            template.save_initial(self.model, path, job.model_identity(self.cfg))
        except OSError as exc:
            path.with_name(path.name + ".partial").unlink(missing_ok=True)
            return [{"kind": "initial_weights_not_written", "path": str(path),
                     "message": str(exc)[:300]}]
        finally:
            self.model = None
        return []


def check_environment(cfg: Config, workers_here: int) -> Config:
    """What the configuration asks of this machine: found here, not inside the workers after
    the output folder exists. Returns the configuration with `cluster.backend` decided (no
    longer `auto`), which every worker of this host reads."""
    try:
        backend, why = job.choose_backend(cfg.cluster.backend, job.cuda_gpus(), workers_here)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if why:
        print(f"spotpipe: {why}", file=sys.stderr)
    if backend == "nccl" and cfg.redundancy == "eager" and cfg.replica.device == "cpu":
        raise LaunchError("replica.device: 'cpu' with redundancy: eager on GPUs: the replica's "
                          "forward (FRC) would run on the CPU, whose products differ from the "
                          "GPU's in the last bits, so a takeover would not be exact; use "
                          "replica.device: device (or redundancy: lazy)")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise LaunchError("logging.tensorboard: true needs the tensorboard package, which is "
                          "not installed (pip install tensorboard), or set it to false")
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend=backend))


def prepare(cfg: Config, workers_here: int | None = None) -> Prepared:
    """Build model and dataset once and decide the backend and the partition; turn every
    failure into a LaunchError that says what to fix. `workers_here`: the workers this host
    starts (default: all the job's, as `spotpipe train` does)."""
    cfg = check_environment(cfg, cfg.stages * cfg.pipelines if workers_here is None
                            else workers_here)
    for path in reversed(search_path(cfg)):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        model = job.build_model(cfg)
    except Exception as exc:
        raise LaunchError(f"model: {exc}") from None
    try:
        dataset = job.build_dataset(cfg)
    except Exception as exc:
        raise LaunchError(f"data: {exc}") from None
    if len(dataset) < cfg.global_batch:
        raise LaunchError(
            f"data: {len(dataset)} samples are fewer than one global batch of {cfg.global_batch} "
            f"(micro_batch_size {cfg.micro_batch_size} x num_microbatches "
            f"{cfg.num_microbatches} x pipelines {cfg.pipelines})")
    try:
        profile = job.profile_model(cfg, model, dataset)
    except job.DataError as exc:  # (its first micro-batch cannot be read)
        raise LaunchError(f"data: {exc}") from None
    except Exception as exc:
        raise LaunchError(f"model: cannot profile its layers on one micro-batch: {exc}") from None
    try:
        partition = job.compute_partition(cfg, profile)
    except Exception as exc:
        key = "model.stage_of_layer" if cfg.model.partition == "explicit" else "model.partition"
        raise LaunchError(f"{key}: {exc}") from None
    lines, refused = job.memory_report(cfg, profile.memory, partition)
    for line in lines:
        print(line, file=sys.stderr)
    if refused:
        raise LaunchError(f"memory: {refused}")
    name = job.misplaced_tie(profile.tied, partition)
    if name:
        raise LaunchError(f"model: tied parameter {name} is split across stages but is on "
                          "neither the first nor the last stage; only ties between the first "
                          "and last stage (like GPT's embedding and head) are kept in sync")
    return Prepared(cfg, job.RunSpec(partition, len(dataset), profile), model)


def etcd_tls(cfg: Config) -> EtcdTLS | None:
    """cluster.etcd_conf, its files checked on this host; LaunchError naming what is wrong."""
    try:
        return parse_conf(cfg.cluster.etcd_conf, "cluster.etcd_conf")
    except TLSConfError as exc:
        raise LaunchError(str(exc)) from None


def bind_store(cfg: Config, job_id: str) -> tuple[dist.Store, StoreAddress]:
    """The job's store and its address: an embedded TCPStore hosted by this process, or a
    connection to the configured etcd (keys under the job's own prefix)."""
    timeout = timedelta(seconds=cfg.cluster.timeout_s)
    if cfg.cluster.store == "etcd":
        from spotpipe.store.etcd import EtcdStore, EtcdStoreError

        host, port = parse_endpoint(cfg.cluster.etcd_endpoint)
        tls = etcd_tls(cfg)
        address = StoreAddress("etcd", host, port, job_prefix(job_id), tls)
        # a launch fails fast when etcd is not there; a running job waits out restarts
        store = EtcdStore(host, port, address.prefix, timeout=timeout, reconnect_s=5.0, tls=tls)
        try:
            store.reachable()
        except EtcdStoreError as exc:
            raise LaunchError(f"cluster.etcd_endpoint: {exc}") from None
        return EtcdStore(host, port, address.prefix, timeout=timeout, tls=tls), address
    try:
        store = host_tcp_store(cfg.cluster.host, cfg.cluster.port, timeout)
    except Exception as exc:
        raise LaunchError(f"cluster.port: cannot start the store on {cfg.cluster.host}:"
                          f"{cfg.cluster.port} ({exc}); the port may be taken: choose another "
                          "or 0 for a free one") from None
    return store, StoreAddress("tcp", cfg.cluster.host, store.port)


class Launcher(JobLoop):
    """The local launcher: every node of the job is a worker process on this machine, plus
    fault injection, trace replay and nodes that join at given iterations."""

    def __init__(self, prepared: Prepared, out: Path, *, progress: bool = True,
                 stream: TextIO | None = None, faults: list[Fault] | None = None,
                 trace_actions: list[TraceAction] | None = None,
                 resume: durable.Checkpoint | None = None,
                 joins: list[int] | None = None, t0: float | None = None,
                 restart: int = 0, first: int | None = None) -> None:
        # every node must present the token to join (a node from another job or a stray
        # process cannot disturb this one); real clusters pass it to their agents
        super().__init__(prepared.cfg, prepared.spec, out, progress=progress, stream=stream,
                         resume=resume, instance=new_instance_id(), t0=t0, restart=restart,
                         first=first,
                         token=os.environ.get("SPOTPIPE_JOIN_TOKEN") or secrets.token_hex(16))
        self.faults = list(faults or [])
        self.joins = sorted(joins or [])
        self._booting: list[str] = []  # nodes started early to join, not yet booted
        self.trace_actions = sorted(trace_actions or [], key=lambda a: a.at_s)

    # ------------------------------------------------------------------ workers, here

    def _spawn(self, rank: int, world: int, address: StoreAddress, joining: bool = False,
               start_after: list[str] | None = None) -> None:
        env = worker_env(self.cfg, rank=rank, world=world, local_rank=rank, local_world=world,
                         address=address, run_dir=self.out, t0=self.t0, token=self.token,
                         instance=self.instance, search_path=search_path(self.cfg),
                         faults=self.faults,
                         joining=joining, gated=joining, start_after=start_after or [],
                         resume=str(self.resume.path) if self.resume else "")
        self.supervisor.spawn(f"node{rank}", env)

    def _start_nodes(self, address: StoreAddress, inbox: Inbox) -> None:
        logs = self.out / "logs"
        self.supervisor = Supervisor(logs, lambda node, code: inbox.put(NodeExit(node, code)),
                                     starter=starter(self.cfg, WORKER, logs))
        world = self.cfg.stages * self.cfg.pipelines
        # joining nodes start now, and ask to join when their iteration comes (a spot
        # instance that becomes available has booted before it asks): the first nodes
        # start training once they have booted (`Worker._await_early_joiners`)
        self.joins = [(at, f"node{world + k}") for k, at in enumerate(sorted(self.joins))]
        self._booting = [node for _, node in self.joins]
        for rank in range(world):
            self._spawn(rank, world, address, start_after=self._booting)
        for k in range(len(self.joins)):
            self._spawn(world + k, world, address, joining=True)

    def _started(self) -> list[str]:
        return list(self.supervisor.procs)

    def _launch_details(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults]}

    def _kill(self, node: str) -> None:
        if node not in self._exited:
            self.supervisor.kill(node)

    def _exit_cause(self, node: str, code: int) -> str:
        return self.supervisor.exit_cause(node, code)

    def _stop_workers(self, grace_s: float = STOP_GRACE_S) -> None:
        if hasattr(self, "supervisor"):
            self.supervisor.stop_all(grace_s)

    def _wait_limit(self) -> float:
        wait = self.cfg.failover.heartbeat_s
        if self.trace_actions:
            wait = min(wait, max(0.0, self._trace_due() - time.time()))
        return wait

    def _each_turn(self, files: RunFiles) -> None:
        self._fire_trace(files)
        for node in [n for n in self._booting if n in self._exited]:
            # it exited before it booted: the first nodes must not wait for it
            self._booting.remove(node)
            self._store.set(keys.join_booted(node), "exited")

    def _on_metrics(self, item: dict[str, Any], files: RunFiles) -> None:
        if os.environ.get("SPOTPIPE_TEST_REGROUP_EVERY_ITERATION") == "1" and \
                self.coordinator.collecting is None and item["iter"] < self.cfg.iterations - 1:
            # a test knob: every iteration ends its generation at the boundary (groups,
            # watchers and connections renewed), to show that none of them pile up
            self.coordinator.request_regroup(f"test: regroup after iteration {item['iter']}")
        while self.joins and item["iter"] >= self.joins[0][0]:
            at, node = self.joins.pop(0)
            files.event({"time_s": self._now(), "kind": "node_available", "node": node,
                         "iteration": item["iter"]})
            self._store.set(keys.join_gate(node), str(at))

    def _only_standby_left(self) -> None:
        self.coordinator.release_standby()  # only standby joiners are left
        for _, node in self.joins:  # and joiners whose iteration never came
            self._store.set(keys.join_gate(node), "over")
        self.joins = []

    # ------------------------------------------------------------------ trace replay

    def _trace_due(self) -> float:
        return self._trace_due_of(self.trace_actions[0])

    def _trace_due_of(self, action: TraceAction) -> float:
        return self._train_start + action.at_s

    def _fire_trace(self, files: RunFiles) -> None:
        """Carry out the trace's actions that are due (the clock starts at the first metrics)."""
        while (self.trace_actions and self.lines.last is not None
               and time.time() >= self._trace_due()):
            action = self.trace_actions.pop(0)
            if action.kind == "available":
                files.event({"time_s": self._now(), "kind": "trace_available",
                             "node": "launcher", "trace_node": action.trace_node})
                self._trace_join(action.node, files)
                continue
            if action.node not in self.supervisor.procs or action.node in self._exited:
                continue
            at = self._now()
            self.supervisor.signal(action.node,
                                   signal.SIGKILL if action.kind == "kill" else signal.SIGTERM)
            files.event({"time_s": at, "kind": "trace_" + action.kind, "node": action.node,
                         "trace_node": action.trace_node, "due_s": round(
                             self._trace_due_of(action) - self.t0, 6)})

    def _trace_join(self, node: str, files: RunFiles) -> None:
        """A trace adds a spot instance: start `node`, the worker the replay named to stand
        for it (so that the instance's removal kills it), joining at once, while the job runs
        on fewer nodes than it started with (the local machine is not grown beyond that)."""
        world = self.cfg.stages * self.cfg.pipelines
        running = [n for n in self.supervisor.procs if n not in self._exited]
        if not node or node in self.supervisor.procs or len(running) >= world \
                or self.coordinator.over:
            return
        rank = int(node.removeprefix("node"))
        files.event({"time_s": self._now(), "kind": "node_started", "node": node,
                     "joining": True, "reason": "trace"})
        self._store.set(keys.join_gate(node), "trace")
        self._spawn(rank, world, self._address, joining=True)


def check_resume(cfg: Config, path: Path, key: bytes | None = None, trust: bool = False,
                 notes: list[dict[str, Any]] | None = None, *, num_samples: int,
                 layers: set[int] | None = None) -> durable.Checkpoint:
    """The checkpoint to resume from, refused clearly if it belongs to another model or data
    order (`num_samples`: the samples of this job's data), or if its MAC does not vouch for
    it under `key` (unless `trust`: then a note says so).
    `layers`: a copy that need hold only the stage folders of these (`durable.verify`)."""
    try:
        ckpt, skipped = durable.resolve(path, layers)
    except durable.CheckpointError as exc:
        raise LaunchError(f"--resume: {exc}") from None
    for problem in skipped:
        print(f"spotpipe: warning: skipped a bad checkpoint: {problem}", file=sys.stderr)
    problem = resume_problem(cfg, ckpt, key, trust, num_samples=num_samples)
    if problem:
        raise LaunchError(f"--resume {ckpt.path}: {problem}")
    origin = ckpt.origin_problem(key) if key is not None else ""
    if origin and notes is not None:
        print(f"spotpipe: warning: --trust-checkpoint: loading {ckpt.path} although {origin}",
              file=sys.stderr)
        notes.append({"kind": "checkpoint_trusted", "path": str(ckpt.path), "reason": origin})
    return ckpt


def resume_problem(cfg: Config, ckpt: durable.Checkpoint, key: bytes | None,
                   trust: bool = False, *, num_samples: int) -> str:
    """Why this job cannot go on from `ckpt` ("" when it can): its MAC does not vouch for it
    under `key` (unless `trust`), it is of another model or optimizer, its data order differs
    (global batch, seed, or the count of samples the epochs permute: `num_samples`, this
    job's data), or it is at the job's end. What `--resume` checks, and a restart after a
    failure (`_restart_point`) alike."""
    if key is not None and not trust:
        problem = ckpt.origin_problem(key)
        if problem:
            return (f"{problem}; pass --trust-checkpoint to load it anyway (only a checkpoint "
                    "whose origin you know)")
    m = ckpt.manifest
    if m.get("model_digest") != cfg.model_digest():
        return "the checkpoint is of another model or optimizer (model/optimizer configuration " \
               "differs)"
    if m.get("global_batch") != cfg.global_batch or m.get("seed") != cfg.seed:
        return (f"written with global batch {m.get('global_batch')} and seed {m.get('seed')}, "
                f"this job has {cfg.global_batch} and {cfg.seed}; the data order depends on "
                "both (keep micro_batch_size x num_microbatches x pipelines the same)")
    if m.get("num_samples") != num_samples:
        return (f"written for data of {m.get('num_samples')} samples, this job's "
                f"{job.data_source(cfg)} holds {num_samples} (at block size "
                f"{job.block_size(cfg)}): the epochs would be other permutations, and the "
                "samples the checkpoint's epoch already consumed would be consumed again")
    if ckpt.next_iteration >= cfg.iterations:
        return (f"it is at iteration {ckpt.next_iteration}, the job has only {cfg.iterations} "
                "iterations")
    return ""


def check_out(cfg: Config, out: Path, overwrite: bool, resume: Path | None,
              config_path: Path | None) -> None:
    """--out must be a folder that is new or empty, or, with --overwrite, one that holds none
    of the job's inputs (replacing it would delete them)."""
    folders = {"--out": out, "checkpoint.dir": Path(cfg.checkpoint.dir or out)}
    for what, folder in folders.items():
        blocker = blocking_file(folder)
        if blocker == folder:
            raise LaunchError(f"{what} {folder}: is a file, not a folder")
        if blocker is not None:
            raise LaunchError(f"{what} {folder}: cannot be made, {blocker} is a file")
    if not (out.exists() and any(out.iterdir())):
        return
    if not overwrite:
        raise LaunchError(f"--out {out}: the folder exists and is not empty; pass --overwrite "
                          "to replace it")
    _refuse_if_running(out)  # (said before the launch's work; checked again before deleting)
    inputs = {"--resume": resume, "the configuration": config_path,
              "data.path": Path(cfg.data.path) if cfg.data.path else None,
              "checkpoint.key": Path(cfg.checkpoint.key) if cfg.checkpoint.key else None}
    where = out.resolve()
    for what, path in inputs.items():
        if path is not None and path.resolve().is_relative_to(where):
            raise LaunchError(f"--out {out} --overwrite: the folder holds {what} ({path}); "
                              "replacing it would delete it. Choose another --out")


def make_out(out: Path) -> None:
    """Make the run folder and its logs folder, the first things the job writes; a file system
    that takes neither (read-only, full, not ours) is a LaunchError naming --out."""
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"--out {out}: cannot be made: {exc.strerror or exc}") from None


def _refuse_if_running(out: Path) -> None:
    """--overwrite of a run folder whose job still runs would delete its files under it."""
    try:
        durable.lock.refuse_if_held(out, "--out")
    except durable.lock.LockHeld as exc:
        raise LaunchError(f"--out {out} --overwrite: {exc}") from None


def _lock_out(out: Path) -> None:
    """One job per run folder: a second job started on it with --overwrite at the same
    moment is refused here (its files are the job's own; nothing of it is removed)."""
    try:
        durable.lock.acquire(out, out)
    except (durable.lock.LockHeld, OSError) as exc:
        raise LaunchError(f"--out {out}: {exc}") from None


def _restart_point(launcher: Launcher, code: int, trust: bool = False
                   ) -> tuple[bool, durable.Checkpoint | None]:
    """Whether to restart the workers, and from which checkpoint (None: from the start, as a
    torchrun script that finds none). Not when the round completed, or failed for another
    reason than a loss the job could not fail over (a software error would only repeat).

    The checkpoint is this job's newest that `--resume` would accept (`resume_problem`; `trust`
    as given to the job). Only iterations up to the newest this job committed or started from
    are looked at: a later folder there is another run's (a job resumed from an older
    checkpoint, or started afresh, in a folder that holds them), not this job's to go on from."""
    coordinator = launcher.coordinator
    if code == 0 or coordinator is None or not coordinator.stop_message:
        return False, None
    ours = _committed(launcher.out)
    if launcher.resume is not None:
        ours.append(launcher.resume.iteration)
    if not ours:
        return True, None
    problems: list[str] = []
    chosen = None
    for found in durable.verified(launcher.checkpoint_root, problems):
        if found.iteration > max(ours):
            continue
        problem = resume_problem(launcher.cfg, found, launcher.checkpoint_key, trust,
                                 num_samples=launcher.spec.num_samples)
        if not problem:
            chosen = found
            break
        problems.append(f"{found.path}: {problem}")
    for problem in problems:
        print(f"spotpipe: warning: restart: skipped a checkpoint: {problem}", file=sys.stderr)
    return True, chosen


def _committed(out: Path) -> list[int]:
    """The iterations this job committed checkpoints of (its events say)."""
    from spotpipe.runfiles import read_jsonl

    return [e["iteration"] for e in read_jsonl(out / "events.jsonl")
            if e["kind"] == "checkpoint_committed"]


def _unfired(faults: list[Fault], out: Path) -> list[Fault]:
    """Injected faults still to come: one that fired was a machine lost once, not again in
    the restarted round."""
    from spotpipe.runfiles import read_jsonl

    fired = {(e["node"], e["fault"], e["iteration"]) for e in read_jsonl(out / "events.jsonl")
             if e["kind"] == "fault_injected"}
    return [f for f in faults if (f.node, f.kind, f.iteration) not in fired]


def train(cfg: Config, out: Path, *, overwrite: bool = False, progress: bool = True,
          faults: list[Fault] | None = None,
          trace_actions: list[TraceAction] | None = None, resume: Path | None = None,
          joins: list[int] | None = None, trust_checkpoint: bool = False,
          config_path: Path | None = None) -> int:
    """Validate, bind the store, then run; raises LaunchError before writing anything."""
    check_out(cfg, out, overwrite, resume, config_path)
    prepared = prepare(cfg, cfg.stages * cfg.pipelines + len(joins or []))
    try:
        key = durable.resolve_key(cfg.checkpoint.key)
    except durable.KeyFileError as exc:
        raise LaunchError(str(exc)) from None
    notes: list[dict[str, Any]] = []
    checkpoint = (check_resume(cfg, resume, key, trust_checkpoint, notes,
                               num_samples=prepared.spec.num_samples)
                  if resume is not None else None)
    root = durable.written_root(cfg, out)  # one job per checkpoint folder
    try:
        if root is not None:
            durable.lock.refuse_if_held(root)
    except durable.lock.LockHeld as exc:
        raise LaunchError(f"checkpoint.dir: {exc}") from None
    own_lock = root is None or root.resolve() != out.resolve()  # (else the root's is out's)
    job_id = secrets.token_hex(8)
    store, address = bind_store(cfg, job_id)
    if out.exists() and overwrite:
        _refuse_if_running(out)
        shutil.rmtree(out)
    created = not out.exists()
    make_out(out)
    if own_lock:
        _lock_out(out)
    notes += prepared.write_initial(out)
    if root is not None:
        try:
            durable.lock.acquire(root, out)
        except (durable.lock.LockHeld, OSError) as exc:  # (nothing of this job stays)
            (out / template.INITIAL_FILE).unlink(missing_ok=True)
            if own_lock:
                durable.lock.release(out)
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise LaunchError(f"checkpoint.dir: {exc}") from None
        removed, checkpoint = durable.take_up(root, checkpoint)
        notes += [{"kind": "checkpoint_partial_removed", "path": str(p)} for p in removed]
    launcher = Launcher(prepared, out, progress=progress, faults=faults,
                        trace_actions=trace_actions, resume=checkpoint, joins=joins)
    launcher.notes = notes
    try:
        code = launcher.run(store, address)
        for restart in range(1, cfg.failover.restarts + 1):
            again, newest = _restart_point(launcher, code, trust_checkpoint)
            if not again:
                break
            # as torchrun's agent: this process and its store stay; only the workers start
            # again, under a new round of keys, from the newest checkpoint
            if root is not None:
                durable.begin_timeline(root, newest)
            launcher = Launcher(prepared, out, progress=progress,
                                faults=_unfired(launcher.faults, out),
                                resume=newest, t0=launcher.t0, first=launcher.job_start(),
                                restart=restart)
            round_address = address.within(f"restart{restart}")
            code = launcher.run(round_address.connect(cfg.cluster.timeout_s), round_address)
        return code
    finally:
        # (reproducible from the seed, and as large as the model: the run's result is final/)
        (out / template.INITIAL_FILE).unlink(missing_ok=True)
        if root is not None:
            durable.lock.release(root)
        if own_lock:
            durable.lock.release(out)
        if address.kind == "etcd":  # the job is over: its keys go (other jobs keep theirs)
            from spotpipe.store.etcd import EtcdStore

            if isinstance(store, EtcdStore):
                kept = "etcd was lost while the job ran" if launcher.store_lost else ""
                if not kept:
                    try:
                        store.delete_prefix()
                    except dist.DistNetworkError as exc:
                        kept = str(exc)
                if kept:
                    print(f"spotpipe: the job's keys stay in etcd under {address.prefix}: "
                          f"{kept}", file=sys.stderr)
        # the store's listening port must be free when train() returns: drop every reference
        # (the coordinator and the launcher refer to each other) so the server shuts down now
        launcher.coordinator = None
        del launcher, store
        import gc

        gc.collect()  # (cycles within the coordinator's parts hold the store too)
