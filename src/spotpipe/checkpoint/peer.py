"""Gemini-style checkpoints (Wang et al., SOSP '23): a copy of each stage in a peer's CPU memory.

Every k iterations the writer of a stage (pipeline 0's owner) copies the stage state into one
flat byte buffer and sends it over torch.distributed point-to-point, in the generation's own
groups (`Comm`, message kinds CKPT and CKPT_DATA), to its peer: the node that holds the stage's
replica in the ring (the owner of the previous stage of pipeline 0), or, when that is the writer
itself (one stage, or a node carrying two), the next node of the ring that is not. The peer
keeps the latest complete copy of each stage it is peer for, in CPU memory, and lets go of the
copies of stages it no longer keeps at its next checkpoint.

The transfer overlaps training: the sends and receives are posted at the boundary (a small
header carrying the size first, which the peer waits for, then the data), and a helper thread
per transfer waits for its completion (a gloo operation says it is complete only once waited
for), so that a copy counts as held from the moment it arrived, even if the next iteration
fails. The main thread reports completed copies at the next boundary, and waits for the previous
copy before starting another (Gemini's single checkpoint in flight). A transfer of a generation
that ended is abandoned; the held copies stay.

The layout (names, dtypes, shapes) of a stage's buffer travels as JSON through the store, so
nothing is unpickled from the network: the writer puts it with every copy (a re-partition
changes a stage's layers in place, and the stage's writer may change and change back), and the
header carries a digest of it, by which the peer reads the new one and keeps with each copy the
layout that copy was cut by. The store is anyone's to write: a layout that is missing, refused
by the seal, not the header's digest, or not a layout of the copy's size
(`snapshot.read_layout`) is a `checkpoint_failed` event naming the key and the writer, never
an error out of the boundary. The copy's bytes are received all the same (left in the channel,
they would be taken for the next copy's) and dropped; the copy held before stays.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from spotpipe.checkpoint import durable, snapshot
from spotpipe.protocol import keys
from spotpipe.checkpoint.schemes import Boundary, Scheme, SchemeContext
from spotpipe.protocol.auth import Refused
from spotpipe.runtime.comm import PeerFailure, tag

CKPT, CKPT_DATA = 4, 5  # message kinds after spotpipe.runtime.comm's ACT, GRAD, REPLICA, TIED


def peer_of(layout: Any, stage: int) -> str | None:
    """The node that keeps the copy of `stage` (written by pipeline 0's owner of it)."""
    writer = layout.owner(0, stage)
    p = layout.num_stages
    ring = [layout.owner(0, (stage - j) % p) for j in range(1, p)]
    others = sorted(n for n in layout.active_nodes if n not in ring)
    return next((n for n in ring + others if n != writer), None)


def layout_tag(layout: str | bytes) -> int:
    """A layout's digest as one int64 (it travels in the copy's header)."""
    raw = layout.encode() if isinstance(layout, str) else layout
    return int.from_bytes(hashlib.sha256(raw).digest()[:7], "big")


@dataclass
class HeldCopy:
    iteration: int
    flat: torch.Tensor  # uint8, CPU
    writer: str
    layout: dict[str, Any]  # what `flat` holds (snapshot.layout_of)


@dataclass
class _InFlight:
    iteration: int
    stage: int
    work: Any
    buffer: torch.Tensor
    comm: Any
    blocked_s: float
    peer: str  # the other end
    layout: dict[str, Any] | None = None  # a received copy's
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    done_time: float = 0.0

    def start(self) -> "_InFlight":
        threading.Thread(target=self._complete, name="gemini-transfer", daemon=True).start()
        return self

    def _complete(self) -> None:
        try:
            self.work.wait()
            self.ok = True
        except Exception:  # noqa: BLE001 - a dead peer: the generation's abort handles it
            self.ok = False
        self.done_time = time.time()
        self.done.set()


class GeminiScheme(Scheme):
    name = "gemini"

    def __init__(self, ctx: SchemeContext) -> None:
        super().__init__(ctx)
        self.held: dict[int, HeldCopy] = {}
        self._sends: list[_InFlight] = []
        self._recvs: list[_InFlight] = []
        self._comm: Any = None
        self._layouts: dict[int, tuple[int, dict[str, Any]]] = {}  # stage -> (tag, layout)

    def _layout_key(self, stage: int) -> str:
        return keys.checkpoint_layout(self.ctx.namespace, stage)

    def save(self, b: Boundary) -> None:
        self.poll(b, wait=True)  # one copy in flight at a time
        comm, me = b.comm, self.ctx.node
        device = comm.device
        # every send is posted before any receive blocks on a header, so no two nodes wait for
        # each other
        for s, (module, optimizer) in sorted(b.stages.items()):
            peer = peer_of(b.layout, s)
            if peer is None:
                continue
            started = time.perf_counter()
            tensors = durable.stage_tensors(module, optimizer)
            layout = self._put_layout(s, tensors, [n for n, _ in module.named_parameters()])
            flat = snapshot.flatten(tensors, device)  # a copy, there (NCCL sends from it)
            comm.send(torch.tensor([flat.numel(), layout_tag(layout)], dtype=torch.int64,
                                   device=device), peer, tag(CKPT, s))
            work = comm.post_send(flat, peer, tag(CKPT_DATA, s))
            self._sends.append(_InFlight(b.iteration, s, work, flat, comm,
                                         time.perf_counter() - started, peer).start())
        for s in range(b.layout.num_stages):
            writer = b.layout.owner(0, s)
            if writer == me or peer_of(b.layout, s) != me:
                continue
            started = time.perf_counter()
            size, tag_of_layout = (int(v) for v in comm.recv(writer, tag(CKPT, s)).tolist())
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            # received whatever its layout: left in the channel, the bytes would be taken for
            # the next copy's, and the writer would wait for them to be taken
            work = comm.post_recv(buffer, writer, tag(CKPT_DATA, s))
            try:
                layout = self._layout(s, tag_of_layout, size, writer)
            except durable.CheckpointError as exc:
                self._failed(b.iteration, s, exc)  # received and dropped; the held copy stays
                layout = None
            self._recvs.append(_InFlight(b.iteration, s, work, buffer, comm,
                                         time.perf_counter() - started, writer,
                                         layout).start())
        self._comm = comm
        self._let_go(b.layout)

    def _let_go(self, layout: Any) -> None:
        """Drop the copies of stages this node no longer keeps (their peer moved, or a
        re-partition removed the stage): each would hold a stage's memory for the rest of the
        run, on a node that may now carry more of the model itself."""
        me = self.ctx.node
        for s in [s for s in self.held
                  if s >= layout.num_stages or peer_of(layout, s) != me]:
            del self.held[s]

    def _put_layout(self, stage: int, tensors: dict[str, torch.Tensor],
                    params: list[str]) -> str:
        """The stage's layout, put in the store at every copy: the stage's writer may have
        been another node since this one last put it (a failover, a re-partition), and then
        the store holds that node's layout, which is not this copy's."""
        layout = json.dumps(snapshot.layout_of(tensors, params))
        self.ctx.store.set(self._layout_key(stage), layout)
        return layout

    def _layout(self, stage: int, tag_: int, size: int, writer: str) -> dict[str, Any]:
        """The layout a copy's header names: the one read last, or the store's (the writer put
        it before it sent the header), which must be that one, for `size` bytes. Anything else
        is a CheckpointError naming the key and the writer."""
        key = self._layout_key(stage)
        where = f"{key} (the copy of stage {stage} that {writer} is sending)"
        cached = self._layouts.get(stage)
        if cached is None or cached[0] != tag_:
            if not self.ctx.store.check([key]):  # (a get would wait for it)
                raise durable.CheckpointError(f"{where}: not in the store")
            try:
                text = self.ctx.store.get(key)
            except Refused as exc:  # (the sealed store's: not written with the job's key)
                raise durable.CheckpointError(f"{where}: refused: {exc.reason}") from None
            raw = text if isinstance(text, bytes) else text.encode()
            if layout_tag(raw) != tag_:
                raise durable.CheckpointError(f"{where}: the store holds another layout")
            cached = (tag_, snapshot.read_layout(raw, size, where))
            self._layouts[stage] = cached
        elif (total := sum(e[-1] for e in snapshot.extents(cached[1]))) != size:
            raise durable.CheckpointError(f"{where}: its layout takes {total} bytes, the copy "
                                          f"has {size}")
        return cached[1]

    def close(self) -> None:
        """Complete the last copies; a generation that ended in a failure (this node leaves
        after a notice) completes nothing more, and the held copies stay as they are."""
        try:
            super().close()
        except PeerFailure:
            self._sends.clear()
            self._recvs.clear()

    def poll(self, b: Boundary | None, wait: bool) -> None:
        """Report the transfers that completed; with `wait`, first wait for those of the
        current generation (abortably: a failure raises PeerFailure into the worker's loop,
        like any other communication)."""
        current = b.comm if b is not None else self._comm
        for items, received in ((self._sends, False), (self._recvs, True)):
            keep = []
            for item in items:
                if wait and item.comm is current and not item.done.is_set():
                    waited = time.perf_counter()
                    current.abort.wait(item.done)
                    item.blocked_s += time.perf_counter() - waited
                if not item.done.is_set():
                    if item.comm is current:
                        keep.append(item)  # still in flight
                    continue  # else abandoned with its generation
                if item.ok:
                    self._report(item, received)
            items[:] = keep

    def _report(self, item: _InFlight, received: bool) -> None:
        if not received:
            self._record("checkpoint_done", item.iteration, item.stage, item.blocked_s,
                         item.buffer.numel(), done_time=item.done_time, peer=item.peer)
            return
        if item.layout is None:
            return  # (its layout was refused when its header came: checkpoint_failed said so)
        flat = item.buffer.to("cpu")
        self.held[item.stage] = HeldCopy(item.iteration, flat, item.peer, item.layout)
        extra = ({"digest": self.fingerprint(item.stage)}
                 if self.cfg.logging.state_digests else {})
        self._record("checkpoint_held", item.iteration, item.stage, item.blocked_s,
                     flat.numel(), counted=False, done_time=item.done_time, writer=item.peer,
                     **extra)

    def tensors(self, stage: int) -> dict[str, torch.Tensor]:
        """The held copy of `stage`, by name (for a restore, or a check)."""
        held = self.held[stage]
        return snapshot.unflatten(held.flat, held.layout)

    def fingerprint(self, stage: int) -> dict[str, str]:
        return snapshot.fingerprint(self.tensors(stage), self.held[stage].layout["params"])
