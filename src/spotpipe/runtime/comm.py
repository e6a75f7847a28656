"""Process groups and point-to-point tensor transfer for one layout of the job.

torch.distributed does the transport (gloo on CPU, NCCL on GPU). What it does not do is tell a
receiver the shape of a tensor, so the first message on each channel carries a small header;
later messages on the channel reuse the shape, because in a pipeline the boundary shape is the
same for every micro-batch of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # ndim, dtype code, up to 8 dims


@dataclass(frozen=True)
class Topology:
    """Ranks on a P x D grid: rank = pipeline * P + stage."""

    num_stages: int
    num_pipelines: int

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_pipelines

    def rank_of(self, pipeline: int, stage: int) -> int:
        return pipeline * self.num_stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline, stage) of a rank."""
        return divmod(rank, self.num_stages)


class Groups:
    """The collectives a stage takes part in: its data-parallel peers, its pipeline, and the
    tied-embedding pair (first and last stage of a pipeline)."""

    def __init__(self, topo: Topology, rank: int, replication: bool = False) -> None:
        pipeline, stage = topo.coords(rank)
        p, d = topo.num_stages, topo.num_pipelines
        # torch.distributed requires every rank to create every group, in the same order.
        self.data_parallel = self.pipeline = self.tied = None
        for s in range(p):
            group = dist.new_group([topo.rank_of(x, s) for x in range(d)])
            if s == stage:
                self.data_parallel = group
        for x in range(d):
            group = dist.new_group([topo.rank_of(x, s) for s in range(p)])
            if x == pipeline:
                self.pipeline = group
        for x in range(d):
            if p > 1:
                group = dist.new_group([topo.rank_of(x, 0), topo.rank_of(x, p - 1)])
                if x == pipeline and stage in (0, p - 1):
                    self.tied = group
        # replica ring: stage s ships gradients to the node of stage s - 1 (its replica holder)
        # on a group of the pair, so these transfers never interleave with activation traffic
        self.replica_send = self.replica_recv = None
        if replication and p > 1:
            for x in range(d):
                pairs = dict.fromkeys(tuple(sorted((s, (s - 1) % p))) for s in range(p))
                for a, b in pairs:
                    group = dist.new_group([topo.rank_of(x, a), topo.rank_of(x, b)])
                    if x != pipeline:
                        continue
                    if {a, b} == {stage, (stage - 1) % p}:
                        self.replica_send = group
                    if {a, b} == {stage, (stage + 1) % p}:
                        self.replica_recv = group


class PeerLink:
    """Asynchronous sends, blocking receives, matched in posting order per peer and tag."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]] = {}
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        tensor = tensor.detach().contiguous()
        key = ("send", dst, tag)
        if key not in self._shapes:
            if tensor.dim() > _HEADER - 2:
                raise ValueError(f"cannot send a {tensor.dim()}-d tensor between stages "
                                 f"(at most {_HEADER - 2} dimensions)")
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0] = tensor.dim()
            header[1] = _DTYPES.index(tensor.dtype)
            header[2: 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._pending.append((dist.isend(header, dst, tag=tag), header))
            self._shapes[key] = (tensor.shape, tensor.dtype)
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        key = ("recv", src, tag)
        if key not in self._shapes:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src, tag=tag)
            h = header.tolist()
            self._shapes[key] = (torch.Size(h[2: 2 + h[0]]), _DTYPES[h[1]])
        shape, dtype = self._shapes[key]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src, tag=tag)
        return out

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
