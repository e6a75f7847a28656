"""Re-partitioning in place: P goes 4 -> 2 -> 4 through failovers and joins, state moves layer
by layer from memory, and training ends where the failure-free run ends."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.runtime import migrate
from spotpipe.faults import Fault

from conftest import tiny_config
from test_failover import (FAST, assert_nothing_left, assert_samples_exactly_once, events,
                           failure_free, store_port)


def _depths(run) -> list[int]:
    """The depth of every re-partition plan, in order."""
    return [e["stages"] for e in events(run) if e["kind"] == "plan"
            and e["action"] == "repartition"]


def test_four_two_four_in_place(tmp_path, tmp_path_factory, corpus):
    """Two non-adjacent nodes of a 4-stage pipeline fail: their predecessors carry two stages
    each, then the job re-partitions onto the 2 nodes left (one stage each, replicas back);
    two nodes join and it returns to 4 stages. Nothing restarts, nothing is read from disk."""
    extra = {**FAST, "iterations": 24}
    cfg = tiny_config(corpus, stages=4, pipelines=1, redundancy="lazy", **extra)
    nodes = [f"node{r}" for r in range(4)]
    faults = [Fault.parse("fail", "node1@3:backward", nodes),
              Fault.parse("fail", "node3@3:backward", nodes)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults, joins=[10, 10]) == 0
    evs = events(run)
    plans = [e["action"] for e in evs if e["kind"] == "plan"]
    assert "failover" in plans
    assert _depths(run) == [2, 4], plans
    done = [e for e in evs if e["kind"] == "repartitioned"]
    assert sorted({e["depth"] for e in done}) == [2, 4]
    # at P = 2 each survivor already held half the model: only its new replica travelled
    down = [e for e in done if e["depth"] == 2]
    assert len(down) == 2 and all(e["bytes_received"] > 0 for e in down)
    assert {tuple(map(tuple, e["layers"])) for e in down} == {((0, 2),), ((2, 4),)}
    up = [e for e in done if e["depth"] == 4]
    assert len(up) == 4
    assert not any(e["kind"] in ("restored", "worker_error") for e in evs)
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == list(range(cfg.iterations))
    assert metrics[-1]["live_nodes"] == 4 and metrics[-1]["carriers"] == 0
    assert any(m["live_nodes"] == 2 and m["carriers"] == 0 for m in metrics)
    assert_samples_exactly_once(run, cfg)
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=4, pipelines=1, **extra))
    assert set(got) == set(want)
    # With one pipeline the partition does not change any arithmetic (each layer's forward,
    # backward and optimizer step are the same kernels on the same values; the tied embedding
    # and head sum their two gradients as autograd does), so even across two re-partitions the
    # result is the failure-free one bit for bit.
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the failure-free run"
    assert_nothing_left(run, store_port(run))


def test_two_pipelines_lend_a_node_and_one_waits_on_standby(tmp_path, tmp_path_factory, corpus):
    """P = 4, D = 2: one node fails, its predecessor carries two stages; the 7 nodes left
    re-partition to P = 3 x D = 2 (D is kept, so the micro-batches split as before) and the
    seventh waits on standby in its process; one node joins and the job returns to P = 4,
    placing the standby node again."""
    extra = {**FAST, "iterations": 20}
    cfg = tiny_config(corpus, stages=4, pipelines=2, redundancy="lazy", **extra)
    nodes = [f"node{r}" for r in range(8)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=[Fault.parse("fail", "node1@3:backward", nodes)],
                 joins=[10]) == 0
    evs = events(run)
    assert _depths(run) == [3, 4]
    standby = [e["node"] for e in evs if e["kind"] == "standby"]
    assert len(standby) == 1
    back = [e for e in evs if e["kind"] == "repartitioned" and e["depth"] == 4]
    assert standby[0] in {e["node"] for e in back} and len(back) == 8
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == list(range(cfg.iterations))
    assert {m["live_nodes"] for m in metrics} >= {8, 6}
    assert_samples_exactly_once(run, cfg)
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=4, pipelines=2, **extra))
    # Two pipelines sum each gradient over two addends, which is commutative, and the depth
    # changes no arithmetic (see above), so this holds bit for bit too; assert_close with tight
    # tolerances is the documented invariant for layouts whose D changed.
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=key)
    assert_nothing_left(run, store_port(run))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
], ids=["adamw", "sgd", "adagrad", "rprop", "rmsprop"])
def test_layer_messages_carry_any_optimizer_state_bit_for_bit(make):
    """What a re-partition sends for a layer (parameters, then whatever state the optimizer
    keeps for each) arrives as the same bits, and the moved copy steps exactly like the
    original from then on."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.float64)
    src[1].to(torch.bfloat16)
    src_opt = make(list(src.parameters()))
    for _ in range(2):
        for p in src.parameters():
            p.grad = torch.randn_like(p)
        src_opt.step()
    names = [n for n, _ in src.named_parameters()]
    meta, flat = migrate.pack_layers(names, migrate.state_index([(src, src_opt)]),
                                     torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == migrate.message_bytes(meta)
    json.dumps(meta)  # metadata travels as JSON
    dst = copy.deepcopy(src)
    for p in dst.parameters():
        with torch.no_grad():
            p.zero_()
    dst_opt = make(list(dst.parameters()))
    want = migrate.state_index([(dst, dst_opt)])
    for name, (value, state) in migrate.unpack_layers(meta, flat).items():
        migrate.install(name, value, state, want)
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b) and a.dtype == b.dtype
        sa, sb = src_opt.state[a], dst_opt.state[b]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]) and sa[key].device == sb[key].device, key
            else:
                assert sa[key] == sb[key], key
    for p, q in zip(src.parameters(), dst.parameters()):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    src_opt.step()
    dst_opt.step()
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)


