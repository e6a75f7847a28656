"""Cloud preemption notices read the way each cloud serves them (tests/metadata_servers.py).

Each client is checked against a server that refuses what the real endpoint refuses: AWS
without an IMDSv2 token (401), GCP without `Metadata-Flavor: Google` (403), Azure without
`Metadata: true` (400); so a client that reads them the old way finds no notice and fails.
"""

from __future__ import annotations

import calendar
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from spotpipe.notices import AwsImds, AzureScheduledEvents, GcpMetadata, NoticeWatcher

from metadata_servers import BrokenServer, MetadataServer
from procs import until


@pytest.fixture
def meta():
    server = MetadataServer()
    yield server
    server.close()


def status(url: str, headers: dict | None = None, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {},
                                                           method=method), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_servers_refuse_what_the_clouds_refuse(meta):
    urls = meta.urls("h1")
    assert status(urls["aws"]) == 401  # IMDSv2 required: no token, no answer
    assert status(urls["aws"].replace("meta-data/spot/instance-action", "api/token"),
                  method="PUT") == 400  # a token needs its TTL header
    assert status(urls["gcp"]) == 403
    assert status(urls["azure"]) == 400
    assert status(urls["azure"].split("?")[0], {"Metadata": "true"}) == 400  # no api-version


def test_aws_imdsv2_token_then_instance_action(meta):
    aws = AwsImds(meta.urls("h1")["aws"])
    assert aws.check() is None and aws.check() is None  # 404: no interruption scheduled
    assert meta.calls[("h1", "aws")] == 2
    assert meta.calls[("h1", "aws-token")] == 1  # the session token is reused
    meta.preempt("h1")
    notice = aws.check()
    assert notice is not None and "terminate" in notice.source and "IMDSv1" not in notice.source
    meta.tokens.clear()  # the token expired on the server: 401, then a new token
    assert aws.check() is None
    assert aws.check() is not None and meta.calls[("h1", "aws-token")] == 2


@pytest.mark.parametrize("refused", [403, 405])
def test_aws_falls_back_to_imdsv1_only_when_the_token_put_is_refused(refused):
    server = MetadataServer(token_status=refused)
    try:
        aws = AwsImds(server.urls("h1")["aws"])
        assert aws.check() is None
        server.preempt("h1")
        notice = aws.check()
        assert notice is not None and "IMDSv1" in notice.source
    finally:
        server.close()


def test_aws_reads_without_a_token_when_the_token_reply_never_comes():
    """In a container behind the default hop limit of 1 the token PUT's reply is dropped and
    the PUT times out; AWS documents that the SDKs then fall back to IMDSv1 (botocore: a read
    timeout on the PUT is a fallback), which an instance with IMDSv1 optional answers. Before,
    the timeout ended each poll without a read: the notice was never heard."""
    server = MetadataServer(token_lost_s=3.0)
    try:
        aws = AwsImds(server.urls("h1")["aws"], timeout_s=0.3)
        server.preempt("h1")
        stop = threading.Event()
        threading.Timer(10, stop.set).start()
        notice = aws.next_notice(stop, 0.05)
        stop.set()
        assert notice is not None and "IMDSv1" in notice.source
        assert not aws.v1  # the token is asked for again at the next read
    finally:
        server.close()


def test_aws_a_failing_token_service_is_no_fallback():
    server = MetadataServer(token_status=503)
    try:
        aws = AwsImds(server.urls("h1")["aws"])
        server.preempt("h1")
        assert aws.check() is None and not aws.v1  # asked again next time, never as v1
        assert server.calls[("h1", "aws")] == 0
    finally:
        server.close()


def test_gcp_long_poll_delivers_the_flip_without_polling(meta):
    gcp = GcpMetadata(meta.urls("h1")["gcp"], wait_s=30)
    stop = threading.Event()
    got: list = []
    # a polling period far longer than the test: only the long poll can deliver the notice
    thread = threading.Thread(target=lambda: got.append(gcp.next_notice(stop, 300.0)))
    thread.start()
    with meta.changed:
        assert meta.changed.wait_for(lambda: meta.calls[("h1", "gcp-wait")] >= 1, timeout=10)
    meta.preempt("h1")
    thread.join(timeout=10)
    stop.set()
    assert not thread.is_alive()
    assert got and got[0] is not None and "GCP preempted" in got[0].source
    assert meta.calls[("h1", "gcp")] == 2  # one read, one long poll that the flip ended


