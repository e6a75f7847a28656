"""Waits that last as long as the job: past any number of slices' timeouts, but never past a
store that is gone."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from spotpipe.store.waiting import wait_unbounded


class SlowStore:
    """A store whose key is set only after `slices` waits have timed out (or which is lost)."""

    def __init__(self, slices: int, lost: bool = False) -> None:
        self.slices, self.lost, self.waits = slices, lost, []

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.waits.append((tuple(keys), timeout))
        if self.lost:
            raise dist.DistNetworkError("connection refused")
        if len(self.waits) <= self.slices:
            raise dist.DistStoreError("wait timeout")


def test_a_wait_goes_on_past_its_slices_until_the_key_is_set():
    store = SlowStore(slices=3)
    wait_unbounded(store, ["over"], timedelta(seconds=5))  # type: ignore[arg-type]
    assert store.waits == [(("over",), timedelta(seconds=5))] * 4


def test_a_lost_store_ends_the_wait_at_once():
    store = SlowStore(slices=3, lost=True)
    with pytest.raises(dist.DistNetworkError, match="connection refused"):
        wait_unbounded(store, ["over"])  # type: ignore[arg-type]
    assert len(store.waits) == 1


def test_a_real_store_returns_once_the_key_is_set_and_times_out_in_slices():
    store = dist.HashStore()
    store.set("over", "1")
    wait_unbounded(store, ["over"], timedelta(milliseconds=50))
    with pytest.raises(dist.DistStoreError):  # (what a slice's end raises: the one retried)
        store.wait(["never"], timedelta(milliseconds=50))
