"""A worker's side of membership: heartbeats, aborts, and preemption notices.

Three small threads, each with its own store connection (a client blocked in `wait` cannot
serve other calls):

- the heartbeat publishes liveness and progress, so the launcher or agent can tell a dead node
  (heartbeats stop) from a hung one (heartbeats go on, progress does not, the main thread is
  not waiting on a peer);
- the abort watcher blocks on the generation's abort key and wakes every wait of the
  generation when any node, the launcher or the agent declares a failure;
- the notice watcher turns a preemption notice (SIGTERM, or the AWS/GCP metadata endpoints)
  into a flag that the next commit shares with every node, so the job reshapes at an
  iteration boundary with nothing to replay.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from spotpipe.cluster.store import StoreAddress
from spotpipe.runtime.comm import AbortSignal

HEARTBEATS = "spotpipe/hb"


def abort_key(generation: int) -> str:
    return f"spotpipe/gen{generation}/abort"


def plan_key(generation: int) -> str:
    return f"spotpipe/gen{generation}/plan"


def regroup_key(generation: int) -> str:
    """Set when the layout should change at the next iteration boundary (a node joined)."""
    return f"spotpipe/gen{generation}/regroup"


def join_key(node: str) -> str:
    """The coordinator's answer to a joining node: the generation that takes it, or a refusal."""
    return f"spotpipe/join/{node}"


def client(address: StoreAddress, timeout_s: float) -> dist.Store:
    """A connection of its own (for a thread that blocks in `wait`)."""
    return address.connect(timeout_s)


class Heartbeat:
    def __init__(self, store: dist.Store, node: str, interval_s: float,
                 progress: Callable[[], dict[str, Any]]) -> None:
        self.store, self.node, self.interval_s, self.progress = store, node, interval_s, progress
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"{HEARTBEATS}/{self.node}",
                               json.dumps({"t": time.time(), **self.progress()}))
            except Exception:  # the store is gone: the job is over
                return
            self._stop.wait(self.interval_s)  # the beat's period, not a synchronisation

    def stop(self) -> None:
        self._stop.set()


class KeyWatcher:
    """Calls `then()` once when `key` appears in the store."""

    def __init__(self, store: dist.Store, key: str, then: Callable[[], None]) -> None:
        def watch() -> None:
            try:
                store.wait([key], timedelta(days=7))
            except Exception:  # store gone (job over)
                return
            then()

        threading.Thread(target=watch, name=f"watch-{key}", daemon=True).start()


class AbortWatcher:
    """Triggers `abort` when the generation's abort key appears in the store."""

    def __init__(self, store: dist.Store, generation: int, abort: AbortSignal) -> None:
        def watch() -> None:
            try:
                store.wait([abort_key(generation)], timedelta(days=7))
                abort.trigger(store.get(abort_key(generation)).decode(errors="replace"))
            except Exception:  # store gone (job over): nothing to abort
                return

        threading.Thread(target=watch, name=f"abort-watch-{generation}", daemon=True).start()


class NoticeWatcher:
    """SIGTERM and cloud metadata notices set `notice`; the worker leaves at the next commit."""

    AWS_DEFAULT = "http://169.254.169.254/latest/meta-data/spot/instance-action"
    GCP_DEFAULT = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"

    def __init__(self, *, aws_url: str = "", gcp_url: str = "", poll_s: float = 5.0,
                 on_notice: Callable[[str], None] | None = None) -> None:
        self.notice = threading.Event()
        self.source = ""
        self._on_notice = on_notice
        signal.signal(signal.SIGTERM, lambda signum, frame: self.set("SIGTERM"))
        if aws_url or gcp_url:
            threading.Thread(target=self._poll, args=(aws_url, gcp_url, poll_s),
                             name="notice-watch", daemon=True).start()

    def set(self, source: str) -> None:
        if not self.notice.is_set():
            self.source = source
            self.notice.set()
            if self._on_notice is not None:
                self._on_notice(source)

    def is_set(self) -> bool:
        return self.notice.is_set()

    def _poll(self, aws_url: str, gcp_url: str, poll_s: float) -> None:
        while not self.notice.is_set():
            if aws_url and self._aws(aws_url):
                self.set(f"AWS spot instance-action ({aws_url})")
            elif gcp_url and self._gcp(gcp_url):
                self.set(f"GCP preempted ({gcp_url})")
            self.notice.wait(poll_s)  # the polling period of the metadata service

    @staticmethod
    def _aws(url: str) -> bool:
        """200 with a JSON action means a notice; 404 means none."""
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                body = json.loads(reply.read() or b"{}")
                return reply.status == 200 and body.get("action") in ("terminate", "stop",
                                                                      "hibernate")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    @staticmethod
    def _gcp(url: str) -> bool:
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                return reply.read().strip().upper() == b"TRUE"
        except (urllib.error.URLError, OSError):
            return False
