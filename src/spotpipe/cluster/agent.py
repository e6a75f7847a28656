"""`spotpipe agent`: the node agent, one per host, for jobs that span machines.

Like torchrun's agent, each agent starts the worker process(es) of its host (one node per agent
by default) and supervises them; the workers' in-process notice watcher polls the cloud's
preemption notice, and a SIGTERM to the agent (the host is being reclaimed) is passed on to
them as a notice. The agents meet at a rendezvous store: etcd (`--rdzv-backend etcd`), or a
TCPStore hosted by the agent whose host is the endpoint's (`c10d`, as torchrun does; it binds
to the endpoint's address only, loopback unless configured otherwise).

Rendezvous, under `spotpipe/rdzv/` in the job's store:

1. Each agent takes an arrival number (an atomic add) and publishes what it brings: its nodes
   and the digests of its model and configuration. Every rendezvous record is a typed
   `spotpipe.protocol` message, unsealed (no job key exists yet) but vouched for: an HMAC
   under the join token (SPOTPIPE_JOIN_TOKEN, a shared secret that never enters the store)
   over its key and body, which its reader checks; a record that is not one is refused with
   an event, never read as a dict.
2. The first agent to win the election runs the coordinator: it publishes the job (its
   partition, clock, and an HMAC proving it holds the token), admits agents in arrival order
   with the same checks a joining worker gets (`coordinator.join_problem`), and once MIN agents
   are in, runs the same `JobLoop` as `spotpipe train`. Agents arriving later, up to MAX, join
   the running job through the joining-node path (a new pipeline, a rebalance). With etcd the
   election is etcd's own recipe (`spotpipe.store.leader`: a leader key created under a lease
   of about the heartbeat timeout, kept alive by the leader); with c10d, a compare-and-set
   (the store's host must be on-demand anyway, see `connect_rendezvous`).
4. With etcd the coordinator is not a single point of failure. Every other agent watches the
   leader key; the coordinator keeps its books in the store at the end of every turn (a
   sealed `CoordinatorState` and the new lines of the run's files, `spotpipe.cluster
   .succession`). When its host is lost, etcd expires its lease within the TTL, the first
   agent to take the vacant office reads the books and carries on: the run's files continue
   in its own --out (the predecessor's lines first), the predecessor's nodes count as lost
   (its host went with it: an ordinary failover), and no worker restarts (workers talk only
   to the store). Whichever coordinator ends the job deletes its etcd prefix.
3. An agent refused (wrong token, another model or configuration, the job full) says why and
   exits 2; nothing of the job changes. An agent that sees the job's proof fail (a job of
   another team under the same id) refuses it in turn.

Workers report to the coordinator through the store's mailbox, as under the local launcher;
each agent adds an "exit" record when one of its workers exits, kills a worker the coordinator
fences, and sends its final stage files through the store (in 512 KiB pieces) so that the
coordinator's --out gets the whole model even without a shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.cluster.coordinator import join_problem
from spotpipe.cluster.jobloop import Deposed, JobLoop, RunFiles
from spotpipe.cluster.launcher import LaunchError, prepare, search_path
from spotpipe.cluster.supervisor import Supervisor, worker_env
from spotpipe.config import Config, parse_endpoint
from spotpipe.protocol import (AgentArrival, ArrivalsClosed, Assignment, Channel,
                               CoordinatorState, Exit, FinalFile, JobOver, JobPosted, Journal,
                               Kill, Message, MessageError, Refused, from_plain, job_key, keys,
                               new_instance_id, plain, vouch, vouched)
from spotpipe.store import board, mailbox
from spotpipe.store.address import StoreAddress, host_tcp_store, job_prefix
from spotpipe.store.leader import Leadership, lease_ttl
from spotpipe.store.mailbox import Outbox
from spotpipe.store.watchers import BoardWatcher

ARRIVALS, COORDINATOR, JOB, OVER = keys.ARRIVALS, keys.COORDINATOR, keys.JOB, keys.OVER
LEFT, ALL_LEFT = keys.LEFT, keys.ALL_LEFT
agent_key, assign_key, final_key = keys.arrival, keys.assignment, keys.final_part
CHUNK = 512 * 1024  # etcd refuses requests over 1.5 MiB; base64 makes 512 KiB about 683 KiB


class AgentError(RuntimeError):
    """Bad flags or an unusable rendezvous; nothing was started (exit 2)."""


@dataclass
class AgentOptions:
    backend: str  # "etcd" or "c10d"
    endpoint: str  # host:port
    rdzv_id: str
    min_nodes: int
    max_nodes: int
    out: Path
    nproc: int = 1
    node_rank: int = -1  # -1: by arrival
    local_addr: str = ""
    rdzv_timeout_s: float = 600.0
    progress: bool = True
    on_demand: bool = False  # the operator says this host is not preemptible (c10d's host)


def parse_nnodes(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX', as torchrun's --nnodes."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise AgentError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise AgentError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return low, high


def _is_local(host: str) -> bool:
    """Whether `host` names an address of this machine (then it can be bound)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def connect_rendezvous(opts: AgentOptions,
                       cfg: Config) -> tuple[StoreAddress, dist.Store | None]:
    """The job's store address, and the TCPStore this agent hosts (c10d, endpoint here)."""
    try:
        host, port = parse_endpoint(opts.endpoint)
    except ValueError as exc:
        raise AgentError(f"--rdzv-endpoint: {exc}") from None
    timeout = timedelta(seconds=cfg.cluster.timeout_s)
    if opts.backend == "etcd":
        from spotpipe.store.etcd import EtcdStore, EtcdStoreError

        address = StoreAddress("etcd", host, port, job_prefix(opts.rdzv_id))
        try:
            EtcdStore(host, port, address.prefix, timeout=timeout, reconnect_s=5.0).reachable()
        except EtcdStoreError as exc:
            raise AgentError(f"--rdzv-endpoint: {exc}") from None
        return address, None
    hosted = None
    if _is_local(host):
        if not opts.on_demand:
            # the store dies with its host, and the job with the store: a c10d store may only
            # live on a host the job cannot lose, which only the operator knows
            raise AgentError(
                f"--rdzv-backend c10d: this agent would host the job's store on {host}:{port}, "
                "and a host the job may lose (a spot host) takes the store and the whole job "
                "with it. Run this agent on an on-demand host and say so with --on-demand, or "
                "use --rdzv-backend etcd with etcd on on-demand machines")
        try:
            hosted = host_tcp_store(host, port, timeout)
        except OSError:
            hosted = None  # another agent of this host hosts it
    return StoreAddress("tcp", host, port), hosted


