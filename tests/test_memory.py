"""The memory model against figures computed by hand (and GPT-2 XL's published size)."""

import dataclasses

import pytest

from spotpipe.plan.memory import (GIB, GPT2, MemoryRules, StageFacts, estimate_stage, fits,
                                  in_flight, instance, merge_facts, refusal, stage_facts,
                                  transformer_layers)
from spotpipe.plan.layout import uniform_partition

N = 1_000_000
FACTS = StageFacts(params=N, activation_bytes=1000, boundary_bytes=100, layers=4,
                   replica_params=2 * N, replica_boundary_bytes=300)


def rules(**kw):
    base = dict(num_stages=4, microbatches=8)
    base.update(kw)
    return MemoryRules(**base)


def test_state_bytes_per_precision_and_optimizer():
    # fp32 Adam: 4 (weights) + 4 (grads) + 8 (two moments) = 16 B/param; activations 4 x 1000,
    # the 4 in-flight outputs held until their backward, and the gradient of one received
    # while its backward runs
    e = estimate_stage(0, FACTS, rules())
    assert e.breakdown() == {"device:weights": 4e6, "device:gradients": 4e6,
                             "device:optimizer": 8e6, "device:activations": 4000.0,
                             "device:outputs": 400.0, "device:backward_working": 100.0}
    assert e.device_bytes == 16_004_500 and e.host_bytes == 0
    # bf16 under autocast: the same fp32 state (test_memory_measured: against a real stage)
    bf = estimate_stage(0, FACTS, rules(precision="bf16"))
    assert bf.breakdown()["device:weights"] == 4e6
    assert bf.breakdown()["device:gradients"] == 4e6
    assert bf.device_bytes == 16_004_500
    # SGD with momentum in fp32: 4 + 4 + 4
    assert estimate_stage(0, FACTS, rules(optimizer="sgd")).device_bytes == 12_004_500


def test_activations_follow_the_schedule():
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, s, 8) for s in range(4)] == [8] * 4
    part = lambda name, s, **kw: estimate_stage(s, FACTS, rules(**kw)).breakdown().get(
        "device:" + name, 0)
    act = lambda s, **kw: part("activations", s, **kw)
    assert act(3) == 1000
    assert act(1, schedule="gpipe") == 8000
    assert part("outputs", 1, schedule="gpipe") == 8 * 100 and part("outputs", 3) == 0
    # checkpointing per layer: 4 in flight x (the 100 B input + 3 inner layers' outputs);
    # one layer recomputed at a time (and the 100 B gradient received)
    assert act(0, activation_checkpointing="layers") == 4 * (100 + 3 * 100)
    assert part("backward_working", 0, activation_checkpointing="layers") == 1000 / 4 + 100
    # per stage: 4 stage inputs; the whole stage recomputed once
    assert act(0, activation_checkpointing="stage") == 4 * 100
    assert part("backward_working", 0, activation_checkpointing="stage") == 1000 + 100


def test_a_layers_backward_comes_on_its_recompute_and_the_gradient_received():
    """A block's backward working memory (GPT's: 4 s b h in the compute dtype and 16 h^2)
    adds to the recompute and to the gradient received (stage 0 of 4, 100 B); on the last
    stage the loss's backward has freed what the loss kept (300 B) before any layer's runs,
    and the larger of the two phases counts."""
    from spotpipe.plan.memory import block_backward_bytes
    assert block_backward_bytes(8, 64, 32, "fp32") == 4 * 8 * 64 * 32 * 4 + 16 * 32 ** 2
    assert block_backward_bytes(8, 64, 32, "bf16") == 4 * 8 * 64 * 32 * 2 + 16 * 32 ** 2
    blocks = transformer_layers(GPT2["gpt2"], micro_batch=8, precision="bf16")[1:-1]
    assert {x.backward_bytes for x in blocks} == {4 * 8 * 1024 * 768 * 2 + 16 * 768 ** 2}
    facts = StageFacts(params=N, activation_bytes=1000, boundary_bytes=100, layers=4,
                       layer_backward_bytes=500)
    last = dataclasses.replace(facts, transient_bytes=700, loss_bytes=300)
    work = lambda s, f, mode: estimate_stage(s, f, rules(activation_checkpointing=mode)
                                             ).breakdown()["device:backward_working"]
    assert work(0, facts, "none") == 500 + 100
    assert work(0, facts, "layers") == 1000 / 4 + 500 + 100
    assert work(0, facts, "stage") == 1000 + 500 + 100
    assert work(3, last, "none") == 700  # the loss's phase: its 700 B against 500 - 300
    assert work(3, last, "layers") == 700  # against (1000 - 300) / 4 + 500 - 300
    assert work(3, last, "stage") == 1000 - 300 + 500 - 300  # against 700
    # the loss's 300 B freed make room for the layer's own, never for the recompute
    big_loss = dataclasses.replace(last, loss_bytes=600, transient_bytes=0)
    assert work(3, big_loss, "stage") == 1000 - 600
    merged = merge_facts(facts, dataclasses.replace(facts, layer_backward_bytes=900))
    assert merged.layer_backward_bytes == 900
    with pytest.raises(ValueError, match="layer_backward_bytes"):
        StageFacts(params=1, activation_bytes=1, boundary_bytes=1, layer_backward_bytes=-1)


