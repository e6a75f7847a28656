"""A node's generations (`spotpipe.runtime.generations`): the boards of the next generation are
watched before the node enters it, and beginning a generation never waits for a store
connection.

What went wrong before: a node that opened a connection on its regroup's path waited in it
for glibc's 5 s retry (one lookup in about 25 is dropped by these VMs' resolver), could not
hear that a peer was lost meanwhile, and was fenced as hung. The formation of the groups is a
stand-in here (it records the abort it was given); the store and the boards are real.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from spotpipe.plan import Layout
from spotpipe.protocol import Abort, Channel, Prepare, Regroup, keys
from spotpipe.protocol.auth import job_key
from spotpipe.runtime.generations import GenerationGroups
from spotpipe.store import board
from spotpipe.store.abort import AbortSignal, PeerFailure
from spotpipe.store.address import StoreAddress, host_tcp_store
from spotpipe.store.watchers import SpareConnections

KEY = job_key(b"sesame", "test")
LAYOUT = Layout.build(2, 1, ["node0", "node1"])
GUARD_S = 30.0  # the most a check here waits before it fails


class _Comm:
    def __init__(self, abort: AbortSignal) -> None:
        self.abort, self.closed = abort, False

    def close(self) -> None:
        self.closed = True


class _GatedSpares:
    """Connections given only once `gate` opens, counting the takes that wait there."""

    def __init__(self, address: StoreAddress, fail: str | None = None) -> None:
        self.address, self.fail = address, fail
        self.gate = threading.Event()
        self.waiting = 0
        self._changed = threading.Condition()

    def take(self) -> dist.Store:
        with self._changed:
            self.waiting += 1
            self._changed.notify_all()
        self.gate.wait()
        if self.fail:
            raise ConnectionError(self.fail)
        return self.address.connect(GUARD_S)

    def give_back(self, store: dist.Store) -> None:
        pass

    def wait_waiting(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.waiting >= count, GUARD_S)


def _triggered(abort: AbortSignal) -> str:
    """The abort's reason once it is triggered (PeerFailure), failing after GUARD_S."""
    guard = threading.Event()
    timer = threading.Timer(GUARD_S, guard.set)
    timer.start()
    try:
        with pytest.raises(PeerFailure) as raised:
            abort.wait(guard)
    finally:
        timer.cancel()
    return str(raised.value)


@pytest.fixture()
def store_address():
    server = host_tcp_store("127.0.0.1", 0, timedelta(seconds=GUARD_S))
    yield StoreAddress("tcp", "127.0.0.1", server.port)
    del server


def _end(groups: GenerationGroups, address: StoreAddress) -> None:
    """The node is done: close the boards it watches, as the coordinator does once their
    generations are over, so that every watcher ends before the store goes."""
    boards = groups.every_board  # type: ignore[attr-defined]
    groups.close()
    store, coordinator = address.connect(GUARD_S), Channel(KEY, "coordinator")
    for g in (b.generation for b in boards):
        board.publish(store, coordinator, keys.abort_board(g), Abort(g, "ended"), g)
        board.publish(store, coordinator, keys.regroup_board(g),
                      Regroup(g, "ended", ended=True), g)
    for watcher in (w for b in boards for w in b.watchers):
        watcher.join(GUARD_S)


def _groups(spares, formed: list[_Comm]) -> GenerationGroups:
    def form(generation: int, layout: Layout, abort: AbortSignal, namespace: str) -> _Comm:
        formed.append(_Comm(abort))
        formed[-1].layout = layout  # type: ignore[attr-defined]
        return formed[-1]

    groups = GenerationGroups(node="node0", protocol=Channel(KEY, "node0"), spares=spares,
                              namespace="test", form=form, coordinator="coordinator",
                              refused=lambda why: None)
    groups.every_board = []  # type: ignore[attr-defined]
    watch = groups._watch

    def watch_and_keep(generation: int):  # (so that `_end` ends each watch it began)
        groups.every_board.append(watch(generation))  # type: ignore[attr-defined]
        return groups.every_board[-1]  # type: ignore[attr-defined]

    groups._watch = watch_and_keep  # type: ignore[method-assign]
    return groups


