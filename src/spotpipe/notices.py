"""Preemption notices: SIGTERM and the clouds' metadata endpoints, turned into one flag.

The notice watcher sets a flag that the next commit shares with every node, so the job
reshapes at an iteration boundary with nothing to replay. It is shared by the worker (which
leaves on it) and by the tests that serve the endpoints.

Each cloud is read the way it asks to be read, because the defaults of today's instances
refuse anything else:
- AWS: IMDSv2, a session token by PUT, then the `spot/instance-action` read with it (404 is
  "no notice"); IMDSv1 (a plain GET) only when the PUT is refused with 403/404/405 or its
  reply never comes (a container behind the default hop limit of 1), the cases where botocore
  falls back too. A 401 means the token expired: a new one is asked for.
- GCP: the `preempted` value with `Metadata-Flavor: Google`, then long polls with
  `wait_for_change=true` and the last ETag, so a change between two polls is never missed and
  the notice arrives when the value flips, not at the next poll. An answer without the
  `Metadata-Flavor: Google` header is not the metadata server's and is ignored.
- Azure: Scheduled Events with `Metadata: true`; a `Preempt` event whose Resources name this
  VM (its name from the instance metadata) is the notice. It is acknowledged (POST of its
  EventId in StartRequests) once, when every worker of the host has left the job:
  acknowledging lets Azure evict at once, which would cut short the notice window of any
  worker still leaving. So it is done by the one reader that knows: a worker alone at its
  URL (the URL names its node), or else its host's node agent once all its workers are gone;
  the workers of a local launcher that share one URL leave it to come at NotBefore.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import math
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from spotpipe.config import FailoverSection

AWS_ACTIONS = ("terminate", "stop", "hibernate")
# what a service that did not answer this time raises: no connection or a timeout (OSError), a
# reply cut short or not HTTP at all (http.client's own errors, which are no OSErrors), a body
# that is not what the cloud documents (ValueError). Each is asked again, never the watch's end.
UNANSWERED = (OSError, http.client.HTTPException, ValueError)
# the most a reply may hold: a real one is a few hundred bytes (Azure's events document a few
# KiB); anything larger is no metadata service's, and is refused before it is read whole
MAX_REPLY_BYTES = 1 << 20


# GCP stops a preempted instance 30 s after it says so (`preempted` turns TRUE then)
GCP_NOTICE_S = 30.0


def leaving_needs_s(iteration_s: float, state_bytes: float, gbps: float) -> float:
    """How long a node needs between acting on a notice and its instance's end: the
    iteration in flight runs to its boundary, the agreement and the re-planning take about
    as long again (two of its iterations), and its state goes to whoever takes it over at
    `gbps` (a stage of tens of GB at 10 Gb/s takes longer than most iterations)."""
    return 2 * iteration_s + state_bytes * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class Notice:
    """One cloud's notice: where it came from, how to acknowledge it (Azure only), and when
    the instance goes (epoch seconds; None: unknown, as for a SIGTERM)."""

    source: str
    acknowledge: Callable[[], None] | None = None
    deadline: float | None = None


def _epoch(text: object, parse: Callable[[str], datetime.datetime]) -> float | None:
    """A cloud's time stamp as epoch seconds; None when it is missing or does not parse (the
    node then leaves at once, which is never wrong, only early)."""
    if not isinstance(text, str):
        return None
    try:
        when = parse(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    stamp = when.timestamp()
    return stamp if math.isfinite(stamp) else None


class Source(Protocol):
    name: str

    def next_notice(self, stop: threading.Event, poll_s: float) -> Notice | None:
        """Block until a notice (returned) or `stop` (None)."""


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
             data: bytes | None = None, timeout_s: float = 2.0) -> tuple[int, dict[str, str],
                                                                         bytes]:
    """(status, headers, body), with HTTP errors as statuses; URLError/OSError propagate."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            return reply.status, dict(reply.headers.items()), _bounded_body(reply, url)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers.items()), _bounded_body(err, url)


def _bounded_body(reply: Any, url: str) -> bytes:
    """The body, read up to MAX_REPLY_BYTES: a larger one (declared, or found by reading one
    byte more) is a ValueError, an unanswered poll, so that a broken or hostile service cannot
    make the watch read without end; one shorter than declared is an IncompleteRead."""
    declared = getattr(reply, "length", None)  # None: chunked, or until the connection ends
    if declared is not None and declared > MAX_REPLY_BYTES:
        raise ValueError(f"{url} declared a reply of {declared} bytes, over the "
                         f"{MAX_REPLY_BYTES} any metadata service gives: not read")
    body = reply.read(MAX_REPLY_BYTES + 1)
    if len(body) > MAX_REPLY_BYTES:
        raise ValueError(f"{url} sent a reply over the {MAX_REPLY_BYTES} bytes any metadata "
                         f"service gives: not read further")
    left = getattr(reply, "length", None)
    if left:  # (read(amt) returns what came before the end, where read() would raise)
        raise http.client.IncompleteRead(body, left)
    return body


