"""Checkpoint schemes: each holds exactly the stage state of the iteration it checkpointed, the
asynchronous ones are reported (and committed) only once written, the interval policy, the
baselines' file format refuses what it must, and bad configuration is rejected by key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from spotpipe import job
from spotpipe.checkpoint import durable, interval, snapshot
from spotpipe.checkpoint.durable import CheckpointError
from spotpipe.checkpoint.peer import peer_of
from spotpipe.checkpoint.schemes import Cadence
from spotpipe.cluster.launcher import train
from spotpipe.config import ConfigError
from spotpipe.plan import Layout
from spotpipe.runfiles import read_jsonl
from spotpipe.runtime import node as nodelib
from spotpipe.runtime.digest import stage_digest

from conftest import tiny_config

KEY = b"k" * 32  # the MAC key of checkpoints committed directly here

RUN = {"stages": 2, "iterations": 6, "checkpoint.every": 2, "logging.state_digests": True}


def owner_digests(run: Path) -> dict[tuple[int, int], dict[str, str]]:
    """(iteration, stage) -> the owner's digest after that iteration's step."""
    out = {}
    for path in (run / "logs").glob("digests.*.jsonl"):
        for r in read_jsonl(path):
            if r["role"] == "owner":
                out[(r["iter"], r["stage"])] = {"params": r["params"], "optim": r["optim"]}
    return out


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind]


def _run(corpus: Path, tmp_path: Path, scheme: str, **extra) -> Path:
    out = tmp_path / scheme
    cfg = tiny_config(corpus, **{**RUN, "checkpoint.scheme": scheme, **extra})
    assert train(cfg, out, progress=False) == 0
    return out


@pytest.mark.parametrize("scheme", ["torch_save", "checkfreq"])
def test_file_schemes_hold_the_owner_state_bit_for_bit(tmp_path, corpus, scheme):
    run = _run(corpus, tmp_path, scheme)
    want = owner_digests(run)
    root = run / f"checkpoints_{scheme}"
    done = events(run, "checkpoint_done")
    assert sorted((e["iteration"], e["stage"]) for e in done) == [
        (t, s) for t in (1, 3, 5) for s in (0, 1)]
    assert all(e["bytes"] > 0 and e["blocked_s"] >= 0 and e["scheme"] == scheme for e in done)
    digest = tiny_config(corpus, **RUN).model_digest()
    for s in (0, 1):
        kept = sorted(p.name for p in (root / f"stage{s}").iterdir())
        # keep: 2, each file committed by its sidecar, no temporary left
        assert kept == ["iter_00000003.json", "iter_00000003.pt", "iter_00000005.json",
                        "iter_00000005.pt"]
        for t in (3, 5):
            snap = snapshot.read_file(snapshot.file_path(root, s, t), digest)
            assert snap.iteration == t and snap.stage == s
            assert snapshot.fingerprint(snap.tensors, snap.params) == want[(t, s)]
        assert snapshot.fingerprint(snap.tensors, snap.params) != want[(4, s)]


def _load_durable(cfg, path: Path, stage: int) -> dict[str, str]:
    model = job.build_model(cfg)
    spec = job.RunSpec.from_json(json.loads((path.parents[1] / "run.json").read_text()))
    state = nodelib.build_stage_state(model, spec.partition, stage, cfg, torch.device("cpu"))
    durable.load_stage(durable.verify(path), state.module, state.optimizer)
    return stage_digest(state.module, state.optimizer)


@pytest.mark.parametrize("scheme", ["durable", "dcp_async"])
def test_durable_tier_commits_exact_state_only_after_the_write(tmp_path, corpus, scheme):
    run = _run(corpus, tmp_path, scheme)
    cfg = tiny_config(corpus, **{**RUN, "checkpoint.scheme": scheme})
    want = owner_digests(run)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["iter_00000003", "iter_00000005", "latest"]  # keep 2, nothing partial
    for t in (3, 5):
        for s in (0, 1):
            assert _load_durable(cfg, run / "checkpoints" / f"iter_{t:08d}", s) == want[(t, s)]
    # the launcher commits an iteration only after every stage reported it written
    log = read_jsonl(run / "events.jsonl")
    for t in (1, 3, 5):
        commit = next(i for i, e in enumerate(log)
                      if e["kind"] == "checkpoint_committed" and e["iteration"] == t)
        saved = [i for i, e in enumerate(log)
                 if e["kind"] == "checkpoint_saved" and e["iteration"] == t]
        assert len(saved) == 2 and max(saved) < commit
    saved = events(run, "checkpoint_saved")
    assert all(e["scheme"] == scheme and e["bytes"] > 0 for e in saved)
    if scheme == "dcp_async":
        # written in the background: some write outlasted what the loop waited for
        assert any(e["persist_s"] > e["blocked_s"] for e in saved)


def test_gemini_peer_holds_the_owner_state_bit_for_bit(tmp_path, corpus):
    run = _run(corpus, tmp_path, "gemini")
    want = owner_digests(run)
    held = events(run, "checkpoint_held")
    sent = events(run, "checkpoint_done")
    assert sorted((e["iteration"], e["stage"]) for e in held) == [
        (t, s) for t in (1, 3, 5) for s in (0, 1)]
    for e in held:
        assert e["digest"] == want[(e["iteration"], e["stage"])]
        assert e["node"] != e["writer"]  # in another node's memory
    assert {(e["iteration"], e["stage"], e["bytes"]) for e in sent} == {
        (e["iteration"], e["stage"], e["bytes"]) for e in held}


def test_auto_interval_picks_k_from_young_daly_and_commits(tmp_path, corpus):
    # a tiny MTBF makes the optimum a few iterations, so the run shows more than one choice
    run = _run(corpus, tmp_path, "durable", **{"checkpoint.every": "auto",
                                               "checkpoint.mtbf_s": 0.05, "iterations": 8})
    saved = sorted({e["iteration"] for e in events(run, "checkpoint_saved")})
    assert saved[0] == 1  # the first after the warm-up iteration
    decided = events(run, "checkpoint_interval")
    assert {e["node"] for e in decided} == {"node0", "node1"}
    by_iteration: dict[int, set[int]] = {}
    for e in decided:
        assert e["k"] >= 1 and e["next_at"] == e["iteration"] + e["k"]
        assert e["mtbf_s"] >= 0.05 and e["cost_s"] >= 0 and e["iteration_s"] > 0
        by_iteration.setdefault(e["iteration"], set()).add(e["next_at"])
    assert sorted(by_iteration) == saved
    assert all(len(v) == 1 for v in by_iteration.values())  # every node chose the same
    for t, t_next in zip(saved, saved[1:]):
        assert by_iteration[t] == {t_next}
    committed = [e["iteration"] for e in events(run, "checkpoint_committed")]
    assert committed == saved


# ---------------------------------------------------------------------- interval (pure)

def test_young_and_daly_intervals():
    assert interval.young_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    young = interval.young_interval_s(1.0, 1e6)
    daly = interval.daly_interval_s(1.0, 1e6)
    assert daly == pytest.approx(young, rel=1e-3)  # C << M: the orders agree
    # C = 50, M = 1000: sqrt(1e5) (1 + sqrt(0.025)/3 + 0.025/9) - 50
    want = math.sqrt(1e5) * (1 + math.sqrt(0.025) / 3 + 0.025 / 9) - 50
    assert interval.daly_interval_s(50.0, 1000.0) == pytest.approx(want)
    assert interval.daly_interval_s(3000.0, 1000.0) == 1000.0  # C >= 2M: once per MTBF
    assert interval.young_interval_s(0.0, 100.0) == 0.0


def test_interval_in_iterations():
    # sqrt(2 * 0.5 * 200) = 14.14 s of work at 1 s per iteration
    assert interval.interval_iterations(0.5, 200.0, 1.0, formula="young") == 14
    assert interval.interval_iterations(0.0, 200.0, 1.0) == 1  # free checkpoints: every one
    assert interval.interval_iterations(10.0, 1e9, 0.01, max_iterations=500) == 500
    with pytest.raises(ValueError, match="iteration_s"):
        interval.interval_iterations(1.0, 100.0, 0.0)
    with pytest.raises(ValueError, match="formula"):
        interval.interval_iterations(1.0, 100.0, 1.0, formula="magic")
    with pytest.raises(ValueError, match="mtbf_s"):
        interval.young_interval_s(1.0, 0.0)
    with pytest.raises(ValueError, match="cost_s"):
        interval.daly_interval_s(-1.0, 10.0)


def test_mtbf_estimate_updates_the_prior_with_failures_seen():
    assert interval.mtbf_estimate(3600.0, 0.0, 0) == 3600.0
    assert interval.mtbf_estimate(3600.0, 400.0, 0) == 4000.0
    assert interval.mtbf_estimate(100.0, 500.0, 5) == 100.0
    with pytest.raises(ValueError):
        interval.mtbf_estimate(0.0, 1.0, 0)


def test_huge_or_non_finite_interval_inputs_give_a_cap_or_a_clear_error(corpus):
    """An MTBF of 1e308 s is finite and accepted by the config, but 2 C M overflowed to
    infinity and `round` of it raised OverflowError in every worker at the first checkpoint of
    `every: auto`. The optimum there is astronomically long: the cap. NaN or infinite inputs
    are named, never passed on as a NaN MTBF."""
    assert interval.young_interval_s(2.0, 1e308) == pytest.approx(2e154)
    assert interval.daly_interval_s(2.0, 1e308) == pytest.approx(2e154)
    assert interval.interval_iterations(1.0, 1e308, 0.1, max_iterations=10_000) == 10_000
    assert interval.interval_iterations(1e308, 1e308, 1e-300, max_iterations=7) == 7
    with pytest.raises(ValueError, match="no whole number of iterations"):
        interval.interval_iterations(1e308, 1e308, 1e-300)
    for args in ((math.nan, 1.0, 0), (math.inf, 1.0, 0), (3600.0, math.nan, 0),
                 (3600.0, math.inf, 0)):
        with pytest.raises(ValueError, match="mtbf_estimate: expected a finite prior"):
            interval.mtbf_estimate(*args)
    cfg = tiny_config(corpus, **{"checkpoint.every": "auto", "checkpoint.mtbf_s": 1e308})
    cadence = Cadence(cfg, lambda: 0, _Store(), "ns")
    assert cadence.due(1)
    cadence.checkpointed(1, 2.0, _Comm([]))
    assert cadence.k == cadence.max_k and cadence.next_at == 1 + cadence.max_k


class _Store(dict):
    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return dict.__getitem__(self, key)

    def set(self, key, value):
        self[key] = value.encode() if isinstance(value, str) else value


class _Comm:
    device = torch.device("cpu")

    def __init__(self, others):
        self.others = others

    def all_gather(self, tensor):
        return [tensor, *[torch.tensor(o, dtype=tensor.dtype) for o in self.others]]


def test_auto_cadence_agrees_on_the_slowest_node_and_publishes_it(corpus):
    cfg = tiny_config(corpus, **{"checkpoint.every": "auto", "checkpoint.mtbf_s": 10.0})
    store = _Store()
    cadence = Cadence(cfg, lambda: 0, store, "ns")
    assert not cadence.due(0) and cadence.due(1)
    # another node blocked 0.2 s with 0.1 s iterations: the slowest decides for all
    cadence.checkpointed(1, 0.01, _Comm([[0.2, 0.1, 0.0, 0.0]]))
    k = interval.interval_iterations(0.2, 10.0, 0.1)  # 18.7 s of work: 19 iterations
    assert k == 19 and cadence.k == k  # (the elapsed milliseconds barely move the MTBF)
    assert cadence.next_at == 1 + k
    assert int(store.get("ns/checkpoint/next_at")) == cadence.next_at
    late = Cadence(cfg, lambda: 0, store, "ns")  # a node that joins later reads it
    assert late.due(cadence.next_at) and not late.due(cadence.next_at - 1)
    # failures seen shorten the interval
    failing = Cadence(cfg, lambda: 3, _Store(), "ns")
    failing.due(1)
    failing.checkpointed(1, 0.2, _Comm([]))
    assert failing.k < k


class _Gather:
    """An all-gather among in-process nodes, one thread each (a barrier, no sleeps)."""

    def __init__(self, world: int):
        import threading

        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world

    def comm(self, rank: int):
        import types

        def all_gather(tensor):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # (everyone has read before a next round writes)
            return out
        return types.SimpleNamespace(device=torch.device("cpu"), all_gather=all_gather)


def test_auto_cadence_agrees_though_nodes_saw_different_failures(corpus):
    """A node that joined after a failure (or one that left through a regroup) counts fewer
    failures than the others: each took its own count into the MTBF, so the nodes chose
    different intervals and checkpointed different iterations (no iteration complete to
    commit, and the next all-gather of the cadence met another collective). They agree on
    the most failures seen, as on the slowest node's costs."""
    import threading

    cfg = tiny_config(corpus, **{"checkpoint.every": "auto", "checkpoint.mtbf_s": 10.0})
    seen = [0, 3]
    cadences = [Cadence(cfg, lambda n=n: n, _Store(), "ns") for n in seen]
    gather = _Gather(2)
    threads = [threading.Thread(target=c.checkpointed, args=(1, 0.2, gather.comm(r)))
               for r, c in enumerate(cadences)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cadences[0].k == cadences[1].k and cadences[0].next_at == cadences[1].next_at
    alone = Cadence(cfg, lambda: 0, _Store(), "ns")
    alone.checkpointed(1, 0.2, _Comm([]))
    assert cadences[0].k < alone.k  # (the failures count: 3 of them, not 0)


def test_a_cadence_record_written_without_the_key_is_not_followed(corpus):
    """The agreed next checkpoint lives in the store, sealed (store/sealed.py): a late node
    reads the genuine one; one written over it without the job's key is refused (an event)
    and the node starts afresh instead of checkpointing where the forger says."""
    from datetime import timedelta

    import torch.distributed as dist

    from spotpipe.store.sealed import SealedStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    refused = []
    store = SealedStore(server, b"k" * 32, on_refused=refused.append)
    cfg = tiny_config(corpus, **{"checkpoint.every": "auto", "checkpoint.mtbf_s": 10.0})
    cadence = Cadence(cfg, lambda: 0, store, "ns")
    cadence.due(1)
    cadence.checkpointed(1, 0.01, _Comm([[0.2, 0.1, 0.0, 0.0]]))
    assert Cadence(cfg, lambda: 0, store, "ns").due(cadence.next_at)
    server.set("ns/checkpoint/next_at", "1000000")
    late = Cadence(cfg, lambda: 0, store, "ns")
    assert late.due(1) and late.next_at == 1  # its own first checkpoint, not the forger's
    assert len(refused) == 1 and "ns/checkpoint/next_at: no seal" in str(refused[0])


def test_fixed_cadence(corpus):
    cadence = Cadence(tiny_config(corpus, **{"checkpoint.every": 3}), lambda: 0, _Store(), "ns")
    assert [t for t in range(10) if cadence.due(t)] == [2, 5, 8]


# ---------------------------------------------------------------------- peers

class _Net:
    """Point-to-point messages between in-process nodes, in order per channel."""

    def __init__(self):
        import collections
        import queue

        self.channels = collections.defaultdict(queue.Queue)


class _Work:
    def __init__(self, complete=lambda: None):
        self.complete = complete

    def wait(self):
        self.complete()


class _PeerComm:
    """What gemini uses of a generation's Comm, over `_Net`."""

    device = torch.device("cpu")

    def __init__(self, net, me):
        import types

        self.net, self.me = net, me
        self.abort = types.SimpleNamespace(wait=lambda event: event.wait())

    def send(self, tensor, node, tag_):
        self.net.channels[(self.me, node, tag_)].put(tensor.clone())

    def recv(self, node, tag_):
        return self.net.channels[(node, self.me, tag_)].get(timeout=60)

    def post_send(self, tensor, node, tag_):
        self.send(tensor, node, tag_)
        return _Work()

    def post_recv(self, buffer, node, tag_):
        return _Work(lambda: buffer.copy_(self.recv(node, tag_)))


def _both(schemes_, boundaries):
    """Each node's boundary at once (each one's receive waits for the other's send)."""
    import threading

    errors = []

    def run(scheme, boundary):
        try:
            scheme.after_iteration(boundary)
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=pair) for pair in zip(schemes_, boundaries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_gemini_copy_keeps_its_layout_when_a_stage_changes_shape(tmp_path, corpus):
    """A re-partition changes a stage's layers in place (nothing restarts): its writer put the
    stage's layout (names, shapes) in the store once, at its first copy, and its peer kept the
    first one it read, so a copy of the stage's new layers was cut by the old layout (a
    CheckpointError in the peer's report, or wrong names where the sizes happened to agree)."""
    from spotpipe.checkpoint import registry, schemes
    from spotpipe.runtime.hooks import Boundary

    cfg = tiny_config(corpus, **{"checkpoint.scheme": "gemini", "checkpoint.every": 2,
                                 "stages": 2, "logging.state_digests": True})
    store, net, said = _Store(), _Net(), []
    nodes = ["node0", "node1"]
    layout = Layout.build(2, 1, nodes)
    pair = [registry.build(schemes.SchemeContext(
        cfg, n, tmp_path, lambda kind, n=n, **f: said.append((n, kind, f)), store))
        for n in nodes]
    comms = [_PeerComm(net, n) for n in nodes]

    def stage(*widths):
        torch.manual_seed(len(widths))
        module = torch.nn.Sequential(*[torch.nn.Linear(w, w) for w in widths])
        optimizer = torch.optim.AdamW(module.parameters())
        module(torch.randn(2, widths[0])).sum().backward()
        optimizer.step()
        return module, optimizer

    for t, stage0 in ((1, stage(3)), (3, stage(3, 3))):  # stage 0 gains a layer after 1
        stage1 = stage(4)
        _both(pair, [Boundary(t, {s: st}, comms[s], layout, ((0, 1), (1, 2)))
                     for s, st in ((0, stage0), (1, stage1))])
        for s in (0, 1):  # (both copies are on their way: each peer's wait ends)
            pair[s].poll(Boundary(t + 1, {}, comms[s], layout, ((0, 1), (1, 2))), wait=True)
        held = {(f["iteration"], f["stage"]): f["digest"] for n, kind, f in said
                if kind == "checkpoint_held"}
        assert held[(t, 0)] == stage_digest(*stage0) and held[(t, 1)] == stage_digest(*stage1)
        got = pair[1].tensors(0)
        want = durable.stage_tensors(*stage0)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_gemini_peer_lets_go_of_copies_it_no_longer_keeps(tmp_path, corpus):
    """P = 2 -> 1 (a re-partition onto one stage, two pipelines): node0 kept the copy of stage
    1, which is gone, for the rest of the run, beside the whole model it now holds itself;
    node1, the new peer of stage 0, holds the copies of the new layout."""
    from spotpipe.checkpoint import registry, schemes
    from spotpipe.runtime.hooks import Boundary

    cfg = tiny_config(corpus, **{"checkpoint.scheme": "gemini", "checkpoint.every": 2,
                                 "stages": 2})
    store, net = _Store(), _Net()
    nodes = ["node0", "node1"]
    pair = [registry.build(schemes.SchemeContext(cfg, n, tmp_path, lambda kind, **f: None,
                                                 store)) for n in nodes]
    comms = [_PeerComm(net, n) for n in nodes]
    two, one = Layout.build(2, 1, nodes), Layout.build(1, 2, nodes)
    _both(pair, [Boundary(1, {s: _stage()}, comms[s], two, ((0, 1), (1, 2))) for s in (0, 1)])
    for s in (0, 1):
        pair[s].poll(Boundary(2, {}, comms[s], two, ((0, 1), (1, 2))), wait=True)
    assert set(pair[0].held) == {1} and set(pair[1].held) == {0}
    _both(pair, [Boundary(3, {0: _stage()} if s == 0 else {}, comms[s], one, ((0, 2),))
                 for s in (0, 1)])
    for s in (0, 1):
        pair[s].poll(Boundary(4, {}, comms[s], one, ((0, 2),)), wait=True)
    assert set(pair[0].held) == set() and pair[1].held[0].iteration == 3


def _gemini_pair(tmp_path, corpus, store):
    """Two in-process nodes running gemini over `_Net`, what they said (node, kind, fields),
    and a maker of a fresh one (a node's new process)."""
    from spotpipe.checkpoint import registry, schemes

    cfg = tiny_config(corpus, **{"checkpoint.scheme": "gemini", "checkpoint.every": 2,
                                 "stages": 2, "logging.state_digests": True})
    net, said = _Net(), []
    nodes = ["node0", "node1"]

    def fresh(n):
        return registry.build(schemes.SchemeContext(
            cfg, n, tmp_path, lambda kind, **f: said.append((n, kind, f)), store))
    return [fresh(n) for n in nodes], [_PeerComm(net, n) for n in nodes], said, fresh


def _checkpoint_both(pair, comms, t, stages, layout):
    """Iteration `t`'s boundary on both nodes (node i writes `stages[i]`), then each waits
    for its transfers."""
    from spotpipe.runtime.hooks import Boundary

    part = ((0, 1), (1, 2))
    _both(pair, [Boundary(t, stages[i], comms[i], layout, part) for i in (0, 1)])
    for i in (0, 1):
        pair[i].poll(Boundary(t + 1, {}, comms[i], layout, part), wait=True)


class _TamperedStore(_Store):
    """A store whose next reads of `key` give what `tamper` makes of the value (or raise)."""

    def __init__(self):
        super().__init__()
        self.tamper = {}

    def get(self, key):
        value = dict.__getitem__(self, key)
        change = self.tamper.pop(key, None)
        return value if change is None else change(value)


def _forged_layout(value):
    layout = json.loads(value)
    layout["tensors"][0][2] = [1]  # a shape of its own: another digest
    return json.dumps(layout).encode()


def _refused(value):
    from spotpipe.protocol.auth import Refused

    raise Refused("bad seal")


@pytest.mark.parametrize("tamper", [_forged_layout, _refused])
def test_gemini_peer_refuses_a_bad_layout_record_and_keeps_its_copy(tmp_path, corpus, tamper):
    """The layout record a copy's header names is read from the store, where anyone may
    write: one that is not the writer's (another digest, or refused by the seal) raised out of
    the peer's boundary and ended its worker. Now it is a checkpoint_failed event naming the
    key and the writer; the copy's bytes are still received (and dropped), so the copy of the
    next checkpoint is not read from them, and the copy held before stays."""
    store = _TamperedStore()
    pair, comms, said, _ = _gemini_pair(tmp_path, corpus, store)
    layout = Layout.build(2, 1, ["node0", "node1"])
    key = "spotpipe/checkpoint/layout/0"
    stages = {1: _stage(), 3: _stage(4), 5: _stage(4)}  # a layout of its own from 3 on
    _checkpoint_both(pair, comms, 1, [{0: stages[1]}, {1: _stage()}], layout)
    store.tamper[key] = tamper
    _checkpoint_both(pair, comms, 3, [{0: stages[3]}, {1: _stage()}], layout)
    failed = [f for n, kind, f in said if kind == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["iteration"] == 3 and failed[0]["stage"] == 0
    assert key in failed[0]["message"] and "node0" in failed[0]["message"]
    assert pair[1].held[0].iteration == 1
    assert pair[1].fingerprint(0) == stage_digest(*stages[1])
    _checkpoint_both(pair, comms, 5, [{0: stages[5]}, {1: _stage()}], layout)
    assert pair[1].held[0].iteration == 5
    assert pair[1].fingerprint(0) == stage_digest(*stages[5])


def test_gemini_writer_puts_its_layout_again_after_another_node_wrote_the_stage(tmp_path,
                                                                               corpus):
    """Stage 0 moves from node0 to node1 (whose stage 0 has other layers) and back, to a peer
    that has not read its layout yet (node1 in a new process): node0 remembered that it had
    put its layout already, while the store held node1's, so the peer refused the copy (and,
    before refusals were events, its worker ended)."""
    pair, comms, said, fresh = _gemini_pair(tmp_path, corpus, _Store())
    first, second = Layout.build(2, 1, ["node0", "node1"]), Layout.build(2, 1, ["node1", "node0"])
    _checkpoint_both(pair, comms, 1, [{0: _stage()}, {1: _stage()}], first)
    _checkpoint_both(pair, comms, 3, [{1: _stage()}, {0: _stage(5)}], second)
    pair[1] = fresh("node1")
    back = _stage()
    _checkpoint_both(pair, comms, 5, [{0: back}, {1: _stage()}], first)
    assert [f for n, kind, f in said if kind == "checkpoint_failed"] == []
    assert pair[1].held[0].iteration == 5 and pair[1].fingerprint(0) == stage_digest(*back)


def test_unflatten_reads_a_tensor_at_any_byte_offset():
    """A BatchNorm's int64 count follows five float32 tensors of 3 values (84 bytes in):
    viewing the buffer's bytes there as int64 failed (the offset must be a multiple of 8),
    so a peer's copy of a stage with such a layer could not be read."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    tensors = durable.stage_tensors(module, optimizer)
    layout = json.loads(json.dumps(snapshot.layout_of(tensors, ["0.weight"])))
    back = snapshot.unflatten(snapshot.flatten(tensors), layout)
    assert list(back) == list(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_flatten_gathers_tensors_of_several_devices_on_one():
    """AdamW's step count stays on the CPU while the parameters are on the GPU (the portable
    kernel, or any non-fused AdamW): concatenating them failed. (The meta device stands for
    the GPU here: what matters is that the tensors' devices differ.)"""
    tensors = {"w": torch.zeros(3, device="meta"), "optim/w/step": torch.tensor(2.0)}
    flat = snapshot.flatten(tensors, torch.device("meta"))
    assert flat.device.type == "meta" and flat.numel() == 16 and flat.dtype == torch.uint8


_GOOD = {"params": ["w"], "tensors": [["w", "float32", [2, 3]], ["optim/w/step", "int64", []]]}


@pytest.mark.parametrize("record, problem", [
    (b"\xff{", "not a JSON record"),
    (b"[" * 100 + b"]" * 100, "nested too deeply"),
    (b" " * (17 << 20), "over the"),
    (json.dumps([1, 2]), "an object of params and tensors"),
    (json.dumps({**_GOOD, "params": "w"}), "params: expected a list"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32"]]}), "name, dtype, shape"),
    (json.dumps({**_GOOD, "tensors": [["w", "nn", [6]], ["s", "int64", []]]}), "'nn' is not"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32", [float("nan")]], ["s", "int64", []]]}),
     "non-negative integers"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32", [-2, -3]], ["s", "int64", []]]}),
     "non-negative integers"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32", [True]]]}), "non-negative integers"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32", [2, 3]], ["w", "int64", []]]}),
     "a name twice"),
    (json.dumps({**_GOOD, "tensors": [["w", "float32", [2, 4]], ["s", "int64", []]]}),
     "take 40 bytes, the copy has 32"),
], ids=["not-utf8", "deep", "oversized", "not-object", "params", "triple", "dtype", "nan",
        "negative", "bool", "twice", "sum"])
