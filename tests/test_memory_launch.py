"""Memory at launch: measured layer facts, the per-stage estimate printed next to the memory,
a stage that cannot fit refused before anything starts, and `model.partition: balanced`."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

from spotpipe import job
from spotpipe.cluster.launcher import LaunchError, prepare
from spotpipe.model import LayeredModel
from spotpipe.model.measure import profile_layer_memory
from spotpipe.model.partition import bounded_partition
from spotpipe.model.precision import Precision

from conftest import tiny_config


def test_layer_memory_counts_what_autograd_keeps():
    b, n_in, n_out = 8, 16, 32
    model = LayeredModel([nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU()),
                          nn.Linear(n_out, 4)], nn.functional.cross_entropy)
    first, second = profile_layer_memory(model, torch.randn(b, n_in))
    # by hand: Linear keeps its input, ReLU its output (weights are not activations)
    assert first.params == n_in * n_out + n_out
    assert first.activation_bytes == 4 * (b * n_in + b * n_out)
    assert first.output_bytes == 4 * b * n_out
    assert second.activation_bytes == 4 * b * n_out and second.output_bytes == 4 * b * 4
    # bf16: the layer's output (what travels) is half the bytes
    bf = profile_layer_memory(model, torch.randn(b, n_in), Precision("bf16"))
    assert bf[0].output_bytes == 2 * b * n_out


def test_the_last_layer_counts_its_loss_and_the_loss_backward():
    """Cross-entropy keeps the log-softmax of the logits (fp32) for its backward, which then
    creates the gradients with respect to it and to the logits, each as large as the logits
    in fp32: on an H200 that working memory was what the estimate missed (GPT-2 small,
    spotpipe bench gpu)."""
    b, n_in, classes = 64, 16, 1000
    model = LayeredModel([nn.Linear(n_in, classes)], nn.functional.cross_entropy)
    x, y = torch.randn(b, n_in), torch.randint(0, classes, (b,))
    plain, = profile_layer_memory(model, x)
    with_loss, = profile_layer_memory(model, x, target=y)
    logits = 4 * b * classes
    assert plain.transient_bytes == 0
    assert with_loss.activation_bytes - plain.activation_bytes >= logits  # the log-softmax
    assert 2 * logits <= with_loss.transient_bytes <= 4 * logits
    for precision in ("bf16", "fp16"):  # the loss runs in fp32 whatever the compute dtype
        low, = profile_layer_memory(model, x, Precision(precision), target=y)
        assert low.transient_bytes >= 2 * logits


def test_a_tied_tensor_counts_once_on_a_stage_that_holds_both_ends():
    """GPT's embedding and head are one tensor in one process (P = 1) and a copy on each of
    the first and last stage otherwise."""
    from spotpipe.plan.memory import stage_facts

    vocab, width = 50, 8
    emb, mid, head = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab,
                                                                                   bias=False)
    head.weight = emb.weight
    model = LayeredModel([emb, mid, head], lambda out, y: out.float().mean())
    layers = profile_layer_memory(model, torch.randint(0, vocab, (2, 4)))
    assert (layers[2].tied_params, layers[2].tied_to) == (vocab * width, 0)
    assert layers[1].tied_to == -1 and layers[0].tied_to == -1
    whole = stage_facts(layers, [(0, 3)], 0)
    assert whole.params == vocab * width + width * width + width  # by hand, the tensor once
    split = [stage_facts(layers, [(0, 2), (2, 3)], s, redundancy=False) for s in (0, 1)]
    assert split[0].params + split[1].params == 2 * vocab * width + width * width + width


def test_bounded_partition_is_the_best_that_fits():
    rng = random.Random(3)
    for _ in range(30):
        n, p = rng.randint(3, 8), rng.randint(1, 3)
        weights = [rng.uniform(0.1, 5.0) for _ in range(n)]
        size = [rng.uniform(0.1, 5.0) for _ in range(n)]
        bound = rng.uniform(2.0, 12.0)

        def fits(stage, start, end):
            return sum(size[start:end]) * (1 + 0.1 * stage) <= bound
        best = None  # by brute force over every cut
        for cuts in itertools.combinations(range(1, n), p - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            if all(fits(s, a, e) for s, (a, e) in enumerate(ranges)):
                cost = max(sum(weights[a:e]) for a, e in ranges)
                best = cost if best is None else min(best, cost)
        got = bounded_partition(weights, p, fits)
        if best is None:
            assert got is None
        else:
            assert all(fits(s, a, e) for s, (a, e) in enumerate(got))
            assert max(sum(weights[a:e]) for a, e in got) == pytest.approx(best)


def test_estimates_are_printed_and_a_stage_that_cannot_fit_is_refused(corpus, capsys):
    cfg = tiny_config(corpus, stages=2)
    prepared = prepare(cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memory")]
    assert [line.split()[2] for line in lines] == ["0", "1"]
    assert all(" of " in line and "host RAM / 2 workers" in line for line in lines)
    layers = job.profile_model(cfg, job.build_model(cfg), job.build_dataset(cfg)).memory
    need = [e.device_bytes + e.host_bytes
            for e in job.memory_estimates(cfg, layers, prepared.spec.partition)]
    tight = tiny_config(corpus, stages=2, **{"cluster.device_memory_gb": need[0] * 0.9 / 2**30})
    with pytest.raises(LaunchError, match=r"memory: stage 0 does not fit: its estimate is "
                       r"[0-9.]+ MiB \(weights .*activations .*\), the memory is [0-9.]+ MiB "
                       r"\(cluster.device_memory_gb\)"):
        prepare(tight)


def test_refused_launch_exits_nonzero_and_starts_nothing(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "spotpipe", "train", str(corpus.parent / "x"),
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode != 0  # (no such file: the CLI's own error path)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"""
model: {{kind: gpt, gpt: {{vocab_size: 256, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}}}
data: {{kind: text, path: {corpus}}}
cluster: {{device_memory_gb: 0.00001}}
iterations: 2
""")
    proc = subprocess.run([sys.executable, "-m", "spotpipe", "train", str(cfg_file),
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "stage 0 does not fit" in proc.stderr
    assert not (out / "metrics.jsonl").exists()


def test_balanced_partition_keeps_every_stage_under_the_bound(corpus):
    # P=3, 1F1B: stage s keeps 3 - s micro-batches in flight, so equal layer counts overload
    # stage 0; the bound is the smallest largest-stage need of any partition (brute force)
    cfg = tiny_config(corpus, stages=3, **{"model.gpt.n_layer": 6})
    model, data = job.build_model(cfg), job.build_dataset(cfg)
    layers = job.profile_model(cfg, model, data).memory

    def worst(ranges):
        return max(e.device_bytes + e.host_bytes
                   for e in job.memory_estimates(cfg, layers, ranges))
    n = len(layers)
    bound = min(worst(list(zip((0,) + c, c + (n,))))
                for c in itertools.combinations(range(1, n), 2))
    assert worst(job.compute_partition(cfg, job.profile_model(cfg, model, data))) > bound  # uniform does not fit
    tight = tiny_config(corpus, stages=3, **{"model.gpt.n_layer": 6,
                                             "model.partition": "balanced",
                                             "cluster.device_memory_gb": bound * 1.000001 / 2**30})
    got = job.compute_partition(tight, job.profile_model(tight, model, data))
    assert worst(got) <= bound * 1.000001, got


def test_the_planner_re_partitions_no_lower_than_the_depth_whose_stages_fit(corpus):
    """The runtime's planner took any depth down to 1 (`Rules.min_stages` was left at 1;
    only the simulator passed its own bound): a job that lost nodes could re-partition onto
    stages too large for its memory. The bound is the smallest depth at which the launch's
    own check (`memory_report`) passes. Reference: the stages' estimates at each depth, with a
    budget set between the largest stage's need at depth 2 and at depth 1."""
    from spotpipe.cluster.coordinator import rules_for

    cfg = tiny_config(corpus, stages=4, redundancy="none")
    profile = job.profile_model(cfg, job.build_model(cfg), job.build_dataset(cfg))

    def largest(depth: int) -> float:
        ranges = job.partition_at_depth(cfg, profile, depth)
        return max(e.device_bytes + e.host_bytes
                   for e in job.memory_estimates(cfg, profile.memory, ranges))

    assert largest(1) > largest(2) > largest(4)
    assert job.min_stages(cfg, profile) == 1  # (the host's RAM: every depth fits)
    between = (largest(1) + largest(2)) / 2 / 2**30
    tight = tiny_config(corpus, stages=4, redundancy="none",
                        **{"cluster.device_memory_gb": between})
    assert job.min_stages(tight, profile) == 2
    assert rules_for(tight, lambda d: job.partition_at_depth(tight, profile, d),
                     job.min_stages(tight, profile)).min_stages == 2


