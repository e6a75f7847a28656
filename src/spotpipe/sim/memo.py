"""Values memoised per object by its identity: the simulator's caches per config and per rules.

A sweep makes a policy per seed, tens of thousands per table, all from one `SimConfig`; what
they derive from it (the recovery rules, step times, what fits in memory) is computed once per
config object. Keyed by `id()`, not by the object: a config's hash walks its model's per-layer
tuples, which costs more than most of the lookups it would serve; and not weakly, for the same
reason (a `WeakKeyDictionary` hashes its keys too). The object is kept in its entry, so its id
cannot be reused by another object while the entry lives, and a hit is checked by identity.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class PerObject(Generic[V]):
    """(object, key) -> value, by the object's identity; cleared whole at `limit` entries (a
    long process that makes many configs, such as `--advise`, must not grow without bound)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._entries: dict[tuple[int, Hashable], tuple[object, V]] = {}

    def get(self, obj: object, key: Hashable, make: Callable[..., V], *args: Any) -> V:
        """The value for (obj, key), made by `make(*args)` the first time (arguments, not a
        closure: the lookups sit on paths a sweep takes per seed)."""
        entry = self._entries.get((id(obj), key))
        if entry is not None and entry[0] is obj:
            return entry[1]
        value = make(*args)
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[(id(obj), key)] = (obj, value)
        return value