def test_beginning_a_generation_waits_for_no_store_connection(store_address):
    spares = _GatedSpares(store_address)
    formed: list[_Comm] = []
    groups = _groups(spares, formed)
    opened: list[_Comm] = []
    opening = threading.Thread(target=lambda: opened.append(groups.open(0, LAYOUT)),
                               daemon=True)
    opening.start()
    opening.join(GUARD_S)
    assert opened, "beginning the generation waited for a store connection"
    [comm] = opened
    assert comm is formed[0] and not comm.abort.is_set
    # generation 0's two watchers wait for their connections, and generation 1's
    assert spares.wait_waiting(4) and not comm.abort.is_set
    spares.gate.set()
    # the watchers connect now and see their boards: generation 0's abort ends its groups
    board.publish(store_address.connect(GUARD_S), Channel(KEY, "node1"), keys.abort_board(0),
                  Abort(0, "node1: lost node2"), 0)
    assert "lost node2" in _triggered(comm.abort)
    _end(groups, store_address)


def test_the_next_generations_boards_are_watched_before_the_node_enters_it(store_address):
    spares = SpareConnections(store_address, GUARD_S)
    formed: list[_Comm] = []
    groups = _groups(spares, formed)
    groups.open(0, LAYOUT)
    ahead = groups.abort_of(1)
    writer = store_address.connect(GUARD_S)
    board.publish(writer, Channel(KEY, "coordinator"), keys.regroup_board(1), Regroup(1, "x"),
                  1)
    board.publish(writer, Channel(KEY, "node1"), keys.abort_board(1),
                  Abort(1, "node1: lost node3"), 1)
    assert "lost node3" in _triggered(ahead)  # heard while the node was still in generation 0
    assert not groups.regroup.is_set()  # generation 0's request is not generation 1's
    comm = groups.open(1, LAYOUT)
    assert comm.abort is ahead and comm.abort.is_set  # it begins aborted: it reports at once
    # and it knows the regroup its generation asked for: as soon as that board's own watcher
    # reads it (published first, but a watcher of its own, on a thread of its own: under two
    # test processes' load it came after the abort's, once)
    assert groups.regroup.wait(GUARD_S)
    assert formed[0].closed
    _end(groups, store_address)
    spares.close()


def test_a_board_that_cannot_be_watched_aborts_its_generation(store_address):
    spares = _GatedSpares(store_address, fail="store unreachable")
    groups = _groups(spares, [])
    comm = groups.open(0, LAYOUT)
    spares.gate.set()
    assert "cannot watch" in _triggered(comm.abort)
    groups.close()


def test_a_preparation_after_the_regroup_request_is_formed_too(store_address):
    """The regroup board's watch reads on past a `Regroup`: a second joiner's `Prepare`,
    posted after the first joiner's request, has its groups formed ahead (the boundary's plan
    is the one it names); the generation's last record (`Regroup.ended`) ends the watch."""
    from procs import until

    spares = SpareConnections(store_address, GUARD_S)
    formed: list[_Comm] = []
    groups = _groups(spares, formed)
    groups.open(0, LAYOUT)
    writer, coordinator = store_address.connect(GUARD_S), Channel(KEY, "coordinator")
    board.publish(writer, coordinator, keys.regroup_board(0), Regroup(0, "node2 joined"), 0)
    wider = Layout.build(2, 2, ["node0", "node1", "node2", "node3"])
    board.publish(writer, coordinator, keys.regroup_board(0), Prepare(0, wider.to_json()), 0)
    until(lambda: len(formed) == 2, "the prepared groups' formation", GUARD_S)
    assert groups.regroup.is_set() and formed[1].layout == wider  # type: ignore[attr-defined]
    board.publish(writer, coordinator, keys.regroup_board(0),
                  Regroup(0, "the generation ended", ended=True), 0)
    watcher = groups.every_board[0].watchers[1]  # type: ignore[attr-defined]
    watcher.join(GUARD_S)
    assert not watcher._thread.is_alive()
    assert groups.open(1, wider, prepared=True) is formed[1]
    _end(groups, store_address)
    spares.close()
