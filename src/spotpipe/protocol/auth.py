"""The job's key, and the seal every record in the store carries.

Anything that can reach the store could otherwise fail the job with one forged exit record,
publish a plan before the coordinator, or fence a healthy node with a stale heartbeat. So every
record is sealed: an HMAC-SHA256, under a per-job key, over the record's bytes together with
the store key it is written under, its writer, the writer's incarnation, its generation and a
per-writer sequence number. Readers drop a record with a bad MAC, one read under another key
than it was sealed for, an old generation or a sequence number they have seen before.

The store key is in the MAC because a genuine record is readable by anyone who reaches the
store: without it, a generation's Decision copied onto a later generation's board, a kill
copied onto a healthy node's board, or an old report copied into a fresh mailbox slot (which
a successor coordinator, with no memory of the sequence numbers its predecessor saw, would
take) would steer the job without the key. Bound to its key, a copy is worthless anywhere but
where the original already was.

The key is derived (HKDF, RFC 5869, from the standard library's hmac) from the join token and
the job's instance id, so the token itself never enters the store, a file or a log, and a key
of one job is worthless in another job that uses the same token. Tokens are bytes: any token
works, non-ASCII included, and every comparison is constant-time on bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from spotpipe.protocol.bounds import Unreadable, load_record

PROTOCOL = 1  # the envelope's version
_INFO = b"spotpipe job key v1"


REASON_CHARS = 300  # the most of a refusal's reason that is kept (its start)
WRITER_CHARS = 200


class Refused(ValueError):
    """A record that a reader drops: its writer (as far as it can be told) and why.

    The reason and the writer are cut to a bounded length here, once for every reader: both
    may quote what a forger wrote (a megabyte of "protocol version"), and they go into events
    and into the coordinator's memory of what it has said (`Coordinator.refused`)."""

    def __init__(self, reason: str, writer: str = "?", claimed: dict[str, Any] | None = None) -> None:
        reason = _cut(str(reason), REASON_CHARS)
        super().__init__(reason)
        self.reason = reason
        self.writer = _cut(str(writer), WRITER_CHARS)
        # what the record says of itself (type, body, its writer's incarnation),
        # unauthenticated: only for answering a stranger that it is refused, never for acting on
        self.claimed = claimed or {}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def token_bytes(token: str | bytes | None) -> bytes:
    """The token as bytes: str tokens as the OS passes them (surrogates kept, so a non-UTF-8
    environment variable round-trips), bytes as they are."""
    if token is None:
        return b""
    return token if isinstance(token, bytes) else os.fsencode(token)


def token_from_env() -> bytes:
    """SPOTPIPE_JOIN_TOKEN as bytes, straight from the environment's bytes."""
    return os.environb.get(b"SPOTPIPE_JOIN_TOKEN", b"")


def new_instance_id() -> str:
    """A fresh id for one run of a job: keys derived for one run do not verify in another."""
    return secrets.token_hex(16)


def job_key(token: str | bytes, instance: str) -> bytes:
    """HKDF-SHA256 (extract with the instance id as salt, then one block of expand)."""
    raw = token_bytes(token)
    if not raw:
        raise ValueError("the job has no join token to derive its key from")
    prk = hmac.new(instance.encode(), raw, hashlib.sha256).digest()
    return hmac.new(prk, _INFO + b"\x01", hashlib.sha256).digest()


