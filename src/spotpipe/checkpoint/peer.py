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
nothing is unpickled from the network: the writer puts it whenever it changes (a re-partition
changes a stage's layers in place), and the header carries a digest of it, by which the peer
reads the new one and keeps with each copy the layout that copy was cut by.
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
from spotpipe.runtime.comm import PeerFailure, tag

CKPT, CKPT_DATA = 4, 5  # message kinds after spotpipe.runtime.comm's ACT, GRAD, REPLICA, TIED


def peer_of(layout: Any, stage: int) -> str | None:
    """The node that keeps the copy of `stage` (written by pipeline 0's owner of it)."""
    writer = layout.owner(0, stage)
    p = layout.num_stages
    ring = [layout.owner(0, (stage - j) % p) for j in range(1, p)]
    others = sorted(n for n in layout.active_nodes if n not in ring)
    return next((n for n in ring + others if n != writer), None)


def layout_tag(layout: str) -> int:
    """A layout's digest as one int64 (it travels in the copy's header)."""
    return int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "big")


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
        self._layout_put: dict[int, str] = {}  # stage -> the layout this node last put
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
            flat = snapshot.flatten(tensors)  # a copy, on the device (NCCL sends from there)
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
            layout = self._layout(s, tag_of_layout, writer)
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            work = comm.post_recv(buffer, writer, tag(CKPT_DATA, s))
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
        """The stage's layout, put in the store where it is not the one this node put last."""
        layout = json.dumps(snapshot.layout_of(tensors, params))
        if self._layout_put.get(stage) != layout:
            self.ctx.store.set(self._layout_key(stage), layout)
            self._layout_put[stage] = layout
        return layout

    def _layout(self, stage: int, tag_: int, writer: str) -> dict[str, Any]:
        """The layout a copy's header names: the one read last, or the store's (the writer put
        it before it sent the header), which must be that one."""
        cached = self._layouts.get(stage)
        if cached is None or cached[0] != tag_:
            text = self.ctx.store.get(self._layout_key(stage))
            text = text.decode() if isinstance(text, bytes) else text
            if layout_tag(text) != tag_:
                raise durable.CheckpointError(
                    f"{self._layout_key(stage)}: not the layout of the copy of stage {stage} "
                    f"that {writer} is sending")
            cached = self._layouts[stage] = (tag_, json.loads(text))
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
        flat = item.buffer.to("cpu")
        assert item.layout is not None  # (a received copy's, read when its header came)
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
