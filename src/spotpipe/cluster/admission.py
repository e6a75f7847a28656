"""The elected agent's side of the rendezvous: admit agents, run the job's loop, end it."""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.cluster import resume_copy
from spotpipe.cluster.agent_loop import AgentJobLoop
from spotpipe.cluster.join_checks import data_problem, join_problem
from spotpipe.cluster.inbox import HelperEvent, Inbox
from spotpipe.cluster.agent_options import AgentOptions
from spotpipe.cluster.rendezvous import (JOB, agent_key, arrive, assign_key, post_over,
                                         proof_key, read_record, read_vouched, wait_get)
from spotpipe.config import Config
from spotpipe.protocol import (AgentArrival, ArrivalsClosed, Assignment, Channel,
                               CoordinatorState, JobPosted, MessageError, job_key,
                               new_instance_id, plain, vouch, vouched)
from spotpipe.store.address import StoreAddress
from spotpipe.store.leader import Leadership, NotLeader
from spotpipe.store.waiting import wait_unbounded


class Coordinating:
    """The elected agent's side of the rendezvous: admit agents, then run the job's loop."""

    def __init__(self, opts: AgentOptions, cfg: Config, spec: job.RunSpec, token: str,
                 address: StoreAddress, me: int = 0,
                 leadership: Leadership | None = None, *,
                 checkpoint: durable.Checkpoint | None = None,
                 notes: list[dict[str, Any]] | None = None) -> None:
        """`checkpoint`: what this agent's --resume found on its host, the job's start (every
        agent of the first layout must bring the same); `notes`: what checking it said."""
        self.opts, self.cfg, self.spec, self.token, self.address = opts, cfg, spec, token, address
        self.checkpoint, self.resume_notes = checkpoint, list(notes or [])
        # the checkpoint on its way to agents whose hosts lack it: (agent, its sending
        # thread, and once that ended, "" or why the copy did not arrive whole)
        self._sends: list[tuple[int, threading.Thread, list[str]]] = []
        # the first layout's agents, admitted and not yet answered (`_answer_first`)
        self._first: list[tuple[int, Assignment, dict[str, Any], bool]] = []
        self.me = me  # this agent's arrival number (its candidacy's name)
        # the arrival number under which this agent's host holds its nodes now: a fenced
        # node's host comes again under a new one (`Agent._rejoin`), its nodes moved to it
        self.host = me
        self.leadership = leadership  # etcd: the office, held under a lease
        self.persistent = leadership is not None  # the books go to the store (succession)
        # the job's store was lost while it ran: the checkpoint folder's lock and probe stay
        # (cut off from an etcd that others still reach, a successor commits there)
        self._store_lost = False
        self.takeover: CoordinatorState | None = None
        # etcd: this host's notice came, and the loop hands the office on once the host's
        # nodes have left (`AgentJobLoop._persist`); `handed_over` once it has. Held by a late
        # admission and by the hand-over's last write of the books, so that no agent is
        # admitted by this coordinator after its books went to the successor
        self.hand_over = threading.Event()
        self.handed_over = threading.Event()
        # took back an office that nobody else took (`Office.take_back`): it stays
        # until its host goes, rather than hand it on again and leave it vacant once more
        self.stays = False
        self.admitting = threading.Lock()
        self.world = cfg.stages * cfg.pipelines
        self._lock = threading.Lock()
        self._nodes: list[str] = []
        self._admitted: list[int] = []
        self._agent_nodes: dict[int, list[str]] = {}
        # an agent that came again (its node fenced or crashed) under a new arrival number:
        # the number it came as, by the one it had. Its records keep the writer's name it
        # first sealed them under (`Agent.channel`), so `runs` follows the chain
        self._renamed: dict[int, int] = {}
        self._silent: set[str] = set()  # nodes whose agent never reported their end
        # nodes the job counted out (exited, lost with their host, left on a notice): an
        # agent with none left no longer counts toward --nnodes MAX (`_present`)
        self._gone: set[str] = set()
        self._slots: dict[int, int] = {}  # slot (node rank / nproc) -> agent
        self._events: list[dict[str, Any]] = []
        self._inbox: Inbox | None = None
        self._late: threading.Thread | None = None  # admits agents while the job runs
        self.t0 = time.time()
        self.instance = new_instance_id()  # the job's key is derived from it and the token
        self.code = 1
        self._crash = ""  # why the coordinator's loop raised, for the agents' end message
        self._closed = False  # the rendezvous was ended (`_close`), or tried to be
        self._next = 1
        self._probe = ""  # the checkpoint folder's probe (`JobPosted.checkpoint_probe`)

    @classmethod
    def successor(cls, opts: AgentOptions, cfg: Config, token: str, address: StoreAddress,
                  me: int, leadership: Leadership, posted: JobPosted,
                  state: CoordinatorState) -> "Coordinating":
        """The coordinator that takes over a running job from its predecessor's books."""
        self = cls(opts, cfg, job.RunSpec.from_json(posted.spec), token, address, me,
                   leadership)
        self.instance, self.t0 = posted.instance, posted.t0
        self.takeover = state
        a = state.admission
        self._nodes = [str(n) for n in a["nodes"]]
        self._admitted = [int(k) for k in a["admitted"]]
        self._agent_nodes = {int(k): [str(n) for n in v] for k, v in a["agent_nodes"].items()}
        self._renamed = {int(k): int(v) for k, v in a.get("renamed", {}).items()}
        self._silent = {str(n) for n in a["silent"]}
        self._gone = set(state.exited)
        self._slots = {int(s): int(k) for s, k in a["slots"].items()}
        self._next = int(a["next"])
        self._probe = posted.checkpoint_probe
        return self

    def admission(self) -> dict[str, Any]:
        """The admission books, for a successor (part of its CoordinatorState)."""
        with self._lock:
            return {"me": self.me, "host": self.host, "nodes": list(self._nodes),
                    "admitted": list(self._admitted),
                    "agent_nodes": {str(k): v for k, v in self._agent_nodes.items()},
                    "renamed": {str(k): v for k, v in self._renamed.items()},
                    "silent": sorted(self._silent),
                    "slots": {str(s): k for s, k in self._slots.items()}, "next": self._next}

    def predecessor_nodes(self) -> list[str]:
        """The nodes of the host of the agent that coordinated before this one."""
        assert self.takeover is not None
        a = self.takeover.admission
        return list(self._agent_nodes.get(int(a.get("host", a.get("me", 0))), []))

    def deposed(self) -> bool:
        return self.leadership is not None and self.leadership.deposed.is_set()

    def office_store(self, store: dist.Store) -> dist.Store:
        """`store` as this coordinator writes through it: with etcd, each write lands only
        while the leader key names this agent (`Leadership.fenced`). Its checks of the key
        (each turn's, the keep-alive's) come too late for a write already on its way: a
        coordinator cut off past its lease, back before it heard, answered an arrival the
        successor answered too, or ended the job the successor was running."""
        if self.leadership is None:
            return store
        return self.leadership.fenced(store, str(self.me))  # type: ignore[arg-type]

    def acting(self) -> bool:
        """Whether this agent still coordinates (neither deposed nor handed the office on)."""
        return not (self.deposed() or self.handed_over.is_set())

    def noticed(self) -> None:
        """This host is being reclaimed: hand the office on once its nodes have left, where a
        successor can take the books up (etcd). With c10d the job's store and its
        coordinator stay until the host goes (there is no succession)."""
        if self.persistent:
            self.hand_over.set()

    def own_nodes(self) -> list[str]:
        """The nodes of this agent's host."""
        with self._lock:
            return list(self._agent_nodes.get(self.host, []))

    def others_nodes(self) -> set[str]:
        """The nodes of the other agents' hosts."""
        with self._lock:
            return {n for k, nodes in self._agent_nodes.items() if k != self.host
                    for n in nodes}

    def runs(self, writer: str, node: str) -> bool:
        """Whether the agent that writes as `writer` runs `node` (or ran it: a node's name
        stays with its host's agent after it exits)."""
        number = writer.removeprefix("agent")
        if writer == number or not number.isdecimal():
            return False
        k, seen = int(number), set()
        with self._lock:
            while k in self._renamed and k not in seen:
                seen.add(k)
                k = self._renamed[k]
            return node in self._agent_nodes.get(k, [])

    def still_leader(self) -> bool:
        """Whether the leader key still names this agent (one read: a coordinator that was cut
        off may come back before its keep-alive learns that its lease is gone). A key written
        over without a lease is no successor's: it is put back under this agent's lease (it
        deposed the coordinator, and, never expiring, kept every agent from succeeding it)."""
        return self.leadership is not None and (self.leadership.leader() == str(self.me)
                                                or self.leadership.reclaim())

    def depose(self) -> None:
        if self.leadership is not None:
            self.leadership.deposed.set()

    def nodes(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    def admitted_count(self) -> int:
        with self._lock:
            return len(self._admitted)

    def silent(self, node: str) -> None:
        with self._lock:
            self._silent.add(node)

    def node_gone(self, node: str) -> None:
        """The job counted `node` out (`AgentJobLoop._node_exited`)."""
        with self._lock:
            self._gone.add(node)

    def _present(self) -> list[int]:
        """Admitted agents with a node the job has not counted out: those that count toward
        --nnodes MAX. Every agent ever admitted counted, so a host lost (or gone on its
        notice) kept its place, and the spot cloud's replacement for it was refused for good."""
        with self._lock:
            return [k for k in self._admitted
                    if not set(self._agent_nodes.get(k, [])) <= self._gone]

    def answering(self) -> int:
        """Admitted agents that may still confirm the end: not all of their nodes went silent
        (an agent whose host is gone never will)."""
        with self._lock:
            return sum(1 for k in self._admitted
                       if not set(self._agent_nodes.get(k, [])) <= self._silent)

    def _event(self, record: dict[str, Any]) -> None:
        record = {"time_s": round(time.time() - self.t0, 6), **record}
        with self._lock:
            if self._inbox is None:
                self._events.append(record)
                return
        self._inbox.put(HelperEvent(record))

    def go(self, inbox: Inbox) -> None:
        """The loop has started: events go to it from now on; late agents may join."""
        with self._lock:
            self._inbox = inbox
            pending, self._events = self._events, []
        for record in pending:
            inbox.put(HelperEvent(record))
        self._late = threading.Thread(target=self._admit_late, name="admission", daemon=True)
        self._late.start()

    # ------------------------------------------------------------------ admission

    def rdzv_key(self, key: str) -> str:
        return proof_key(self.opts.rdzv_id, key)

    def _answer(self, store: dist.Store, k: int, answer: Assignment) -> None:
        store.set(assign_key(k), plain(vouch(answer, self.token, self.rdzv_key(assign_key(k)))))

    def _arrival(self, store: dist.Store, k: int) -> AgentArrival | ArrivalsClosed | None:
        """The `k`-th arrival; None (refused with an event, and answered) when it is not one,
        or a closing marker this coordinator did not write."""
        try:
            found = read_record(store, agent_key(k), AgentArrival, ArrivalsClosed)
            if isinstance(found, ArrivalsClosed) and not vouched(found, self.token,
                                                                 self.rdzv_key(agent_key(k))):
                raise MessageError("a closing marker without the job's proof")
        except MessageError as exc:
            reason = f"arrival {k}: {exc}"
            self._event({"kind": "record_refused", "node": "launcher",
                         "writer": f"agent{k}", "reason": reason})
            self._answer(store, k, Assignment(refused=f"agent{k} refused by the job: {reason}"))
            return None
        assert isinstance(found, (AgentArrival, ArrivalsClosed))
        return found

    def _problem(self, k: int, info: AgentArrival, late: bool) -> str | None:
        problem = join_problem(
            self.cfg, token_ok=vouched(info, self.token, self.rdzv_key(agent_key(k))),
            model_digest=info.model_digest, config_digest=info.config_digest,
            config_keys=info.config_keys)
        if problem:
            return problem
        problem = data_problem(self.cfg, info.data_digest, self.spec.data_digest)
        if problem:
            return problem
        if self._rejoin_of(info) is not None and late:
            # an agent whose fenced nodes come again brings as many as were fenced: its other
            # workers run on, in their places on the host (its GPUs)
            if not 1 <= info.nproc <= self.opts.nproc:
                return (f"it comes again with {info.nproc} nodes, the job runs 1 to "
                        f"{self.opts.nproc} per agent (--nproc-per-node)")
        elif info.nproc != self.opts.nproc:
            return (f"it runs {info.nproc} nodes per agent, the job "
                    f"{self.opts.nproc} (--nproc-per-node)")
        if not late:  # (a node joining a running job takes its state from its peers)
            problem = self._resume_problem(info)
            if problem:
                return problem
        # an agent whose node was fenced (cut off, then back) comes again in its own place
        present = self._present()
        again = 1 if self._rejoin_of(info) in present else 0
        if len(present) - again >= self.opts.max_nodes:
            return f"the job has its maximum of {self.opts.max_nodes} agents (--nnodes)"
        rank = info.node_rank
        if not late and rank >= 0 and (rank >= self.opts.min_nodes or rank in self._slots):
            return (f"--node-rank {rank} is taken or beyond the {self.opts.min_nodes} agents "
                    "the job starts with")
        return None

    def _rejoin_of(self, info: AgentArrival) -> int | None:
        """The admitted agent that this arrival says it was (its node was fenced), or None."""
        k = info.rejoin_of
        return k if k is not None and k in self._admitted else None

    def _resume_problem(self, info: AgentArrival) -> str | None:
        """Why an agent of the first layout would start its workers from another state than
        the job's: every one must load the same checkpoint (the same manifest, wherever its
        copy lies on that host), or none."""
        mine = self.checkpoint
        if mine is None and not (info.resume_digest or info.resume_fetch):
            return None
        if mine is None:
            return (f"it resumes from {info.resume_from or 'a checkpoint'} (--resume), the job "
                    "starts from iteration 0 (its coordinating agent was given no --resume)")
        if info.resume_fetch:  # its host lacks it: this agent's copy is sent (`_send_resume`)
            return None
        if not info.resume_digest:
            return (f"it was given no --resume; the job resumes from the checkpoint of "
                    f"iteration {mine.next_iteration - 1} ({mine.path})")
        if info.resume_digest != mine.digest:
            return (f"it resumes from {info.resume_from}, the job from {mine.path}: not the "
                    "same checkpoint (their manifests differ)")
        return None

    def _start_send(self, k: int) -> None:
        """Send the checkpoint to agent `k` on a thread (`_sent` waits for every send)."""
        failed: list[str] = []
        thread = threading.Thread(target=lambda: failed.append(self._send_resume(k)),
                                  name=f"resume-to-agent{k}", daemon=True)
        self._sends.append((k, thread, failed))
        thread.start()

    def _send_resume(self, k: int) -> str:
        """Send this agent's checkpoint to agent `k`, whose host lacks the job's --resume
        (`resume_copy`): "" once it arrived whole, else why not."""
        mine = self.checkpoint
        assert mine is not None
        timeout_s = self.cfg.cluster.timeout_s
        with self._lock:
            nodes = list(self._agent_nodes[k])
        try:
            sent = resume_copy.send(self.address.connect(timeout_s),
                                    Channel(job_key(self.token, self.instance), "coordinator"),
                                    k, mine, timeout_s=timeout_s,
                                    layers=job.start_layers(self.cfg, self.spec.partition, nodes))
        except Exception as exc:  # noqa: BLE001 - said as the job's end
            return f"--resume: the checkpoint did not reach agent {k}: {exc}"[:500]
        self._event({"kind": "checkpoint_sent", "node": f"agent{k}", "path": str(mine.path),
                     "nodes": nodes, "files": sent.files, "bytes": sent.bytes})
        return ""

    def _sent(self) -> str:
        """Wait for the checkpoint's sends to the hosts that lack it; "" or the first failure."""
        for _, thread, failed in self._sends:
            thread.join()
        return next((f[0] for _, _, f in self._sends if f and f[0]), "")

    def _admit(self, store: dist.Store, k: int, info: AgentArrival, late: bool) -> None:
        problem = self._problem(k, info, late)
        name = f"agent{k}@{info.host[:100]}"
        if problem:
            self._answer(store, k, Assignment(refused=f"{name} refused by the job: {problem}"))
            self._event({"kind": "join_refused", "node": name, "reason": problem})
            return
        before = self._rejoin_of(info) if late else None
        n = info.nproc if before is not None else self.opts.nproc
        if late:
            first = len(self._nodes)
        else:
            rank = info.node_rank
            slot = rank if rank >= 0 else min(set(range(self.opts.min_nodes)) - set(self._slots))
            self._slots[slot] = k
            first = slot * n
        ranks = list(range(first, first + n))
        self._book(k, before, ranks)
        answer = Assignment(ranks=tuple(ranks), world=self.world, joining=late)
        event = {"kind": "agent_admitted", "node": name, "ranks": ranks, "joining": late,
                 **({"rejoin_of": f"agent{before}"} if before is not None else {})}
        if late:
            self._answer(store, k, answer)
            self._event(event)
        else:  # answered once the first layout is whole (`_answer_first`)
            self._first.append((k, answer, event, info.resume_fetch))

    def _answer_first(self, store: dist.Store) -> None:
        """Answer the first layout's agents, once all of them have come. An agent starts its
        workers at its answer, and they wait to form the job's groups for cluster.timeout_s:
        answered as each came, a host that came later than that (a slower boot) found the
        first host's workers gone, and the job failed forming its groups ("timed out ...
        waiting for .../gen0/world/0/2") although --rdzv-timeout still waited for it. The
        checkpoint's sends to hosts that lack it start here too, as their receivers do."""
        for k, answer, event, fetches in self._first:
            if fetches:
                self._start_send(k)
            self._answer(store, k, answer)
            self._event(event)
        self._first = []

    def _book(self, k: int, before: int | None, ranks: list[int]) -> None:
        """Agent `k` runs the nodes of `ranks`, and, coming again in place of agent `before`
        (its node fenced), that agent's nodes that still run: the admission books."""
        with self._lock:
            kept: list[str] = []
            if before is not None:  # the same host: its nodes that still run stay its own
                self._admitted.remove(before)
                kept = self._agent_nodes.pop(before, [])
                self._renamed[before] = k
                if before == self.host:
                    self.host = k
            self._admitted.append(k)
            self._agent_nodes[k] = [*kept, *(f"node{r}" for r in ranks)]
            self._nodes.extend(f"node{r}" for r in ranks)

    def _take_in(self, store: dist.Store, k: int) -> None:
        """Arrival `k` is answered, and these books do not have it: a predecessor admitted it
        after its last books were written (lost in that turn). Its answer, with the job's
        proof, goes into the books as an admission made here: only said, it left that agent's
        nodes out of the job's count, and the next agent was given the same ranks (two
        workers of one name). A refusal, or an answer without the proof, admitted no one."""
        if k in self._admitted:
            return
        try:
            answer = read_vouched(store, assign_key(k), self.token, self.opts.rdzv_id,
                                  Assignment)
        except MessageError as exc:
            self._event({"kind": "record_refused", "node": "launcher", "writer": "unknown",
                         "reason": f"the answer to arrival {k}: {exc}"[:300]})
            return
        assert isinstance(answer, Assignment)
        if answer.refused or not answer.ranks:
            return
        try:
            info = read_record(store, agent_key(k), AgentArrival)
        except MessageError:
            info = None
        before = self._rejoin_of(info) if isinstance(info, AgentArrival) else None
        self._book(k, before, list(answer.ranks))
        self._event({"kind": "agent_admitted", "node": f"agent{k}", "ranks": list(answer.ranks),
                     "joining": answer.joining, "answered_by": "predecessor",
                     **({"rejoin_of": f"agent{before}"} if before is not None else {})})

    def _admit_late(self) -> None:
        store = self.office_store(self.address.connect(self.cfg.cluster.timeout_s))
        while True:
            k = self._next
            try:  # (an agent may come late in a job of weeks)
                wait_unbounded(store, [agent_key(k)])
            except Exception:  # the store gone (the job is over; its own error types)
                return
            if not self.acting():
                return
            with self.admitting:
                try:
                    if not self.acting() or not self._admit_next(store, k):
                        return
                except NotLeader:  # (deposed: the successor answers it)
                    return

    def _admit_next(self, store: dist.Store, k: int) -> bool:
        """Answer the arrival in slot `k`; False at the job's end (its closing marker)."""
        if store.check([assign_key(k)]):
            # answered already: by a predecessor, or (its own arrival) by this one in `_run`
            if k != self.me:
                self._event({"kind": "agent_answered_before", "node": f"agent{k}"})
            self._take_in(store, k)  # (its own too: a rejoin the predecessor admitted)
        else:
            info = self._arrival(store, k)
            if isinstance(info, ArrivalsClosed):  # this coordinator's: the job is over
                return False
            if info is not None:
                self._admit(store, k, info, late=True)
        with self._lock:
            self._next = k + 1
        return True

    def run(self) -> int:
        """Coordinate the job (or go on with it from the books) to its end; the job's exit
        code. Whatever raises on the way still ends the rendezvous, saying why: before,
        an error ahead of the job's loop (which ends it itself) left no end record while
        this agent's lease kept the office taken, and every agent waited for ever."""
        try:
            return self._take_over() if self.takeover is not None else self._start()
        except Exception as exc:
            if not self._closed:
                self._crash = (f"the coordinator (agent {self.me}) failed: "
                               f"{type(exc).__name__}: {exc}")[:500]
                try:
                    self._close(self.address.connect(self.cfg.cluster.timeout_s))
                except NotLeader:
                    pass  # (deposed: its successor ends the job)
                except Exception as lost:  # noqa: BLE001 - the store is gone: said, and raised
                    print(f"spotpipe agent: the job's end could not be posted: {lost}",
                          file=sys.stderr)
            raise

    def _start(self) -> int:
        store = self.office_store(self.address.connect(self.cfg.cluster.timeout_s))
        root = durable.written_root(self.cfg, self.opts.out)
        nonce, refused = secrets.token_hex(16), ""
        if self.opts.resume is not None and self.checkpoint is None:
            refused = (f"--resume {self.opts.resume}: not found on the coordinating agent's host;"
                       " it sends the checkpoint to the hosts that lack it, so it must hold it")
        try:  # this job commits the checkpoints: it holds the folder, and marks it
            if root is not None and not refused:
                durable.lock.acquire(root, self.opts.out)
                (root / durable.transfer.probe_name(self.opts.rdzv_id)).write_text(nonce)
        except (durable.lock.LockHeld, OSError) as exc:
            refused = f"checkpoint.dir: {exc}"
        if refused:
            print(f"spotpipe agent: {refused}", file=sys.stderr)
            post_over(store, self.token, self.opts.rdzv_id, "failed", refused, 0)
        store.set(JOB, plain(vouch(JobPosted(
            proof="", spec=self.spec.to_json(), t0=self.t0, instance=self.instance,
            world=self.world, config_digest=self.cfg.digest(),
            model_digest=self.cfg.model_digest(), checkpoint_probe=nonce),
            self.token, self.rdzv_key(JOB))))
        if refused:
            return self.code
        try:
            return self._run(store, root)
        finally:
            if root is not None:
                self._free_folder(root)

    def _free_folder(self, root: Path) -> None:
        """The job is over: the checkpoint folder's probe and lock go. Not when the office
        was handed on or lost, or the store was: the job may go on committing there, under a
        successor."""
        if not self.acting() or self._store_lost:
            return
        (root / durable.transfer.probe_name(self.opts.rdzv_id)).unlink(missing_ok=True)
        durable.lock.release(root)

    def _run(self, store: dist.Store, root: Path | None) -> int:
        removed: list[Path] = []
        if root is not None:
            removed, self.checkpoint = durable.take_up(root, self.checkpoint)
        notes = [{"kind": "checkpoint_partial_removed", "path": str(p)} for p in removed]
        # this agent's own arrival first: written before it campaigned, but not always
        # before the others'. Taken in arrival order, it could come after MIN others (and be
        # left to the late admission, a joiner of the running job or refused at MAX) or find
        # its --node-rank taken: refused, its agent exited 2, taking the coordinator along
        own = self._arrival(store, self.me)
        if isinstance(own, AgentArrival):
            self._admit(store, self.me, own, late=False)
        k = 0
        while len(self._slots) < self.opts.min_nodes:
            k += 1
            if k == self.me:
                continue
            raw = wait_get(store, agent_key(k), self.opts.rdzv_timeout_s)
            if raw is None:
                message = (f"rendezvous: {len(self._slots)} of {self.opts.min_nodes} agents "
                           f"arrived within {self.opts.rdzv_timeout_s:.0f} s (--rdzv-timeout)")
                for j in sorted(set(range(1, k)) | {self.me}):  # (the admitted: unanswered)
                    if not store.check([assign_key(j)]):
                        self._answer(store, j, Assignment(refused=message))
                print(f"spotpipe agent: {message}", file=sys.stderr)
                post_over(store, self.token, self.opts.rdzv_id, "failed", message, 0)
                self.code = 1
                return self.code
            info = self._arrival(store, k)
            if isinstance(info, AgentArrival):
                self._admit(store, k, info, late=False)
        self._next = k + 1
        self._answer_first(store)
        failed = self._sent()
        if failed:
            print(f"spotpipe agent: {failed}", file=sys.stderr)
            post_over(store, self.token, self.opts.rdzv_id, "failed", failed, 0)
            return self.code
        loop = self._loop()
        loop.notes = self.resume_notes + notes
        return self._run_loop(loop, store)

    def _take_over(self) -> int:
        """Go on with the job from the predecessor's books (the job's files continue in this
        agent's --out). Checkpoints are committed here from now on only where this host sees
        the checkpoint folder the workers write to (a shared `checkpoint.dir`)."""
        root = durable.written_root(self.cfg, self.opts.out)
        # the folder is this job's: its lock names this process from now on, released (with
        # the probe) at the end, as the first coordinator would have
        seen = root is not None and durable.transfer.sees_probe(root, self.opts.rdzv_id,
                                                                self._probe)
        if seen:
            durable.lock.adopt(root, self.opts.out)
        loop = self._loop()
        loop.takeover = self.takeover
        try:
            return self._run_loop(loop, self.office_store(
                self.address.connect(self.cfg.cluster.timeout_s)))
        finally:
            if seen:
                self._free_folder(root)  # type: ignore[arg-type]

    def _loop(self) -> AgentJobLoop:
        return AgentJobLoop(self, cfg=self.cfg, spec=self.spec, out=self.opts.out,
                            token=self.token, instance=self.instance,
                            progress=self.opts.progress, t0=self.t0, resume=self.checkpoint)

    def _run_loop(self, loop: AgentJobLoop, store: dist.Store) -> int:
        """Run the job's loop on a connection of its own; then end the rendezvous, with the
        loop's error as the job's end message if it raised."""
        try:
            self.code = loop.run(self.office_store(
                self.address.connect(self.cfg.cluster.timeout_s)), self.address)
        except BaseException as exc:
            self._crash = f"the coordinator failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._store_lost = loop.store_lost
            try:  # (the store may be back: the agents wait for this end record)
                self._close(store)
            except NotLeader:
                pass  # (deposed: its successor ends the job)
            except dist.DistNetworkError as exc:
                print(f"spotpipe agent: the job's end could not be posted: {exc}",
                      file=sys.stderr)
        return self.code

    def _close(self, store: dist.Store) -> None:
        """The job is over (unless this coordinator was deposed or handed the office on: then
        its successor ends it)."""
        self._closed = True
        if self.handed_over.is_set() and self.leadership is not None:
            # the office falls vacant now, the key going with the lease: the other agents
            # elect a successor at once, rather than one lease TTL after this host is gone
            self.leadership.resign()
        if not self.acting():
            return
        store = self.office_store(store)
        # wake the admission thread: a marker in the next arrival slot it will read
        close = arrive(store, lambda key: plain(vouch(ArrivalsClosed(), self.token,
                                                      self.rdzv_key(key))))
        # the admission thread answers every arrival before the marker, then stops: only then
        # are the unanswered ones known (two writers could otherwise both answer one agent,
        # admitted by one and refused by the other; and its answers go through a connection
        # of its own, which a check here is not ordered with until it has read the marker)
        if self._late is not None:
            self._late.join(self.cfg.cluster.timeout_s)
        for j in range(1, close):  # agents still waiting for an answer get one
            if not store.check([assign_key(j)]):
                self._answer(store, j, Assignment(refused=f"job {self.opts.rdzv_id} is over"))
        summary = json.loads((self.opts.out / "summary.json").read_text()) \
            if (self.opts.out / "summary.json").exists() else {}
        post_over(store, self.token, self.opts.rdzv_id, summary.get("status", "failed"),
              summary.get("message", "") or self._crash, self.answering())
