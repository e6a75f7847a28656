"""The portable optimizer kernel (`optimizer.kernel: portable`): the same bits on any device.

The references do not come from spotpipe: numpy's square root (the processor's correctly
rounded instruction) and torch's own AdamW and SGD. That CPU and GPU agree bit for bit was
measured on an H200 (`spotpipe bench gpu`, tests/test_gpu.py); here the kernel is checked on
the CPU and inside a whole job.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.runtime.faults import Fault
from spotpipe.runtime.optim import PortableAdamW, PortableSGD, corrected_sqrt, rounded_sqrt

from conftest import tiny_config
from test_equivalence import reference
from test_failover import FAST, assert_samples_exactly_once
from test_shadow import state_digests


def test_the_square_root_is_correctly_rounded():
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-44, 38, (1 << 18,), generator=gen).float()
    x = torch.rand(1 << 18, generator=gen) * 10.0 ** exponents
    edge = torch.tensor([0.0, 1.0, 2.0, 0.25, 1e-45, 1e-40, 1.1754942e-38, 3.4028235e38])
    x = torch.cat([x, edge])
    want = np.sqrt(x.numpy())
    assert np.array_equal(rounded_sqrt(x).numpy(), want)
    # the path a GPU takes, built on float64 products alone (the same on an H200: bench gpu)
    assert np.array_equal(corrected_sqrt(x).numpy(), want)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_portable_kernels_compute_torchs_update(name):
    """The same algorithm as torch's (to a few ulps: the operations are grouped otherwise)."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in [(300,), (17, 29), (1,)]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    if name == "adamw":
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        a, b = PortableAdamW(ours, **kw), torch.optim.AdamW(theirs, foreach=False, **kw)
    else:
        kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.1)
        a, b = PortableSGD(ours, **kw), torch.optim.SGD(theirs, foreach=False, **kw)
    for _ in range(20):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q, t in zip(ours, theirs, init):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p, t)
    for key, value in b.state[theirs[0]].items():  # the same state layout
        assert key in a.state[ours[0]] and a.state[ours[0]][key].shape == value.shape


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_pieces_change_no_bits(monkeypatch, name):
    """The update runs piece by piece (cache-sized on the CPU, bounded on a GPU); every
    operation is elementwise, so any piece size gives the same state."""
    from spotpipe.runtime import optim

    def run(piece):
        monkeypatch.setitem(optim.PIECE, "cpu", piece)
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(1000,), (31, 7)]]
        opt = (PortableAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
               if name == "adamw" else PortableSGD(params, lr=1e-2, momentum=0.9,
                                                   weight_decay=0.1))
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            opt.step()
        return [t.clone() for p in params for t in (p, *opt.state[p].values())]

    whole, pieces = run(1 << 30), run(7)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))


def test_a_job_with_the_portable_kernel_is_the_loop_with_it(tmp_path, corpus):
    """Shadows and a replica step with it, a failover takes over from the replica, and the
    job ends on the plain loop's bits with the same kernel."""
    extra = {"optimizer.kernel": "portable", "shadow.enabled": True,
             "logging.state_digests": True}
    cfg = tiny_config(corpus, stages=2, redundancy="lazy", **{**FAST, **extra})
    run = tmp_path / "run"
    fault = Fault.parse("fail", "node1@2:backward", ["node0", "node1"])
    assert train(cfg, run, progress=False, faults=[fault]) == 0
    want, _ = reference(tiny_config(corpus, **{**FAST, "optimizer.kernel": "portable"}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    fused, _ = reference(tiny_config(corpus, **FAST))
    assert any(not torch.equal(fused[k], want[k]) for k in want)  # another kernel
    seen = state_digests(run)
    for t in range(2):  # before the failure: the shadows equal their owners
        for s in range(2):
            assert seen[("shadow", s, t)] == seen[("owner", s, t)], (s, t)
    # every replica state logged equals its owner's; node0 took stage 1 over from its
    # replica, which therefore applied both iterations before the failure (node1's replica
    # of stage 0 may have died before it logged)
    replicas = [key for key in seen if key[0] == "replica"]
    assert {("replica", 1, 0), ("replica", 1, 1)} <= set(replicas)
    assert all(seen[key] <= seen[("owner", *key[1:])] for key in replicas), replicas
    assert_samples_exactly_once(run, cfg)