def test_a_parameter_of_another_shape_is_refused():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    want = migrate.state_index([(module, torch.optim.SGD(module.parameters(), lr=0.1))])
    with pytest.raises(RuntimeError, match="0.weight"):
        migrate.install("0.weight", torch.zeros(3, 2), {}, want)


def test_a_repartition_cuts_the_profile_measured_at_launch(tmp_path, corpus, monkeypatch):
    """The layers are profiled once, at launch, and a re-partition to another depth is cut
    from that profile (it travels in run.json) instead of building and profiling the model
    again. Before, the launcher profiled every other depth on a thread while the job trained
    (one profiling run per depth, each with its own noise, and a thread that a job ending
    first had to wait for). Stand-in layer times [1, 1, 1, 5]: at P = 2 the balanced cut is
    layers 0-2 | 3 (largest stage 5), where equal layer counts would give 0-1 | 2-3 (6)."""
    from spotpipe import job

    calls = []

    def profiled(model, sample, **kwargs):
        calls.append(model.num_layers)
        return [1.0, 1.0, 1.0, 5.0]

    monkeypatch.setattr(job, "profile_layer_times", profiled)
    cfg = tiny_config(corpus, stages=3, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 8, "model.partition": "time"})
    nodes = [f"node{r}" for r in range(3)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False,
                 faults=[Fault.parse("fail", "node1@2:backward", nodes)]) == 0
    assert calls == [4]  # once, at launch, for every depth
    spec = json.loads((run / "run.json").read_text())
    assert spec["profile"]["times"] == [1.0, 1.0, 1.0, 5.0]
    assert _depths(run) == [2]
    done = [e for e in events(run) if e["kind"] == "repartitioned"]
    assert sorted(tuple(map(tuple, e["layers"])) for e in done) == [((0, 3),), ((3, 4),)]
    assert_samples_exactly_once(run, cfg)



class _Comm:
    """The part of a generation's `Comm` that the exchange's commit uses: its wait for the
    marks, which the generation's abort ends once it is set."""

    def __init__(self, store, aborted: bool) -> None:
        self.store, self.aborted = store, aborted

    def wait_keys(self, keys, timeout_s, what) -> None:
        from datetime import timedelta

        from spotpipe.runtime.comm import PeerFailure

        if self.aborted:
            raise PeerFailure("aborted: a node was lost")
        self.store.wait(keys, timedelta(seconds=timeout_s))


def _committer(store, node: str, nodes: list[str]):
    """A node's `Reshaper`, as far as committing a re-partition's exchange goes."""
    from types import SimpleNamespace

    from spotpipe.plan import Layout
    from spotpipe.protocol import Channel, job_key
    from spotpipe.runtime.reshape import Reshaper

    state = SimpleNamespace(node=node, generation=3, layout=Layout.build(len(nodes), 1, nodes),
                            cfg=SimpleNamespace(cluster=SimpleNamespace(timeout_s=30.0)))
    return Reshaper(state, store=store, sealed=None, namespace="t",  # type: ignore[arg-type]
                    channel=Channel(job_key(b"sesame", "test"), node), shadow=None,
                    digests=None, inject=lambda *_: None, refused=lambda why: None)


def _switches(reshaper, comm) -> bool:
    """Whether the node switches to the new partition (else it keeps the old one)."""
    from spotpipe.runtime.comm import PeerFailure

    try:
        reshaper._commit_exchange(comm)
    except PeerFailure:
        return False
    return True


def _together(store, nodes: list[str], aborted: set[str]) -> list[bool]:
    """Every node commits at once; those in `aborted` after the others wrote their marks."""
    from concurrent.futures import ThreadPoolExecutor

    from spotpipe.protocol import keys

    committers = [_committer(store, n, nodes) for n in nodes]
    with ThreadPoolExecutor(len(nodes)) as pool:
        running = {n: pool.submit(_switches, r, _Comm(store, False))
                   for n, r in zip(nodes, committers) if n not in aborted}
        store.wait([keys.exchanged("t", 3, n) for n in running])
        late = {n: pool.submit(_switches, r, _Comm(store, True))
                for n, r in zip(nodes, committers) if n in aborted}
        return [{**running, **late}[n].result(timeout=30) for n in nodes]


def test_a_repartition_cut_short_switches_every_node_or_none():
    """node2 writes its mark that its layers are exchanged and dies; node0, woken by the
    abort, looks at the marks while node1 (slower, its exchange done) has not written its
    own yet; node1 then writes it and finds every mark there. Both must decide alike: node0
    once kept the old partition while node1 switched, and the job, which cannot roll back a
    plan that changed a node, counted node0 out with state it could have run on."""
    import torch.distributed as dist

    nodes = ["node0", "node1", "node2"]
    store = dist.HashStore()
    node0, node1, node2 = (_committer(store, n, nodes) for n in nodes)
    _switches(node2, _Comm(store, aborted=True))  # (its own outcome is moot: it dies)
    decided = [_switches(node0, _Comm(store, aborted=True)),
               _switches(node1, _Comm(store, aborted=True))]
    assert decided[0] == decided[1], decided
    # with no node lost every node switches, and a node woken by the abort once every mark
    # is there switches with the others
    assert _together(dist.HashStore(), nodes, set()) == [True, True, True]
    assert _together(dist.HashStore(), nodes, {"node0"}) == [True, True, True]
