"""Sealing and opening typed messages under the job's key: the one way records are made.

`Channel.seal` turns a Message into the bytes a store key holds; `Channel.open` turns bytes
from the store back into a Message, or raises `Refused` with the writer and the reason (bad
MAC, malformed, unknown type or version, sealed for another key, an old generation, a
replay). Both name the store key (`at`): a record opens only under the key it was sealed for
(`spotpipe.protocol.auth`). Callers drop refused
records with a `record_refused` event; nothing else can come out of a record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from spotpipe.protocol.auth import Refused, ReplayGuard, Sealed, Sealer, unseal
from spotpipe.protocol.messages import Message, MessageError, parse

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Opened:
    sealed: Sealed
    message: Message

    @property
    def writer(self) -> str:
        return self.sealed.writer

    @property
    def generation(self) -> int:
        return self.sealed.generation


class Channel:
    """One process's view of the protocol: its own seals, and the key to check others'."""

    def __init__(self, key: bytes, writer: str) -> None:
        self.key = key
        self.sealer = Sealer(key, writer)

    @property
    def writer(self) -> str:
        return self.sealer.writer

    def seal(self, message: Message, generation: int = 0, *, at: str) -> bytes:
        """`message` as the store key `at` holds it."""
        return self.sealer.seal(message.TYPE, message.VERSION, message.to_json(), generation,
                                at=at)

    def open(self, blob: bytes | str, *, at: str,
             expect: type[M] | tuple[type[Message], ...] | None = None,
             guard: ReplayGuard | None = None, min_generation: int | None = None,
             writers: frozenset[str] | set[str] | None = None) -> Opened:
        """The message the store key `at` holds."""
        sealed = unseal(self.key, blob)
        if sealed.at != at:
            raise Refused(f"a copy: sealed for {sealed.at[:120]!r}, found at {at!r}",
                          sealed.writer)
        try:
            message = parse(sealed.type, sealed.version, sealed.body)
        except MessageError as exc:
            raise Refused(str(exc), sealed.writer) from None
        if expect is not None and not isinstance(message, expect):
            raise Refused(f"a {sealed.type} record where another kind belongs", sealed.writer)
        if writers is not None and sealed.writer not in writers:
            raise Refused(f"{sealed.writer!r} may not write this record", sealed.writer)
        if min_generation is not None and sealed.generation < min_generation:
            raise Refused(f"from generation {sealed.generation}, older than {min_generation}",
                          sealed.writer)
        if guard is not None and not guard.fresh(sealed):
            raise Refused(f"a replay (sequence number {sealed.seq} seen before)", sealed.writer)
        return Opened(sealed, message)


def channel_from_env(writer: str) -> Channel:
    """A worker's or shadow's channel, keyed from its environment (SPOTPIPE_JOIN_TOKEN and
    SPOTPIPE_INSTANCE, which its launcher or agent sets)."""
    import os

    from spotpipe.protocol.auth import job_key, token_from_env

    instance = os.environ.get("SPOTPIPE_INSTANCE", "")
    if not instance:
        raise RuntimeError("SPOTPIPE_INSTANCE is not set: this process was not started by a "
                           "spotpipe launcher or agent")
    return Channel(job_key(token_from_env(), instance), writer)
