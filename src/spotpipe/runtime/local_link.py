"""Point-to-point between two workers of one host through shared memory.

Why our own transport: gloo moves a tensor between two processes of one machine over loopback
TCP. Each message costs the sender a socket write of the whole tensor (0.2-0.25 ms for the
bench GPT's 128 KiB activations) and the receiver a read plus two thread switches (the wait
runs on `comm.Waiter`'s thread so that an abort can end it), and gloo's I/O thread competes with
the stage's compute on its core. A pipeline of one host pays that for every activation and
every gradient. torch.distributed has no shared-memory transport for CPU tensors, so pipeline
channels between co-located workers use this one:

- The sender maps a ring of `slots` buffers in a memfd, passes the memfd to the receiver over a
  Unix socket once, and then per message copies the tensor into the next buffer and writes one
  byte on the socket. The receiver waits for that byte, copies the buffer out and writes one
  byte back, which frees the buffer. A message costs two memcpys and two one-byte syscalls.
- Every wait is a `poll` on the socket and the generation's abort (`AbortSignal.wakeup_fd`)
  on the calling thread: no helper thread is needed, and an abort, a peer that exits (the
  socket closes: PeerFailure, as a broken gloo connection gives) or a hung peer (the
  coordinator's abort) ends it as it ends gloo's waits.
- A sender blocks only when `slots` messages of one channel are unread. Pipeline schedules send
  at most one iteration's micro-batches on a channel before its receiver reads them, and the
  runtime sizes `slots` to that, so the block is a bound on memory, not a step of the schedule
  (with fewer, GPipe on a node that runs the last stage and the first deadlocks:
  `plan.memory.pipeline_ring_slots`). A message must fit its slot (ValueError otherwise).

Who is local: each `Listener` binds an abstract Unix socket whose name is an HMAC of the job's
key, the generation and the node. A sender that can connect to its receiver's name is on the
same host (and network namespace); one that cannot (also when the listener's queue of
connections is full, which anyone on the host can make it) uses the process group, and one
that connects and then loses the listener fails with PeerFailure. Names nobody
without the key can compute cannot be squatted, and the receiver still checks each
connection's hello (an HMAC of the channel under the key), and that the memory is as large as
the hello says and sealed against shrinking, before it maps anything. Anyone on the host can
connect all the same (/proc/net/unix lists the names), so the listener waits for the hellos
of all its connections at once: one that says nothing holds up none of the others. A
connection from another user's process (its credentials, SO_PEERCRED) is refused at once,
before it can take one of the listener's places for silent connections: only a process of the
job's own user, which could read the workers' memory anyway, can crowd a genuine sender out.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import mmap
import os
import select
import socket
import struct
import threading
from collections.abc import Callable

import torch

from spotpipe.store.abort import AbortSignal, PeerFailure

_HELLO = struct.Struct("!32sII")  # channel name, slots, slot bytes
_MAC = 32
_MAX_READ = 4096  # notification bytes read at once (each one message)
_MAX_SILENT = 64  # connections without a hello kept at once (the oldest goes beyond that)
# refusals a listener says (each a `record_refused` event through the store); beyond that it
# says once that it goes on refusing: a flood of connections must not flood the job's store
_REFUSALS_SAID = 8
_CREDS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# the ring's size is fixed for good before the receiver maps it: memory that its sender could
# shrink under the mapping would kill the reader with SIGBUS instead of a PeerFailure
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def address(key: bytes, namespace: str, generation: int, node: str) -> bytes:
    """The abstract socket name a node of a generation listens on (see the module doc)."""
    digest = hmac.new(key, f"local-link/{namespace}/gen{generation}/{node}".encode(),
                      hashlib.sha256).hexdigest()[:40]
    return b"\0spotpipe-" + digest.encode()


def _mac(key: bytes, channel: bytes, slots: int, nbytes: int) -> bytes:
    return hmac.new(key, b"local-link-hello" + _HELLO.pack(channel, slots, nbytes),
                    hashlib.sha256).digest()


def _wait_readable(sock: socket.socket, abort: AbortSignal,
                   blocked: Callable[[bool], None]) -> None:
    """Until `sock` has data (or its peer closed it); PeerFailure if the abort comes first."""
    _wait_any([sock], abort, blocked)


def _wait_any(socks: list[socket.socket], abort: AbortSignal,
              blocked: Callable[[bool], None]) -> list[socket.socket]:
    """Until some of `socks` have data (or their peers closed them): those; PeerFailure if the
    abort comes first. (poll, not select: a worker's descriptors can number past select's
    1024.)"""
    abort.check()
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    if not ready:
        poller.register(abort.wakeup_fd(), select.POLLIN)
        blocked(True)
        try:
            while not any(sock.fileno() in ready for sock in socks):
                ready = {fd for fd, _ in poller.poll()}
                abort.check()
        finally:
            blocked(False)
    return [sock for sock in socks if sock.fileno() in ready]


def _lost(peer: str, exc: OSError | None = None) -> PeerFailure:
    """A broken link, named as gloo's broken connections are (a reset is a close: a peer that
    exits with our bytes unread resets the connection instead of closing it)."""
    if exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return PeerFailure(f"communication failed: local link closed by {peer}")
    return PeerFailure(f"communication failed: local link to {peer}: {exc}")


def _read(conn: socket.socket, peer: str) -> int:
    """How many one-byte notes have come (each a message, or a freed slot)."""
    try:
        data = conn.recv(_MAX_READ)
    except OSError as exc:
        raise _lost(peer, exc) from None
    if not data:
        raise _lost(peer)
    return len(data)


def _connected(name: bytes, on_busy: Callable[[], None] | None = None) -> socket.socket | None:
    """A connection to the listener `name`, or None if there is none from here. Not blocking:
    anyone on the host can fill a listener's queue of connections that nobody has taken yet
    (its name is listed in /proc/net/unix), and a blocking connect would then wait, beyond
    any abort, for a receive that waits for this sender's header. A full queue (EAGAIN) is
    told to `on_busy`: the listener is on this host, and somebody is keeping it busy."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.setblocking(False)
    try:
        conn.connect(name)
    except BlockingIOError:  # on this host, its queue full
        conn.close()
        if on_busy is not None:
            on_busy()
        return None
    except OSError:  # not on this host (or network namespace)
        conn.close()
        return None
    conn.setblocking(True)
    return conn