def test_gcp_ignores_an_answer_that_is_not_the_metadata_servers(meta):
    # the AWS path answers without Metadata-Flavor: Google: not a notice, however it reads
    gcp = GcpMetadata(meta.urls("h1")["gcp"].replace("computeMetadata/v1/instance/preempted",
                                                     "nothing"))
    with pytest.raises(ValueError):
        gcp._read()


def test_azure_preempt_for_this_vm_and_its_acknowledgement(meta):
    az = AzureScheduledEvents(meta.urls("h1")["azure"])
    assert az.check() is None
    meta.preempt("h2")  # another VM's event
    meta.events["h1"] = dict(meta.events["h2"])  # listed on h1's endpoint, naming vm-h2
    assert az.check() is None
    del meta.events["h1"]
    meta.preempt("h1")
    event_id = meta.events["h1"]["EventId"]
    notice = az.check()
    assert notice is not None and event_id in notice.source and "vm-h1" in notice.source
    assert meta.acks == []  # not acknowledged before the node has left
    notice.acknowledge()
    assert meta.acks == [("h1", event_id)]


def test_an_acknowledged_azure_event_is_a_notice_only_to_a_reader_that_watches(meta):
    """Once the host's workers have left and acknowledged their event, Azure lists it as
    "Started": no notice for a node (it acted on it already), but one for the node agent,
    which only watches and may poll after its workers acknowledged."""
    meta.preempt("h1")
    notice = AzureScheduledEvents(meta.urls("h1")["azure"]).check()
    assert notice is not None
    notice.acknowledge()
    assert meta.events["h1"]["EventStatus"] == "Started"
    assert AzureScheduledEvents(meta.urls("h1")["azure"]).check() is None
    watching = AzureScheduledEvents(meta.urls("h1")["azure"], started_too=True).check()
    assert watching is not None and meta.events["h1"]["EventId"] in watching.source


BROKEN = {"cut short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"action\"",
          "not HTTP": b"\x00\x01 not HTTP at all\r\n\r\n",
          "JSON, not an object": b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nMetadata-Flavor: Google"
                                 b"\r\n\r\nnull",
          "events, not a list": b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"Events": 7}'}


def make_source(cloud: str, server: BrokenServer):
    """`cloud`'s reader of `server`, which answers every request alike."""
    path = {"aws": "/latest/meta-data/spot/instance-action",
            "gcp": "/computeMetadata/v1/instance/preempted",
            "azure": "/metadata/scheduledevents?api-version=2020-07-01"}[cloud]
    source = {"aws": AwsImds, "gcp": GcpMetadata, "azure": AzureScheduledEvents}[cloud](
        server.base + path, timeout_s=2.0)
    if cloud == "azure":
        source.vm_name = "vm-h1"
    if cloud == "aws":  # the token from a service that works, the rest from the broken one
        source.token, source.token_until = "t", float("inf")
    return source


@pytest.mark.parametrize("reply", list(BROKEN))
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_broken_service_is_asked_again_not_the_end_of_the_watch(cloud, reply):
    """A reply cut short or not HTTP (http.client's own errors, not OSErrors) or of the wrong
    shape is one unanswered poll: the watch goes on. Before, the watcher's thread died on it
    and the node never heard its cloud's notice for the rest of the job."""
    assert_watch_goes_on(cloud, BrokenServer(BROKEN[reply]))


def assert_watch_goes_on(cloud: str, server: BrokenServer) -> None:
    """`cloud`'s watch of `server` polls it three times and is still watching: no notice,
    and its thread alive. (The server is closed.)"""
    source = make_source(cloud, server)
    stop = threading.Event()
    got: list = []
    thread = threading.Thread(target=lambda: got.append(source.next_notice(stop, 0.02)))
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while server.calls < 3 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.is_alive() and server.calls >= 3, f"the watch ended: {got}"
    finally:
        stop.set()
        thread.join(timeout=20)
        server.close()
    assert got == [None]