def test_a_peer_copy_layout_from_the_store_is_checked_before_use(record, problem):
    """The layout is read from the store: anything but one `layout_of` wrote for the copy's
    size is a CheckpointError naming the key (a dtype name went to `getattr(torch, ...)`, a
    NaN or negative shape to the sizes, and a layout whose sizes do not sum to the copy's was
    held as a copy nobody could read)."""
    assert snapshot.read_layout(json.dumps(_GOOD), 32, "KEY") == _GOOD
    with pytest.raises(CheckpointError, match=f"^KEY: .*{problem}"):
        snapshot.read_layout(record, 32, "KEY")


@pytest.mark.parametrize("case", ["float64 weight", "counter past 2^24"])
def test_a_stage_state_that_float32_cannot_hold_is_refused_by_flatten(case):
    """`state.flatten` (a shadow's state on its way back to a worker) casts every tensor to the
    first parameter's dtype: a counter past 2^24 (fp16's loss-scale growth count, with a long
    growth interval) arrived rounded, and a float64 weight's optimizer state lost its low bits,
    silently. Now it is refused, naming the tensor; fp32 state (the only kind spotpipe builds)
    goes as before, exactly."""
    from spotpipe.runtime import state

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    copy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    copy_optimizer = torch.optim.AdamW(copy.parameters())
    state.unflatten(state.flatten(module, optimizer), copy, copy_optimizer)
    assert stage_digest(copy, copy_optimizer) == stage_digest(module, optimizer)
    if case == "float64 weight":
        module[1].double()
        optimizer.state[module[1].weight]["exp_avg"] = torch.full((1, 2), 1 + 2.0 ** -40,
                                                                  dtype=torch.float64)
        name = "parameter 1.weight"
    else:
        optimizer.state[module[0].bias]["growth"] = torch.tensor(2 ** 24 + 1, dtype=torch.int32)
        name = "optimizer state 'growth' of 0.bias"
    with pytest.raises(ValueError, match=f"^{name} .*float32"):
        state.flatten(module, optimizer)


