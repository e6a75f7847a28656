"""Per-layer costs of the models the simulator predicts for: paper-scale presets and profiles.

The simulator needs forward/backward seconds per layer (to partition into any depth P after a
re-partition), the bytes of one activation message, and the parameter bytes per layer (for
the data-parallel all-reduce). Presets are derived from stated assumptions, not measured, so
each number can be traced back to a formula; a profile measured on a real run replaces them.

Assumptions shared by the presets (V100, mixed precision):
- effective throughput 40 TFLOP/s of the 125 TFLOP/s fp16 tensor-core peak (about a third,
  typical for Megatron/DeepSpeed transformer kernels at these sizes);
- a transformer block costs 24*h^2*s + 4*s^2*h FLOPs per sequence forward (matrix multiplies
  plus attention scores), backward twice the forward;
- activations travel in fp16 over the instance's network (p3.2xlarge: up to 10 Gbit/s,
  taken as 1.0 GB/s achieved); gradients are all-reduced in fp16 with a ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from spotpipe.plan.memory import LayerMemory, TransformerShape, transformer_layers
from spotpipe.runfiles import read_json

EFFECTIVE_FLOPS = 40e12
NETWORK_BYTES_S = 1.0e9


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer costs of one micro-batch, plus what the schedule needs around them."""

    name: str
    forward_s: tuple[float, ...]  # per layer, one micro-batch
    backward_s: tuple[float, ...]
    param_bytes: tuple[float, ...]  # per layer, fp16 gradient bytes all-reduced
    activation_bytes: float  # one micro-batch's activation (= its gradient) between stages
    micro_batch_size: int  # samples per micro-batch
    global_microbatches: int  # micro-batches per iteration, all pipelines together
    network_bytes_s: float = NETWORK_BYTES_S
    optimizer_s_per_byte: float = 0.0  # optimizer step time per parameter byte of a stage
    # per layer: parameters, activation bytes kept and sent (`spotpipe.plan.memory`); empty:
    # unknown (a profile without them), and no layout is refused for memory
    layer_memory: tuple[LayerMemory, ...] = ()
    # per layer, the runtime's stand-in for compute where FRC is placed (the parameters a
    # layer multiplies by: `spotpipe.model.compute_weights`); empty: its parameters
    placement_weights: tuple[float, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    @property
    def samples_per_iteration(self) -> int:
        return self.micro_batch_size * self.global_microbatches


def transformer(name: str, *, layers: int, hidden: int, seq: int, vocab: int,
                micro_batch: int, global_batch: int, heads: int) -> ModelCosts:
    """A decoder/encoder stack: an embedding layer, `layers` blocks, and an output head.

    Block FLOPs per sequence: 24*h^2*s + 4*s^2*h; head FLOPs: 2*s*h*vocab; the embedding is a
    lookup (cost taken as zero compute, but it holds vocab*h parameters).
    """
    block_flops = (24 * hidden ** 2 * seq + 4 * seq ** 2 * hidden) * micro_batch
    head_flops = 2 * seq * hidden * vocab * micro_batch
    fwd = [0.0] + [block_flops / EFFECTIVE_FLOPS] * layers + [head_flops / EFFECTIVE_FLOPS]
    params = [vocab * hidden] + [12 * hidden ** 2 + 13 * hidden] * layers + [2 * hidden]
    # what the runtime's FRC placement sees: the embedding table is looked up (nothing), the
    # head multiplies by the tied vocab x h table (and its layer norm's 2h)
    multiplied = [0] + params[1:-1] + [vocab * hidden + 2 * hidden]
    return ModelCosts(
        name=name,
        forward_s=tuple(fwd),
        backward_s=tuple(2 * f for f in fwd),
        param_bytes=tuple(2.0 * p for p in params),
        placement_weights=tuple(float(p) for p in multiplied),
        activation_bytes=2.0 * micro_batch * seq * hidden,
        micro_batch_size=micro_batch,
        global_microbatches=global_batch // micro_batch,
        # fp32 Adam over master weights: ~16 bytes touched per parameter at ~400 GB/s HBM
        optimizer_s_per_byte=8.0 / 400e9,
        layer_memory=transformer_layers(TransformerShape(layers, hidden, heads, seq, vocab),
                                        micro_batch, "fp16"),
    )


def gpt2_1_5b() -> ModelCosts:
    """GPT-2 XL (1.5B): 48 blocks, h=1600, seq 1024, vocab 50257; micro-batch 4, batch 384.

    Batch 384 sequences is the order Bamboo trains GPT-2 with, and its 96 micro-batches split
    evenly over 1, 2, 3, 4, 6, 8, 12, ... pipelines, as the runtime requires (512 would not
    split over 3); with mixed precision and activation checkpointing per layer (the
    simulator's default memory rules) the memory model fits it on 16 GB V100s from P = 2
    (plain stages), from P = 5 with redundancy or shadows (a node carrying two stages after
    a takeover or a restore must fit too), from P = 6 as Bamboo runs it (eager, its replica
    on the GPU, FRC of every replica: at P = 5 the last stage's loss working memory,
    1.53 GiB, and its replica of stage 0 need 16.43 GiB).
    """
    return transformer("gpt2-1.5b", layers=48, hidden=1600, seq=1024, vocab=50257,
                       micro_batch=4, global_batch=384, heads=25)


def bert_large() -> ModelCosts:
    """BERT-large (340M): 24 blocks, h=1024, seq 512, vocab 30522; micro-batch 16, batch 1024."""
    return transformer("bert-large", layers=24, hidden=1024, seq=512, vocab=30522,
                       micro_batch=16, global_batch=1024, heads=16)


PRESETS = {"gpt2-1.5b": gpt2_1_5b, "bert-large": bert_large}


def preset(name: str) -> ModelCosts:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(PRESETS)} "
                         f"or a profile .json") from None


