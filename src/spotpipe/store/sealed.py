"""A store whose values carry a MAC under the job's key, for the records that are not protocol
messages: torch's own rendezvous of process groups (gloo's and NCCL's), a re-partition's layer
metadata, the shadow links and marks, a checkpoint scheme's agreed cadence and peer layouts,
and stage files carried through the store.

Why: gloo publishes each rank's listening address in the store and connects to whatever
address it reads there. Anyone who could write to the store could otherwise put an address of
their own there and sit between two nodes, receiving and sending the job's tensors; a forged
layer metadata or cadence record could resize a transfer or move a checkpoint. Protocol
messages have their sealed JSON envelope (`protocol.auth`); these values are opaque bytes that
torch writes and reads itself, so they get a binary seal: a tag, the HMAC-SHA256 of the full
key and the value, then the value. Binding the key makes a sealed value worthless under any
other key (another rank's, another generation's). A value replayed under its own key is the
one genuine value it already held.

Reading, a value that does not verify is refused (`Refused`, with a `record_refused` event
where the caller passes `on_refused`). For a rendezvous (`wait_genuine_s`), `get` then waits
for the genuine value instead: a value squatted ahead of its writer is overwritten when the
writer comes. Someone who overwrites a value after its writer can still deny service (as anyone
who can write to the store can, by deleting keys); they cannot steer the job.

Counters (`add`) are not values: they pass through unsealed, and callers treat what they count
as a hint, never as data. `compare_set` is refused: nothing sealed uses it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from spotpipe.protocol.auth import Refused

TAG = b"spotpipe-seal/1\x00"
_MAC = hashlib.sha256().digest_size


def _mac(job_key: bytes, key: str, value: bytes) -> bytes:
    name = key.encode()
    return hmac.new(job_key, b"%d:" % len(name) + name + value, hashlib.sha256).digest()


def seal_value(job_key: bytes, key: str, value: str | bytes) -> bytes:
    """`value` as it is stored under `key` (its full name in the store)."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return TAG + _mac(job_key, key, raw) + raw


def open_value(job_key: bytes, key: str, blob: bytes) -> bytes:
    """The value a sealed blob holds; Refused (naming the key) if it was not sealed under
    `key` with the job's key."""
    if not blob.startswith(TAG) or len(blob) < len(TAG) + _MAC:
        raise Refused(f"{key}: no seal (written without the job's key)")
    mac, raw = blob[len(TAG):len(TAG) + _MAC], blob[len(TAG) + _MAC:]
    if not hmac.compare_digest(mac, _mac(job_key, key, raw)):
        raise Refused(f"{key}: bad seal (not written with this job's key, or for another key)")
    return raw


class SealedStore(dist.Store):
    """`inner` with every value sealed on `set` and checked on `get`.

    A Python subclass of `torch.distributed.Store`: ProcessGroupGloo, ProcessGroupNCCL and
    PrefixStore take it like any store, as long as the object stays referenced while they use
    it. Put PrefixStores outside it (`PrefixStore(p, SealedStore(conn, key))`), so that the
    MAC binds the full key."""

    def __init__(self, inner: dist.Store, job_key: bytes, *,
                 wait_genuine_s: float | None = None,
                 on_refused: Callable[[Refused], None] | None = None,
                 poll_s: float = 0.002, max_poll_s: float = 0.1) -> None:
        super().__init__()  # the pybind trampoline needs it
        if not job_key:
            raise ValueError("a sealed store needs the job's key")
        self.inner = inner
        self.set_timeout(inner.timeout)
        self._key = job_key
        self.wait_genuine_s = wait_genuine_s
        self.on_refused = on_refused
        self.poll_s, self.max_poll_s = poll_s, max_poll_s

    def rendezvous(self, wait_genuine_s: float) -> "SealedStore":
        """The same store, for keys whose writer may come after a squatter (`get` waits up to
        `wait_genuine_s` for the genuine value)."""
        return SealedStore(self.inner, self._key, wait_genuine_s=wait_genuine_s,
                           on_refused=self.on_refused, poll_s=self.poll_s,
                           max_poll_s=self.max_poll_s)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, seal_value(self._key, key, value))

    def get(self, key: str) -> bytes:
        blob = bytes(self.inner.get(key))
        try:
            return open_value(self._key, key, blob)
        except Refused as why:
            self._refused(why)
            if self.wait_genuine_s is None:
                raise
        # a rendezvous: the writer may not have come yet, and overwrites the squatter when it
        # does. The store has no "wait for a change", hence the polling, bounded like gloo's
        # own wait for the key. The interval doubles up to `max_poll_s`: a writer that comes
        # at once is seen within milliseconds, and a squatter that stands costs the store a
        # few requests a second per reader, not hundreds
        deadline = time.monotonic() + self.wait_genuine_s
        interval = self.poll_s
        while time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(2 * interval, self.max_poll_s)
            again = bytes(self.inner.get(key))
            if again == blob:
                continue
            blob = again
            try:
                return open_value(self._key, key, blob)
            except Refused as why:
                self._refused(why)
        raise Refused(f"{key}: no genuine value within {self.wait_genuine_s:g} s (a value "
                      "that does not verify stands there)")

    def _refused(self, why: Refused) -> None:
        if self.on_refused is not None:
            self.on_refused(why)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        raise NotImplementedError(f"{key}: compare_set on a sealed store (nothing sealed uses "
                                  "it; its expected value could not be checked)")