def test_peer_is_the_replica_holder_or_the_next_node():
    layout = Layout.build(3, 1, ["node0", "node1", "node2"])
    assert [peer_of(layout, s) for s in range(3)] == ["node2", "node0", "node1"]
    one_stage = Layout.build(1, 2, ["node0", "node1"])
    assert peer_of(one_stage, 0) == "node1"
    assert peer_of(Layout.build(1, 1, ["node0"]), 0) is None


def test_flatten_round_trip():
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "c": torch.tensor(2.5, dtype=torch.float64)}
    layout = snapshot.layout_of(tensors, ["a"])
    back = snapshot.unflatten(snapshot.flatten(tensors), json.loads(json.dumps(layout)))
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype
               for k in tensors)
    with pytest.raises(CheckpointError, match="bytes"):
        snapshot.unflatten(snapshot.flatten(tensors)[:-1], layout)


# ---------------------------------------------------------------------- safety of the files

def _stage(inputs: int = 3):
    module = torch.nn.Linear(inputs, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(4, inputs)).sum().backward()
    optimizer.step()
    return module, optimizer


def _write(folder: Path, iteration: int, digest: str = "m1") -> Path:
    module, optimizer = _stage()
    snapshot.write_file(folder, snapshot.take(0, iteration, module, optimizer), digest, keep=3)
    return snapshot.file_path(folder, 0, iteration)


