"""A c10d Store on etcd's v3 API, for jobs whose nodes are on several hosts.

Why not torch's own `torch.distributed.elastic.rendezvous.etcd_store.EtcdStore`: it speaks
etcd's v2 API through python-etcd (unmaintained since 2017; v2 is off by default in etcd 3.4
and removed in 3.6), reads the job's whole key directory on every `get`/`wait` (the mailbox and
the per-generation process groups write thousands of keys), has no `delete_key` (the mailbox
deletes what it has read) nor `compare_set` (the agents elect their coordinator with it), and
gives up on the first connection error. This store is a Python subclass of
`torch.distributed.Store` (which ProcessGroupGloo, ProcessGroupNCCL and PrefixStore accept like
any C++ store, as long as the Python object stays referenced while they use it) over etcd3gw, the maintained client of etcd's v3 HTTP gateway (OpenStack).

Every key lives under the job's prefix, so several jobs share one etcd. Blocking waits use etcd
watches (no polling). On a connection error (etcd restarting, a leader change) every call
retries with backoff until a bounded deadline (`reconnect_s`), then raises; etcd keeps its data
directory, so a restarted server has every key, and a watch resumes from the revision it saw.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import requests
import torch.distributed as dist
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from spotpipe.store.fenced import NotLeader
from spotpipe.store.tls import EtcdTLS, speaks_tls, tls_problem

T = TypeVar("T")

# Errors that mean "etcd is not reachable right now", worth retrying until the deadline.
_RETRYABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
              etcd_errors.InternalServerError, requests.exceptions.ConnectionError,
              requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError)

_WATCH_SLICE_S = 10.0  # a long wait re-checks its keys this often (covers a lost watch)


def _cause(exc: BaseException) -> str:
    """The innermost error under `exc` (etcd3gw's own carry no text), as `Type: text`."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return f"{type(exc).__name__}" + (f": {str(exc)[:300]}" if str(exc) else "")


class EtcdStoreError(dist.DistNetworkError):
    """etcd stayed unreachable past the reconnect deadline, or answered nonsense. The error a
    TCPStore client raises when its server is gone (`torch.distributed.DistNetworkError`, not
    a wait's timeout), so that code that outlives a lost store catches one kind for both."""


class JobGone(EtcdStoreError):
    """A write refused because the key it was made under (`while_present`) is gone: the job
    ended and its keys were deleted (a host cut off until then comes back to an empty
    namespace). To its process, as good as a store that is gone."""


class EtcdStore(dist.Store):
    def __init__(self, host: str, port: int, prefix: str, *, timeout: timedelta,
                 reconnect_s: float | None = None, tls: EtcdTLS | None = None,
                 while_present: str = "") -> None:
        """`while_present`: a key (the job's record) without which this client writes nothing,
        each write checking it in the same transaction (JobGone): a process of a job that
        ended while it was cut off must not put the job's keys back once it reaches etcd
        again (its last heartbeat, its agent's report of its exit)."""
        super().__init__()  # the pybind trampoline needs it
        self.host, self.port, self.tls = host, port, tls
        self.prefix = prefix.rstrip("/") + "/"
        self.set_timeout(timeout)
        self.reconnect_s = timeout.total_seconds() if reconnect_s is None else reconnect_s
        # a requests.Session per thread: sessions are not thread-safe, and gloo, heartbeat and
        # watcher threads may share one store object
        self._local = threading.local()
        # (key, value) that every write of this client requires (value None: that the key
        # exists), and who hears a refusal
        self._guard: tuple[bytes, bytes | None] | None = (
            (self._key(while_present), None) if while_present else None)
        self._on_refused: Callable[[], None] = lambda: None

    def guarded(self, key: str, holds: str | bytes,
                on_refused: Callable[[], None] = lambda: None) -> "EtcdStore":
        """A client of the same store each of whose writes (`set`, `compare_set`, `add`,
        `multi_set`, `delete_key`) is made only while `key` holds `holds`, in the same
        transaction: a refused one raises NotLeader after calling `on_refused`. The
        coordinator's writes go through one, so that a coordinator deposed while cut off
        writes nothing once it is back (a plan, an answer to an arrival, the job's end)."""
        other = EtcdStore(self.host, self.port, self.prefix, timeout=self.timeout,
                          reconnect_s=self.reconnect_s, tls=self.tls)
        other._guard = (self._key(key), holds.encode() if isinstance(holds, str) else holds)
        other._on_refused = on_refused
        return other

    def _guards(self) -> list[dict[str, Any]]:
        if self._guard is None:
            return []
        key, holds = self._guard
        if holds is None:
            return [{"key": _encode(key), "target": "CREATE", "result": "GREATER",
                     "create_revision": 0}]
        return [{"key": _encode(key), "target": "VALUE", "result": "EQUAL",
                 "value": _encode(holds)}]

    def _guard_read(self) -> list[dict[str, Any]]:
        return [] if self._guard is None else [{"request_range": {"key": _encode(self._guard[0])}}]

    def _refused_unless_guard_held(self, reply: dict[str, Any], at: int) -> None:
        """A failed transaction's reply, whose response `at` reads the guard's key: raise
        NotLeader (JobGone for `while_present`) when the guard no longer holds (rather than
        the compare of the write)."""
        if self._guard is None:
            return
        key, holds = self._guard
        kvs = reply.get("responses", [])[at].get("response_range", {}).get("kvs", [])
        if holds is None and not kvs:
            raise JobGone(f"{key.decode(errors='replace')} is gone from etcd (the job ended and "
                          "its keys were deleted): the write was refused")
        if holds is not None and (not kvs or _decode(kvs[0].get("value", "")) != holds):
            self._on_refused()
            raise NotLeader(f"{key.decode(errors='replace')} no longer holds "
                            f"{holds.decode(errors='replace')!r}: the write was refused")

    def _put_guarded(self, what: str, success: list[dict[str, Any]]) -> dict[str, Any]:
        """`success` in one transaction, under the guard if there is one."""
        reply = self._retry(what, lambda: self._txn({
            "compare": self._guards(), "success": success, "failure": self._guard_read()}))
        if not reply.get("succeeded"):  # (the gateway leaves a false out)
            self._refused_unless_guard_held(reply, 0)
        return reply

    # ------------------------------------------------------------------ plumbing

    def _client(self) -> Etcd3Client:
        client = getattr(self._local, "client", None)
        if client is None:
            # api_path fixed: etcd >= 3.4 serves /v3/, and discovery would cost a request
            client = Etcd3Client(host=self.host, port=self.port, timeout=30, api_path="/v3/",
                                 **(self.tls.client_args() if self.tls else {}))
            self._local.client = client
        return client

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix.encode() + (key if isinstance(key, bytes) else key.encode())

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """Run `call`, retrying connection errors with backoff until the reconnect deadline."""
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.05
        while True:
            try:
                return call()
            except _RETRYABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise EtcdStoreError(
                        f"etcd at {self.host}:{self.port} unreachable for {self.reconnect_s:.0f}"
                        f" s ({what}): {_cause(exc)}{tls_problem(exc, self.tls)}") from None
                self._local.client = None  # a fresh connection after the server came back
                time.sleep(delay)  # backoff between reconnection attempts, not a sync point
                delay = min(delay * 2, 1.0)

    def _txn(self, txn: dict[str, Any]) -> dict[str, Any]:
        return self._client().transaction(txn)

    def _range(self, keys: Sequence[bytes]) -> tuple[int, dict[bytes, bytes]]:
        """The store's revision and the values of those of `keys` that exist (one request)."""
        reply = self._retry("get", lambda: self._txn({"compare": [], "success": [
            {"request_range": {"key": _encode(k)}} for k in keys], "failure": []}))
        found: dict[bytes, bytes] = {}
        for response in reply.get("responses", []):
            for kv in response.get("response_range", {}).get("kvs", []):
                found[_decode(kv["key"])] = _decode(kv.get("value", ""))
        return int(reply["header"]["revision"]), found

    # ------------------------------------------------------------------ c10d Store

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        if self._guard is not None:
            self._put_guarded("set", [{"request_put": {"key": _encode(self._key(key)),
                                                       "value": _encode(data)}}])
            return
        self._retry("set", lambda: self._client().put(self._key(key), data))

    def get(self, key: str) -> bytes:
        k = self._key(key)
        _, found = self._range([k])
        if k not in found:
            self._wait([k], self.timeout)
            _, found = self._range([k])
        return found[k]

    def check(self, keys: list[str]) -> bool:
        wanted = [self._key(k) for k in keys]
        _, found = self._range(wanted)
        return all(k in found for k in wanted)

    def delete_key(self, key: str) -> bool:
        k = self._key(key)
        if self._guard is not None:
            reply = self._put_guarded("delete", [{"request_delete_range": {"key": _encode(k)}}])
            deleted = reply["responses"][0].get("response_delete_range", {})
            return int(deleted.get("deleted", 0)) > 0
        reply = self._retry("delete", lambda: self._client().post(
            self._client().get_url("/kv/deleterange"), json={"key": _encode(k)}))
        return int(reply.get("deleted", 0)) > 0

    def delete_keys(self, keys: list[str]) -> None:
        """Delete `keys` in one transaction (under the guard if there is one): the mailbox's
        old read slots, a few a turn (`mailbox.ReadSlots`)."""
        self._put_guarded("delete_keys", [{"request_delete_range": {"key": _encode(self._key(k))}}
                                          for k in keys])

    def num_keys(self) -> int:
        start = self.prefix.encode()
        reply = self._retry("num_keys", lambda: self._client().post(
            self._client().get_url("/kv/range"),
            json={"key": _encode(start), "range_end": _encode(_increment_last_byte(start)),
                  "count_only": True}))
        return int(reply.get("count", 0))

    def add(self, key: str, amount: int) -> int:
        """Atomic increment (etcd has none): compare-and-swap on the key's mod revision.

        The swap also writes a receipt under a fresh id, so that a retry after a lost reply
        (etcd restarting between commit and answer) returns the committed result instead of
        adding twice: a doubled count would leave a hole in the mailbox's numbering.
        """
        k = self._key(key)
        if amount == 0:  # a read (the mailbox asks for the count this way): no swap needed
            _, found = self._range([k])
            return int(found.get(k) or 0)
        receipt = self._key(f"__receipts/{uuid.uuid4().hex}")
        tried = False

        def attempt() -> int | None:
            nonlocal tried
            if tried:  # a retry: the previous attempt may have committed before failing
                _, done = self._range([receipt])
                if receipt in done:
                    return int(done[receipt])
            tried = True
            reply = self._client().get(k, metadata=True)
            if reply:
                value, meta = reply[0]
                current, compare = int(value or 0), {"target": "MOD", "result": "EQUAL",
                                                     "mod_revision": meta["mod_revision"]}
            else:
                current, compare = 0, {"target": "CREATE", "result": "EQUAL",
                                       "create_revision": 0}
            new = str(current + amount)
            result = self._txn({"compare": [{"key": _encode(k), **compare}, *self._guards()],
                                "success": [
                {"request_put": {"key": _encode(k), "value": _encode(new)}},
                {"request_put": {"key": _encode(receipt), "value": _encode(new)}}],
                "failure": self._guard_read()})
            if not result.get("succeeded"):
                self._refused_unless_guard_held(result, 0)
            return int(new) if result.get("succeeded") else None

        while True:
            value = self._retry("add", attempt)
            if value is not None:
                self._retry("add", lambda: self._client().delete(receipt))
                return value

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """c10d semantics: set to `desired_value` if the key holds `expected_value` (or is
        missing and `expected_value` is empty); return the value the key holds afterwards
        (TCPStore returns `expected_value` for a missing key with a non-empty expectation)."""
        k = self._key(key)
        expected = expected_value.encode() if isinstance(expected_value, str) else expected_value
        desired = desired_value.encode() if isinstance(desired_value, str) else desired_value
        if expected:
            compare = {"target": "VALUE", "result": "EQUAL", "value": _encode(expected)}
        else:
            compare = {"target": "CREATE", "result": "EQUAL", "create_revision": 0}
        reply = self._retry("compare_set", lambda: self._txn({
            "compare": [{"key": _encode(k), **compare}, *self._guards()],
            "success": [{"request_put": {"key": _encode(k), "value": _encode(desired)}}],
            "failure": [{"request_range": {"key": _encode(k)}}, *self._guard_read()]}))
        if reply.get("succeeded"):
            return desired
        self._refused_unless_guard_held(reply, 1)
        kvs = reply["responses"][0].get("response_range", {}).get("kvs", [])
        return _decode(kvs[0].get("value", "")) if kvs else expected

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wanted = [self._key(k) for k in keys]
        _, found = self._range(wanted)
        if not all(k in found for k in wanted):
            self._wait(wanted, self.timeout)
            _, found = self._range(wanted)
        return [found[k] for k in wanted]

    def multi_set_if(self, guard: str, holds: str | bytes, keys: list[str],
                     values: list[str | bytes]) -> bool:
        """`multi_set` in one transaction only while key `guard` holds `holds` (a leader
        writing its books only while it still holds the office); whether it was written."""
        expected = holds.encode() if isinstance(holds, str) else holds
        reply = self._retry("multi_set_if", lambda: self._txn({
            "compare": [{"key": _encode(self._key(guard)), "target": "VALUE",
                         "result": "EQUAL", "value": _encode(expected)}],
            "success": [{"request_put": {"key": _encode(self._key(k)), "value": _encode(v)}}
                        for k, v in zip(keys, values)], "failure": []}))
        return bool(reply.get("succeeded"))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._put_guarded("multi_set", [
            {"request_put": {"key": _encode(self._key(k)), "value": _encode(v)}}
            for k, v in zip(keys, values)])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait([self._key(k) for k in keys], timeout or self.timeout)

    # ------------------------------------------------------------------ waiting

    def _wait(self, keys: list[bytes], timeout: timedelta) -> None:
        """Block until every key exists: check, then watch the first missing key from the
        revision the check saw (so nothing written in between is missed), and check again."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            revision, found = self._range(keys)
            missing = [k for k in keys if k not in found]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"etcd store: timed out after {timeout.total_seconds():.1f} s waiting for "
                    f"{', '.join(m.decode(errors='replace') for m in missing)}")
            try:
                self._watch_once(missing[0], revision + 1, min(remaining, _WATCH_SLICE_S))
            except _RETRYABLE:
                # the stream broke (etcd restarting): the next _range retries until it is
                # back or the reconnect deadline passes
                continue

    def _watch_once(self, key: bytes, start_revision: int, limit_s: float,
                    range_end: bytes | None = None) -> None:
        """Return at the first change of `key` (or of any key up to `range_end`) at or after
        `start_revision`, or after about `limit_s` seconds without one (a read timeout on the
        event stream)."""
        client = self._client()
        body = {"create_request": {"key": _encode(key), "start_revision": start_revision,
                                   **({"range_end": _encode(range_end)} if range_end else {})}}
        with client.session.post(client.get_url("/watch"), json=body, stream=True,
                                 timeout=(5, max(0.05, limit_s))) as reply:
            if reply.status_code != 200:
                raise EtcdStoreError(f"etcd watch refused: {reply.status_code} {reply.text}")
            try:
                for line in reply.iter_lines(chunk_size=None):
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("events") or result.get("canceled"):
                        return
            except requests.exceptions.ConnectionError as exc:
                # requests reports a read timeout on a stream as a ConnectionError whose
                # cause is urllib3's ReadTimeoutError: the slice is over, nothing happened
                if "timed out" in str(exc).lower():
                    return
                raise

    def wait_until(self, keys: list[str], done: Callable[[dict[str, bytes]], bool],
                   timeout_s: float) -> dict[str, bytes] | None:
        """Block until `done(values)` holds for the values of those of `keys` that exist (a
        key deleted counts as a change too, which `wait` cannot see); the values then, or
        None after `timeout_s`. Watches the key range that spans `keys` (no polling)."""
        wanted = {self._key(k): k for k in keys}
        low = min(wanted)
        high = _increment_last_byte(max(wanted))
        deadline = time.monotonic() + timeout_s
        while True:
            revision, found = self._range(list(wanted))
            values = {wanted[k]: v for k, v in found.items()}
            if done(values):
                return values
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._watch_once(low, revision + 1, min(remaining, _WATCH_SLICE_S), high)
            except _RETRYABLE:
                continue

    # ------------------------------------------------------------------ leases (election)

    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        reply = self._retry("lease grant", lambda: self._client().post(
            self._client().get_url("/lease/grant"), json={"TTL": int(ttl_s), "ID": 0}))
        return int(reply["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew the lease; False when it has expired already (its keys are gone)."""
        reply = self._retry("lease keep-alive", lambda: self._client().post(
            self._client().get_url("/lease/keepalive"), json={"ID": lease}))
        return int(reply.get("result", {}).get("TTL", -1)) > 0

    def revoke_lease(self, lease: int) -> None:
        """End the lease now: its keys are deleted (a resignation)."""
        self._retry("lease revoke", lambda: self._client().post(
            self._client().get_url("/kv/lease/revoke"), json={"ID": lease}))

    def create_leased(self, key: str, value: str | bytes, lease: int) -> bytes:
        """Put `value` under `key`, attached to `lease`, only if the key does not exist (etcd's
        election: the key goes with the lease); the value the key holds afterwards."""
        k = self._key(key)
        data = value.encode() if isinstance(value, str) else value
        reply = self._retry("create", lambda: self._txn({
            "compare": [{"key": _encode(k), "target": "CREATE", "result": "EQUAL",
                         "create_revision": 0}],
            "success": [{"request_put": {"key": _encode(k), "value": _encode(data),
                                         "lease": lease}}],
            "failure": [{"request_range": {"key": _encode(k)}}]}))
        if reply.get("succeeded"):
            return data
        kvs = reply["responses"][0].get("response_range", {}).get("kvs", [])
        return _decode(kvs[0].get("value", "")) if kvs else b""

    def lease_of(self, key: str) -> int | None:
        """The lease `key` is attached to (0: none), or None when the key does not exist."""
        k = self._key(key)
        reply = self._retry("get", lambda: self._txn({"compare": [], "success": [
            {"request_range": {"key": _encode(k)}}], "failure": []}))
        kvs = reply["responses"][0].get("response_range", {}).get("kvs", [])
        return int(kvs[0].get("lease", 0)) if kvs else None

    def claim_unleased(self, key: str, value: str | bytes, lease: int) -> bool:
        """Put `value` under `key`, attached to `lease`, only if the key exists attached to no
        lease (a value written over the election's key by something that is not an agent:
        every agent's is leased); whether it was put."""
        k = self._key(key)
        data = value.encode() if isinstance(value, str) else value
        reply = self._retry("claim", lambda: self._txn({
            "compare": [{"key": _encode(k), "target": "CREATE", "result": "NOT_EQUAL",
                         "create_revision": 0},
                        {"key": _encode(k), "target": "LEASE", "result": "EQUAL", "lease": 0}],
            "success": [{"request_put": {"key": _encode(k), "value": _encode(data),
                                         "lease": lease}}],
            "failure": []}))
        return bool(reply.get("succeeded"))

    # ------------------------------------------------------------------ housekeeping

    def delete_prefix(self) -> None:
        """Remove every key of this job (the job is over)."""
        start = self.prefix.encode()
        self._retry("delete_prefix", lambda: self._client().delete(
            start, range_end=_increment_last_byte(start)))

    def delete_under(self, prefix: str) -> int:
        """Remove every key of this job that starts with `prefix` (a generation that is over:
        `cluster.collect`), under the guard if there is one; how many went."""
        start = self._key(prefix)
        reply = self._put_guarded("delete_under", [{"request_delete_range": {
            "key": _encode(start), "range_end": _encode(_increment_last_byte(start))}}])
        deleted = reply.get("responses", [{}])[0].get("response_delete_range", {})
        return int(deleted.get("deleted", 0))

    def reachable(self) -> None:
        """Raise EtcdStoreError unless etcd answers within the reconnect deadline; one that
        speaks TLS to a client that does not is said so (it only closes the connection)."""
        try:
            self._range([self._key("__ping")])
        except EtcdStoreError as exc:
            if self.tls is None and speaks_tls(self.host, self.port):
                raise EtcdStoreError(f"{exc}; etcd there speaks TLS: connect with "
                                     "protocol=https and its CA (--rdzv-conf for `spotpipe "
                                     "agent`, cluster.etcd_conf for `spotpipe train`)") from None
            raise
