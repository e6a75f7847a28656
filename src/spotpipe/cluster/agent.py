"""`spotpipe agent`: the node agent, one per host, for jobs that span machines.

Like torchrun's agent, each agent starts the worker process(es) of its host (one node per agent
by default) and supervises them; the workers' in-process notice watcher polls the cloud's
preemption notice, and a SIGTERM to the agent (the host is being reclaimed) is passed on to
them as a notice. The agents meet at a rendezvous store: etcd (`--rdzv-backend etcd`), or a
TCPStore hosted by the agent whose host is the endpoint's (`c10d`, as torchrun does; it binds
to the endpoint's address only, loopback unless configured otherwise).

Rendezvous, under `spotpipe/rdzv/` in the job's store:

1. Each agent takes an arrival number by claiming the next free slot of the arrivals' board
   with what it brings (one compare_set, `rendezvous.arrive`: a slot is whole or empty,
   whatever instant its agent dies at): its nodes and the digests of its model and
   configuration. Every rendezvous record is a typed
   `spotpipe.protocol` message, unsealed (no job key exists yet) but vouched for: an HMAC
   under the join token (SPOTPIPE_JOIN_TOKEN, a shared secret that never enters the store)
   over its key and body, which its reader checks; a record that is not one is refused with
   an event, never read as a dict.
2. The first agent to win the election (`spotpipe.cluster.office`, which holds this agent's
   part in the coordinator's office) runs the coordinator: it publishes the job (its
   partition, clock, and an HMAC proving it holds the token), admits agents in arrival order
   with the same checks a joining worker gets (`join_checks.join_problem`), and once MIN agents
   are in, runs the same `JobLoop` as `spotpipe train`. Agents arriving later, up to MAX, join
   the running job through the joining-node path (a new pipeline, a rebalance). With etcd the
   election is etcd's own recipe (`spotpipe.store.leader`: a leader key created under a lease
   of about the heartbeat timeout, kept alive by the leader); with c10d, the agent hosting
   the store (its host must be on-demand anyway, see `connect_rendezvous`).
3. An agent refused (wrong token, another model or configuration, the job full) says why and
   exits 2; nothing of the job changes. An agent that sees the job's proof fail (a job of
   another team under the same id) refuses it in turn.
4. With etcd the coordinator is not a single point of failure. Every other agent watches the
   leader key; the coordinator keeps its books in the store at the end of every turn (a
   sealed `CoordinatorState` and the new lines of the run's files, `spotpipe.cluster
   .succession`). When its host is lost, etcd expires its lease within the TTL, the first
   agent to take the vacant office reads the books and carries on: the run's files continue
   in its own --out (the predecessor's lines first), the predecessor's nodes count as lost
   (its host went with it: an ordinary failover), and no worker restarts (workers talk only
   to the store). Whichever coordinator ends the job deletes its etcd prefix.

Workers report to the coordinator through the store's mailbox, as under the local launcher;
each agent adds an "exit" record when one of its workers exits and kills a worker the
coordinator fences; its workers send their final stages through the store (in 512 KiB pieces)
so that the coordinator's --out gets the whole model even without a shared filesystem.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import yaml

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.cluster import resume_copy
from spotpipe.cluster.agent_options import (AgentError, AgentOptions, check_options,
                                            parse_nnodes)
from spotpipe.cluster.launcher import LaunchError, check_resume, prepare, search_path
from spotpipe.cluster.office import Office
from spotpipe.cluster.rendezvous import (ALL_LEFT, JOB, LEFT, OVER, arrive, assign_key,
                                         connect_rendezvous, is_over, posted_over, proof_key,
                                         read_record, read_vouched, wait_get, write_atomic)
from spotpipe.cluster.proc import signal_name
from spotpipe.cluster.supervisor import (STOP_GRACE_S, WORKER, Supervisor, starter,
                                         worker_env)
from spotpipe.config import Config
from spotpipe.model import template
from spotpipe.notices import NoticeWatcher
from spotpipe.protocol import (AgentArrival, Assignment, Channel, Exit, JobOver, JobPosted,
                               Kill, MessageError, job_key, keys, plain, vouch, vouched)
from spotpipe.protocol.messages import EXIT_CAUSE_CHARS, plain_text
from spotpipe.store.address import StoreAddress, StoreSilent
from spotpipe.store.mailbox import Outbox
from spotpipe.store.watchers import BoardWatcher

__all__ = ["Agent", "AgentError", "AgentOptions", "parse_nnodes", "run_agent"]


class Agent:
    def __init__(self, opts: AgentOptions, cfg: Config, spec: job.RunSpec, token: str,
                 address: StoreAddress, hosted: dist.Store | None,
                 checkpoint: durable.Checkpoint | None = None,
                 notes: list[dict[str, Any]] | None = None) -> None:
        self.opts, self.cfg, self.spec, self.token = opts, cfg, spec, token
        self.address, self.hosted = address, hosted
        self.checkpoint = checkpoint  # --resume, checked on this host
        self.notes = notes or []  # what checking it said (a trusted checkpoint's note)
        self.timeout_s = cfg.cluster.timeout_s
        self._exits_done = threading.Event()
        # the host's preemption notice (SIGTERM) came; then, once its workers have all left,
        # an agent that hosts neither the store nor the coordinator (or has handed its office
        # on) is done (`_done`)
        self._noticed = threading.Event()
        self._done = threading.Event()  # the job is over for this host
        self.notices: NoticeWatcher | None = None  # the cloud's, for this host
        self._pending = 0
        self._restarts = 0  # workers replaced after dying of a signal (--max-restarts)
        # signals this agent sends its workers from now on are its own (not a crash): a
        # notice passed on, the stop at the job's end; no worker starts after it is set
        # (a worker started late would miss the notice, or outlive the stop)
        self._signalling = False
        # the notice was a SIGTERM, passed on to the workers (a cloud's notice is not: the
        # workers read it themselves)
        self._passing_on = False
        self._spawning = threading.Lock()  # held by the spawner while it starts a worker
        self._lock = threading.Lock()
        # whether this agent coordinates, and its candidacy for the office (office.py)
        self.office = Office(opts, cfg, token, address, self.say,
                             on_handed_over=lambda: self._done_with(0))

    def say(self, text: str) -> None:
        # one unbuffered write: also said from the SIGTERM handler, which may run while the
        # main thread is inside a print (a buffered stream's reentrant call raises there)
        os.write(2, f"spotpipe agent: {text}\n".encode())

    def run(self) -> int:
        opts = self.opts
        try:  # (the endpoint a user gave: bounded even where another service holds it)
            store = self.address.connect_answered(self.timeout_s)
        except StoreSilent as exc:
            raise AgentError(f"--rdzv-endpoint: {exc}") from None
        me = self._arrive(store)
        self.me = me  # (the office keeps it too: `elect` here, `Office.renamed` on a rejoin)
        self.office.elect(store, me, self.spec, hosts_store=self.hosted is not None,
                          checkpoint=self.checkpoint, notes=self.notes)
        if wait_get(store, JOB, opts.rdzv_timeout_s) is None:
            self.say(f"no job appeared at the rendezvous within {opts.rdzv_timeout_s:.0f} s")
            return 1
        try:
            posted = read_record(store, JOB, JobPosted)
        except MessageError as exc:
            self.say(f"refused: the job record at this rendezvous (--rdzv-id {opts.rdzv_id}) "
                     f"is not a spotpipe job's ({exc}); this agent did not join it")
            return 2
        assert isinstance(posted, JobPosted)
        if not vouched(posted, self.token, self.rdzv_key(JOB)):
            self.say(f"refused: the job at this rendezvous (--rdzv-id {opts.rdzv_id}) was not "
                     "started with this SPOTPIPE_JOIN_TOKEN; this agent did not join it")
            return 2
        if posted_over(store, self.token, opts.rdzv_id) is not None:
            self.say(f"job {opts.rdzv_id} is over already")
            return 1
        # from here on, this host's clients (its workers', its reports of their exits) write
        # only while the job's record stands: cut off until the job ended and its keys were
        # deleted, they would put some back once they reach etcd again
        self.address = self.address.writing_while(JOB)
        if self._abandoned(store):
            return 1
        answer = self._assignment(store, me)
        if answer is None:
            return 1
        if answer.refused:
            self.say(answer.refused)
            return 2
        self.channel = Channel(job_key(self.token, posted.instance), f"agent{me}")
        self.instance = posted.instance
        return self.office.outcome(self._work(store, posted, answer))

    def rdzv_key(self, key: str) -> str:
        return proof_key(self.opts.rdzv_id, key)

    def _abandoned(self, store: dist.Store) -> bool:
        """etcd: whether the job at this rendezvous has no coordinator and none is coming
        (said). A job lost whole (every host gone, or etcd away past the reconnect deadline)
        leaves its keys: agents started again under its --rdzv-id asked to be admitted and
        waited out --rdzv-timeout for an answer nobody would give. In a running job the
        office is vacant only until an admitted agent takes it: within a lease TTL of its
        holder's loss, or of a hand-over that nobody took (`Office.take_back`)."""
        leadership = self.office.leadership
        if leadership is None:
            return False
        wait_s = 3.0 * leadership.ttl_s
        if leadership.wait_taken(OVER, wait_s, accept=lambda raw: is_over(
                raw, self.token, self.opts.rdzv_id)):
            return False
        self.say(f"job {self.opts.rdzv_id} at this rendezvous is not running: it has no "
                 f"coordinator, and none took the office within {wait_s:.0f} s (its keys are "
                 "left from a job that was lost whole, to etcd or with every host). Start "
                 "with another --rdzv-id, or remove them: etcdctl del --prefix "
                 f"{self.address.prefix}/")
        return True

    def _arrive(self, store: dist.Store, rejoin_of: int | None = None,
                nproc: int | None = None) -> int:
        """Take an arrival number and say what this agent brings (`nproc`: coming again, as
        many nodes as were fenced); the number."""
        opts = self.opts
        return arrive(store, lambda key: plain(vouch(AgentArrival(
            host=socket.gethostname(), nproc=opts.nproc if nproc is None else nproc,
            node_rank=opts.node_rank, proof="",
            model_digest=self.cfg.model_digest(), config_digest=self.cfg.digest(),
            local_addr=opts.local_addr, rejoin_of=rejoin_of,
            config_keys=self.cfg.key_digests(),
            resume_from=str(self.checkpoint.path) if self.checkpoint else "",
            resume_digest=self.checkpoint.digest if self.checkpoint else "",
            resume_fetch=self._lacks_resume, data_digest=self.spec.data_digest,
            nonce=secrets.token_hex(8)), self.token,
            self.rdzv_key(key))))

    def _assignment(self, store: dist.Store, me: int) -> Assignment | None:
        """The coordinator's answer to arrival `me`; None (said) when none comes in time.
        Anyone who reaches the store can write at the answer's key before the coordinator
        does: a record there without the job's proof is said once and waited past (the
        coordinator's answer overwrites it), where the agent took it for a refusal and left:
        a stranger could keep every host out of the job."""
        deadline = time.monotonic() + self.opts.rdzv_timeout_s
        if wait_get(store, assign_key(me), self.opts.rdzv_timeout_s) is None:
            self.say(f"not admitted within {self.opts.rdzv_timeout_s:.0f} s (--rdzv-timeout)")
            return None
        said = False
        while True:
            try:
                answer = read_vouched(store, assign_key(me), self.token, self.opts.rdzv_id,
                                      Assignment)
                assert isinstance(answer, Assignment)
                return answer
            except MessageError as exc:
                if not said:
                    said = True
                    self.say(f"the answer to this agent's arrival ({me}) is not the "
                             f"coordinator's ({exc}): something without the join token writes "
                             "into this rendezvous; waiting for the coordinator's answer")
            if time.monotonic() >= deadline:
                self.say(f"not admitted within {self.opts.rdzv_timeout_s:.0f} s "
                         "(--rdzv-timeout): no answer with the job's proof came")
                return None
            time.sleep(_REREAD_S)  # (a store has no wait for a key's change: read again)

    def _job_over(self, store: dist.Store) -> JobOver | None:
        """The job's end as its coordinator posted it; None while there is none (a record at
        its key without the job's proof is no end: `Office.wait_over` waited past it)."""
        return posted_over(store, self.token, self.opts.rdzv_id)

    def _work(self, store: dist.Store, posted: JobPosted, answer: Assignment) -> int:
        """Run this host's workers until the job is over; the job's outcome as exit code."""
        out = self.opts.out
        (out / "logs").mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.yaml", yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        write_atomic(out / "run.json", json.dumps(posted.spec, indent=1))
        ranks, world = list(answer.ranks), answer.world
        # does this host see the folder the coordinator commits checkpoints in? If not, the
        # workers send their stages through the store (spotpipe.checkpoint.transfer)
        root = durable.written_root(self.cfg, out)
        shared = root is None or durable.transfer.sees_probe(
            root, self.opts.rdzv_id, posted.checkpoint_probe)
        if root is not None:
            Outbox(store, self.channel, posted.t0).event(
                "checkpoint_dir_probe", path=str(root), shared=shared, ranks=ranks,
                host=socket.gethostname())
        if self._lacks_resume and not answer.joining:
            fetched = self._fetch_resume(store, ranks,
                                         job.RunSpec.from_json(posted.spec).partition)
            if isinstance(fetched, str):
                # the job waits for this host's nodes: tell it, so that it ends now, naming
                # them and (in its events) why, rather than when forming their groups times out
                self.say(fetched)
                outbox = Outbox(store, self.channel, posted.t0)
                outbox.event("resume_failed", message=fetched, ranks=ranks)
                for rank in ranks:
                    outbox.post(Exit(f"node{rank}", 1))
                try:
                    self.office.wait_over(store, posted, self.channel, self._noticed)
                except dist.DistNetworkError as exc:
                    return self._lost(f"lost the store: {exc}")
                return self._leave_unless_lost(store)
            self.checkpoint = fetched
        self._pending = len(ranks)
        self._fenced: set[str] = set()
        self._local: dict[str, int] = {}  # each running node's place on this host (LOCAL_RANK)
        self._rejoining = threading.Lock()
        self._posted, self._shared = posted, shared
        supervisor = self.supervisor = Supervisor(
            out / "logs", self._exited, starter=starter(self.cfg, WORKER, out / "logs"))
        # a SIGTERM to the agent is the host's preemption notice: pass it on to the workers
        signal.signal(signal.SIGTERM, lambda *_: self._pass_notice())
        signal.signal(signal.SIGINT, lambda *_: self._interrupted())
        # and the cloud's own notice for this host, read from its metadata service as its
        # workers read it (the host's first node's, where the URL names nodes)
        if ranks:
            self.notices = NoticeWatcher.of_node(self.cfg.failover, f"node{ranks[0]}",
                                                 self._heard_notice, sigterm=False,
                                                 watch_only=True, for_host=True)
        self._spawn(ranks, world, answer.joining, list(range(len(ranks))))
        # later workers (a fenced node's agent joining again) are started by one thread that
        # lives as long as the agent: a worker dies with the thread that started it
        # (PR_SET_PDEATHSIG), and the exit callbacks' threads end at once
        self._spawns: queue.Queue[tuple[list[int], int, list[int]]] = queue.Queue()
        threading.Thread(target=self._spawner, name="spawner", daemon=True).start()
        lost = ""
        try:
            self._await_end(store, posted)
            while self.office.take_back(store, posted, self.channel):
                # a fresh event: setters of the one before (the abandoned wait for the end,
                # a notice's handler that saw the office handed on) must not end this wait
                self._done = threading.Event()
                self._await_end(store, posted)
        except dist.DistNetworkError as exc:  # the store is gone (or out of this host's reach)
            lost = f"lost the store: {exc}"
        finally:  # (also at Ctrl-C, which the workers got too: their deaths are no crashes)
            self._stop_spawning()
        supervisor.stop_all(self._stop_grace(store, lost))
        self._exits_done.wait(self.timeout_s)
        if lost:  # (a coordinator here writes the job's summary saying so: `Office.outcome`)
            return self._lost(lost)
        return self._leave_unless_lost(store)

    def _stop_grace(self, store: dist.Store, lost: str) -> float:
        """How long this host's workers still running get to leave once SIGTERM (their
        preemption notice: leave at the next boundary, on a plan) has told them to: none when
        nobody will plan any more (the store is lost, or the job ended failed: they would only
        wait it out, every failed job 10 s more), else the supervisor's grace (this host cut
        off while the job goes on: its workers leave at a boundary, not as a crash)."""
        if lost:
            return 0.0
        if self._done.is_set():  # left on a notice: its workers are gone, and the store's
            return STOP_GRACE_S  # connection is held by the wait it abandoned
        try:
            over = self._job_over(store)
        except Exception:  # noqa: BLE001 - the store is gone: the job is, for this host
            return 0.0
        return 0.0 if over is not None and over.status == "failed" else STOP_GRACE_S

    def _await_end(self, store: dist.Store, posted: JobPosted) -> None:
        """Wait for the job's end, taking part in the office meanwhile (`Office.wait_over`,
        off the main thread), or until this host's workers have all left on its notice
        (`_done`)."""
        _with_main_thread_free(
            lambda: self.office.wait_over(store, posted, self.channel, self._noticed),
            self._done)

    def _lost(self, why: str) -> int:
        self.say(f"{why}; this host's workers were stopped"
                 + (" (if other hosts still reach etcd, one of their agents coordinates on)"
                    if self.address.kind == "etcd" else ": the job cannot go on"))
        return 1

    def _leave_unless_lost(self, store: dist.Store) -> int:
        try:
            return self._leave(store)
        except dist.DistNetworkError as exc:
            return self._lost(f"lost the store: {exc}")

    def _leave(self, store: dist.Store) -> int:
        """The job is over (or goes on without this host): confirm its end, the last agent
        out cleaning up; the job's outcome as exit code."""
        if self._leaves_on_notice and self.notices is not None:
            # every worker of this host is gone (`stop_all`): the cloud may take it now
            # (Azure), said once for them all, never by a worker while others still leave
            self.notices.acknowledge()
        if self._leaves_on_notice:
            # (a connection of its own: the one given is held by the wait for the job's end,
            # abandoned, and a TCPStore client answers its calls in turn)
            store = self.address.connect(self.timeout_s)
            if self._job_over(store) is None:
                store.add(LEFT, 1)  # one of the agents that confirm the job's end (answering)
                handed = (" and it handed the coordinator's office on (another agent "
                          "coordinates from its books)" if self.office.coordinating is not None
                          else "")
                self.say("left the job on this host's preemption notice: its workers have "
                         f"left{handed}, and the job goes on without them")
                return 0
        over = self._job_over(store)
        if over is None:  # deposed: the job goes on without this host
            return 1
        coordinating = self.office.coordinating is not None
        leadership = self.office.leadership
        last = store.add(LEFT, 1) >= over.agents
        if last:
            store.set(ALL_LEFT, "1")
        if last and leadership is not None and leadership.leader() is None:
            # the coordinator that ended the job is gone since: the last agent out cleans up
            store.delete_prefix()  # type: ignore[attr-defined]
        elif self.hosted is not None or coordinating:
            # the store's host stays until every agent has read the end; the coordinator
            # then removes the job's keys from etcd (other jobs keep theirs)
            try:
                store.wait([ALL_LEFT], timedelta(seconds=self.timeout_s))
            except Exception:
                self.say("not every agent confirmed the end of the job; leaving anyway")
            if coordinating and self.address.kind == "etcd":
                from spotpipe.store.etcd import EtcdStore

                if isinstance(store, EtcdStore):
                    if leadership is not None:
                        leadership.resign()
                    store.delete_prefix()
        if over.status == "completed":
            self.say("job completed; results in the coordinator's --out")
            return 0
        self.say(f"job failed: {over.message}")
        return 1

    @property
    def _lacks_resume(self) -> bool:
        """Given --resume, which this host does not have (the coordinating agent sends it)."""
        return self.opts.resume is not None and self.checkpoint is None

    def _fetch_resume(self, store: dist.Store, ranks: list[int],
                      partition: list[tuple[int, int]]) -> durable.Checkpoint | str:
        """Take the coordinating agent's copy of the checkpoint into OUT/resume/
        (`resume_copy`: the stage folders the workers `ranks` load under the job's
        `partition`, the posted one, which they run), then check it as any --resume. What
        went wrong instead."""
        folder = resume_copy.receive(store, self.channel, self.me, self.opts.out,
                                     timeout_s=self.timeout_s)
        if isinstance(folder, str):
            return f"--resume {self.opts.resume}: this host lacks it, and {folder}"
        layers = job.start_layers(self.cfg, partition, [f"node{r}" for r in ranks])
        try:
            checkpoint = _checked_resume(replace(self.opts, resume=folder), self.cfg, [],
                                         self.spec.num_samples, layers=layers)
        except LaunchError as exc:
            return f"--resume: the coordinating agent's copy, received: {exc}"
        assert checkpoint is not None
        self.say(f"--resume: this host lacked {self.opts.resume}; received the coordinating "
                 f"agent's copy into {folder}")
        return checkpoint

    def _spawn(self, ranks: list[int], world: int, joining: bool, places: list[int]) -> None:
        """Start this host's workers for `ranks` in the host's `places` (their LOCAL_RANK:
        their GPU), each with a watcher of its kill board."""
        for local, rank in zip(places, ranks):
            node = f"node{rank}"
            self._local[node] = local
            env = worker_env(self.cfg, rank=rank, world=world, local_rank=local,
                             local_world=self.opts.nproc, address=self.address,
                             run_dir=self.opts.out,
                             t0=self._posted.t0, token=self.token,
                             instance=self.instance, search_path=search_path(self.cfg),
                             faults=self.opts.faults, joining=joining,
                             # (a node joining a running job takes its state from its peers)
                             resume=str(self.checkpoint.path)
                             if self.checkpoint is not None and not joining else "")
            env["SPOTPIPE_CHECKPOINT_UPLOAD"] = "0" if self._shared else "1"
            env["SPOTPIPE_FINAL_UPLOAD"] = "1"  # the result is kept in the coordinator's --out
            env["SPOTPIPE_HOST_ACKNOWLEDGES"] = "1"  # (this agent does: `_leave`)
            self.supervisor.spawn(node, env)
            BoardWatcher(self.address.connect(self.timeout_s), self.channel,
                         keys.kill_board(node), Kill, lambda _, node=node: self._kill(node),
                         writers={"coordinator"})
        self.say(f"started {', '.join(f'node{r}' for r in ranks)} (local rank"
                 f"{'s' if len(places) > 1 else ''} {', '.join(map(str, places))})"
                 + (" joining the running job" if joining else ""))

    def _spawner(self) -> None:
        while True:
            ranks, world, places = self._spawns.get()
            with self._spawning:
                if not self._signalling:
                    self._spawn(ranks, world, True, places)
                    if self._passing_on:  # a SIGTERM came while they started (_pass_notice)
                        for rank in ranks:
                            self.supervisor.signal(f"node{rank}", signal.SIGTERM)
                    continue
            self._done_with(len(ranks))  # the host leaves or the job ended: none started

    def _stop_spawning(self) -> None:
        """No worker starts from now on; one being started is waited for, so that the stop
        that follows sees every process."""
        with self._spawning:
            self._signalling = True

    def _kill(self, node: str) -> None:
        """The coordinator fenced `node` (hung, or cut off past the heartbeat timeout)."""
        self._fenced.add(node)
        self.supervisor.kill(node)

    def _pass_notice(self, why: str = "it is being reclaimed") -> None:
        """The host is being reclaimed (a SIGTERM to this agent): its workers leave at the
        next boundary, and none of them is restarted from now on. A signal handler must not
        wait for the spawner: it sets the flag and signals the workers there are; a worker
        the spawner is starting meanwhile is either among them or signalled by the spawner,
        which checks the flag once it has started it."""
        self._passing_on = True
        self._reclaimed(why)
        for node in list(self.supervisor.procs):
            self.supervisor.signal(node, signal.SIGTERM)
        self._done_with(0)  # (none may be left to wait for)

    _interrupts = 0

    def _interrupted(self) -> None:
        """Ctrl-C: the operator takes this host out of the job. The first leaves as a
        preemption notice does (the workers leave at their next boundary, the job goes on
        without them where it can, an office held here is handed on); a second stops the
        workers now, as a lost host (the job fails over). Before, the agent died of it with a
        traceback, then of its store's threads (SIGABRT), and its workers with it unsaid."""
        self._interrupts += 1
        if self._interrupts == 1:
            self.say("Ctrl-C: this host leaves the job as at a preemption notice: its workers "
                     "leave at their next boundary (Ctrl-C again to stop them now)")
            self._pass_notice("it leaves the job (Ctrl-C)")
            return
        self.say("Ctrl-C again: stopping this host's workers now")
        for node in list(self.supervisor.procs):
            self.supervisor.kill(node)

    def _heard_notice(self, source: str) -> None:
        """The cloud's metadata service says this host is being reclaimed. Its workers poll
        the same service and leave on it themselves, so nothing is passed on; this agent
        starts no worker from now on, campaigns for nothing, hands the coordinator's office on
        if it holds it, and leaves once its workers have (acknowledging an Azure event for
        them all). Before, only
        a SIGTERM told the agent: one whose workers left on the cloud's notice stayed to the
        job's end, and could be elected to coordinate from a host about to go."""
        if self._noticed.is_set():
            return  # (a SIGTERM came first: passed on already)
        self.say(f"this host's preemption notice ({source}): its workers leave at their next "
                 "boundary, and this agent with them")
        self._reclaimed()
        self._done_with(0)  # (its workers may have left already)

    def _reclaimed(self, why: str = "it is being reclaimed") -> None:
        if self.hosted is not None and not self._noticed.is_set():
            # (--on-demand was required of it: `check_options`)
            self.say("this host hosts the job's c10d store and its coordinator, and was "
                     f"started as on-demand (--on-demand), yet {why}: the job "
                     "cannot outlive it (its store goes with the host). A job that must "
                     "outlive any host uses --rdzv-backend etcd, with etcd on on-demand "
                     "machines")
        self._signalling = True
        self._noticed.set()
        if self.office.coordinating is not None:
            self.office.coordinating.noticed()

    @property
    def _leaves_on_notice(self) -> bool:
        """After a notice, this agent leaves once its workers have: unless the job's store
        lives in it, or its coordinator does and has not handed the office on (c10d: never),
        which stay for the others until the host goes."""
        if self.hosted is not None:
            return False
        if self.office.coordinating is not None:  # (handed on once its workers left)
            return self.office.handed_over
        return self._noticed.is_set()

    def _rejoin(self, node: str, why: str) -> None:
        """`node` was fenced (`why` says so) while this host lives (a partition that healed, or
        a hang), or died of a signal nobody here sent (--max-restarts): the job moved on
        without it, so its state is stale or gone; come again as a new agent with one fresh
        node in its place on this host (its GPU), which joins the running job like any late
        one (placed when a layout has room for it). The host's other workers run on: coming
        again with all --nproc-per-node nodes put two workers on one GPU. One node at a
        time, so that each arrival names this agent's newest number."""
        place = self._local.pop(node)
        try:
            with self._rejoining:
                if self._signalling:  # the host leaves, or the job ended
                    return
                store = self.address.connect(self.timeout_s)
                if self._job_over(store) is not None:
                    return
                me = self._arrive(store, rejoin_of=self.me, nproc=1)
                answer = self._assignment(store, me) or Assignment(refused="no answer")
                if answer.refused:
                    self.say(f"{why}; not admitted again: {answer.refused}")
                    return
                self.me = me
                self.office.renamed(me)
            with self._lock:
                self._pending += len(answer.ranks)
            self.say(f"{why}; this host joins again as agent {me}")
            self._spawns.put((list(answer.ranks), answer.world, [place]))
        except Exception as exc:  # the store is gone: the job is over already
            self.say(f"{why}; could not join again: {exc}")

    def _exited(self, node: str, code: int) -> None:
        """A worker of this host exited (having sent its final stages itself, while it beat):
        tell the job, and join again if the job fenced it or it died of a signal
        (--max-restarts)."""
        store = None
        why = self.supervisor.exit_cause(node, code)
        try:
            store = self.address.connect(self.timeout_s)
            Outbox(store, self.channel, 0.0).post(Exit(node, code, self._exit_cause(why)))
        except Exception as exc:  # the store is gone: the job is over already
            self.say(f"could not report the exit of {node}: {exc}")
        if node in self._fenced or (store is not None and self._was_fenced(store, node)):
            self._rejoin(node, f"{node} was fenced by the job")
        elif code < 0 and not self._signalling:
            self._crashed(node, code, store, why)
        self._done_with(1)

    @staticmethod
    def _exit_cause(why: str) -> str:
        """`why` a worker exited (its supervisor's `exit_cause`: as the local launcher says
        it), and on which host: the coordinator, on another host, says it with the loss and
        the stop it leads to."""
        if not why:
            return ""
        host = plain_text(socket.gethostname(), 64)  # (Linux's HOST_NAME_MAX: the cause stays)
        return plain_text(f"on {host}, {why}", EXIT_CAUSE_CHARS)

    def _done_with(self, workers: int) -> None:
        """`workers` of this host's are over (exited, or never started)."""
        with self._lock:
            self._pending -= workers
            if self._pending <= 0:
                self._exits_done.set()
                if self._leaves_on_notice:
                    self._done.set()

    def _crashed(self, node: str, code: int, store: dist.Store | None, why: str = "") -> None:
        """`node` died of a signal this agent did not send while its host lives (`why`: what
        its supervisor knows of the cause, its fork server's end): replaced by a fresh node
        while --max-restarts allows (torchrun's restart, but of one node: the job failed over
        without it and goes on), else said, with the flag that would; in the agent's output
        and in the job's events (`worker_crashed`)."""
        died = f"{node} died of {signal_name(-code)}" + (f" ({why})" if why else "") + \
            " while its host lives"
        with self._lock:
            restart = self._restarts < self.opts.max_restarts
            if restart:
                self._restarts += 1
            number = self._restarts
        if store is not None:
            try:
                Outbox(store, self.channel, self._posted.t0).event(
                    "worker_crashed", worker=node, signal=signal_name(-code),
                    replaced=restart, restarts=number, max_restarts=self.opts.max_restarts,
                    **({"cause": why} if why else {}))
            except Exception as exc:  # the store is gone: the job is over already
                self.say(f"could not report the crash of {node}: {exc}")
        if restart:
            self._rejoin(node, f"{died}; replaced (restart {number} of "
                               f"--max-restarts {self.opts.max_restarts})")
        elif self.opts.max_restarts:
            self.say(f"{died}; not replaced: --max-restarts {self.opts.max_restarts} used")
        else:
            self.say(f"{died}; the job goes on without it (--max-restarts N would start a "
                     "fresh node in its place)")

    def _was_fenced(self, store: dist.Store, node: str) -> bool:
        """Whether the coordinator posted a kill for `node`. A fenced worker back on the network
        can see that the job went on without it and leave by itself (exit code 0) before this
        agent's watcher of its kill board, cut off too, delivers the kill: it was fenced all
        the same, and the host must come again (seen in a partition that healed)."""
        try:
            slot = keys.board_slot(keys.kill_board(node), 1)
            if not store.check([slot]):
                return False
            self.channel.open(store.get(slot), at=slot, expect=Kill, writers={"coordinator"})
            return True
        except Exception:
            # a record that is not the job's kill (refused), or the store gone (the job is
            # over already): nothing to act on either way
            return False


