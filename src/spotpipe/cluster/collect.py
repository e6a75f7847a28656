"""What each generation leaves in the job's store, and its removal once no one reads it.

Every generation writes records of its own: its boards (abort, decision, regroup), its
process groups' rendezvous (each rank's address per group, under `keys.groups_prefix`), the
groups formed ahead for it (under `keys.early_groups`), and a re-partition's layer metadata
and exchange marks. Nothing read them after the generation, and nothing deleted them: the
launcher's memory (TCPStore) or etcd's space grew with every generation for as long as the job
ran (11.8 keys and 3.7 KB a generation at P = 2 x D = 2: `tests/store_growth.py`), towards
etcd's quota, past which etcd refuses writes and the job dies.

The coordinator knows when a generation is over. It removes generation g's records when it
publishes the Decision that ends g + 1 + KEPT_GENERATIONS. Every node that is still in the
job reported in g + 1 by then (the agreement waits for every live node, or for its fencing
and exit), so each of them read g's Decision, took or gave up g's groups, and left g's boards
(its watchers of them, closed as it began g + 1, read no further:
`store.watchers.BoardWatcher`); a node fenced in g is killed. But a node that g's Decision
let go (leaving on a notice, put on standby, counted out to join again) reports in no later
generation, and may read that Decision after the next one is out: a plan that fails while it
is carried out is followed by another within milliseconds (a two-process CI run had a leaving
node wait 60 s for a Decision removed 18 ms after it was published, and fail the job). Those
readers get KEPT_GENERATIONS more decisions' time; any other reader of a removed key waits
out its own timeout, in a generation that is over anyway. A store that deletes by prefix
(etcd) has each prefix removed whole; torch's TCPStore has only `delete_key`, so its keys
are named: the boards' slots are probed from 1 (a board's slots are filled in order), the
groups' from the layouts that formed them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from spotpipe.plan import Layout
from spotpipe.protocol import keys


# generations whose records stay after the one they are removed at (see the module doc): at
# most this many more generations' keys in the store, some 12 each at P = 2
KEPT_GENERATIONS = 8


@dataclass(frozen=True)
class GenerationRecords:
    """What generation `generation` may have written, as far as the coordinator knows it."""

    generation: int
    layout: Layout  # the layout whose groups formed under the generation's prefix
    early: tuple[Layout, ...] = ()  # layouts prepared ahead for it (a prefix each)
    # the layout before it, when the plan that began it re-partitioned (layers moved)
    moved_from: Layout | None = None
    handover: int = 0  # the members of its departing nodes' group (`keys.HANDOVER_GROUP`)


def boards(generation: int) -> list[str]:
    return [keys.abort_board(generation), keys.decision_board(generation),
            keys.regroup_board(generation)]


def prefixes(namespace: str, rec: GenerationRecords) -> list[str]:
    """Every prefix the generation's records are under (each ends with '/': `gen1/` is not
    a prefix of `gen10/...`)."""
    g = rec.generation
    found = [f"{keys.ROOT}/gen{g}/", keys.groups_prefix(namespace, g) + "/"]
    found += [keys.groups_prefix(keys.early_groups(namespace, layout.to_json()), g) + "/"
              for layout in rec.early]
    return list(dict.fromkeys(found))


def group_keys(prefix: str, layout: Layout) -> list[str]:
    """The rendezvous keys of `layout`'s groups formed under `prefix` (`runtime.comm`: the
    world group of the active nodes, and each stage's data-parallel group of two or more)."""
    names = keys.group_rendezvous(prefix, "world", len(layout.active_nodes))
    if layout.num_pipelines > 1:  # (a stage's group: its owner in each pipeline)
        for stage in range(layout.num_stages):
            names += keys.group_rendezvous(prefix, f"dp{stage}", layout.num_pipelines)
    return names


def named_keys(namespace: str, rec: GenerationRecords) -> list[str]:
    """The generation's keys other than its boards' slots, by name (for a store that cannot
    delete by prefix)."""
    g = rec.generation
    names = group_keys(keys.groups_prefix(namespace, g), rec.layout)
    if rec.handover:
        names += keys.group_rendezvous(keys.groups_prefix(namespace, g), keys.HANDOVER_GROUP,
                                       rec.handover)
    for layout in rec.early:
        names += group_keys(keys.groups_prefix(keys.early_groups(namespace, layout.to_json()),
                                               g), layout)
    if rec.moved_from is not None:
        nodes = sorted(rec.layout.active_nodes | rec.moved_from.active_nodes)
        names += [keys.exchanged(namespace, g, n) for n in sorted(rec.layout.active_nodes)]
        layers = keys.layers_prefix(namespace, g)
        names += [f"{layers}/{src}/{dst}" for src in nodes for dst in nodes if src != dst]
    return names


def _board_slots(store: dist.Store, board: str) -> Iterable[str]:
    index = 1
    while store.check([slot := keys.board_slot(board, index)]):
        yield slot
        index += 1


def collect(store: dist.Store, namespace: str, rec: GenerationRecords) -> int:
    """Remove generation `rec.generation`'s records from `store`; how many keys went (for
    etcd, how many it deleted)."""
    delete_under = getattr(store, "delete_under", None)
    if delete_under is not None:
        return sum(delete_under(prefix) for prefix in prefixes(namespace, rec))
    gone = 0
    for board in boards(rec.generation):
        for slot in list(_board_slots(store, board)):
            gone += bool(store.delete_key(slot))
    for name in named_keys(namespace, rec):
        gone += bool(store.delete_key(name))
    return gone
