"""Run configuration: YAML mapped onto typed dataclasses, validated before any process starts.

The mapping is generic (driven by the dataclass type hints) so that adding a key means adding
a field; every error names the dotted key, what was expected and what was given, because a
typo found after P x D processes have started costs minutes and leaves debris.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from spotpipe.config_yaml import (ConfigError, apply_overrides, parse_override, plain_value,
                                  read_yaml)

__all__ = ["Config", "ConfigError", "apply_overrides", "from_dict", "load_config",
           "parse_override"]

@dataclass
class GPTSection:
    """The `model.gpt` keys: the fields of spotpipe.model.GPTConfig, repeated here so that a
    configuration can be read and checked without importing torch (the CLI checks it before
    anything starts); job.build_model passes them over field by field."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False


@dataclass
class HFSection:
    """`model.kind: hf`: a transformers causal LM (GPT-2 or Llama family)."""

    config: str = ""  # a model type ("gpt2", "llama") or a local folder with config.json
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields set on top
    weights: str = ""  # local safetensors file (or folder with model.safetensors); "": random


@dataclass
class ModelSection:
    kind: Literal["gpt", "factory", "hf"] = "gpt"
    gpt: GPTSection = field(default_factory=GPTSection)
    hf: HFSection = field(default_factory=HFSection)
    factory: str = ""  # "package.module:function" returning layers (+ loss)
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    # balanced: profiled time balanced under the per-stage memory bound (plan.memory)
    partition: Literal["uniform", "parameters", "time", "explicit", "balanced"] = "uniform"
    stage_of_layer: list[int] = field(default_factory=list)  # for partition: explicit
    # where stages begin, by layer name ("layers.4"; torch.distributed.pipelining's
    # SplitPoint.BEGINNING): len + 1 stages; overrides partition
    split_points: list[str] = field(default_factory=list)
    # torch.utils.checkpoint (non-reentrant) around each layer, or around each whole stage:
    # activations are recomputed in the backward instead of kept; the bits do not change
    activation_checkpointing: Literal["none", "layers", "stage"] = "none"


@dataclass
class DataSection:
    kind: Literal["text", "tokens", "factory"] = "text"
    path: str = ""
    dtype: Literal["uint16", "uint32"] = "uint16"
    block_size: int = 0  # tokens per sample; 0 takes model.gpt.block_size
    factory: str = ""
    factory_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerSection:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.0
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    # the update's kernel: "fused" (torch's), "portable" (the same bits on CPU and GPU, for
    # CPU shadows and replicas of GPU stages), "auto" (portable exactly then)
    kernel: Literal["auto", "fused", "portable"] = "auto"


@dataclass
class LRScheduleSection:
    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_iters: int = 0
    min_lr: float = 0.0


@dataclass
class LossScaleSection:
    """fp16's dynamic loss scaler (torch.amp.GradScaler's parameters and defaults)."""

    init: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class ReplicaSection:
    sync: Literal["gradient", "state"] = "gradient"  # state: the baseline, full copy every k
    sync_every: int = 1  # k, for sync: state
    device: Literal["cpu", "device"] = "cpu"  # where replica state lives
    max_lag: int = 2  # iterations the background update may fall behind before the worker waits
    offload_frc: bool = False  # keep FRC outputs on the CPU instead of the device
    # eager FRC of the replicas whose outputs a takeover sends on ("served": not the last
    # stage's, none on two stages), or of every replica, as Bamboo's engine runs it ("every":
    # for comparisons with Bamboo; the extra FRC costs throughput and serves no recovery)
    frc: Literal["served", "every"] = "served"


REPLAY_MODES = ("rest", "iteration")
# failover.heartbeat_timeout_s and hang_timeout_s are at least this many heartbeat_s (`_check`)
BEATS_PER_TIMEOUT = 2


