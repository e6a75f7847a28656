"""The coordinator's office, as one agent takes part in it: election, succession, take-back.

Every agent of a job runs its host's workers; one of them also coordinates. Which one, and
what happens when it goes, is this module's: the agent (`cluster/agent.py`) keeps to its
host (arrival, workers, notices, exits), and asks its `Office` what its part is.

- Election. With etcd, etcd's own recipe (`store/leader.py`: a leader key under a lease of
  about the heartbeat timeout); with c10d, the agent hosting the store, and no other (without
  succession the coordinator's host must be one the job cannot lose, and the store's is the
  one the operator said is).
- Succession (etcd). Every other agent watches the leader key while it waits for the job's
  end; when the office falls vacant it campaigns, and the winner takes over from the books
  the coordinator kept in the store (`cluster/succession.py`, `Coordinating.successor`).
- Hand-over and take-back. A coordinator whose host is being reclaimed hands the office on
  (`AgentJobLoop`); if no agent takes it within one lease TTL (their hosts are going too), it
  takes the office back from the books it just wrote and keeps it to the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from spotpipe import job
from spotpipe.checkpoint import durable
from spotpipe.cluster.admission import Coordinating
from spotpipe.cluster.agent_options import AgentOptions
from spotpipe.cluster.rendezvous import (COORDINATOR, JOB, OVER, over_record, post_over,
                                         wait_for_over)
from spotpipe.config import Config
from spotpipe.protocol import Channel, CoordinatorState, JobPosted, MessageError, Refused, keys
from spotpipe.store.address import StoreAddress
from spotpipe.store.leader import Leadership, lease_ttl
from spotpipe.store.mailbox import Outbox


class Office:
    """This agent's part in the coordinator's office: whether it holds it (`coordinating`,
    run on a thread of its own), and, with etcd, its candidacy (`leadership`)."""

    def __init__(self, opts: AgentOptions, cfg: Config, token: str, address: StoreAddress,
                 say: Callable[[str], None], on_handed_over: Callable[[], None]) -> None:
        """`on_handed_over`: called once the coordinator this agent ran has handed the
        office on (its host may be done)."""
        self.opts, self.cfg, self.token, self.address = opts, cfg, token, address
        self.say, self._on_handed_over = say, on_handed_over
        self.me = -1  # this agent's arrival number, the name it campaigns under
        self.coordinating: Coordinating | None = None  # this agent's, if elected
        self.thread: threading.Thread | None = None  # the coordinator's
        self.leadership: Leadership | None = None  # etcd: the office, under a lease
        self._refused_over = b""  # the last record at the job's end key refused (said once)

    @property
    def handed_over(self) -> bool:
        """This agent coordinated, and has handed the office on."""
        return self.coordinating is not None and self.coordinating.handed_over.is_set()

    def renamed(self, me: int) -> None:
        """The agent came again under a new arrival number (`Agent._rejoin`): a candidate
        campaigns under its newest (an office it holds stays under the one it was won with)."""
        self.me = me
        if self.leadership is not None and not self.leadership.leading:
            self.leadership.me = str(me)

    def elect(self, store: dist.Store, me: int, spec: job.RunSpec,
              hosts_store: bool, checkpoint: durable.Checkpoint | None,
              notes: list[dict[str, Any]]) -> None:
        """Campaign at arrival; coordinate the job if elected. An office found vacant while
        the job exists (its coordinator lost before this agent came) is left for now: this
        agent takes it over once admitted, in `wait_over`, from the books."""
        self.me = me
        if self.address.kind == "etcd":
            self.leadership = Leadership(store, str(me), lease_ttl(
                self.cfg.failover.heartbeat_timeout_s))  # type: ignore[arg-type]
            won = self.leadership.campaign() and not store.check([JOB])
        else:
            won = c10d_elected(store, me, hosts_store)
        if won:
            self._coordinate(Coordinating(self.opts, self.cfg, spec, self.token,
                                          self.address, me, self.leadership,
                                          checkpoint=checkpoint, notes=notes))
            self.say(f"agent {me} coordinates job {self.opts.rdzv_id}")
        elif self.leadership is not None and self.leadership.leading:
            self.leadership.resign()

    def outcome(self, code: int) -> int:
        """The agent's exit code, its workers' being `code`: a coordinator's thread is waited
        for, and its outcome is the job's (a coordinator that handed the office on left
        saying so: `code` stands)."""
        coordinating = self.coordinating
        if self.thread is None or coordinating is None:
            return code
        self.thread.join()
        if coordinating.handed_over.is_set():
            return code
        return 1 if coordinating.deposed() else coordinating.code

    def _coordinate(self, coordinating: Coordinating) -> None:
        self.coordinating = coordinating

        def run() -> None:
            try:
                coordinating.run()
            finally:
                if coordinating.handed_over.is_set():
                    self._on_handed_over()

        self.thread = threading.Thread(target=run, name="coordinator", daemon=True)
        self.thread.start()

    def _succeed(self, store: dist.Store, posted: JobPosted, channel: Channel,
                 stays: bool = False) -> bool:
        """This agent won the vacant office: take over from the predecessor's books; False
        when there are none that open (then the job cannot go on, and is ended). `stays`: it
        coordinates until its host goes (an office taken back)."""
        if not store.check([keys.COORDINATOR_STATE]):
            # (lost before its first turn: no books to go on from, nothing trained yet)
            return self._cannot_go_on(store, "the coordinator was lost before it kept any "
                                             "books (during the rendezvous or the job's "
                                             "start): the job cannot go on; start it again")
        try:
            opened = channel.open(store.get(keys.COORDINATOR_STATE), at=keys.COORDINATOR_STATE,
                                  expect=CoordinatorState, writers={"coordinator"})
        except Refused as why:
            return self._cannot_go_on(store, f"the coordinator was lost and its books cannot "
                                             f"be read ({why.reason}); the job cannot go on")
        assert isinstance(opened.message, CoordinatorState) and self.leadership is not None
        self.say(f"agent {self.me} takes over as the coordinator of job {self.opts.rdzv_id}")
        successor = Coordinating.successor(self.opts, self.cfg, self.token, self.address,
                                           self.me, self.leadership, posted, opened.message)
        successor.stays = stays
        self._coordinate(successor)
        return True

    def _cannot_go_on(self, store: dist.Store, message: str) -> bool:
        """End the job, saying why no successor can take it on: False."""
        self.say(message)
        post_over(store, self.token, self.opts.rdzv_id, "failed", message, 0)
        return False

    def wait_over(self, store: dist.Store, posted: JobPosted, channel: Channel,
                  noticed: threading.Event) -> None:
        """Wait for the job's end while watching the coordinator's office: when it falls
        vacant (its host lost), campaign, and take over if elected; a host being reclaimed
        (`noticed`) does not campaign. A leader that finds itself deposed leaves (its
        workers with it: the successor counts its host lost)."""
        leadership = self.leadership
        is_over = self._over_check(store, posted, channel)
        if leadership is None:  # c10d: the store's host is on-demand; so is the coordinator
            wait_for_over(store, is_over)  # (a job runs for weeks)
            return
        slice_s = float(leadership.ttl_s)
        while True:
            if leadership.deposed.is_set():
                self.say("lost the coordinator's lease (cut off from etcd for longer than its "
                         "TTL): a successor coordinates; this host leaves the job")
                return
            seen = leadership.wait_vacant(OVER, slice_s, accept=is_over)
            if seen == OVER:
                return
            if seen is None and self.coordinating is None and not noticed.is_set() \
                    and leadership.squatted():
                seen = "vacant"  # (a key no agent holds never expires: taken in its place)
            if seen == "vacant" and self.coordinating is not None:
                leadership.deposed.wait(slice_s)  # its own lease gone: deposed at the next renewal
                continue
            if seen == "vacant" and noticed.is_set():
                # a host being reclaimed waits for another to take the office (or the job's
                # end), rather than asking again at once
                leadership.wait_taken(OVER, slice_s, accept=is_over)
                continue
            if seen == "vacant" and self.coordinating is None and leadership.campaign():
                if not self._succeed(store, posted, channel):
                    return
                if noticed.is_set():  # (the notice came while it campaigned)
                    self.coordinating.noticed()  # type: ignore[union-attr]

    def _over_check(self, store: dist.Store, posted: JobPosted,
                    channel: Channel) -> Callable[[bytes], bool]:
        """Whether a value at the job's end key is the end its coordinator posted. One that
        is not (anything with the store's address can write there) is refused, said once and
        told to the job as a `record_refused` event, and the wait for the end goes on: read
        as the end, it stopped every host's workers."""
        def is_over(raw: bytes) -> bool:
            try:
                over_record(raw, self.token, self.opts.rdzv_id)
                return True
            except MessageError as exc:
                if raw != self._refused_over:
                    self._refused_over = raw
                    reason = f"{OVER}: not the coordinator's end of the job ({exc})"
                    self.say(f"refused the record at {reason}; the job goes on")
                    try:
                        Outbox(store, channel, posted.t0).event(
                            "record_refused", writer="unknown", reason=reason)
                    except Exception:  # noqa: BLE001 - the store gone: said above
                        pass
                return False

        return is_over

    def take_back(self, store: dist.Store, posted: JobPosted, channel: Channel) -> bool:
        """After handing the office on, wait one lease TTL for another agent to take it. If
        none did (their hosts are being reclaimed too, which this coordinator had not heard
        yet, or their agents are gone), take it back from the books just written and
        coordinate to the job's end (`Coordinating.stays`). Whether it was taken back (then
        the agent waits for the job's end again)."""
        leadership = self.leadership
        if not self.handed_over or leadership is None:
            return False
        assert self.thread is not None
        self.thread.join()  # (it resigned: the office is vacant from there)
        try:
            if leadership.wait_taken(OVER, float(leadership.ttl_s),
                                     accept=self._over_check(store, posted, channel)):
                return False
            # a candidate under this agent's newest number (a rejoin renamed it while it led)
            leadership.me = str(self.me)
            if not leadership.campaign():
                return False  # another agent took it meanwhile
        except Exception as exc:  # etcd unreachable: the office is the others' to take
            self.say(f"could not watch the coordinator's office after handing it on: {exc}")
            return False
        self.say("no other agent took the coordinator's office within the lease TTL; this "
                 "agent takes it back")
        return self._succeed(store, posted, channel, stays=True)


def c10d_elected(store: dist.Store, me: int, hosts_store: bool) -> bool:
    """With c10d the agent that hosts the store coordinates, and no other: without
    succession the coordinator's host must be one the job cannot lose, and the store's is
    the one the operator said is (`--on-demand`). The first agent to win a compare-and-set
    coordinated before, which could be a spot host's: its loss ended the job, and the CPU
    shadows it ran went with it."""
    if not hosts_store:
        return False
    return store.compare_set(COORDINATOR, "", str(me)) == str(me).encode()