def test_the_embedding_and_the_loss_backward_working_memory_by_hand():
    """GPT-2 XL (V = 50257, h = 1600, s = 1024) at micro-batch 4 in fp16: the embedding's
    backward makes its token table's dense fp32 gradient (4 V h) and, in 16-bit, an fp32 copy
    of its output's gradient (4 b s h); the loss's, the gradients w.r.t. the log-softmax and
    the logits (2 x 4 s b V). Both were left out (0 in `transformer_layers`)."""
    from spotpipe.plan.memory import embedding_backward_bytes, loss_backward_bytes
    assert embedding_backward_bytes(8, 64, 32, 256, "fp32") == 4 * 256 * 32
    assert embedding_backward_bytes(8, 64, 32, 256, "bf16") == 4 * 256 * 32 + 4 * 8 * 64 * 32
    assert loss_backward_bytes(4, 1024, 50257) == 1_646_821_376  # 2 x 0.77 GiB
    layers = transformer_layers(GPT2["gpt2-1.5b"], micro_batch=4, precision="fp16")
    assert layers[0].backward_bytes == 321_644_800 + 26_214_400
    assert layers[-1].transient_bytes == 1_646_821_376
    assert {x.transient_bytes for x in layers[:-1]} == {0}
    # a node carrying stages 0 and 1 of 4 (layers 0-25, per-layer checkpointing): one block
    # recomputed (1024 x 4 x 1600 x 114 + fp16 copies 2 x 12 h^2), the embedding's own backward
    # (the stage's largest) and the gradient received (b s h x 2)
    parts = uniform_partition(len(layers), 4)
    carrier = merge_facts(*(stage_facts(layers, parts, s) for s in (0, 1)))
    r4 = MemoryRules(precision="fp16", num_stages=4, microbatches=24,
                     activation_checkpointing="layers", device_reserve_bytes=GIB)
    e = estimate_stage(0, carrier, dataclasses.replace(r4, redundancy="none"))
    assert e.breakdown()["device:backward_working"] == \
        808_550_400 + 347_859_200 + 13_107_200
    assert e.device_bytes > 16 * GIB  # 16.03 GiB: P = 4 with redundancy no longer fits a V100
    # the whole model on one device: the loss's phase is the larger
    whole = estimate_stage(0, stage_facts(layers, [(0, len(layers))], 0),
                           MemoryRules(precision="fp16", microbatches=96,
                                       activation_checkpointing="layers"))
    assert whole.breakdown()["device:backward_working"] == 1_646_821_376


def test_redundancy_and_shadows():
    lazy = estimate_stage(0, FACTS, rules(redundancy="lazy")).breakdown()
    # the replica (2M params) on the host: fp32 weights + replicated gradient + Adam = 16 B
    assert lazy["host:replica"] == 32e6
    assert lazy["device:kept_inputs"] == 8 * 100  # the iteration's 8 inputs of the successor
    assert "device:outputs" not in lazy  # the in-flight outputs are among the kept inputs
    assert "device:sent_gradients" not in lazy  # stage 0 sends no input gradient back
    # a later stage keeps the gradients of its 8 inputs it sent back, for its heir to re-send
    assert estimate_stage(1, FACTS, rules(redundancy="lazy")).breakdown()[
        "device:sent_gradients"] == 8 * 100
    assert "device:frc_outputs" not in lazy
    eager = estimate_stage(0, FACTS, rules(redundancy="eager", replica_on_host=False,
                                           precision="bf16")).breakdown()
    assert eager["device:replica"] == 2 * N * (4 + 4 + 8)  # FRC keeps no compute copy
    assert eager["device:frc_outputs"] == 8 * 300
    off = estimate_stage(0, FACTS, rules(redundancy="eager", offload_frc=True)).breakdown()
    assert off["host:frc_outputs"] == 8 * 300
    # stage 2 of 4 holds the last stage's replica, whose outputs nobody reads: no FRC
    holder = estimate_stage(2, FACTS, rules(redundancy="eager")).breakdown()
    assert "device:frc_outputs" not in holder and holder["host:replica"] == 32e6
    # on two stages stage 0's successor is its own heir: no FRC anywhere
    for stage in (0, 1):
        two = estimate_stage(stage, FACTS, rules(num_stages=2, redundancy="eager")).breakdown()
        assert "device:frc_outputs" not in two and two["host:replica"] == 32e6
    # FRC of every replica, as Bamboo runs it (`replica.frc: every`): its outputs everywhere
    for stages, stage in ((4, 2), (2, 0), (2, 1)):
        every = estimate_stage(stage, FACTS, rules(num_stages=stages, redundancy="eager",
                                                   frc_every_stage=True)).breakdown()
        assert every["device:frc_outputs"] == 8 * 300
    # one stage: no successor to replicate
    assert estimate_stage(0, FACTS, rules(num_stages=1, redundancy="eager")).host_bytes == 0
    sh = estimate_stage(0, FACTS, rules(shadows=True, optimizer="sgd"))
    assert sh.shadow_host_bytes == N * (4 + 4 + 4) and sh.host_bytes == 0
    reserve = estimate_stage(0, FACTS, rules(device_reserve_bytes=GIB))
    assert reserve.device_bytes == 16_004_500 + GIB


