"""Local links: pipeline channels between two CPU workers of one host through shared memory
(spotpipe.runtime.local_link, used by Comm.send/recv).

Checked against the tensors sent (copied before sending), not against the link's own view:
messages arrive in order and intact across more messages than the ring has slots; a peer
that exits, an abort and a stranger's hello each end or refuse what they should; and Comm
takes the link between two nodes of one host but the process group where there is none.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from spotpipe.job import link_slots
from spotpipe.plan.memory import pipeline_ring_slots
from spotpipe.runtime import local_link
from spotpipe.runtime.comm import Comm
from spotpipe.schedule import ScheduleError, check, merged_schedule
from spotpipe.store.abort import AbortSignal, PeerFailure

KEY = b"k" * 32
CHANNEL = local_link.channel_name("node0", "node1", 7)


def _name(node: str = "node1", generation: int = 0) -> bytes:
    return local_link.address(KEY, "test", generation, node)


def _messages(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 16, 8, generator=g) for _ in range(n)]


class _Blocked:
    """Records the waits a link reports (the heartbeat's `waiting`)."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, waiting: bool) -> None:
        self.calls.append(waiting)


def _send_all(n: int, slots: int, name: bytes) -> None:
    sender = local_link.Sender.connect(KEY, name, CHANNEL, slots, 4 * 16 * 8 * 4)
    assert sender is not None
    for message in _messages(n):
        sender.send(message, AbortSignal(), lambda _: None)
    sender.close()


def test_messages_arrive_in_order_and_intact_through_a_ring_smaller_than_the_stream():
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    child = mp.get_context("fork").Process(target=_send_all, args=(50, 3, _name()))
    child.start()
    blocked = _Blocked()
    receiver = listener.accept(CHANNEL, AbortSignal(), blocked)
    got = [receiver.recv(torch.empty(4, 16, 8), AbortSignal(), blocked).clone()
           for _ in range(50)]
    child.join(30)
    assert child.exitcode == 0
    assert all(torch.equal(a, b) for a, b in zip(got, _messages(50), strict=True))
    # then the sender is gone: the next receive fails at once instead of waiting
    with pytest.raises(PeerFailure, match="closed by its sender"):
        receiver.recv(torch.empty(4, 16, 8), AbortSignal(), blocked)
    assert blocked.calls.count(True) == blocked.calls.count(False)  # every wait ended
    listener.close()


def _send_then_hang(name: bytes, ready: mp.Event) -> None:
    sender = local_link.Sender.connect(KEY, name, CHANNEL, 2, 4)
    sender.send(torch.ones(1), AbortSignal(), lambda _: None)
    ready.set()
    time.sleep(120)  # killed by the test


def test_a_peer_killed_mid_stream_ends_the_wait_and_an_abort_ends_a_hung_one():
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    ready = mp.get_context("fork").Event()
    child = mp.get_context("fork").Process(target=_send_then_hang, args=(_name(), ready))
    child.start()
    assert ready.wait(30)
    receiver = listener.accept(CHANNEL, AbortSignal(), lambda _: None)
    assert receiver.recv(torch.empty(1), AbortSignal(), lambda _: None).item() == 1.0

    # a hung peer: the coordinator's abort, once the receiver waits, ends the wait
    abort, calls = AbortSignal(), []

    def blocked(waiting: bool) -> None:
        calls.append(waiting)
        if waiting:
            threading.Thread(target=abort.trigger, args=("node0 stalled",)).start()

    with pytest.raises(PeerFailure, match="node0 stalled"):
        receiver.recv(torch.empty(1), abort, blocked)
    assert calls == [True, False]

    # a killed one: its socket closes, and the wait ends without any abort
    waiter = threading.Timer(0.2, os.kill, args=(child.pid, signal.SIGKILL))
    waiter.start()
    with pytest.raises(PeerFailure, match="closed by its sender"):
        receiver.recv(torch.empty(1), AbortSignal(), lambda _: None)
    child.join(30)
    listener.close()


def test_a_full_ring_holds_the_sender_until_its_receiver_reads_and_an_abort_ends_that_too():
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    sender = local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 4)
    receiver = listener.accept(CHANNEL, AbortSignal(), lambda _: None)
    sender.send(torch.tensor([1.0]), AbortSignal(), lambda _: None)
    sender.send(torch.tensor([2.0]), AbortSignal(), lambda _: None)
    abort = AbortSignal()
    threading.Timer(0.2, abort.trigger, args=("regroup",)).start()
    with pytest.raises(PeerFailure, match="regroup"):  # two unread in two slots
        sender.send(torch.tensor([3.0]), abort, lambda _: None)
    # once one is read, the slot it held takes the next message
    assert receiver.recv(torch.empty(1), AbortSignal(), lambda _: None).item() == 1.0
    sender.send(torch.tensor([3.0]), AbortSignal(), lambda _: None)
    assert [receiver.recv(torch.empty(1), AbortSignal(), lambda _: None).item()
            for _ in range(2)] == [2.0, 3.0]
    sender.close(), receiver.close(), listener.close()


