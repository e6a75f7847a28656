"""A node's state after start holds only its own layers' values (`NodeState.release_unheld`):
the model it keeps is a template of shapes, buffers and names, and every stage built from it
later gets its values from elsewhere."""

from __future__ import annotations

import torch

from conftest import tiny_config
from spotpipe import job
from spotpipe.plan import Layout
from spotpipe.runtime.state import NodeState, build_stage_state


def _node(corpus, **overrides) -> NodeState:
    """node1 of a P = 3 x D = 1 job, owning stage 1 (layers 1-1 of the tiny GPT's 4)."""
    cfg = tiny_config(corpus, stages=3, pipelines=1, **overrides)
    model = job.build_model(cfg)
    partition = [(0, 1), (1, 2), (2, 4)]
    layout = Layout.build(3, 1, ["node0", "node1", "node2"])
    state = NodeState(cfg, model, torch.device("cpu"), "node1", layout, partition)
    state.stages[1] = build_stage_state(model, partition, 1, cfg, torch.device("cpu"))
    return state


def test_only_the_owned_layers_keep_their_values(corpus):
    state = _node(corpus)
    before = {k: v.clone() for k, v in state.stages[1].module.state_dict().items()}
    state.release_unheld()
    model = state.model
    for i, layer in enumerate(model.layers):
        metas = {p.is_meta for p in layer.parameters()}
        assert metas == ({False} if i == 1 else {True}), (i, metas)
        # buffers (e.g. a causal mask) are kept: a stage built later needs them
        assert not any(b.is_meta for b in layer.buffers())
    after = state.stages[1].module.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # the owned stage is still the model's own layer (trained in place), not a copy
    assert state.stages[1].module[0] is model.layers[1]


def test_a_stage_built_later_has_nan_until_loaded(corpus):
    """Every path that builds a stage loads its state next; one that forgot would train on
    NaN and stop at the first non-finite loss, not drift quietly."""
    state = _node(corpus)
    state.release_unheld()
    module, optimizer = state.build_stage(2)
    params = list(module.parameters())
    assert params and all(torch.isnan(p).all() for p in params)
    assert all(not b.is_meta for b in module.buffers())
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)


def test_tied_weights_stay_tied_through_release_and_build(corpus):
    """With tied embeddings the head's weight is the embedding's: a node owning neither keeps
    them as one meta parameter, and a stage built from the template holding both ends (layers
    0-3) gets one parameter for the two."""
    state = _node(corpus, **{"model.gpt.tie_embeddings": True})
    state.release_unheld()
    model = state.model
    assert model.layers[0].wte.weight is model.layers[-1].lm_head.weight
    assert model.layers[0].wte.weight.is_meta
    state.partition = [(0, 4)]
    module, _ = state.build_stage(0)
    built = dict(module.named_parameters(remove_duplicate=False))
    assert built["0.wte.weight"] is built["3.lm_head.weight"]
