"""State migration between layouts, peer to peer, from memory.

When the layout changes for more than a takeover (a joining node gets a stage, a carrier hands
its extra stage over, a new pipeline forms), whole stage states (parameters and optimizer
state) and replicas move between nodes. Which transfers happen is computed by every node from
the same inputs (old layout, new layout, the plan's stage copies), so nobody has to announce
anything; each node then posts all its sends before waiting on its receives, which cannot
deadlock. A replica comes from a node that owned its stage before the change (all data-parallel
owners of a stage hold identical state), preferring the receiver itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spotpipe.checkpoint.durable import materialise_optimizer_state
from spotpipe.plan import Layout
from spotpipe.runtime.comm import Comm, tag
from spotpipe.runtime.digest import optimizer_tensors

STAGE, REPLICA_COPY = 4, 5  # message kinds (see comm.tag)


@dataclass(frozen=True)
class Transfer:
    kind: str  # "stage" or "replica"
    stage: int
    src: str
    dst: str


def transfers(old: Layout, new: Layout, copies: list[dict[str, Any]],
              promoted: set[str]) -> list[Transfer]:
    """Every state transfer the change needs, in a deterministic order.

    `copies` are the plan's COPY moves (stage s from src to dst); `promoted` the nodes that
    turned their replica into an owned stage in this plan (their replica is gone).
    """
    # imported here: node -> executor -> shadow_link -> migrate would otherwise be a cycle
    # that breaks `from spotpipe.runtime import node` as a first import
    from spotpipe.runtime.node import held_replica

    out = [Transfer("stage", m["stage"], m["src"], m["dst"]) for m in copies]
    alive = set(new.active_nodes)
    for node in sorted(new.active_nodes):
        want = held_replica(new, node)
        if want is None:
            continue
        had = (held_replica(old, node) if node in old.active_nodes and node not in promoted
               else None)
        if had == want:
            continue
        sources = sorted(n for (d, s), n in old.mapping.items() if s == want and n in alive)
        src = node if node in sources else sources[0]
        out.append(Transfer("replica", want, src, node))
    return out


def flatten(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    params = list(module.parameters())
    materialise_optimizer_state(module, optimizer)
    return torch.cat([p.detach().reshape(-1) for p in params]
                     + [t.detach().reshape(-1).to(params[0].dtype)
                        for t in optimizer_tensors(optimizer)])


def unflatten(flat: torch.Tensor, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `flatten` produced on another node into a module and optimizer of the
    same structure (the optimizer state is created first, so the layouts agree)."""
    materialise_optimizer_state(module, optimizer)
    targets = [p for p in module.parameters()] + optimizer_tensors(optimizer)
    offset = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t).to(t.dtype))
            offset += n
    if offset != flat.numel():
        raise RuntimeError(f"state message of {flat.numel()} values, expected {offset}")


def run(plan: list[Transfer], me: str, comm: Comm, have: dict[tuple[str, int], Any],
        build: Any) -> dict[tuple[str, int], Any]:
    """Carry out this node's part of `plan`.

    `have[(kind, stage)]` gives (module, optimizer) for what this node holds now ("stage" for
    owned stages, "replica" for its replica); `build(stage)` makes an empty module and
    optimizer of a stage. Returns what this node received, by (kind, stage), and under
    ("bytes", -1) how many bytes came over the network.
    """
    sends = []
    bytes_moved = [0]
    for t in plan:
        if t.src == me and t.dst != me:
            module, optimizer = have.get(("stage", t.stage)) or have[("replica", t.stage)]
            flat = flatten(module, optimizer).to(comm.device)
            kind = STAGE if t.kind == "stage" else REPLICA_COPY
            sends.append((comm.post_send(flat, t.dst, tag(kind, t.stage)), flat))
    received: dict[tuple[str, int], Any] = {}
    for t in plan:
        if t.dst != me:
            continue
        module, optimizer = build(t.stage)
        if t.src == me:  # local: the node keeps a copy of a stage it owned
            src_module, src_optimizer = have.get(("stage", t.stage)) or have[("replica", t.stage)]
            unflatten(flatten(src_module, src_optimizer), module, optimizer)
        else:
            materialise_optimizer_state(module, optimizer)
            size = sum(p.numel() for p in module.parameters()) + sum(
                x.numel() for x in optimizer_tensors(optimizer))
            flat = torch.empty(size, device=comm.device)
            kind = STAGE if t.kind == "stage" else REPLICA_COPY
            comm.wait(comm.post_recv(flat, t.src, tag(kind, t.stage)))
            unflatten(flat, module, optimizer)
        received[(t.kind, t.stage)] = (module, optimizer)
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters()) + sum(
            x.numel() * x.element_size() for x in optimizer_tensors(optimizer))
        bytes_moved[0] += 0 if t.src == me else nbytes
    for work, _ in sends:
        comm.wait(work)
    received[("bytes", -1)] = bytes_moved[0]
    return received

