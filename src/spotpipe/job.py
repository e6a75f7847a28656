"""What every process of a job builds from the configuration: model, dataset, partition.

The launcher calls these once before any worker starts, so that bad input (a factory that does
not import, a missing data file, more stages than layers) is reported cleanly, and so that the
partition (which may come from noisy profiling) is decided once and handed to every worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spotpipe.config import Config
from spotpipe.data import (DataError, GlobalSampler, TextDataset, TokenFileDataset, collate,
                           load_user_dataset)
from spotpipe.model import (GPTConfig, LayeredModel, PartitionError, build_gpt, build_user_model,
                            template)
from spotpipe.model.gpt import Block, Embedding
from spotpipe.model.measure import profile_layer_memory
from spotpipe.model.named import SplitError, split_points_map
from spotpipe.model.partition import (balanced_partition, bounded_partition, cut,
                                      explicit_partition, parameter_counts, profile_layer_times)
from spotpipe.model.precision import Precision
from spotpipe.plan.memory import (GIB, LayerMemory, MemoryEstimate, MemoryRules,
                                  block_backward_bytes, carried, embedding_backward_bytes,
                                  estimate_stage, range_facts, stage_facts)
from spotpipe.plan.layers import node_layers
from spotpipe.plan.layout import Layout
from spotpipe.plan.profile import LayerProfile, cross_stage_tied


def first_layout(cfg: Config) -> Layout:
    """The layout every job starts in: node r runs stage r % P of pipeline r // P."""
    return Layout.build(cfg.stages, cfg.pipelines,
                        [f"node{r}" for r in range(cfg.stages * cfg.pipelines)])


def start_layers(cfg: Config, partition: Sequence[tuple[int, int]],
                 nodes: Iterable[str]) -> set[int]:
    """The layers whose state `nodes` build (and load from a checkpoint) when the job starts:
    their stages' and their replicas' in the first layout."""
    layout = first_layout(cfg)
    return set().union(*(node_layers(layout, list(partition), node,
                                     redundancy=cfg.redundancy != "none") for node in nodes))


def build_model(cfg: Config) -> LayeredModel:
    if cfg.model.kind == "gpt":
        return build_gpt(GPTConfig(**dataclasses.asdict(cfg.model.gpt)), seed=cfg.seed)
    if cfg.model.kind == "hf":
        from spotpipe.model.hf import build_hf_model, split_hf  # transformers: the hf extra

        h = cfg.model.hf
        return split_hf(*build_hf_model(h.config, dict(h.overrides), h.weights, cfg.seed))
    return build_user_model(cfg.model.factory, dict(cfg.model.factory_kwargs), seed=cfg.seed)


def model_identity(cfg: Config) -> str:
    """What the initial weights depend on: the model (its digest) and the seed."""
    return f"{cfg.model_digest()}/seed{cfg.seed}"


HELD = "held layers from the initial weights file"  # what `build_model_holding` says
NO_INITIAL_FILE = "whole: no initial weights file"


def build_model_holding(cfg: Config, run_dir: Path,
                        layers: Iterable[int]) -> tuple[LayeredModel, str]:
    """The model with values for `layers` only (the rest on the meta device), read from the
    initial weights this host's launcher or agent wrote (model/template.py): a worker's memory
    never holds the whole model. The file is only a shortcut to what the seed builds: where
    it is missing, written for another model (a node that comes to join with the wrong
    model, which the job then refuses), or does not fit, or where the model cannot be built
    on the meta device (a factory that computes with its tensors while it builds), the model
    is built whole, to the same values. The second value says which it was, for the
    worker's events."""
    path = run_dir / template.INITIAL_FILE
    if not path.is_file():
        return build_model(cfg), NO_INITIAL_FILE
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception as exc:  # the factory needs real tensors
        return build_model(cfg), f"whole: the model does not build on the meta device " \
                                 f"({_first_line(exc)})"
    outside = template.meta_outside_state(model)
    if outside:
        return build_model(cfg), f"whole: {outside}"
    try:
        template.load_held(model, path, model_identity(cfg), layers)
    except template.InitialFileError as exc:
        return build_model(cfg), f"whole: {_first_line(exc)}"
    return model, HELD


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def block_size(cfg: Config) -> int:
    return cfg.data.block_size or cfg.model.gpt.block_size


