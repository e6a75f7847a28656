"""A generation's records are removed from the store once it is over (`cluster.collect`).

The references are the stores' own counts: what torch's gloo writes when groups really form,
and what the boards really hold after posting, against `num_keys` after the collection."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from spotpipe.cluster.collect import GenerationRecords, collect, group_keys
from spotpipe.plan import Layout
from spotpipe.protocol import Abort, Channel, DecisionRecord, Regroup, keys
from spotpipe.store import board

KEY = b"k" * 32
P2D2 = Layout.build(2, 2, ["node0", "node1", "node2", "node3"])
P2D1 = Layout.build(2, 1, ["node0", "node2"])


def form_groups(store: dist.Store, prefix: str, layout: Layout) -> None:
    """Form `layout`'s groups under `prefix` as `runtime.comm` does (the world group of the
    active nodes in rank order, then each stage's data-parallel group), one thread a node."""
    nodes = sorted(layout.active_nodes)
    errors: list[BaseException] = []

    def node(me: str) -> None:
        try:
            dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/world", store), nodes.index(me),
                                  len(nodes), timedelta(seconds=20))
            for stage in range(layout.num_stages):
                members = [layout.owner(d, stage) for d in range(layout.num_pipelines)]
                if me in members and len(members) > 1:
                    dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/dp{stage}", store),
                                          members.index(me), len(members),
                                          timedelta(seconds=20))
        except BaseException as exc:  # (said by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors


def test_the_named_rendezvous_keys_are_all_that_gloo_writes():
    """torch 2.13's gloo writes one key per rank and group: exactly the named ones."""
    store = dist.HashStore()
    form_groups(store, "spotpipe/gen3", P2D2)
    names = group_keys("spotpipe/gen3", P2D2)
    assert store.num_keys() == len(names) == 8  # world of 4, two stage groups of 2
    assert all(store.check([name]) for name in names)


def write_generation(store: dist.Store, g: int, layout: Layout, early: Layout) -> None:
    """What generation `g` leaves: its boards as the coordinator and a node post them, its
    groups, the groups formed ahead for it, a re-partition's marks and layer metadata."""
    coordinator, node = Channel(KEY, "coordinator"), Channel(KEY, "node0")
    board.publish(store, node, keys.abort_board(g), Abort(g, "node1 lost"), g)
    board.publish(store, coordinator, keys.decision_board(g), DecisionRecord(g, {}), g)
    board.publish(store, coordinator, keys.abort_board(g), Abort(g, "ended"), g)
    board.publish(store, coordinator, keys.regroup_board(g), Regroup(g, "a join"), g)
    board.publish(store, coordinator, keys.regroup_board(g), Regroup(g, "ended", True), g)
    form_groups(store, keys.groups_prefix("spotpipe", g), layout)
    form_groups(store, keys.groups_prefix(keys.early_groups("spotpipe", early.to_json()), g),
                early)
    for n in sorted(layout.active_nodes):  # (as runtime.reshape and runtime.migrate write)
        store.set(keys.exchanged("spotpipe", g, n), "exchanged")
    store.set(f"{keys.layers_prefix('spotpipe', g)}/node0/node2", "{}")


def test_collect_removes_one_generation_and_leaves_the_next():
    store = dist.HashStore()
    write_generation(store, 4, P2D1, P2D2)
    store.set(keys.heartbeat("node0"), "beat")  # not a generation's
    kept = store.num_keys()
    write_generation(store, 3, P2D1, P2D2)
    assert store.num_keys() > kept
    rec = GenerationRecords(3, P2D1, early=(P2D2,), moved_from=P2D2)
    assert collect(store, "spotpipe", rec) == kept - 1
    assert store.num_keys() == kept
    assert store.check([keys.board_slot(keys.decision_board(4), 1), keys.heartbeat("node0")])