def _wait_get(store: dist.Store, key: str, timeout_s: float) -> bytes | None:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # a timeout (the store raises its own error types)
        return None
    return store.get(key)


def _read(store: dist.Store, key: str, *expect: type[Message]) -> Message:
    """The rendezvous record at `key`, typed; MessageError when it is not one of `expect`
    (anything with the store's address can write there: its reader says so and goes on)."""
    return from_plain(store.get(key), *expect)


def _over(store: dist.Store, token: str, rdzv_id: str, status: str, message: str,
          agents: int) -> None:
    store.set(OVER, plain(vouch(JobOver(status, message, agents), token, f"{rdzv_id}/{OVER}")))
    # (the key the proof covers is what `Coordinating._key` and `Agent._key` give for OVER)


def _write_atomic(path: Path, text: str) -> None:
    # the coordinating thread and its own agent write the same files at the same time: the
    # temporary name is the writer's (process and thread), not only the process's
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------- the coordinator


class AgentJobLoop(JobLoop):
    """The coordinator's loop when the workers run under agents on other hosts: exits arrive
    as mailbox records, kills go through the store, the final model through the store."""

    def __init__(self, coordinator: "Coordinating", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rdzv = coordinator
        self._kill_due: dict[str, float] = {}
        self._persisted: dict[str, Any] | None = None  # the books last written to the store
        self._marked = 0  # mailbox slots marked read (only once the books have taken them in)

    @property
    def _tombstone_on_read(self) -> bool:
        return not self.rdzv.persistent

    def _persist(self, files: RunFiles) -> None:
        """Keep the books in the store: the new lines of the run's files (a Journal record),
        the state (overwritten) and the read marks of the slots it has taken in, in one
        transaction, so a successor sees all of a turn or none of it."""
        if not self.rdzv.persistent:
            return
        metrics, lines = files.take()
        books = {**self._books(), "admission": self.rdzv.admission()}
        cursor = books["cursor"]
        if not (metrics or lines) and books == self._persisted and self._marked >= cursor:
            return
        g = self.coordinator.generation
        names: list[str] = []
        values: list[bytes] = []
        if metrics or lines:
            self._journal += 1
            names.append(keys.journal(self._journal))
            values.append(self.channel.seal(Journal(tuple(metrics), tuple(lines)), g))
        names.append(keys.COORDINATOR_STATE)
        values.append(self.channel.seal(
            CoordinatorState(**books, journal=self._journal, time_s=self._now()), g))
        # etcd bounds a transaction's operations (128 by default): the rest next turn
        marks, reads = mailbox.read_marks(self._marked + 1, min(cursor, self._marked + 100))
        # only while this agent still holds the office: a deposed coordinator that reaches
        # the store again must not overwrite its successor's books
        if not self._store.multi_set_if(  # type: ignore[attr-defined]
                keys.LEADER, str(self.rdzv.me), names + marks, values + reads):
            self.rdzv.depose()
            raise Deposed("this agent no longer holds the coordinator's office (another agent "
                          "was elected while it was cut off); its successor coordinates")
        self._marked += len(marks)
        self._persisted = books

    def _resume_nodes(self, inbox: Any) -> None:
        """Taking over: the nodes run on under their agents. The predecessor's own nodes went
        with its host (or are cut off with it): they are lost, as in any host loss; nodes it
        had fenced are asked to be killed again (its wait for their exits went with it)."""
        self.rdzv.go(inbox)
        state = self.takeover
        assert state is not None
        self._marked = state.cursor  # (the predecessor marked what its books took in)
        if self.coordinator.decided_after_books():
            return
        lost = self.rdzv.predecessor_nodes()
        self.files.event({"time_s": self._now(), "kind": "coordinator_takeover",
                          "node": f"agent{self.rdzv.me}",
                          "predecessor": f"agent{state.admission.get('me')}",
                          "generation": self.coordinator.generation, "cursor": state.cursor,
                          "books_age_s": round(self._now() - state.time_s, 6),
                          "predecessor_nodes": lost})
        for node in lost:
            if node in self._exited or node in self.coordinator.dead:
                continue
            self.files.event({"time_s": self._now(), "kind": "agent_lost", "node": node,
                              "reason": "its agent coordinated and lost its lease"})
            self.rdzv.silent(node)
            inbox.put(("exit", (node, -int(signal.SIGKILL))))
        for node in sorted(self.coordinator.fenced - set(self._exited) - set(lost)):
            self._kill(node)

    def _write_inputs(self) -> None:
        # the local agent writes the same files into the same folder at the same time
        _write_atomic(self.out / "config.yaml", yaml.safe_dump(self.cfg.to_dict(),
                                                               sort_keys=False))
        _write_atomic(self.out / "run.json", json.dumps(self.spec.to_json(), indent=1))

    def _start_nodes(self, address: StoreAddress, inbox: Any) -> None:
        self.rdzv.go(inbox)

    def _started(self) -> list[str]:
        return self.rdzv.nodes()

    def _launch_details(self) -> dict[str, Any]:
        return {"rdzv_id": self.rdzv.opts.rdzv_id, "agents": self.rdzv.admitted_count()}

    def _kill(self, node: str) -> None:
        """Ask the node's agent to kill it; a node whose agent is gone with its host never
        reports an exit, so it counts as exited once the heartbeat timeout passes again."""
        if node in self._exited or node in self._kill_due:
            return
        board.publish(self._store, self.channel, keys.kill_board(node),
                      Kill(node, "fenced by the coordinator"), self.coordinator.generation)
        self._kill_due[node] = time.time() + self.cfg.failover.heartbeat_timeout_s

    def _each_turn(self, files: RunFiles) -> None:
        if self.rdzv.persistent and not self.rdzv.still_leader():
            self.rdzv.depose()  # (before this turn fences, kills or publishes anything)
        if self.rdzv.deposed():
            raise Deposed("this agent lost the coordinator's lease (cut off from etcd for "
                          "longer than its TTL); a successor coordinates the job")
        now = time.time()
        for node, due in list(self._kill_due.items()):
            if node in self._exited:
                del self._kill_due[node]
            elif now >= due:
                del self._kill_due[node]
                files.event({"time_s": self._now(), "kind": "agent_silent", "node": node,
                             "reason": "killed by the coordinator, no exit reported"})
                self.rdzv.silent(node)
                self._inbox.put(("exit", (node, -int(signal.SIGKILL))))

    def _gather_final(self) -> str:
        last = self._last
        if self.coordinator.stop_message or last is None or last["iter"] + 1 < self.cfg.iterations:
            return ""  # the run did not finish; _completion_problem says why
        final = self.out / "final"
        final.mkdir(exist_ok=True)
        for s in range(self._stage_count()):
            if not self._store.check([final_key(s, "meta")]):
                return f"the final parameters of stage {s} never arrived from its agent"
            try:
                meta = _read(self._store, final_key(s, "meta"), FinalFile)
                if not vouched(meta, self.token, self.rdzv._key(final_key(s, "meta"))):
                    raise MessageError("it lacks the job's proof")
            except MessageError as exc:
                return f"the final parameters of stage {s} arrived unreadable ({exc})"
            assert isinstance(meta, FinalFile)
            data = b"".join(self._store.get(final_key(s, str(i))) for i in range(meta.parts))
            if hashlib.sha256(data).hexdigest() != meta.sha256:
                return f"the final parameters of stage {s} arrived damaged (checksum differs)"
            tmp = final / f".stage{s}.safetensors.recv"
            tmp.write_bytes(data)
            os.replace(tmp, final / f"stage{s}.safetensors")
            for i in range(meta.parts):
                self._store.delete_key(final_key(s, str(i)))
        return ""


class Coordinating:
    """The elected agent's side of the rendezvous: admit agents, then run the job's loop."""

    def __init__(self, opts: AgentOptions, cfg: Config, spec: job.RunSpec, token: str,
                 address: StoreAddress, me: int = 0,
                 leadership: Leadership | None = None) -> None:
        self.opts, self.cfg, self.spec, self.token, self.address = opts, cfg, spec, token, address
        self.me = me  # this agent's arrival number
        self.leadership = leadership  # etcd: the office, held under a lease
        self.persistent = leadership is not None  # the books go to the store (succession)
        self.takeover: CoordinatorState | None = None
        self.world = cfg.stages * cfg.pipelines
        self._lock = threading.Lock()
        self._nodes: list[str] = []
        self._admitted: list[int] = []
        self._agent_nodes: dict[int, list[str]] = {}
        self._silent: set[str] = set()  # nodes whose agent never reported their end
        self._slots: dict[int, int] = {}  # slot (node rank / nproc) -> agent
        self._events: list[dict[str, Any]] = []
        self._inbox: Any = None
        self.t0 = time.time()
        self.instance = new_instance_id()  # the job's key is derived from it and the token
        self.code = 1
        self._crash = ""  # why the coordinator's loop raised, for the agents' end message
        self._next = 1

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
        self._silent = {str(n) for n in a["silent"]}
        self._slots = {int(s): int(k) for s, k in a["slots"].items()}
        self._next = int(a["next"])
        return self

    def admission(self) -> dict[str, Any]:
        """The admission books, for a successor (part of its CoordinatorState)."""
        with self._lock:
            return {"me": self.me, "nodes": list(self._nodes), "admitted": list(self._admitted),
                    "agent_nodes": {str(k): v for k, v in self._agent_nodes.items()},
                    "silent": sorted(self._silent),
                    "slots": {str(s): k for s, k in self._slots.items()}, "next": self._next}

    def predecessor_nodes(self) -> list[str]:
        """The nodes of the agent that coordinated before this one."""
        assert self.takeover is not None
        return list(self._agent_nodes.get(int(self.takeover.admission.get("me", 0)), []))

    def deposed(self) -> bool:
        return self.leadership is not None and self.leadership.deposed.is_set()

    def still_leader(self) -> bool:
        """Whether the leader key still names this agent (one read: a coordinator that was cut
        off may come back before its keep-alive learns that its lease is gone)."""
        return self.leadership is not None and self.leadership.leader() == str(self.me)

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
        self._inbox.put(("event", record))

    def go(self, inbox: Any) -> None:
        """The loop has started: events go to it from now on; late agents may join."""
        with self._lock:
            self._inbox = inbox
            pending, self._events = self._events, []
        for record in pending:
            inbox.put(("event", record))
        threading.Thread(target=self._admit_late, name="admission", daemon=True).start()

    # ------------------------------------------------------------------ admission

    def _key(self, key: str) -> str:
        """What a rendezvous record's proof covers: the job's id and the record's key."""
        return f"{self.opts.rdzv_id}/{key}"

    def _answer(self, store: dist.Store, k: int, answer: Assignment) -> None:
        store.set(assign_key(k), plain(vouch(answer, self.token, self._key(assign_key(k)))))

    def _arrival(self, store: dist.Store, k: int) -> AgentArrival | ArrivalsClosed | None:
        """The `k`-th arrival; None (refused with an event, and answered) when it is not one,
        or a closing marker this coordinator did not write."""
        try:
            found = _read(store, agent_key(k), AgentArrival, ArrivalsClosed)
            if isinstance(found, ArrivalsClosed) and not vouched(found, self.token,
                                                                 self._key(agent_key(k))):
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
            self.cfg, token_ok=vouched(info, self.token, self._key(agent_key(k))),
            model_digest=info.model_digest, config_digest=info.config_digest)
        if problem:
            return problem
        if info.nproc != self.opts.nproc:
            return (f"it runs {info.nproc} nodes per agent, the job "
                    f"{self.opts.nproc} (--nproc-per-node)")
        # an agent whose node was fenced (cut off, then back) comes again in its own place
        again = 1 if self._rejoin_of(info) is not None else 0
        if len(self._admitted) - again >= self.opts.max_nodes:
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

    def _admit(self, store: dist.Store, k: int, info: AgentArrival, late: bool) -> None:
        problem = self._problem(k, info, late)
        name = f"agent{k}@{info.host[:100]}"
        if problem:
            self._answer(store, k, Assignment(refused=f"{name} refused by the job: {problem}"))
            self._event({"kind": "join_refused", "node": name, "reason": problem})
            return
        n = self.opts.nproc
        if late:
            first = len(self._nodes)
        else:
            rank = info.node_rank
            slot = rank if rank >= 0 else min(set(range(self.opts.min_nodes)) - set(self._slots))
            self._slots[slot] = k
            first = slot * n
        ranks = list(range(first, first + n))
        before = self._rejoin_of(info) if late else None
        with self._lock:
            if before is not None:
                self._admitted.remove(before)
            self._admitted.append(k)
            self._agent_nodes[k] = [f"node{r}" for r in ranks]
            self._nodes.extend(f"node{r}" for r in ranks)
        self._answer(store, k, Assignment(ranks=tuple(ranks), world=self.world, joining=late))
        self._event({"kind": "agent_admitted", "node": name, "ranks": ranks, "joining": late,
                     **({"rejoin_of": f"agent{before}"} if before is not None else {})})

    def _admit_late(self) -> None:
        store = self.address.connect(self.cfg.cluster.timeout_s)
        while True:
            k = self._next
            raw = _wait_get(store, agent_key(k), 7 * 86400.0)
            if raw is None or self.deposed():
                return
            if store.check([assign_key(k)]):  # answered by a predecessor already
                self._event({"kind": "agent_answered_before", "node": f"agent{k}"})
            else:
                info = self._arrival(store, k)
                if isinstance(info, ArrivalsClosed):  # this coordinator's: the job is over
                    return
                if info is not None:
                    self._admit(store, k, info, late=True)
            with self._lock:
                self._next = k + 1

    def run(self) -> int:
        if self.takeover is not None:
            return self._take_over()
        store = self.address.connect(self.cfg.cluster.timeout_s)
        root = durable.written_root(self.cfg, self.opts.out)
        nonce, refused = secrets.token_hex(16), ""
        try:  # this job commits the checkpoints: it holds the folder, and marks it
            if root is not None:
                durable.lock.acquire(root, self.opts.out)
                (root / durable.transfer.probe_name(self.opts.rdzv_id)).write_text(nonce)
        except (durable.lock.LockHeld, OSError) as exc:
            refused = f"checkpoint.dir: {exc}"
            print(f"spotpipe agent: {refused}", file=sys.stderr)
            _over(store, self.token, self.opts.rdzv_id, "failed", refused, 0)
        store.set(JOB, plain(vouch(JobPosted(
            proof="", spec=self.spec.to_json(), t0=self.t0, instance=self.instance,
            world=self.world, config_digest=self.cfg.digest(),
            model_digest=self.cfg.model_digest(), checkpoint_probe=nonce),
            self.token, self._key(JOB))))
        if refused:
            return self.code
        try:
            return self._run(store, root)
        finally:
            if root is not None:
                (root / durable.transfer.probe_name(self.opts.rdzv_id)).unlink(missing_ok=True)
                durable.lock.release(root)

    def _run(self, store: dist.Store, root: Path | None) -> int:
        notes = [{"kind": "checkpoint_partial_removed", "path": str(p)}
                 for p in (durable.clean_partials(root) if root is not None else [])]
        k = 0
        while len(self._slots) < self.opts.min_nodes:
            k += 1
            raw = _wait_get(store, agent_key(k), self.opts.rdzv_timeout_s)
            if raw is None:
                message = (f"rendezvous: {len(self._slots)} of {self.opts.min_nodes} agents "
                           f"arrived within {self.opts.rdzv_timeout_s:.0f} s (--rdzv-timeout)")
                for j in range(1, k):
                    if not store.check([assign_key(j)]):
                        self._answer(store, j, Assignment(refused=message))
                print(f"spotpipe agent: {message}", file=sys.stderr)
                _over(store, self.token, self.opts.rdzv_id, "failed", message, 0)
                self.code = 1
                return self.code
            info = self._arrival(store, k)
            if isinstance(info, AgentArrival):
                self._admit(store, k, info, late=False)
        self._next = k + 1
        loop = AgentJobLoop(self, cfg=self.cfg, spec=self.spec, out=self.opts.out,
                            token=self.token, instance=self.instance,
                            progress=self.opts.progress, t0=self.t0)
        loop.notes = notes
        loop_store = self.address.connect(self.cfg.cluster.timeout_s)
        try:
            self.code = loop.run(loop_store, self.address)
        except BaseException as exc:
            self._crash = f"the coordinator failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._close(store)
        return self.code

    def _take_over(self) -> int:
        """Go on with the job from the predecessor's books (the job's files continue in this
        agent's --out). Checkpoints are committed here from now on only where this host sees
        the checkpoint folder the workers write to (a shared `checkpoint.dir`)."""
        store = self.address.connect(self.cfg.cluster.timeout_s)
        loop = AgentJobLoop(self, cfg=self.cfg, spec=self.spec, out=self.opts.out,
                            token=self.token, instance=self.instance,
                            progress=self.opts.progress, t0=self.t0)
        loop.takeover = self.takeover
        try:
            self.code = loop.run(self.address.connect(self.cfg.cluster.timeout_s), self.address)
        except BaseException as exc:
            self._crash = f"the coordinator failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._close(store)
        return self.code

    def _close(self, store: dist.Store) -> None:
        """The job is over (unless this coordinator was deposed: then its successor ends it)."""
        if self.deposed():
            return
        # wake the admission thread: a marker in the next arrival slot it will read
        close = store.add(ARRIVALS, 1)
        store.set(agent_key(close), plain(vouch(ArrivalsClosed(), self.token,
                                                self._key(agent_key(close)))))
        for j in range(1, close):  # agents still waiting for an answer get one
            if not store.check([assign_key(j)]):
                self._answer(store, j, Assignment(refused=f"job {self.opts.rdzv_id} is over"))
        summary = json.loads((self.opts.out / "summary.json").read_text()) \
            if (self.opts.out / "summary.json").exists() else {}
        _over(store, self.token, self.opts.rdzv_id, summary.get("status", "failed"),
              summary.get("message", "") or self._crash, self.answering())