def model_vocabulary(cfg: Config) -> int | None:
    """The size of the model's vocabulary, which bounds the data's token ids (None for a
    factory model: only its code knows). Checked as samples are read, since an id past it
    ends in the embedding's bare IndexError on a CPU and a device assert on a GPU."""
    if cfg.model.kind == "gpt":
        return cfg.model.gpt.vocab_size
    if cfg.model.kind == "hf":
        vocab = getattr(_hf_config(cfg), "vocab_size", None)
        return vocab if isinstance(vocab, int) and vocab > 0 else None
    return None


def _hf_config(cfg: Config) -> Any:
    """The transformers model's config (the hf extra), with the job's overrides."""
    from spotpipe.model.hf import load_config

    return load_config(cfg.model.hf.config, dict(cfg.model.hf.overrides))


def model_positions(cfg: Config) -> tuple[str, int] | None:
    """The longest sequence a transformers model takes, with the name its config gives it
    (`max_position_embeddings`, GPT-2's `n_positions`), or None where unknown. The built-in
    GPT's bound is a key (`model.gpt.block_size`), checked with the configuration."""
    if cfg.model.kind != "hf":
        return None
    config = _hf_config(cfg)
    positions = getattr(config, "max_position_embeddings", None)
    name = getattr(config, "attribute_map", {}).get("max_position_embeddings",
                                                    "max_position_embeddings")
    return (name, positions) if isinstance(positions, int) and positions > 0 else None


def _check_positions(cfg: Config) -> None:
    """Samples longer than the model's positions: refused naming the keys, as over
    `model.gpt.block_size` (GPT-2's learned positions ended in a bare IndexError at launch)."""
    bound = model_positions(cfg)
    if bound is not None and block_size(cfg) > bound[1]:
        raise DataError(
            f"data.block_size: {block_size(cfg)} tokens a sample, more than the model's "
            f"{bound[0]} ({bound[1]}), the longest sequence it takes"
            + ("" if cfg.data.block_size else " (data.block_size 0 takes "
               "model.gpt.block_size)"))


def build_dataset(cfg: Config) -> Any:
    d = cfg.data
    if d.kind in ("tokens", "text"):
        _check_positions(cfg)
    vocab = model_vocabulary(cfg) if d.kind in ("tokens", "text") else None
    if d.kind == "tokens":
        return TokenFileDataset(d.path, block_size(cfg), dtype=d.dtype, vocab_size=vocab)
    if d.kind == "text":
        return TextDataset(d.path, block_size(cfg), vocab_size=vocab)
    return load_user_dataset(d.factory, dict(d.factory_kwargs))


def build_sampler(cfg: Config, dataset: Any) -> GlobalSampler:
    return GlobalSampler(len(dataset), cfg.global_batch, cfg.seed)


def data_source(cfg: Config) -> str:
    """The data as a user names it: the file, or the factory spec."""
    d = cfg.data
    return f"data file {d.path!r}" if d.kind in ("text", "tokens") else \
        f"dataset spec {d.factory!r}"


def data_digest(cfg: Config) -> str:
    """The SHA-256 of the data file's bytes ("" for a factory dataset, whose samples only its
    code knows). Hosts must read the same data: a sample's inputs are read on its pipeline's
    first stage and its targets on the last, often on two hosts, and copies of one length but
    other contents (another version of a tokenized corpus) would pair one copy's inputs with
    the other's targets without any error. Counting samples (`build_job_dataset`) cannot see
    that; a digest of every byte can, once per host, at about a second per GB."""
    if cfg.data.kind not in ("text", "tokens"):
        return ""
    sha = hashlib.sha256()
    try:
        with open(cfg.data.path, "rb") as f:
            while chunk := f.read(1 << 23):
                sha.update(chunk)
    except OSError as exc:
        raise DataError(f"{data_source(cfg)}: cannot be read ({exc.strerror or exc})") from None
    return sha.hexdigest()


