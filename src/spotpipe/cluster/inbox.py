"""What the coordinator's loop hears, as types: one queue, fed by the threads around it.

The loop (`cluster/jobloop.py`) acts on one thing at a time, so everything that happens
around it, on threads of its own process, comes to it through one queue: the mailbox reader's
records (`protocol.Opened`) and the slots it could not open (`protocol.Refused`), the exits
the supervisor sees (or the agent's loop counts for a node whose host went silent), events
that helper threads want in the run's files, and the refusals the committer's receives hear.
Each is a type of its own, so that the loop dispatches on what an item is.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, TypeAlias

from spotpipe.protocol import Opened, Refused


@dataclass(frozen=True)
class NodeExit:
    """A worker process exited with `code` (minus the signal that ended it): seen by this
    host's supervisor, reported by its agent (an `Exit` record), or counted by the loop for a
    node whose agent is gone. `cause`: what its agent said of why (`Exit.cause`)."""

    node: str
    code: int
    cause: str = ""


@dataclass(frozen=True)
class ShadowExit:
    """A CPU shadow process exited (`spotpipe.checkpoint.shadow`)."""

    name: str
    code: int


@dataclass(frozen=True)
class HelperEvent:
    """An event for the run's files from a helper thread (an admission, a checkpoint's
    send): only the loop writes them."""

    record: dict[str, Any]


@dataclass(frozen=True)
class RefusedUpload:
    """A record that did not verify, met by a receive on the committer's thread."""

    writer: str
    reason: str


@dataclass(frozen=True)
class MailboxClosed:
    """The mailbox reader stopped: the store went away."""

    reason: str


Item: TypeAlias = (Opened | Refused | NodeExit | ShadowExit | HelperEvent | RefusedUpload
                   | MailboxClosed)
Inbox: TypeAlias = queue.Queue[Item]
