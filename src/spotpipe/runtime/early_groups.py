"""The next generation's process groups, formed while the current generation still trains.

A preemption notice says which node will leave, an iteration (and, in the clouds, 30 s to 2
min) before it goes; the coordinator's planner then knows the layout the job will take at the
boundary and says so (`protocol.Prepare`). Forming that layout's groups is most of a regroup
(a full mesh of connections among the generation's nodes: 5-40 ms among CPU workers here, and
seconds for NCCL communicators on GPUs), so the nodes form them on a thread of their own while
the iteration in flight runs, and the regroup at the boundary only takes them.

A preparation is a guess: another failure before the boundary changes the layout. Whether the
nodes take the groups is therefore the Decision's to say (`DecisionRecord.prepared`), the
same answer for every node, so that all of them meet in one set of groups: the early ones,
under a store prefix and local-link names of their own, or fresh ones formed as usual. A node
whose watcher had not yet seen the `Prepare` when the Decision says "prepared" starts forming
then (`EarlyGroups.take`), and the others wait for it there as they would in any formation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from spotpipe.plan import Layout
from spotpipe.protocol import keys
from spotpipe.store.abort import AbortSignal, PeerFailure

# Forms a generation's groups: (generation, layout, the abort that ends the formation) -> Comm
Form = Callable[[int, Layout, AbortSignal], Any]


def layout_digest(layout: Layout) -> str:
    """A short name for a layout, the same on every node (the groups' store prefix)."""
    return keys.layout_digest(layout.to_json())


class _Forming:
    """One formation on its own thread; `result` waits for it."""

    def __init__(self, generation: int, layout: Layout, form: Form,
                 abort: AbortSignal) -> None:
        """`abort`: the generation's; these groups end with it, or when cancelled alone."""
        self.generation, self.layout = generation, layout
        self.abort = abort.linked()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._comm: Any = None
        self._error: BaseException | None = None
        self._cancelled = False
        threading.Thread(target=self._run, args=(form,), name="early-groups",
                         daemon=True).start()

    def _run(self, form: Form) -> None:
        try:
            comm = form(self.generation, self.layout, self.abort)
        except BaseException as exc:  # a peer lost meanwhile, or cancelled: said at `result`
            with self._lock:
                self._error = exc
            self._done.set()
            return
        with self._lock:
            late = self._cancelled
            if not late:
                self._comm = comm
        if late:  # nobody will take them
            comm.close()
        self._done.set()

    def cancel(self, why: str) -> None:
        """Nobody will take these groups: end the formation (the members waiting on this
        node in it see their own abort or timeout) and close what formed."""
        with self._lock:
            self._cancelled = True
            comm, self._comm = self._comm, None
        self.abort.trigger(why)
        if comm is not None:
            comm.close()

    def result(self) -> Any:
        """The formed groups; PeerFailure if they could not form. Ended, like any formation,
        by the abort of the generation they are for (which triggers `self.abort`)."""
        try:
            self.abort.wait(self._done)
        except PeerFailure:  # what forms after this is nobody's
            self.cancel(self.abort.reason or "aborted")
            raise
        with self._lock:
            error, comm = self._error, self._comm
            self._comm = None
        if error is not None:
            if isinstance(error, PeerFailure):
                raise error
            raise PeerFailure(f"forming the prepared groups failed: {error}"[:300]) from error
        return comm


class EarlyGroups:
    """The formations ahead of the job, one per generation: a notice's for the next one, and
    (right after a plan that the layout can improve on) the plan after it."""

    def __init__(self, form: Form, abort_of: Callable[[int], AbortSignal]) -> None:
        """`abort_of(generation)`: that generation's abort, watched from before the node
        enters it (`runtime.generations`)."""
        self._form = form
        self._abort_of = abort_of
        self._lock = threading.Lock()
        # by generation, every layout prepared for it: one replaced by a newer preparation
        # is kept until the generation begins, since the plan may still name it (its nodes
        # may have formed it with this node already, and a second formation of the same
        # layout would be under the same store prefix and local-link names)
        self._forming: dict[int, dict[Layout, _Forming]] = {}
        # generations whose groups were taken or given up: a `Prepare` read late (a watcher
        # thread the scheduler let run only after the node moved on) must not form them again,
        # under the same store prefix as the groups in use, whose records it would read
        self._through = -1

    def start(self, generation: int, layout: Layout) -> None:
        """Form the groups of `layout` for `generation` on a thread (nothing if they are on
        their way already, or if that generation began or was given up). Another layout's
        for the same generation goes on until the generation begins: `take` keeps the one
        its plan names and cancels the others."""
        with self._lock:
            if generation <= self._through:
                return
        self._ensure(generation, layout)

    def _ensure(self, generation: int, layout: Layout) -> None:
        abort = self._abort_of(generation)  # (its owner's lock is never taken under ours)
        with self._lock:
            ours = self._forming.setdefault(generation, {})
            if layout not in ours:
                ours[layout] = _Forming(generation, layout, self._form, abort)

    def take(self, generation: int, layout: Layout) -> Any:
        """The groups of `layout` for `generation`: formed, still forming (waited for), or
        started now. PeerFailure if they cannot form. Older preparations, and the other
        layouts prepared for this generation, are dropped."""
        self._ensure(generation, layout)
        with self._lock:
            forming = self._forming[generation].pop(layout)
        self.discard(f"generation {generation} began", generation)
        return forming.result()

    def discard(self, why: str, through: int) -> None:
        """A plan did not take the prepared groups: end and close the preparations for
        `through` and before, and form none for them any more.

        Later ones stay: the coordinator prepares generation n only once the plan for n - 1
        is decided, from that plan's layout, so the groups are right whether or not that plan
        took groups formed ahead. And the nodes may have started them already (a generation's
        boards are watched before it begins): a node that cancelled them here while its peers
        formed them with the cancelled formation's abandoned thread would form them again under
        the same store prefix at `take`, and wait there for peers that are done."""
        with self._lock:
            self._through = max(self._through, through)
            gone = [f for g, ours in self._forming.items() if g <= through
                    for f in ours.values()]
            self._forming = {g: ours for g, ours in self._forming.items() if g > through}
        for forming in gone:
            forming.cancel(why)

    @property
    def pending(self) -> dict[int, tuple[Layout, ...]]:
        """The layouts of the formations under way or done and not taken, by generation (in
        the order they were prepared)."""
        with self._lock:
            return {g: tuple(ours) for g, ours in self._forming.items() if ours}
