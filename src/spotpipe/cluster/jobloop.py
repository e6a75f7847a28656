"""The coordinator's loop: one per job, next to the store, never on a preemptible worker.

It is what `spotpipe train` runs after starting its workers, and what the elected node agent
runs for a multi-host job: read the workers' records from the store's mailbox, write the run's
output files (metrics, events, summary, final model; the single writer), feed failures, exits
and joins to the `Coordinator`, tick its heartbeat checks, and decide when the job is over.

Where the workers run is not its business: a subclass starts and stops them (the local
launcher through a `Supervisor` on this machine; the agent's coordinator through the store,
each agent supervising its own host) and tells the loop of their exits, either directly or as
"exit" records in the mailbox.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.cluster.checkpoint_parts import CheckpointParts, durable_tier
from spotpipe.cluster.checkpoint_intake import CheckpointIntake
from spotpipe.cluster.coordinator import Coordinator
from spotpipe.cluster.journal import JournalFolder, read_back
from spotpipe.cluster.inbox import (HelperEvent, Inbox, Item, MailboxClosed, NodeExit,
                                    RefusedUpload, ShadowExit)
from spotpipe.cluster.metrics_lines import MetricsLines
from spotpipe.cluster.run_files import RunFiles, RunFilesError
from spotpipe.protocol import (Channel, CheckpointSaved, Close, CoordinatorState, Event, Exit,
                               FinalUpload, JoinRequest, Metrics, Notice, Opened, Refused, Report,
                               StageUpload, Stalled, job_key)
from spotpipe.store import mailbox
from spotpipe.store.address import StoreAddress
from spotpipe.cluster.supervisor import (SHADOW, STOP_GRACE_S, Supervisor, interruption,
                                         search_path, starter, worker_env)
from spotpipe.config import Config
from spotpipe.store.leader import NotLeader
from spotpipe.store.sealed import SealedStore


class Deposed(RuntimeError):
    """This coordinator lost its office (its lease expired): a successor may be acting."""


class HandedOver(Deposed):
    """This coordinator left its office on its host's notice, its books whole in the store:
    a successor goes on from them. The loop ends as a deposed one does, but not in failure."""


def stop_grace(status: str, *, interrupted: bool, deposed: bool) -> float:
    """How long the workers still running when the loop leaves get between SIGTERM and
    SIGKILL. After a Ctrl-C, or a failure that ends the job while workers run (a worker's
    error, the store lost), nobody coordinates them any more: the grace a SIGTERM gives them
    (their preemption notice: leave at the next boundary, on a plan) would only be waited out
    (every failed job took 10 s more to say so). A job that completed has no worker left; one
    handed to a successor keeps the grace."""
    if interrupted or (status == "failed" and not deposed):
        return 0.0
    return STOP_GRACE_S


class JobLoop:
    """The coordinator's loop over one run folder; subclasses say where the workers run."""

    def __init__(self, cfg: Config, spec: job.RunSpec, out: Path, *, token: str | bytes,
                 instance: str, progress: bool = True, stream: TextIO | None = None,
                 resume: durable.Checkpoint | None = None, t0: float | None = None,
                 writer: str = "coordinator", restart: int = 0,
                 first: int | None = None) -> None:
        self.cfg = cfg
        self.spec = spec
        self.out = out
        self.token = token
        self.instance = instance
        # the job's key: every record this loop reads must be sealed under it
        self.channel = Channel(job_key(token, instance), writer)
        self.progress = progress and cfg.logging.progress
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.time() if t0 is None else t0
        self._train_start = self.t0
        self.resume = resume
        self.restart = restart  # 0, or which restart of the job this round is
        # the job's first iteration, where `t0`'s round started (a restart's round is given
        # it: it resumes past it); None: this loop's first line
        self.first = first
        self.checkpoint_root = Path(cfg.checkpoint.dir or out / "checkpoints")
        self.checkpoint_key = durable.resolve_key(cfg.checkpoint.key)
        # (its events go to the run files, made when the loop runs)
        self.intake = CheckpointIntake(cfg, spec, self.checkpoint_root, self.checkpoint_key,
                                       self._now, lambda record: self.files.event(record))
        self.notes: list[dict[str, Any]] = []  # events decided before the run started
        self._shadows: Supervisor | None = None
        # a predecessor's books: this loop takes over a running job instead of starting one
        self.takeover: CoordinatorState | None = None
        self._journal = 0  # journal records written (or replayed) so far
        self._folder = JournalFolder()  # which of them are folded into segments
        self.store_lost = False  # the store went away for good (etcd unreachable)

    # ------------------------------------------------------------------ where workers run

    def _start_nodes(self, address: StoreAddress, inbox: Inbox) -> None:
        """Start (or let start) the job's first nodes; their exits come through `inbox`."""
        raise NotImplementedError

    def _started(self) -> list[str]:
        """Every node started so far; the job is over when all of them have exited."""
        raise NotImplementedError

    def _kill(self, node: str) -> None:
        raise NotImplementedError

    def _exit_cause(self, node: str, code: int) -> str:
        """What this process knows of why `node` exited with `code` ("": nothing more)."""
        return ""

    def _exit_refusal(self, writer: str, node: str) -> str:
        """Why an exit record from `writer` about `node` is not taken ("": it is). Only a
        node agent writes them, of its own host's workers; this loop's workers are its own
        processes, whose exits it sees itself."""
        return f"an exit record for {node}, where no agent runs the workers"

    def _stop_workers(self, grace_s: float = STOP_GRACE_S) -> None:
        """The loop is leaving: no worker may outlive the job (SIGTERM, SIGKILL after
        `grace_s`)."""

    def _launch_details(self) -> dict[str, Any]:
        return {}

    def _wait_limit(self) -> float:
        """How long the loop may block on its inbox before its next turn."""
        return self.cfg.failover.heartbeat_s

    def _each_turn(self, files: RunFiles) -> None:
        """Called on every turn of the loop (timed actions)."""

    def _on_metrics(self, item: dict[str, Any], files: RunFiles) -> None:
        """Called on each iteration's metrics (iteration-triggered actions)."""

    def _only_standby_left(self) -> None:
        """Every running node waits on standby: training is over for them."""
        self.coordinator.release_standby()

    def _gather_final(self) -> str:
        """Bring the final stage files into this run folder; a problem, or "" when done."""
        return ""

    def _final_upload(self, message: FinalUpload, writer: str) -> None:
        """An agent's final stage file on its way (agent jobs only: here the workers write
        into this run folder themselves)."""
        self.coordinator.refused(writer, "a final_upload record in a job without agents")

    def _persist(self, files: RunFiles) -> None:
        """End of a turn: keep what a successor needs in the store (agent jobs on etcd)."""

    def _resume_nodes(self, inbox: Inbox) -> None:
        """Taking over: the nodes run already; only their exits are to come through `inbox`."""
        raise NotImplementedError

    def _read_through(self) -> int:
        """The mailbox's slots up to this one are read for good: none is read again, by this
        loop or a successor (`mailbox.ReadSlots` deletes them once far behind)."""
        return self._received

    @property
    def _tombstone_on_read(self) -> bool:
        """Whether the mailbox reader marks a slot read as it reads it; a loop that keeps its
        books in the store marks slots only once its saved state has taken them in."""
        return True

    # ------------------------------------------------------------------ the loop

    def _write_inputs(self) -> None:
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        (self.out / "run.json").write_text(json.dumps(self.spec.to_json(), indent=1))

    def run(self, store: dist.Store, address: StoreAddress) -> int:
        cfg = self.cfg
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self._write_inputs()
        files = self.files = RunFiles(self.out, append=self.restart > 0,
                                      journaled=not self._tombstone_on_read)
        first = self.resume.next_iteration if self.resume else 0
        if cfg.logging.tensorboard:
            files.tensorboard = self._tensorboard(first)
        if self.takeover is None:
            self._launch_event(files, address)
        self.lines = MetricsLines(
            cfg, first, write=self._line_written, event=files.event,
            refused=lambda writer, why: self.coordinator.refused(writer, why),
            now=self._now, current=lambda: (self.coordinator.generation,
                                            self.coordinator.layout))
        self.coordinator = Coordinator(
            cfg=cfg, store=store, layout=job.first_layout(cfg),
            kill=self._kill, emit=files.event, now=self._now, channel=self.channel,
            partition=self.spec.partition, partition_for=self._partition_for,
            min_stages=job.min_stages(self.cfg, self.spec.profile),
            stages_fit=job.stages_fit(self.cfg, self.spec.profile),
            start=self.resume.next_iteration if self.resume else 0, agreed=self.lines.agreed)
        inbox: Inbox = queue.Queue()
        self._inbox, self._address, self._store = inbox, address, store
        self.intake.open(SealedStore(store, self.channel.key), self._upload_connection)
        self._exited: dict[str, int] = {}
        self._errors: dict[str, str] = {}  # a node's error, as it reported it
        self._received = 0
        if self.takeover is not None:
            self._restore(files, self.takeover)
        self._read_slots = mailbox.ReadSlots(store, self._received)
        self._note_layout()
        self._watch_mailbox(address, inbox, start=self._received + 1)
        return self._loop(files, inbox, store, address)

    def _tensorboard(self, first: int) -> Any:
        """TensorBoard's writer. A restart's round trains again the iterations after its
        checkpoint, in the same folder: TensorBoard is told to drop the round before's points
        from `first` on (`purge_step`), or it would show those steps twice, going back."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.out / "tensorboard"),
                             purge_step=first if self.restart else None)

    def _launch_event(self, files: RunFiles, address: StoreAddress) -> None:
        cfg = self.cfg
        files.event({"time_s": self._now() if self.restart else 0.0, "kind": "launch",
                     "node": "launcher",
                     **({"restart": self.restart} if self.restart else {}), "stages": cfg.stages,
                     "repartition": (cfg.failover.repartition and not cfg.shadow.enabled
                                     and cfg.checkpoint.scheme != "gemini"),
                     "pipelines": cfg.pipelines, "partition": self.spec.partition,
                     "microbatches": cfg.num_microbatches * cfg.pipelines,
                     "redundancy": cfg.redundancy, "store": f"{address.host}:{address.port}",
                     "store_kind": address.kind, "instance": self.instance,
                     **({"store_prefix": address.prefix} if address.prefix else {}),
                     **self._launch_details(), "t0": self.t0,
                     **({"resumed_from": str(self.resume.path),
                         "start_iteration": self.resume.next_iteration} if self.resume else {})})
        for note in self.notes:
            files.event({"time_s": 0.0, "node": "launcher", **note})

    def _loop(self, files: RunFiles, inbox: Inbox, store: dist.Store,
              address: StoreAddress) -> int:
        cfg = self.cfg
        bar = self._bar = self._progress_bar()
        status, message = "failed", ""
        deposed = handed_over = interrupted = False
        self._shadow_exited: dict[str, int] = {}
        try:
            if cfg.shadow.enabled and self.takeover is None:
                self._spawn_shadows(address, inbox)
            if self.takeover is None:
                self._start_nodes(address, inbox)
            else:
                self._resume_nodes(inbox)
            last_tick = time.time()
            while True:
                try:
                    item: Item | None = inbox.get(timeout=self._wait_limit())
                except queue.Empty:
                    item = None  # (a turn for the timed checks alone)
                self._each_turn(files)
                self.intake.turn(self.coordinator.dead)
                if time.time() - last_tick >= cfg.failover.heartbeat_s:
                    last_tick = time.time()
                    self.coordinator.tick()
                    self._repair_mailbox_count(store)
                    self._note_layout()
                ended = self._take(item) if item is not None else None
                self._note_layout()
                if ended is not None:
                    status, message = ended
                    break
                self._persist(files)
                self._read_slots.turn(self._read_through())
        except KeyboardInterrupt as exc:
            (how, interrupted_code), interrupted = interruption(exc), True
            message = f"interrupted ({how})"
            _hold_interrupts(self.stream)
        except RunFilesError as exc:
            message = str(exc)
        except Deposed as exc:
            message, deposed = str(exc), True
            handed_over = isinstance(exc, HandedOver)
        except NotLeader as exc:  # (a write of this turn refused: another agent coordinates)
            message, deposed = f"this agent no longer holds the coordinator's office: {exc}", True
        except dist.DistNetworkError as exc:  # the store is gone (etcd unreachable past
            # cluster.timeout_s): the workers are cut off from its records too; say so
            message, self.store_lost = f"lost the store: {exc}", True
        finally:
            grace_s = stop_grace(status, interrupted=interrupted, deposed=deposed)
            self._stop_workers(grace_s)
            try:
                self.intake.end(abandon=deposed)
            except RunFilesError:
                pass  # (the job's own outcome is reported below)
            if self._shadows is not None:
                self._shadows.stop_all(grace_s)
            if not deposed:  # (a successor reads this mailbox on: no closing record in it)
                self._close_mailbox(store)
            if bar is not None:
                bar.close()
            if deposed:
                print(f"spotpipe: {message}", file=self.stream)
                files.close()
                return 0 if handed_over else 1
            wall = time.time() - self.t0
            try:
                files.event({"time_s": round(wall, 6), "kind": "job_" + status,
                             "node": "launcher", **({"message": message} if message else {})})
            except RunFilesError:
                pass  # the message is in the summary, if that can be written
            try:
                files.close()
            except OSError:
                pass
            try:
                self._write_summary(status, message, self.lines.last, wall)
            except OSError as exc:
                print(f"spotpipe: cannot write {self.out / 'summary.json'}: {exc}",
                      file=self.stream)
        if interrupted:
            print(f"spotpipe: training {message}", file=self.stream)
            return interrupted_code  # (as a shell reports a process ended by that signal)
        if status != "completed":
            print(f"spotpipe: training failed: {message}", file=self.stream)
            return 1
        return 0

    def _take(self, item: Item) -> tuple[str, str] | None:
        """Act on one item of the inbox; the job's status and message when it ends here."""
        if isinstance(item, Opened) and isinstance(item.message, Exit):  # from an agent
            self._received += 1
            node = item.message.node
            problem = self._exit_refusal(item.writer, node)
            if problem:
                self.coordinator.refused(item.writer, problem)
                return None
            if node in self._exited:
                # counted out already, its agent silent past the timeout: the agent was cut
                # off and is back; the record is stale, and changes nothing
                self.coordinator.refused(
                    item.writer, f"a late exit record for {node} (code {item.message.code}), "
                                 "which the job counted out already")
                return None
            item = NodeExit(node, item.message.code, item.message.cause)
        if isinstance(item, HelperEvent):  # from a helper thread of this process
            self.files.event(item.record)
        elif isinstance(item, RefusedUpload):  # from the committer's thread
            self.coordinator.refused(item.writer, item.reason)
        elif isinstance(item, (Opened, Refused)):
            self._handle_record(item)
        elif isinstance(item, NodeExit):
            return self._node_exited(item.node, item.code, item.cause)
        elif isinstance(item, ShadowExit):
            self._shadow_exited[item.name] = item.code
            if item.code != 0:
                return "failed", self._failed(item.name, item.code, "shadow_failed")
            if len(self._exited) == len(self._started()) and self._shadows_done():
                return self._ended()
        elif isinstance(item, MailboxClosed):
            self.store_lost = True
            return "failed", f"lost the store: {item.reason}"
        return None

    def _node_exited(self, node: str, code: int, cause: str = "") -> tuple[str, str] | None:
        """`node` exited with `code`; `cause`: what its host's agent said of why ("" from
        this host's own supervisor, which this process asks itself: `_exit_cause`)."""
        exited = self._exited
        exited[node] = code
        if code == 1:  # a software error: failing over would repeat it elsewhere
            if node not in self.coordinator.left:
                return "failed", self._failed(node, code, "worker_failed")
            # a node a plan let go runs none of the job any more: its error is said, and
            # until the plan no longer needs it (its hand-over) it is a loss like any (its
            # `worker_error` event, if already in, says the error itself)
            cause = cause or (f"{self._errors.get(node) or 'a software error'} "
                              f"(log: {self._log_of(node)})")
        if code != 3:  # 3: stopped by the plan, already accounted for
            self.coordinator.node_exited(node, code, cause or self._exit_cause(node, code))
        running = [n for n in self._started() if n not in exited]
        if running and not (set(running) & self.coordinator.live):
            self._only_standby_left()
        if len(exited) == len(self._started()) and (
                self._shadows_done() or self.coordinator.stop_message):
            return self._ended()
        return None

    def _ended(self) -> tuple[str, str]:
        """Every process is done: the job's status and message."""
        message = self._complete()
        return ("failed" if message else "completed"), message

    def _spawn_shadows(self, address: StoreAddress, inbox: Inbox) -> None:
        """The CPU shadows, one per stage, run here, next to the store: on the host that is
        not preempted (see spotpipe.checkpoint.shadow)."""
        logs, module = self.out / "logs", SHADOW
        self._shadows = Supervisor(logs,
                                   lambda name, code: inbox.put(ShadowExit(name, code)),
                                   module=module, starter=starter(self.cfg, module, logs))
        for stage in range(self.cfg.stages):
            env = worker_env(self.cfg, rank=0, world=1, local_rank=0, local_world=1,
                             address=address, run_dir=self.out, t0=self.t0, token=self.token,
                             instance=self.instance,
                             search_path=search_path(self.cfg),
                             resume=str(self.resume.path) if self.resume else "")
            env["SPOTPIPE_SHADOW_STAGE"] = str(stage)
            self._shadows.spawn(f"shadow{stage}", env)

    def _failed(self, name: str, code: int, kind: str) -> str:
        """A process whose failure ends the job: record it and say why, naming its log."""
        self._drain()
        detail = self._errors.get(name) or f"exited with code {code}"
        self.files.event({"time_s": self._now(), "kind": kind, "node": name,
                          "returncode": code, "message": detail})
        return f"{name} failed: {detail} (log: {self._log_of(name)})"

    def _log_of(self, name: str) -> str:
        """Where the output of the job's process `name` is, as its failure's message says."""
        return f"{self.out}/logs/{name}.log"

    def _shadows_done(self) -> bool:
        return self._shadows is None or len(self._shadow_exited) == len(self._shadows.procs)

    def _complete(self) -> str:
        """Every process is done: write what is left; return why the run did not complete."""
        self._drain()
        message = self._gather_final() or self._completion_problem()
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
        last = self.lines.last
        if missing or last is None:
            done = 0 if last is None else last["iter"] + 1
            return f"workers exited after {done} of {self.cfg.iterations} iterations"
        return ""

    def _upload_connection(self) -> SealedStore:
        """A store connection of its own for one upload's receive (a store client serialises
        its calls, and a wait that timed out may leave it unusable). A record there that does
        not verify is reported through the loop, like any other."""
        inbox = self._inbox
        return SealedStore(
            self._address.connect(self.cfg.cluster.timeout_s), self.channel.key,
            on_refused=lambda why: inbox.put(RefusedUpload(why.writer, why.reason)))

    def _partition_for(self, depth: int) -> list[tuple[int, int]]:
        """The partition at another depth, cut from the layer profile measured at launch (in
        the run spec): instant, the model is not built again, and every depth comes from the
        same measurement (the coordinator keeps each answer, so all nodes get the same)."""
        return job.partition_at_depth(self.cfg, self.spec.profile, depth)

    def _stage_count(self) -> int:
        """Stages of the job as it ended (a re-partition changes the depth)."""
        coordinator = getattr(self, "coordinator", None)
        return len(coordinator.partition) if coordinator and coordinator.partition \
            else self.cfg.stages

    def _now(self) -> float:
        return round(time.time() - self.t0, 6)

    def _repair_mailbox_count(self, store: dist.Store) -> None:
        """Writers start from the mailbox's count, which anyone who reaches the store can move
        (it cannot be sealed: `spotpipe.store.board.hint`); moved past the slot this loop
        waits on, nothing would reach the coordinator again. Put it back, and say so."""
        awaited = self._received + 1
        found = mailbox.repair_count(store, awaited)
        if found is not None:
            self.coordinator.refused("?", f"the mailbox's count was moved to {found}, past "
                                          f"slot {awaited}, which is empty: put back (records "
                                          "posted in between are lost)")

    def _drain(self) -> None:
        """Write every record posted so far: a worker posts its last record before it exits,
        so once it has exited, the store's mailbox count says how many records to wait for.
        (What else comes meanwhile, exits and helpers' events, is dropped: the job is over.)
        The count is not sealed (anything with the store's address can add to it): records
        it promises that do not come within the store's timeout end the drain with an event,
        not the job."""
        store = self._store
        posted = mailbox.posted(store)
        # the count may lag by a record whose writer was killed right after writing it
        while self._received < posted or mailbox.slot_written(store, self._received + 1):
            try:
                item = self._inbox.get(timeout=self.cfg.cluster.timeout_s)
            except queue.Empty:
                self.files.event({"time_s": self._now(), "kind": "mailbox_short",
                                  "node": "launcher", "promised": posted,
                                  "came": self._received,
                                  "waited_s": self.cfg.cluster.timeout_s})
                break
            if isinstance(item, (Opened, Refused)):
                self._handle_record(item)
        self.lines.drain()

    def _note_layout(self) -> None:
        """Tell the checkpoint intake which layout runs the job from which iteration (a plan
        changes it within a call of the coordinator's; each is noted before the next call):
        a stage's checkpoint counts only from the node that owned it then."""
        history = self.coordinator.history
        self.intake.ran(history.resumed_at, history.layout)

    def _handle_record(self, item: Opened | Refused) -> None:
        """A slot of the mailbox: a record to act on, or one that did not open."""
        files = self.files
        if isinstance(item, Refused):  # a slot whose record did not open: counted, not read
            self._received += 1
            self.coordinator.refused(item.writer, f"mailbox: {item.reason}")
            body = item.claimed.get("body")
            if item.claimed.get("type") == JoinRequest.TYPE and isinstance(body, dict):
                # a node without the job's key asks to join: tell it so (it cannot verify
                # the answer, and nothing else it wrote is acted on)
                inc = item.claimed.get("inc")
                self.coordinator.join_without_key(str(body.get("node", item.writer))[:100],
                                                  inc[:100] if isinstance(inc, str) else "")
            return
        self._received += 1
        message, writer = item.message, item.writer
        if isinstance(message, Exit):  # an agent's report, read while draining
            problem = self._exit_refusal(writer, message.node)
            if problem:
                self.coordinator.refused(writer, problem)
            else:
                self._exited.setdefault(message.node, message.code)
        elif isinstance(message, Metrics):
            self.lines.posted(message, writer)
        elif isinstance(message, (CheckpointSaved, StageUpload)) \
                and (why := self.intake.refusal(message, writer)):
            self.coordinator.refused(writer, why)  # (it does not count toward the commit)
        elif isinstance(message, CheckpointSaved):
            files.event({"time_s": message.time_s, "kind": "checkpoint_saved",
                         "node": message.node, "iteration": message.iteration,
                         "stage": message.stage, **message.details})
            self.intake.saved(message)
        elif isinstance(message, FinalUpload):
            self._final_upload(message, writer)
        elif isinstance(message, StageUpload):
            files.event({"time_s": message.time_s, "kind": "checkpoint_upload",
                         "node": message.node, "iteration": message.iteration,
                         "stage": message.stage})
            self.intake.upload(message)
        elif isinstance(message, JoinRequest):
            files.event({"time_s": message.time_s, "kind": "join_requested",
                         "node": message.node})
            self.coordinator.join(message, writer, item.sealed.incarnation)
        elif isinstance(message, Report):
            files.event({"kind": "report", **message.to_json()})
            self.coordinator.report(message, writer)
        elif isinstance(message, Stalled):
            files.event({"kind": "stall_reported", **message.to_json()})
            self.coordinator.stalled(message, writer)
        elif isinstance(message, Notice):
            files.event({"time_s": message.time_s, "kind": "notice", "node": message.node,
                         "source": message.source, "generation": message.generation})
            self.coordinator.noticed(message, writer)
        elif isinstance(message, Event):
            record = message.record()
            files.event(record)
            if message.kind == "checkpoint_failed" and durable_tier(record):
                self.intake.failed(record["iteration"])  # (the previous stays newest)
            if message.kind in ("worker_error", "shadow_error"):
                self._errors[message.node] = str(message.details.get("message", ""))
        else:
            self.coordinator.refused(writer, f"a {type(message).__name__} record in the mailbox")

    def _line_written(self, item: dict[str, Any]) -> None:
        """A line of metrics.jsonl (`MetricsLines`): written, shown, and acted on."""
        if self.lines.last is None:
            self._train_start = time.time()
        self.files.metric(item)
        self.coordinator.committed(item["iter"])
        self._update_bar(self._bar, item)
        if item["iter"] >= self.cfg.iterations - 1:
            # the last iteration is committed: no plan will place a node any more, so a
            # node asking to join from now on is told so instead of being accepted
            self.coordinator.release_standby()
        self._on_metrics(item, self.files)

    def _restore(self, files: RunFiles, state: CoordinatorState) -> None:
        """Take over from a predecessor's books: its run-file lines first (the files continue
        here whole), then its coordinator's state and this loop's."""
        self._folder = read_back(self._store, self.channel, state, files.replay,
                                 self.coordinator.refused)
        self._journal = state.journal
        self.coordinator.restore(state)
        self.lines.restore(state)
        self._exited = dict(state.exited)
        self._received = state.cursor
        self.intake.parts = CheckpointParts.from_json(state.checkpoints)

    def _books(self) -> dict[str, Any]:
        """This loop's part of a CoordinatorState, with the coordinator's."""
        return {**self.coordinator.books(), **self.lines.books(), "cursor": self._received,
                "exited": dict(self._exited), "checkpoints": self.intake.parts.to_json()}

    def _watch_mailbox(self, address: StoreAddress, inbox: Inbox, start: int = 1) -> None:
        client = address.connect(self.cfg.cluster.timeout_s)
        me = self.channel.sealer.incarnation

        def pump() -> None:
            try:
                for opened in mailbox.read_mailbox(
                        client, self.channel, inbox.put,
                        start=start, tombstone=self._tombstone_on_read):
                    if isinstance(opened.message, Close) and opened.writer == \
                            self.channel.writer and opened.sealed.incarnation == me:
                        return
                    inbox.put(opened)
            except Exception as exc:  # the store went away: only at shutdown, or a real fault
                inbox.put(MailboxClosed(str(exc)))

        self._pump = threading.Thread(target=pump, name="mailbox", daemon=True)
        self._pump.start()

    def _close_mailbox(self, store: dist.Store) -> None:
        """Post the closing record, so the reader thread leaves its blocking wait and ends
        before the interpreter does (a thread inside a store call at exit aborts the process).
        With the store lost, nothing can be posted, and the reader's own wait fails."""
        if not self.store_lost:
            try:
                mailbox.Outbox(store, self.channel, self.t0).post(Close())
            except dist.DistNetworkError:
                self.store_lost = True
            except NotLeader:  # (deposed as it ended: the successor reads the mailbox on)
                pass
        self._pump.join(timeout=10 if not self.store_lost else self.cfg.cluster.timeout_s)

    def _merge_final(self) -> None:
        """One model.safetensors from the stages' files; for a transformers model, its
        config.json beside it, so that the folder loads with `from_pretrained`. The
        coordinator writes that itself: stage 0's final owner may run on another host, whose
        `--out` is not this one."""
        final = self.out / "final"
        if self.cfg.model.kind == "hf":
            from spotpipe.model.hf import save_config

            h = self.cfg.model.hf
            save_config(h.config, dict(h.overrides), final)
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
            "first_iteration": self.job_start(),
            "samples_per_s": None if not last else round(self._trained(last) / last["time_s"],
                                                         3),
            "stages": cfg.stages, "pipelines": cfg.pipelines, "schedule": cfg.schedule,
            "partition": self.spec.partition, "config_digest": cfg.digest(),
        }
        tmp = self.out / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, self.out / "summary.json")

    def job_start(self) -> int:
        """The job's first iteration: a resumed checkpoint's next, or 0."""
        return self.first if self.first is not None else self.lines.first

    def _trained(self, last: dict[str, Any]) -> int:
        """The samples this job trained since `t0`, up to the line `last`: its `samples`
        count from the first iteration of all, the resumed checkpoint's included."""
        return last["samples"] - self.job_start() * self.cfg.global_batch

    # ------------------------------------------------------------------ progress

    def _progress_bar(self) -> Any:
        if not self.progress:
            return None
        from tqdm import tqdm

        # (from the job's next line: a resumed job, or a successor's, counts the iterations
        # trained before it as done, not as still to come)
        return tqdm(initial=self.lines.next_line(), total=self.cfg.iterations, desc="train",
                    unit="it", file=self.stream, dynamic_ncols=True)

    def _update_bar(self, bar: Any, record: dict[str, Any]) -> None:
        if bar is None:
            return
        bar.update(1)
        loss = "nan" if record["loss"] is None else f"{record['loss']:.4f}"
        bar.set_postfix_str(f"loss {loss} | {record['samples_per_s']:.1f} samples/s"
                            f" | {nodes_label(record, self.cfg.stages * self.cfg.pipelines)}"
                            f" double {record.get('carriers', 0)} gen {record['generation']}")


