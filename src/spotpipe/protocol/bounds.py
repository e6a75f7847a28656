"""How much of a record a reader parses: a cap on its size and on its JSON nesting.

Anything that reaches the store can write a record, and its reader parses it before it can
tell a forgery (the MAC covers the parsed fields). `json.loads` of a deeply nested blob
(`[[[[...]]]]`) raises RecursionError, which is no ValueError: it would pass every reader's
`except` and end the loop that read it (the coordinator's mailbox pump, a watcher of a
generation's aborts). So both parsers, `auth.unseal` (sealed records) and
`messages.from_plain` (the rendezvous's), read through `load_record`, which raises only
`Unreadable` (a ValueError) for what it will not parse.
"""

from __future__ import annotations

import json
from typing import Any

# The largest record a reader parses. The largest legitimate records are the coordinator's
# books (`CoordinatorState`: the layout, the history, the node sets, in the job's nodes) and
# one turn's `Journal` of run-file lines. Both go into the store in one etcd transaction,
# which etcd bounds at 1.5 MiB by default (--max-request-bytes), so no working job writes a
# record within ten times of this cap; past it a blob is refused unread, so a forged one
# costs its reader no time or memory in its size.
MAX_RECORD_BYTES = 16 * 1024 * 1024

# The deepest nesting a reader accepts. The deepest legitimate record, a CoordinatorState
# (envelope, body, history, layout, its pipelines and slots), is about ten levels deep; a
# worker's event details a few more. Past about a thousand levels json and every recursive
# walk after it (the MAC's canonical form, the field checks) raise RecursionError.
MAX_DEPTH = 64


class Unreadable(ValueError):
    """A blob a reader will not parse: over the size cap, not UTF-8 JSON, or nested too
    deeply. Its message says which, in a few words."""


def load_record(blob: bytes | str) -> Any:
    """The JSON value in `blob` (UTF-8); `Unreadable` for anything else, never another
    exception."""
    if len(blob) > MAX_RECORD_BYTES:
        raise Unreadable(f"{len(blob)} bytes, over the {MAX_RECORD_BYTES}-byte cap on a record")
    try:
        text = blob.decode("utf-8") if isinstance(blob, (bytes, bytearray)) else blob
        value = json.loads(text)
    except RecursionError:
        raise Unreadable(f"nested too deeply (over {MAX_DEPTH} levels)") from None
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise Unreadable(f"not a JSON record ({type(exc).__name__})") from None
    if _deeper_than(value, MAX_DEPTH):
        raise Unreadable(f"nested too deeply (over {MAX_DEPTH} levels)")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` deep (without recursion:
    the point is to refuse what recursion cannot walk)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