def same_secret(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time equality of two secrets, on their bytes."""
    return hmac.compare_digest(token_bytes(a), token_bytes(b))


def proof(key_or_token: str | bytes, what: str) -> str:
    """Shows that the writer holds a secret without revealing it (anyone reading the store
    sees this, not the secret)."""
    return hmac.new(token_bytes(key_or_token), what.encode(), hashlib.sha256).hexdigest()


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


@dataclass(frozen=True)
class Sealed:
    """An opened record: who wrote it, in which generation, and its typed body."""

    type: str
    version: int
    writer: str
    incarnation: str
    generation: int
    seq: int
    body: dict[str, Any]
    at: str  # the store key it was sealed for


class Sealer:
    """One writer's seals. A process has one incarnation (a random id) and one sequence
    counter shared by all its threads, so a copy of any of its records is a replay."""

    def __init__(self, key: bytes, writer: str, incarnation: str | None = None) -> None:
        self._key = key
        self.writer = writer
        self.incarnation = incarnation or secrets.token_hex(8)
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, type_: str, version: int, body: dict[str, Any], generation: int, *,
             at: str) -> bytes:
        """The record as the store key `at` holds it."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        fields = {"p": PROTOCOL, "type": type_, "ver": version, "writer": self.writer,
                  "inc": self.incarnation, "gen": int(generation), "seq": seq, "body": body,
                  "at": at}
        mac = hmac.new(self._key, _canonical(fields), hashlib.sha256).hexdigest()
        return _canonical({**fields, "mac": mac})


def unseal(key: bytes, blob: bytes | str) -> Sealed:
    """Check a record's envelope and MAC; raises Refused naming the problem. Never anything
    else: a reader's loop must not end on what someone wrote into the store."""
    try:
        raw = blob.encode() if isinstance(blob, str) else bytes(blob)
        fields = load_record(raw)  # (a cap on its size and its nesting: see bounds.py)
    except Unreadable as exc:
        raise Refused(str(exc)) from None
    except (UnicodeError, ValueError, TypeError) as exc:
        raise Refused(f"not a JSON record ({type(exc).__name__})") from None
    if not isinstance(fields, dict):
        raise Refused("not a JSON object")
    writer = fields.get("writer")
    writer = writer if isinstance(writer, str) and len(writer) <= 200 else "?"
    mac = fields.pop("mac", None)
    if not isinstance(mac, str):
        raise Refused("no MAC (written without the job's key)", writer,
                      {"type": fields.get("type"), "body": fields.get("body"),
                       "inc": fields.get("inc")})
    if fields.get("p") != PROTOCOL:
        raise Refused(f"unknown protocol version {repr(fields.get('p'))[:40]}", writer)
    try:
        expected = hmac.new(key, _canonical(fields), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):
        raise Refused("malformed envelope", writer) from None
    if not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "replace")):
        raise Refused("bad MAC (not written with this job's key)", writer,
                      {"type": fields.get("type"), "body": fields.get("body"),
                       "inc": fields.get("inc")})
    types = {"type": str, "ver": int, "writer": str, "inc": str, "gen": int, "seq": int,
             "body": dict, "at": str}
    for name, kind in types.items():
        value = fields.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise Refused(f"envelope field {name!r} missing or not a {kind.__name__}", writer)
    return Sealed(fields["type"], fields["ver"], fields["writer"], fields["inc"], fields["gen"],
                  fields["seq"], fields["body"], fields["at"])


@dataclass
class ReplayGuard:
    """Remembers which (writer, incarnation, seq) a reader has accepted. Records from one
    writer may arrive out of order (its threads post concurrently), so it keeps the set of
    recent numbers above a floor, not just the highest."""

    window: int = 4096
    _seen: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    _floor: dict[tuple[str, str], int] = field(default_factory=dict)

    def fresh(self, record: Sealed) -> bool:
        """True the first time a record is seen; records it as seen."""
        who = (record.writer, record.incarnation)
        seen = self._seen.setdefault(who, set())
        if record.seq <= self._floor.get(who, 0) or record.seq in seen:
            return False
        seen.add(record.seq)
        if len(seen) > self.window:
            drop = sorted(seen)[: len(seen) - self.window]
            self._floor[who] = drop[-1]
            seen.difference_update(drop)
        return True

    def newest(self, record: Sealed) -> bool:
        """For a key that is overwritten (a heartbeat): True when the record is newer than any
        accepted from its writer's incarnation before (the same one again is not new)."""
        who = (record.writer, record.incarnation)
        last = self._floor.get(who, 0)
        if record.seq <= last:
            return False
        self._floor[who] = record.seq
        return True
