"""The local multi-node launcher: `spotpipe train` on one machine.

It plays the part torchrun's agent plays: hosts the store (so the store outlives any worker),
starts one worker process per node with torchrun's environment variables, watches them, and is
the single writer of the run's output files. Everything that can be wrong with the input is
checked here before the output folder exists or a process starts.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file

from spotpipe.checkpoint import durable
from spotpipe.config import Config
from spotpipe.cluster.channel import MAILBOX, WorkerChannel, read_mailbox
from spotpipe.cluster.coordinator import Coordinator
from spotpipe.cluster.trace_replay import Action as TraceAction
from spotpipe.plan import Layout
from spotpipe.runtime.faults import Fault
from spotpipe import job


class LaunchError(RuntimeError):
    """Input that cannot run; raised before anything is written or started."""


@dataclass
class Prepared:
    cfg: Config
    spec: job.RunSpec


def search_path(cfg: Config) -> list[str]:
    """Where user factories are imported from: the working folder and the config's folder."""
    return [p for p in dict.fromkeys([os.getcwd(), cfg.source_dir]) if p]


def prepare(cfg: Config) -> Prepared:
    """Build model and dataset once and decide the partition; turn every failure into a
    LaunchError that says what to fix."""
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
        partition = job.compute_partition(cfg, model, dataset)
    except Exception as exc:
        key = "model.stage_of_layer" if cfg.model.partition == "explicit" else "model.partition"
        raise LaunchError(f"{key}: {exc}") from None
    name = job.misplaced_tie(model, partition)
    if name:
        raise LaunchError(f"model: tied parameter {name} is split across stages but is on "
                          "neither the first nor the last stage; only ties between the first "
                          "and last stage (like GPT's embedding and head) are kept in sync")
    return Prepared(cfg, job.RunSpec(partition, len(dataset)))


def bind_store(cfg: Config) -> dist.TCPStore:
    try:
        return dist.TCPStore(cfg.cluster.host, cfg.cluster.port, is_master=True,
                             wait_for_workers=False,
                             timeout=timedelta(seconds=cfg.cluster.timeout_s))
    except Exception as exc:
        raise LaunchError(f"cluster.port: cannot start the store on {cfg.cluster.host}:"
                          f"{cfg.cluster.port} ({exc}); the port may be taken: choose another "
                          "or 0 for a free one") from None


