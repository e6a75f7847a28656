"""A node's groups of each generation, and the watchers of the generation's boards.

A generation begins with its process groups (formed now, or taken from those formed ahead of
it, `runtime.early_groups`) and two watchers, each on a store connection of its own: the
abort board's, whose record ends every wait of the generation, and the regroup board's, whose
`Regroup` asks for a change at the next iteration boundary and whose `Prepare` names the next
generation's layout early. The Worker decides when a generation begins and with which layout;
this module is how.

The watchers of a generation start while the one before it trains, and connect on their own
threads: a regroup then opens no store connection on its path (a new one can take seconds:
see `store.watchers.SpareConnections`), and a node hears its generation's abort from the
moment it enters it. A node that waited in a connection there could not hear that a peer was
lost meanwhile, nor report, and was fenced as hung (seen as a peer that never reported after
a loss in the transfers of a re-partition whose groups were formed ahead).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotpipe.plan import Layout
from spotpipe.protocol import Channel, Prepare, Refused, Regroup, keys
from spotpipe.runtime.comm import Comm
from spotpipe.runtime.early_groups import EarlyGroups
from spotpipe.store.abort import AbortSignal
from spotpipe.store.watchers import BoardWatcher, SpareConnections, watch_abort

# Forms the groups of a layout: (generation, layout, the abort that ends the formation, the
# store namespace of their rendezvous and local links) -> Comm
Form = Callable[[int, Layout, AbortSignal, str], Comm]


@dataclass
class _Boards:
    """One generation's abort (what its watcher triggers) and the watchers of its boards."""

    generation: int
    abort: AbortSignal
    regroup: threading.Event  # set by the generation's `Regroup`
    watchers: list[BoardWatcher]

    def close(self) -> None:
        for watcher in self.watchers:  # (they end with their generation's boards)
            watcher.close()


class GenerationGroups:
    """The groups of this node's current generation (`comm`), its regroup request
    (`regroup`), and the groups formed ahead for the next ones (`early`)."""

    def __init__(self, *, node: str, protocol: Channel, spares: SpareConnections,
                 namespace: str, form: Form, coordinator: str,
                 refused: Callable[[Refused], None]) -> None:
        """`coordinator`: the writer name whose regroup records count."""
        self.node, self.protocol, self.spares = node, protocol, spares
        self.namespace, self._form = namespace, form
        self.coordinator, self._refused = coordinator, refused
        # under a store prefix of their own per layout: a preparation replaced by another for
        # the same generation leaves rendezvous records that the other must not read
        self.early = EarlyGroups(lambda g, layout, abort: form(
            g, layout, abort, keys.early_groups(namespace, layout.to_json())), self.abort_of)
        self.regroup = threading.Event()  # the layout changes at the next boundary
        self.comm: Comm | None = None
        self._lock = threading.Lock()
        self._boards: dict[int, _Boards] = {}  # the current generation's and those ahead

    def abort_of(self, generation: int) -> AbortSignal:
        """`generation`'s abort, watched from now on if it was not yet."""
        return self._watched(generation).abort

    def _watched(self, generation: int) -> _Boards:
        with self._lock:
            boards = self._boards.get(generation)
            if boards is None:
                boards = self._boards[generation] = self._watch(generation)
            return boards

    def _watch(self, generation: int) -> _Boards:
        abort, regroup = AbortSignal(), threading.Event()
        # each connects on its thread (`SpareConnections.take`), and its connection comes back
        # when its board closes, for a later generation
        watchers = [
            watch_abort(self.spares.take, self.protocol, generation, abort, self._refused,
                        done=self.spares.give_back),
            BoardWatcher(self.spares.take, self.protocol, keys.regroup_board(generation),
                         (Regroup, Prepare),
                         lambda message: self._on_regroup_board(message, generation, regroup),
                         self._refused, done=self.spares.give_back,
                         writers={self.coordinator}, on_lost=abort.trigger)]
        return _Boards(generation, abort, regroup, watchers)

    def open(self, generation: int, layout: Layout, prepared: bool = False) -> Comm:
        """Begin `generation`: its groups among `layout`'s active nodes, the ones formed ahead
        for it when the Decision says `prepared`, and the watch of the next generation's
        boards. The last generation's groups are closed first. PeerFailure if the groups
        cannot form."""
        boards = self._watched(generation)  # (watched since the last generation began)
        with self._lock:
            gone = [self._boards.pop(g) for g in sorted(self._boards) if g < generation]
        for old in gone:
            old.close()
        self.regroup = boards.regroup
        self._watched(generation + 1)
        if self.comm is not None:  # the last generation's (or a plan's that failed)
            self.comm.close()
            self.comm = None
        self.comm = (self.early.take(generation, layout) if prepared
                     else self._form(generation, layout, boards.abort, self.namespace))
        return self.comm

    def close(self) -> None:
        """The node is done: end what was formed ahead, and stop watching every board."""
        self.early.discard("the node is done", 2 ** 62)
        with self._lock:
            gone, self._boards = list(self._boards.values()), {}
        for boards in gone:
            boards.close()

    def prepare(self, prepare: Prepare) -> None:
        """Start forming the groups a `Prepare` names, if this node is in its layout."""
        try:
            layout = Layout.from_json(prepare.layout)
        except (KeyError, TypeError, ValueError) as exc:
            self._refused(Refused(f"a preparation that does not parse: {exc}",
                                  self.coordinator))
            return
        if self.node in layout.active_nodes:
            self.early.start(prepare.generation + 1, layout)

    def _on_regroup_board(self, message: Any, generation: int,
                          regroup: threading.Event) -> bool:
        """A record of `generation`'s regroup board: a `Regroup` ends the generation at the
        next boundary; a `Prepare` starts forming the next generation's groups while this one
        trains, in place of any prepared before it. The watch reads on to the generation's
        last record (`Regroup.ended`): an event after the first `Regroup`, a second joiner
        say, prepares again."""
        if isinstance(message, Prepare):
            if message.generation == generation:
                self.prepare(message)
            return True
        regroup.set()
        return not message.ended
