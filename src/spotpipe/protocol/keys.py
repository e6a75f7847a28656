"""Every key of the job's store, built in one place.

A key says what a record is and who may write it; spelling keys in one module means a reader
and its writer cannot drift apart, and a test can list every key the job uses. Keys are plain
strings under the store's own prefix (etcd's job namespace, or none for the launcher's
TCPStore). Keys that several jobs can share a store by (a benchmark's variants) take a
`namespace` first part; the control plane's keys live under `spotpipe/`.
"""

from __future__ import annotations

import hashlib
import json

ROOT = "spotpipe"

# the numbered mailbox: every record from a worker, shadow or agent to the coordinator
MAILBOX = f"{ROOT}/mail"
MAILBOX_COUNT = f"{MAILBOX}/count"
HEARTBEATS = f"{ROOT}/hb"
# written once at launch, read by every node to derive the job's key (not a secret)
INSTANCE = f"{ROOT}/instance"
RDZV = f"{ROOT}/rdzv"
# the elected coordinator: its agent's number, under an etcd lease that its agent keeps alive
LEADER = f"{RDZV}/leader"
# the coordinator's books, for a successor (a sealed CoordinatorState, overwritten each turn)
COORDINATOR_STATE = f"{ROOT}/coordinator/state"
# the agents' rendezvous (`spotpipe.cluster.agent`): plain records (see protocol.messages)
ARRIVALS = f"{RDZV}/arrivals"  # a counter: each agent takes the next arrival number
COORDINATOR = f"{RDZV}/coordinator"  # c10d: the elected agent's number (compare-and-set)
JOB = f"{RDZV}/job"  # the job, as the coordinating agent posted it (JobPosted)
OVER = f"{RDZV}/over"  # the job's end (JobOver)
LEFT = f"{RDZV}/left"  # a counter: agents that read the end
ALL_LEFT = f"{RDZV}/left/all"  # set by the last of them


def mailbox_slot(index: int) -> str:
    return f"{MAILBOX}/{index}"


def heartbeat(node: str) -> str:
    return f"{HEARTBEATS}/{node}"


def board_slot(board: str, index: int) -> str:
    """Slot `index` (from 1) of an append-only board: see `spotpipe.store.board`."""
    return f"{board}/{index}"


def abort_board(generation: int) -> str:
    """Aborts of a generation: any node, the coordinator or an agent declares a failure."""
    return f"{ROOT}/gen{generation}/abort"


def decision_board(generation: int) -> str:
    """The coordinator's Decision that ends a generation (the next generation's plan)."""
    return f"{ROOT}/gen{generation}/decision"


def regroup_board(generation: int) -> str:
    """Set when the layout should change at the next iteration boundary (a node joined)."""
    return f"{ROOT}/gen{generation}/regroup"


def join_board(node: str) -> str:
    """The coordinator's answers to a joining node (placed in a generation, or refused)."""
    return f"{ROOT}/join/{node}"


def join_gate(node: str) -> str:
    """The local launcher opens it when a node started early (warm) may ask to join."""
    return f"{ROOT}/join_gate/{node}"


def join_booted(node: str) -> str:
    """Set by a node started early (warm) once it waits at its gate, or by the local launcher
    when it exited before that: the job's first nodes start training after it."""
    return f"{ROOT}/join_booted/{node}"


def exchanged(namespace: str, generation: int, node: str) -> str:
    """A node's mark that its layer exchange of a re-partition is complete."""
    return f"{namespace}/gen{generation}/exchanged/{node}"


def layers_prefix(namespace: str, generation: int) -> str:
    """Layer metadata of a re-partition (`runtime.migrate.exchange_layers`)."""
    return f"{namespace}/gen{generation}/layers"


# the group, beside a generation's world group under its prefix, of the nodes that leave on a
# notice and hand their stages over, and of their receivers (`runtime.reshape`)
HANDOVER_GROUP = "handover"


def groups_prefix(namespace: str, generation: int) -> str:
    """Where a generation's process groups rendezvous (torch's PrefixStore)."""
    return f"{namespace}/gen{generation}"


def layout_digest(layout_json: dict) -> str:
    """A short name for a layout (its JSON), the same on every node and the coordinator."""
    text = json.dumps(layout_json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def early_groups(namespace: str, layout_json: dict) -> str:
    """The namespace of the groups formed ahead for a layout (`runtime.early_groups`): they
    rendezvous under `groups_prefix(early_groups(..), generation)`."""
    return f"{namespace}/early/{layout_digest(layout_json)}"


def group_rendezvous(prefix: str, group: str, size: int) -> list[str]:
    """The keys torch's gloo writes to form a group of `size` ranks under
    `PrefixStore(f"{prefix}/{group}")` (each rank's address, under its one device's index;
    read off a store after forming groups with torch 2.13: tests/test_store_collection.py)."""
    return [f"{prefix}/{group}/0/{rank}" for rank in range(size)]


def shadow_links(namespace: str, stage: int) -> str:
    return f"{namespace}/shadow/{stage}/links"


def shadow_link(namespace: str, stage: int, number: int) -> str:
    return f"{namespace}/shadow/{stage}/link/{number}"


def shadow_applied(namespace: str, stage: int, iteration: int | str) -> str:
    return f"{namespace}/shadow/{stage}/applied/{iteration}"


def shadow_groups(namespace: str, stage: int, number: int) -> str:
    return f"{namespace}/shadow/{stage}/pg{number}"


def checkpoint_next_at(namespace: str) -> str:
    return f"{namespace}/checkpoint/next_at"


def checkpoint_layout(namespace: str, stage: int) -> str:
    return f"{namespace}/checkpoint/layout/{stage}"


# the arrivals: a board (`store.board`), each agent claiming its slot with its record
ARRIVAL_BOARD = f"{RDZV}/agent"


def arrival(k: int) -> str:
    """What the `k`-th arriving agent brings (AgentArrival; ArrivalsClosed once the job ends)."""
    return board_slot(ARRIVAL_BOARD, k)


def assignment(k: int) -> str:
    """The answer to the `k`-th arrival (Assignment)."""
    return f"{RDZV}/assign/{k}"


def kill_board(node: str) -> str:
    """The coordinator's order to kill a fenced node, for its host's agent."""
    return f"{RDZV}/kill/{node}"


def journal(index: int) -> str:
    """The coordinator's `index`-th batch of run-file lines (from 1), for a successor."""
    return f"{ROOT}/coordinator/journal/{index}"


def journal_segment(index: int) -> str:
    """The `index`-th segment of the journal (from 1): records folded into one
    (`JournalSegment`)."""
    return f"{ROOT}/coordinator/journal_segment/{index}"


def resume_offer(agent: int) -> str:
    """The coordinating agent's `ResumeOffer` to agent `agent` (whose host lacks --resume)."""
    return f"{RDZV}/resume/{agent}"
