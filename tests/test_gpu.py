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


def test_a_cpu_replica_promoted_onto_the_gpu_steps_and_a_gpu_stage_held_on_the_cpu_too(corpus):
    """`replica.device: cpu` (the default) on a GPU job: the replica's optimizer state must
    follow its module onto the GPU at a takeover, and onto the CPU when a stage received on
    the GPU is held as a replica (`optim.follow_parameters`); left behind, the next step
    fails on the device mismatch. A re-partition's install keeps AdamW's step count on the
    CPU, as torch does for an optimizer that is not fused."""
    from spotpipe import job
    from spotpipe.plan import Layout
    from spotpipe.runtime import migrate
    from spotpipe.runtime.optim import follow_parameters
    from spotpipe.runtime.state import NodeState

    cfg = tiny_config(corpus, stages=3, pipelines=1)
    st = NodeState(cfg, job.build_model(cfg), torch.device("cuda"), "node1",
                   Layout.build(3, 1, ["node0", "node1", "node2"]), [(0, 1), (1, 2), (2, 4)])

    def devices(module, optimizer) -> set[tuple[str, str]]:
        return {(k, v.device.type) for p in module.parameters()
                for k, v in optimizer.state[p].items()}

    def step(module, optimizer) -> None:
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()

    module, optimizer = st.build_stage(2, torch.device("cpu"))  # a CPU replica, stepped
    step(module, optimizer)
    module.to("cuda")  # what a takeover does (`Reshaper._promote`)
    follow_parameters(optimizer)
    assert {d for k, d in devices(module, optimizer) if k != "step"} == {"cuda"}
    step(module, optimizer)
    st.hold(2, module, optimizer, 1)  # a stage held as a CPU replica (`NodeState.hold`)
    held = st.holding.replica
    assert {d for _, d in devices(held.module, held.optimizer)} == {"cpu"}
    step(held.module, held.optimizer)
    st.drop_replica()
    target, target_optimizer = st.build_stage(2)  # a re-partition's install on the GPU
    names = [n for n, _ in module.named_parameters()]
    meta, flat = migrate.pack_layers(names, migrate.state_index([(held.module,
                                                                   held.optimizer)]),
                                     torch.device("cpu"))
    want = migrate.state_index([(target, target_optimizer)])
    for name, (value, state) in migrate.unpack_layers(meta, flat).items():
        migrate.install(name, value, state, want)
    placed = devices(target, target_optimizer)
    assert ("step", "cpu") in placed and ("exp_avg", "cuda") in placed
    step(target, target_optimizer)
