"""A node's groups of each generation, and the watchers of the generation's boards.

A generation begins with its process groups (formed now, or taken from those formed ahead of
it, `runtime.early_groups`) and two watchers, each on a store connection of its own: the
abort board's, whose record ends every wait of the generation, and the regroup board's, whose
`Regroup` asks for a change at the next iteration boundary and whose `Prepare` names the next
generation's layout early. The Worker decides when a generation begins and with which layout;
this module is how.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from spotpipe.plan import Layout
from spotpipe.protocol import Channel, Prepare, Refused, Regroup, keys
from spotpipe.runtime.comm import Comm
from spotpipe.runtime.early_groups import EarlyGroups, layout_digest
from spotpipe.store.abort import AbortSignal
from spotpipe.store.watchers import BoardWatcher, SpareConnections, watch_abort

# Forms the groups of a layout: (generation, layout, the abort that ends the formation, the
# store namespace of their rendezvous and local links) -> Comm
Form = Callable[[int, Layout, AbortSignal, str], Comm]


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
            g, layout, abort, f"{namespace}/early/{layout_digest(layout)}"))
        self.regroup = threading.Event()  # the layout changes at the next boundary
        self.comm: Comm | None = None
        self._watchers: list[BoardWatcher] = []

    def open(self, generation: int, layout: Layout, prepared: bool = False) -> Comm:
        """Begin `generation`: its watchers, then its groups among `layout`'s active nodes,
        the ones formed ahead for it when the Decision says `prepared`. The last generation's
        groups are closed first. PeerFailure if the groups cannot form."""
        for watcher in self._watchers:  # (they end with their generation's boards)
            watcher.close()
        abort = self.early.abort_for(generation, layout) if prepared else AbortSignal()
        self.regroup = threading.Event()
        # their connections come back when the generation's boards close, for the next one
        self._watchers = [
            watch_abort(self.spares.take(), self.protocol, generation, abort, self._refused,
                        done=self.spares.give_back),
            BoardWatcher(self.spares.take(), self.protocol, keys.regroup_board(generation),
                         (Regroup, Prepare),
                         lambda message: self._on_regroup_board(message, generation),
                         self._refused, done=self.spares.give_back,
                         writers={self.coordinator})]
        if self.comm is not None:  # the last generation's (or a plan's that failed)
            self.comm.close()
            self.comm = None
        self.comm = (self.early.take(generation, layout) if prepared
                     else self._form(generation, layout, abort, self.namespace))
        return self.comm

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

    def _on_regroup_board(self, message: Any, generation: int) -> bool:
        """A record of `generation`'s regroup board: a `Regroup` ends the generation at the
        next boundary (and the watch); a `Prepare` starts forming the next generation's
        groups while this one trains (and the watch goes on)."""
        if isinstance(message, Prepare):
            if message.generation == generation:
                self.prepare(message)
            return True
        self.regroup.set()
        return False
