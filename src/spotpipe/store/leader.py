"""Which agent coordinates a job: an election under an etcd lease.

The coordinator is a process on one of the job's hosts, and spot hosts go. So it holds its
office the way etcd's own election recipe does: the leader key is created only if it is
absent (one transaction), attached to a lease of about the heartbeat timeout, which the
leader's keep-alive thread renews three times per TTL. When the leader's host is lost (or cut
off for longer than the TTL), etcd lets the lease expire and deletes the key; every other
agent watches that key, and the first whose put-if-absent succeeds coordinates next. A
leader that finds its own lease gone (it was cut off and the others moved on) is deposed: it
must stop acting at once, since a successor may already be coordinating.

etcd restarting is not a loss of office: etcd keeps leases in its data directory and gives
every lease a fresh TTL when it elects its own leader, and the keep-alive retries until then.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from spotpipe.protocol import keys
from spotpipe.store.fenced import NotLeader  # noqa: F401 (re-exported: a fenced write's error)

if TYPE_CHECKING:  # (etcd3gw is an optional dependency: the `etcd` extra)
    from spotpipe.store.etcd import EtcdStore


def lease_ttl(heartbeat_timeout_s: float) -> int:
    """The leader's lease TTL: the heartbeat timeout, in whole seconds (etcd's unit), at
    least 2 (etcd refuses shorter leases)."""
    return max(2, math.ceil(heartbeat_timeout_s))


class Leadership:
    """One agent's candidacy: `campaign` once or again; `deposed` is set if the office is lost."""

    def __init__(self, store: "EtcdStore", me: str, ttl_s: int,
                 on_deposed: Callable[[], None] | None = None) -> None:
        self.store, self.me, self.ttl_s = store, me, ttl_s
        self.deposed = threading.Event()
        self._on_deposed = on_deposed
        self._stop = threading.Event()
        self._lease: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def leading(self) -> bool:
        return self._lease is not None and not self.deposed.is_set()

    def leader(self) -> str | None:
        """The agent that coordinates now, or None while the office is vacant."""
        values = self.store.wait_until([keys.LEADER], lambda _: True, 0.0) or {}
        raw = values.get(keys.LEADER)
        return None if raw is None else raw.decode(errors="replace")

    def squatted(self) -> bool:
        """Whether the leader key holds a value attached to no lease: no agent's (each holds
        it under its lease), but something's that reached the store. Such a key never
        expires: the office looked taken for good, and every agent waited for ever."""
        return self.store.lease_of(keys.LEADER) == 0

    def fenced(self, store: "EtcdStore", name: str) -> "EtcdStore":
        """`store`, each of whose writes lands only while the leader key names `name` (one
        transaction): the keep-alive hears of a lost lease only after its retries give up
        (`cluster.timeout_s`), long after a successor took the office, and a write that was
        under way while this agent was cut off lands when it is back. Refused, it deposes."""
        return store.guarded(keys.LEADER, name, on_refused=self._refused)

    def _refused(self) -> None:
        """A write refused for want of the office: deposed, and its lease, which holds no key
        any more, is no longer renewed."""
        self._stop.set()
        self.deposed.set()
        if self._on_deposed is not None:
            self._on_deposed()

    def reclaim(self) -> bool:
        """The leader holds its lease, but the key was written over without one: put it back
        under the lease; whether it was (False: not this agent's office to take back)."""
        lease = self._lease
        return lease is not None and not self.deposed.is_set() and \
            self.store.claim_unleased(keys.LEADER, self.me, lease)

    def campaign(self) -> bool:
        """Try to take the office (put-if-absent under a fresh lease, or in place of a key
        that no lease holds: `squatted`); whether this agent has it. A lost campaign leaves
        no lease behind."""
        if self.leading:
            return True
        lease = self.store.grant_lease(self.ttl_s)
        if self.store.create_leased(keys.LEADER, self.me, lease) != self.me.encode() \
                and not self.store.claim_unleased(keys.LEADER, self.me, lease):
            self.store.revoke_lease(lease)
            return False
        # (a fresh term: an office handed on and then taken back)
        self._lease, self._stop, self.deposed = lease, threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, args=(lease, self._stop),
                                        name="leader-lease", daemon=True)
        self._thread.start()
        return True

    def _keep_alive(self, lease: int, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):  # renewal period, not a synchronisation
            try:
                alive = self.store.keep_alive(lease)
            except Exception:  # etcd away past the store's reconnect deadline
                alive = False
            if stop.is_set():  # resigned meanwhile: the lease went with the office
                return
            if not alive:
                self.deposed.set()
                if self._on_deposed is not None:
                    self._on_deposed()
                return

    def wait_vacant(self, also: str, timeout_s: float,
                    accept: Callable[[bytes], bool] = lambda _: True) -> str | None:
        """Block until the office is vacant (returns "vacant") or key `also` holds a value
        that `accept`s (returns `also`), or `timeout_s` passes (None). A watch, not a poll:
        a value `also` holds that is not accepted is waited past until it changes."""
        def done(values: dict[str, bytes]) -> bool:
            return keys.LEADER not in values or _holds(values, also, accept)

        values = self.store.wait_until([keys.LEADER, also], done, timeout_s)
        if values is None:
            return None
        return also if _holds(values, also, accept) else "vacant"

    def wait_taken(self, also: str, timeout_s: float,
                   accept: Callable[[bytes], bool] = lambda _: True) -> bool:
        """Block until an agent holds the office or key `also` holds a value that `accept`s
        (True), or `timeout_s` passes with the office vacant (False). A watch, not a poll."""
        def done(values: dict[str, bytes]) -> bool:
            return keys.LEADER in values or _holds(values, also, accept)

        return self.store.wait_until([keys.LEADER, also], done, timeout_s) is not None

    def resign(self) -> None:
        """Leave the office (the job is over): the key goes with the lease."""
        self._stop.set()
        if self._lease is not None and not self.deposed.is_set():
            try:
                self.store.revoke_lease(self._lease)
            except Exception:  # the store is gone: the lease expires on its own
                pass
        self._lease = None


def _holds(values: dict[str, bytes], key: str, accept: Callable[[bytes], bool]) -> bool:
    return key in values and accept(values[key])
