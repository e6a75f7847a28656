"""How much device and host memory one pipeline stage needs, and whether that fits.

One estimator serves two callers. The simulator builds a stage's facts analytically (GPT-2
sizes, `transformer_layers`) and refuses every layout whose stages do not fit the instance
preset (`INSTANCES`), so the smallest depth P follows from memory. The runtime builds them
from a real stage (its parameter count, measured activation bytes) and refuses to launch a
stage that would not fit its device, with the figures (`refusal`). Standard library only.

Formulas (B = bytes, N = parameters of the stage, in_flight = micro-batches whose
activations a stage holds at once, M = micro-batches per pipeline and iteration):

Model state (`state_bytes_per_param`). Weights, their gradients and the optimizer state are
fp32 whatever the compute precision: spotpipe runs bf16/fp16 under `torch.autocast`
(model/precision.py), which keeps no compute copy of the weights between operations and
accumulates the gradients on the fp32 parameters. The compute copies autocast makes are kept
by autograd for the backward, once per micro-batch in flight, so they are activations
(measured with them at launch; `transformer_layers` adds them). (The former model, Micikevicius
et al.'s mixed precision with a 2 N compute copy and 2 N gradients, had the same total for one
micro-batch but both terms wrong against a measured bf16 stage: weights 1.50, gradients 0.50
of the real figures.)
- weights 4 N, gradients 4 N;
- optimizer state: Adam/AdamW 8 N (two fp32 moments, Kingma & Ba 2015; torch.optim.AdamW
  keeps `exp_avg` and `exp_avg_sq`), SGD with momentum 4 N (torch's `momentum_buffer`).
  So Adam is 4 + 4 + 8 = 16 B/param, the ZeRO paper's figure for mixed precision too
  (Rajbhandari et al., SC '20, sec. 3.1: 2Psi + 2Psi + K Psi, K = 12), split otherwise.

Activations (`in_flight`): a stage keeps, per micro-batch in flight, what its backward needs.
- 1F1B (PipeDream-flush, Narayanan et al., SC '21): stage s of P runs P - s - 1 warm-up
  forwards before its first backward, so it holds min(P - s, M) micro-batches;
- GPipe (Huang et al., NeurIPS '19): every forward before any backward: M micro-batches.
Besides what its layers keep, a stage that is not the last holds each in-flight micro-batch's
output until that micro-batch's backward (the executor's `outputs`: nothing of the layer keeps
it): in_flight x boundary_bytes (`outputs`), counted with the kept inputs under redundancy
(the same tensors, M of them). The last stage's loss keeps its fp32 log-softmax per
micro-batch (`loss_bytes`), outside any activation checkpoint.
Activation checkpointing (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016;
non-reentrant torch.utils.checkpoint), per micro-batch in flight:
- none: activation_bytes;
- layers: the stage's input and every layer's output but the last (each the input of the next
  layer's checkpoint: `inner_outputs_bytes`) and the loss's;
- stage: the stage's input (`stage_input_bytes`) and the loss's;
and, once per stage, one micro-batch's activations while they are recomputed, the largest
layer's (`max_layer_activation_bytes`) or the whole stage's, in `backward_working` (below).
(Measured on a tiny GPT's stage 0 before these were counted: the estimate took stage 0's layer
inputs as its input, the token ids, counted as 0, and the average layer's recompute; the
device total was 0.61 of the measured peak with per-layer checkpointing.)
Analytic transformer activations (`transformer_layers`) per block and micro-batch are
s b h (34 + 5 a s / h) bytes with 16-bit activations (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys '23, eq. 1, no tensor parallelism), scaled by
dtype bytes / 2 for other precisions; the head keeps its logits (s b V in the compute dtype)
and their fp32 softmax for the loss (s b V x 4); in 16-bit each layer also keeps autocast's
compute copy of the matrices it multiplies by (`transformer_layers`). The formula assumes
attention that keeps its s x s scores and dropout masks; with fused attention and no dropout
a block keeps less (spotpipe's GPT block on CPU, fp32, saved tensors measured with
torch.autograd.graph.saved_tensors_hooks: 1.8x less at s = 128, h = 64; 2.8x less at
s = 256, h = 128), so the analytic estimate errs on the safe side; the runtime passes measured
bytes.

Redundancy (Bamboo, NSDI '23; spotpipe's replicas kept exact by gradient replication):
- none: nothing more;
- lazy: the replica of the successor's stage (its fp32 weights 4 N', the replicated gradient
  4 N', its optimizer state) on the replica's device (`replica_on_host`: the runtime's default
  `replica.device: cpu`), plus the successor's inputs of the iteration kept for a replay:
  M x boundary_bytes (what this stage sends) on the device; and, on a stage that is not the
  first, the gradients of its inputs that it sent back (`sent_gradients`, M x
  stage_input_bytes: its predecessor, should it take over, re-sends them from here);
- eager: as lazy, plus FRC's outputs of the iteration, M x the replica's boundary bytes, on the
  device, or on the host with `offload_frc` (the runtime's `replica.offload_frc`), where FRC
  runs: not for the last stage's replica nor on two stages (`schedule.frc_serves`), unless
  `frc_every_stage` (`replica.frc: every`). FRC runs under no_grad, so it keeps no
  activations and no compute copy of the replica's weights (autocast casts each weight for
  the one operation that uses it); BRC recomputes them after a loss.
Shadows (`shadows`): a CPU process per stage holds every iteration's state: fp32 weights, the
gradient it receives and the optimizer state: (4 + 4 + optimizer) N, in the memory of the
host the shadows run on (the launcher's or agent's, not a preemptible node: `shadow_host`).
Local links (`link_slots`, CPU runs; runtime/local_link.py): a worker makes the shared-memory
ring of every pipeline channel it sends on, `pipeline_ring_slots` messages of the channel's
size: the activation to the next stage (`boundary_bytes`) and the gradient to the previous one
(`stage_input_bytes`), and with redundancy its stage's gradients to their replica
(`replica_link_slots` messages: the replica's thread applies them where they lie), in the
host's memory.
Reserve: `device_reserve_bytes` of every device (CUDA context and allocator slack; about
0.5-1 GiB in practice) is not available to the stage.
Backward's working memory (`backward_working`): what one micro-batch's backward allocates
beyond what its forward kept, once per stage: the loss's (`transient_bytes`, measured by the
runtime, `loss_backward_bytes` in the analytic model) or a layer's own backward
(`layer_backward_bytes`) on top of the activations recomputed under activation checkpointing
and of the gradient received for the stage's output (a stage that is not the last),
whichever is larger (the loss's backward is done before the first recompute; summed, they
over-estimated a tiny GPT's last stage by 23-34%). A transformer block's own backward
(`block_backward_bytes`) peaks in its MLP: the gradient of the 4h-wide hidden activation,
4 s b h in the compute dtype, and of the MLP's 4h x h weight, 16 h^2 (fp32 as it is added to
the parameter's gradient; in 16-bit the compute-dtype gradient and the autocast copy it
replaces cancel; the block's input gradient, made later, is smaller); measured on spotpipe's
GPT block on the CPU, exactly in fp32, in bf16 less what oneDNN's matmul scratch adds
(0.5-1 s b h at h = 64-128). On the last stage the loss's kept log-softmax, freed by then,
makes room for it. Its attention is fused (scaled_dot_product_attention): no a s^2 scores are
made in the backward either, so none are counted. Without the block's term and the received
gradient, a tiny GPT's stage 0 was estimated at 0.82-0.92 of its measured peak with
activation checkpointing (0.93-1.04 without), 0.96-1.11 with them
(`tests/test_memory_measured.py`). GPT's embedding's own backward
(`embedding_backward_bytes`) makes its V x h token table's gradient whole, in fp32, before
adding it to the parameter's (torch's dense embedding backward, whichever tokens the
micro-batch holds), and in 16-bit an fp32 copy of its output's gradient (4 s b h: the layer
runs in fp32, its output is cast to the compute dtype); measured on the embedding alone on the
CPU, to 512 bytes in fp32 and bf16 (V = 256-8192), where the estimate had only the gradient
received (0.06-0.67 of the peak). At GPT-2's V = 50257 it is larger than a block's (GPT-2 XL,
micro-batch 4, fp16: 0.32 GiB against 0.09 GiB). The loss's are the gradients
with respect to the log-softmax and to the logits, each as large as the logits in fp32
(GPT-2 small, 8 x 512 tokens: 1.5 GiB, which the estimate missed against
`torch.cuda.max_memory_allocated` on an H200 before it was counted, with the loss's own saved
tensors: 0.78 of the measured peak in fp32). The analytic model counts them as the runtime
measures them (2 x 4 s b V; GPT-2 XL at micro-batch 4: 2 x 0.77 GiB). Both terms were 0 in
the analytic model; with them a node carrying stages 0 and 1 of GPT-2 XL at P = 4 (after a
takeover) needs 16.03 GiB, more than a 16 GiB V100 has, and the simulator's smallest depth
with redundancy there went from 4 to 5.
Not counted: temporary buffers of one kernel, the backward working memory of layers other
than spotpipe's GPT embedding and blocks and the loss (Hugging Face and torchtitan-style
models), what the embedding's recompute makes under activation checkpointing (at V = 256,
h = 64 an embedding-only stage's backward peaks there: 0.71-0.76 of it counted; from V = 2048
the token table's gradient is the larger, within 1%), each activation checkpoint's copy of
the CPU generator's state (5056 bytes), communication buffers (small against the above at
these sizes), fragmentation beyond the reserve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from spotpipe.schedule import replica_of, runs_frc

GIB = 1024 ** 3

# a local link's ring holds at most this, and 2 messages at least (a pipeline channel's an
# iteration's micro-batches at least: `pipeline_ring_slots`)
LINK_RING_CAP = 256 * 1024 ** 2
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
SCHEDULES = ("1f1b", "gpipe")
REDUNDANCY = ("none", "lazy", "eager")
CHECKPOINTING = ("none", "layers", "stage")


@dataclass(frozen=True)
class StageFacts:
    """What the estimate needs to know of one stage (and of the replica its node holds).

    activation_bytes: what one micro-batch's forward keeps for its backward, without
    activation checkpointing (the loss's `loss_bytes` included); boundary_bytes: the
    activation this stage sends on per micro-batch; input_bytes: the one it receives
    (default: boundary_bytes); inner_outputs_bytes: the outputs of its layers but the last,
    per micro-batch (what per-layer checkpointing keeps besides the input; default: layers - 1
    boundaries); max_layer_activation_bytes: its largest layer's activation_bytes without the
    loss's (default: the average, activation_bytes / layers); layer_backward_bytes: the
    largest working memory of one of its layers' own backward (`block_backward_bytes`).
    """

    params: int
    activation_bytes: float
    boundary_bytes: float
    layers: int = 1
    replica_params: int = 0
    replica_boundary_bytes: float = 0.0
    input_bytes: float | None = None
    transient_bytes: float = 0.0
    inner_outputs_bytes: float | None = None
    loss_bytes: float = 0.0
    max_layer_activation_bytes: float | None = None
    layer_backward_bytes: float = 0.0

    @property
    def stage_input_bytes(self) -> float:
        return self.boundary_bytes if self.input_bytes is None else self.input_bytes

    @property
    def layer_outputs_bytes(self) -> float:
        """The outputs of every layer but the last, per micro-batch."""
        if self.inner_outputs_bytes is not None:
            return self.inner_outputs_bytes
        return (self.layers - 1) * self.boundary_bytes

    @property
    def largest_layer_bytes(self) -> float:
        """What the largest layer keeps per micro-batch, the loss's part aside."""
        if self.max_layer_activation_bytes is not None:
            return self.max_layer_activation_bytes
        return (self.activation_bytes - self.loss_bytes) / self.layers

    def __post_init__(self) -> None:
        for name in ("params", "activation_bytes", "boundary_bytes", "replica_params",
                     "replica_boundary_bytes", "stage_input_bytes", "transient_bytes",
                     "layer_outputs_bytes", "loss_bytes", "largest_layer_bytes",
                     "layer_backward_bytes"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"StageFacts.{name} must be >= 0, got {value!r}")
        if self.layers < 1:
            raise ValueError(f"StageFacts.layers must be >= 1, got {self.layers}")


@dataclass(frozen=True)
class MemoryRules:
    """How the job runs, as far as memory goes (see the module doc for each formula)."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    schedule: str = "1f1b"
    num_stages: int = 1
    microbatches: int = 1  # per pipeline and iteration
    redundancy: str = "none"
    activation_checkpointing: str = "none"
    shadows: bool = False
    replica_on_host: bool = True  # the runtime's `replica.device: cpu`
    offload_frc: bool = False  # the runtime's `replica.offload_frc`
    frc_every_stage: bool = False  # the runtime's `replica.frc: every`
    device_reserve_bytes: float = 0.0
    link_slots: int = 0  # messages a local link buffers per channel (0: no local links)
    replica_max_lag: int = 2  # the runtime's `replica.max_lag`

    def __post_init__(self) -> None:
        for name, allowed in (("precision", COMPUTE_BYTES), ("optimizer", OPTIMIZER_BYTES),
                              ("schedule", SCHEDULES), ("redundancy", REDUNDANCY),
                              ("activation_checkpointing", CHECKPOINTING)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MemoryRules.{name}: {getattr(self, name)!r}, expected one "
                                 f"of {', '.join(allowed)}")
        if self.num_stages < 1 or self.microbatches < 1:
            raise ValueError(f"MemoryRules: num_stages and microbatches must be >= 1, got "
                             f"{self.num_stages}, {self.microbatches}")
        if self.device_reserve_bytes < 0:
            raise ValueError("MemoryRules.device_reserve_bytes must be >= 0")


@dataclass(frozen=True)
class MemoryPart:
    name: str
    where: str  # "device", "host" (the node's) or "shadow_host"
    bytes: float


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    parts: tuple[MemoryPart, ...]

    @property
    def device_bytes(self) -> float:
        return sum(p.bytes for p in self.parts if p.where == "device")

    @property
    def host_bytes(self) -> float:
        return sum(p.bytes for p in self.parts if p.where == "host")

    @property
    def shadow_host_bytes(self) -> float:
        return sum(p.bytes for p in self.parts if p.where == "shadow_host")

    def breakdown(self) -> dict[str, float]:
        """bytes per "where:name", e.g. {"device:weights": ...}."""
        return {f"{p.where}:{p.name}": p.bytes for p in self.parts}


def in_flight(schedule: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak (see the module doc)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(num_stages - stage, microbatches)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def replica_link_slots(max_lag: int) -> int:
    """Buffers of a replica's gradient channel, so that its sender never waits on the ring:
    the holder's replica thread keeps up to `max_lag` messages unapplied (in place, lent), one
    more is taken and not yet handed over, and the sender writes the next one."""
    return max_lag + 2


def link_ring_slots(message_bytes: float, slots: int, least: int = 2) -> int:
    """Buffers of a local link's ring for messages of `message_bytes`: `slots`, as far as
    LINK_RING_CAP allows, and never fewer than `least` (what its sender may have to write
    before its receiver reads: a sender blocks on a full ring) nor 2 (one being read, one
    being written)."""
    return max(2, least, min(slots, int(LINK_RING_CAP // max(1.0, message_bytes))))


def pipeline_ring_slots(message_bytes: float, link_slots: int) -> int:
    """Buffers of a pipeline channel's ring (activations, gradients, `link_slots` as
    `job.link_slots` gives it: twice an iteration's micro-batches per pipeline). The cap
    trims the slack, never the iteration: GPipe on a node that took over stage 0 from the
    last stage's (owners (P-1, 0)) sends up to M/2 messages on a channel before its
    receiver reads one, while that receiver waits to send on the other way; with fewer
    buffers both ends block on full rings for good."""
    return link_ring_slots(message_bytes, link_slots, least=link_slots // 2)


def state_bytes_per_param(precision: str, optimizer: str) -> dict[str, int]:
    """Bytes per parameter of an owned stage: weights, gradients, optimizer state; fp32 in
    every precision, as autocast keeps them (the module doc)."""
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of "
                         f"{', '.join(COMPUTE_BYTES)}")
    return {"weights": 4, "gradients": 4, "optimizer": OPTIMIZER_BYTES[optimizer]}


def estimate_stage(stage: int, facts: StageFacts, rules: MemoryRules) -> MemoryEstimate:
    """Device and host bytes of the node that runs `stage` (and holds its successor's replica)."""
    if not 0 <= stage < rules.num_stages:
        raise ValueError(f"stage {stage} is outside 0..{rules.num_stages - 1}")
    per = state_bytes_per_param(rules.precision, rules.optimizer)
    n = facts.params
    parts = [MemoryPart(name, "device", float(b * n)) for name, b in per.items()]
    parts.append(MemoryPart("activations", "device", _kept_activations(stage, facts, rules)))
    redundant = rules.redundancy != "none" and rules.num_stages > 1
    if not redundant and stage < rules.num_stages - 1:  # (else among the kept inputs)
        parts.append(MemoryPart("outputs", "device", float(_in_flight(stage, rules)
                                                           * facts.boundary_bytes)))
    received = facts.boundary_bytes if stage < rules.num_stages - 1 else 0.0
    parts.append(MemoryPart("backward_working", "device",
                            _backward_working(facts, rules, received)))
    m = rules.microbatches
    if redundant:
        r = facts.replica_params
        where = "host" if rules.replica_on_host else "device"
        replica = (4 + 4 + OPTIMIZER_BYTES[rules.optimizer]) * r
        parts.append(MemoryPart("replica", where, float(replica)))
        parts.append(MemoryPart("kept_inputs", "device", float(m * facts.boundary_bytes)))
        if stage > 0:
            parts.append(MemoryPart("sent_gradients", "device",
                                    float(m * facts.stage_input_bytes)))
        if rules.redundancy == "eager" and runs_frc(replica_of(stage, rules.num_stages),
                                                    rules.num_stages, rules.frc_every_stage):
            parts.append(MemoryPart("frc_outputs", "host" if rules.offload_frc else "device",
                                    float(m * facts.replica_boundary_bytes)))
    if rules.shadows:
        parts.append(MemoryPart("shadow", "shadow_host",
                                float((4 + 4 + OPTIMIZER_BYTES[rules.optimizer]) * n)))
    if rules.link_slots and rules.num_stages > 1:
        sent = ([facts.boundary_bytes] if stage < rules.num_stages - 1 else []) \
            + ([facts.stage_input_bytes] if stage > 0 else [])
        ring = sum(pipeline_ring_slots(b, rules.link_slots) * b for b in sent)
        if rules.redundancy != "none":  # the stage's gradients to its replica, 2 buffers
            grads = per["gradients"] * n
            ring += link_ring_slots(grads, replica_link_slots(rules.replica_max_lag)) * grads
        parts.append(MemoryPart("link_buffers", "host", float(ring)))
    if rules.device_reserve_bytes:
        parts.append(MemoryPart("reserve", "device", float(rules.device_reserve_bytes)))
    return MemoryEstimate(stage, tuple(p for p in parts if p.bytes))


def _in_flight(stage: int, rules: MemoryRules) -> int:
    return in_flight(rules.schedule, rules.num_stages, stage, rules.microbatches)


def _kept_activations(stage: int, facts: StageFacts, rules: MemoryRules) -> float:
    """What the stage's layers and loss keep for the in-flight micro-batches (the module
    doc)."""
    k = _in_flight(stage, rules)
    mode = rules.activation_checkpointing
    if mode == "none":
        return k * facts.activation_bytes
    kept = facts.stage_input_bytes + facts.loss_bytes
    if mode == "layers":
        return k * (kept + facts.layer_outputs_bytes)
    return k * kept


def _backward_working(facts: StageFacts, rules: MemoryRules, received: float) -> float:
    """What one micro-batch's backward needs beyond what was kept: the loss's working memory
    (`transient_bytes`), or a layer's own backward (`layer_backward_bytes`) on top of the
    activations recomputed under activation checkpointing (the largest layer's, or the
    stage's without the loss's), which the layer's backward runs on, and of the gradient
    `received` for the stage's output (the executor holds it until the backward returns).
    The loss's backward runs before any recompute and frees what the loss kept of the
    micro-batch, so the larger of the two, the layer's own less the loss's kept bytes."""
    mode = rules.activation_checkpointing
    recompute = 0.0 if mode == "none" else facts.largest_layer_bytes if mode == "layers" \
        else facts.activation_bytes - facts.loss_bytes
    # what the loss kept of this micro-batch is freed by then, and its gradient of the logits
    # (as large) too once the last layer's backward is done: room for the layers' own working
    # memory, never for the recompute (the last layer's, such as GPT's head, runs with it)
    own = max(0.0, facts.layer_backward_bytes + received - facts.loss_bytes)
    return float(max(facts.transient_bytes, recompute + own))


def fits(estimate: MemoryEstimate, device_bytes: float, host_bytes: float) -> bool:
    return estimate.device_bytes <= device_bytes and estimate.host_bytes <= host_bytes


def refusal(estimate: MemoryEstimate, device_bytes: float, host_bytes: float) -> str | None:
    """One line naming the stage, what it needs and what there is; None when it fits."""
    short = []
    for where, need, have in (("device", estimate.device_bytes, device_bytes),
                              ("host", estimate.host_bytes, host_bytes)):
        if need > have:
            parts = ", ".join(f"{p.name} {_gib(p.bytes)}" for p in estimate.parts
                              if p.where == where)
            short.append(f"{_gib(need)} of {where} memory ({parts}), the {where} has "
                         f"{_gib(have)}")
    if not short:
        return None
    return f"stage {estimate.stage} does not fit: it needs " + "; and ".join(short)


def _gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


# -- analytic models (the simulator's) ----------------------------------------------------

@dataclass(frozen=True)
class LayerMemory:
    """One layer of a layer-list model: parameters, bytes kept for backward per
    micro-batch, bytes of its output per micro-batch, and the working memory of one
    micro-batch's backward beyond what is kept (`transient_bytes`, needed by one micro-batch
    at a time; measured for the last layer, whose loss's gradients are as large as the
    logits in fp32, twice over), and what its own backward needs (`backward_bytes`: a
    transformer block's `block_backward_bytes`)."""

    params: int
    activation_bytes: float
    output_bytes: float
    transient_bytes: float = 0.0
    # parameters this layer shares with an earlier layer (`tied_to`; -1: none), such as GPT's
    # head and embedding: one tensor where a stage holds both layers, two copies otherwise
    tied_params: int = 0
    tied_to: int = -1
    # of activation_bytes, what the loss keeps (the last layer's; outside any checkpoint)
    loss_bytes: float = 0.0
    backward_bytes: float = 0.0


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int


GPT2 = {
    "gpt2": TransformerShape(12, 768, 12, 1024, 50257),
    "gpt2-medium": TransformerShape(24, 1024, 16, 1024, 50257),
    "gpt2-large": TransformerShape(36, 1280, 20, 1024, 50257),
    "gpt2-1.5b": TransformerShape(48, 1600, 25, 1024, 50257),  # GPT-2 XL
}


def block_backward_bytes(micro_batch: int, seq: int, hidden: int,
                         precision: str = "fp32") -> float:
    """What one transformer block's (GPT's: 4h-wide MLP, fused attention) backward needs at its
    peak beyond what its forward kept: the gradient of the MLP's hidden activation (4 s b h in
    the compute dtype) and of its 4h x h weight (fp32, as it is added to the parameter's
    gradient); see the module doc."""
    return float(4 * micro_batch * seq * hidden * COMPUTE_BYTES[precision] + 16 * hidden ** 2)


def embedding_backward_bytes(micro_batch: int, seq: int, hidden: int, vocab: int,
                             precision: str = "fp32") -> float:
    """What a GPT embedding's (token + position tables) backward needs at its peak beyond
    what its forward kept: the dense gradient of its V x h token table, fp32 as it is added to
    the parameter's `.grad` (torch's embedding backward makes it whole, whatever the tokens),
    and in 16-bit the fp32 copy of its output's gradient (4 s b h: the layer runs in fp32 and
    its output is cast to the compute dtype). The position table's (s x h) is made and freed
    before the token table's; see the module doc."""
    copy = 0 if COMPUTE_BYTES[precision] == 4 else 4 * micro_batch * seq * hidden
    return float(4 * vocab * hidden + copy)


def loss_backward_bytes(micro_batch: int, seq: int, vocab: int) -> float:
    """The loss's backward working memory: the gradients with respect to the log-softmax and
    to the logits, each as large as the logits in fp32 (what the runtime measures at launch,
    `spotpipe.model.measure`; see the module doc)."""
    return float(2 * seq * micro_batch * vocab * 4)


def transformer_layers(shape: TransformerShape, micro_batch: int,
                       precision: str = "fp32") -> tuple[LayerMemory, ...]:
    """[embedding, blocks..., head], as spotpipe's GPT lays them out (untied head: each stage
    holds its own copy of what it uses).

    embedding: token + position tables (V h + s h), keeps nothing but its output (s b h),
    its backward's working memory by `embedding_backward_bytes`;
    block: 12 h^2 + 13 h parameters (attention 4 h^2 + 4 h, MLP 8 h^2 + 5 h, two layer norms
    4 h), activations by Korthikanti et al. (module doc), its backward's working memory by
    `block_backward_bytes`;
    head: final layer norm (2 h) and the LM projection (V h); keeps its input, the logits and
    their fp32 softmax (the loss's); the loss's backward working memory, `loss_backward_bytes`.
    In 16-bit, autocast's copy of every matrix a layer multiplies by (12 h^2 in a block, V h
    in the head) is kept per micro-batch too (the module doc).
    """
    s, h, a, v, b = shape.seq, shape.hidden, shape.heads, shape.vocab, micro_batch
    dt = COMPUTE_BYTES[precision]
    copy = 0 if dt == 4 else dt  # bytes per multiplied weight that autocast's copy keeps
    boundary = float(s * b * h * dt)
    block_act = s * b * h * (34 + 5 * a * s / h) * dt / 2 + copy * 12 * h * h
    loss = float(s * b * v * 4)
    head_act = boundary + s * b * v * dt + loss + copy * v * h
    layers = [LayerMemory(v * h + s * h, 0.0, boundary,
                          backward_bytes=embedding_backward_bytes(b, s, h, v, precision))]
    layers += [LayerMemory(12 * h * h + 13 * h, block_act, boundary,
                           backward_bytes=block_backward_bytes(b, s, h, precision))] \
        * shape.layers
    layers.append(LayerMemory(v * h + 2 * h, head_act, 0.0, loss_bytes=loss,
                              transient_bytes=loss_backward_bytes(b, s, v)))
    return tuple(layers)


def range_facts(layers: Sequence[LayerMemory], start: int, end: int) -> StageFacts:
    """Facts of the layers start..end - 1 as one stage, without a replica."""
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"layers {start}..{end} outside 0..{len(layers)}")
    own = layers[start:end]
    shared = sum(x.tied_params for x in own if start <= x.tied_to < end)
    return StageFacts(
        params=sum(x.params for x in own) - shared,
        activation_bytes=sum(x.activation_bytes for x in own),
        boundary_bytes=own[-1].output_bytes,
        layers=len(own),
        input_bytes=layers[start - 1].output_bytes if start > 0 else 0.0,
        transient_bytes=max(x.transient_bytes for x in own),
        inner_outputs_bytes=sum(x.output_bytes for x in own[:-1]),
        loss_bytes=sum(x.loss_bytes for x in own),
        max_layer_activation_bytes=max(x.activation_bytes - x.loss_bytes for x in own),
        layer_backward_bytes=max(x.backward_bytes for x in own))


def stage_facts(layers: Sequence[LayerMemory], stages: Sequence[tuple[int, int]],
                stage: int, redundancy: bool = True) -> StageFacts:
    """Facts of stage `stage` of the partition `stages` ((start, end) layer ranges), with the
    replica of its successor (stage + 1) mod P when `redundancy` and P > 1."""
    start, end = stages[stage]
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"stage {stage}: layers {start}..{end} outside 0..{len(layers)}")
    replica: Sequence[LayerMemory] = ()
    if redundancy and len(stages) > 1:
        rs, re_ = stages[(stage + 1) % len(stages)]
        replica = layers[rs:re_]
    return dataclasses.replace(
        range_facts(layers, start, end),
        replica_params=sum(x.params for x in replica),
        replica_boundary_bytes=replica[-1].output_bytes if replica else 0.0)