def test_local_links_count_the_rings_a_stage_sends_on():
    """CPU runs: a stage makes the ring of each channel it sends on, `link_slots` messages of
    the channel's size (its activation forward, its input's gradient back), capped at 256 MiB
    and never under link_slots / 2 (an iteration's micro-batches) nor 2 messages."""
    facts = StageFacts(params=N, activation_bytes=1000, boundary_bytes=100, layers=4,
                       input_bytes=300)
    ring = lambda s, **kw: estimate_stage(s, facts, rules(link_slots=16, **kw)).breakdown()
    assert ring(0)["host:link_buffers"] == 16 * 100  # activations to stage 1 only
    assert ring(1)["host:link_buffers"] == 16 * 100 + 16 * 300  # and gradients to stage 0
    assert ring(3)["host:link_buffers"] == 16 * 300  # the last stage sends gradients only
    assert "host:link_buffers" not in ring(0, num_stages=1)  # nothing to send to
    # with redundancy, a stage's gradients to its replica: max_lag + 2 messages (2 unapplied,
    # one taken, one being written) of 4 bytes (fp32) x N, in bf16 too (the gradients are fp32)
    assert ring(0, redundancy="lazy")["host:link_buffers"] == 16 * 100 + 4 * 4 * N
    assert ring(3, redundancy="eager", precision="bf16",
                replica_max_lag=1)["host:link_buffers"] == 16 * 300 + 3 * 4 * N
    # the cap trims the slack, never an iteration's micro-batches (link_slots / 2: fewer
    # deadlocks a schedule, tests/test_local_link.py)
    big = StageFacts(params=N, activation_bytes=1, boundary_bytes=100 * 2 ** 20, layers=1)
    capped = estimate_stage(0, big, rules(link_slots=16)).breakdown()["host:link_buffers"]
    assert capped == 8 * 100 * 2 ** 20  # 256 MiB holds 2 of these, the iteration 8
    mid = StageFacts(params=N, activation_bytes=1, boundary_bytes=20 * 2 ** 20, layers=1)
    assert estimate_stage(0, mid, rules(link_slots=16)).breakdown()["host:link_buffers"] == \
        12 * 20 * 2 ** 20  # 256 MiB / 20 MiB
    assert "host:link_buffers" not in estimate_stage(0, FACTS, rules()).breakdown()