def test_lent_messages_go_back_in_ring_order_and_outlive_both_ends():
    """A replica's gradient is applied in place on another thread and given back then: a
    buffer released early must not be reused before those the sender wrote ahead of it."""
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    sender = local_link.Sender.connect(KEY, _name(), CHANNEL, 3, 8)
    receiver = listener.accept(CHANNEL, AbortSignal(), lambda _: None)
    for i in range(3):
        sender.send_parts([torch.tensor([float(i)]), torch.tensor([10.0 + i])], AbortSignal(),
                          lambda _: None)
    leases = [receiver.take(8, AbortSignal(), lambda _: None) for _ in range(3)]
    assert [lease.tensor.view(torch.float32).tolist() for lease in leases] == \
        [[0.0, 10.0], [1.0, 11.0], [2.0, 12.0]]

    def freed(conn: socket.socket) -> int:  # buffers given back so far (left unread)
        try:
            return len(conn.recv(64, socket.MSG_DONTWAIT | socket.MSG_PEEK))
        except BlockingIOError:
            return 0

    leases[2].release()
    assert freed(sender.conn) == 0  # the last one back first: nothing is free yet
    leases[0].release()
    leases[0].release()  # (idempotent)
    assert freed(sender.conn) == 1
    leases[1].release()
    assert freed(sender.conn) == 3  # the second, and the third that waited for it
    last = receiver.take  # a lease taken, then both ends closed: its message stays whole
    sender.send(torch.tensor([7.0, 8.0]), AbortSignal(), lambda _: None)
    kept = last(8, AbortSignal(), lambda _: None)
    for end in (sender, receiver, listener):
        end.close()
    del sender, receiver, listener, last
    assert kept.tensor.view(torch.float32).tolist() == [7.0, 8.0]
    kept.release()  # to a closed socket: nothing to tell, and no error


def _genuine_taken(listener):
    """The genuine sender's channel, after the refused ones: connected, a message through it
    and received whole. Returns (sender, receiver)."""
    genuine = local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 4)
    genuine.send(torch.tensor([5.0]), AbortSignal(), lambda _: None)
    receiver = listener.accept(CHANNEL, AbortSignal(), lambda _: None)
    assert receiver.recv(torch.empty(1), AbortSignal(), lambda _: None).item() == 5.0
    return genuine, receiver


def test_a_hello_not_under_the_jobs_key_is_refused_and_the_genuine_one_taken():
    refused: list[str] = []
    listener = local_link.Listener(KEY, _name(), refused.append)
    # a stranger who learnt the name: a hello under another key, with memory of its own
    stranger = local_link.Sender.connect(b"x" * 32, _name(), CHANNEL, 2, 4)
    # one under the key that claims more memory than it passes (mapping it would fault)
    short = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    short.connect(_name())
    fd = os.memfd_create("short")
    os.ftruncate(fd, 4)
    hello = local_link._HELLO.pack(CHANNEL, 2, 1 << 20)
    socket.send_fds(short, [hello + local_link._mac(KEY, CHANNEL, 2, 1 << 20)], [fd])
    os.close(fd)
    # and one of the right size that its sender could still shrink under the mapping
    unsealed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unsealed.connect(_name())
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 8)
    socket.send_fds(unsealed, [local_link._HELLO.pack(CHANNEL, 2, 4)
                               + local_link._mac(KEY, CHANNEL, 2, 4)], [fd])
    os.close(fd)
    genuine, receiver = _genuine_taken(listener)
    too_small = ("a local connection repeated a channel or sent memory that is too small or "
                 "could shrink")
    assert refused == ["a local connection's hello did not verify under the job's key",
                       too_small, too_small]
    for end in (stranger, genuine, receiver, listener):
        end.close()
    short.close()
    unsealed.close()


