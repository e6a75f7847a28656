"""A generation's store connections are opened while the job trains, not during a regroup
(`spotpipe.store.watchers.SpareConnections`)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from spotpipe.store.address import StoreAddress
from spotpipe.store.watchers import SpareConnections


def test_spares_are_opened_when_asked_and_taken_before_connecting():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    spares = SpareConnections(StoreAddress("tcp", "127.0.0.1", server.port), 30.0, keep=3)
    first = spares.take()  # none ready yet: it connects itself
    first.set("a", "1")
    spares.refill()
    assert spares.wait_ready(30)
    ready = list(spares._ready)
    taken = [spares.take() for _ in range(3)]
    assert sorted(map(id, taken)) == sorted(map(id, ready))  # the ready ones, not new ones
    for i, store in enumerate(taken):  # each a working connection of its own
        store.set(f"k{i}", str(i))
        assert first.get(f"k{i}") == str(i).encode()
    assert spares._ready == []
    fourth = spares.take()  # none left: connects itself
    assert fourth.get("a") == b"1" and fourth not in taken
    spares.refill()
    assert spares.wait_ready(30)
    spares.close()  # the job is over: what was ready is dropped, nothing more is opened
    assert spares._ready == []
    spares.refill()
    assert spares._ready == []


def test_a_slow_connection_holds_up_only_itself(monkeypatch):
    """torch's TCPStore client looks up the name of the store's address on every connection,
    and a resolver that drops the query holds that one for 5 s: the others are opened
    meanwhile, and the slow one joins them when it comes."""
    import threading

    from spotpipe.store import watchers

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    address = StoreAddress("tcp", "127.0.0.1", server.port)
    release, first = threading.Event(), threading.Event()
    real = watchers.client

    def connect(addr, timeout_s):
        if not first.is_set():  # the first connection asked for stalls until released
            first.set()
            assert release.wait(30)
        return real(addr, timeout_s)

    monkeypatch.setattr(watchers, "client", connect)
    spares = SpareConnections(address, 30.0, keep=4, openers=2)
    spares.refill()
    assert first.wait(30)
    assert spares.wait_ready(30, count=3)  # opened beside the stalled one
    assert len(spares._ready) == 3
    release.set()
    assert spares.wait_ready(30)
    assert len(spares._ready) == 4
    spares.refill()  # full: nothing more is opened
    assert spares._owed == 0 and len(spares._ready) == 4
    spares.close()