@dataclass
class FailoverSection:
    heartbeat_s: float = 0.5  # how often each worker publishes liveness and progress
    heartbeat_timeout_s: float = 5.0  # no heartbeat for this long: the node is dead
    hang_timeout_s: float = 10.0  # computing without progress for this long: hung
    # cloud notice endpoints ("" = off; "{node}" is replaced by the node's name). AWS: the
    # spot/instance-action URL, read through IMDSv2 (its token URL is the same host's
    # /latest/api/token); GCP: the instance/preempted URL, long-polled; Azure: the
    # scheduledevents URL (api-version=2020-07-01), the VM's name read from the same host
    aws_notice_url: str = ""
    gcp_notice_url: str = ""
    azure_notice_url: str = ""
    notice_poll_s: float = 5.0
    # a cloud notice that says when the instance goes (AWS's `time`, Azure's `NotBefore`,
    # GCP's 30 s) is acted on this long before then: the node trains on until then, and
    # leaves at the next iteration boundary (its stages handed over). It must cover an
    # iteration, the agreement and the hand-over of its stages: a worker takes two of its
    # own iterations, as measured, and the time its state takes at `handover_gbps`, where
    # that is longer. A SIGTERM acts at once.
    notice_lead_s: float = 30.0
    # the network a leaving node sends its stages over, in gigabits per second, for the
    # lead above (a cloud GPU instance has 10-25; p3.2xlarge up to 10)
    handover_gbps: float = 10.0
    # ... but never waits longer than this for it: no cloud gives a spot instance more than
    # AWS's two minutes, and a time further off is more likely a clock that is wrong
    notice_max_wait_s: float = 120.0
    # when too few nodes remain for depth P, re-partition the model onto fewer stages (false:
    # nodes carry two stages until new nodes arrive)
    repartition: bool = True
    # after a crash, "rest": survivors keep their share of the in-flight iteration and only
    # the lost stage's work is redone (FRC outputs, BRC; Bamboo); "iteration": every node
    # replays the whole iteration (simpler, slower; a baseline for the benchmark)
    replay: str = "rest"
    # torchrun's --max-restarts: when the job stops on a loss it cannot fail over (e.g.
    # redundancy none at D = 1), the launcher (and its store) stay up, stop every worker and
    # start them again from the newest durable checkpoint, at most this many times (0: stop)
    restarts: int = 0


# Checkpoint schemes (spotpipe.checkpoint.schemes registers one class per name): `durable` is
# the resumable DCP tier written synchronously, `dcp_async` the same tier written with DCP's
# async_save; the others are the baselines the checkpoint benchmark measures against.
CHECKPOINT_SCHEMES = ("none", "durable", "torch_save", "checkfreq", "dcp_async", "gemini")


@dataclass
class CheckpointSection:
    # a checkpoint every k iterations (0: never), or "auto": k from the Young/Daly formula with
    # the measured checkpoint cost and the failure rate (spotpipe.checkpoint.interval)
    every: Any = 0
    scheme: str = "durable"  # one of CHECKPOINT_SCHEMES
    dir: str = ""  # default: OUT/checkpoints (torch_save/checkfreq: OUT/checkpoints_<scheme>)
    keep: int = 2  # newest checkpoints kept
    # for every: auto, the mean time between failures assumed before any is seen; failures seen
    # in the run update it (interval.mtbf_estimate)
    mtbf_s: float = 3600.0
    # a file holding the secret that signs manifests ("": derived from SPOTPIPE_JOIN_TOKEN,
    # else a per-user key file; spotpipe.checkpoint.origin)
    key: str = ""


@dataclass
class TrainingSection:
    # a non-finite loss or global gradient norm at an iteration's commit: "stop" ends the job
    # naming the iteration and the stage; "skip" skips that optimizer step on every node
    nonfinite: Literal["stop", "skip"] = "stop"


@dataclass
class ShadowSection:
    enabled: bool = False  # one CPU shadow process per stage holds a checkpoint of every iteration
    # iterations a shadow may fall behind before the stage's writer waits (behind the one it
    # holds until the writer's next gradient confirms its commit)
    max_lag: int = 4