def carried(layers: Sequence[LayerMemory], stages: Sequence[tuple[int, int]],
            carry: Sequence[int], rules: MemoryRules) -> list[MemoryEstimate]:
    """The estimates of the stages `carry` of the partition `stages` on one node that runs
    them all: each without a replica (a node running several holds none), under `rules`
    (whose `num_stages` is the partition's depth). Their sum is what the node needs."""
    return [estimate_stage(s, range_facts(layers, *stages[s]), rules) for s in carry]


def merge_facts(first: StageFacts, second: StageFacts) -> StageFacts:
    """A node that carries two adjacent stages (after a takeover): both stages' state and
    activations, the second's output sent on, no replica (the runtime holds none then)."""
    return StageFacts(first.params + second.params,
                      first.activation_bytes + second.activation_bytes,
                      second.boundary_bytes, first.layers + second.layers,
                      input_bytes=first.stage_input_bytes,
                      transient_bytes=max(first.transient_bytes, second.transient_bytes),
                      # the first's output is now the input of the second's first layer
                      inner_outputs_bytes=first.layer_outputs_bytes + first.boundary_bytes
                      + second.layer_outputs_bytes,
                      loss_bytes=first.loss_bytes + second.loss_bytes,
                      max_layer_activation_bytes=max(first.largest_layer_bytes,
                                                     second.largest_layer_bytes),
                      layer_backward_bytes=max(first.layer_backward_bytes,
                                               second.layer_backward_bytes))


