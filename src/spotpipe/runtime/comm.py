"""Communication for one generation of the job: process groups, point-to-point, and aborts.

torch.distributed does the transport (gloo on CPU, NCCL on GPU), but two things it does not do
are needed here, so this module owns them:

- Re-forming groups in place. Each generation creates fresh process-group objects under its
  own store prefix (`spotpipe/gen<g>/...`) among the nodes still alive, without the global
  default group, so survivors keep their processes and memory. A gloo group with an operation
  pending on a dead peer can block in its destructor, so a closed generation's groups are
  parked for a few generations and then released on one reaper thread, never on the main
  thread: sockets, threads and store connections stay bounded however many generations a job
  goes through.
- Leaving a blocked wait. A gloo receive from a peer that is alive but stuck does not return,
  and a timed-out gloo wait closes the connection, so waits run on a helper thread while the
  main thread waits on an event that either the operation's completion or an abort sets.

A receiver also learns a tensor's shape from a small header sent on first use of a channel;
later messages reuse it, since in a pipeline each boundary's shape is fixed for a run. The
header also says how the channel's messages travel: through the process group, or, between two
CPU workers of one host, through shared memory (runtime/local_link.py, which says why).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spotpipe.plan.memory import link_ring_slots, pipeline_ring_slots
from spotpipe.protocol.auth import Refused
from spotpipe.runtime import local_link
from spotpipe.runtime.activity import Activity
from spotpipe.store.abort import AbortSignal, PeerFailure  # noqa: F401 (re-exported)
from spotpipe.store.sealed import SealedStore
from spotpipe.store.watchers import Connection, connected

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 11  # ndim, dtype code, transport, up to 8 dims
_GROUP, _LOCAL = 0, 1  # transports

# message kinds; the tag is kind * 1024 + source stage, so every channel has its own tag
ACT, GRAD, REPLICA, TIED = 0, 1, 2, 3

_PARKED = 2  # closed generations whose groups are kept before release (see above)


class _Reaper:
    """Releases the groups of old generations on a thread of its own (see the module doc)."""

    def __init__(self) -> None:
        self._parked: list[list[Any]] = []
        self._queue: queue.Queue[list[Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def park(self, things: list[Any]) -> None:
        with self._lock:
            self._parked.append(things)
            old = self._parked[:-_PARKED] if len(self._parked) > _PARKED else []
            self._parked = self._parked[-_PARKED:]
            if old and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="group-reaper",
                                                daemon=True)
                self._thread.start()
        for things in old:
            self._queue.put(things)

    def _loop(self) -> None:
        while True:
            things = self._queue.get()
            things.clear()  # the last references: destructors run here, not on the main thread
            del things


_REAPER = _Reaper()


def tag(kind: int, stage: int) -> int:
    return kind * 1024 + stage


class Waiter:
    """Runs blocking calls (a Work's wait, forming a group, a store wait) on a helper thread, in
    submission order, so that the generation's abort can end the main thread's wait. A call
    abandoned at the abort keeps the thread until its own timeout; the generation is over."""

    def __init__(self, abort: AbortSignal, activity: Activity | None = None) -> None:
        self.abort = abort
        # the worker's main thread between instructions: each wait here is a wait there
        self.activity = activity or Activity()
        self.waiting = False  # the main thread is blocked on a peer (read by the heartbeat)
        self.handoffs = 0  # calls handed to the thread (each costs two thread switches)
        self.idle_at = time.monotonic()  # when the main thread's last wait ended
        self._queue: queue.Queue[tuple[Callable[[], Any], str, threading.Event,
                                       list[str]]] = queue.Queue()
        threading.Thread(target=self._loop, name="comm-waiter", daemon=True).start()

    def stop(self) -> None:
        """End the thread once it is done with what it runs (a call abandoned at the abort
        ends at its own timeout)."""
        self._queue.put(None)  # type: ignore[arg-type]

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, failure, done, errors = item
            try:
                call()
            except BaseException as exc:  # a dead peer: connection closed, or a timeout
                errors.append(f"{failure}: {exc}".splitlines()[0][:300])
                self.abort.trigger(errors[0])
            done.set()

    def wait(self, work: Any) -> None:
        self.call(work.wait, "communication failed")

    def blocked(self, waiting: bool) -> None:
        """The main thread waits on a peer itself (a local link's poll), or stopped."""
        self.waiting = waiting
        if waiting:
            self.activity.wait_began()
        else:
            self.idle_at = time.monotonic()
            self.activity.wait_ended()

    def call(self, call: Callable[[], Any], failure: str) -> None:
        """`call()`; PeerFailure (`failure`: the error) if it fails or the abort comes first."""
        self.abort.check()
        done, errors = threading.Event(), []
        self.handoffs += 1
        self._queue.put((call, failure, done, errors))
        self.waiting = True
        self.activity.wait_began()
        try:
            self.abort.wait(done)
        finally:
            self.idle_at = time.monotonic()
            self.waiting = False
            self.activity.wait_ended()
        if errors:
            raise PeerFailure(errors[0])


def _make_group(backend: str, store: dist.Store, rank: int, size: int,
                timeout: timedelta) -> Any:
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Comm:
    """The process groups of one generation and the operations the runtime needs on them.

    `nodes` is the generation's membership in rank order; `stage_members[s]` lists the nodes
    owning stage s across pipelines (its data-parallel group), in pipeline order.
    """

    def __init__(self, *, store: Connection, key: bytes, generation: int, nodes: Sequence[str],
                 me: str, stage_members: dict[int, list[str]], backend: str,
                 device: torch.device, timeout_s: float, abort: AbortSignal,
                 namespace: str = "spotpipe", local_slots: int = 0,
                 on_refused: Callable[[Refused], None] | None = None,
                 activity: Activity | None = None, group: str = "world") -> None:
        """`store`: the generation's own connection, or how to get one
        (`SpareConnections.take`), then got on the waiter's thread, where the generation's
        abort ends a wait for it as any other (a new connection can take seconds).
        `key`: the job's; the groups' rendezvous records are sealed under it
        (store/sealed.py), so that nobody without it can slip an address of theirs into a
        group. `on_refused` hears of every record there that does not verify.
        `local_slots`: messages a local link buffers per channel (0: no local links); the
        most a schedule sends on one channel before its receiver takes them. `activity`: the
        worker's main thread between instructions, which this comm's waits mark
        (`runtime.activity`). `group`: the name of the group of all `nodes` under the
        generation's prefix (another than "world" for a second group of one generation:
        the nodes that hand their stages over on a notice, `runtime.reshape`)."""
        self.generation = generation
        self.nodes = list(nodes)
        self.me = me
        self.rank = self.nodes.index(me)
        self.device = device
        self.abort = abort
        self.waiter = Waiter(abort, activity)
        self.world: Any = None
        self.data_parallel: dict[int, tuple[Any, int]] = {}
        # the generation's own connection (see _form_groups, wait_keys), referenced as long
        # as the groups may use it: they hold only its C++ side
        self._store: dist.Store | None = None
        self._sealed: SealedStore | None = None
        # the listener exists before the groups form, so before any peer can send to it
        self._key, self._namespace, self._local_slots = key, namespace, local_slots
        self._on_refused = on_refused
        self._listener = None
        self.local_off: str | None = None  # why this node has no local links, if it has none
        if local_slots > 0 and device.type == "cpu":
            try:
                self._listener = local_link.Listener(
                    key, local_link.address(key, namespace, generation, me),
                    lambda why: on_refused(Refused(why, writer="a local process"))
                    if on_refused is not None else None)
            except OSError as exc:  # no Unix sockets here (a sandbox): peers use the group
                self.local_off = f"cannot listen for local links: {exc}"
        self._links: dict[tuple[str, int, int], Any] = {}
        self._form_groups(store, f"{namespace}/gen{generation}", stage_members, backend,
                          timeout_s, on_refused, world_group=group)
        self._shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._early: dict[tuple[str, int, int], tuple[Any, torch.Tensor]] = {}

    def _form_groups(self, store: Connection, prefix: str,
                     stage_members: dict[int, list[str]], backend: str, timeout_s: float,
                     on_refused: Callable[[Refused], None] | None,
                     world_group: str = "world") -> None:
        """The world group, then the data-parallel groups of this node's stages.

        Forming a gloo group blocks until every member has published its address and every
        pair has connected; a member lost meanwhile (a spot node may go while the job
        reshapes) would hold the others there until `timeout`, or break the mesh under them.
        So the groups form on the waiter's thread, and the generation's abort (set
        by the coordinator when it learns of the loss) or a broken connection ends the wait
        with PeerFailure: the node reports, like any survivor, and waits for the next plan.
        """
        timeout = timedelta(seconds=timeout_s)

        def form() -> None:
            self._store = connected(store)
            sealed = self._sealed = SealedStore(self._store, self._key,
                                                wait_genuine_s=timeout_s, on_refused=on_refused)
            self.world = _make_group(backend, dist.PrefixStore(f"{prefix}/{world_group}", sealed),
                                     self.rank, len(self.nodes), timeout)
            # created in stage order on every member, so that two nodes sharing two groups
            # never wait for each other in opposite orders
            for stage in sorted(stage_members):
                members = stage_members[stage]
                if self.me in members and len(members) > 1:
                    group = _make_group(backend, dist.PrefixStore(f"{prefix}/dp{stage}", sealed),
                                        members.index(self.me), len(members), timeout)
                    self.data_parallel[stage] = (group, len(members))

        self.waiter.call(form, "forming the process groups failed")

    def close(self) -> None:
        """The generation is over: stop its waiter thread and park its groups for release."""
        self.waiter.stop()
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.abort.release()
        groups = [self.world] + [g for g, _ in self.data_parallel.values()]
        _REAPER.park([g for g in groups + [self._sealed, self._store] if g is not None])
        self.world, self.data_parallel, self._store, self._sealed = None, {}, None, None
        self._pending.clear()
        self._early.clear()

    def wait_keys(self, keys: list[str], timeout_s: float, what: str) -> None:
        """Wait until `keys` exist in the store (what peers publish while the job reshapes),
        ended like any communication by the generation's abort: a peer lost before it
        published would otherwise hold this node for the whole timeout. The wait runs on the
        generation's own store connection, so an abandoned one holds up nothing else."""
        store = self._store
        assert store is not None, "wait_keys on groups that are closed"
        self.waiter.call(lambda: store.wait(keys, timedelta(seconds=timeout_s)),
                         f"waiting for {what} failed")

    @contextlib.contextmanager
    def waiting_on_peer(self) -> Iterator[None]:
        """Mark a wait of the main thread on a peer that does not go through the waiter (a
        rendezvous read that polls past a squatter's value for the peer's own): for the hang
        watches it waits, it does not compute."""
        self.waiter.blocked(True)
        try:
            yield
        finally:
            self.waiter.blocked(False)

    def _post(self, op: Any, *args: Any) -> Any:
        """Start an operation; a peer already gone makes gloo raise right here, not at wait."""
        self.abort.check()
        try:
            return op(*args)
        except RuntimeError as exc:
            reason = f"communication failed: {exc}".splitlines()[0][:300]
            self.abort.trigger(reason)
            raise PeerFailure(reason) from None

    # ------------------------------------------------------------------ point to point

    def send(self, tensor: torch.Tensor, node: str, tag_: int) -> None:
        """Asynchronous; completed by `wait_sends` (at the latest before the reduction). On a
        local link the tensor is copied out before this returns."""
        tensor = tensor.detach().contiguous()
        self._send([tensor.reshape(-1)], tensor.shape, node, tag_)

    def send_concatenated(self, parts: Sequence[torch.Tensor], node: str, tag_: int,
                          ring_slots: int) -> None:
        """The 1-d `parts` (one dtype) as one message, as `send` would send their
        concatenation; on a local link each part is copied straight into the shared buffer
        (a stage's gradients for its replica: one copy of them instead of two).
        `ring_slots`: the most messages its local link buffers (at least 2)."""
        parts = [p.detach() for p in parts]
        self._send(parts, torch.Size([sum(p.numel() for p in parts)]), node, tag_, ring_slots)

    def send_buffer(self, node: str, tag_: int) -> torch.Tensor | None:
        """Where the next message on this channel will be sent from, typed as its messages,
        when the channel is a local link (after its first message): a writer may build the
        message there, and `send_concatenated` does not copy the parts it finds in place.
        None for a channel through the process group, or not used yet."""
        key = ("send", self.nodes.index(node), tag_)
        link = self._links.get(key)
        if link is None:
            return None
        shape, dtype = self._shapes[key]
        return self._local(link.buffer)[: shape.numel() * dtype.itemsize].view(dtype)

    def _send(self, parts: list[torch.Tensor], shape: torch.Size, node: str, tag_: int,
              ring_slots: int | None = None) -> None:
        self.abort.check()
        dst = self.nodes.index(node)
        dtype = parts[0].dtype
        key = ("send", dst, tag_)
        if key not in self._shapes:
            if len(shape) > _HEADER - 3:
                raise ValueError(f"cannot send a {len(shape)}-d tensor between stages "
                                 f"(at most {_HEADER - 3} dimensions)")
            link = self._connect(node, tag_, shape.numel() * parts[0].element_size(),
                                 ring_slots)
            if link is not None:
                self._links[key] = link
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = len(shape)
            header[1] = _DTYPES.index(dtype)
            header[2] = _GROUP if link is None else _LOCAL
            header[3: 3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
            header = header.to(self.device)
            self._pending.append((self._post(self.world.send, [header], dst, tag_), header))
            self._shapes[key] = (shape, dtype)
        elif self._shapes[key] != (shape, dtype):
            raise ValueError(self._not_the_channels(key, shape, dtype, node, tag_))
        link = self._links.get(key)
        if link is not None:
            self._local(link.send_parts, parts)
        else:
            whole = parts[0] if len(parts) == 1 else torch.cat(parts)
            self._pending.append((self._post(self.world.send, [whole.view(shape)], dst, tag_),
                                  whole))

    def _not_the_channels(self, key: tuple[str, int, int], shape: torch.Size,
                          dtype: torch.dtype, node: str, tag_: int) -> str:
        """Why a message cannot go on its channel: its receiver knows only the first
        message's shape (the header), and would take a smaller one's bytes from the last
        (a local link) or fail on it (the group)."""
        first_shape, first_dtype = self._shapes[key]
        return (f"a {dtype} message of shape {list(shape)} to {node} (tag {tag_}) on a "
                f"channel of {first_dtype} messages of shape {list(first_shape)}")

    def _connect(self, node: str, tag_: int, nbytes: int, ring_slots: int | None) -> Any:
        """A local link for the channel to `node` if it runs on this host, else None."""
        if self._listener is None:
            return None
        nbytes = max(8, nbytes)  # (a zero-size message too: a slot every dtype can view)
        # (what the launch's estimate counts)
        slots = pipeline_ring_slots(nbytes, self._local_slots) if ring_slots is None \
            else link_ring_slots(nbytes, ring_slots)
        try:
            return local_link.Sender.connect(
                self._key, local_link.address(self._key, self._namespace, self.generation,
                                              node),
                local_link.channel_name(self.me, node, tag_), slots, nbytes,
                on_busy=lambda: self._busy(node, tag_))
        except PeerFailure as exc:  # the generation's, as any (`_local`)
            self.abort.trigger(str(exc))
            raise

    def _busy(self, node: str, tag_: int) -> None:
        """Say that `node`'s local listener had its queue of connections full (someone on the
        host connects without ever saying hello), so that the channel's move to the process
        group, slower but the same messages, is not silent."""
        if self._on_refused is not None:
            self._on_refused(Refused(
                f"{node}'s local link listener had its queue of connections full (a process "
                f"on this host that connects and says nothing?): the channel to it (tag "
                f"{tag_}) goes through the process group", writer="a local process"))

    def recv(self, node: str, tag_: int) -> torch.Tensor:
        """The next tensor on this channel.

        After the first message, the receive for the next one is posted as soon as this one
        is taken, so the transfer overlaps the computation in between instead of starting
        when the schedule reaches its receive (1F1B puts every such latency on the critical
        path). Messages on a channel match in order, so the early receive cannot take another
        channel's tensor.
        """
        key = self._receiving(node, tag_)
        link = self._links.get(key)
        if link is not None:
            shape, dtype = self._shapes[key]
            return self._local(link.recv, torch.empty(shape, dtype=dtype))
        posted = self._early.pop(key, None)
        if posted is None:
            posted = self._post_data_recv(key, key[1], tag_)
        work, out = posted
        self.waiter.wait(work)
        self._early[key] = self._post_data_recv(key, key[1], tag_)
        return out

    def recv_lent(self, node: str, tag_: int) -> local_link.Lease:
        """The next tensor on this channel, lent: on a local link it is read in place, not
        copied, and its buffer goes back to the sender when the lease is released (a
        replica's gradient, applied later on another thread). Nothing is posted ahead: with a
        core per stage, as in `bench redundancy`, an early receive of a replica's gradient
        competed with the node's last backward, and the iteration was no faster (4 runs)."""
        key = self._receiving(node, tag_)
        shape, dtype = self._shapes[key]
        link = self._links.get(key)
        if link is not None:
            nbytes = shape.numel() * dtype.itemsize
            lease = self._local(link.take, nbytes)
            lease.tensor = lease.tensor.view(dtype).view(shape)
            return lease
        work, out = self._post_data_recv(key, key[1], tag_)
        self.waiter.wait(work)
        return local_link.Lease(out, None)

    def _receiving(self, node: str, tag_: int) -> tuple[str, int, int]:
        """The channel's key, once its header (shape, dtype, transport) has come."""
        src = self.nodes.index(node)
        key = ("recv", src, tag_)
        if key not in self._shapes:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self.waiter.wait(self._post(self.world.recv, [header], src, tag_))
            h = header.tolist()
            self._shapes[key] = (torch.Size(h[3: 3 + h[0]]), _DTYPES[h[1]])
            if h[2] == _LOCAL:
                if self._listener is None:
                    raise PeerFailure(f"communication failed: {node} offered a local link "
                                      "to a node without one")
                self._links[key] = self._local(self._listener.accept,
                                               local_link.channel_name(node, self.me, tag_))
        return key

    def _local(self, op: Callable[..., Any], *args: Any) -> Any:
        """A local link's operation, its waits ended by the abort; its failure is the
        generation's, as a process group's is (Waiter)."""
        try:
            return op(*args, self.abort, self.waiter.blocked)
        except PeerFailure as exc:
            self.abort.trigger(str(exc))
            raise

    def _post_data_recv(self, key: tuple[str, int, int], src: int,
                        tag_: int) -> tuple[Any, torch.Tensor]:
        shape, dtype = self._shapes[key]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return self._post(self.world.recv, [out], src, tag_), out

    def post_send(self, tensor: torch.Tensor, node: str, tag_: int) -> Any:
        """A raw asynchronous send of a tensor whose shape the receiver knows."""
        return self._post(self.world.send, [tensor], self.nodes.index(node), tag_)

    def post_recv(self, tensor: torch.Tensor, node: str, tag_: int) -> Any:
        return self._post(self.world.recv, [tensor], self.nodes.index(node), tag_)

    def wait(self, work: Any) -> None:
        self.waiter.wait(work)

    def wait_all(self, works: Sequence[Any]) -> None:
        """Complete `works` in order, in one hand-off to the waiter's thread."""
        self.waiter.call(lambda: [work.wait() for work in works], "communication failed")

    def wait_sends(self) -> None:
        """Complete every send posted so far, in one hand-off to the waiter's thread rather
        than one per send (an iteration of 1F1B posts M of them)."""
        pending, self._pending = self._pending, []  # (the tensors stay alive meanwhile)
        if pending:
            self.wait_all([work for work, _ in pending])

    # ------------------------------------------------------------------ collectives

    def all_reduce_dp(self, stage: int, tensor: torch.Tensor) -> None:
        """Sum over the pipelines' owners of `stage` (no-op with one pipeline)."""
        if stage not in self.data_parallel:
            return
        group, _ = self.data_parallel[stage]
        self.waiter.wait(self._post(group.allreduce, [tensor]))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every node's tensor (same shape everywhere), in rank order."""
        if len(self.nodes) == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in self.nodes]
        self.waiter.wait(self._post(self.world.allgather, [out], [tensor]))
        return out

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if len(self.nodes) > 1:
            self.waiter.wait(self._post(self.world.allreduce, [tensor]))
