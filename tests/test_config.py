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
    ({}, ["data.block_size=65"], "data.block_size: expected at most model.gpt.block_size (64)"),
    # optimizer and schedule values the workers would refuse, or train on silently
    ({}, ["optimizer.weight_decay=-1"], "optimizer.weight_decay: expected >= 0, got -1.0"),
    ({}, ["optimizer.eps=0"], "optimizer.eps: expected a positive number, got 0.0"),
    ({}, ["optimizer.eps=-1"], "optimizer.eps: expected a positive number"),
    ({}, ["optimizer.name=sgd", "optimizer.momentum=-5"], "optimizer.momentum: expected >= 0"),
    ({}, ["lr_schedule.min_lr=-1"], "lr_schedule.min_lr: expected >= 0"),
    ({}, ["lr_schedule.kind=cosine", "lr_schedule.min_lr=10"],
     "lr_schedule.min_lr: expected at most optimizer.lr (0.001)"),
    ({}, ["lr_schedule.kind=linear", "lr_schedule.min_lr=10"], "lr_schedule.min_lr"),
    # timeouts a working node's beats cannot meet; a negative memory is no size
    ({"data": {"path": "x.txt"}}, ["failover.hang_timeout_s=0.001"],
     "failover.hang_timeout_s: expected at least 2 x failover.heartbeat_s = 1 s"),
    ({"data": {"path": "x.txt"}}, ["failover.heartbeat_timeout_s=0.9"],
     "failover.heartbeat_timeout_s: expected at least 2 x failover.heartbeat_s"),
    ({"data": {"path": "x.txt"}}, ["cluster.device_memory_gb=-3"], "cluster.device_memory_gb: expected >= 0"),
    ({"data": {"path": "x.txt"}}, ["failover.notice_lead_s=-1"],
     "failover.notice_lead_s: expected a number of seconds >= 0, got -1.0"),
    ({"data": {"path": "x.txt"}}, ["failover.notice_max_wait_s=-5"],
     "failover.notice_max_wait_s: expected a number of seconds >= 0, got -5.0"),
    ({"data": {"path": "x.txt"}}, ["failover.handover_gbps=0"],
     "failover.handover_gbps: expected a positive number of gigabits per second, got 0.0"),
    ({"data": {"path": "x.txt"}}, ["failover.handover_gbps=nan"],
     "failover.handover_gbps: expected a finite number, got nan"),
    # numbers beyond what torch takes, and YAML values that are not configuration values
    ({}, ["seed=99999999999999999999999"],
     "seed: expected an integer in -2**63..2**63-1 (64 bits), got 99999999999999999999999"),
    ({}, ["optimizer.lr=1" + "0" * 400],
     "optimizer.lr: expected a finite number, got an integer of 1329 bits"),
    ({}, ["seed=2024-01-01"], "seed: a YAML date (2024-01-01) is not a configuration value"),
    ({}, ["model.factory_kwargs={a: !!binary aGVsbG8=}"],
     "model.factory_kwargs.a: YAML binary data (!!binary) is not a configuration value"),
    ({}, ["model.factory_kwargs={a: 1, a: 2}"], "a: given twice"),
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


def test_min_lr_is_not_read_by_the_constant_schedule():
    cfg = from_dict({"data": {"path": "x.txt"}}, ["lr_schedule.min_lr=10"])
    assert cfg.lr_at(5) == cfg.optimizer.lr
    assert from_dict({"data": {"path": "x.txt"}}, ["seed=-5", "cluster.device_memory_gb=0"])


@pytest.mark.parametrize("content,message", [
    (b"stages: 2\n\xff\xfe: 3\n", "not UTF-8 text: byte 10 (line 2) is 0xff"),
    (b"stages: 2\nseed: 2024-01-01\n", "seed: a YAML date (2024-01-01) is not a configuration"),
    (b"model:\n  factory_kwargs: {when: 2024-01-01 10:00:00}\n",
     "model.factory_kwargs.when: a YAML date and time (2024-01-01 10:00:00)"),
    (b"data: {path: !!binary aGVsbG8=}\n", "data.path: YAML binary data (!!binary)"),
    (b"model:\n  factory_kwargs: &a {x: *a}\n",
     "model.factory_kwargs.x: refers to itself (a YAML alias inside its own anchor)"),
    (b"model:\n  kind: gpt\n  gpt: {n_layer: 2}\n  gpt: {n_layer: 3}\n",
     "model.gpt: given twice, on line 3 and line 4"),
    (b"optimizer: {lr: 0.1}\nstages: 2\noptimizer: {weight_decay: 0.5}\n",
     "optimizer: given twice, on line 1 and line 3"),
    (b"", "the file is empty (no keys)"),
    (b"# only a comment\n", "the file is empty (no keys)"),
    (b"stages: 2\nseed: " + b"9" * 5000 + b"\n",
     "line 2: an integer of 5000 digits; expected 64 bits at most"),
    (b"seed: 2024-13-45\n", "cannot read a value: month must be in 1..12"),
], ids=lambda v: v[:30].decode(errors="replace") if isinstance(v, bytes) else v[:30])
def test_a_file_that_cannot_be_a_configuration_is_named(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("data: {path: x.txt}\noptimizer: {lr: 0.5}\n"
                    "lr_schedule: {<<: {kind: cosine, min_lr: 0.1}, min_lr: 0.2}\n")
    cfg = load_config(path)
    assert cfg.lr_schedule.kind == "cosine" and cfg.lr_schedule.min_lr == 0.2


def test_a_folder_is_not_a_configuration_file(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a configuration file"):
        load_config(tmp_path)