def test_a_depth_that_leaves_a_stage_without_parameters_is_refused(corpus):
    """Launched at P = 5, every stage holds parameters; a re-partition to P = 4 cut stage 2
    from layers 5-6 alone, which have none (activations), and every node stopped while it
    built that stage (torch: "optimizer got an empty parameter list"). Such a depth is now
    refused by the partitioner, so the planner keeps the layout it has and says why."""
    from spotpipe.cluster.coordinator import rules_for
    from spotpipe.model.partition import PartitionError
    from spotpipe.plan import Action, Layout, decide
    from spotpipe.plan.memory import LayerMemory
    from spotpipe.plan.profile import LayerProfile
    from spotpipe.plan.recovery import History, _choose

    cfg = tiny_config(corpus, stages=5)
    params = (10, 10, 0, 10, 10, 0, 0, 10, 5)
    profile = LayerProfile(names=(), params=params,
                           memory=tuple(LayerMemory(p, 0.0, 0.0) for p in params))
    launched = job.partition_at_depth(cfg, profile, 5)
    assert all(sum(params[a:b]) for a, b in launched)
    with pytest.raises(PartitionError, match="stage 2 of 4 .* layers 5-6"):
        job.partition_at_depth(cfg, profile, 4)
    rules = rules_for(cfg, lambda d: job.partition_at_depth(cfg, profile, d), 1)
    # n2 was lost and n1 took its stage over: with no standby node, the job re-partitions
    carried = decide(Layout.build(5, 1, [f"n{i}" for i in range(5)]), {"n2"}, []).layout
    assert decide(carried, set(), []).action == Action.REPARTITION
    choice, refused = _choose(History(layout=carried, partition=launched), frozenset(), [],
                              rules)
    assert choice.action == Action.KEEP and choice.layout.num_stages == 5
    assert refused is not None and "layers 5-6" in refused


