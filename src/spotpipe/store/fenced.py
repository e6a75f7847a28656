"""The error of a write fenced by the coordinator's office, in a module of its own: the etcd
store raises it (`EtcdStore.guarded`) and the office (`store.leader`), which needs the etcd
store, hands it out, so neither imports the other for it, and code that never runs on etcd
catches it without the optional etcd client installed."""

from __future__ import annotations


class NotLeader(RuntimeError):
    """etcd refused a write of the coordinator's because the leader key no longer names it
    (`EtcdStore.guarded`): its lease expired while it was cut off, and a successor may be
    coordinating. The writer is deposed; nothing of that write reached the store."""
