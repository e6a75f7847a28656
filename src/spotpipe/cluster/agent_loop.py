"""The coordinator's job loop when its workers run under agents on other hosts."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import yaml

from spotpipe.checkpoint import transfer
from spotpipe.cluster.inbox import HelperEvent, Inbox, NodeExit, RefusedUpload
from spotpipe.cluster.jobloop import Deposed, HandedOver, JobLoop
from spotpipe.cluster.run_files import RunFiles
from spotpipe.cluster.agent_options import AgentOptions
from spotpipe.cluster.rendezvous import write_atomic
from spotpipe.protocol import CoordinatorState, FinalUpload, Journal, Kill, keys
from spotpipe.store import board, mailbox
from spotpipe.store.address import StoreAddress


class ElectedAgent(Protocol):
    """What the loop needs of the elected agent (`spotpipe.cluster.admission.Coordinating`):
    its admission books, and whether it still holds the coordinator's office."""

    me: int
    opts: AgentOptions
    persistent: bool  # etcd: the books go to the store, for a successor

    def go(self, inbox: Inbox) -> None: ...
    def nodes(self) -> list[str]: ...
    def admitted_count(self) -> int: ...
    def admission(self) -> dict[str, Any]: ...
    def predecessor_nodes(self) -> list[str]: ...
    def silent(self, node: str) -> None: ...
    def node_gone(self, node: str) -> None: ...
    def deposed(self) -> bool: ...
    def still_leader(self) -> bool: ...
    def depose(self) -> None: ...
    # the hand-over at the host's notice (`Coordinating.noticed`)
    hand_over: threading.Event
    handed_over: threading.Event
    stays: bool
    admitting: threading.Lock
    def own_nodes(self) -> list[str]: ...
    def others_nodes(self) -> set[str]: ...
    def runs(self, writer: str, node: str) -> bool: ...


