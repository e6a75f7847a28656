"""Preemption notices: SIGTERM and the clouds' metadata endpoints, turned into one flag.

The notice watcher sets a flag that the next commit shares with every node, so the job
reshapes at an iteration boundary with nothing to replay. It is shared by the worker (which
leaves on it) and by the tests that serve the endpoints.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable


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
