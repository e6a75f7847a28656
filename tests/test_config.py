"""Configuration mapping: defaults, overrides, and errors that name the key."""

import pytest

from spotpipe.config import ConfigError, from_dict, load_config


def test_defaults_and_overrides():
    cfg = from_dict({"stages": 4, "data": {"path": "x.txt"}}, ["optimizer.lr=3e-4", "model.gpt.n_layer=8",
                                    "optimizer.betas=[0.8, 0.9]", "logging.tensorboard=true"])
    assert cfg.stages == 4 and cfg.optimizer.lr == 3e-4 and cfg.model.gpt.n_layer == 8
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.logging.tensorboard is True
    assert cfg.global_batch == cfg.micro_batch_size * cfg.num_microbatches * cfg.pipelines


@pytest.mark.parametrize("data,overrides,message", [
    ({"stagez": 2}, [], "unknown key 'stagez' (did you mean 'stages'?)"),
    ({"optimizer": {"name": "lamb"}}, [], "optimizer.name: expected one of 'adamw', 'sgd'"),
    ({"optimizer": 3}, [], "optimizer: expected a mapping"),
    ({"iterations": 2.5}, [], "iterations: expected an integer, got 2.5"),
    ({"iterations": True}, [], "iterations: expected an integer"),
    ({}, ["pipelines=-1"], "pipelines: expected a positive integer, got -1"),
    ({}, ["nokey"], "expected key=value"),
    ({}, ["model.gpt=3"], "model.gpt: expected a mapping"),
    ({}, ["optimizer.grad_clip=-1"], "optimizer.grad_clip"),
    ({"model": {"kind": "factory"}}, [], "model.factory: expected 'package.module:function'"),
    ({"data": {"kind": "tokens"}}, [], "data.path: required"),
])
def test_errors_name_the_key(data, overrides, message):
    with pytest.raises(ConfigError) as err:
        from_dict(data, overrides)
    assert message in str(err.value)


def test_relative_data_path_is_taken_from_the_config_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "c.txt").write_text("hello")
    (tmp_path / "job.yaml").write_text("data: {kind: text, path: d/c.txt}\n")
    cfg = load_config(tmp_path / "job.yaml")
    assert cfg.data.path == str((tmp_path / "d" / "c.txt").resolve())
    assert "source_dir" not in cfg.to_dict()


def test_digest_changes_with_what_matters():
    base = {"data": {"path": "x.txt"}}
    assert from_dict(base).digest() == from_dict(base).digest()
    assert from_dict(base).digest() != from_dict(base, ["seed=1"]).digest()


@pytest.mark.parametrize("override", [
    "model.partition=parameters", "model.stage_of_layer=[0, 0, 1, 1]",
    "model.split_points=['layers.2']", "model.activation_checkpointing=layers",
    "model.gpt.dropout=0.1", "stages=3", "optimizer.lr=0.5"])
def test_the_model_digest_ignores_how_the_model_is_cut_and_run(override):
    """A checkpoint is resharded on load: keys that decide the stages and how they run change
    no tensor, so a checkpoint written without them loads with them."""
    base = from_dict({"data": {"path": "x.txt"}})
    assert from_dict({"data": {"path": "x.txt"}}, [override]).model_digest() == \
        base.model_digest()


@pytest.mark.parametrize("override", [
    "model.gpt.n_embd=32", "model.gpt.n_layer=2", "model.gpt.vocab_size=512",
    "model.gpt.bias=false", "model.gpt.tie_embeddings=true",
    "optimizer.name=sgd"])
def test_the_model_digest_covers_what_decides_the_tensors(override):
    base = from_dict({"data": {"path": "x.txt"}})
    assert from_dict({"data": {"path": "x.txt"}}, [override]).model_digest() != \
        base.model_digest()
