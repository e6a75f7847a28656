"""Workers read only the layers they hold from the initial weights the launcher wrote
(model/template.py), instead of each building the whole model: the same values, bit for bit,
without the whole model in any worker's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from spotpipe import job
from spotpipe.cluster.launcher import train
from spotpipe.model.template import INITIAL_FILE, save_initial


def _written(tmp_path, cfg):
    whole = job.build_model(cfg)
    save_initial(whole, tmp_path / INITIAL_FILE, job.model_identity(cfg))
    return whole


def test_held_layers_are_the_whole_builds_and_the_rest_stays_empty(tmp_path, corpus):
    cfg = tiny_config(corpus, **{"model.gpt.tie_embeddings": True})
    whole = _written(tmp_path, cfg)
    model, how = job.build_model_holding(cfg, tmp_path, {2, 3})
    assert how == "held layers from the initial weights file"
    for i, (got, want) in enumerate(zip(model.layers, whole.layers)):
        mine = dict(got.named_parameters(remove_duplicate=False))
        for name, p in want.named_parameters(remove_duplicate=False):
            if i in (2, 3):
                assert torch.equal(mine[name], p), (i, name)
            elif not (i == 0 and name == "wte.weight"):  # tied to the held head
                assert mine[name].is_meta, (i, name)
    # the head's weight is the embedding's: one Parameter, read once
    assert model.layers[0].wte.weight is model.layers[3].lm_head.weight
    assert torch.equal(model.layers[3].lm_head.weight, whole.layers[0].wte.weight)


def test_buffers_come_from_the_file_for_every_layer(tmp_path, corpus):
    """A shared module's buffer (Llama's rotary frequencies, one module in every block) is
    stored once and filled everywhere, held layer or not."""
    pytest.importorskip("transformers")
    from test_hf import hf_config

    cfg = hf_config(corpus, "llama")
    whole = _written(tmp_path, cfg)
    model, _ = job.build_model_holding(cfg, tmp_path, {1})
    want = dict(whole.to_sequential().named_buffers(remove_duplicate=False))
    got = dict(model.to_sequential().named_buffers(remove_duplicate=False))
    assert want and set(got) == set(want)
    for name, b in want.items():
        assert not got[name].is_meta and torch.equal(got[name], b), name
    assert model.layers[1].rotary is model.layers[2].rotary  # still one module


def test_a_file_of_another_model_or_with_a_wrong_tensor_is_not_used(tmp_path, corpus):
    """The file is a shortcut to what the seed builds: one that does not fit is passed over,
    saying why, and the model is built whole (the values the job wants either way)."""
    cfg = tiny_config(corpus)
    whole = _written(tmp_path, cfg)
    other = tiny_config(corpus, seed=2)
    model, how = job.build_model_holding(other, tmp_path, {1})
    assert how.startswith(f"whole: {tmp_path / INITIAL_FILE} holds the initial weights of "
                          "another job's model"), how
    assert torch.equal(model.layers[1].attn.c_attn.weight,
                       job.build_model(other).layers[1].attn.c_attn.weight)
    path = tmp_path / INITIAL_FILE
    tensors = load_file(str(path))
    tensors["1.attn.c_attn.weight"] = tensors["1.attn.c_attn.weight"][:1].clone()
    save_file(tensors, str(path), metadata={"identity": job.model_identity(cfg)})
    model, how = job.build_model_holding(cfg, tmp_path, {1})
    assert how.endswith("tensor '1.attn.c_attn.weight' is torch.float32 (1, 32), the model "
                        "wants torch.float32 (96, 32)"), how
    assert torch.equal(model.layers[1].attn.c_attn.weight, whole.layers[1].attn.c_attn.weight)
    del tensors["1.attn.c_attn.weight"]
    save_file(tensors, str(path), metadata={"identity": job.model_identity(cfg)})
    _, how = job.build_model_holding(cfg, tmp_path, {1})
    assert how.endswith("has no tensor '1.attn.c_attn.weight'"), how
    _, how = job.build_model_holding(cfg, tmp_path, {0})  # layer 1 not held: not read
    assert how == "held layers from the initial weights file"


def test_without_a_file_the_model_is_built_whole(tmp_path, corpus):
    model, how = job.build_model_holding(tiny_config(corpus), tmp_path, {0})
    assert how == "whole: no initial weights file"
    assert not any(p.is_meta for p in model.to_sequential().parameters())


def test_a_job_s_workers_read_their_layers_and_the_file_goes_at_the_end(tmp_path, corpus):
    cfg = tiny_config(corpus, stages=2, redundancy="lazy")
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    ready = [json.loads(line) for line in open(run / "events.jsonl")]
    ready = [e for e in ready if e["kind"] == "worker_ready"]
    assert len(ready) == 2
    assert {e["built"] for e in ready} == {"held layers from the initial weights file"}
    assert not (run / INITIAL_FILE).exists()


@pytest.mark.parametrize("factory, why", [
    ("shifted", "layer 1 keeps a tensor outside its state: offset"),
    ("weighted_loss", "the loss (_WeightedMSE) holds tensors"),
])
def test_a_model_with_tensors_outside_its_layers_state_is_built_whole(tmp_path, corpus,
                                                                      monkeypatch, factory, why):
    """A tensor the file cannot carry (a plain attribute, a loss module's buffer) would stay
    on the meta device: such a model is built whole, and trains exactly as before."""
    monkeypatch.chdir(Path(__file__).parent)  # (factories import from the working folder)
    cfg = tiny_config(corpus, stages=2, **{
        "model.kind": "factory", "model.factory": f"fixtures.user_models:{factory}",
        "data.kind": "factory", "data.factory": "fixtures.user_models:regression"})
    _written(tmp_path, cfg)
    model, how = job.build_model_holding(cfg, tmp_path, {0})
    assert how == f"whole: {why}"
    assert not any(p.is_meta for p in model.to_sequential().parameters())
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    ready = [json.loads(line) for line in open(run / "events.jsonl")]
    assert {e["built"] for e in ready if e["kind"] == "worker_ready"} == {f"whole: {why}"}


def test_a_disk_that_cannot_take_the_file_costs_only_the_shortcut(tmp_path, corpus,
                                                                  monkeypatch):
    import errno

    from spotpipe.model import template

    def full(model, path, identity):
        path.with_name(path.name + ".partial").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(template, "save_initial", full)
    cfg = tiny_config(corpus, stages=2)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    evs = [json.loads(line) for line in open(run / "events.jsonl")]
    note = [e for e in evs if e["kind"] == "initial_weights_not_written"]
    assert len(note) == 1 and "No space left on device" in note[0]["message"]
    assert {e["built"] for e in evs if e["kind"] == "worker_ready"} == \
        {"whole: no initial weights file"}
    assert not list(run.glob("initial*"))