def test_nobody_listening_on_this_host_means_no_link():
    assert local_link.Sender.connect(KEY, _name("node9"), CHANNEL, 2, 4) is None


def _comm(store_port: int, me: str, local_slots: int, out: dict) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=timedelta(seconds=30))
    comm = Comm(store=store, key=KEY, generation=local_slots, nodes=["node0", "node1"], me=me,
                stage_members={}, backend="gloo", device=torch.device("cpu"), timeout_s=30,
                abort=AbortSignal(), namespace="test", local_slots=local_slots)
    try:
        if me == "node0":
            for message in _messages(12):
                comm.send(message, "node1", 5)
            for message in _messages(3):  # each as the concatenation of its rows
                comm.send_concatenated([row.reshape(-1) for row in message], "node1", 6,
                                       ring_slots=4)
            # a fourth built where it will be sent from (a local link's buffer), all but its
            # last row: the send finds those in place and copies only the last
            message = _messages(4)[3]
            buffer = comm.send_buffer("node1", 6)
            out["buffer"] = buffer is not None
            rows = [row.reshape(-1) for row in message]
            if buffer is not None:
                rows[:-1] = [buffer[i * 128: (i + 1) * 128].copy_(row)
                             for i, row in enumerate(rows[:-1])]
            comm.send_concatenated(rows, "node1", 6, ring_slots=4)
            # a message of another shape than its channel's: the receiver knows only the first
            # shape, and on a local link took a smaller one's tail from the message before
            try:
                comm.send(torch.ones(4, 16, 7), "node1", 5)
            except ValueError as exc:
                out["other_shape"] = str(exc)
            comm.send(torch.empty(0, 3), "node1", 8)  # zero-size messages, twice
            comm.send(torch.empty(0, 3), "node1", 8)
            comm.wait_sends()
        else:
            out["got"] = [comm.recv("node0", 5) for _ in range(12)]
            leases = [comm.recv_lent("node0", 6) for _ in range(4)]
            out["lent"] = [lease.tensor.clone() for lease in leases]
            ring = [link.ring for link in comm._links.values() if hasattr(link, "take")]
            out["in_place"] = [any(r.data_ptr() <= lease.tensor.data_ptr()
                                   < r.data_ptr() + r.numel() for r in ring)
                               for lease in leases]
            for lease in leases:
                lease.release()
            out["empty"] = [tuple(comm.recv("node0", 8).shape) for _ in range(2)]
            out["links"] = [type(link).__name__ for link in comm._links.values()]
            out["local_off"] = comm.local_off
        comm.all_reduce(torch.zeros(1))  # both ends done before either closes
    finally:
        comm.close()