def _unanswered(source: Any, exc: BaseException, poll_s: float) -> None:
    """Say, once per source, that its service did not answer: it is asked again at every
    poll, so a notice it gives later is still heard, but a URL that names no service (a typo
    in `failover.*_notice_url`, or a host on another cloud) was never said, and the job
    never heard its notices without anyone knowing."""
    if getattr(source, "said_unanswered", False):
        return
    source.said_unanswered = True
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) \
        else type(exc).__name__
    print(f"spotpipe: the {source.name} preemption notice service at {source.url} did not "
          f"answer ({why}); it is asked again every {poll_s:g} s (said once): check "
          f"failover.{source.name.lower()}_notice_url if this host is not on {source.name}",
          file=sys.stderr, flush=True)


def _json_object(body: bytes) -> dict:
    """The JSON object a 200 carries; anything else (a list, null, HTML) is a ValueError."""
    doc = json.loads(body or b"{}")
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


class _Polled:
    """A source read once per polling period."""

    name = ""

    def check(self) -> Notice | None:
        raise NotImplementedError

    def next_notice(self, stop: threading.Event, poll_s: float) -> Notice | None:
        while not stop.is_set():
            try:
                notice = self.check()
            except UNANSWERED as exc:
                _unanswered(self, exc, poll_s)
                notice = None  # the service did not answer this time: ask again
            if notice is not None:
                return notice
            stop.wait(poll_s)
        return None


class AwsImds(_Polled):
    """AWS spot instance-action through IMDSv2 (IMDSv1 only where the token PUT is refused)."""

    name = "AWS"
    DEFAULT = "http://169.254.169.254/latest/meta-data/spot/instance-action"
    TTL_S = 21600  # the longest token AWS issues

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url
        self.token_url = url.split("/latest/", 1)[0] + "/latest/api/token"
        self.timeout_s = timeout_s
        self.token = ""
        self.token_until = 0.0
        self.v1 = False  # the PUT was refused: IMDSv1 is all this instance offers

    def _token(self) -> str | None:
        """The session token; "" when none came (no read this time); None to read without
        one this time: the PUT's reply never came, as in a container behind the default hop
        limit of 1, which drops IMDSv2's replies only (botocore falls back on it too)."""
        if self.v1 or (self.token and time.monotonic() < self.token_until):
            return self.token
        try:
            status, _, body = _request(self.token_url, method="PUT", timeout_s=self.timeout_s,
                                       headers={"X-aws-ec2-metadata-token-ttl-seconds":
                                                str(self.TTL_S)})
        except TimeoutError:  # (a connect timeout is a URLError: no service to read at all)
            return None
        if status == 200:
            self.token = body.decode().strip()
            self.token_until = time.monotonic() + self.TTL_S - 60
        elif status in (403, 404, 405):
            self.v1, self.token = True, ""
        return self.token

    def check(self) -> Notice | None:
        token = self._token()
        if token == "" and not self.v1:
            return None
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        status, _, body = _request(self.url, headers=headers, timeout_s=self.timeout_s)
        if status == 401:  # the token expired or was revoked: a new one next time
            self.token = ""
            return None
        if status != 200:  # 404: no interruption scheduled
            return None
        doc = _json_object(body)
        action = doc.get("action")
        if action not in AWS_ACTIONS:
            return None
        when = doc.get("time")
        return Notice(f"AWS spot instance-action {action} at {when} ({self.url}"
                      f"{', IMDSv1' if not token else ''})",
                      deadline=_epoch(when, datetime.datetime.fromisoformat))


