"""Waiting on store keys for as long as a job runs.

A store's `wait` takes a deadline and raises past it: right for a peer that answers within
`cluster.timeout_s`, wrong for what comes only at the job's end or at a far-off iteration (a
training job runs for weeks; a node may be due to join one late in a trace). Such waits go
on in slices until the keys are set. A store that is gone still ends the wait at once: its
clients raise `DistNetworkError` (ours for etcd too, `spotpipe.store.etcd`), and only a
slice's timeout (`DistStoreError`) is waited past.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# long enough that a slice's end is rare (torch's client logs two lines when one ends)
SLICE = timedelta(days=1)


def wait(store: dist.Store, keys: list[str], timeout_s: float | None) -> None:
    """`store.wait` up to `timeout_s`, or without a deadline when it is None."""
    if timeout_s is None:
        wait_unbounded(store, keys)
    else:
        store.wait(keys, timedelta(seconds=timeout_s))


def wait_unbounded(store: dist.Store, keys: list[str], slice_: timedelta = SLICE) -> None:
    """Block until every key of `keys` is set, however long that takes."""
    while True:
        try:
            store.wait(keys, slice_)
            return
        except dist.DistNetworkError:
            raise  # the store is gone (not a subclass of DistStoreError today; said anyway)
        except dist.DistStoreError:
            continue  # the slice ended: wait on