def build_job_dataset(cfg: Config, num_samples: int) -> Any:
    """The dataset of a worker: the one the launcher counted `num_samples` in (`RunSpec`).

    Every process draws its pipelines' samples from the permutation of `num_samples`
    (`GlobalSampler`): a process whose copy of the data holds another count (a file copied
    to its host in part, or since changed; a factory that gives another length there) would
    take its share of each batch from another permutation, consuming samples twice and
    skipping others without any error. It is refused instead, naming the data."""
    dataset = build_dataset(cfg)
    if len(dataset) != num_samples:
        raise DataError(
            f"{data_source(cfg)} holds {len(dataset)} samples in this process, the job was "
            f"launched with {num_samples}: every process must read the same data (is this "
            "host's copy complete and the launcher's?)")
    return dataset


def profile_model(cfg: Config, model: LayeredModel, dataset: Any) -> LayerProfile:
    """The layer profile every partition of this job is cut from (plan/profile.py): measured
    once, at launch. Times are profiled only for the methods that balance them."""
    sample, target = collate(dataset, list(range(cfg.micro_batch_size)))
    precision = Precision.of(cfg)
    times = None
    if cfg.model.partition in ("time", "balanced") and not cfg.model.split_points:
        times = tuple(profile_layer_times(model, sample, precision=precision))
    memory = with_layer_backward(model, profile_layer_memory(model, sample, precision, target),
                                 sample, precision)
    return LayerProfile(names=tuple(model.layer_names), params=tuple(parameter_counts(model)),
                        memory=tuple(memory), times=times, tied=tuple(model.tied))


def with_layer_backward(model: LayeredModel, memory: Sequence[LayerMemory], sample: Any,
                        precision: Precision) -> list[LayerMemory]:
    """The layers' facts with the backward working memory (`backward_bytes`) of each of
    spotpipe's GPT embeddings and blocks, from its sizes and the micro-batch's shape: what
    autograd saves, which the profile measures, does not show what the backward allocates."""
    out = list(memory)
    for i, layer in enumerate(model.layers):
        own = _own_backward_bytes(layer, sample, precision.name)
        if own is not None:
            out[i] = dataclasses.replace(out[i], backward_bytes=own)
    return out


def _own_backward_bytes(layer: Any, sample: Any, precision: str) -> float | None:
    """A GPT layer's own backward working memory on `sample`'s (b, s) token ids
    (plan/memory.py); None for other layers (whose input may have another shape)."""
    if not isinstance(layer, (Block, Embedding)):
        return None
    micro_batch, seq = sample.shape[:2]
    if isinstance(layer, Block):
        return block_backward_bytes(micro_batch, seq, layer.ln_1.normalized_shape[0], precision)
    return embedding_backward_bytes(micro_batch, seq, layer.wte.embedding_dim,
                                    layer.wte.num_embeddings, precision)


def compute_partition(cfg: Config, profile: LayerProfile,
                      num_stages: int | None = None) -> list[tuple[int, int]]:
    """The layer ranges of the configured method at `num_stages` (the configured depth by
    default): a pure function of the profile, so every depth comes from one measurement."""
    p = num_stages or cfg.stages
    n = profile.num_layers
    if cfg.model.split_points:
        if len(cfg.model.split_points) + 1 != p:
            raise PartitionError(f"model.split_points {cfg.model.split_points} make "
                                 f"{len(cfg.model.split_points) + 1} stages, the job has {p}")
        try:
            stage_of = split_points_map(list(profile.names), list(cfg.model.split_points))
        except SplitError as exc:
            raise PartitionError(str(exc)) from None
        ranges = explicit_partition(stage_of, p, n)
        refuse_parameterless_stage(profile.params, ranges)
        return ranges
    method = cfg.model.partition
    if method == "balanced":
        if profile.times is None:
            raise PartitionError("partition method 'balanced' needs the layers' profiled "
                                 "times, and the profile has none")
        ranges = balanced_under_memory(cfg, profile, p)
    else:
        ranges = cut(method, n, p, params=profile.params, times=profile.times,
                     explicit=list(cfg.model.stage_of_layer) or None)
    refuse_parameterless_stage(profile.params, ranges)
    return ranges