OVERSIZED = 32 << 20  # no metadata service's reply: 32 MiB (of JSON whitespace)
# (headers, body head, body tail) of a notice each client would take if it read it whole
OVERSIZED_NOTICE = {
    "aws": (b"", b'{"action": "terminate"', b"}"),
    "gcp": (b"Metadata-Flavor: Google\r\n", b"TRUE", b""),
    "azure": (b"", b'{"Events": [{"EventId": "E1", "EventType": "Preempt", "EventStatus": '
                   b'"Scheduled", "Resources": ["vm-h1"]}]', b"}")}


@pytest.mark.parametrize("declared", [True, False], ids=["Content-Length", "until close"])
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_an_oversized_reply_is_refused_unread_and_the_watch_goes_on(cloud, declared):
    """A reply larger than any metadata service's was read whole, into memory, at every
    poll (and taken for a notice): a broken or hostile service could exhaust the node's
    memory. Now a reply over 1 MiB (declared, or found by reading one byte more) is an
    unanswered poll, read no further: the watch goes on, and the server could not send it."""
    headers, head, tail = OVERSIZED_NOTICE[cloud]
    length = f"Content-Length: {len(head) + OVERSIZED + len(tail)}\r\n".encode() \
        if declared else b"Connection: close\r\n"
    server = BrokenServer(b"HTTP/1.1 200 OK\r\n" + length + headers + b"\r\n" + head,
                          padding=OVERSIZED, tail=tail)
    assert_watch_goes_on(cloud, server)
    assert server.sent < OVERSIZED  # (socket buffers hold a few MiB: never the whole reply)


def test_an_acknowledgement_cut_short_does_not_raise_in_the_leaving_worker():
    """The worker acknowledges on its way out (its main thread): a reply cut short is no
    reason to crash there, as a refused connection is not (Azure evicts at NotBefore)."""
    server = BrokenServer(BROKEN["cut short"])
    try:
        az = AzureScheduledEvents(server.base + "/metadata/scheduledevents?api-version=2020-07-01")
        watcher = NoticeWatcher(sigterm=False)
        watcher.set("Azure", lambda: az.acknowledge("E1"))
        watcher.acknowledge()
        assert server.calls == 1
    finally:
        server.close()


def test_watcher_sets_once_and_acknowledges_azure_once(meta):
    seen: list[str] = []
    ready = threading.Event()
    watcher = NoticeWatcher(azure_url=meta.urls("h1")["azure"], poll_s=0.05, sigterm=False,
                            on_notice=lambda s: (seen.append(s), ready.set()))
    meta.preempt("h1")
    assert ready.wait(10)
    assert watcher.is_set() and len(seen) == 1 and "Azure" in watcher.source
    watcher.acknowledge()
    watcher.acknowledge()
    assert meta.acks == [("h1", meta.events["h1"]["EventId"])]
    body = json.loads(urllib.request.urlopen(urllib.request.Request(
        meta.urls("h1")["azure"], headers={"Metadata": "true"}), timeout=5).read())
    assert body["Events"][0]["EventType"] == "Preempt"


def test_one_host_acknowledges_its_azure_event_once_after_all_its_workers(meta):
    """Two workers of one host and its node agent read the host's one event. Each worker
    acknowledged it as it left, and the first acknowledgement let Azure take the host while
    the other was still leaving. Now the workers of a host with an agent do not; the agent
    does, once, after both; a worker alone at its URL (the URL names its node) still does."""
    url = meta.urls("h1")["azure"]
    heard = threading.Semaphore(0)
    workers = [NoticeWatcher(azure_url=url, poll_s=0.05, sigterm=False, acknowledges=False,
                             on_notice=lambda s: heard.release()) for _ in range(2)]
    host = NoticeWatcher(azure_url=url, poll_s=0.05, sigterm=False, watch_only=True,
                         acknowledges=True, on_notice=lambda s: heard.release())
    meta.preempt("h1")
    assert all(heard.acquire(timeout=10) for _ in range(3))
    for worker in workers:  # each leaves on it
        worker.acknowledge()
    assert meta.acks == []  # nobody told Azure while a worker was still leaving
    host.acknowledge()  # the agent, once both are gone
    host.acknowledge()
    assert meta.acks == [("h1", meta.events["h1"]["EventId"])]
    # who acknowledges, from the configured URL: a worker alone at it, or the host's agent
    assert acknowledges(meta.urls()["azure"]) and not acknowledges(url)
    assert acknowledges(url, for_host=True)