def test_a_snapshot_written_before_later_ones_in_its_folder_is_kept(tmp_path):
    """A run gone back to an older iteration in a folder holding later files: at keep = 3 the
    file just written was deleted for the later ones (and its size then read from nothing)."""
    for iteration in (10, 20, 30):
        _write(tmp_path, iteration)
    mine = _write(tmp_path, 15)  # (no FileNotFoundError)
    assert mine.is_file() and snapshot.read_file(mine, "m1").iteration == 15
    names = sorted(p.name for p in (tmp_path / "stage0").glob("iter_*.pt"))
    assert names == ["iter_00000010.pt", "iter_00000015.pt", "iter_00000020.pt",
                     "iter_00000030.pt"]  # later ones neither count nor go
    _write(tmp_path, 16)
    _write(tmp_path, 17)  # the oldest before the one just written goes
    names = sorted(p.name for p in (tmp_path / "stage0").glob("iter_*.pt"))
    assert names == ["iter_00000015.pt", "iter_00000016.pt", "iter_00000017.pt",
                     "iter_00000020.pt", "iter_00000030.pt"]


def test_snapshots_past_iteration_10_to_the_8_are_newer_than_those_before(tmp_path):
    _write(tmp_path, 99_999_999)
    _write(tmp_path, 100_000_000)
    assert snapshot.newest_file(tmp_path, 0, "m1").iteration == 100_000_000
    for iteration in (100_000_001, 100_000_002):
        _write(tmp_path, iteration)  # keep = 3: the oldest, 99999999, goes
    names = sorted(p.name for p in (tmp_path / "stage0").glob("iter_*.pt"))
    assert names == ["iter_100000000.pt", "iter_100000001.pt", "iter_100000002.pt"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "sidecar", "version", "model"])