class AgentJobLoop(JobLoop):
    """The coordinator's loop when the workers run under agents on other hosts: exits arrive
    as mailbox records, kills go through the store, the final model through the store."""

    def __init__(self, coordinator: ElectedAgent, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rdzv = coordinator
        self._kill_due: dict[str, float] = {}
        # nodes counted out here (silent, or the predecessor's) whose exit this loop queued
        # for itself: in no books until a turn takes it in
        self._queued_exits: set[str] = set()
        self._persisted: dict[str, Any] | None = None  # the books last written to the store
        self._marked = 0  # mailbox slots marked read (only once the books have taken them in)
        # the final stage files on their way from the agents (`_final_upload`), by stage
        self._finals: dict[int, Future[str]] = {}
        # every stage's receive at once (threads start as announcements come): received one
        # after another, a later stage's sender waited for its first acknowledgement as long
        # as the stages before it took, past `cluster.timeout_s` for a large model
        self._finals_pool = ThreadPoolExecutor(64, thread_name_prefix="final-receive")

    @property
    def _tombstone_on_read(self) -> bool:
        return not self.rdzv.persistent

    def _read_through(self) -> int:
        return self._marked  # (a successor reads on from the books' cursor)

    def _persist(self, files: RunFiles) -> None:
        """Keep the books in the store at the end of a turn; and once this host's notice came
        and its nodes have left, hand the office on (`HandedOver`)."""
        if not self.rdzv.persistent:
            return
        if not self._may_hand_over():
            self._write_books(files)
            return
        with self.rdzv.admitting:  # (no agent admitted by this coordinator from now on)
            self._events_now(files)
            self.intake.committed()
            files.event({"time_s": self._now(), "kind": "coordinator_handover",
                         "node": f"agent{self.rdzv.me}", "generation":
                         self.coordinator.generation, "nodes_left": self.rdzv.own_nodes()})
            self._write_books(files, handed_over=True)
            self.rdzv.handed_over.set()
        raise HandedOver(f"agent{self.rdzv.me} handed the coordinator's office on at its "
                         "host's notice, its nodes having left; an agent of another host "
                         "coordinates from its books")

    def _may_hand_over(self) -> bool:
        """Whether this host is being reclaimed (its agent had a SIGTERM, or every node of it
        left on a notice: a cloud's metadata service tells the workers, not the agent), its
        nodes have all left, and an agent of another host has a node that trains on (not
        leaving on a notice of its own): one that will campaign for the office. Otherwise
        the coordinator stays: the job is ending with its hosts. It waits for what only its
        memory holds: a checkpoint being committed or received (the committer's), a node it
        asked killed whose exit is due or queued; and it stays once the job is ending: the final
        stages come to it (`_final_upload`), a stop is being carried out."""
        own = set(self.rdzv.own_nodes())
        if not (self.rdzv.hand_over.is_set()
                or (own and own <= self.coordinator.left_on_notice)):
            return False  # (every turn of a coordinator whose host is not reclaimed)
        exited = set(self._exited)
        if (self.rdzv.stays or not own <= exited or self.coordinator.over
                or self.coordinator.finished or self._finals or self.coordinator.stop_message
                or self._kill_due or not self._queued_exits <= exited
                or not self.intake.idle()):
            return False
        staying = self.rdzv.others_nodes() - exited - self.coordinator.dead \
            - self.coordinator.leaving_now()
        return bool(staying)

    def _events_now(self, files: RunFiles) -> None:
        """Write the events helper threads have queued (an admission, a checkpoint's send)
        and the refusals, which a successor would not see otherwise; the rest of the inbox is
        the mailbox's records, which the successor reads again from the cursor."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, HelperEvent):
                files.event(item.record)
            elif isinstance(item, RefusedUpload):
                self.coordinator.refused(item.writer, item.reason)

    def _write_books(self, files: RunFiles, handed_over: bool = False) -> None:
        """The new lines of the run's files (a Journal record), the state (overwritten) and
        the read marks of the slots it has taken in, in one transaction, so a successor sees
        all of a turn or none of it."""
        metrics, lines = files.take()
        books = {**self._books(), "admission": self.rdzv.admission()}
        cursor = books["cursor"]
        if not (metrics or lines or handed_over) and books == self._persisted \
                and self._marked >= cursor:
            return
        g = self.coordinator.generation
        names: list[str] = []
        values: list[bytes] = []
        if metrics or lines:
            self._journal += 1
            record = Journal(tuple(metrics), tuple(lines))
            names.append(keys.journal(self._journal))
            values.append(self.channel.seal(record, g, at=names[-1]))
            self._folder.add(self._journal, record)
        segment = self._folder.due()
        segments, folded = self._folder.named_with(segment)
        if segment is not None:
            names.append(keys.journal_segment(segments))
            values.append(self.channel.seal(segment, g, at=names[-1]))
        names.append(keys.COORDINATOR_STATE)
        values.append(self.channel.seal(
            CoordinatorState(**books, journal=self._journal, time_s=self._now(),
                             handed_over=handed_over, journal_segments=segments,
                             journal_folded=folded), g, at=keys.COORDINATOR_STATE))
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
        if segment is not None:
            # (after the books that name the segment: a successor that read the books before
            # finds the records still there; one that reads them after reads the segment)
            covered = self._folder.written(segment)
            self._store.delete_keys([keys.journal(i) for i in covered])  # type: ignore[attr-defined]

    def _resume_nodes(self, inbox: Inbox) -> None:
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
                          "handed_over": state.handed_over, "predecessor_nodes": lost})
        for node in lost:
            if node in self._exited or node in self.coordinator.dead:
                continue
            self.files.event({"time_s": self._now(), "kind": "agent_lost", "node": node,
                              "reason": "its agent coordinated and lost its lease"})
            self.rdzv.silent(node)
            self._queued_exits.add(node)
            inbox.put(NodeExit(node, -int(signal.SIGKILL)))
        for node in sorted(self.coordinator.fenced - set(self._exited) - set(lost)):
            self._kill(node)

    def _node_exited(self, node: str, code: int, cause: str = "") -> tuple[str, str] | None:
        self.rdzv.node_gone(node)  # (its agent may no longer count toward --nnodes MAX)
        return super()._node_exited(node, code, cause)

    def _log_of(self, name: str) -> str:
        """A node of another host logs there, into its agent's --out: not into this one's."""
        if name in self.rdzv.others_nodes():
            return f"logs/{name}.log in the --out of its host's agent"
        return super()._log_of(name)

    def _exit_refusal(self, writer: str, node: str) -> str:
        """Only the agent of `node`'s host reports its exit (and its cause): another's record
        would count a running node out, or lend it a cause it did not die of."""
        if self.rdzv.runs(writer, node):
            return ""
        return f"an exit record for {node}, which {writer} does not run"

    def _write_inputs(self) -> None:
        # the local agent writes the same files into the same folder at the same time
        write_atomic(self.out / "config.yaml", yaml.safe_dump(self.cfg.to_dict(),
                                                               sort_keys=False))
        write_atomic(self.out / "run.json", json.dumps(self.spec.to_json(), indent=1))

    def _start_nodes(self, address: StoreAddress, inbox: Inbox) -> None:
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
                self._queued_exits.add(node)
                self._inbox.put(NodeExit(node, -int(signal.SIGKILL)))

    def _final_upload(self, message: FinalUpload, writer: str) -> None:
        """A worker sends its stage's final parameters: take its pieces as they come, on a
        thread of their own and a store connection of their own (the worker waits for each
        piece to be taken), into `final/.incoming` until the run is known complete. Only the
        node itself announces its stage, and a stage once at a time: a second sender on the
        same stream's keys would interleave its pieces with the first's."""
        if writer != message.node:
            self.coordinator.refused(writer, f"a final_upload in the name of {message.node}")
            return
        underway = self._finals.get(message.stage)
        if underway is not None and not underway.done():
            self.coordinator.refused(writer, f"a final_upload of stage {message.stage}, "
                                             "which is being received already")
            return
        incoming = self.out / "final" / ".incoming"
        name = f"stage{message.stage}.safetensors"

        self._finals[message.stage] = self._finals_pool.submit(
            lambda: transfer.receive(self._upload_connection(),
                                     transfer.Stream.final(message.stage),
                                     {name: message.sha256}, incoming,
                                     timeout_s=self.cfg.cluster.timeout_s, node=message.node,
                                     receiving=self.intake.receiving))

    def _gather_final(self) -> str:
        last = self.lines.last
        if self.coordinator.stop_message or last is None or last["iter"] + 1 < self.cfg.iterations:
            return ""  # the run did not finish; _completion_problem says why
        final = self.out / "final"
        for s in range(self._stage_count()):
            if s not in self._finals:
                return f"the final parameters of stage {s} never arrived from its agent"
            problem = self._finals[s].result()  # (done: its node exited after sending it)
            if problem:
                return f"the final parameters of stage {s} did not arrive whole: {problem}"
            os.replace(final / ".incoming" / f"stage{s}.safetensors",
                       final / f"stage{s}.safetensors")
        shutil.rmtree(final / ".incoming", ignore_errors=True)  # (a stage sent twice)
        return ""
