"""Per-layer memory facts measured on a real model, for `spotpipe.plan.memory`'s estimator.

The estimator is pure (it is the simulator's too); what it needs of a layer (parameters, the
bytes its forward keeps for the backward per micro-batch, the bytes of its output) is measured
here by running each layer once on a real micro-batch, in the job's precision, and counting
what autograd saves (`torch.autograd.graph.saved_tensors_hooks`), each storage once and
parameters not at all (they are counted as weights).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spotpipe.model.layered import LayeredModel
from spotpipe.model.precision import Precision, loss_of, run_layers
from spotpipe.plan.memory import LayerMemory


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Kept(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for the backward under it, each storage once, parameters not
    at all (they are counted as weights)."""

    def __init__(self, params: set[tuple[int, int]]) -> None:
        self.bytes = 0
        self._seen = set(params)
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "_Kept":  # (the base class returns None)
        super().__enter__()
        return self

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += key[1]
        return t


class _Allocated(TorchDispatchMode):
    """Bytes of the tensors the operations under it create, each storage once."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self._seen: set[tuple[int, int]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                key = _storage_key(t)
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += key[1]
        return out


def _loss_memory(model: LayeredModel, output: Tensor, target: Tensor, precision: Precision,
                 params: set[tuple[int, int]]) -> tuple[int, int]:
    """What the loss keeps for the backward (the log-softmax of the logits, in fp32), and
    what its backward creates: the gradients with respect to it and to the logits, which
    exist together at the last stage's backward and are as large as the logits in fp32."""
    y = output.detach().requires_grad_(True)
    with _Kept(params) as kept:
        loss = loss_of(model.loss_fn, y, target, Precision(precision.name))
    with _Allocated() as created:
        torch.autograd.grad(loss, y)
    return kept.bytes, created.bytes


def profile_layer_memory(model: LayeredModel, sample_input: Tensor,
                         precision: Precision = Precision(),
                         target: Tensor | None = None) -> list[LayerMemory]:
    """LayerMemory of every layer on `sample_input` (one micro-batch); with `target`, the
    last layer's facts count its loss too (what the loss keeps, and its backward's working
    memory). Gradients, the RNG and the model are left as they were (nothing is stepped; the
    loss's backward runs to a detached copy of the logits only)."""
    out: list[LayerMemory] = []
    params = {_storage_key(p) for p in model.to_sequential().parameters()}
    owner: dict[tuple[int, int], int] = {}  # a parameter's storage -> the first layer using it
    x = sample_input
    with torch.random.fork_rng(devices=[]):
        for i, layer in enumerate(model.layers):
            inp = x.detach()
            if inp.is_floating_point():
                inp.requires_grad_(True)
            with _Kept(params) as kept:
                y = run_layers(nn.Sequential(layer), inp, Precision(precision.name))
            n = sum(p.numel() for p in layer.parameters())
            tied_to, tied = -1, 0
            for p in layer.parameters():
                first = owner.setdefault(_storage_key(p), i)
                if first != i and tied_to in (-1, first):  # (one partner layer is counted)
                    tied_to, tied = first, tied + p.numel()
            out.append(LayerMemory(n, float(kept.bytes), float(y.numel() * y.element_size()),
                                   tied_params=tied, tied_to=tied_to))
            x = y.detach()
        if target is not None and out and x.is_floating_point():
            kept_bytes, working = _loss_memory(model, x, target, precision, params)
            last = out[-1]
            out[-1] = dataclasses.replace(last, activation_bytes=last.activation_bytes
                                          + kept_bytes, transient_bytes=float(working),
                                          loss_bytes=float(kept_bytes))
    return out