class GcpMetadata:
    """GCP `preempted`, read once and then long-polled with wait_for_change and the ETag."""

    name = "GCP"
    DEFAULT = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"

    def __init__(self, url: str, timeout_s: float = 2.0, wait_s: int = 30) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.wait_s = wait_s  # the longest the server holds one long poll
        self.etag = ""

    def _read(self) -> bool:
        url = self.url
        wait = bool(self.etag)
        if wait:
            sep = "&" if "?" in url else "?"
            url += f"{sep}wait_for_change=true&last_etag={self.etag}&timeout_sec={self.wait_s}"
        status, headers, body = _request(url, headers={"Metadata-Flavor": "Google"},
                                         timeout_s=self.wait_s + self.timeout_s if wait
                                         else self.timeout_s)
        flavor = {k.lower(): v for k, v in headers.items()}.get("metadata-flavor")
        if status != 200 or flavor != "Google":
            raise ValueError(f"not the metadata server's answer (HTTP {status})")
        self.etag = {k.lower(): v for k, v in headers.items()}.get("etag", "")
        return body.strip().upper() == b"TRUE"

    def next_notice(self, stop: threading.Event, poll_s: float) -> Notice | None:
        while not stop.is_set():
            try:
                if self._read():
                    return Notice(f"GCP preempted ({self.url})",
                                  deadline=time.time() + GCP_NOTICE_S)
                if not self.etag:  # a server without ETags cannot be long-polled
                    stop.wait(poll_s)
            except UNANSWERED as exc:
                _unanswered(self, exc, poll_s)
                self.etag = ""
                stop.wait(poll_s)
        return None


