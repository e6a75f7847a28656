"""What a worker's main thread does between instructions, for the hang watch.

While the executor runs instructions its own stamps say where the main thread computes and
since when (`runtime.stall`). Between them, while the node carries out a Decision (finishing
the committed step, promoting a replica, building stages, moving states, relinking shadows)
nothing said so: the node counted as waiting, so a main thread stopped there (a deadlock in a
load, a copy that never returns) was never judged hung, and its peers waited for it in the
group formation or a transfer until `cluster.timeout_s` (minutes), the whole job with them.

So the worker names each step it takes there, and every wait of its main thread on something
outside it (a peer, the store, a shadow) is marked. A step that computes with no wait open
for the hang timeout is a hang, judged as an instruction's is: by the node's own watch and by
the coordinator from its beats, and the node is fenced; its peers' waits end with the
generation's abort, and the job decides again without it. A wait is never judged here: a
peer that does not come is the peer's hang or death, found on the peer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class Activity:
    """The main thread's current step between instructions ("" while it runs them), and since
    when it has computed in it without waiting.

    Written by the main thread only, read by the heartbeat's thread. Waits marked from other
    threads (the groups formed ahead for a coming generation run the same waiter code on a
    thread of their own) are not the main thread's and are not counted."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.step = ""
        self.generation = 0  # the generation the step works towards (its stall's)
        self.since = clock()
        self._waits = 0
        self._owner = threading.get_ident()

    def begin(self, step: str, generation: int) -> None:
        """The main thread starts `step`, towards `generation` (a new step is progress: its
        clock starts again)."""
        self.since = self.clock()
        self.generation = generation
        self.step = step

    def end(self) -> None:
        """Back to instructions (or done): the executor's stamps speak again."""
        self.step = ""

    @property
    def busy(self) -> bool:
        """In a step, computing: no wait open."""
        return bool(self.step) and self._waits == 0

    def wait_began(self) -> None:
        if threading.get_ident() == self._owner:
            self._waits += 1

    def wait_ended(self) -> None:
        if threading.get_ident() == self._owner:
            # the stamp before the count drops: a reader never sees an old `since` with no
            # wait open
            self.since = self.clock()
            self._waits -= 1

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark a wait on something outside the main thread."""
        self.wait_began()
        try:
            yield
        finally:
            self.wait_ended()