# -- instance presets (device memory per GPU, host memory per instance) --------------------

@dataclass(frozen=True)
class Instance:
    name: str
    gpus: int
    device_bytes: float  # per GPU
    host_bytes: float  # the whole instance

    @property
    def host_bytes_per_gpu(self) -> float:
        return self.host_bytes / max(1, self.gpus)


# AWS's published instance specifications (aws.amazon.com/ec2/instance-types/p3, /g4, /g5)
INSTANCES = {
    "p3.2xlarge": Instance("p3.2xlarge", 1, 16 * GIB, 61 * GIB),
    "p3.8xlarge": Instance("p3.8xlarge", 4, 16 * GIB, 244 * GIB),
    "p3.16xlarge": Instance("p3.16xlarge", 8, 16 * GIB, 488 * GIB),
    "g4dn.xlarge": Instance("g4dn.xlarge", 1, 16 * GIB, 16 * GIB),
    "g4dn.2xlarge": Instance("g4dn.2xlarge", 1, 16 * GIB, 32 * GIB),
    "g4dn.12xlarge": Instance("g4dn.12xlarge", 4, 16 * GIB, 192 * GIB),
    "g5.xlarge": Instance("g5.xlarge", 1, 24 * GIB, 16 * GIB),
    # a CPU host for the shadows (not preempted): no GPU, its memory is host memory
    "r5.4xlarge": Instance("r5.4xlarge", 0, 0, 128 * GIB),
}


def instance(name: str) -> Instance:
    try:
        return INSTANCES[name]
    except KeyError:
        raise ValueError(f"unknown instance {name!r}; known: {', '.join(sorted(INSTANCES))}") \
            from None