_REREAD_S = 0.2  # how often an agent reads an answer again that was not the coordinator's


def _with_main_thread_free(wait: Callable[[], None], done: threading.Event) -> None:
    """Run `wait` on a thread while the main thread waits for it, or for `done` set by
    another (the host's workers all left on its notice: the wait, for the job's end, is
    abandoned). Python runs a signal's handler only on the main thread, between bytecodes:
    blocked inside a store call (the wait for the job's end, days long with c10d) it never
    ran, so a host's preemption notice (SIGTERM to the agent) reached its workers only once
    the job was over. A wait on an event lets the handler run as the signal comes."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="wait-for-the-end", daemon=True).start()
    done.wait()
    if failed:
        raise failed[0]


def run_agent(opts: AgentOptions, cfg: Config, *, overwrite: bool = False) -> int:
    """Validate, meet the other agents, run; AgentError/LaunchError before anything starts."""
    token = check_options(opts, cfg, overwrite)
    out = opts.out
    notes: list[dict[str, Any]] = []
    prepared = prepare(cfg, opts.nproc)
    spec = replace(prepared.spec, data_digest=_data_digest(cfg))
    checkpoint = _checked_resume(opts, cfg, notes, spec.num_samples)
    address, hosted = connect_rendezvous(opts, cfg)
    import shutil

    if out.exists() and overwrite:
        shutil.rmtree(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    root = durable.written_root(cfg, out)
    try:  # before this agent joins: a host that cannot write its checkpoints must not
        if root is not None:
            durable.transfer.check_writable(root)
    except OSError as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise AgentError(f"checkpoint.dir {root}: cannot be written on this host ({exc})") \
            from None
    for note in prepared.write_initial(out):
        print(f"spotpipe agent: the initial weights were not written ({note['message']}): "
              "this host's workers build the whole model", file=sys.stderr)
    try:
        return Agent(opts, prepared.cfg, spec, token, address, hosted,
                     checkpoint, notes).run()
    finally:  # (reproducible from the seed, and as large as the model)
        (out / template.INITIAL_FILE).unlink(missing_ok=True)


def _data_digest(cfg: Config) -> str:
    """This host's copy of the data, as a digest the coordinating agent compares with its own
    (`Coordinating._problem`); said when it takes long enough to be noticed."""
    started = time.monotonic()
    try:
        digest = job.data_digest(cfg)
    except job.DataError as exc:
        raise AgentError(f"data: {exc}") from None
    took = time.monotonic() - started
    if took > 2.0:
        print(f"spotpipe agent: read {job.data_source(cfg)} for its digest in {took:.1f} s",
              file=sys.stderr)
    return digest


def _checked_resume(opts: AgentOptions, cfg: Config, notes: list[dict[str, Any]],
                    num_samples: int, layers: set[int] | None = None
                    ) -> durable.Checkpoint | None:
    """--resume as `spotpipe train` checks it, on this host: every file against the manifest
    (with `layers`, a copy that holds only the stage folders of these layers), the manifest's
    MAC, the model and the data order (`num_samples`: of this job's data). Each agent checks
    its own copy; the coordinating agent then admits only agents whose copy is the same
    checkpoint as its own
    (`Coordinating._problem`). None when there is none, or when this host does not have it
    (then the coordinating agent sends its copy, `Agent._fetch_resume`)."""
    if opts.resume is None or not opts.resume.exists():
        return None
    try:
        key = durable.resolve_key(cfg.checkpoint.key)
    except durable.KeyFileError as exc:
        raise AgentError(str(exc)) from None
    return check_resume(cfg, opts.resume, key, opts.trust_checkpoint, notes,
                        num_samples=num_samples, layers=layers)


__all__ = ["AgentError", "AgentOptions", "LaunchError", "parse_nnodes", "run_agent"]