def load_profile(path: str | Path) -> ModelCosts:
    """A profile measured on a run: per-stage forward/backward seconds of one micro-batch.

    JSON keys: `forward_s` and `backward_s` (lists, one per stage), `micro_batch_size`,
    `global_microbatches`; optional `activation_bytes`, `param_bytes` (per stage),
    `network_bytes_s`, `name`. Each measured stage becomes one "layer", so the profile
    re-partitions only at depths that divide its stage count.
    """
    path = Path(path)
    raw = read_json(path, "profile")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: profile must be a JSON object")
    for key in ("forward_s", "backward_s", "micro_batch_size", "global_microbatches"):
        if key not in raw:
            raise ValueError(f"{path}: profile lacks key {key!r}")
    fwd = _numbers(path, raw, "forward_s", "seconds", positive=True)
    bwd = _numbers(path, raw, "backward_s", "seconds", positive=True)
    if len(fwd) != len(bwd):
        raise ValueError(f"{path}: forward_s and backward_s must be equally long lists (one "
                         f"entry per stage), got {len(fwd)} and {len(bwd)}")
    params = _numbers(path, raw, "param_bytes", "bytes", default=[0.0] * len(fwd))
    if len(params) != len(fwd):
        raise ValueError(f"{path}: param_bytes must have one entry per stage")
    return ModelCosts(name=str(raw.get("name", path.stem)), forward_s=fwd, backward_s=bwd,
                      param_bytes=params,
                      activation_bytes=_number(path, "activation_bytes",
                                               raw.get("activation_bytes", 0.0), "bytes"),
                      micro_batch_size=_whole(path, raw, "micro_batch_size"),
                      global_microbatches=_whole(path, raw, "global_microbatches"),
                      network_bytes_s=_number(path, "network_bytes_s",
                                              raw.get("network_bytes_s", NETWORK_BYTES_S),
                                              "bytes/s", positive=True))


def _number(path: Path, what: str, value: object, unit: str, positive: bool = False) -> float:
    """A finite number, > 0 if `positive` (a duration, a bandwidth), else >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{path}: {what} must be a finite number {'>' if positive else '>='} "
                         f"0 {unit}, got {value!r}")
    return float(value)


def _numbers(path: Path, raw: dict, key: str, unit: str, default: list | None = None,
             positive: bool = False) -> tuple[float, ...]:
    """raw[key]: a non-empty list of such numbers, one per stage."""
    values = raw.get(key, default)
    if not isinstance(values, list) or not values:
        raise ValueError(f"{path}: {key} must be a non-empty list of {unit}, one per stage, "
                         f"got {values!r}")
    return tuple(_number(path, f"{key}[{i}]", v, unit, positive) for i, v in enumerate(values))


def _whole(path: Path, raw: dict, key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 1 and value == int(value)):
        raise ValueError(f"{path}: {key} must be a whole number >= 1, got {value!r}")
    return int(value)


def model_from_arg(arg: str) -> ModelCosts:
    """A preset name, or a path to a profile JSON."""
    if arg in PRESETS:
        return preset(arg)
    if arg.endswith(".json"):
        return load_profile(arg)
    return preset(arg)
