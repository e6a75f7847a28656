"""Per-layer memory facts measured on a real model, for `spotpipe.plan.memory`'s estimator.

The estimator is pure (it is the simulator's too); what it needs of a layer (parameters, the
bytes its forward keeps for the backward per micro-batch, the bytes of its output) is measured
here by running each layer once on a real micro-batch, in the job's precision, and counting
what autograd saves (`torch.autograd.graph.saved_tensors_hooks`), each storage once and
parameters not at all (they are counted as weights).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spotpipe.model.layered import LayeredModel
from spotpipe.model.precision import Precision, run_layers
from spotpipe.plan.memory import LayerMemory


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def profile_layer_memory(model: LayeredModel, sample_input: Tensor,
                         precision: Precision = Precision()) -> list[LayerMemory]:
    """LayerMemory of every layer on `sample_input` (one micro-batch); gradients, the RNG and
    the model are left as they were (nothing is stepped, no backward runs)."""
    out: list[LayerMemory] = []
    params = {_storage_key(p) for p in model.to_sequential().parameters()}
    x = sample_input
    with torch.random.fork_rng(devices=[]):
        for layer in model.layers:
            seen: set[tuple[int, int]] = set()
            kept = 0

            def pack(t: Tensor) -> Tensor:
                nonlocal kept
                key = _storage_key(t)
                if key not in seen and key not in params:
                    seen.add(key)
                    kept += key[1]
                return t

            inp = x.detach()
            if inp.is_floating_point():
                inp.requires_grad_(True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = run_layers(nn.Sequential(layer), inp, Precision(precision.name))
            n = sum(p.numel() for p in layer.parameters())
            out.append(LayerMemory(n, float(kept), float(y.numel() * y.element_size())))
            x = y.detach()
    return out