def _pair(local_slots: int) -> dict:
    """node0 sends 12 messages to node1, each a Comm on a thread of its own; what node1 got."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    out: dict = {}
    threads = [threading.Thread(target=_comm, args=(server.port, me, local_slots, out))
               for me in ("node0", "node1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("local_slots", [4, 0])
def test_comm_takes_the_local_link_between_nodes_of_one_host_and_the_group_otherwise(
        local_slots):
    out = _pair(local_slots)
    assert all(torch.equal(a, b) for a, b in zip(out["got"], _messages(12), strict=True))
    assert out["links"] == (["Receiver"] * 3 if local_slots else [])
    # a message sent in parts arrives as their concatenation, lent in place on a local link,
    # also one built in the sender's buffer
    assert all(torch.equal(a, b.reshape(-1))
               for a, b in zip(out["lent"], _messages(4), strict=True))
    assert out["in_place"] == [bool(local_slots)] * 4
    assert out["buffer"] == bool(local_slots)  # (the group has no buffer to build in)
    assert out["other_shape"] == ("a torch.float32 message of shape [4, 16, 7] to node1 (tag 5) "
                                  "on a channel of torch.float32 messages of shape [4, 16, 8]")
    assert out["empty"] == [(0, 3), (0, 3)]


def test_a_node_that_cannot_listen_sends_through_the_group_and_says_why(monkeypatch):
    def no_sockets(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(local_link, "Listener", no_sockets)
    out = _pair(4)
    assert all(torch.equal(a, b) for a, b in zip(out["got"], _messages(12), strict=True))
    assert out["links"] == []
    assert out["in_place"] == [False] * 4
    assert out["local_off"] == "cannot listen for local links: [Errno 1] Operation not permitted"


def test_a_stranger_that_connects_and_says_nothing_does_not_hold_up_the_genuine_sender():
    """Abstract socket names are listed in /proc/net/unix to every process of the host, so a
    stranger can connect without the key; one that then says nothing must not stop the
    receiver from taking the genuine sender's hello behind it (it waited for the stranger's
    hello until the generation's abort, and the pipeline with it)."""
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    listed = [line.split()[-1] for line in open("/proc/net/unix").read().splitlines()]
    assert "@" + _name()[1:].decode() in listed  # what the stranger reads
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(_name())
    genuine = local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 4)
    genuine.send(torch.tensor([5.0]), AbortSignal(), lambda _: None)
    abort, got = AbortSignal(), []

    def receive() -> None:
        try:
            receiver = listener.accept(CHANNEL, abort, lambda _: None)
            got.append(receiver.recv(torch.empty(1), abort, lambda _: None).item())
            receiver.close()
        except PeerFailure as why:
            got.append(why)

    taker = threading.Thread(target=receive, daemon=True)
    taker.start()
    taker.join(timeout=30)  # (a guard against a hang: the receive needs no time to pass)
    abort.trigger("the test is over")  # ends a wait that is still held up, if any
    taker.join(timeout=30)
    assert got == [5.0], got
    for end in (stranger, genuine, listener):
        end.close()


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_pipeline_rings_buffers_hold_what_a_schedule_sends_before_its_receiver_reads(kind):
    """GPipe on a node that took over stage 0 from the last stage (owners (P-1, 0)) sends up
    to M/2 activations to stage 1 before it reads one of stage 1's, which meanwhile sends on
    to it: the 256 MiB cap on a ring left messages over 128 MiB 2 buffers, and both nodes
    then blocked on full rings (shown with real links of 2 slots, P=3, M=8)."""
    for microbatches, pipelines in [(8, 1), (16, 1), (4, 2)]:
        m = microbatches * pipelines  # a pipeline's once the others are dropped
        slots = pipeline_ring_slots(200 * 2 ** 20, link_slots(
            SimpleNamespace(num_microbatches=microbatches, pipelines=pipelines)))
        for owners in ([(2, 0), (1,)], [(0, 1), (2,)], [(3, 0), (1,), (2,)],
                       [(0,), (1,), (2,)]):
            check(merged_schedule(kind, m, owners), ring_slots=slots)
    if kind == "gpipe":  # (what the check says of the rings that were too small)
        with pytest.raises(ScheduleError, match="deadlock"):
            check(merged_schedule(kind, 8, [(2, 0), (1,)]), ring_slots=2)


def test_a_full_queue_of_connections_means_no_link_and_a_listener_lost_later_a_failure(
        monkeypatch):
    """Anyone on the host can fill a listener's queue of connections (its name is listed in
    /proc/net/unix): the sender's connect then waited, beyond any abort, and its receiver for
    the header it never sent. Now the group carries that channel. A listener lost once
    connected is the peer's failure, not an OSError out of the send."""
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    strangers = []
    while True:
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.setblocking(False)
        try:
            stranger.connect(_name())
        except BlockingIOError:
            stranger.close()
            break
        strangers.append(stranger)
    got, busy = [], []
    connecting = threading.Thread(target=lambda: got.append(
        local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 4, on_busy=lambda: busy.append(1))),
        daemon=True)
    connecting.start()
    connecting.join(timeout=30)  # (a guard against a hang: no time needs to pass)
    assert got == [None] and busy == [1]  # (said: the move to the group is not silent)
    assert local_link.Sender.connect(KEY, _name(generation=9), CHANNEL, 2, 4,
                                     on_busy=lambda: busy.append(2)) is None
    assert busy == [1]  # nobody listening there: no one to say anything about
    for stranger in strangers:
        stranger.close()
    listener.close()

    listener = local_link.Listener(KEY, _name(generation=1), lambda why: None)
    ring = local_link._ring
    monkeypatch.setattr(local_link, "_ring", lambda *args: (listener.close(), ring(*args))[1])
    with pytest.raises(PeerFailure, match="closed by its receiver"):
        local_link.Sender.connect(KEY, _name(generation=1), CHANNEL, 2, 4)