def acknowledges(url: str, for_host: bool = False) -> bool:
    """Whether a node's watcher of `url` (failover.azure_notice_url) acknowledges."""
    from spotpipe.config import FailoverSection

    watcher = NoticeWatcher.of_node(FailoverSection(azure_notice_url=url), "node1",
                                    lambda s: None, sigterm=False, for_host=for_host)
    watcher.close()  # (its reads end here, not after the test's server is gone)
    return watcher.acknowledges


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_service_that_never_answers_is_said_once(cloud, capsys):
    """A notice URL that names no service (a typo, or a host on another cloud) was asked at
    every poll and never said anything: the job could not hear its notices, and nobody knew.
    Its first unanswered poll is said, once, naming the URL and the setting; the watch goes
    on (a notice given later is still heard)."""
    import socket

    with socket.socket() as s:  # a port with nobody listening: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/notice"
    source = {"aws": AwsImds, "gcp": GcpMetadata, "azure": AzureScheduledEvents}[cloud](
        url, timeout_s=2.0)
    if cloud == "azure":
        source.vm_name = "vm-h1"
    polls = 0
    stop = threading.Event()
    real_wait = stop.wait

    def wait(timeout):  # (the poll's pause: counts the polls, stops after the third)
        nonlocal polls
        polls += 1
        if polls == 3:
            stop.set()
        return real_wait(0)

    stop.wait = wait
    assert source.next_notice(stop, 0.01) is None and polls == 3
    said = [line for line in capsys.readouterr().err.splitlines() if "did not answer" in line]
    assert len(said) == 1, said
    assert f"{source.name} preemption notice service at {url} did not answer" in said[0]
    assert f"failover.{cloud}_notice_url" in said[0]


def test_close_ends_the_watch_without_a_notice(meta):
    """`close` ends the reads (none outlives its reader to say, after the service is gone,
    that it did not answer) and is no notice: nothing is set, nothing acknowledged."""
    heard: list[str] = []
    watcher = NoticeWatcher(azure_url=meta.urls("h1")["azure"], poll_s=0.05, sigterm=False,
                            on_notice=heard.append)
    with meta.changed:
        assert meta.changed.wait_for(lambda: meta.calls[("h1", "azure")] >= 2, timeout=10)
    watcher.close()
    assert not any(thread.is_alive() for thread in watcher._threads)
    polls = meta.calls[("h1", "azure")]
    meta.preempt("h1")
    watcher.acknowledge()
    assert not watcher.is_set() and heard == [] and meta.acks == []
    assert meta.calls[("h1", "azure")] == polls  # nobody asks any more


@pytest.mark.parametrize("service", ["aws", "azure"])
def test_a_notice_says_when_the_instance_goes(meta, service):
    """AWS's instance-action `time` and Azure's `NotBefore` (whole seconds), read as epoch
    seconds; a time that does not parse is none (the node then leaves at once)."""
    meta.preempt("h1", in_s=100.0)
    source = (AwsImds if service == "aws" else AzureScheduledEvents)(meta.urls("h1")[service])
    notice = source.check()
    assert notice is not None
    assert time.time() + 98 < notice.deadline <= time.time() + 100
    meta.reclaimed_at["h1"] = "soon"
    meta.events["h1"]["NotBefore"] = "soon"
    assert source.check().deadline is None


def test_gcp_says_the_instance_goes_30_s_after_its_notice(meta):
    meta.preempt("h1")
    before = time.time()
    notice = GcpMetadata(meta.urls("h1")["gcp"]).next_notice(threading.Event(), 0.05)
    assert before + 30 <= notice.deadline <= time.time() + 30