class AzureScheduledEvents(_Polled):
    """Azure Scheduled Events: a `Preempt` event for this VM."""

    name = "Azure"
    DEFAULT = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, url: str, timeout_s: float = 2.0, vm_name: str = "",
                 started_too: bool = False) -> None:
        """`started_too`: an event already acknowledged (Azure says "Started") is a notice
        too, for a reader that only watches (the node agent), whose host's workers may have
        heard the event and acknowledged it before its next poll."""
        self.url = url
        self.statuses = ("Scheduled", "Started") if started_too else ("Scheduled",)
        self.name_url = url.split("/metadata/", 1)[0] + self.NAME_PATH
        self.timeout_s = timeout_s
        self.vm_name = vm_name

    def _name(self) -> str:
        if not self.vm_name:
            status, _, body = _request(self.name_url, headers={"Metadata": "true"},
                                       timeout_s=self.timeout_s)
            if status == 200:
                self.vm_name = body.decode().strip()
        return self.vm_name

    def check(self) -> Notice | None:
        name = self._name()
        if not name:
            return None
        status, _, body = _request(self.url, headers={"Metadata": "true"},
                                   timeout_s=self.timeout_s)
        if status != 200:
            return None
        events = _json_object(body).get("Events", [])
        if not isinstance(events, list):
            raise ValueError(f"Events: expected a list, got {type(events).__name__}")
        for event in events:
            if not isinstance(event, dict) or "EventId" not in event:
                continue
            resources = event.get("Resources")
            if (event.get("EventType") == "Preempt" and isinstance(resources, list)
                    and name in resources and event.get("EventStatus") in self.statuses):
                event_id = str(event["EventId"])
                return Notice(f"Azure Scheduled Events Preempt {event_id} for {name} "
                              f"(not before {event.get('NotBefore', '?')})",
                              acknowledge=lambda: self.acknowledge(event_id),
                              deadline=_epoch(event.get("NotBefore"),
                                              email.utils.parsedate_to_datetime))
        return None

    def acknowledge(self, event_id: str) -> None:
        """Tell Azure this VM is ready: the eviction may start now."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        _request(self.url, method="POST", data=body, timeout_s=self.timeout_s,
                 headers={"Metadata": "true", "Content-Type": "application/json"})


class NoticeWatcher:
    """SIGTERM and cloud metadata notices set `notice`; the worker leaves at the next commit."""

    AWS_DEFAULT = AwsImds.DEFAULT
    GCP_DEFAULT = GcpMetadata.DEFAULT
    AZURE_DEFAULT = AzureScheduledEvents.DEFAULT

    def __init__(self, *, aws_url: str = "", gcp_url: str = "", azure_url: str = "",
                 poll_s: float = 5.0, on_notice: Callable[[str], None] | None = None,
                 sigterm: bool = True, watch_only: bool = False,
                 acknowledges: bool = True, lead_s: float = 0.0, max_wait_s: float = 120.0,
                 on_deferred: Callable[[str, float, float], None] | None = None,
                 needs_s: Callable[[], float] | None = None) -> None:
        """`sigterm`: a SIGTERM to this process is a notice too. `watch_only`: an Azure event
        already acknowledged ("Started") still counts, for a reader beside others (the node
        agent). `acknowledges`: whether `acknowledge` tells the cloud (see the module's
        docstring: one reader per host does). `lead_s`: a cloud notice that says when the
        instance goes is set that long before then, not when it comes: the node trains on
        through most of an AWS notice's two minutes (`on_deferred(source, seconds, lead)`
        says how long it waits, and the lead it leaves before the end); a SIGTERM, or a
        notice whose time is unknown, is set at once.
        `max_wait_s` caps that wait: no cloud gives a spot instance more than AWS's two
        minutes, so a time further off is more likely this host's clock (or the service)
        wrong than a promise, and training on past the real end would turn the notice into a
        crash. `needs_s()`: how long the node itself needs to leave cleanly, measured (a job
        of minute-long iterations needs more than a fixed lead): the lead is the longer."""
        self.notice = threading.Event()
        self.source = ""
        self.acknowledges = acknowledges
        # what ends the watch: a notice, or `close` (which is no notice)
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ack: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._on_notice = on_notice
        self._lead_s, self._max_wait_s, self._on_deferred = lead_s, max_wait_s, on_deferred
        self._needs_s = needs_s
        if sigterm:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.set("SIGTERM"))
        sources: list[Source] = []
        if aws_url:
            sources.append(AwsImds(aws_url))
        if gcp_url:
            sources.append(GcpMetadata(gcp_url))
        if azure_url:
            sources.append(AzureScheduledEvents(azure_url, started_too=watch_only))
        for src in sources:
            thread = threading.Thread(target=self._watch, args=(src, poll_s),
                                      name=f"notice-{src.name.lower()}", daemon=True)
            self._threads.append(thread)
            thread.start()

    @classmethod
    def of_node(cls, failover: FailoverSection, node: str, on_notice: Callable[[str], None],
                sigterm: bool = True, watch_only: bool = False,
                for_host: bool = False, host_acknowledges: bool = False,
                on_deferred: Callable[[str, float, float], None] | None = None,
                needs_s: Callable[[], float] | None = None) -> NoticeWatcher:
        """The notices `failover.*_notice_url` configure, read for `node`: "{node}" in a URL is
        the node's name (one metadata service per host in the cloud, where the URLs name
        no node; one loopback server for every node in the tests). `for_host`: this reader
        acknowledges for every worker of its host (the node agent, once they are gone);
        else it does only where it reads its URL alone, which then names its node, and its
        host's agent does not (`host_acknowledges`)."""
        alone = "{node}" in failover.azure_notice_url and not host_acknowledges
        return cls(aws_url=failover.aws_notice_url.replace("{node}", node),
                   gcp_url=failover.gcp_notice_url.replace("{node}", node),
                   azure_url=failover.azure_notice_url.replace("{node}", node),
                   poll_s=failover.notice_poll_s, on_notice=on_notice, sigterm=sigterm,
                   watch_only=watch_only, acknowledges=for_host or alone,
                   lead_s=failover.notice_lead_s, max_wait_s=failover.notice_max_wait_s,
                   on_deferred=on_deferred, needs_s=needs_s)

    def _watch(self, source: Source, poll_s: float) -> None:
        notice = source.next_notice(self._done, poll_s)
        if notice is None or self.closed:
            return
        if notice.deadline is not None:
            lead = max(self._lead_s, self._needs_s() if self._needs_s is not None else 0.0)
            wait = min(notice.deadline - lead - time.time(), self._max_wait_s)
            if wait > 0:
                if self._on_deferred is not None:
                    self._on_deferred(notice.source, wait, lead)
                # (`close`, or another notice set meanwhile, ends the wait)
                if self._done.wait(wait) and not self.notice.is_set():
                    return
        self.set(notice.source, notice.acknowledge)

    def set(self, source: str, acknowledge: Callable[[], None] | None = None) -> None:
        with self._lock:
            if self.notice.is_set():
                return
            self.source, self._ack = source, acknowledge
            self.notice.set()
            self._done.set()
        if self._on_notice is not None:
            self._on_notice(source)

    def is_set(self) -> bool:
        return self.notice.is_set()

    @property
    def closed(self) -> bool:
        return self._done.is_set() and not self.notice.is_set()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the watch without a notice, and wait (at most `timeout_s`) for the reads in
        flight: a poll still running after its reader is done would say that the service
        "did not answer" once the service is gone (a test's server, an agent's last moments),
        where nobody is listening any more."""
        self._done.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def acknowledge(self) -> None:
        """What this reader acts for has left the job: tell the cloud it may go on (Azure),
        once, where this reader acknowledges at all."""
        ack, self._ack = self._ack, None
        if ack is not None and self.acknowledges:
            try:
                ack()
            except UNANSWERED:
                pass  # the eviction comes at NotBefore anyway
