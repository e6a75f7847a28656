"""Cut a LayeredModel into contiguous pipeline stages, and build a stage's module.

A partition is a list of half-open layer ranges ``[(start, end), ...]``, one per stage, in
order, each non-empty and together covering every layer. Balancing is by the most loaded stage,
because a pipeline runs at the pace of its slowest stage.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from spotpipe.model.layered import LayeredModel
from spotpipe.model.precision import Precision, run_layers

METHODS = ("uniform", "parameters", "time", "explicit", "balanced")


class PartitionError(ValueError):
    """A partition that cannot be made: too many stages, a bad explicit map, a bad method."""


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(f"the number of stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise PartitionError(f"cannot split {num_layers} layers into {num_stages} stages")


def uniform_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layer counts differ by at most one; the first ``num_layers % num_stages`` get one more."""
    _check_counts(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _best_split(
    prefix: list[float], num_stages: int, cost, combine
) -> tuple[list[list[float]], list[list[int]]]:
    """DP over contiguous splits: ``best[k][i]`` is the best way to put layers [0, i) on k
    stages, where stage k - 1 holding [j, i) costs ``cost(k - 1, j, i)`` and costs add up
    with ``combine``."""
    n = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = combine(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    return best, cut


def balanced_partition(weights: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous non-empty stages minimising the largest stage sum (exact, by DP).

    Many cuts often share the optimal maximum; among them the one with the smallest sum of
    squared stage sums is taken (the most even), so ``[1] * 7`` on 3 stages gives 3, 2, 2
    layers, not 3, 3, 1. O(P n^2), instant for layer lists of hundreds of layers.
    """
    found = bounded_partition(weights, num_stages, lambda stage, start, end: True)
    assert found is not None  # every partition fits
    return found


def bounded_partition(weights: Sequence[float], num_stages: int,
                      fits: Callable[[int, int, int], bool]) -> list[tuple[int, int]] | None:
    """As `balanced_partition`, among the partitions whose every stage fits (`fits(stage,
    start, end)`: a stage's memory depends on its index too, e.g. how many micro-batches 1F1B
    keeps in flight there); None when none does."""
    n = len(weights)
    _check_counts(n, num_stages)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")

    def stage_sum(stage: int, j: int, i: int) -> float:
        return prefix[i] - prefix[j] if fits(stage, j, i) else inf

    best, _ = _best_split(prefix, num_stages, stage_sum, max)
    if best[num_stages][n] == inf:
        return None
    limit = best[num_stages][n] * (1 + 1e-9) + 1e-12  # float sums: tolerate rounding

    def squared_within_limit(stage: int, j: int, i: int) -> float:
        w = stage_sum(stage, j, i)
        return w * w if w <= limit else inf

    _, cut = _best_split(prefix, num_stages, squared_within_limit, lambda a, b: a + b)
    bounds, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def parameter_counts(model: LayeredModel) -> list[int]:
    """Parameters per layer; a tied weight counts in each layer that holds it (each stage
    holding it keeps a copy)."""
    return [sum(p.numel() for p in layer.parameters()) for layer in model.layers]


def compute_weights(model: LayeredModel) -> list[int]:
    """Per layer, the parameters its forward multiplies by: every module's own parameters
    except an embedding's table (`nn.Embedding`, `nn.EmbeddingBag`), which is looked up, not
    multiplied. A tied output head counts its (shared) weight, because that is where the
    matmul happens.

    A stand-in for a layer's compute where nothing has been measured (FRC placement): plain
    parameter counts put a language model's embedding table (often the largest tensor it has)
    on the first stage's clock and a tied head's vocabulary-sized matmul on nobody's.
    """
    lookups = (nn.Embedding, nn.EmbeddingBag)
    return [sum(p.numel() for m in layer.modules() if not isinstance(m, lookups)
                for p in m.parameters(recurse=False))
            for layer in model.layers]


def profile_layer_times(
    model: LayeredModel, sample_input: Tensor, repeats: int = 5,
    precision: Precision = Precision(),
) -> list[float]:
    """Median forward+backward seconds of each layer on ``sample_input`` (after one warm-up).

    Each layer runs on the previous layer's (detached) output, so the shapes are the real ones.
    The model's gradients and the global RNG (dropout) are restored afterwards.
    """
    params = list(model.to_sequential().parameters())
    saved_grads = [p.grad for p in params]
    times: list[float] = []
    try:
        with torch.random.fork_rng(devices=[]):
            x = sample_input
            for layer in model.layers:
                samples = []
                for r in range(repeats + 1):
                    inp = x.detach()
                    if inp.is_floating_point():
                        inp.requires_grad_(True)
                    t0 = time.perf_counter()
                    out = run_layers(nn.Sequential(layer), inp, precision)
                    if out.requires_grad:
                        out.backward(torch.ones_like(out))
                    samples.append(time.perf_counter() - t0)
                times.append(statistics.median(samples[1:]))
                x = out.detach()
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    return times


def explicit_partition(
    stage_of_layer: Sequence[int], num_stages: int, num_layers: int
) -> list[tuple[int, int]]:
    """From a map giving the stage index of every layer, e.g. ``[0, 0, 1, 1, 1, 2]``.

    The map must have one entry per layer, start at 0, end at ``num_stages - 1`` and step by 0
    or 1 from one layer to the next (stages are contiguous and none is empty).
    """
    _check_counts(num_layers, num_stages)
    stages = list(stage_of_layer)
    if len(stages) != num_layers:
        raise PartitionError(
            f"explicit map has {len(stages)} entries but the model has {num_layers} layers"
        )
    if stages[0] != 0 or stages[-1] != num_stages - 1:
        raise PartitionError(
            f"explicit map must start at stage 0 and end at stage {num_stages - 1}, got {stages}"
        )
    for i in range(1, num_layers):
        if stages[i] - stages[i - 1] not in (0, 1):
            raise PartitionError(
                f"explicit map must be non-decreasing with no stage skipped, but layer {i - 1} "
                f"is on stage {stages[i - 1]} and layer {i} on stage {stages[i]}: {stages}"
            )
    bounds, start = [], 0
    for i in range(1, num_layers + 1):
        if i == num_layers or stages[i] != stages[i - 1]:
            bounds.append((start, i))
            start = i
    return bounds


def cut(method: str, num_layers: int, num_stages: int, *,
        params: Sequence[float] | None = None, times: Sequence[float] | None = None,
        explicit: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The ranges of `method` from per-layer figures already known (the launch's profile, or
    the model itself in `partition`): the one dispatch both use."""
    if method == "uniform":
        return uniform_partition(num_layers, num_stages)
    if method == "parameters":
        assert params is not None
        return balanced_partition(params, num_stages)
    if method == "time":
        if times is None:
            raise PartitionError("partition method 'time' needs the layers' profiled times")
        _check_counts(num_layers, num_stages)
        return balanced_partition(times, num_stages)
    if method == "explicit":
        if not explicit:
            raise PartitionError("partition method 'explicit' needs the explicit stage map")
        return explicit_partition(explicit, num_stages, num_layers)
    raise PartitionError(f"unknown partition method {method!r}; expected one of {METHODS}")


def partition(
    model: LayeredModel,
    num_stages: int,
    method: str = "uniform",
    *,
    explicit: list[int] | None = None,
    sample_input: Tensor | None = None,
) -> list[tuple[int, int]]:
    """Split ``model`` into ``num_stages`` contiguous ``[start, end)`` layer ranges.

    ``uniform``: equal layer counts; ``parameters``: balance parameter counts; ``time``:
    balance profiled forward+backward time on ``sample_input``; ``explicit``: ``explicit`` is
    the stage index of each layer (see :func:`explicit_partition`).
    """
    if method == "time" and sample_input is None:
        raise PartitionError("partition method 'time' needs a sample_input to profile")
    return cut(method, model.num_layers, num_stages,
               params=parameter_counts(model) if method == "parameters" else None,
               times=profile_layer_times(model, sample_input)
               if method == "time" and sample_input is not None else None,
               explicit=explicit)


def build_stage(model: LayeredModel, start: int, end: int) -> nn.Sequential:
    """Layers ``[start, end)`` as an ``nn.Sequential`` named by global layer index.

    The names make the stage's ``state_dict`` keys equal the unpartitioned model's (e.g.
    ``"3.attn.c_attn.weight"``), so stage checkpoints merge by key. The layers are shared with
    ``model``, not copied: updating the stage updates the model.
    """
    if not 0 <= start < end <= model.num_layers:
        raise PartitionError(
            f"stage range [{start}, {end}) is not a non-empty range within "
            f"the model's {model.num_layers} layers"
        )
    return nn.Sequential(OrderedDict((str(i), model.layers[i]) for i in range(start, end)))