@dataclass
class LoggingSection:
    progress: bool = True  # progress bar on the launcher's terminal
    tensorboard: bool = False  # write DIR/tensorboard/
    sample_log: bool = False  # DIR/logs/samples.*.jsonl: which samples each iteration used
    state_digests: bool = False  # DIR/logs/digests.*.jsonl: hashes of stage/replica state (tests)


@dataclass
class ClusterSection:
    host: str = "127.0.0.1"  # the embedded store binds here; loopback unless told otherwise
    port: int = 0  # 0 picks a free port
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 120.0  # store and collective timeout
    threads_per_worker: int = 1  # torch intra-op threads in each worker
    # workers start as forks of a process that imported torch once (spotpipe.cluster.forkserver)
    # rather than as fresh interpreters that each import it (3 s of CPU apiece)
    fork_server: bool = True
    # memory one stage may use, GiB (0: the GPU's memory; on CPU the host's RAM shared by the
    # workers started on it): the launch refuses a stage whose estimate exceeds it
    device_memory_gb: float = 0.0
    store: Literal["tcp", "etcd"] = "tcp"  # tcp: embedded TCPStore; etcd: an etcd server
    etcd_endpoint: str = ""  # host:port of etcd's client URL, when store is etcd
    # etcd over TLS, as torchrun's --rdzv-conf: "protocol=https,cacert=CA,cert=CERT,key=KEY"
    # (`spotpipe.store.tls`; its files are checked at launch, on the launching host)
    etcd_conf: str = ""


