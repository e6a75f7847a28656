"""A node's threads that talk to the store: the heartbeat, the board watchers, and those that
keep the next generations' connections ready (`SpareConnections`).

Each has its own store connection (a client blocked in `wait` cannot serve other calls):

- the heartbeat publishes liveness and progress, so the coordinator can tell a dead node
  (heartbeats stop) from a hung one (heartbeats go on, progress does not, the main thread is
  not waiting on a peer). It survives store errors: it retries, and says so once in an event;
- a board watcher blocks on a board (a generation's abort, its regroup request) and calls
  back on the first record that opens under the job's key; a forged record is skipped;
- a board reader reads a board the node's main thread waits on (its join answers) and hands
  the records over, so that the main thread never blocks in the store's C++ wait.

Watchers end when their generation does: the coordinator closes every board of a generation
it ends (an abort record, a regroup record), so threads and connections do not pile up over
hundreds of generations (tests/test_liveness.py counts them).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from spotpipe.protocol import Abort, Channel, Heartbeat as Beat, Message, Opened, Refused, keys
from spotpipe.store import board
from spotpipe.store.abort import AbortSignal
from spotpipe.store.address import StoreAddress


def client(address: StoreAddress, timeout_s: float) -> dist.Store:
    """A connection of its own (for a thread that blocks in `wait`)."""
    return address.connect(timeout_s)


KEEP, OPENERS = 6, 3  # SpareConnections' defaults (see there)

# a connection, or how to get one (`SpareConnections.take`), for a user that gets it on a
# thread of its own, so that whoever starts that user never waits for a new connection
Connection = dist.Store | Callable[[], dist.Store]


def connected(store: Connection) -> dist.Store:
    return store if isinstance(store, dist.Store) else store()


class SpareConnections:
    """Store connections opened ahead of need.

    A node needs three connections of its own for each generation (two board watchers and
    its groups' rendezvous), and a failover's regroup is on the job's critical path: opening
    them took 2-3 ms of a takeover's 5-6 ms on this machine. The watchers give theirs back
    when their boards close (`give_back`); threads open the rest when asked (`refill`, once
    the job trains again), so a regroup takes ready ones. Should the store be unreachable
    then, `take` connects itself and reports it as before.

    Six are kept, two regroups' worth: a failover is often followed at once by the
    re-partition it calls for, before an iteration has completed to ask for more. And each
    is opened on one of several threads: torch's TCPStore client looks up the name of the
    store's address on every connection it makes (for its log lines), and a resolver that
    drops the query holds that connection for glibc's retry (about one connection in 25 on
    our VMs, where the lookup of a v4-mapped loopback address goes to DNS; 5 s by default, 1 s
    in the job's processes: `cluster.supervisor.RESOLVER_OPTIONS`). One slow connection then
    holds up only itself, not the regroup's or the ones behind it."""

    def __init__(self, address: StoreAddress, timeout_s: float, keep: int = KEEP,
                 openers: int = OPENERS) -> None:
        self.address, self.timeout_s, self.keep, self.openers = address, timeout_s, keep, openers
        self._ready: list[dist.Store] = []
        self._cond = threading.Condition()
        self._owed = 0  # connections `refill` asked for that no opener has started on
        self._opening = 0
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def take(self) -> dist.Store:
        with self._cond:
            store = self._ready.pop() if self._ready else None
        return store if store is not None else client(self.address, self.timeout_s)

    def give_back(self, store: dist.Store) -> None:
        """A connection its user is done with, idle (a watcher whose board closed): kept for
        the next `take` when fewer than `keep` are ready, else dropped (closed)."""
        with self._cond:
            if not self._stopped and len(self._ready) < self.keep:
                self._ready.append(store)
                self._cond.notify_all()

    def refill(self) -> None:
        """Open connections up to `keep`, on the openers (started on first use)."""
        with self._cond:
            if self._stopped:
                return
            self._owed = max(0, self.keep - len(self._ready) - self._opening)
            if not self._owed:
                return
            if not self._threads:
                self._threads = [threading.Thread(target=self._open, name="spare-store",
                                                  daemon=True) for _ in range(self.openers)]
                for thread in self._threads:
                    thread.start()
            self._cond.notify_all()

    def wait_ready(self, timeout_s: float, count: int | None = None) -> bool:
        """Whether `count` connections (`keep` unless given) are ready within `timeout_s`."""
        want = self.keep if count is None else count
        with self._cond:
            return self._cond.wait_for(lambda: len(self._ready) >= want, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()

    def _open(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._owed > 0)
                if self._stopped:
                    return
                self._owed -= 1
                self._opening += 1
            try:
                store: dist.Store | None = client(self.address, self.timeout_s)
            except Exception:  # unreachable for now: `take` connects (and fails) itself
                store = None
            with self._cond:
                self._opening -= 1
                if store is None:
                    self._owed = 0
                elif not self._stopped:
                    self._ready.append(store)
                self._cond.notify_all()


class Heartbeat:
    """Publishes a sealed beat every `interval_s`; never ends on a store error."""

    def __init__(self, store: dist.Store, channel: Channel, node: str, interval_s: float,
                 progress: Callable[[], dict[str, Any]],
                 on_trouble: Callable[[str], None] | None = None,
                 watch: Callable[[], float] | None = None) -> None:
        self.store, self.channel, self.node = store, channel, node
        self.interval_s, self.progress = interval_s, progress
        self._on_trouble = on_trouble
        # called after each beat (`spotpipe.runtime.stall.StallWatch.look`): the seconds until
        # it wants to be called again, which can bring the next beat forward
        self._watch = watch
        self._stop = threading.Event()
        self.failures = 0  # beats that could not be written, in a row
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                state = self.progress()
                key = keys.heartbeat(self.node)
                self.store.set(key, self.channel.seal(
                    Beat(self.node, **state), state.get("generation", 0), at=key))
                self.failures = 0
            except Exception as exc:  # the store away (etcd restarting) or a closed client
                self.failures += 1
                if self.failures == 3 and self._on_trouble is not None:
                    try:
                        self._on_trouble(f"heartbeats failing: {type(exc).__name__}: {exc}")
                    except Exception:  # the same store is away: the event cannot go either
                        pass
            wait = self.interval_s
            if self._watch is not None:
                try:
                    wait = max(0.0, min(wait, self._watch()))
                except Exception:  # its report could not go (the store away): next beat
                    pass
            self._stop.wait(wait)  # the beat's period, not a synchronisation

    def stop(self) -> None:
        self._stop.set()


class BoardWatcher:
    """Calls `then(message)` for the first record of `board` that opens as `expect`, and for
    the records after it while `then` returns True (the regroup board's `Prepare`s and
    `Regroup`s, up to the generation's last record); `writers` limits whose records count.

    `store` is a connection, or how to get one (`SpareConnections.take`): then the thread
    gets it, so that whoever starts the watch never waits for a connection (a new one can take
    seconds: see SpareConnections), and `on_lost(why)` hears if it cannot.

    `done(store)`, if given, gets the connection back once the watch ends on a record:
    nothing waits on it any more, so the next generation's watcher can use it
    (`SpareConnections.give_back`) instead of opening one. A wait that failed keeps its
    connection (it may be broken)."""

    def __init__(self, store: Connection, channel: Channel, board_key: str,
                 expect: type[Message] | tuple[type[Message], ...],
                 then: Callable[[Message], bool | None],
                 on_refused: Callable[[Refused], None] | None = None,
                 done: Callable[[dist.Store], None] | None = None,
                 writers: set[str] | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.store = store if isinstance(store, dist.Store) else None
        self._closed = threading.Event()
        checks: dict[str, object] = {"expect": expect}
        if writers is not None:
            checks["writers"] = writers

        def watch() -> None:
            try:
                connection = connected(store)
            except Exception as exc:  # the store unreachable: the watch cannot be kept
                if on_lost is not None:
                    on_lost(f"cannot watch {board_key}: {exc}"[:300])
                return
            self.store = connection  # (kept referenced as long as the thread may use it)
            records = board.read(connection, board_key, channel,
                                 on_refused=lambda why, _: on_refused and on_refused(why),
                                 **checks)
            # a closed watch reads no further: its generation's records are deleted from the
            # store once the generation after it ends (`cluster.collect`), and a wait on a
            # slot deleted before it was read would hold this thread and its connection for
            # as long as the job runs (a watch that got its connection seconds late, say)
            while not self._closed.is_set():
                try:
                    _, opened = next(records)
                except Exception:  # the store gone (the job is over)
                    return
                if self._closed.is_set() or not then(opened.message):
                    break
            if done is not None:
                done(connection)

        self._thread = threading.Thread(target=watch, name=f"watch-{board_key}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Ignore what comes from now on: the thread ends before its next read, or with the
        next record if it is waiting for one (the generation's last record comes before its
        watchers are closed, and before its records are deleted)."""
        self._closed.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def watch_abort(store: Connection, channel: Channel, generation: int, abort: AbortSignal,
                on_refused: Callable[[Refused], None] | None = None,
                done: Callable[[dist.Store], None] | None = None) -> BoardWatcher:
    """Trigger `abort` on the generation's first genuine abort record (or when the board
    cannot be watched: a node that cannot hear its generation's abort must not wait in it)."""
    return BoardWatcher(store, channel, keys.abort_board(generation), Abort,
                        lambda m: abort.trigger(m.reason),  # type: ignore[attr-defined]
                        on_refused, done, on_lost=abort.trigger)


class BoardReader:
    """`board.read` on a thread and a store connection of its own, record by record.

    For a board the main thread waits on for long (a standby node's join answers, for days):
    Python runs a signal handler (SIGTERM, a preemption notice) only when the main thread is
    between bytecodes, never while it is blocked in the store's C++ wait, and a client
    blocked there serves no one else (the node's events, posted from other threads, would
    queue behind it). Here the thread blocks, and the main thread takes records with `next`,
    returning now and then to look at its notices.
    """

    def __init__(self, store: dist.Store, channel: Channel, board_key: str, *, start: int = 1,
                 **checks: object) -> None:
        # (slot, what it held, or None with what ended the reading)
        self._items: queue.Queue[tuple[int, Opened | Refused | None, Exception | None]] = (
            queue.Queue())

        def read() -> None:
            try:
                for index, opened in board.read(
                        store, board_key, channel, start=start,
                        on_refused=lambda why, index: self._items.put((index, why, None)),
                        **checks):
                    self._items.put((index, opened, None))
            except Exception as exc:  # the store gone (the job is over) or the wait timed out
                self._items.put((-1, None, exc))

        self._store = store  # (kept referenced as long as the thread may use it)
        threading.Thread(target=read, name=f"read-{board_key}", daemon=True).start()

    def next(self, timeout_s: float) -> tuple[int, Opened | Refused] | None:
        """The next slot and what it held (a record, or why it did not open), or None if
        nothing came within `timeout_s`. Raises what ended the reading."""
        try:
            index, item, ended = self._items.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is None:
            self._items.put((index, item, ended))  # every later call says the same
            assert ended is not None
            raise ended
        return index, item
