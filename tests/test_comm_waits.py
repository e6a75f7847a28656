"""The sends of an iteration complete in one hand-off to the waiter's thread (counted), and a
send that fails still ends the wait with PeerFailure and the generation's abort."""

from __future__ import annotations

import pytest
import torch

from spotpipe.runtime.comm import Comm, PeerFailure, Waiter
from spotpipe.store.abort import AbortSignal


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.error, self.waited = error, 0

    def wait(self) -> bool:
        self.waited += 1
        if self.error:
            raise RuntimeError(self.error)
        return True


def _comm(works: list[_Work]) -> Comm:
    comm = object.__new__(Comm)  # only the waits: no process groups are needed for them
    comm.abort = AbortSignal()
    comm.waiter = Waiter(comm.abort)
    comm._pending = [(w, torch.zeros(1)) for w in works]
    return comm


def test_wait_sends_is_one_handoff_for_all_sends():
    works = [_Work() for _ in range(8)]
    comm = _comm(works)
    comm.wait_sends()
    assert [w.waited for w in works] == [1] * 8
    assert comm.waiter.handoffs == 1  # was 8: one per send
    comm.wait_sends()  # nothing pending: no hand-off at all
    assert comm.waiter.handoffs == 1
    comm.waiter.stop()


def test_a_failed_send_aborts_the_generation():
    works = [_Work(), _Work("Connection closed by peer"), _Work()]
    comm = _comm(works)
    with pytest.raises(PeerFailure, match="communication failed: Connection closed by peer"):
        comm.wait_sends()
    assert comm.abort.is_set
    assert works[2].waited == 0  # the rest are not waited on a broken generation
    comm.waiter.stop()