# model keys that decide how the model is cut into stages and run, not its tensors
_RUN_NOT_TENSORS = ("partition", "stage_of_layer", "split_points", "activation_checkpointing")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_schedule: LRScheduleSection = field(default_factory=LRScheduleSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    redundancy: Literal["none", "lazy", "eager"] = "none"
    # compute dtype: autocast inside each layer, layer outputs (what travels between stages)
    # in it; master weights, gradients and optimizer state stay fp32 (spotpipe.runtime.precision)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    replica: ReplicaSection = field(default_factory=ReplicaSection)
    failover: FailoverSection = field(default_factory=FailoverSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    shadow: ShadowSection = field(default_factory=ShadowSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    stages: int = 2
    pipelines: int = 1
    micro_batch_size: int = 4
    num_microbatches: int = 4
    iterations: int = 100
    seed: int = 0
    # not a key: the folder of the YAML file, searched for user factories like the working dir
    source_dir: str = field(default="", repr=False, metadata={"internal": True})

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.pipelines

    def lr_at(self, step: int) -> float:
        """The learning rate of iteration `step` (0-based): warmup, then constant, cosine or
        linear. A function of the config alone, so any process resumes at any step, and the
        coordinator can name the rate of an iteration whose node did not report it."""
        s = self.lr_schedule
        if s.warmup_iters and step < s.warmup_iters:
            factor = (step + 1) / s.warmup_iters
        elif s.kind == "constant":
            factor = 1.0
        else:
            floor = s.min_lr / self.optimizer.lr
            span = max(1, self.iterations - s.warmup_iters)
            progress = min(1.0, (step - s.warmup_iters) / span)
            if s.kind == "cosine":
                factor = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                factor = floor + (1.0 - floor) * (1.0 - progress)
        return self.optimizer.lr * factor

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("source_dir")
        return data

    def model_digest(self) -> str:
        """A hash of what a checkpoint's tensors depend on: the model's keys that decide the
        tensors' names, shapes and dtypes (and initial values), and the optimizer kind. P, D,
        the schedule and the data layout may differ between save and load, and so may how
        the model is cut into stages and run (`_RUN_NOT_TENSORS`): a checkpoint is resharded
        on load. (A node joining a running job is checked against `digest` as well, which
        covers those keys.)"""
        model = dataclasses.asdict(self.model)
        for key in _RUN_NOT_TENSORS:
            model.pop(key)
        model["gpt"].pop("dropout")  # (a GPT's dropout changes no tensor either)
        blob = json.dumps({"model": model, "optimizer": self.optimizer.name},
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def digest(self) -> str:
        """A hash of what determines the training result, for manifests and join checks."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def key_digests(self) -> dict[str, str]:
        """A short hash of each key's value, by dotted key. A node that joins carries these
        beside `digest()`, so that a refusal can name the keys that differ without the
        values themselves travelling (arrival records are readable by anyone on the store)."""
        return {key: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
                for key, value in _flatten(self.to_dict())}


# keys that `auto` settles on each host from what that host has, so two hosts of one job can
# settle them differently (job.choose_backend, runtime.optim.optimizer_kernel)
HOST_DECIDED = {"cluster.backend": "its GPUs", "optimizer.kernel": "its backend"}


def differing_keys(cfg: Config, theirs: dict[str, str]) -> list[str]:
    """The dotted keys whose values differ between `cfg` and a node's `key_digests()`
    (keys only one side knows count as differing: another build of spotpipe)."""
    mine = cfg.key_digests()
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def _flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


# --------------------------------------------------------------------------- generic mapping


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _finite_inside(value, key)
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        raise TypeError("unions are not used in Config")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if not -2**63 <= value < 2**63:  # (torch, numpy and the store take 64 bits)
            raise ConfigError(f"{key}: expected an integer in -2**63..2**63-1 (64 bits), got "
                              f"{_shown(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return finite(float(value), key)
        except OverflowError:  # an integer beyond any float
            raise ConfigError(f"{key}: expected a finite number, got {_shown(value)}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Any:
        _finite_inside(value, key)
        return value
    raise TypeError(f"unsupported config type {tp!r} at {key}")


def _shown(value: int) -> str:
    """An integer as a message shows it (a huge one by its size: it may not even print)."""
    return str(value) if abs(value) < 10**30 else f"an integer of {value.bit_length()} bits"


def finite(value: float, key: str) -> float:
    """`value`, or a ConfigError naming `key`: NaN or infinity in a setting only ever ends
    in a traceback or a run that never stops."""
    if not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value}")
    return value


def _finite_inside(value: Any, key: str) -> None:
    """No NaN or infinity anywhere in a free-form value (factory kwargs)."""
    if isinstance(value, float):
        finite(value, key)
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite_inside(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_inside(v, f"{key}[{i}]")


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {dotted!r}{hint}; {where} accepts: {', '.join(names)}")
        kwargs[key] = _convert(value, hints[key], dotted)
    return cls(**kwargs)


def _check(cfg: Config) -> None:
    """Semantic checks the type mapping cannot express."""
    positive = {"stages": cfg.stages, "pipelines": cfg.pipelines,
                "micro_batch_size": cfg.micro_batch_size,
                "num_microbatches": cfg.num_microbatches, "iterations": cfg.iterations,
                "cluster.threads_per_worker": cfg.cluster.threads_per_worker,
                "model.gpt.vocab_size": cfg.model.gpt.vocab_size,
                "model.gpt.block_size": cfg.model.gpt.block_size,
                "model.gpt.n_layer": cfg.model.gpt.n_layer,
                "model.gpt.n_head": cfg.model.gpt.n_head, "model.gpt.n_embd": cfg.model.gpt.n_embd}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: expected a positive integer, got {value}")
    g = cfg.model.gpt
    if g.n_embd % g.n_head:
        raise ConfigError(f"model.gpt.n_embd: {g.n_embd} is not divisible by model.gpt.n_head "
                          f"= {g.n_head}")
    if not 0.0 <= g.dropout < 1.0:
        raise ConfigError(f"model.gpt.dropout: expected a number in [0, 1), got {g.dropout}")
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr: expected a positive number, got {o.lr}")
    if o.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip: expected >= 0 (0 disables), got {o.grad_clip}")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas: expected two numbers in [0, 1), got {o.betas}")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay: expected >= 0, got {o.weight_decay}")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps: expected a positive number, got {o.eps}")
    if o.momentum < 0:
        raise ConfigError(f"optimizer.momentum: expected >= 0, got {o.momentum}")
    s = cfg.lr_schedule
    if s.warmup_iters < 0:
        raise ConfigError(f"lr_schedule.warmup_iters: expected >= 0, got {s.warmup_iters}")
    # (cosine and linear decay from optimizer.lr to min_lr; constant does not read min_lr)
    if s.min_lr < 0:
        raise ConfigError(f"lr_schedule.min_lr: expected >= 0 (a negative rate climbs the "
                          f"loss), got {s.min_lr}")
    if s.kind != "constant" and s.min_lr > o.lr:
        raise ConfigError(f"lr_schedule.min_lr: expected at most optimizer.lr ({o.lr}): the "
                          f"{s.kind} schedule decays from optimizer.lr to min_lr, got {s.min_lr}")
    if cfg.model.kind == "factory" and ":" not in cfg.model.factory:
        raise ConfigError("model.factory: expected 'package.module:function' when model.kind is "
                          f"'factory', got {cfg.model.factory!r}")
    if cfg.model.kind == "hf" and not cfg.model.hf.config:
        raise ConfigError("model.hf.config: required when model.kind is 'hf' (a model type such "
                          "as 'gpt2' or 'llama', or a local folder with config.json)")
    if cfg.data.kind == "factory" and ":" not in cfg.data.factory:
        raise ConfigError("data.factory: expected 'package.module:function' when data.kind is "
                          f"'factory', got {cfg.data.factory!r}")
    if cfg.data.block_size < 0:
        raise ConfigError(f"data.block_size: expected >= 0, got {cfg.data.block_size}")
    if cfg.model.kind == "gpt" and cfg.data.block_size > g.block_size:
        raise ConfigError(f"data.block_size: expected at most model.gpt.block_size "
                          f"({g.block_size}), the longest sequence the GPT takes, got "
                          f"{cfg.data.block_size}")
    if cfg.data.kind in ("text", "tokens") and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.kind is {cfg.data.kind!r}")
    if cfg.model.partition == "explicit" and not cfg.model.stage_of_layer:
        raise ConfigError("model.stage_of_layer: required when model.partition is 'explicit' "
                          "(one stage index per layer)")
    if cfg.redundancy != "none" and cfg.stages < 2:
        raise ConfigError(f"redundancy: {cfg.redundancy!r} needs stages >= 2 (a replica lives on "
                          f"the neighbouring stage's node), got stages = {cfg.stages}")
    ls = cfg.loss_scale
    if ls.init <= 0 or ls.growth_factor <= 1 or not 0 < ls.backoff_factor < 1 \
            or ls.growth_interval < 1:
        raise ConfigError("loss_scale: expected init > 0, growth_factor > 1, backoff_factor in "
                          f"(0, 1) and growth_interval >= 1, got {dataclasses.asdict(ls)}")
    if cfg.shadow.max_lag < 1:
        raise ConfigError(f"shadow.max_lag: expected a positive integer, got {cfg.shadow.max_lag}")
    if cfg.replica.sync_every < 1 or cfg.replica.max_lag < 1:
        raise ConfigError("replica.sync_every and replica.max_lag: expected positive integers")
    _check_checkpoint(cfg)
    f = cfg.failover
    for key in ("heartbeat_s", "heartbeat_timeout_s", "hang_timeout_s", "notice_poll_s"):
        if getattr(f, key) <= 0:
            raise ConfigError(f"failover.{key}: expected a positive number, got {getattr(f, key)}")
    for name in ("notice_lead_s", "notice_max_wait_s"):
        value = getattr(f, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"failover.{name}: expected a number of seconds >= 0, got {value}")
    if not (math.isfinite(f.handover_gbps) and f.handover_gbps > 0):
        raise ConfigError(f"failover.handover_gbps: expected a positive number of gigabits "
                          f"per second, got {f.handover_gbps}")
    if f.replay not in REPLAY_MODES:
        raise ConfigError(f"failover.replay: expected one of {', '.join(REPLAY_MODES)}, got "
                          f"{f.replay!r}")
    if not isinstance(f.restarts, int) or f.restarts < 0:
        raise ConfigError(f"failover.restarts: expected a non-negative integer, got "
                          f"{f.restarts!r}")
    # beats are sent, and read by the coordinator, once every heartbeat_s each, out of step:
    # a working node's newest beat (and its progress) may be up to two beats old when read
    for key in ("heartbeat_timeout_s", "hang_timeout_s"):
        if getattr(f, key) < BEATS_PER_TIMEOUT * f.heartbeat_s:
            raise ConfigError(
                f"failover.{key}: expected at least {BEATS_PER_TIMEOUT} x failover.heartbeat_s "
                f"= {BEATS_PER_TIMEOUT * f.heartbeat_s:g} s (a node's beats, sent and read once "
                "per heartbeat_s, can be that old while it works: a shorter timeout fences "
                f"working nodes), got {getattr(f, key)}")
    memory = cfg.cluster.device_memory_gb
    if memory < 0:
        raise ConfigError("cluster.device_memory_gb: expected >= 0 (0: the device's memory, or "
                          f"the host's RAM shared by its workers), got {memory}")
    if not 0 <= cfg.cluster.port < 65536:
        raise ConfigError(f"cluster.port: expected 0..65535, got {cfg.cluster.port}")
    if cfg.cluster.timeout_s <= 0:
        raise ConfigError(f"cluster.timeout_s: expected a positive number, got "
                          f"{cfg.cluster.timeout_s}")
    if cfg.cluster.store == "etcd":
        try:
            parse_endpoint(cfg.cluster.etcd_endpoint)
        except ValueError as exc:
            raise ConfigError(f"cluster.etcd_endpoint: {exc} (required when cluster.store is "
                              "etcd)") from None
    elif cfg.cluster.etcd_conf:
        raise ConfigError("cluster.etcd_conf: given, but cluster.store is tcp (it says how to "
                          "reach etcd)")


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError saying what is wrong otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port (e.g. 127.0.0.1:2379), got {text!r}")
    return host.strip("[]"), int(port)


def _check_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    every = c.every
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise ConfigError(f"checkpoint.every: expected an integer >= 0 or 'auto', got {every!r}")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep: expected an integer >= 1, got {c.keep}")
    if c.scheme not in CHECKPOINT_SCHEMES:
        close = difflib.get_close_matches(c.scheme, CHECKPOINT_SCHEMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"checkpoint.scheme: expected one of {', '.join(CHECKPOINT_SCHEMES)}, "
                          f"got {c.scheme!r}{hint}")
    if c.mtbf_s <= 0:
        raise ConfigError(f"checkpoint.mtbf_s: expected a positive number of seconds, got "
                          f"{c.mtbf_s}")
    if cfg.shadow.enabled and every == "auto":
        raise ConfigError("checkpoint.every: 'auto' is not supported with shadow.enabled (the "
                          "shadows write the durable tier every k iterations); give k")
    if c.scheme == "gemini" and every and cfg.stages * cfg.pipelines < 2:
        raise ConfigError("checkpoint.scheme: 'gemini' keeps each copy in another node's memory "
                          "and needs at least 2 nodes (stages x pipelines), got 1")


def from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    data = apply_overrides(plain_value(data or {}, ""), overrides or [])
    cfg = _build(Config, data, "")
    _check(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML file; relative data paths are taken relative to the file's folder."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a configuration file")
    if not path.is_file():
        raise ConfigError(f"{path}: no such configuration file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte {exc.start} (line {line}) is "
                          f"0x{raw[exc.start]:02x}; save the file as UTF-8") from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty (no keys); expected a mapping of "
                          "configuration keys")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        cfg = from_dict(data, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    cfg.source_dir = str(path.parent.resolve())  # where user factories are also looked up
    if cfg.data.path and not Path(cfg.data.path).is_absolute():
        candidate = path.parent / cfg.data.path
        if candidate.exists() or not Path(cfg.data.path).exists():
            cfg.data.path = str(candidate.resolve())
    return cfg