def test_damaged_snapshot_file_is_named_and_the_previous_one_used(tmp_path, damage):
    _write(tmp_path, 1)
    path = _write(tmp_path, 2)
    side = path.with_suffix(".json")
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        expected = f"{path}: checksum mismatch"
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:20])
        expected = f"{path}: checksum mismatch"
    elif damage == "sidecar":
        side.unlink()
        expected = f"{side}: missing"
    elif damage == "version":
        meta = json.loads(side.read_text())
        side.write_text(json.dumps({**meta, "format_version": 99}))
        expected = f"{side}: format version 99 is not supported"
    else:
        expected = f"{path}: a snapshot of another model"
    digest = "m2" if damage == "model" else "m1"
    with pytest.raises(CheckpointError) as err:
        snapshot.read_file(path, digest)
    assert str(err.value).startswith(expected)
    problems: list[str] = []
    found = snapshot.newest_file(tmp_path, 0, "m1" if damage != "model" else None, problems)
    if damage == "model":
        assert found is not None and found.iteration == 2  # no digest asked: it reads
    else:
        assert found is not None and found.iteration == 1
        assert problems and problems[0].startswith(expected)


class Payload:
    """Not a tensor: a pickle that would run code if unpickled freely."""

    def __reduce__(self):
        return (print, ("unpickled!",))