def test_gpt2_xl_does_not_fit_one_16gb_gpu_but_fits_eight_stages():
    shape = GPT2["gpt2-1.5b"]
    layers = transformer_layers(shape, micro_batch=4, precision="fp16")
    total = sum(x.params for x in layers)
    # GPT-2 XL has 1,557,611,200 parameters with a tied head (Hugging Face's count); the
    # pipeline's last stage holds its own copy of the 50257 x 1600 projection
    assert total - 50257 * 1600 == 1_557_611_200
    # Korthikanti et al.: s b h (34 + 5 a s / h) = 1024*4*1600*(34 + 80) bytes per block (16-bit),
    # and autocast's fp16 copy of the block's 12 h^2 matrix weights
    block = 1024 * 4 * 1600 * 114 + 2 * 12 * 1600 ** 2
    assert layers[1].activation_bytes == block
    gpu = instance("p3.2xlarge")
    whole = estimate_stage(0, stage_facts(layers, [(0, len(layers))], 0),
                           MemoryRules(precision="fp16", microbatches=128))
    assert whole.device_bytes > 16 * total  # 16 B/param of state alone: 26 GB
    assert not fits(whole, gpu.device_bytes, gpu.host_bytes)
    line = refusal(whole, gpu.device_bytes, gpu.host_bytes)
    assert line.startswith("stage 0 does not fit") and "device" in line and "16.00 GiB" in line
    parts = uniform_partition(len(layers), 8)
    assert parts[0] == (0, 7)  # the embedding and 6 blocks
    r8 = MemoryRules(precision="fp16", num_stages=8, microbatches=32, redundancy="lazy",
                     device_reserve_bytes=GIB)
    # without activation checkpointing, stage 0 keeps 8 micro-batches x 6 blocks: 33.4 GiB
    plain = estimate_stage(0, stage_facts(layers, parts, 0), r8)
    assert plain.breakdown()["device:activations"] == 8 * 6 * block
    assert not fits(plain, gpu.device_bytes, gpu.host_bytes)
    r8 = MemoryRules(precision="fp16", num_stages=8, microbatches=32, redundancy="lazy",
                     device_reserve_bytes=GIB, activation_checkpointing="layers")
    for s in range(8):
        e = estimate_stage(s, stage_facts(layers, parts, s), r8)
        assert fits(e, gpu.device_bytes, gpu.host_bytes), refusal(e, gpu.device_bytes,
                                                                  gpu.host_bytes)
        assert refusal(e, gpu.device_bytes, gpu.host_bytes) is None


def test_stage_facts_and_merge():
    layers = transformer_layers(GPT2["gpt2"], micro_batch=2)
    parts = uniform_partition(len(layers), 2)
    a, b = (stage_facts(layers, parts, s) for s in range(2))
    assert a.replica_params == b.params and b.replica_params == a.params
    assert a.boundary_bytes == 1024 * 2 * 768 * 4 and b.boundary_bytes == 0
    m = merge_facts(a, b)
    assert m.params == a.params + b.params and m.replica_params == 0
    assert m.stage_input_bytes == 0 and m.layers == len(layers)
    # per-layer checkpointing keeps the outputs of every layer but the last (7 of stage 0's 7
    # layers are the embedding and 6 blocks: 6 outputs), the head's loss its fp32 softmax
    boundary = 1024 * 2 * 768 * 4
    assert a.layer_outputs_bytes == 6 * boundary and a.loss_bytes == 0
    assert b.loss_bytes == 1024 * 2 * 50257 * 4 and b.layer_outputs_bytes == 6 * boundary
    assert b.largest_layer_bytes == max(x.activation_bytes - x.loss_bytes for x in layers[7:])
    assert m.layer_outputs_bytes == 13 * boundary and m.loss_bytes == b.loss_bytes


def test_in_flight_is_what_the_schedules_streams_hold():
    """The formula against the instruction streams the runtime executes: the most forwards a
    stage has run whose backward has not."""
    from spotpipe.schedule.builders import build_schedule
    from spotpipe.schedule.ir import Op

    for kind in ("1f1b", "gpipe"):
        for p in range(1, 6):
            for m in range(1, 10):
                for s, stream in enumerate(build_schedule(kind, p, m).streams):
                    held = most = 0
                    for ins in stream:
                        held += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(ins.op, 0)
                        most = max(most, held)
                    assert in_flight(kind, p, s, m) == most, (kind, p, s, m)


@pytest.mark.parametrize("kw, word", [({"precision": "fp8"}, "precision"),
                                      ({"optimizer": "lion"}, "optimizer"),
                                      ({"schedule": "zb"}, "schedule"),
                                      ({"redundancy": "full"}, "redundancy"),
                                      ({"microbatches": 0}, "microbatches")])
def test_bad_rules_are_refused_naming_the_field(kw, word):
    with pytest.raises(ValueError, match=word):
        rules(**kw)


def test_bad_facts_and_stage_are_refused():
    with pytest.raises(ValueError, match="params"):
        StageFacts(params=-1, activation_bytes=0, boundary_bytes=0)
    with pytest.raises(ValueError, match="stage 4"):
        estimate_stage(4, FACTS, rules())
    with pytest.raises(ValueError, match="unknown instance"):
        instance("p9.huge")


def test_transformer_parameters_match_spotpipes_gpt():
    """The analytic layer sizes against the real model the runtime trains (untied head)."""
    from spotpipe.model.gpt import GPTConfig, build_gpt
    from spotpipe.plan.memory import TransformerShape

    gpt = build_gpt(GPTConfig(vocab_size=100, block_size=32, n_layer=3, n_head=4, n_embd=48),
                    seed=0)
    real = [sum(p.numel() for p in layer.parameters()) for layer in gpt.layers]
    analytic = [x.params for x in transformer_layers(TransformerShape(3, 48, 4, 32, 100), 1)]
    assert real == analytic