def _die_with_parent() -> None:
    """Workers get SIGKILL if the launcher dies, so no worker outlives its job."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class RunFiles:
    """The run's output files, written by the launcher only."""

    out: Path
    metrics: TextIO = field(init=False)
    events: TextIO = field(init=False)
    tensorboard: Any = None

    def __post_init__(self) -> None:
        self.metrics = open(self.out / "metrics.jsonl", "w")
        self.events = open(self.out / "events.jsonl", "w")

    def event(self, record: dict[str, Any]) -> None:
        self.events.write(json.dumps(record) + "\n")
        self.events.flush()

    def metric(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tensorboard is not None:
            step = record["iter"]
            for key in ("loss", "samples_per_s", "lr", "grad_norm", "live_nodes"):
                if key in record:
                    self.tensorboard.add_scalar(key, record[key], step)

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class Launcher:
    def __init__(self, prepared: Prepared, out: Path, *, progress: bool = True,
                 stream: TextIO | None = None, faults: list[Fault] | None = None,
                 trace_actions: list[TraceAction] | None = None,
                 resume: durable.Checkpoint | None = None,
                 joins: list[int] | None = None) -> None:
        self.cfg = prepared.cfg
        self.spec = prepared.spec
        self.out = out
        self.progress = progress and self.cfg.logging.progress
        self.stream = stream if stream is not None else sys.stderr
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.shadow_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.t0 = time.time()
        self._train_start = self.t0
        self.faults = list(faults or [])
        self.joins = sorted(joins or [])
        # every node must present it to join (a node from another job or a stray process
        # cannot disturb this one); real clusters pass it to their agents
        self.token = os.environ.get("SPOTPIPE_JOIN_TOKEN") or secrets.token_hex(16)
        self.resume = resume
        self._ckpt_parts: dict[int, dict[int, dict[str, str]]] = {}
        self.checkpoint_root = Path(self.cfg.checkpoint.dir or out / "checkpoints")
        self.trace_actions = sorted(trace_actions or [], key=lambda a: a.at_s)

    # ------------------------------------------------------------------ set-up

    def _write_inputs(self) -> None:
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        (self.out / "run.json").write_text(json.dumps(self.spec.to_json(), indent=1))

    def _spawn_shadow(self, stage: int, port: int,
                      inbox: "queue.Queue[tuple[str, Any]]") -> None:
        """The CPU shadow of `stage` runs here, next to the store: on the host that is not
        preempted (see spotpipe.checkpoint.shadow)."""
        env = self._env(0, 1, port)
        env["SPOTPIPE_SHADOW_STAGE"] = str(stage)
        name = f"shadow{stage}"
        with open(self.out / "logs" / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "spotpipe.checkpoint.shadow"],
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=_die_with_parent)
        self.shadow_procs[name] = proc
        threading.Thread(target=lambda: inbox.put(("shadow_exit", (name, proc.wait()))),
                         name=f"wait-{name}", daemon=True).start()

    def _env(self, rank: int, world: int, port: int, joining: bool = False) -> dict[str, str]:
        return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=self.cfg.cluster.host,
                   MASTER_PORT=str(port), SPOTPIPE_RUN_DIR=str(self.out),
                   SPOTPIPE_T0=repr(self.t0), OMP_NUM_THREADS=str(self.cfg.cluster.threads_per_worker),
                   SPOTPIPE_FAULTS=json.dumps([f.to_json() for f in self.faults]),
                   SPOTPIPE_JOIN="1" if joining else "", SPOTPIPE_JOIN_GATED="1" if joining else "",
                   SPOTPIPE_JOIN_TOKEN=self.token,
                   SPOTPIPE_RESUME=str(self.resume.path) if self.resume else "",
                   PYTHONPATH=os.pathsep.join(search_path(self.cfg)
                                              + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))

    def _spawn(self, rank: int, world: int, port: int,
               inbox: "queue.Queue[tuple[str, Any]]", joining: bool = False) -> None:
        env = self._env(rank, world, port, joining)
        log = open(self.out / "logs" / f"node{rank}.log", "wb")
        node = f"node{rank}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "spotpipe.runtime.worker"], env=env, stdout=log,
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        self.procs[node] = proc
        threading.Thread(target=lambda: inbox.put(("exit", (node, proc.wait()))),
                         name=f"wait-{node}", daemon=True).start()

    # ------------------------------------------------------------------ run

    def run(self, store: dist.TCPStore) -> int:
        cfg = self.cfg
        world = cfg.stages * cfg.pipelines
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self._write_inputs()
        files = self.files = RunFiles(self.out)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            files.tensorboard = SummaryWriter(str(self.out / "tensorboard"))
        files.event({"time_s": 0.0, "kind": "launch", "node": "launcher", "stages": cfg.stages,
                     "pipelines": cfg.pipelines, "partition": self.spec.partition,
                     "redundancy": cfg.redundancy, "store": f"{cfg.cluster.host}:{store.port}",
                     "faults": [f.to_json() for f in self.faults], "t0": self.t0,
                     **({"resumed_from": str(self.resume.path),
                         "start_iteration": self.resume.next_iteration} if self.resume else {})})
        nodes = [f"node{r}" for r in range(world)]
        self.coordinator = Coordinator(
            cfg=cfg, store=store, layout=Layout.build(cfg.stages, cfg.pipelines, nodes),
            kill=self._kill, emit=files.event, now=self._now, token=self.token,
            partition=self.spec.partition, partition_for=self._partition_for)
        inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._inbox, self._port, self._store = inbox, store.port, store
        self._exited: dict[str, int] = {}
        self._shadow_exited: dict[str, int] = {}
        self._watch_mailbox(store.port, inbox)
        bar = self._bar = self._progress_bar()
        status, message = "failed", ""
        self._last: dict[str, Any] | None = None
        self._received = 0
        errors: dict[str, str] = {}
        try:
            if cfg.shadow.enabled:
                for stage in range(cfg.stages):
                    self._spawn_shadow(stage, store.port, inbox)
            for rank in range(world):
                self._spawn(rank, world, store.port, inbox)
            # joining nodes start now, ready, and ask to join when their iteration comes (a
            # spot instance that becomes available has booted before it asks)
            for k, at in enumerate(sorted(self.joins)):
                self._spawn(world + k, world, store.port, inbox, joining=True)
            self.joins = [(at, f"node{world + k}") for k, at in enumerate(sorted(self.joins))]
            exited = self._exited  # Popen.poll() is unreliable while a thread waits on the child
            last_tick = time.time()
            while True:
                wait = cfg.failover.heartbeat_s
                if self.trace_actions:
                    wait = min(wait, max(0.0, self._trace_due() - time.time()))
                try:
                    what, item = inbox.get(timeout=wait)
                except queue.Empty:
                    what, item = "tick", None
                self._fire_trace(files)
                if time.time() - last_tick >= cfg.failover.heartbeat_s:
                    last_tick = time.time()
                    self.coordinator.tick()
                if what == "record":
                    self._handle_record(what, item, files, errors)
                elif what == "exit":
                    node, code = item
                    exited[node] = code
                    if code == 1:  # a software error: failing over would repeat it elsewhere
                        self._drain(inbox, files, errors, store)
                        detail = errors.get(node) or f"exited with code {code}"
                        message = f"{node} failed: {detail} (log: {self.out}/logs/{node}.log)"
                        files.event({"time_s": self._now(), "kind": "worker_failed",
                                     "node": node, "returncode": code, "message": detail})
                        break
                    if code != 3:  # 3: stopped by the plan, already accounted for
                        self.coordinator.node_exited(node, code)
                    running = [n for n, p in self.procs.items() if n not in exited]
                    if running and not (set(running) & self.coordinator.live):
                        self.coordinator.release_standby()  # only standby joiners are left
                        for _, node in self.joins:  # and joiners whose iteration never came
                            self._store.set(f"spotpipe/join_gate/{node}", "over")
                        self.joins = []
                    if len(exited) == len(self.procs) and (
                            self._shadows_done() or self.coordinator.stop_message):
                        message = self._complete(inbox, files, errors, store)
                        status = "completed" if not message else status
                        break
                elif what == "shadow_exit":
                    name, code = item
                    self._shadow_exited[name] = code
                    if code != 0:
                        self._drain(inbox, files, errors, store)
                        detail = errors.get(name) or f"exited with code {code}"
                        message = f"{name} failed: {detail} (log: {self.out}/logs/{name}.log)"
                        files.event({"time_s": self._now(), "kind": "shadow_failed",
                                     "node": name, "returncode": code, "message": detail})
                        break
                    if len(exited) == len(self.procs) and self._shadows_done():
                        message = self._complete(inbox, files, errors, store)
                        status = "completed" if not message else status
                        break
                elif what == "mailbox_closed":
                    message = f"lost the store: {item}"
                    break
        except KeyboardInterrupt:
            message = "interrupted"
        finally:
            self._stop_workers()
            self._close_mailbox(store)
            if bar is not None:
                bar.close()
            wall = time.time() - self.t0
            files.event({"time_s": round(wall, 6), "kind": "job_" + status, "node": "launcher",
                         **({"message": message} if message else {})})
            files.close()
            self._write_summary(status, message, self._last, wall)
        if status != "completed":
            print(f"spotpipe: training failed: {message}", file=self.stream)
            return 1
        return 0

    def _shadows_done(self) -> bool:
        return len(self._shadow_exited) == len(self.shadow_procs)

    def _complete(self, inbox: "queue.Queue[tuple[str, Any]]", files: RunFiles,
                  errors: dict[str, str], store: dist.TCPStore) -> str:
        """Every process is done: write what is left; return why the run did not complete."""
        self._drain(inbox, files, errors, store)
        message = self._completion_problem()
        if not message:
            self._merge_final()
        return message

    def _completion_problem(self) -> str:
        """Why a run whose workers all exited did not complete ("" when it did)."""
        if self.coordinator.stop_message:
            return self.coordinator.stop_message
        final = self.out / "final"
        missing = [s for s in range(self._stage_count())
                   if not (final / f"stage{s}.safetensors").exists()]
        if missing or self._last is None:
            done = 0 if self._last is None else self._last["iter"] + 1
            return f"workers exited after {done} of {self.cfg.iterations} iterations"
        return ""

    def _checkpoint_saved(self, item: dict[str, Any], files: RunFiles) -> None:
        """Commit a checkpoint once every stage of its iteration is on disk (single writer)."""
        t = item["iteration"]
        parts = self._ckpt_parts.setdefault(t, {})
        parts[item["stage"]] = item["checksums"]
        partition = self.coordinator.partition or self.spec.partition
        if len(parts) < len(partition):
            return
        checksums = {k: v for stage in parts.values() for k, v in stage.items()}
        info = {"partition": [list(r) for r in partition], "stages": len(partition),
                "pipelines": self.cfg.pipelines, "config_digest": self.cfg.digest(),
                "model_digest": self.cfg.model_digest(), "num_samples": self.spec.num_samples,
                "global_batch": self.cfg.global_batch, "seed": self.cfg.seed}
        path = durable.commit(self.checkpoint_root, t, info, checksums, self.cfg.checkpoint.keep)
        del self._ckpt_parts[t]
        files.event({"time_s": self._now(), "kind": "checkpoint_committed", "node": "launcher",
                     "iteration": t, "path": str(path)})

    def _partition_for(self, depth: int) -> list[tuple[int, int]]:
        """The partition at another depth, decided here once for every worker (as at launch:
        profiling is noisy, so the workers must not each compute their own)."""
        if self._partition_inputs is None:
            self._partition_inputs = (job.build_model(self.cfg), job.build_dataset(self.cfg))
        return job.partition_at_depth(self.cfg, *self._partition_inputs, depth)

    _partition_inputs: tuple[Any, Any] | None = None

    def _stage_count(self) -> int:
        """Stages of the job as it ended (a re-partition changes the depth)."""
        coordinator = getattr(self, "coordinator", None)
        return len(coordinator.partition) if coordinator and coordinator.partition \
            else self.cfg.stages

    def _kill(self, node: str) -> None:
        proc = self.procs.get(node)
        if proc is not None and node not in self._exited:
            proc.kill()

    def _trace_due(self) -> float:
        return self._trace_due_of(self.trace_actions[0])

    def _trace_due_of(self, action: TraceAction) -> float:
        return self._train_start + action.at_s

    def _fire_trace(self, files: RunFiles) -> None:
        """Carry out the trace's actions that are due (the clock starts at the first metrics)."""
        while self.trace_actions and self._last is not None and time.time() >= self._trace_due():
            action = self.trace_actions.pop(0)
            if action.kind == "available":
                files.event({"time_s": self._now(), "kind": "trace_available",
                             "node": "launcher", "trace_node": action.trace_node})
                self._trace_join(files)
                continue
            proc = self.procs.get(action.node)
            if proc is None or action.node in self._exited:
                continue
            at = self._now()
            os.kill(proc.pid, signal.SIGKILL if action.kind == "kill" else signal.SIGTERM)
            files.event({"time_s": at, "kind": "trace_" + action.kind, "node": action.node,
                         "trace_node": action.trace_node, "due_s": round(
                             self._trace_due_of(action) - self.t0, 6)})

    def _trace_join(self, files: RunFiles) -> None:
        """A trace adds a spot instance: start a node that joins at once, while the job runs
        on fewer nodes than it started with (the local machine is not grown beyond that)."""
        world = self.cfg.stages * self.cfg.pipelines
        running = [n for n in self.procs if n not in self._exited]
        if len(running) >= world or self.coordinator.over:
            return
        rank = len(self.procs)
        node = f"node{rank}"
        files.event({"time_s": self._now(), "kind": "node_started", "node": node,
                     "joining": True, "reason": "trace"})
        self._store.set(f"spotpipe/join_gate/{node}", "trace")
        self._spawn(rank, world, self._port, self._inbox, joining=True)

    def _now(self) -> float:
        return round(time.time() - self.t0, 6)

    def _drain(self, inbox: "queue.Queue[tuple[str, Any]]", files: RunFiles,
               errors: dict[str, str], store: dist.TCPStore) -> None:
        """Write every record posted so far: a worker posts its last record before it exits,
        so once it has exited, the store's mailbox count says how many records to wait for."""
        posted = store.add(f"{MAILBOX}/count", 0)
        # the count may lag by a record whose writer was killed right after writing it
        while self._received < posted or store.check([f"{MAILBOX}/{self._received + 1}"]):
            what, item = inbox.get(timeout=self.cfg.cluster.timeout_s)
            self._handle_record(what, item, files, errors)

    def _handle_record(self, what: str, item: Any, files: RunFiles,
                       errors: dict[str, str]) -> None:
        if what != "record":
            return
        self._received += 1
        kind = item.pop("type")
        if kind == "metrics":
            if self._last is None:
                self._train_start = time.time()
            files.metric(item)
            self._last = item
            self._update_bar(self._bar, item)
            while self.joins and item["iter"] >= self.joins[0][0]:
                at, node = self.joins.pop(0)
                files.event({"time_s": self._now(), "kind": "node_available", "node": node,
                             "iteration": item["iter"]})
                self._store.set(f"spotpipe/join_gate/{node}", str(at))
        elif kind == "event" and item["kind"] == "checkpoint_saved":
            files.event({k: v for k, v in item.items() if k != "checksums"})
            self._checkpoint_saved(item, files)
        elif kind == "join":
            files.event({"time_s": item.pop("time_s"), "kind": "join_requested",
                         "node": item["node"]})
            self.coordinator.join(item)
        elif kind == "report":
            files.event({"time_s": item.pop("time_s"), "kind": "report", **item})
            item["time_s"] = 0.0
            self.coordinator.report(item)
        else:
            files.event(item)
            if item["kind"] in ("worker_error", "shadow_error"):
                errors[item["node"]] = item["message"]

    def _watch_mailbox(self, port: int, inbox: "queue.Queue[tuple[str, Any]]") -> None:
        client = dist.TCPStore(self.cfg.cluster.host, port, is_master=False,
                               timeout=timedelta(seconds=self.cfg.cluster.timeout_s))

        def pump() -> None:
            try:
                for record in read_mailbox(client):
                    if record.get("type") == "close":
                        return
                    inbox.put(("record", record))
            except Exception as exc:  # the store went away: only at shutdown, or a real fault
                inbox.put(("mailbox_closed", str(exc)))

        self._pump = threading.Thread(target=pump, name="mailbox", daemon=True)
        self._pump.start()

    def _close_mailbox(self, store: dist.TCPStore) -> None:
        """Post the closing record, so the reader thread leaves its blocking wait and ends
        before the interpreter does (a thread inside a store call at exit aborts the process)."""
        WorkerChannel(store, "launcher", self.t0)._post({"type": "close"})
        self._pump.join(timeout=10)

    def _stop_workers(self) -> None:
        procs = list(self.procs.values()) + list(self.shadow_procs.values())
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _merge_final(self) -> None:
        final = self.out / "final"
        merged: dict[str, Any] = {}
        parts = [final / f"stage{s}.safetensors" for s in range(self._stage_count())]
        for part in parts:
            merged.update(load_file(str(part)))
        tmp = final / ".model.safetensors.tmp"
        save_file(merged, str(tmp), metadata={"spotpipe_config": self.cfg.digest()})
        os.replace(tmp, final / "model.safetensors")
        for part in parts:
            part.unlink()

    def _write_summary(self, status: str, message: str, last: dict[str, Any] | None,
                       wall: float) -> None:
        cfg = self.cfg
        iters = 0 if last is None else last["iter"] + 1
        summary = {
            "status": status, "message": message, "iterations": iters,
            "samples": 0 if last is None else last["samples"],
            "final_loss": None if last is None else last["loss"],
            "wall_s": round(wall, 3),
            "train_s": None if last is None else last["time_s"],
            "samples_per_s": None if not last else round(last["samples"] / last["time_s"], 3),
            "stages": cfg.stages, "pipelines": cfg.pipelines, "schedule": cfg.schedule,
            "partition": self.spec.partition, "config_digest": cfg.digest(),
        }
        tmp = self.out / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, self.out / "summary.json")

    # ------------------------------------------------------------------ progress

    def _progress_bar(self) -> Any:
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.iterations, desc="train", unit="it", file=self.stream,
                    dynamic_ncols=True)

    def _update_bar(self, bar: Any, record: dict[str, Any]) -> None:
        if bar is None:
            return
        bar.update(1)
        bar.set_postfix_str(f"loss {record['loss']:.4f} | {record['samples_per_s']:.1f} samples/s"
                            f" | nodes {record['live_nodes']}/{self.cfg.stages * self.cfg.pipelines}"
                            f" double {record.get('carriers', 0)} gen {record['generation']}")