def test_snapshot_loading_never_unpickles_arbitrary_objects(tmp_path):
    import hashlib

    path = _write(tmp_path, 1)
    torch.save({"format_version": 1, "tensors": {}, "evil": Payload()}, path)
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        snapshot.read_file(path)


def test_resume_of_baseline_snapshots_says_they_are_not_resumable(tmp_path):
    """A run of torch_save or checkfreq leaves committed files that --resume cannot take: it
    said "no committed checkpoint there", or for a file "manifest.json: missing (the
    checkpoint was not committed)", which sends the user looking for a fault."""
    run = tmp_path / "run"
    path = _write(run / "checkpoints_torch_save", 3)
    for given in (run, run / "checkpoints_torch_save", path.parent, path):
        with pytest.raises(CheckpointError) as err:
            durable.resolve(given)
        assert str(err.value).startswith(f"{given}: "), err.value
        assert "baseline checkpoint scheme" in str(err.value), err.value
        assert "checkpoint.scheme durable or dcp_async" in str(err.value)
    with pytest.raises(CheckpointError) as err:  # an empty folder: nothing else is said
        durable.resolve(tmp_path / "empty")
    assert "baseline checkpoint scheme" not in str(err.value)


def test_snapshot_loads_into_a_stage(tmp_path):
    path = _write(tmp_path, 4)
    module, optimizer = torch.nn.Linear(3, 2), None
    optimizer = torch.optim.AdamW(module.parameters())
    snap = snapshot.read_file(path, "m1")
    snapshot.load_into(snap, module, optimizer)
    assert snapshot.fingerprint(snap.tensors, snap.params) == stage_digest(module, optimizer)


# ---------------------------------------------------------------------- configuration

@pytest.mark.parametrize("key,value,message", [
    ("checkpoint.scheme", "torchsave", "checkpoint.scheme: expected one of .* \\(did you mean "
                                       r"'torch_save'\?"),
    ("checkpoint.every", -1, "checkpoint.every: expected an integer >= 0 or 'auto'"),
    ("checkpoint.every", "often", "checkpoint.every: expected an integer >= 0 or 'auto'"),
    ("checkpoint.every", True, "checkpoint.every: expected an integer >= 0 or 'auto'"),
    ("checkpoint.every", 2.5, "checkpoint.every: expected an integer >= 0 or 'auto'"),
    ("checkpoint.keep", 0, "checkpoint.keep: expected an integer >= 1"),
    ("checkpoint.mtbf_s", 0, "checkpoint.mtbf_s: expected a positive number"),
])
def test_bad_checkpoint_config_is_rejected_naming_the_key(corpus, key, value, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(corpus, **{key: value})


def test_gemini_needs_a_second_node(corpus):
    with pytest.raises(ConfigError, match="checkpoint.scheme: 'gemini' .* at least 2 nodes"):
        tiny_config(corpus, **{"checkpoint.scheme": "gemini", "checkpoint.every": 1,
                               "stages": 1, "pipelines": 1})
    tiny_config(corpus, **{"checkpoint.scheme": "gemini", "checkpoint.every": 1, "stages": 2})


# ---------------------------------------------------------------------- failed writes

def _scheme(corpus, tmp_path: Path, scheme: str, said: list, **extra):
    """A scheme as a worker builds it, writing under tmp_path/c, its events in `said`."""
    from spotpipe.checkpoint import registry, schemes

    cfg = tiny_config(corpus, **{"checkpoint.scheme": scheme, "checkpoint.every": 2,
                                 "checkpoint.dir": str(tmp_path / "c"), **extra})
    ctx = schemes.SchemeContext(cfg, "node0", tmp_path,
                                lambda kind, **f: said.append((kind, f)), _Store())
    return registry.build(ctx)


def _boundary(iteration: int, module, optimizer):
    from spotpipe.runtime.hooks import Boundary

    return Boundary(iteration, {0: (module, optimizer)}, None, None, ((0, 1),))


@pytest.mark.parametrize("scheme", ["torch_save", "checkfreq"])
def test_a_full_disk_is_a_failed_checkpoint_and_training_goes_on(tmp_path, corpus, scheme):
    """The file's temporary is /dev/full, the kernel's always-full device: the write fails with
    ENOSPC as on a full disk. It must be a checkpoint_failed naming the cause (torch.save to a
    path said only "unexpected pos", as a RuntimeError that ended the worker and the job),
    leave nothing behind, and the next checkpoint must be written as scheduled."""
    said: list = []
    scheme_ = _scheme(corpus, tmp_path, scheme, said)
    module, optimizer = _stage()
    path = snapshot.file_path(tmp_path / "c", 0, 1)
    path.parent.mkdir(parents=True)
    Path(f"{path}.tmp").symlink_to("/dev/full")
    scheme_.after_iteration(_boundary(1, module, optimizer))
    # (checkfreq's next checkpoint waits for the previous write, and so reports it)
    scheme_.after_iteration(_boundary(3, module, optimizer))
    scheme_.close()
    [(kind, fields), *rest] = said
    assert (kind, fields["iteration"], fields["stage"]) == ("checkpoint_failed", 1, 0)
    assert "No space left on device" in fields["message"] and str(path) in fields["message"]
    assert [(k, f["iteration"]) for k, f in rest] == [("checkpoint_done", 3)]
    # neither the file of iteration 1, its sidecar nor the temporary is left
    assert sorted(p.name for p in path.parent.iterdir()) == ["iter_00000003.json",
                                                              "iter_00000003.pt"]
    assert snapshot.read_file(snapshot.file_path(tmp_path / "c", 0, 3)).iteration == 3


def test_dcp_async_on_a_full_disk_names_the_cause_and_leaves_no_partial(tmp_path, corpus,
                                                                        monkeypatch):
    """DCP's data file of the stage is /dev/full (ENOSPC, as on a full disk): the failure named
    only DCP's wrapper ("CheckpointException ranks:dict_keys([0])"), not the disk, and the
    half-written stage folder stayed, taking space on the disk that is full; the synchronous
    durable scheme removes its own."""
    prepare = durable.prepare_stage_folder

    def on_full_disk(root, iteration, stage):
        folder = prepare(root, iteration, stage)
        (folder / "__0_0.distcp").symlink_to("/dev/full")  # (DCP's one data file here)
        return folder
    monkeypatch.setattr(durable, "prepare_stage_folder", on_full_disk)
    said: list = []
    scheme = _scheme(corpus, tmp_path, "dcp_async", said)
    module, optimizer = _stage()
    scheme.after_iteration(_boundary(1, module, optimizer))
    scheme.close()
    [(kind, fields)] = said
    assert (kind, fields["iteration"], fields["stage"]) == ("checkpoint_failed", 1, 0)
    assert "No space left on device" in fields["message"], fields["message"]
    assert list((tmp_path / "c").iterdir()) == []


class _Lazy:
    """A background write still going on when the loop waits for it: it runs when its result
    is asked for."""

    def __init__(self, job):
        self.job = job

    def done(self):
        return False

    def result(self):
        return self.job()


class _LazyPool:
    def submit(self, job):
        return _Lazy(job)

    def shutdown(self, wait=True):
        pass


def test_a_failed_background_write_counts_the_loop_wait_once(tmp_path, corpus, monkeypatch):
    """On a clock that moves only when the write does, a write that takes 5 s and fails is
    waited for once, at close: the loop was blocked 5 s. A failure added its wait to the total
    a second time, on top of the call's own span (10 s), and the benches read that total."""
    import errno
    import types

    from spotpipe.checkpoint import schemes

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(schemes, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                               time=lambda: clock.now))

    def full(*args, **kwargs):
        clock.now += 5.0
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(snapshot, "write_file", full)
    said: list = []
    scheme = _scheme(corpus, tmp_path, "checkfreq", said)
    scheme._thread = _LazyPool()
    module, optimizer = _stage()
    scheme.after_iteration(_boundary(1, module, optimizer))
    scheme.close()
    assert [(k, f["iteration"]) for k, f in said] == [("checkpoint_failed", 1)]
    assert scheme.blocked_s == 5.0


