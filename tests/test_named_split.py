"""torchtitan-style models split by module names (`model.split_points`), no wrappers.

The model is examples/titan_llama.py, a small Llama in torchtitan's shape (tok_embeddings,
layers in a ModuleDict, norm, output; a rotary buffer). Reference: the unsplit model trained
by a plain loop, `model(tokens)`, over the same samples.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from spotpipe import job
from spotpipe.cluster.launcher import train
from spotpipe.config import load_config
from spotpipe.data import collate
from spotpipe.model import PartitionError, gpt_loss
from spotpipe.model.named import split_by_names

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
from titan_llama import Transformer  # noqa: E402

SMALL = ["model.factory_kwargs={vocab_size: 256, dim: 32, n_layers: 3, n_heads: 2, "
         "max_seq_len: 16}", "data.block_size=16", "iterations=3", "micro_batch_size=2",
         "logging.progress=false", "lr_schedule.kind=constant"]


def test_units_are_the_models_own_modules_and_run_as_its_forward():
    torch.manual_seed(0)
    model = Transformer(dim=32, n_layers=3, n_heads=2, max_seq_len=16)
    layered = split_by_names(model, gpt_loss)
    assert layered.layer_names == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm",
                                   "output"]
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(layered.to_sequential()(tokens), model(tokens))
    names = {layered.export_name(k) for k in layered.to_sequential().state_dict()}
    assert names == set(model.state_dict())
    # the units share the model's parameters: nothing was copied
    assert layered.layers[2].layers["1"] is model.layers["1"]


def test_split_points_train_exactly_like_the_unsplit_model(tmp_path):
    cfg = load_config(REPO / "examples" / "titan_llama.yaml", SMALL)
    model = job.build_model(cfg)
    profile = job.profile_model(cfg, model, job.build_dataset(cfg))
    assert job.compute_partition(cfg, profile) == [(0, 3), (3, 6)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    got = load_file(str(run / "final" / "model.safetensors"))
    # the plain loop on the model itself
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    torch.manual_seed(cfg.seed)
    plain = Transformer(**cfg.model.factory_kwargs)
    o = cfg.optimizer
    opt = torch.optim.AdamW(plain.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)
    dataset = job.build_dataset(cfg)
    sampler = job.build_sampler(cfg, dataset)
    for t in range(cfg.iterations):
        for idx in sampler.pipeline_microbatches(t, 0, 1, cfg.num_microbatches):
            x, y = collate(dataset, idx)
            (gpt_loss(plain(x), y) / cfg.num_microbatches).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = plain.state_dict()
    assert set(got) == set(want), "final keys must be the model's own names"
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_bad_split_points_are_refused_by_name():
    cfg = load_config(REPO / "examples" / "titan_llama.yaml", SMALL + ["model.split_points=[layers.9]"])
    model, data = job.build_model(cfg), job.build_dataset(cfg)
    with pytest.raises(PartitionError, match=r"'layers.9' is not a layer.*layers.0"):
        job.compute_partition(cfg, job.profile_model(cfg, model, data))
    cfg = load_config(REPO / "examples" / "titan_llama.yaml", SMALL + ["stages=3"])
    with pytest.raises(PartitionError, match="make 2 stages, the job has 3"):
        job.compute_partition(cfg, job.profile_model(cfg, model, data))