def check_resume(cfg: Config, path: Path) -> durable.Checkpoint:
    """The checkpoint to resume from, refused clearly if it belongs to another model."""
    try:
        ckpt, skipped = durable.resolve(path)
    except durable.CheckpointError as exc:
        raise LaunchError(f"--resume: {exc}") from None
    for problem in skipped:
        print(f"spotpipe: warning: skipped a bad checkpoint: {problem}", file=sys.stderr)
    m = ckpt.manifest
    if m.get("model_digest") != cfg.model_digest():
        raise LaunchError(f"--resume {ckpt.path}: the checkpoint is of another model or "
                          "optimizer (model/optimizer configuration differs)")
    if m.get("global_batch") != cfg.global_batch or m.get("seed") != cfg.seed:
        raise LaunchError(
            f"--resume {ckpt.path}: written with global batch {m.get('global_batch')} and seed "
            f"{m.get('seed')}, this job has {cfg.global_batch} and {cfg.seed}; the data order "
            "depends on both (keep micro_batch_size x num_microbatches x pipelines the same)")
    if ckpt.next_iteration >= cfg.iterations:
        raise LaunchError(f"--resume {ckpt.path}: it is at iteration {ckpt.next_iteration}, the "
                          f"job has only {cfg.iterations} iterations")
    return ckpt


def train(cfg: Config, out: Path, *, overwrite: bool = False, progress: bool = True,
          faults: list[Fault] | None = None,
          trace_actions: list[TraceAction] | None = None, resume: Path | None = None,
          joins: list[int] | None = None) -> int:
    """Validate, bind the store, then run; raises LaunchError before writing anything."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LaunchError(f"--out {out}: the folder exists and is not empty; pass --overwrite "
                              "to replace it")
    prepared = prepare(cfg)
    checkpoint = check_resume(cfg, resume) if resume is not None else None
    store = bind_store(cfg)
    if out.exists() and overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(prepared, out, progress=progress, faults=faults,
                        trace_actions=trace_actions, resume=checkpoint, joins=joins)
    try:
        return launcher.run(store)
    finally:
        # the store's listening port must be free when train() returns: drop every reference
        # (the coordinator and the launcher refer to each other) so the server shuts down now
        launcher.coordinator = None
        del launcher, store
