"""Loopback stand-ins for the clouds' metadata services, answering as the real ones do.

One server holds any number of hosts: a path starts with `/<host>/`, and the rest is the
cloud's own path. What each endpoint answers (status codes, bodies, headers) follows the
providers' documentation:
- AWS IMDSv2: PUT /latest/api/token needs X-aws-ec2-metadata-token-ttl-seconds (1..21600,
  else 400) and returns the token as text; a GET without a valid token is 401 when IMDSv2 is
  required (the default of current instances); spot/instance-action is 404 (an HTML page)
  until a notice, then 200 with {"action": "terminate", "time": "...Z"}. With
  `token_status` set (e.g. 403), the PUT is refused and plain GETs (IMDSv1) are served. With
  `token_lost_s`, the PUT's reply comes that late (a container behind the default hop limit
  of 1, which drops IMDSv2's replies only) and plain GETs are served (IMDSv1 optional).
- GCP: every request needs `Metadata-Flavor: Google` (else 403); answers carry
  `Metadata-Flavor: Google` and an ETag; `?wait_for_change=true&last_etag=E` holds the request
  until the value's ETag differs from E or timeout_sec passes.
- Azure: every request needs `Metadata: true` (else 400 with a JSON error) and an
  api-version; scheduledevents returns {"DocumentIncarnation", "Events": [...]}; a POST of
  {"StartRequests": [{"EventId"}]} acknowledges an event (recorded in `acks`), which is
  "Started" from then on.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from email.utils import formatdate

NOT_FOUND_HTML = (b'<?xml version="1.0" encoding="iso-8859-1"?>\n<!DOCTYPE html>\n<html><head>'
                  b"<title>404 - Not Found</title></head><body><h1>404 - Not Found</h1>"
                  b"</body></html>\n")


class MetadataServer:
    """AWS, GCP and Azure metadata endpoints for named hosts, on one loopback port."""

    def __init__(self, host: str = "127.0.0.1", *, token_status: int = 200,
                 token_lost_s: float = 0.0) -> None:
        self.token_status = token_status
        self.token_lost_s = token_lost_s
        self.preempted: set[str] = set()
        self.reclaimed_at: dict[str, str] = {}  # host -> AWS's `time` of its reclaim
        self.tokens: set[str] = set()
        self.calls: Counter = Counter()  # (host, what) -> count
        self.acks: list[tuple[str, str]] = []  # (host, EventId)
        self.events: dict[str, dict] = {}  # host -> its Azure event
        self.changed = threading.Condition()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                owner._put(self)

            def do_GET(self) -> None:  # noqa: N802
                owner._get(self)

            def do_POST(self) -> None:  # noqa: N802
                owner._post(self)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    # -- what tests use -----------------------------------------------------------------

    def urls(self, host: str = "{node}") -> dict[str, str]:
        """The failover.* notice URLs for `host` ("{node}": each node its own host)."""
        b = f"{self.base}/{host}"
        return {"aws": f"{b}/latest/meta-data/spot/instance-action",
                "gcp": f"{b}/computeMetadata/v1/instance/preempted",
                "azure": f"{b}/metadata/scheduledevents?api-version=2020-07-01"}

    def preempt(self, host: str, in_s: float = -3600.0) -> None:
        """`host` is reclaimed `in_s` from now (whole seconds in the answers, as the clouds
        give them: AWS's `time`, Azure's `NotBefore`); by default an hour ago, so that the
        notice is acted on at once."""
        when = time.time() + in_s
        with self.changed:
            self.preempted.add(host)
            self.reclaimed_at[host] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
            self.events[host] = {
                "EventId": str(uuid.uuid4()).upper(), "EventStatus": "Scheduled",
                "EventType": "Preempt", "ResourceType": "VirtualMachine",
                "Resources": [self.vm_name(host)], "NotBefore": formatdate(when, usegmt=True),
                "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
            self.changed.notify_all()

    @staticmethod
    def vm_name(host: str) -> str:
        return f"vm-{host}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    # -- the endpoints ------------------------------------------------------------------

    @staticmethod
    def _split(req) -> tuple[str, str, dict[str, list[str]]]:
        parts = urllib.parse.urlsplit(req.path)
        host, _, rest = parts.path.lstrip("/").partition("/")
        return host, "/" + rest, urllib.parse.parse_qs(parts.query)

    @staticmethod
    def _reply(req, status: int, body: bytes, ctype: str = "text/plain",
               headers: dict[str, str] | None = None) -> None:
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        try:
            req.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the asker left: a watcher closed
            pass  # while GCP's long poll held its request (`NoticeWatcher.close`)

    def _put(self, req) -> None:
        host, path, _ = self._split(req)
        if path != "/latest/api/token":
            return self._reply(req, 403, b"")
        self.calls[(host, "aws-token")] += 1
        time.sleep(self.token_lost_s)
        if self.token_status != 200:
            return self._reply(req, self.token_status, b"")
        ttl = req.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self._reply(req, 400, b"")
        token = uuid.uuid4().hex
        self.tokens.add(token)
        self._reply(req, 200, token.encode(),
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def _get(self, req) -> None:
        host, path, query = self._split(req)
        if path.startswith("/latest/"):
            return self._aws(req, host, path)
        if path.startswith("/computeMetadata/"):
            return self._gcp(req, host, path, query)
        if path.startswith("/metadata/"):
            return self._azure(req, host, path, query)
        self._reply(req, 404, NOT_FOUND_HTML, "text/html")

    def _aws(self, req, host: str, path: str) -> None:
        token = req.headers.get("X-aws-ec2-metadata-token")
        v2_required = self.token_status == 200 and not self.token_lost_s
        if (token is not None and token not in self.tokens) or (token is None and v2_required):
            return self._reply(req, 401, b"")
        if path != "/latest/meta-data/spot/instance-action":
            return self._reply(req, 404, NOT_FOUND_HTML, "text/html")
        self.calls[(host, "aws")] += 1
        if host not in self.preempted:
            return self._reply(req, 404, NOT_FOUND_HTML, "text/html")
        body = json.dumps({"action": "terminate", "time": self.reclaimed_at[host]}).encode()
        self._reply(req, 200, body, "application/json")

    def _gcp(self, req, host: str, path: str, query: dict[str, list[str]]) -> None:
        if req.headers.get("Metadata-Flavor") != "Google":
            return self._reply(req, 403, b"Missing required header: Metadata-Flavor\n",
                               "text/html")
        if path != "/computeMetadata/v1/instance/preempted":
            return self._reply(req, 404, NOT_FOUND_HTML, "text/html")
        self.calls[(host, "gcp")] += 1
        etag = lambda: hashlib.md5(str(host in self.preempted).encode()).hexdigest()[:16]
        if query.get("wait_for_change") == ["true"]:
            last = query.get("last_etag", [""])[0]
            limit = float(query.get("timeout_sec", ["300"])[0])
            with self.changed:
                self.calls[(host, "gcp-wait")] += 1
                self.changed.notify_all()  # (tests wait for a long poll to be held)
                self.changed.wait_for(lambda: etag() != last, timeout=limit)
        value = b"TRUE" if host in self.preempted else b"FALSE"
        self._reply(req, 200, value, "application/text",
                    {"Metadata-Flavor": "Google", "ETag": etag()})

    def _azure(self, req, host: str, path: str, query: dict[str, list[str]]) -> None:
        if req.headers.get("Metadata") != "true":
            return self._reply(req, 400, json.dumps(
                {"error": "Bad request. Required metadata header not specified"}).encode(),
                "application/json")
        if "api-version" not in query:
            return self._reply(req, 400, json.dumps(
                {"error": "Bad request. api-version was not specified in the request"}).encode(),
                "application/json")
        if path == "/metadata/instance/compute/name":
            return self._reply(req, 200, self.vm_name(host).encode())
        if path != "/metadata/scheduledevents":
            return self._reply(req, 404, json.dumps({"error": "Not found"}).encode(),
                               "application/json")
        with self.changed:
            self.calls[(host, "azure")] += 1
            self.changed.notify_all()  # (tests wait for polls)
        events = [self.events[host]] if host in self.events else []
        body = json.dumps({"DocumentIncarnation": len(events), "Events": events}).encode()
        self._reply(req, 200, body, "application/json")

    def _post(self, req) -> None:
        host, path, _ = self._split(req)
        data = req.rfile.read(int(req.headers.get("Content-Length", 0)))
        if req.headers.get("Metadata") != "true" or path != "/metadata/scheduledevents":
            return self._reply(req, 400, b"{}", "application/json")
        try:
            starts = json.loads(data)["StartRequests"]
            ids = [str(s["EventId"]) for s in starts]
        except (ValueError, KeyError, TypeError):
            return self._reply(req, 400, b"{}", "application/json")
        with self.changed:
            for event_id in ids:
                self.acks.append((host, event_id))
                event = self.events.get(host)
                if event is not None and event["EventId"] == event_id:
                    event["EventStatus"] = "Started"  # (as Azure does once it is approved)
        self._reply(req, 200, b"", "application/json")


class BrokenServer:
    """A service that answers every request with the same bytes, whatever was asked: a reply
    cut short, one that is not HTTP, or JSON of the wrong shape. `calls` counts requests.
    `padding` spaces (sent in pieces, never held whole) and then `tail` follow `reply`: an
    oversized reply; `sent` is the most bytes one connection took before its reader left."""

    def __init__(self, reply: bytes, padding: int = 0, tail: bytes = b"") -> None:
        self.reply, self.padding, self.tail = reply, padding, tail
        self.calls = 0
        self.sent = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.recv(65536)
                self.calls += 1
                self.sent = max(self.sent, self._send(conn))

    def _send(self, conn: socket.socket) -> int:
        sent = 0
        try:
            conn.sendall(self.reply)
            sent += len(self.reply)
            piece = b" " * (1 << 16)
            while sent - len(self.reply) < self.padding:
                n = min(len(piece), self.padding - (sent - len(self.reply)))
                conn.sendall(piece[:n])
                sent += n
            conn.sendall(self.tail)
            sent += len(self.tail)
        except OSError:  # the reader closed the connection: it read no further
            pass
        return sent

    def close(self) -> None:
        self.sock.close()