def refuse_parameterless_stage(params: tuple[int, ...] | list[int],
                               ranges: list[tuple[int, int]]) -> None:
    """A stage must hold parameters: its optimizer, its replica's updates and the loss
    scale all live with them (torch refuses an optimizer of none). A depth whose cut gives
    a stage only parameterless layers (activations, dropout, reshapes) is refused here, so
    that a re-partition to it is refused by the planner (`plan.recovery._choose`) instead
    of stopping the nodes midway with torch's "optimizer got an empty parameter list"."""
    for stage, (start, end) in enumerate(ranges):
        if not any(params[start:end]):
            raise PartitionError(f"stage {stage} of {len(ranges)} would hold only layers "
                                 f"{start}-{end - 1}, which have no parameters")


def partition_at_depth(cfg: Config, profile: LayerProfile,
                       depth: int) -> list[tuple[int, int]]:
    """The partition a re-partition to `depth` stages uses: the configured method, as at
    launch. An explicit map names the stage of every layer for the configured depth only."""
    if cfg.model.split_points and depth != cfg.stages:
        raise PartitionError(
            f"model.split_points place the stages of a {cfg.stages}-stage job and cannot be "
            f"derived for {depth}; leave them out to let the job change its depth")
    if cfg.model.partition == "explicit" and depth != cfg.stages:
        raise PartitionError(
            f"model.partition is explicit: model.stage_of_layer places the layers on "
            f"{cfg.stages} stages and cannot be derived for {depth}; use uniform, parameters or "
            "time to let the job change its depth")
    ranges = compute_partition(cfg, profile, depth)
    name = misplaced_tie(profile.tied, ranges)
    if name:
        raise PartitionError(f"tied parameter {name} would be split across stages at P={depth} "
                             "but is on neither the first nor the last stage")
    return ranges


def min_stages(cfg: Config, profile: LayerProfile) -> int:
    """The smallest depth at which every stage fits its memory as the launch checks it
    (`memory_report`): a re-partition goes no lower. Without it the runtime's planner took
    any depth down to 1 (the simulator alone passed its own bound), and a job that lost
    nodes could re-partition onto stages too large for its devices. 1 where the layers'
    memory was not measured."""
    if not profile.memory:
        return 1
    for depth in range(1, cfg.stages):
        try:
            ranges = partition_at_depth(cfg, profile, depth)
        except PartitionError:  # (no partition at this depth: the planner refuses it and
            return depth        # says why, `plan.recovery._choose`)
        if memory_report(cfg, profile.memory, ranges)[1] is None:
            return depth
    return cfg.stages


def stages_fit(cfg: Config, profile: LayerProfile
               ) -> Callable[[Sequence[tuple[int, int]], tuple[int, ...]], bool] | None:
    """Whether one node's memory holds these stages of a partition (layer ranges), as the
    launch estimates a stage (`memory_report`): the planner copies or restores a stage onto
    a node only where it fits beside the node's own (`plan.policy.Room`). A node that runs
    several stages holds no replica, so each is estimated without one, and with every
    micro-batch of the iteration on its pipeline (a job that dropped pipelines runs them
    all, as `sim.fit` checks at D = 1). None where the layers' memory was not measured."""
    layers = profile.memory
    if not layers:
        return None
    mem = device_memory(cfg)
    rules = dataclasses.replace(memory_rules(cfg, cfg.stages), redundancy="none",
                                microbatches=cfg.num_microbatches * cfg.pipelines)

    def fit(ranges: Sequence[tuple[int, int]], stages: tuple[int, ...]) -> bool:
        at = dataclasses.replace(rules, num_stages=len(ranges))
        return sum(_needed(e, mem) for e in carried(layers, ranges, stages, at)) <= mem.bytes
    return fit