# ---------------------------------------------------------------------- every agent


class Agent:
    def __init__(self, opts: AgentOptions, cfg: Config, spec: job.RunSpec, token: str,
                 address: StoreAddress, hosted: dist.Store | None) -> None:
        self.opts, self.cfg, self.spec, self.token = opts, cfg, spec, token
        self.address, self.hosted = address, hosted
        self.timeout_s = cfg.cluster.timeout_s
        self._exits_done = threading.Event()
        self._pending = 0
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        print(f"spotpipe agent: {text}", file=sys.stderr, flush=True)

    def run(self) -> int:
        opts = self.opts
        store = self.address.connect(self.timeout_s)
        me = self._arrive(store)
        self.me = me
        self.coordinating: Coordinating | None = None
        self.thread: threading.Thread | None = None
        self.leadership = None
        if self.address.kind == "etcd":
            self.leadership = Leadership(store, str(me), lease_ttl(
                self.cfg.failover.heartbeat_timeout_s))  # type: ignore[arg-type]
            won = self.leadership.campaign() and not store.check([JOB])
        else:
            won = store.compare_set(COORDINATOR, "", str(me)) == str(me).encode()
        if won:
            self._coordinate(Coordinating(opts, self.cfg, self.spec, self.token, self.address,
                                          me, self.leadership))
            self.say(f"agent {me} coordinates job {opts.rdzv_id}")
        elif self.leadership is not None and self.leadership.leading:
            # the office was vacant but the job exists: its coordinator was lost before this
            # agent arrived; take over once admitted (below, in _work)
            self.leadership.resign()
        if _wait_get(store, JOB, opts.rdzv_timeout_s) is None:
            self.say(f"no job appeared at the rendezvous within {opts.rdzv_timeout_s:.0f} s")
            return 1
        try:
            posted = _read(store, JOB, JobPosted)
        except MessageError as exc:
            self.say(f"refused: the job record at this rendezvous (--rdzv-id {opts.rdzv_id}) "
                     f"is not a spotpipe job's ({exc}); this agent did not join it")
            return 2
        assert isinstance(posted, JobPosted)
        if not vouched(posted, self.token, self._key(JOB)):
            self.say(f"refused: the job at this rendezvous (--rdzv-id {opts.rdzv_id}) was not "
                     "started with this SPOTPIPE_JOIN_TOKEN; this agent did not join it")
            return 2
        if store.check([OVER]):
            self.say(f"job {opts.rdzv_id} is over already")
            return 1
        answer = self._assignment(store, me)
        if answer is None:
            return 1
        if answer.refused:
            self.say(answer.refused)
            return 2
        self.channel = Channel(job_key(self.token, posted.instance), f"agent{me}")
        self.instance = posted.instance
        code = self._work(store, posted, answer)
        if self.thread is not None and self.coordinating is not None:
            self.thread.join()
            code = 1 if self.coordinating.deposed() else self.coordinating.code
        return code

    def _key(self, key: str) -> str:
        return f"{self.opts.rdzv_id}/{key}"  # (as Coordinating._key)

    def _arrive(self, store: dist.Store, rejoin_of: int | None = None) -> int:
        """Take an arrival number and say what this agent brings; the number."""
        opts = self.opts
        me = store.add(ARRIVALS, 1)
        store.set(agent_key(me), plain(vouch(AgentArrival(
            host=socket.gethostname(), nproc=opts.nproc, node_rank=opts.node_rank, proof="",
            model_digest=self.cfg.model_digest(), config_digest=self.cfg.digest(),
            local_addr=opts.local_addr, rejoin_of=rejoin_of), self.token,
            self._key(agent_key(me)))))
        return me

    def _assignment(self, store: dist.Store, me: int) -> Assignment | None:
        """The coordinator's answer to arrival `me`; None (said) when none comes in time. An
        answer without the job's proof is a refusal that says so: someone without the token
        wrote into this job's rendezvous."""
        if _wait_get(store, assign_key(me), self.opts.rdzv_timeout_s) is None:
            self.say(f"not admitted within {self.opts.rdzv_timeout_s:.0f} s (--rdzv-timeout)")
            return None
        try:
            answer = _read(store, assign_key(me), Assignment)
            if not vouched(answer, self.token, self._key(assign_key(me))):
                raise MessageError("it lacks the job's proof")
        except MessageError as exc:
            return Assignment(refused=f"the answer to this agent's arrival ({me}) is not the "
                                      f"coordinator's: {exc}; something without the join "
                                      "token writes into this rendezvous")
        assert isinstance(answer, Assignment)
        return answer

    def _job_over(self, store: dist.Store) -> JobOver:
        """The job's end; a record without the job's proof reads as a failure saying so."""
        try:
            over = _read(store, OVER, JobOver)
            if vouched(over, self.token, self._key(OVER)):
                assert isinstance(over, JobOver)
                return over
            raise MessageError("without the job's proof")
        except MessageError as exc:
            return JobOver("failed", f"the job's end record is not the coordinator's ({exc})")

    def _coordinate(self, coordinating: Coordinating) -> None:
        self.coordinating = coordinating
        self.thread = threading.Thread(target=coordinating.run, name="coordinator", daemon=True)
        self.thread.start()

    def _succeed(self, store: dist.Store, posted: JobPosted) -> bool:
        """This agent won the vacant office: take over from the predecessor's books; False
        when there are none that open (then the job cannot go on, and is ended)."""
        try:
            opened = self.channel.open(store.get(keys.COORDINATOR_STATE) if store.check(
                [keys.COORDINATOR_STATE]) else b"", expect=CoordinatorState,
                writers={"coordinator"})
        except Refused as why:
            message = (f"the coordinator was lost and its books cannot be read ({why.reason});"
                       " the job cannot go on")
            self.say(message)
            _over(store, self.token, self.opts.rdzv_id, "failed", message, 0)
            return False
        assert isinstance(opened.message, CoordinatorState) and self.leadership is not None
        self.say(f"agent {self.me} takes over as the coordinator of job {self.opts.rdzv_id}")
        self._coordinate(Coordinating.successor(
            self.opts, self.cfg, self.token, self.address, self.me, self.leadership, posted,
            opened.message))
        return True

    def _wait_over(self, store: dist.Store, posted: JobPosted) -> None:
        """Wait for the job's end while watching the coordinator's office: when it falls
        vacant (its host lost), campaign, and take over if elected. A leader that finds itself
        deposed leaves (its workers with it: the successor counts its host lost)."""
        leadership = self.leadership
        if leadership is None:  # c10d: the store's host is on-demand; so is the coordinator
            store.wait([OVER], timedelta(days=7))
            return
        slice_s = float(leadership.ttl_s)
        while True:
            if leadership.deposed.is_set():
                self.say("lost the coordinator's lease (cut off from etcd for longer than its "
                         "TTL): a successor coordinates; this host leaves the job")
                return
            seen = leadership.wait_vacant(OVER, slice_s)
            if seen == OVER:
                return
            if seen == "vacant" and self.coordinating is not None:
                leadership.deposed.wait(slice_s)  # its own lease gone: deposed at the next renewal
                continue
            if seen == "vacant" and self.coordinating is None and leadership.campaign():
                if not self._succeed(store, posted):
                    return

    def _work(self, store: dist.Store, posted: JobPosted, answer: Assignment) -> int:
        """Run this host's workers until the job is over; the job's outcome as exit code."""
        out = self.opts.out
        (out / "logs").mkdir(parents=True, exist_ok=True)
        _write_atomic(out / "config.yaml", yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        _write_atomic(out / "run.json", json.dumps(posted.spec, indent=1))
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
        self._pending = len(ranks)
        self._fenced: set[str] = set()
        self._posted, self._shared = posted, shared
        supervisor = self.supervisor = Supervisor(out / "logs", self._exited)
        # a SIGTERM to the agent is the host's preemption notice: pass it on to the workers
        signal.signal(signal.SIGTERM, lambda *_: [supervisor.signal(n, signal.SIGTERM)
                                                  for n in list(supervisor.procs)])
        self._spawn(ranks, world, answer.joining)
        # later workers (a fenced node's agent joining again) are started by one thread that
        # lives as long as the agent: a worker dies with the thread that started it
        # (PR_SET_PDEATHSIG), and the exit callbacks' threads end at once
        self._spawns: queue.Queue[tuple[list[int], int]] = queue.Queue()
        threading.Thread(target=self._spawner, name="spawner", daemon=True).start()
        self._wait_over(store, posted)
        supervisor.stop_all()
        self._exits_done.wait(self.timeout_s)
        if not store.check([OVER]):  # deposed: the job goes on without this host
            return 1
        over = self._job_over(store)
        coordinating = self.coordinating is not None
        last = store.add(LEFT, 1) >= over.agents
        if last:
            store.set(ALL_LEFT, "1")
        if last and self.leadership is not None and self.leadership.leader() is None:
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
                    if self.leadership is not None:
                        self.leadership.resign()
                    store.delete_prefix()
        if over.status == "completed":
            self.say("job completed; results in the coordinator's --out")
            return 0
        self.say(f"job failed: {over.message}")
        return 1

    def _spawn(self, ranks: list[int], world: int, joining: bool) -> None:
        """Start this host's workers for `ranks`, each with a watcher of its kill board."""
        for local, rank in enumerate(ranks):
            node = f"node{rank}"
            env = worker_env(self.cfg, rank=rank, world=world, local_rank=local,
                             local_world=len(ranks), address=self.address, run_dir=self.opts.out,
                             t0=self._posted.t0, token=self.token,
                             instance=self.instance, search_path=search_path(self.cfg),
                             joining=joining)
            env["SPOTPIPE_CHECKPOINT_UPLOAD"] = "0" if self._shared else "1"
            self.supervisor.spawn(node, env)
            BoardWatcher(self.address.connect(self.timeout_s), self.channel,
                         keys.kill_board(node), Kill, lambda _, node=node: self._kill(node))
        self.say(f"started {', '.join(f'node{r}' for r in ranks)}"
                 + (" (joining the running job)" if joining else ""))

    def _spawner(self) -> None:
        while True:
            ranks, world = self._spawns.get()
            self._spawn(ranks, world, joining=True)

    def _kill(self, node: str) -> None:
        """The coordinator fenced `node` (hung, or cut off past the heartbeat timeout)."""
        self._fenced.add(node)
        self.supervisor.signal(node, signal.SIGKILL)

    def _rejoin(self, node: str) -> None:
        """`node` was fenced while this host lives (a partition that healed): the job moved on
        without it, so its state is stale; come again as a new agent, whose fresh node joins
        the running job like any late one (placed when a layout has room for it)."""
        try:
            store = self.address.connect(self.timeout_s)
            if store.check([OVER]):
                return
            me = self._arrive(store, rejoin_of=self.me)
            answer = self._assignment(store, me) or Assignment(refused="no answer")
            if answer.refused:
                self.say(f"{node} was fenced; not admitted again: {answer.refused}")
                return
            self.me = me
            if self.leadership is not None and not self.leadership.leading:
                self.leadership.me = str(me)  # (a candidate under its current number)
            with self._lock:
                self._pending += len(answer.ranks)
            self.say(f"{node} was fenced by the job; this host joins again as agent {me}")
            self._spawns.put((list(answer.ranks), answer.world))
        except Exception as exc:  # the store is gone: the job is over already
            self.say(f"could not join again after {node} was fenced: {exc}")

    def _exited(self, node: str, code: int) -> None:
        """A worker of this host exited: hand over its final files, then tell the job (and
        join again if the job fenced it)."""
        try:
            store = self.address.connect(self.timeout_s)
            if code == 0:
                self._upload_final(store)
            Outbox(store, self.channel, 0.0).post(Exit(node, code))
        except Exception as exc:  # the store is gone: the job is over already
            self.say(f"could not report the exit of {node}: {exc}")
        if node in self._fenced:
            self._rejoin(node)
        with self._lock:
            self._pending -= 1
            if self._pending <= 0:
                self._exits_done.set()

    def _upload_final(self, store: dist.Store) -> None:
        for path in sorted((self.opts.out / "final").glob("stage*.safetensors")):
            s = int(path.name[len("stage"):-len(".safetensors")])
            data = path.read_bytes()
            parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
            for i, part in enumerate(parts):
                store.set(final_key(s, str(i)), part)
            meta = FinalFile(len(parts), hashlib.sha256(data).hexdigest())
            store.set(final_key(s, "meta"), plain(vouch(meta, self.token,
                                                        self._key(final_key(s, "meta")))))


def run_agent(opts: AgentOptions, cfg: Config, *, overwrite: bool = False) -> int:
    """Validate, meet the other agents, run; AgentError/LaunchError before anything starts."""
    token = os.environ.get("SPOTPIPE_JOIN_TOKEN", "")  # (str; any bytes, see protocol.auth)
    if not token:
        raise AgentError("SPOTPIPE_JOIN_TOKEN: set it to the job's shared secret on every host "
                         "(a node without it is refused)")
    if opts.backend not in ("etcd", "c10d"):
        raise AgentError(f"--rdzv-backend {opts.backend!r}: expected etcd or c10d")
    if opts.nproc < 1:
        raise AgentError(f"--nproc-per-node {opts.nproc}: expected >= 1")
    world = cfg.stages * cfg.pipelines
    if opts.min_nodes * opts.nproc != world:
        raise AgentError(
            f"--nnodes {opts.min_nodes}:{opts.max_nodes}: the job starts with stages x pipelines"
            f" = {cfg.stages} x {cfg.pipelines} = {world} nodes, so MIN x --nproc-per-node "
            f"({opts.min_nodes} x {opts.nproc}) must be {world}; agents beyond MIN join later")
    if opts.node_rank >= opts.min_nodes:
        raise AgentError(f"--node-rank {opts.node_rank}: expected 0..{opts.min_nodes - 1}")
    out = opts.out = opts.out.resolve()  # workers get it in their environment
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise AgentError(f"--out {out}: the folder exists and is not empty; pass --overwrite "
                         "to replace it")
    prepared = prepare(cfg)
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
    return Agent(opts, cfg, prepared.spec, token, address, hosted).run()


__all__ = ["AgentError", "AgentOptions", "LaunchError", "parse_nnodes", "run_agent"]
