"""State migration between layouts, peer to peer, from memory.

When the layout changes for more than a takeover (a joining node gets a stage, a carrier hands
its extra stage over, a new pipeline forms), whole stage states (parameters and optimizer
state) and replicas move between nodes. Which transfers happen is computed by every node from
the same inputs (old layout, new layout, the plan's stage copies), so nobody has to announce
anything; each node then posts all its sends before waiting on its receives, which cannot
deadlock. A replica comes from a node that owned its stage before the change (all data-parallel
owners of a stage hold identical state), preferring the receiver itself.

A change of depth (re-partition) moves layers instead of stages: see `exchange_layers` below.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spotpipe.model import LayeredModel
from spotpipe.plan import LayerMove, exchange_order
from spotpipe.plan.transfers import Transfer
from spotpipe.runtime.comm import Comm, tag
from spotpipe.runtime.digest import optimizer_tensors
from spotpipe.runtime.optim import materialise_optimizer_state, state_device
from spotpipe.runtime.state import flatten, unflatten  # noqa: F401 (re-exported)

STAGE, REPLICA_COPY = 4, 5  # message kinds (see comm.tag)


def run(plan: list[Transfer], me: str, comm: Comm, have: dict[tuple[str, int], Any],
        build: Any, arrived: Callable[[str, int, Any], None] | None = None
        ) -> dict[tuple[str, int], Any]:
    """Carry out this node's part of `plan`.

    `have[(kind, stage)]` gives (module, optimizer) for what this node holds now ("stage" for
    owned stages, "replica" for its replica); `build(stage)` makes an empty module and
    optimizer of a stage. Returns what this node received, by (kind, stage), and under
    ("bytes", -1) how many bytes came over the network. `arrived(kind, stage, (module,
    optimizer))` hears of each as it lands: a peer lost before the last leaves the node with
    what came before it (`runtime.reshape` keeps the stages).

    A stage travels as the raw bytes of its tensors (`stage_tensors`), so each keeps its
    dtype bit for bit, behind a header with their size and layout that the receiver checks
    against the stage it built before it takes the bytes: gloo fills a larger buffer from a
    shorter message without a word and aborts the process on a longer one. A stage sent to
    several nodes is packed once.
    """
    def source(stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        return have.get(("stage", stage)) or have[("replica", stage)]

    def kind_of(t: Transfer) -> int:
        return STAGE if t.kind == "stage" else REPLICA_COPY

    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def send(t: Transfer) -> list[Any]:
        if t.stage not in packed:  # (packed once, however many nodes it goes to)
            tensors = stage_tensors(*source(t.stage))
            packed[t.stage] = (_header(tensors, comm.device), _pack(tensors, comm.device))
        return [comm.post_send(part, t.dst, tag(kind_of(t), t.stage))
                for part in packed[t.stage]]

    received: dict[tuple[str, int], Any] = {}
    for t in plan:  # local: the node keeps a copy of a stage it owned
        if t.src == me and t.dst == me:
            module, optimizer = build(t.stage)
            with torch.no_grad():
                for target, value in zip(stage_tensors(module, optimizer),
                                         stage_tensors(*source(t.stage))):
                    target.copy_(value)
            received[(t.kind, t.stage)] = (module, optimizer)
            if arrived is not None:
                arrived(t.kind, t.stage, (module, optimizer))
    # peer by peer in `plan.exchange_order`: the lower rank of a pair sends first, so that no
    # two nodes that send each other a stage wait on each other's receive (NCCL's sends of
    # one stream block until taken; gloo's never do). Stages go in a round before replicas:
    # a receiver then holds its stages before it waits on a replica's sender, and a sender
    # lost there costs it the replica, not its place (`plan.recovery`). Still no cycle of
    # waits: a node in the second round has done every message of the first.
    sends, bytes_moved = [], 0
    ranks = {n: i for i, n in enumerate(comm.nodes)}
    rounds = [[t for t in plan if t.kind == "stage"], [t for t in plan if t.kind != "stage"]]
    for op, peer, moves in [(op, peer, moves) for moves in rounds
                            for op, peer in exchange_order(moves, me, ranks)]:
        if op == "send":
            for t in moves:
                if t.src == me and t.dst == peer:
                    sends += send(t)
            continue
        for t in moves:
            if t.src == peer and t.dst == me:
                module, optimizer = build(t.stage)
                bytes_moved += _receive_stage(comm, t, tag(kind_of(t), t.stage),
                                              stage_tensors(module, optimizer))
                received[(t.kind, t.stage)] = (module, optimizer)
                if arrived is not None:
                    arrived(t.kind, t.stage, (module, optimizer))
    for work in sends:
        comm.wait(work)
    received[("bytes", -1)] = bytes_moved
    return received


def stage_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A stage's state in message order: its parameters, then its optimizer's tensors (the
    state created first where it is missing, so that both ends list the same tensors)."""
    materialise_optimizer_state(module, optimizer)
    return [p.detach() for p in module.parameters()] + optimizer_tensors(optimizer)