def test_a_node_holds_the_stages_whose_estimates_its_memory_holds(corpus):
    """The planner copies or restores a stage onto a node only where its memory holds it
    beside the node's own (`job.stages_fit`, the coordinator's `Rules.room`), where it used
    a count of stages. Reference by hand: layers with parameters only, fp32 AdamW (weights,
    gradients and two moments: 16 bytes a parameter), and a memory of 16 x 600 bytes."""
    from spotpipe.cluster.coordinator import Coordinator
    from spotpipe.plan import Layout
    from spotpipe.plan.memory import LayerMemory
    from spotpipe.plan.profile import LayerProfile
    from spotpipe.protocol import Channel, job_key

    params = (100, 200, 300, 400)
    profile = LayerProfile(names=(), params=params,
                           memory=tuple(LayerMemory(p, 0.0, 0.0) for p in params))
    cfg = tiny_config(corpus, stages=4, redundancy="lazy",
                      **{"cluster.device_memory_gb": 16 * 600 / 2**30})
    assert (cfg.precision, cfg.optimizer.name) == ("fp32", "adamw")
    fit = job.stages_fit(cfg, profile)
    four = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert fit(four, (0, 1, 2)) and fit(four, (0, 3)) and fit(four, (2,))
    assert not fit(four, (1, 2, 3)) and not fit(four, (2, 3))
    two = [(0, 2), (2, 4)]
    assert fit(two, (0,)) and not fit(two, (1,)) and not fit(two, (0, 1))
    coord = Coordinator(cfg=cfg, store=torch.distributed.HashStore(),
                        layout=Layout.build(4, 1, [f"node{i}" for i in range(4)]),
                        kill=lambda node: None, emit=lambda e: None, now=lambda: 0.0,
                        channel=Channel(job_key(b"sesame", "test"), "coordinator"),
                        partition=four, partition_for=lambda depth: two, stages_fit=fit)
    room = coord.rules.room
    assert room(4, (0, 1, 2)) and not room(4, (1, 2, 3))  # the partition the job runs
    assert room(2, (0,)) and not room(2, (1,))  # a depth it would re-partition to