def nodes_label(record: dict[str, Any], configured: int) -> str:
    """The bar's nodes: those running stages out of the P x D configured, and those waiting
    on standby beside them ("nodes 4/4 +1 standby"). The bar showed the first alone, so a
    standby node, which takes a stage at once on a loss or a notice, was not seen."""
    standby = record.get("standby") or 0
    return f"nodes {record['live_nodes']}/{configured}" + (
        f" +{standby} standby" if standby else "")


def _hold_interrupts(stream: TextIO) -> None:
    """After a Ctrl-C (or a SIGTERM), the stop runs to its end: the workers are stopped
    (SIGKILL right after the SIGTERM: nobody coordinates them any more), the commit in
    progress finishes, and the summary is written. A second Ctrl-C (a terminal's reaches the
    whole process group, and users press it again) or SIGTERM would cut that short with a
    traceback and leave no summary; it is said and ignored instead, for the rest of the
    process, which is on its way out (a Ctrl-C during the interpreter's shutdown printed a
    traceback as well)."""
    def said(*_: Any) -> None:
        print("spotpipe: interrupted: stopping the workers", file=stream, flush=True)

    try:
        signal.signal(signal.SIGINT, said)
        signal.signal(signal.SIGTERM, said)
    except ValueError:  # (not the main thread: an agent's loop; its own Ctrl-C stays)
        return
    said()