def _layout_code(tensors: list[torch.Tensor]) -> int:
    """A fingerprint of the tensors' dtypes and shapes, in order (63 bits, for an int64)."""
    text = ";".join(f"{t.dtype}:{list(t.shape)}" for t in tensors)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _header(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return torch.tensor([nbytes, _layout_code(tensors)], dtype=torch.int64, device=device)


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes in one buffer on `device`, put together where the stage lives (a
    CPU replica sent over NCCL takes one copy's room on the GPU, not two)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    home = tensors[0].device
    return torch.cat([_raw(t, home) for t in tensors]).to(device)


def _receive_stage(comm: Comm, t: Transfer, tag_: int, tensors: list[torch.Tensor]) -> int:
    """Receive `t`'s state into `tensors` (the stage this node built), once its header says
    that the message is that stage; returns the bytes received."""
    header = torch.empty(2, dtype=torch.int64, device=comm.device)
    comm.wait(comm.post_recv(header, t.src, tag_))
    expected = _header(tensors, torch.device("cpu")).tolist()
    got = header.tolist()
    if got != expected:
        raise RuntimeError(
            f"{comm.me}: the {t.kind} of stage {t.stage} from {t.src} is {got[0]} bytes of "
            f"tensors laid out as {got[1]:x}, this node's stage {t.stage} is {expected[0]} "
            f"bytes laid out as {expected[1]:x}: the two nodes built the stage differently "
            "(model, partition or optimizer)")
    flat = torch.empty(expected[0], dtype=torch.uint8, device=comm.device)
    comm.wait(comm.post_recv(flat, t.src, tag_))
    offset = 0
    with torch.no_grad():
        for target in tensors:
            target.copy_(_typed(flat, offset, target.dtype, list(target.shape)))
            offset += target.numel() * target.element_size()
    return offset


# -- re-partition: layers move, not stages -------------------------------------------------
#
# A change of depth gives stages other layer ranges, so whole-stage messages do not fit: the
# unit is the layer (see `plan.layers`). A message carries, for each of its layers, every
# parameter and that parameter's optimizer state, whatever the optimizer keeps there (state
# is keyed by parameter, and parameters by their global names "layer.name", the same in every
# stage of every depth). Tensors travel as raw bytes, so every dtype travels bit for bit in one
# buffer; what is in the buffer (names, keys, shapes, dtypes, plain numbers) is JSON in the
# store, written by each sender before any message is posted, so no receiver waits on a
# sender that waits on it.

LAYERS = 6  # message kind (see comm.tag)

StateIndex = dict[str, tuple[nn.Parameter, torch.optim.Optimizer]]


def state_index(held: list[tuple[nn.Module, torch.optim.Optimizer]]) -> StateIndex:
    """Global parameter name -> (parameter, its optimizer) over the modules a node holds; both
    names of a parameter tied within one module are listed."""
    out: StateIndex = {}
    for module, optimizer in held:
        for name, p in module.named_parameters(remove_duplicate=False):
            out[name] = (p, optimizer)
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a layer message")
    return dtype


def _raw(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


def _typed(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes start at `offset` of the byte buffer
    `flat` (the inverse of `_raw`): a view, or a copy where a wider dtype follows a narrower
    one and its bytes are not aligned for it."""
    n = 1
    for d in shape:
        n *= d
    part = flat[offset: offset + n * dtype.itemsize]
    if offset % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).view(shape)


def pack_layers(names: list[str], have: StateIndex,
                device: torch.device) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Parameters `names` and their optimizer state as (metadata, one byte buffer)."""
    meta: list[dict[str, Any]] = []
    chunks: list[torch.Tensor] = []
    for name in names:
        p, optimizer = have[name]
        entry: dict[str, Any] = {"name": name, "shape": list(p.shape), "dtype": str(p.dtype),
                                 "state": {}}
        chunks.append(_raw(p, device))
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                entry["state"][key] = {"shape": list(value.shape), "dtype": str(value.dtype)}
                chunks.append(_raw(value, device))
            elif isinstance(value, (bool, int, float)):
                entry["state"][key] = {"value": value}
            else:
                raise TypeError(f"optimizer state {key!r} of {name} is a "
                                f"{type(value).__name__}; only tensors and numbers can move")
        meta.append(entry)
    flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device)
    return meta, flat


def message_bytes(meta: list[dict[str, Any]]) -> int:
    total = 0
    for entry in meta:
        for spec in [entry] + [s for s in entry["state"].values() if "shape" in s]:
            n = 1
            for d in spec["shape"]:
                n *= d
            total += n * _dtype(spec["dtype"]).itemsize
    return total


def unpack_layers(meta: list[dict[str, Any]],
                  flat: torch.Tensor) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """Inverse of `pack_layers`: name -> (parameter value, {state key: tensor or number})."""
    out: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
    offset = 0

    def take(spec: dict[str, Any]) -> torch.Tensor:
        nonlocal offset
        part = _typed(flat, offset, _dtype(spec["dtype"]), spec["shape"])
        offset += part.numel() * part.element_size()
        return part

    for entry in meta:
        value = take(entry)
        state = {key: take(spec) if "shape" in spec else spec["value"]
                 for key, spec in entry["state"].items()}
        out[entry["name"]] = (value, state)
    if offset != flat.numel():
        raise RuntimeError(f"layer message of {flat.numel()} bytes, its metadata says {offset}")
    return out


def local_entry(name: str, have: StateIndex) -> tuple[torch.Tensor, dict[str, Any]]:
    """A parameter this node already holds, in the form `unpack_layers` gives."""
    p, optimizer = have[name]
    return p.detach(), dict(optimizer.state.get(p, {}))


def install(name: str, value: torch.Tensor, state: dict[str, Any], want: StateIndex) -> None:
    """Copy one parameter's value and optimizer state into the new module that wants it.

    Each state tensor goes where the new module's optimizer keeps it (`optim.state_device`:
    beside the parameter; AdamW's step count on the CPU unless fused), not where the sender
    kept it: a CPU replica's step count would otherwise land on a GPU stage, and each of its
    steps wait on the device to read it."""
    p, optimizer = want[name]
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    if tuple(value.shape) != tuple(p.shape) or value.dtype != p.dtype:
        raise RuntimeError(f"{name}: got {value.dtype}{list(value.shape)}, the stage has "
                           f"{p.dtype}{list(p.shape)}")
    with torch.no_grad():
        p.copy_(value)
    optimizer.state[p] = {
        key: (v.detach().to(state_device(group, key, p), copy=True)
              if isinstance(v, torch.Tensor) else v)
        for key, v in state.items()}


def exchange_layers(moves: list[LayerMove], me: str, comm: Comm, store: Any, prefix: str,
                    model: LayeredModel, have: StateIndex, want: StateIndex,
                    timeout_s: float) -> int:
    """Fill `want` (the new modules' parameters and optimizer states) from what this node has
    and from peers, as `moves` (from `plan.layer_plan`) says; returns the bytes received.

    All metadata first, then every message posted in `plan.exchange_order`, then the waits in
    the same order: with gloo the posts never block, and with NCCL no pair of nodes can wait
    on each other in opposite orders."""
    def names(layers: list[int]) -> list[str]:
        return [f"{layer}.{n}" for layer in layers
                for n, _ in model.layers[layer].named_parameters(remove_duplicate=False)]

    def key(src: str, dst: str) -> str:
        return f"{prefix}/{src}/{dst}"

    outgoing: dict[str, torch.Tensor] = {}
    for dst in sorted({m.dst for m in moves if m.src == me and m.dst != me}):
        layers = sorted(m.layer for m in moves if m.src == me and m.dst == dst)
        meta, flat = pack_layers(names(layers), have, comm.device)
        store.set(key(me, dst), json.dumps(meta))
        outgoing[dst] = flat
    incoming: dict[str, tuple[list[dict[str, Any]], torch.Tensor]] = {}
    works = []
    ranks = {n: i for i, n in enumerate(comm.nodes)}
    for op, peer in exchange_order(moves, me, ranks):
        if op == "send":
            works.append(comm.post_send(outgoing[peer], peer, tag(LAYERS, 0)))
        else:
            comm.wait_keys([key(peer, me)], timeout_s, f"{peer}'s layer metadata")
            with comm.waiting_on_peer():  # (past a squatter's value, until the peer's own)
                meta = json.loads(store.get(key(peer, me)))
            flat = torch.empty(message_bytes(meta), dtype=torch.uint8, device=comm.device)
            incoming[peer] = (meta, flat)
            works.append(comm.post_recv(flat, peer, tag(LAYERS, 0)))
    for work in works:
        comm.wait(work)
    received: dict[str, tuple[str, tuple[torch.Tensor, dict[str, Any]]]] = {}
    for peer, (meta, flat) in incoming.items():
        received.update((name, (peer, entry)) for name, entry in unpack_layers(meta, flat).items())
    for name in want:
        if name in received:
            peer, entry = received[name]
            try:
                install(name, *entry, want)
            except RuntimeError as exc:  # (a peer that built its layers otherwise)
                raise RuntimeError(f"{me}: the re-partition's layer {name.split('.')[0]} "
                                   f"from {peer} does not fit: {exc}") from None
        elif name in have:
            install(name, *local_entry(name, have), want)
        else:
            raise RuntimeError(f"{me}: the re-partition left {name} without a source")
    return sum(flat.numel() for _, flat in incoming.values())