def misplaced_tie(tied: tuple[tuple[str, str], ...] | list[tuple[str, str]],
                  ranges: list[tuple[int, int]]) -> str | None:
    """A tied parameter split across stages away from the first and last stage, if any: the
    runtime keeps only first/last ties (like GPT's embedding and head) in sync."""
    last = len(ranges) - 1
    for name in sorted(cross_stage_tied(tied, ranges)):
        layer = int(name.split(".", 1)[0])
        if not (ranges[0][0] <= layer < ranges[0][1] or ranges[last][0] <= layer < ranges[last][1]):
            return name
    return None


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs beyond the config: decided once by the launcher. The
    profile lets whoever coordinates cut the model at another depth without building it."""

    partition: list[tuple[int, int]]
    num_samples: int
    profile: LayerProfile
    # the data's `data_digest` where the job runs on several hosts ("" on one host, where
    # every process reads the same file, and for a factory dataset): each host's is checked
    # against it before its agent is admitted
    data_digest: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"partition": [list(r) for r in self.partition], "num_samples": self.num_samples,
                "profile": self.profile.to_json(), "data_digest": self.data_digest}

    @classmethod
    def from_json(cls, data: Any) -> "RunSpec":
        """Checked field by field (it comes from a file or a store record): ValueError naming
        the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError("run spec: not an object")
        profile = LayerProfile.from_json(data.get("profile"))
        rows = data.get("partition")
        if not isinstance(rows, list) or not rows or not all(
                isinstance(r, list) and len(r) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in r) for r in rows):
            raise ValueError(f"run spec: partition is not a list of [start, end] layer "
                             f"ranges: {rows!r}")
        partition = [(int(a), int(b)) for a, b in rows]
        ends = [0] + [b for _, b in partition]
        if [a for a, _ in partition] != ends[:-1] or ends[-1] != profile.num_layers or any(
                a >= b for a, b in partition):
            raise ValueError(f"run spec: partition {rows} does not cover the profile's "
                             f"{profile.num_layers} layers in order")
        samples = data.get("num_samples")
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise ValueError(f"run spec: num_samples is not a positive count: {samples!r}")
        digest = data.get("data_digest", "")
        if not isinstance(digest, str) or (digest and (
                len(digest) != 64 or digest.strip("0123456789abcdef"))):
            raise ValueError(f"run spec: data_digest is not a SHA-256 in hex: {digest!r}")
        return cls(partition, samples, profile, digest)


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def choose_backend(requested: str, gpus: int, workers_here: int) -> tuple[str, str]:
    """The backend for `workers_here` workers on a host with `gpus` CUDA GPUs, and a line
    for the user when `auto` chose the CPU although there are GPUs (else "").

    NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so
    it needs a GPU per worker; `auto` takes NCCL only then, and says why when it does not,
    instead of letting every worker fail inside NCCL's initialisation."""
    if requested == "gloo":
        return "gloo", ""
    if requested == "nccl":
        if gpus == 0:
            raise ValueError("cluster.backend: 'nccl' needs CUDA GPUs, and torch finds none on "
                             "this machine; use 'gloo' or 'auto'")
        if gpus < workers_here:
            raise ValueError(f"cluster.backend: 'nccl' needs a GPU for each of the "
                             f"{workers_here} workers on this host, and torch finds {gpus} "
                             "(NCCL refuses two ranks on one GPU); use fewer stages x "
                             "pipelines per host, or 'gloo'")
        return "nccl", ""
    if gpus == 0:
        return "gloo", ""
    if gpus < workers_here:
        return "gloo", (f"cluster.backend auto: gloo on the CPU, since this host has {gpus} "
                        f"GPU{'s' if gpus > 1 else ''} for {workers_here} workers and NCCL "
                        "needs one per worker")
    return "nccl", ""


def cuda_gpus() -> int:
    """The GPUs torch sees, counted through NVML where it can (`torch.cuda.device_count`),
    which leaves CUDA uninitialised: a process that forks workers must not initialise it."""
    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def resolve_backend(cfg: Config) -> str:
    """The configured backend. The launcher decides `auto` (`choose_backend`, from the workers
    of its host) and writes the decision into the configuration every worker reads, so a
    worker finds it decided; `auto` here is for code that runs outside a job (the reference
    loop, tests), decided for all the job's workers on this host."""
    if cfg.cluster.backend != "auto":
        return cfg.cluster.backend
    return choose_backend("auto", cuda_gpus(), cfg.stages * cfg.pipelines)[0]


# --------------------------------------------------------------------------- memory


def memory_rules(cfg: Config, num_stages: int) -> MemoryRules:
    micro = cfg.num_microbatches
    return MemoryRules(precision=cfg.precision, optimizer=cfg.optimizer.name,
                       schedule=cfg.schedule, num_stages=num_stages, microbatches=micro,
                       redundancy=cfg.redundancy if num_stages > 1 else "none",
                       activation_checkpointing=cfg.model.activation_checkpointing,
                       shadows=cfg.shadow.enabled,
                       replica_on_host=cfg.replica.device == "cpu",
                       offload_frc=cfg.replica.offload_frc,
                       frc_every_stage=cfg.replica.frc == "every",
                       link_slots=link_slots(cfg) if resolve_backend(cfg) != "nccl" else 0,
                       replica_max_lag=cfg.replica.max_lag)