def test_checkfreq_persists_the_boundary_state_though_the_optimizer_went_on(tmp_path, corpus):
    """The persist runs only after three more optimizer steps (in place) on the live stage:
    the file must hold the state at the boundary, bit for bit, so the snapshot is a copy."""
    said: list = []
    scheme = _scheme(corpus, tmp_path, "checkfreq", said)
    scheme._thread = _LazyPool()
    module, optimizer = _stage()
    scheme.after_iteration(_boundary(1, module, optimizer))
    want = stage_digest(module, optimizer)
    for _ in range(3):
        module(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    assert stage_digest(module, optimizer) != want
    scheme.close()
    assert [(k, f["iteration"]) for k, f in said] == [("checkpoint_done", 1)]
    snap = snapshot.read_file(snapshot.file_path(tmp_path / "c", 0, 1))
    assert snapshot.fingerprint(snap.tensors, snap.params) == want


def test_snapshot_files_are_flushed_to_the_disk_before_their_renames(tmp_path, monkeypatch):
    """A rename is atomic, but without an fsync of the data first a crash can leave the new
    name on a file whose blocks never reached the disk; the folder is fsynced after, so the
    renames themselves survive."""
    import os

    seen: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append("fsync " + Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    def replace(src, dst):
        seen.append(f"rename {Path(src).name}")
        real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _write(tmp_path, 7)
    assert seen == ["fsync iter_00000007.pt.tmp", "rename iter_00000007.pt.tmp",
                    "fsync iter_00000007.json.tmp", "rename iter_00000007.json.tmp",
                    "fsync stage0"]


# ---------------------------------------------------------------------- across a failover

@pytest.mark.parametrize("scheme", ["gemini", "dcp_async"])
def test_schemes_go_on_exactly_after_a_takeover(tmp_path, corpus, scheme):
    """node2 crashes in iteration 3 of a P = 3 job: node1 takes stage 2 over and from then on
    writes both; gemini's copy of stage 2 moves to node0 (node1 is the writer now)."""
    from spotpipe.faults import Fault

    # the carrier keeps both stages (no re-partition), so the copies keep their layout
    cfg = tiny_config(corpus, **{**RUN, "stages": 3, "redundancy": "lazy", "checkpoint.every": 1,
                                 "checkpoint.scheme": scheme, "failover.heartbeat_s": 0.2,
                                 "failover.heartbeat_timeout_s": 3.0,
                                 "failover.repartition": False})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False,
                 faults=[Fault("fail", "node2", 3, "backward")]) == 0
    want = owner_digests(run)
    assert [e["promoted"] for e in events(run, "takeover")] == [[2]]
    if scheme == "gemini":
        held = {(e["iteration"], e["stage"]): e for e in events(run, "checkpoint_held")}
        assert {t for t, _ in held} == {0, 1, 2, 3, 4, 5}  # the in-flight 3 is replayed
        assert held[(5, 2)]["node"] == "node0" and held[(5, 2)]["writer"] == "node1"
        assert held[(1, 2)]["node"] == "node1" and held[(1, 2)]["writer"] == "node2"
        for key, e in held.items():
            assert e["digest"] == want[key], key
    else:
        newest = durable.newest(run / "checkpoints")
        assert newest is not None and newest.manifest["iteration"] == 5
        for s in range(3):
            assert _load_durable(cfg, newest.path, s) == want[(5, s)]


def test_a_baseline_write_that_fails_does_not_cost_the_shadows_their_checkpoint(tmp_path,
                                                                              corpus):
    """With shadows the durable tier is theirs, and a baseline scheme may run in the workers
    beside it, on files of its own. node0's torch_save write of iteration 1 fails (ENOSPC):
    the launcher dropped the shadows' checkpoint of iteration 1 too, though both its stages
    were written; only the baseline's file is lost."""
    from spotpipe.faults import Fault

    cfg = tiny_config(corpus, **{**RUN, "iterations": 4, "logging.state_digests": False,
                                 "checkpoint.scheme": "torch_save", "shadow.enabled": True})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False,
                 faults=[Fault("ioerror", "node0", 1, "checkpoint")]) == 0
    failed = [(e["node"], e["iteration"], e.get("scheme"))
              for e in events(run, "checkpoint_failed")]
    assert failed == [("node0", 1, "torch_save")]
    assert sorted(e["iteration"] for e in events(run, "checkpoint_committed")) == [1, 3]


# ---------------------------------------------------------------------- durable tier: the gaps
# (tests/test_checkpoint.py covers a flipped byte, a truncated shard, a deleted manifest,
# another model and another format version on real runs)

def _committed(root: Path, iteration: int) -> Path:
    module, optimizer = _stage()
    sums = durable.save_stage(root, iteration, 0, module, optimizer)
    return durable.commit(root, iteration, {"partition": [[0, 1]]}, sums, keep=5, key=KEY)


