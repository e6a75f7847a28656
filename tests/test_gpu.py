"""The checks that need a CUDA GPU (run where one is lent; skipped elsewhere).

One GPU holds one worker (NCCL refuses two ranks on one device), so a GPU job here is P = 1:
its worker on the GPU, its shadow on the CPU. The reference is the plain loop on the same GPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.runtime.optim import optimizer_kernel
from spotpipe.runtime.reference import train_reference

from conftest import tiny_config
from test_shadow import state_digests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage_on_the_gpu_equals_the_plain_loop_on_the_gpu(tmp_path, corpus, precision):
    cfg = tiny_config(corpus, stages=1, precision=precision, iterations=4)
    assert train(cfg, tmp_path / "run", progress=False) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    model, _ = train_reference(cfg, device="cuda")
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the loop on the GPU"
    # on the CPU the same job ends elsewhere: the comparison is GPU against GPU
    cpu, _ = train_reference(cfg, device="cpu")
    assert any(not torch.equal(v, want[k]) for k, v in cpu.state_dict().items())


@pytest.mark.parametrize("optimizer,kernel", [("adamw", "auto"), ("adamw", "portable"),
                                              ("sgd", "auto")])
def test_a_cpu_shadow_of_a_gpu_stage_is_exact(tmp_path, corpus, optimizer, kernel):
    """torch's fused AdamW on the CPU and on the GPU give other bits (spotpipe bench gpu); a
    GPU job with CPU shadows steps with the portable kernel, which gives the same."""
    cfg = tiny_config(corpus, stages=1, iterations=5, precision="bf16",
                      **{"shadow.enabled": True, "logging.state_digests": True,
                         "optimizer.name": optimizer, "optimizer.momentum": 0.9,
                         "optimizer.kernel": kernel})
    assert optimizer_kernel(cfg) == "portable"
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    seen = state_digests(run)
    for t in range(cfg.iterations):
        owner = seen[("owner", 0, t)]
        assert len(owner) == 1, t
        assert seen[("shadow", 0, t)] == owner, f"the CPU shadow drifted after iteration {t}"
    assert len({next(iter(seen[("owner", 0, t)])) for t in range(cfg.iterations)}) == 5
    # and the job is the plain loop on the GPU with the same kernel
    model, _ = train_reference(cfg, device="cuda")
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], v.cpu()) for k, v in model.state_dict().items())


def test_dropout_on_the_gpu_draws_per_layer_and_a_stage_equals_the_loop(tmp_path, corpus):
    """The CUDA generator is seeded per layer (`model.precision.Draws`): a layer draws the same
    masks in any stage on the GPU, and a job with dropout trains the GPU loop's bits."""
    from spotpipe import job
    from spotpipe.model import build_stage
    from spotpipe.model.precision import Draws, Precision, run_layers

    cfg = tiny_config(corpus, stages=1, iterations=4, **{"model.gpt.dropout": 0.2,
                                                         "model.gpt.n_layer": 4})
    model = job.build_model(cfg)
    whole = model.to_sequential().cuda().train()
    x = torch.randint(0, 256, (2, 16), device="cuda")
    draws, fp32 = Draws(cfg.seed, 3, 1), Precision()
    want = run_layers(whole, x, fp32, draws)
    first, second = build_stage(model, 0, 2), build_stage(model, 2, model.num_layers)
    torch.rand(1000, device="cuda")
    assert torch.equal(run_layers(second, run_layers(first, x, fp32, draws), fp32, draws), want)
    assert not torch.equal(run_layers(whole, x, fp32, Draws(cfg.seed, 3, 2)), want)
    assert train(cfg, tmp_path / "run", progress=False) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    loop, _ = train_reference(cfg, device="cuda")
    for key, value in loop.state_dict().items():
        assert torch.equal(got[key], value.cpu()), f"{key} differs from the loop on the GPU"