def _ring(fd: int, slots: int, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    memory = mmap.mmap(fd, slots * nbytes)
    return memory, torch.frombuffer(memory, dtype=torch.uint8).view(slots, nbytes)


class Listener:
    """The socket a node's local senders connect to, for one generation; connections are
    taken when a receive first needs them (`accept`)."""

    def __init__(self, key: bytes, name: bytes, on_refused: Callable[[str], None]) -> None:
        self.key, self.on_refused = key, on_refused
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(name)
        self.sock.listen(64)
        self._arrived: dict[bytes, tuple[socket.socket, int, int, int]] = {}
        self._silent: list[socket.socket] = []  # connections whose hello has not come yet
        self._refusals = 0

    def close(self) -> None:
        self.sock.close()
        for conn, fd, _, _ in self._arrived.values():
            conn.close()
            os.close(fd)
        self._arrived.clear()
        for conn in self._silent:
            conn.close()
        self._silent.clear()

    def accept(self, channel: bytes, abort: AbortSignal,
               blocked: Callable[[bool], None]) -> Receiver:
        """The receiving end of `channel`, once its sender's connection has arrived. New
        connections and the hellos of those taken are awaited together (see the module doc)."""
        while channel not in self._arrived:
            ready = _wait_any([self.sock, *self._silent], abort, blocked)
            for conn in ready[1:] if ready[0] is self.sock else ready:
                self._silent.remove(conn)
                self._hello(conn)
            if ready[0] is self.sock:
                self._take_connection()
        conn, fd, slots, nbytes = self._arrived.pop(channel)
        try:
            return Receiver(conn, fd, slots, nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        conn.close()
        self._refusals += 1
        if self._refusals <= _REFUSALS_SAID:
            self.on_refused(reason)
        elif self._refusals == _REFUSALS_SAID + 1:
            self.on_refused(f"more local connections refused ({reason}); the rest of this "
                            "generation's refusals are not said one by one")

    def _take_connection(self) -> None:
        """A new connection, kept until its hello comes; beyond `_MAX_SILENT` without one, the
        oldest is dropped (a genuine sender's hello comes with its connection). One from
        another user's process is refused at once (see the module doc)."""
        conn, _ = self.sock.accept()
        _, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _CREDS.size))
        if uid != os.geteuid():
            self._refuse(conn, f"a local connection from another user's process (uid {uid})")
            return
        self._silent.append(conn)
        if len(self._silent) > _MAX_SILENT:
            self._refuse(self._silent.pop(0), "a local connection sent no hello")

    def _hello(self, conn: socket.socket) -> None:
        """Take the hello of `conn`, which has data (or was closed by its peer)."""
        try:
            data, fds, _, _ = socket.recv_fds(conn, _HELLO.size + _MAC, 1)
        except OSError as exc:
            self._refuse(conn, f"a local connection failed: {exc}")
            return
        if len(data) != _HELLO.size + _MAC or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._refuse(conn, "a local connection sent no valid hello")
            return
        channel, slots, nbytes = _HELLO.unpack(data[:_HELLO.size])
        if not hmac.compare_digest(data[_HELLO.size:], _mac(self.key, channel, slots, nbytes)):
            os.close(fds[0])
            self._refuse(conn, "a local connection's hello did not verify under the job's key")
            return
        try:
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        except OSError:  # (EINVAL: a file or pipe, which has no seals)
            os.close(fds[0])
            self._refuse(conn, "a local connection sent a descriptor that is not sealed shared "
                               "memory")
            return
        if channel in self._arrived or os.fstat(fds[0]).st_size < slots * nbytes \
                or seals & _SEALS != _SEALS:
            os.close(fds[0])  # (a channel connects once per generation)
            self._refuse(conn, "a local connection repeated a channel or sent memory that is "
                               "too small or could shrink")
            return
        self._arrived[channel] = (conn, fds[0], slots, nbytes)