def test_durable_deleted_shard_and_bad_manifest_are_named(tmp_path):
    _committed(tmp_path, 1)
    newest = _committed(tmp_path, 2)
    shard = next(newest.rglob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: missing"):
        durable.verify(newest)
    (newest / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: not valid JSON"):
        durable.verify(newest)
    problems: list[str] = []
    assert durable.newest(tmp_path, problems).manifest["iteration"] == 1
    assert "not valid JSON" in problems[0]


def test_durable_nothing_valid_left_is_refused_naming_each_problem(tmp_path):
    for t in (1, 2):
        (_committed(tmp_path, t) / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="nothing to resume from") as err:
        durable.resolve(tmp_path)
    assert str(err.value).count("manifest.json: missing") == 2


def test_uncommitted_partial_folder_is_never_taken(tmp_path):
    _committed(tmp_path, 1)
    module, optimizer = _stage()
    durable.save_stage(tmp_path, 2, 0, module, optimizer)  # written, never committed
    assert durable.newest(tmp_path).manifest["iteration"] == 1


def test_shadows_take_the_durable_tier_over(corpus):
    from spotpipe.checkpoint import registry, schemes

    for scheme, built in (("durable", "none"), ("dcp_async", "none"), ("gemini", "gemini")):
        cfg = tiny_config(corpus, **{"checkpoint.scheme": scheme, "checkpoint.every": 2,
                                     "shadow.enabled": True, "stages": 2})
        ctx = schemes.SchemeContext(cfg, "node0", Path("unused"), lambda *a, **k: None,
                                    _Store())
        assert registry.build(ctx).name == built
    with pytest.raises(ConfigError, match="checkpoint.every: 'auto' is not supported with "
                                          "shadow.enabled"):
        tiny_config(corpus, **{"checkpoint.every": "auto", "shadow.enabled": True})


class _FailingStore:
    """A sealed store whose writes fail after the first (a store lost half-way)."""

    def __init__(self, inner):
        self.inner, self.writes = inner, 0

    def set(self, key, value):
        self.writes += 1
        if self.writes > 2:  # (the file list and a first piece go)
            raise RuntimeError("the store refused the piece")
        self.inner.set(key, value)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("fail", [False, True])
def test_an_upload_runs_beside_training_and_is_reported_once_taken(tmp_path, corpus, fail):
    """A host that does not see the committing host's folder sends its stage through the store
    on the uploader's thread: the loop announces it (`checkpoint_upload`, on which the
    committing host starts taking it) and goes on while it travels; the stage is reported (and
    so committed) only once all of it has been taken, then removed here. A store that fails
    makes it a checkpoint_failed, never a saved one, and leaves nothing in the store."""
    from datetime import timedelta

    import torch.distributed as dist

    from spotpipe.checkpoint import registry, schemes, transfer
    from spotpipe.runtime.hooks import Boundary
    from spotpipe.store.sealed import SealedStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    store = SealedStore(server, b"k" * 32)
    cfg = tiny_config(corpus, **{"checkpoint.every": 2, "checkpoint.dir": str(tmp_path / "c"),
                                 "cluster.timeout_s": 30.0})
    said: list[tuple[str, dict]] = []

    def connect():  # the uploader's own connection (a client blocked in a wait serves no one)
        own = SealedStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                        timeout=timedelta(seconds=30)), b"k" * 32)
        return _FailingStore(own) if fail else own
    ctx = schemes.SchemeContext(cfg, "node1", tmp_path, lambda kind, **f: said.append((kind, f)),
                                _Store(), upload=True, upload_store=connect)
    scheme = registry.build(ctx)
    module, optimizer = _stage()
    assert scheme.cadence.due(1) and not scheme.cadence.due(2)
    scheme.after_iteration(Boundary(1, {1: (module, optimizer)}, None, None, ((0, 1), (1, 2))))
    [(kind, announced)] = said
    assert (kind, announced["iteration"], announced["stage"]) == ("checkpoint_upload", 1, 1)
    partial = durable.iter_dir(tmp_path / "c", 1, partial=True)
    if not fail:
        # nobody takes the pieces yet: the sender waits (its file list is out), the loop not
        server.wait([transfer.Stream.checkpoint(1, 1).meta], timedelta(seconds=30))
        scheme.after_iteration(Boundary(2, {1: (module, optimizer)}, None, None,
                                        ((0, 1), (1, 2))))
        assert len(said) == 1 and (partial / "stage1").is_dir()
        got = tmp_path / "got"
        assert transfer.receive_stage(store, 1, 1, announced["checksums"], got,
                                      timeout_s=30) == ""
        assert durable.stage_checksums(got / "stage1", 1) == announced["checksums"]
    scheme.close()
    assert not (partial / "stage1").exists()  # sent (or given up): not kept here
    left = [k for k in ("meta", "verdict", "0", "1", "ack0") if
            server.check([transfer.Stream.checkpoint(1, 1).key(k)])]
    if fail:
        assert [(k, f["iteration"], f["stage"]) for k, f in said[1:]] == \
            [("checkpoint_failed", 1, 1)]
        assert "the store refused the piece" in said[1][1]["message"]
        # the list and the piece that went are taken back (the stop the sender would leave
        # for a receiver in the next piece's place is refused too, by this failing store)
        assert left == [], left
        return
    assert left == []
    [(kind, fields)] = said[1:]
    assert (kind, fields["iteration"], fields["stage"], fields["uploaded"]) == \
        ("checkpoint_saved", 1, 1, True)
    assert fields["checksums"] == announced["checksums"]


@pytest.mark.parametrize("scheme", ["torch_save", "checkfreq", "dcp_async"])
def test_a_baseline_without_checksums_writes_as_its_system_does(tmp_path, corpus, scheme,
                                                                monkeypatch):
    """bench checkpoint's baselines (`Scheme.checksums` false) write what torch.save,
    CheckFreq or DCP write, and hash nothing: spotpipe's SHA-256 of every file (for its commit
    and safe resume) would be a cost the baseline systems do not pay."""
    from spotpipe.checkpoint import registry, schemes
    from spotpipe.runtime.hooks import Boundary

    def hashed(path):
        raise AssertionError(f"{path} hashed")

    monkeypatch.setattr(snapshot, "sha256_file", hashed)
    monkeypatch.setattr(durable, "sha256_file", hashed)
    cfg = tiny_config(corpus, **{"checkpoint.scheme": scheme, "checkpoint.every": 1,
                                 "checkpoint.keep": 2, "checkpoint.dir": str(tmp_path / "c")})
    ctx = schemes.SchemeContext(cfg, "node0", tmp_path, lambda *a, **k: None, _Store())
    built = registry.build(ctx)
    built.checksums = False
    module, optimizer = _stage()
    for t in range(3):
        built.after_iteration(Boundary(t, {0: (module, optimizer)}, None, None,
                                       ((0, 1), (1, 2))))
    built.close()
    assert [(r["kind"], r["iteration"]) for r in built.records] == [
        ("checkpoint_saved" if scheme == "dcp_async" else "checkpoint_done", t)
        for t in range(3)]
    assert all(r["bytes"] > 0 for r in built.records) and built.bytes > 0
    if scheme != "dcp_async":  # the newest `keep` files, and no sidecar beside them
        assert sorted(p.name for p in (tmp_path / "c" / "stage0").iterdir()) == [
            "iter_00000001.pt", "iter_00000002.pt"]
