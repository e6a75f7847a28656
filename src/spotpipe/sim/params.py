"""Times the simulator charges for cluster operations, with defaults and bench calibration.

Defaults are order-of-magnitude figures for V100 instances (stated per field); a JSON of
figures measured by `spotpipe bench` replaces any of them, because the simulator's prediction
is only as good as these pauses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from spotpipe.plan.layout import splits_evenly
from spotpipe.plan.memory import GIB, MemoryRules
from spotpipe.runfiles import read_json

if TYPE_CHECKING:
    from spotpipe.sim.models import ModelCosts
    from spotpipe.sim.prices import Price


@dataclass(frozen=True)
class SimParams:
    boot_s: float = 120.0  # a granted spot instance until its worker joins (AMI boot + start)
    rendezvous_s: float = 10.0  # first membership round of a job (or after a stop)
    pause_s: float = 5.0  # failover: detect the loss, re-form groups, promote the replica
    # a preemption with notice (`SimConfig.notice_s`): the job reshapes at an iteration
    # boundary, nothing to detect or replay (`spotpipe bench failover`'s `notice_pause_s`)
    notice_pause_s: float = 5.0
    reconfig_pause_s: float = 30.0  # rebalance / add / drop pipeline / re-partition: P2P moves
    shadow_restore_pause_s: float = 60.0  # spotpipe fatal failure: reload from CPU shadows
    restart_pause_s: float = 300.0  # full restart: relaunch every process, load checkpoint
    checkpoint_interval_s: float = 1800.0  # durable checkpoints (checkpoint-restart; spotpipe
    # without shadows)
    checkpoint_cost_s: float = 0.0  # training stalled per durable checkpoint (0: free, as
    # with async saves from shadows; `spotpipe bench checkpoint` measures the schemes)
    # throughput of lazy redundancy (replicas updated from replicated gradients in the
    # background) over none: `spotpipe bench redundancy --json` measured 0.970 and 0.973
    # (its key `lazy_ratio`, so `calibrate` takes it from that output)
    lazy_ratio: float = 0.97

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite non-negative number, got {value!r}")
        if self.checkpoint_interval_s <= 0:
            raise ValueError("checkpoint_interval_s must be positive")
        if not 0 < self.lazy_ratio <= 1:
            raise ValueError(f"lazy_ratio must be in (0, 1], got {self.lazy_ratio!r}")


# figures of `spotpipe bench failover|reconfigure|checkpoint --json` that set a parameter
# under another name: the simulator charges one reconfiguration pause for rebalance, add,
# drop and re-partition alike (the mean of those measured), and a fatal failure with shadows
# costs the measured shadow recovery
RECONFIG_KEYS = ("rebalance_pause_s", "add_pipeline_pause_s", "drop_pipeline_pause_s",
                 "repartition_pause_s")
RENAMED = {"shadow_recovery_s": "shadow_restore_pause_s"}
# pause figures the benches print that calibrate nothing here (they describe other variants)
IGNORED_PAUSES = ("iteration_replay_pause_s", "eager_rest_replay_pause_s",
                  "eager_iteration_replay_pause_s", "repartition_down_pause_s",
                  "repartition_up_pause_s")


def calibrate(paths: str | Path | list[str | Path], base: SimParams | None = None) -> SimParams:
    """Override defaults from bench JSONs (flat objects, or one under a "figures" key); a later
    file overrides an earlier one.

    Keys named like the fields (pause_s, restart_pause_s, boot_s, lazy_ratio, ...) are used
    as they are; the benches' reconfiguration pauses and shadow recovery map onto their fields
    (RECONFIG_KEYS, RENAMED); other keys are ignored, since bench output carries unrelated
    figures too. An unknown *_pause_s key (a typo in a hand-written file) and a file with no
    figure at all are errors: calibrating from them would silently change nothing.
    """
    params = base or SimParams()
    for path in ([paths] if isinstance(paths, (str, Path)) else paths):
        params = _calibrate_one(Path(path), params)
    return params


def _read_calibration(path: Path) -> dict:
    raw = read_json(path, "calibration")
    if isinstance(raw, dict) and isinstance(raw.get("figures"), dict):
        raw = raw["figures"]
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: calibration must be a JSON object")
    return raw


def calibrate_shapes(paths: str | Path | list[str | Path]) -> tuple[tuple[tuple, float], ...]:
    """Measured iteration seconds per layout shape from calibration JSONs: a "shape_times"
    list of [[P, D, [[merged stages of pipeline 0], ...]], seconds] (or, for a pipeline
    whose nodes run stages apart, the stages of each of its nodes: `Layout.shape_key`; what
    `spotpipe.sim.validate` writes, also under "calibration"); a later file wins per shape.
    They replace the timing model for those shapes in every policy."""
    shapes: dict[tuple, float] = {}
    for path in ([paths] if isinstance(paths, (str, Path)) else paths):
        raw = _read_calibration(Path(path))
        items = raw.get("shape_times", (raw.get("calibration") or {}).get("shape_times", []))
        if not isinstance(items, list):
            raise ValueError(f"{path}: shape_times must be a list of [shape, seconds]")
        for i, item in enumerate(items):
            try:
                (p, d, merged), seconds = item
                key = (int(p), int(d), tuple(tuple(map(_stage_or_stages, m)) for m in merged))
                seconds = float(seconds)
            except (TypeError, ValueError):
                raise ValueError(f"{path}: shape_times[{i}]: expected [[P, D, [[...], ...]], "
                                 f"seconds], got {item!r}") from None
            if not (math.isfinite(seconds) and seconds > 0) or len(key[2]) != key[1]:
                raise ValueError(f"{path}: shape_times[{i}]: seconds must be positive and "
                                 f"one merged list per pipeline, got {item!r}")
            shapes[key] = seconds
    return tuple(shapes.items())


def _stage_or_stages(item: object) -> "int | tuple[int, ...]":
    """A merged stage, or one node's stages in a pipeline whose nodes run stages apart
    (`Layout.shape_key`, as `spotpipe.sim.validate` writes it)."""
    if isinstance(item, list):
        return tuple(int(s) for s in item)
    return int(item)  # type: ignore[call-overload]


def _calibrate_one(path: Path, base: SimParams) -> SimParams:
    raw = _read_calibration(path)
    names = {f.name for f in fields(SimParams)}
    found = {k: v for k, v in raw.items() if k in names}
    for key, field_name in RENAMED.items():
        if key in raw and field_name not in found:
            found[field_name] = raw[key]
    reconfig = [raw[k] for k in RECONFIG_KEYS if isinstance(raw.get(k), (int, float))]
    if reconfig and "reconfig_pause_s" not in found:
        found["reconfig_pause_s"] = sum(reconfig) / len(reconfig)
    unknown = sorted(k for k in raw if k.endswith("_pause_s") and k not in names
                     and k not in RECONFIG_KEYS and k not in IGNORED_PAUSES)
    if unknown:
        raise ValueError(f"{path}: unknown pause figure(s) {unknown}; known: {sorted(names)}")
    if not found and "shape_times" not in raw and "calibration" not in raw:
        raise ValueError(f"{path}: no calibration figures; expected some of {sorted(names)} "
                         f"or shape_times")
    try:
        return replace(base, **found)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# the simulator's default memory rules: mixed precision (fp16 compute, fp32 master weights and
# Adam), activation checkpointing per layer (what Megatron/DeepSpeed GPT runs at this size
# use), replicas on the host (the runtime's `replica.device: cpu`), 1 GiB of each device
# reserved for the CUDA context and the allocator; depth, micro-batches, schedule and
# redundancy are set per layout
DEFAULT_MEMORY = MemoryRules(precision="fp16", optimizer="adamw",
                             activation_checkpointing="layers", device_reserve_bytes=GIB)


@dataclass(frozen=True)
class SimConfig:
    """One job: the model, its configured P x D and schedule, the instance price, the pauses."""

    model: "ModelCosts"
    price: "Price"
    num_stages: int = 8
    num_pipelines: int = 4
    schedule: str = "1f1b"
    params: SimParams = SimParams()
    min_stages: int = 1  # below this depth the model does not fit: the job stops
    repartition: bool = True  # shrink P when too few nodes remain (`failover.repartition`)
    redundancy: str = "eager"  # spotpipe/bamboo: eager runs FRC in bubbles; lazy/none do not
    # measured seconds per iteration by layout shape (`Layout.shape_key()`), which replace the
    # timing model's for those shapes: a profile of the very cluster being predicted (see
    # `spotpipe.sim.validate`: on one machine whose cores the workers share, a takeover
    # frees a core, which no per-node timing model can know)
    shape_times: tuple[tuple[tuple, float], ...] = ()
    # samples_per_dollar: samples / dollars billed; bamboo: its simulator's time average of
    # (samples/s) / ($/h) over the time the job ran (see `Result.time_average_value`)
    value_formula: str = "samples_per_dollar"
    # memory rules of the job (None: no layout is refused for memory); the instance's device
    # and host memory come from `spotpipe.plan.memory.INSTANCES`
    memory: MemoryRules | None = DEFAULT_MEMORY
    # spotpipe keeps CPU shadows of every stage (a fatal failure loses only the iteration in
    # flight); without them it rolls back to the last durable checkpoint. They run on an
    # on-demand CPU host, billed and memory-checked as `shadow_host`
    shadows: bool = False
    shadow_host: str = "r5.4xlarge"
    shadow_host_price: float = 1.008  # $/h on-demand, AWS us-east-1 r5.4xlarge (128 GiB)
    # seconds of notice before each preemption (AWS gives 120, GCP 30; 0: every preemption
    # is a kill). spotpipe acts on it `notice_lead_s` before the removal (the runtime's
    # `failover.notice_lead_s`), or at once when the notice is shorter, and reshapes at the
    # next iteration boundary: nothing in flight is lost, and a node leaving with no replica
    # of its stage left (adjacent removals) hands the stage over itself. The other policies
    # do not use notices (torchrun's default, Bamboo's simulator)
    notice_s: float = 0.0
    notice_lead_s: float = 30.0

    @property
    def acted_notice_s(self) -> float:
        """How long before a removal spotpipe acts on its notice (0: no notice)."""
        return min(self.notice_s, self.notice_lead_s)

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_pipelines < 1:
            raise ValueError(f"need at least one stage and one pipeline, got P={self.num_stages}, "
                             f"D={self.num_pipelines}")
        if not splits_evenly(self.model.global_microbatches, self.num_pipelines):
            raise ValueError(f"{self.model.name}'s {self.model.global_microbatches} micro-batches "
                             f"per iteration do not split over {self.num_pipelines} pipelines "
                             "(each takes an equal share, as in the runtime); choose a number "
                             "of pipelines that divides them")
        if self.num_stages > self.model.num_layers:
            raise ValueError(f"{self.model.name} has {self.model.num_layers} layers, cannot run "
                             f"{self.num_stages} stages")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown schedule {self.schedule!r}; expected gpipe or 1f1b")
        if self.redundancy not in ("none", "lazy", "eager"):
            raise ValueError(f"unknown redundancy {self.redundancy!r}; expected none, lazy or "
                             f"eager")
        if self.value_formula not in ("samples_per_dollar", "bamboo"):
            raise ValueError(f"unknown value_formula {self.value_formula!r}; expected "
                             f"samples_per_dollar or bamboo")
        for name in ("notice_s", "notice_lead_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got "
                                 f"{value!r}")
        for shape, seconds in self.shape_times:
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"shape_times: iteration time of {shape} must be a positive "
                                 f"number of seconds, got {seconds!r}")

    @property
    def nodes(self) -> int:
        return self.num_stages * self.num_pipelines