def test_a_message_that_does_not_fit_its_slot_is_refused_whole():
    """Parts beyond a slot were dropped without a word (a copy into nothing), and a tensor too
    large failed with torch's broadcast error."""
    listener = local_link.Listener(KEY, _name(), lambda why: None)
    sender = local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 8)
    receiver = listener.accept(CHANNEL, AbortSignal(), lambda _: None)
    for parts in ([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [torch.zeros(3)]):
        with pytest.raises(ValueError, match="a 12-byte message on a channel of 8-byte buffers"):
            sender.send_parts(parts, AbortSignal(), lambda _: None)
    sender.send_parts([torch.tensor([4.0]), torch.tensor([5.0])], AbortSignal(), lambda _: None)
    assert receiver.recv(torch.empty(2), AbortSignal(), lambda _: None).tolist() == [4.0, 5.0]
    for end in (sender, receiver, listener):
        end.close()


def test_a_channel_moved_to_the_group_by_a_busy_listener_is_said():
    """The sender's side of a full queue (`Comm._busy`): a refusal the worker's events carry
    (`record_refused`), naming the node and the channel, as the listener's own are."""
    from types import SimpleNamespace

    from spotpipe.runtime.comm import Comm

    heard: list = []
    Comm._busy(SimpleNamespace(_on_refused=heard.append), "node3", 7)
    [refused] = heard
    assert refused.writer == "a local process"
    assert "node3's local link listener had its queue of connections full" in refused.reason
    assert "(tag 7) goes through the process group" in refused.reason


def test_a_keyed_hello_with_a_descriptor_that_is_not_shared_memory_is_refused(tmp_path):
    """A hello under the job's key that passes a file, not a memfd: checking its seals raised
    OSError (EINVAL) out of the listener, which named nothing. It is refused, and the genuine
    sender's channel is taken. (Only a holder of the job's key can send one: a bug, not an
    attack.)"""
    refused: list[str] = []
    listener = local_link.Listener(KEY, _name(), refused.append)
    wrong = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    wrong.connect(_name())
    fd = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 8)  # (as large as the hello says: only its seals are wrong)
    socket.send_fds(wrong, [local_link._HELLO.pack(CHANNEL, 2, 4)
                            + local_link._mac(KEY, CHANNEL, 2, 4)], [fd])
    os.close(fd)
    genuine, receiver = _genuine_taken(listener)
    assert refused == ["a local connection sent a descriptor that is not sealed shared memory"]
    for end in (genuine, receiver, listener):
        end.close()
    wrong.close()


def _flood(name: bytes, count: int, connected, done) -> None:
    """Another user of the host (nobody) connects `count` times and says nothing."""
    os.setgid(65534)
    os.setuid(65534)
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(name)  # (blocks while the listener's queue is full: taken as it drains)
        held.append(s)
    connected.set()
    done.wait(60)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_another_users_connections_are_refused_at_once_and_said_a_bounded_number_of_times():
    """Another user floods the listener with 100 connections that say nothing (more than the
    64 silent ones it keeps): each is refused as it is taken, by its credentials, so none
    takes a place a genuine sender's connection needs, and the refusals (each an event through
    the job's store) are said 8 times, then once that more follow. Before, the flood stayed
    among the silent connections, pushing the oldest out, and every drop was said."""
    refused: list[str] = []
    listener = local_link.Listener(KEY, _name(), refused.append)
    ctx = mp.get_context("fork")
    connected, done = ctx.Event(), ctx.Event()
    flooder = ctx.Process(target=_flood, args=(_name(), 100, connected, done), daemon=True)
    abort, got = AbortSignal(), []

    def receive() -> None:
        receiver = listener.accept(CHANNEL, abort, lambda _: None)
        got.append(receiver.recv(torch.empty(1), abort, lambda _: None).item())
        receiver.close()

    taker = threading.Thread(target=receive, daemon=True)
    taker.start()
    flooder.start()
    assert connected.wait(60)
    deadline = time.monotonic() + 60  # (all 100 taken: a condition, polled)
    while listener._refusals < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    genuine = local_link.Sender.connect(KEY, _name(), CHANNEL, 2, 4)
    assert genuine is not None
    genuine.send(torch.tensor([5.0]), AbortSignal(), lambda _: None)
    taker.join(timeout=30)
    abort.trigger("the test is over")
    done.set()
    flooder.join(timeout=30)
    assert got == [5.0], got
    assert listener._refusals == 100 and not listener._silent
    assert refused[:8] == ["a local connection from another user's process (uid 65534)"] * 8
    assert len(refused) == 9 and refused[8].startswith("more local connections refused ("), \
        refused
    for end in (genuine, listener):
        end.close()
