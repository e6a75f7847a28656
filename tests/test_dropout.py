"""Dropout without losing exactness: each layer's masks come from a stream of their own per
(seed, iteration, micro-batch, layer) (`spotpipe.model.precision.Draws`), so a layer draws the
same masks on its owner, on the replica's redundant forward, on a heir replaying it after a
takeover and in any partition. Before, each worker's own RNG drew them, and no run with
dropout was bit-identical to another layout's or to itself after a failover."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from spotpipe import job
from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault
from spotpipe.model import build_stage
from spotpipe.model.precision import Draws, Precision, run_layers

from conftest import tiny_config
from test_failover import FAST, assert_samples_exactly_once, failure_free

DROPOUT = {"model.gpt.dropout": 0.2, "model.gpt.n_layer": 4}


def _model(corpus, kind):
    if kind == "gpt":
        cfg = tiny_config(corpus, **DROPOUT)
    else:  # GPT-2 from transformers, its three dropouts on (nn.Dropout and attention's)
        from test_hf import TINY, hf_config

        cfg = hf_config(corpus, "gpt2", {**TINY["gpt2"], "n_layer": 3, "resid_pdrop": 0.2,
                                         "embd_pdrop": 0.2, "attn_pdrop": 0.2})
    return cfg, job.build_model(cfg)


def _grads(module, x, precision, draws):
    for p in module.parameters():
        p.grad = None
    out = run_layers(module, x, precision, draws)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_a_layer_draws_the_same_masks_in_any_stage_and_on_a_recompute(corpus, kind):
    cfg, model = _model(corpus, kind)
    x = torch.randint(0, 256, (2, 16))
    whole = model.to_sequential().train()
    draws = Draws(cfg.seed, 7, 3)
    fp32 = Precision()
    want, want_grads = _grads(whole, x, fp32, draws)
    # the model cut in two stages, with other draws of the global RNG in between
    first, second = build_stage(model, 0, 3), build_stage(model, 3, model.num_layers)
    torch.rand(1000)
    got = run_layers(second, run_layers(first, x, fp32, draws), fp32, draws)
    assert torch.equal(got, want)
    # a recompute (activation checkpointing, per layer and per stage): the same masks again
    for checkpointing in ("layers", "stage"):
        out, grads = _grads(whole, x, Precision("fp32", checkpointing), draws)
        assert torch.equal(out, want) and all(map(torch.equal, grads, want_grads))
    # the masks do depend on the iteration, the micro-batch and the layer (dropout is on)
    for other in (Draws(cfg.seed, 8, 3), Draws(cfg.seed, 7, 4), Draws(cfg.seed + 1, 7, 3)):
        assert not torch.equal(run_layers(whole, x, fp32, other), want), other
    assert not torch.equal(whole(x), want)  # the global RNG's own draws differ


@pytest.mark.parametrize("mode,stages,fault", [
    ("lazy", 2, Fault("fail", "node1", 3, "backward")),
    ("eager", 3, Fault("fail", "node1", 3, "forward")),  # FRC's outputs carry the iteration on
])
def test_a_failover_with_dropout_is_bit_identical_to_the_plain_loop(
        tmp_path, tmp_path_factory, corpus, mode, stages, fault):
    cfg = tiny_config(corpus, stages=stages, pipelines=1, redundancy=mode,
                      **{**FAST, **DROPOUT})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[fault]) == 0
    want = failure_free(tmp_path_factory, cfg)  # D = 1: the single-process loop
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]
    assert_samples_exactly_once(run, cfg)