def test_a_notice_with_time_to_spare_is_set_its_lead_before_the_instance_goes(meta):
    """AWS says the instance goes in 3 s; with a 1 s lead the watcher says so at once
    (`on_deferred`) and sets its notice 1 s before the instance goes, not when it came. A
    SIGTERM meanwhile (`set`) is acted on at once."""
    deferred: list[tuple[str, float]] = []
    meta.preempt("h1", in_s=3.0)
    reclaimed = calendar.timegm(time.strptime(meta.reclaimed_at["h1"], "%Y-%m-%dT%H:%M:%SZ"))
    watcher = NoticeWatcher(aws_url=meta.urls("h1")["aws"], poll_s=0.05, sigterm=False,
                            lead_s=1.0,
                            on_deferred=lambda s, w, lead: deferred.append((s, w)))
    try:
        assert watcher.notice.wait(10)
        assert time.time() >= reclaimed - 1.0
        assert len(deferred) == 1 and "AWS" in deferred[0][0] and 1.0 < deferred[0][1] <= 2.0
        meta.preempt("h2", in_s=60.0)
        later = NoticeWatcher(aws_url=meta.urls("h2")["aws"], poll_s=0.05, sigterm=False,
                              lead_s=1.0,
                            on_deferred=lambda s, w, lead: deferred.append((s, w)))
        until(lambda: len(deferred) == 2, "the second notice's deferral", 10)
        assert not later.is_set()
        later.set("SIGTERM")
        assert later.is_set() and later.source == "SIGTERM"
        later.close()
    finally:
        watcher.close()


def test_a_notice_that_says_the_instance_goes_in_an_hour_waits_no_longer_than_the_cap(meta):
    """A metadata service (or this host's clock) that puts the end an hour away would keep
    the node training past its real end, turning the notice into a crash: the wait is capped
    at `max_wait_s`, and the deferral says the capped wait."""
    deferred: list[tuple[str, float]] = []
    meta.preempt("h1", in_s=3600.0)
    watcher = NoticeWatcher(aws_url=meta.urls("h1")["aws"], poll_s=0.05, sigterm=False,
                            lead_s=1.0, max_wait_s=0.5,
                            on_deferred=lambda s, w, lead: deferred.append((s, w)))
    try:
        until(lambda: len(deferred) == 1, "the notice's deferral", 10)
        told = time.monotonic()
        assert deferred[0][1] == 0.5
        assert watcher.notice.wait(10)
        assert 0.45 <= time.monotonic() - told < 5.0
    finally:
        watcher.close()


def test_a_job_of_long_iterations_leaves_as_early_as_it_needs(meta):
    """AWS says the instance goes in 60 s; the lead is 1 s, but the node says it needs 50
    (two of its iterations: the one in flight runs to its boundary, the hand-over takes about
    as long): it is told to leave about 10 s from now, not 59."""
    deferred: list[tuple[str, float, float]] = []
    meta.preempt("h1", in_s=60.0)
    watcher = NoticeWatcher(aws_url=meta.urls("h1")["aws"], poll_s=0.05, sigterm=False,
                            lead_s=1.0, needs_s=lambda: 50.0,
                            on_deferred=lambda s, w, lead: deferred.append((s, w, lead)))
    try:
        until(lambda: len(deferred) == 1, "the notice's deferral", 10)
        assert 8.0 < deferred[0][1] <= 10.0, deferred
        assert deferred[0][2] == 50.0  # (the lead it leaves, as the event says it)
        assert not watcher.is_set()
    finally:
        watcher.close()


def test_a_node_needs_two_iterations_and_its_state_s_time_on_the_network():
    """By hand: 1.5 s iterations and 20 GB of weights and optimizer state at 10 Gb/s (160
    Gbit: 16 s) need 2 x 1.5 + 16 = 19 s; the worker gives its watcher this (`needs_s`),
    and the lead is the longer of it and `failover.notice_lead_s`."""
    from spotpipe.notices import leaving_needs_s

    assert leaving_needs_s(1.5, 20e9, 10.0) == pytest.approx(19.0)
    assert leaving_needs_s(0.0, 0, 10.0) == 0.0