def link_slots(cfg: Config) -> int:
    """Messages a local link buffers per channel: a channel carries at most one iteration's
    micro-batches unread (all of them once pipelines are dropped), twice that for slack; the
    cap on a ring's memory trims only the slack (`plan.memory.pipeline_ring_slots`)."""
    return 2 * cfg.num_microbatches * cfg.pipelines


@dataclass(frozen=True)
class DeviceMemory:
    """What one stage may use: bytes, where the figure comes from, and whether device and
    host are one memory (a CPU run: the replica and shadows share the RAM with the stage)."""

    bytes: float
    source: str
    shared_with_host: bool


def device_memory(cfg: Config) -> DeviceMemory:
    workers = cfg.stages * cfg.pipelines
    if cfg.cluster.device_memory_gb > 0:
        return DeviceMemory(cfg.cluster.device_memory_gb * GIB, "cluster.device_memory_gb",
                            resolve_backend(cfg) != "nccl")
    if resolve_backend(cfg) == "nccl":
        total = torch.cuda.get_device_properties(0).total_memory
        return DeviceMemory(float(total), torch.cuda.get_device_name(0), False)
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return DeviceMemory(pages * size / workers, f"host RAM / {workers} workers", True)


def memory_estimates(cfg: Config, layers: Sequence[LayerMemory],
                     ranges: list[tuple[int, int]]) -> list[MemoryEstimate]:
    rules = memory_rules(cfg, len(ranges))
    return [estimate_stage(s, stage_facts(layers, ranges, s, redundancy=rules.redundancy
                                          != "none"), rules) for s in range(len(ranges))]


def _needed(estimate: MemoryEstimate, mem: DeviceMemory) -> float:
    return estimate.device_bytes + (estimate.host_bytes if mem.shared_with_host else 0.0)


def memory_report(cfg: Config, layers: Sequence[LayerMemory],
                  ranges: list[tuple[int, int]]) -> tuple[list[str], str | None]:
    """One line per stage (estimate next to the memory), and the refusal of the first stage
    that does not fit (None when all do)."""
    mem = device_memory(cfg)
    lines, refused = [], None
    for est in memory_estimates(cfg, layers, ranges):
        need = _needed(est, mem)
        parts = ", ".join(f"{p.name} {_mib(p.bytes)}" for p in est.parts)
        lines.append(f"memory: stage {est.stage} (layers {ranges[est.stage][0]}-"
                     f"{ranges[est.stage][1] - 1}) needs {_mib(need)} of {_mib(mem.bytes)} "
                     f"({mem.source}): {parts}")
        if need > mem.bytes and refused is None:
            refused = (f"stage {est.stage} does not fit: its estimate is {_mib(need)} "
                       f"({parts}), the memory is {_mib(mem.bytes)} ({mem.source})")
    return lines, refused


def _mib(b: float) -> str:
    """MiB to a tenth, or to a thousandth below 1 MiB (a tiny stage, such as one holding only
    the final norm, must not read as needing nothing)."""
    mib = b / 2 ** 20
    return f"{mib:.1f} MiB" if mib >= 1 else f"{mib:.3f} MiB"


def balanced_under_memory(cfg: Config, profile: LayerProfile,
                          num_stages: int) -> list[tuple[int, int]]:
    """Profiled time balanced under the memory bound; the time-balanced partition when no
    partition fits (the launch then refuses it, naming the stage)."""
    assert profile.times is not None
    layers = profile.memory
    rules = memory_rules(cfg, num_stages)
    mem = device_memory(cfg)

    def fits(stage: int, start: int, end: int) -> bool:
        # the stage's own needs; its replica (its successor's layers) is checked at launch
        return _needed(estimate_stage(stage, range_facts(layers, start, end), rules),
                       mem) <= mem.bytes

    return (bounded_partition(profile.times, num_stages, fits)
            or balanced_partition(profile.times, num_stages))