class Sender:
    """The sending end of one channel: a ring of `slots` buffers of `nbytes` in shared memory."""

    def __init__(self, conn: socket.socket, fd: int, slots: int, nbytes: int) -> None:
        self.conn, self.slots, self.nbytes = conn, slots, nbytes
        self._memory, self.ring = _ring(fd, slots, nbytes)
        self.sent = self.freed = 0

    @classmethod
    def connect(cls, key: bytes, name: bytes, channel: bytes, slots: int, nbytes: int,
                on_busy: Callable[[], None] | None = None) -> Sender | None:
        """A channel to the listener `name`, or None if none can be made from here (nobody
        listens there from this host, its queue of connections is full, no shared memory):
        the process group carries it. `on_busy` hears of a full queue, the one of these
        that someone else makes. PeerFailure if the listener fails once connected."""
        conn = _connected(name, on_busy)
        if conn is None:
            return None
        try:
            fd = os.memfd_create("spotpipe-link", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:  # no memfd here: the listener drops the connection without a hello
            conn.close()
            return None
        try:
            try:
                os.ftruncate(fd, slots * nbytes)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                sender = cls(conn, fd, slots, nbytes)
            except OSError:  # no memory for the ring: as above
                conn.close()
                return None
            try:
                socket.send_fds(conn, [_HELLO.pack(channel, slots, nbytes)
                                       + _mac(key, channel, slots, nbytes)], [fd])
            except OSError as exc:  # connected, then lost: not a link we may do without
                conn.close()
                raise _lost("its receiver", exc) from None
        finally:
            os.close(fd)  # the mapping and the receiver's copy keep the memory
        return sender

    def send(self, tensor: torch.Tensor, abort: AbortSignal,
             blocked: Callable[[bool], None]) -> None:
        self.send_parts([tensor.reshape(-1)], abort, blocked)

    def send_parts(self, parts: list[torch.Tensor], abort: AbortSignal,
                   blocked: Callable[[bool], None]) -> None:
        """One message: the 1-d `parts` (one dtype) one after another, each copied straight
        into the slot, so that a message gathered from many tensors (a stage's gradients) is
        copied once rather than concatenated first; a part already in its place there (see
        `buffer`) is not copied at all."""
        nbytes = sum(part.numel() for part in parts) * parts[0].element_size()
        if nbytes > self.nbytes:  # (its parts would be cut off, or the first fail to copy)
            raise ValueError(f"a {nbytes}-byte message on a channel of {self.nbytes}-byte "
                             "buffers")
        slot = self.buffer(abort, blocked)[:nbytes].view(parts[0].dtype)
        at = 0
        for part in parts:
            place = slot[at: at + part.numel()]
            if place.data_ptr() != part.data_ptr():
                place.copy_(part)
            at += part.numel()
        try:
            self.conn.send(b"\1")
        except OSError as exc:
            raise _lost("its receiver", exc) from None
        self.sent += 1

    def buffer(self, abort: AbortSignal, blocked: Callable[[bool], None]) -> torch.Tensor:
        """The buffer (bytes) the next message will be sent from, once its receiver is done
        with what it held: a writer may build the message there (`send_parts` then finds it
        in place)."""
        # freed slots are read only when the ring looks full: a read that finds nothing costs
        # 25 us in Python, a quarter of the message
        while self.sent - self.freed >= self.slots:
            _wait_readable(self.conn, abort, blocked)
            self.freed += _read(self.conn, "its receiver")
        return self.ring[self.sent % self.slots]

    def close(self) -> None:
        self.conn.close()


class Lease:
    """A message read in place, in its ring buffer, which goes back to the sender on `release`
    (idempotent). Until then the sender cannot overwrite it, and the memory outlives the link
    (the tensor holds the mapping): a message whose sender is lost stays whole."""

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None] | None) -> None:
        self.tensor = tensor
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class Receiver:
    """The receiving end of one channel (made by `Listener.accept`)."""

    def __init__(self, conn: socket.socket, fd: int, slots: int, nbytes: int) -> None:
        self.conn, self.slots, self.nbytes = conn, slots, nbytes
        self._memory, self.ring = _ring(fd, slots, nbytes)
        self.received = self.ready = 0
        # buffers go back in ring order: one released early waits for those before it, since
        # the sender reuses them in that order (`_give_back`)
        self._lock = threading.Lock()
        self._returned: set[int] = set()
        self._freed = 0

    def recv(self, out: torch.Tensor, abort: AbortSignal,
             blocked: Callable[[bool], None]) -> torch.Tensor:
        """The next message, copied into `out` (whose size must be the channel's)."""
        lease = self.take(out.numel() * out.element_size(), abort, blocked)
        out.copy_(lease.tensor.view(out.dtype).view(out.shape))
        lease.release()
        return out

    def take(self, nbytes: int, abort: AbortSignal, blocked: Callable[[bool], None]) -> Lease:
        """The next message's first `nbytes`, in place (no copy), until it is released."""
        if nbytes > self.nbytes:
            raise ValueError(f"a {nbytes}-byte message on a channel of {self.nbytes}-byte "
                             "buffers")
        while self.ready == 0:
            _wait_readable(self.conn, abort, blocked)
            self.ready += _read(self.conn, "its sender")
        index = self.received
        self.ready -= 1
        self.received += 1
        return Lease(self.ring[index % self.slots][:nbytes], lambda: self._give_back(index))

    def _give_back(self, index: int) -> None:
        with self._lock:  # (the replica's thread releases what the main thread took)
            self._returned.add(index)
            freed = self._freed
            while self._freed in self._returned:
                self._returned.remove(self._freed)
                self._freed += 1
            if self._freed > freed:
                try:
                    self.conn.send(b"\1" * (self._freed - freed))
                except OSError:  # the sender is gone after its last message: that one is
                    pass  # whole, and the next receive hears of the loss

    def close(self) -> None:
        self.conn.close()


def channel_name(src: str, dst: str, tag: int) -> bytes:
    """The channel's name in hellos: fixed width, so that hellos have one size."""
    return hashlib.sha256(f"{src}->{dst}#{tag}".encode()).digest()
