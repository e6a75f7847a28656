"""CPU shadows: a checkpoint of every iteration, and recovery when no replica survives.

The shadow of a stage applies the writer's final gradients; its state must equal the owner's
after every committed iteration, bit for bit, and it must restore lost stages so exactly that
the run ends with the failure-free parameters.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.checkpoint import durable
from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault

from conftest import tiny_config
from test_failover import (FAST, assert_nothing_left, assert_samples_exactly_once, events,
                           failure_free, store_port)


def state_digests(run):
    """(role, stage, iter) -> set of (params, optimizer) digests across nodes and shadows."""
    out = defaultdict(set)
    for path in (run / "logs").glob("digests.*.jsonl"):
        for line in open(path):
            r = json.loads(line)
            if "params" in r:
                out[(r["role"], r["stage"], r["iter"])].add((r["params"], r["optim"]))
    return out


@pytest.mark.parametrize("stages,pipelines,redundancy,optimizer", [
    (3, 1, "lazy", "adamw"), (2, 2, "none", "sgd")])
def test_shadow_equals_the_owner_after_every_iteration(tmp_path, corpus, stages, pipelines,
                                                       redundancy, optimizer):
    cfg = tiny_config(corpus, stages=stages, pipelines=pipelines, redundancy=redundancy,
                      iterations=5, **{"shadow.enabled": True, "logging.state_digests": True,
                                       "optimizer.name": optimizer, "optimizer.momentum": 0.9,
                                       "checkpoint.every": 2})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False) == 0
    seen = state_digests(run)
    for t in range(cfg.iterations):
        for s in range(stages):
            owner, shadow = seen[("owner", s, t)], seen[("shadow", s, t)]
            assert len(owner) == 1 and len(shadow) == 1, (s, t)
            assert shadow == owner, f"shadow of stage {s} differs from its owner after {t}"
    assert seen[("shadow", 0, 0)] != seen[("shadow", 0, cfg.iterations - 1)]
    # the durable checkpoints came from the shadows, not from the workers
    saved = [e for e in events(run) if e["kind"] == "checkpoint_saved"]
    assert saved and all(e["node"].startswith("shadow") for e in saved)
    committed = [e["iteration"] for e in events(run) if e["kind"] == "checkpoint_committed"]
    assert committed == [1, 3]
    newest = durable.newest(run / "checkpoints")
    assert newest is not None and newest.next_iteration == 4
    done = [e for e in events(run) if e["kind"] == "shadow_done"]
    assert sorted(e["stage"] for e in done) == list(range(stages))
    assert all(e["iteration"] == cfg.iterations - 1 for e in done)
    # the receiving thread moved messages at the lowest weight, not at idle priority (beside
    # CPU-bound processes an idle one could not open its links) and not at the workers' weight
    # (a message's wake-up would preempt a co-located writer)
    assert all(e["receiver_nice"] == 19 for e in done), done
    # shadows change nothing in training
    got = load_file(str(run / "final" / "model.safetensors"))
    plain = tmp_path / "plain"
    assert train(tiny_config(corpus, stages=stages, pipelines=pipelines, iterations=5,
                             **{"optimizer.name": optimizer, "optimizer.momentum": 0.9}),
                 plain, progress=False) == 0
    want = load_file(str(plain / "final" / "model.safetensors"))
    for key in want:
        assert torch.equal(got[key], want[key]), key


CASES = [
    # id, P, redundancy, faults
    ("adjacent-P4", 4, "lazy", ["node1@2:forward", "node2@2:forward"]),
    ("adjacent-wrap-P3", 3, "eager", ["node2@2:backward", "node0@2:backward"]),
    ("no-replicas-P2", 2, "none", ["node1@3:all-reduce"]),
    # killed after the commit, before its COMMIT message: the new writer brings the clipping
    # scale, the shadow applies the pending gradient with it
    ("no-replicas-committed-P2", 2, "none", ["node1@3:optimizer"]),
]


@pytest.mark.parametrize("stages,redundancy,faults", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_lost_stages_without_replica_are_restored_from_shadows(tmp_path, tmp_path_factory,
                                                               corpus, stages, redundancy,
                                                               faults):
    cfg = tiny_config(corpus, stages=stages, pipelines=1, redundancy=redundancy,
                      **{**FAST, "shadow.enabled": True})
    nodes = [f"node{r}" for r in range(stages)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False,
                 faults=[Fault.parse("fail", f, nodes) for f in faults]) == 0
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=stages, pipelines=1,
                                                      **FAST))
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the failure-free run"
    assert_samples_exactly_once(run, cfg)
    evs = events(run)
    # the second loss may land before or after the first one's failover: either way some
    # stage ends up without a live replica and comes back from its shadow
    plans = [e for e in evs if e["kind"] == "plan"]
    assert {p["action"] for p in plans} <= {"failover", "restore_from_shadow"}
    restore = next(p for p in plans if p["action"] == "restore_from_shadow")
    restored = [e for e in evs if e["kind"] == "shadow_restored"]
    assert restored and all(e["iteration"] == restore["resume"] - 1 for e in restored)
    # at most the in-flight iteration is lost: the job resumes right after the last commit
    agreement = next(e for e in evs if e["kind"] == "agreement")
    first_fault = min(int(f.split("@")[1].split(":")[0]) for f in faults)
    assert agreement["resume"] >= first_fault
    if all(f.endswith(":optimizer") for f in faults):  # committed, its COMMIT never sent
        # (a race the test cannot close: the killed node's norm gather returned, while the
        # survivor's had not yet received its part, which the kill discards with the socket;
        # then the survivor never committed the iteration and the job replays it, which is
        # as exact: the parameters were compared above)
        settled = [e["iteration"] for e in evs if e["kind"] == "shadow_settled"]
        assert agreement["resume"] in (first_fault, first_fault + 1)
        assert agreement["resume"] == first_fault or settled == [first_fault]
    assert_nothing_left(run, store_port(run))


def test_every_pipeline_broken_is_restored_from_shadows(tmp_path, tmp_path_factory, corpus):
    """P=2 x D=2 without redundancy, both pipelines' stage 1 killed at the same instant (a
    replayed trace, so the launcher kills both at once): no pipeline survives to drop the
    other, so pipeline 0's lost stage comes back from its shadow and pipeline 1's is copied
    from it; D stays 2, so the result is the failure-free run's, bit for bit."""
    from spotpipe.cluster.trace_replay import replay_actions
    from spotpipe.sim.traces import load_trace

    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n1500,remove,b\n1500,remove,d\n")
    extra = {**FAST, "iterations": 200}
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="none",
                      **{**extra, "shadow.enabled": True})
    actions = replay_actions(load_trace(trace), [f"node{r}" for r in range(4)], 1.0)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, trace_actions=actions) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan"]
    agreement = next(e for e in evs if e["kind"] == "agreement")
    assert agreement["lost"] == ["node1", "node3"], agreement  # one agreement, both lost
    assert [p["action"] for p in plans] == ["restore_from_shadow"]
    moves = {(m["pipeline"], m["stage"]): m["dst"] for m in plans[0]["moves"]}
    assert moves == {(0, 1): "node0", (1, 1): "node2"}
    assert any(e["kind"] == "shadow_restored" for e in evs)
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=2, **extra))
    got = load_file(str(run / "final" / "model.safetensors"))
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the failure-free run"
    assert_samples_exactly_once(run, cfg)
    assert_nothing_left(run, store_port(run))


def test_shadows_write_checkpoints_that_resume_onto_another_depth(tmp_path, corpus):
    """Checkpoints written by the shadows of a P=4 run resume a P=2 run with shadows, which
    load it too, and the result is the uninterrupted run's, bit for bit."""
    from test_checkpoint import SAVE
    from test_equivalence import reference

    saved = tmp_path / "saved"
    assert train(tiny_config(corpus, stages=4, pipelines=1, **SAVE, **{"shadow.enabled": True}),
                 saved, progress=False) == 0
    iters = {**SAVE, "checkpoint.every": 0, "shadow.enabled": True,
             "logging.state_digests": True}
    resumed = tmp_path / "resumed"
    assert train(tiny_config(corpus, stages=2, pipelines=1, **iters), resumed, progress=False,
                 resume=saved / "checkpoints" / "iter_00000005") == 0
    ready = [e for e in events(resumed) if e["kind"] == "shadow_ready"]
    assert sorted(e["iteration"] for e in ready) == [5, 5]
    seen = state_digests(resumed)
    assert all(seen[("shadow", s, 7)] == seen[("owner", s, 7)] for s in range(2))
    got = load_file(str(resumed / "final" / "model.safetensors"))
    want, _ = reference(tiny_config(corpus, pipelines=1, **{**SAVE, "checkpoint.every": 0}))
    assert all(torch.equal(got[k], want[k]) for k in want)


def _one_shadow_setup(corpus, monkeypatch, **overrides):
    """What a shadow run in the test's own process needs: the job's config (with shadows), its
    run spec, and a way to open a connection to a fresh store (the job's key from the
    environment, as the launcher gives it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from spotpipe import job
    from spotpipe.protocol.auth import new_instance_id

    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "t")
    monkeypatch.setenv("SPOTPIPE_INSTANCE", new_instance_id())
    cfg = tiny_config(corpus, **{"shadow.enabled": "true", **overrides})
    model = job.build_model(cfg)
    profile = job.profile_model(cfg, model, job.build_dataset(cfg))
    spec = job.RunSpec(job.compute_partition(cfg, profile), 64, profile)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def connect():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                             timeout=timedelta(seconds=30))

    return cfg, spec, connect  # (which holds the server)


def _shadow_running(cfg, spec, connect, tmp_path):
    """A shadow of stage 0 serving on a thread of the test's process: the shadow, its thread,
    a queue of the links it gives up (`shadow_link_lost` events) and what its run raised."""
    import queue
    import threading

    from spotpipe.checkpoint.shadow import Shadow

    shadow = Shadow(cfg, spec, tmp_path, 0, connect(), 0.0, link_store=connect())
    lost: queue.Queue = queue.Queue()
    told = shadow.channel.event

    def event(kind, **details):
        if kind == "shadow_link_lost":
            lost.put(details)
        told(kind, **details)

    shadow.channel.event = event
    ended: list[BaseException] = []

    def run():
        try:
            shadow.run()
        except BaseException as exc:
            ended.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return shadow, runner, lost, ended


def test_a_shadow_between_writers_marks_what_it_applies(tmp_path, corpus, monkeypatch):
    # Between two writers the shadow's main thread waits for the next link; its applier goes
    # on stepping the backlog, and a writer's max_lag wait reads the marks it sets. Were the
    # wait on the applier's connection, those marks would queue behind it until a writer came
    # (a TCPStore client serves one request at a time).
    import threading
    from datetime import timedelta


    from spotpipe.checkpoint.shadow import Shadow
    from spotpipe.runtime.shadow_link import applied_key, link_key

    cfg, spec, connect = _one_shadow_setup(corpus, monkeypatch)

    class Waiting:
        """The link connection, telling when the shadow's main thread waits on it."""

        def __init__(self, inner):
            self.inner, self.entered = inner, threading.Event()

        def wait(self, keys, timeout):
            self.entered.set()
            return self.inner.wait(keys, timeout)

    links = Waiting(connect())
    shadow = Shadow(cfg, spec, tmp_path, 0, connect(), 0.0, link_store=links)
    ended: list[BaseException] = []

    def run():
        try:
            shadow.run()
        except BaseException as exc:  # the record below ends it
            ended.append(exc)

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    assert links.entered.wait(timeout=30)  # waiting for its first writer
    shadow._submit(0, torch.ones(shadow.grad_size), torch.tensor(1.0))
    # the mark lands while no writer has come
    connect().wait([applied_key("spotpipe", 0, 0)], timedelta(seconds=20))
    # no writer will come: a sealed record that does not parse ends the shadow
    shadow.sealed.set(link_key("spotpipe", 0, 1), "not json")
    waiter.join(timeout=30)
    assert not waiter.is_alive() and isinstance(ended[0], ValueError)


class _GoneWriter:
    """A pair group whose peer has gone: gloo raises when an operation is posted (the
    connection closed between two messages) or when it is waited for."""

    def __init__(self, at: str) -> None:
        self.at = at

    def recv(self, tensors, rank, tag):
        if self.at == "post":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return self

    def wait(self):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:589] Read error: Connection reset")


@pytest.mark.parametrize("at", ["post", "wait"])
def test_a_writer_gone_between_messages_breaks_the_link_not_the_shadow(at):
    """The shadow posts the next gradient's receive ahead; a writer killed between two
    messages makes gloo raise right at that post. Both ways are a broken link (the shadow
    waits for the next writer), never the shadow's failure (which failed the job: a CI run's
    adjacent-P4 case above)."""
    from types import SimpleNamespace

    from spotpipe.checkpoint.shadow import LinkBroken, Shadow

    me = SimpleNamespace(grad_size=4)
    with pytest.raises(LinkBroken, match="Connection"):
        work, buffer = Shadow._post_gradient(me, _GoneWriter(at))  # type: ignore[arg-type]
        Shadow._wait(me, work, buffer)  # type: ignore[arg-type]


class _WriterDiesAfterAGradient:
    """A writer that says HELLO, sends iteration 3's gradient and is gone: the post of the
    receive for the gradient after it raises (gloo, a closed connection)."""

    def __init__(self) -> None:
        from spotpipe.runtime.shadow_link import GRAD, HELLO, header

        self.headers = [header(HELLO, 3), header(GRAD, 3, 4)]
        self.grads = 0

    def recv(self, tensors, rank, tag):
        from spotpipe.runtime.shadow_link import GRAD_TAG

        if tag == GRAD_TAG:
            self.grads += 1
            if self.grads > 1:
                raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
            tensors[0].fill_(0.5)
        else:
            tensors[0].copy_(self.headers.pop(0))
        return self

    def send(self, tensors, rank, tag):
        return self

    def wait(self):
        return None


def test_a_gradient_received_just_before_the_writer_died_stays_pending():
    """The gradient of the iteration in flight is kept (pending its commit) before the next
    receive is posted: when that post raises because the writer died, the new writer's HELLO
    applies it if the survivors committed that iteration. Kept after the post, it was lost,
    and the job stopped with "the shadow of stage 1 holds iteration 2, but the job resumes at
    iteration 4" (a loaded run of tests/test_reshape_failures.py)."""
    from types import SimpleNamespace

    from spotpipe.checkpoint.shadow import LinkBroken, Shadow

    shadow = Shadow.__new__(Shadow)
    shadow.stage, shadow.grad_size, shadow.pending = 1, 4, None
    shadow.max_lag_seen, shadow.submitted = 0, 2
    shadow.applier = SimpleNamespace(applied=2, drain=lambda: None)
    with pytest.raises(LinkBroken, match="Connection closed"):
        shadow._serve(_WriterDiesAfterAGradient())
    assert shadow.pending is not None and shadow.pending.iteration == 3
    assert torch.equal(shadow.pending.flat, torch.full((4,), 0.5))


class _ScriptedWriter:
    """A pair group whose writer says `script`, (header, gradient or None) pairs, and is then
    gone; like gloo, a receive takes a shorter message (its tail stays as it was)."""

    def __init__(self, script) -> None:
        self.script, self.grads, self.said = list(script), [], []

    def recv(self, tensors, rank, tag):
        from spotpipe.runtime.shadow_link import GRAD_TAG

        if tag == GRAD_TAG:
            return SimpleNamespace(wait=lambda: self._fill(tensors[0]))
        if not self.script:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        head, grad = self.script.pop(0)
        tensors[0].copy_(head)
        if grad is not None:
            self.grads.append(grad)
        return SimpleNamespace(wait=lambda: None)

    def _fill(self, buffer) -> None:
        if not self.grads:  # (the receive posted ahead, on a link that is gone)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:589] Read error: Connection reset")
        grad = self.grads.pop(0)
        buffer[: grad.numel()] = grad

    def send(self, tensors, rank, tag):
        self.said.append(tensors[0].clone())
        return SimpleNamespace(wait=lambda: None)


def _bare_shadow(events: list, submitted: list):
    """A shadow of stage 1 with a 4-value gradient, clipping on, that holds iteration 2, its
    writer node7; its applier records what it is given."""
    from spotpipe.checkpoint.shadow import Shadow

    shadow = Shadow.__new__(Shadow)
    shadow.stage, shadow.grad_size, shadow.num_params, shadow.pending = 1, 4, 1, None
    shadow.max_lag_seen, shadow.submitted, shadow.writer = 0, 2, "node7"
    shadow.cfg = SimpleNamespace(precision="fp32", optimizer=SimpleNamespace(grad_clip=1.0))
    shadow.channel = SimpleNamespace(event=lambda kind, **details: events.append(kind))
    shadow.applier = SimpleNamespace(
        applied=2, drain=lambda: None,
        submit=lambda t, kind, flat, scale=None: submitted.append((t, kind, scale)))
    return shadow


def _message(kind, t=0, arg=0, scale=None, grad=None):
    from spotpipe.runtime.shadow_link import header

    return header(kind, t, arg, scale), grad


@pytest.mark.parametrize("bad,refusal", [
    ("short", r"gradient of iteration 3 has 3 values, the stage's has 4"),
    ("inf", r"clipping scale inf, not in \[0, 1\]"),
    ("negative", r"clipping scale -0.5, not in \[0, 1\]"),
    ("kind", r"unknown message kind 9"), ("hello", r"a second HELLO on the link")])
def test_a_shadow_refuses_a_message_that_breaks_the_protocol_naming_its_writer(bad, refusal):
    """Gloo takes a shorter message into a receive: a gradient short of the stage's was
    applied, its tail and presence flags whatever the buffer held. A clipping scale of inf
    made every parameter non-finite in one step. A second HELLO posted the gradient's receive
    again, the first left pending. Each is refused, naming the stage and the writer, before
    anything is applied (the shadow stops; the job stops with its message)."""
    from spotpipe.runtime.shadow_link import COMMIT, GRAD, HELLO

    events, submitted = [], []
    shadow = _bare_shadow(events, submitted)
    whole = torch.full((4,), 0.5)
    script = {
        "short": [_message(GRAD, 3, 3, grad=whole[:3])],
        "inf": [_message(GRAD, 3, 4, grad=whole), _message(COMMIT, 3, scale=float("inf")),
                _message(GRAD, 4, 4, grad=whole)],
        "negative": [_message(GRAD, 3, 4, grad=whole), _message(COMMIT, 3, scale=-0.5),
                     _message(GRAD, 4, 4, grad=whole)],
        "kind": [_message(9, 3)], "hello": [_message(HELLO, 3)]}[bad]
    with pytest.raises(RuntimeError, match=rf"shadow of stage 1: .*{refusal} \(writer node7\)"):
        shadow._serve(_ScriptedWriter([_message(HELLO, 3)] + script))
    assert submitted == [] and shadow.submitted == 2


class _WriterThatSendsNoGradient(_ScriptedWriter):
    """A live writer between gradients: the gradient's receive posted ahead completes only
    when it sends one (here: never; a wait on it is recorded, and held for 5 s)."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.waited_for_gradient = 0

    def _fill(self, buffer) -> None:
        self.waited_for_gradient += 1
        threading.Event().wait(5)


@pytest.mark.parametrize("bad", ["kind", "hello"])
def test_a_refusal_does_not_wait_for_the_gradient_receive_posted_ahead(bad):
    """A refusal with a gradient's receive posted ahead first waited for that receive, which
    completes only when the writer sends its next gradient (up to cluster.timeout_s): the
    shadow's stop, and the job's, waited as long. The shadow now stops at once (it leaves by
    os._exit, so the pending receive's group is never destroyed)."""
    from spotpipe.runtime.shadow_link import HELLO

    shadow = _bare_shadow([], [])
    writer = _WriterThatSendsNoGradient([_message(HELLO, 3),
                                         _message(9 if bad == "kind" else HELLO, 3)])
    with pytest.raises(RuntimeError, match=r"shadow of stage 1: .*\(writer node7\)"):
        shadow._serve(writer)
    assert writer.waited_for_gradient == 0


def test_a_hello_resuming_where_no_writer_can_leaves_the_shadow_as_it_was():
    """A shadow holds iteration 3's committed gradient when its writer is lost; a HELLO that
    resumes far ahead (a writer out of step: it refuses the ACK) dropped that gradient, and
    the survivors' writer, resuming at 4, then found the shadow at 2 and stopped the job. It
    settles nothing now: the next writer's HELLO applies iteration 3 with its scale."""
    from spotpipe.checkpoint.shadow import LinkBroken
    from spotpipe.runtime.shadow_link import COMMIT, GRAD, HELLO

    events, submitted = [], []
    shadow = _bare_shadow(events, submitted)
    lost = _ScriptedWriter([_message(HELLO, 3), _message(GRAD, 3, 4, grad=torch.ones(4)),
                            _message(COMMIT, 3, scale=0.25)])
    stray = _ScriptedWriter([_message(HELLO, 50)])
    survivor = _ScriptedWriter([_message(HELLO, 4)])
    for writer in (lost, stray, survivor):
        with pytest.raises(LinkBroken):
            shadow._serve(writer)
    assert [int(ack[1]) for ack in stray.said] == [2]  # (the writer refuses: not 49)
    assert "shadow_refused" in events
    assert [(t, kind, float(scale)) for t, kind, scale in submitted] == [(3, "grad", 0.25)]


def test_a_restore_refuses_a_state_not_of_the_stages_size(monkeypatch):
    """A node restoring a stage receives the shadow's state into a buffer of its own stage's
    size; gloo takes a shorter message into it, and the module was loaded with a tail the
    shadow never sent. The ACK says the state's size now, and a mismatch loads nothing."""
    from spotpipe.runtime import shadow_link
    from spotpipe.runtime.shadow_link import ACK, ShadowError, ShadowWriter, header, state_size

    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    size = state_size(module, optimizer)
    shadows = [header(ACK, 4, size - 2), torch.full((size - 2,), 7.0)]  # two values short

    def recv(tensors, rank, tag):
        sent = shadows.pop(0)
        tensors[0][: sent.numel()] = sent
        return SimpleNamespace(wait=lambda: None)

    group = SimpleNamespace(recv=recv, send=lambda *a: SimpleNamespace(wait=lambda: None))
    monkeypatch.setattr(shadow_link, "pair_group", lambda *args: group)
    store = SimpleNamespace(add=lambda key, n: 1, set=lambda key, value: None,
                            rendezvous=lambda timeout_s: None)
    writer = ShadowWriter(store, "spotpipe", "node3", max_lag=1, timeout_s=1)
    before = [p.clone() for p in module.parameters()]
    with pytest.raises(ShadowError, match=rf"stage 2 holds a state of {size - 2} values, "
                                          rf"node3's stage has {size}: nothing restored"):
        writer.relink({2: (module, optimizer)}, 5, {2})
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_a_shadow_that_dies_ends_the_job_naming_it(tmp_path, corpus):
    """A shadow runs beside the coordinator, on the host the job cannot lose, and holds the
    only copy of its stage that survives every pipeline losing it: one that dies there is a
    fault of that host's software, so the job stops at once (exit 1), naming the shadow and
    its log, with its workers and the store's port let go, rather than training on without
    the copy a later loss would need."""
    import os
    import signal
    import threading

    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 2000, "shadow.enabled": True})
    run = tmp_path / "run"
    log = (run / "logs" / "shadow1.log").resolve()
    killed: list[int] = []
    stop = threading.Event()

    def kill_once_training() -> None:
        """SIGKILL shadow1's process once the job has trained 3 iterations (it is found by
        its output, which goes to its log)."""
        metrics = run / "metrics.jsonl"
        while not stop.is_set():
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) >= 3:
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        if Path(os.readlink(f"/proc/{pid}/fd/1")) == log:
                            os.kill(int(pid), signal.SIGKILL)
                            killed.append(int(pid))
                            return
                    except OSError:  # gone meanwhile, or not ours
                        continue
            stop.wait(0.02)

    killer = threading.Thread(target=kill_once_training, daemon=True)
    killer.start()
    try:
        code = train(cfg, run, progress=False)
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "shadow1 was never found running"
    assert code == 1
    ev = events(run)
    assert [(e["node"], e["returncode"]) for e in ev if e["kind"] == "shadow_failed"] == [
        ("shadow1", -signal.SIGKILL)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["iterations"] < cfg.iterations
    assert summary["message"] == (f"shadow1 failed: exited with code {-signal.SIGKILL} "
                                  f"(log: {run}/logs/shadow1.log)"), summary["message"]
    assert ev[-1]["kind"] == "job_failed"
    assert_nothing_left(run, store_port(run))


@pytest.mark.parametrize("clip", [0.5, 0.0], ids=["clipped", "unclipped"])
def test_a_skipped_step_whose_commit_message_was_lost_is_skipped_by_the_shadow(
        tmp_path, corpus, clip):
    """training.nonfinite: skip, and the writer of stage 1 killed after the commit of the
    iteration whose norm was not finite, before its COMMIT message: the new writer's HELLO is
    all the shadow hears of that iteration. The shadow must skip it as every node did (it once
    applied the non-finite gradient it held, and restored NaN parameters onto the new owner)."""
    from spotpipe.runtime.reference import train_reference

    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="none",
                      **{**FAST, "shadow.enabled": True, "training.nonfinite": "skip",
                         "optimizer.grad_clip": clip})
    nodes = ["node0", "node1"]
    faults = [Fault("nan", "node1", 3, "all-reduce"),
              Fault.parse("fail", "node1@3:optimizer", nodes)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    settled = [e["iteration"] for e in evs if e["kind"] == "shadow_settled"]
    agreement = next(e for e in evs if e["kind"] == "agreement")
    # (the race of test_lost_stages_without_replica_are_restored_from_shadows: node1's norm
    # gather may return while node0's has not yet received node1's part, which the kill
    # discards; node0 then never committed iteration 3, and the job replays it, its NaN
    # injected once: the step is taken then, as the plain loop takes it)
    assert agreement["resume"] in (3, 4), agreement
    replayed = agreement["resume"] == 3
    assert settled == ([] if replayed else [3]), (settled, agreement)
    model, _ = train_reference(cfg, skip=frozenset() if replayed else frozenset({3}))
    got = load_file(str(run / "final" / "model.safetensors"))
    want = model.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the loop without step 3"


def test_a_writer_silent_longer_than_the_timeout_writes_on_over_a_new_link(tmp_path, corpus,
                                                                           monkeypatch):
    """A shadow gives up a link whose writer says nothing for cluster.timeout_s (its receive
    times out, as for a writer that is gone) and waits for the next one; a writer that was
    merely silent that long (a recovery that kept its link, a slow final save) must write on
    over a new link, not fail on the old one (it once raised gloo's "Connection closed by
    peer" at its next gradient, and at its END when the job was over, failing the job). Here
    the silence falls before a gradient, between a gradient and its commit (the new link's
    HELLO brings the commit), and before the END. The shadow then holds the iterations as a
    plain optimizer stepping the same gradients does."""


    from spotpipe import job
    from spotpipe.protocol import channel_from_env
    from spotpipe.runtime.node import build_stage_state
    from spotpipe.runtime.optim import set_lr
    from spotpipe.runtime.replica import flatten_grads
    from spotpipe.runtime.shadow_link import ShadowWriter
    from spotpipe.store.sealed import SealedStore

    cfg, spec, connect = _one_shadow_setup(corpus, monkeypatch, iterations=3,
                                           **{"cluster.timeout_s": 1, "optimizer.grad_clip": 0})
    shadow, runner, lost, ended = _shadow_running(cfg, spec, connect, tmp_path)
    writer = ShadowWriter(SealedStore(connect(), channel_from_env("node0").key), "spotpipe",
                          "node0", max_lag=4, timeout_s=1)
    owner = build_stage_state(job.build_model(cfg), spec.partition, 0, cfg,
                              torch.device("cpu"))
    reference = build_stage_state(job.build_model(cfg), spec.partition, 0, cfg,
                                  torch.device("cpu"))
    writer.relink({0: (owner.module, owner.optimizer)}, 0, set())

    def silence() -> None:
        """Until the shadow gives up the link that the writer has left silent."""
        assert lost.get(timeout=60) and not ended, ended

    for t in range(cfg.iterations):
        if t == 1:
            silence()
        for p in owner.params:
            p.grad = torch.full_like(p, 0.01 * (t + 1))
        writer.post_grad(t, 0, flatten_grads(owner.params))
        writer.confirm()
        if t == 1:
            silence()
        writer.commit(t, None)
        set_lr(reference.optimizer, cfg, t)
        for p in reference.params:
            p.grad = torch.full_like(p, 0.01 * (t + 1))
        reference.optimizer.step()
    silence()
    writer.close()  # the shadow's last writer: it ends when the link does
    runner.join(timeout=60)
    assert not runner.is_alive() and not ended, ended
    assert shadow.applied == cfg.iterations - 1
    for mine, want in zip(shadow.module.parameters(), reference.module.parameters()):
        assert torch.equal(mine, want)


def test_a_commit_its_writer_alone_completed_is_not_applied_before_the_survivors_agree(
        tmp_path, corpus, monkeypatch):
    """The norm gather that commits an iteration can return on one node and be cut short on
    another (the first killed right after, its part discarded with its socket). A writer that
    completed it sends its shadow COMMIT(1) and is lost; the survivors never committed 1, and
    the new writer resumes at 1 and sends iteration 1 again. The shadow once applied the lost
    writer's COMMIT at once, held iteration 1, and failed the new writer ("holds iteration 1,
    but the job resumes at iteration 1"): a recoverable loss stopped the job. It now applies a
    commit once the writer's next message shows every node has it, and holds what the
    survivors agreed: the plain optimizer's state after gradient 0 and the new writer's 1."""

    from spotpipe import job
    from spotpipe.protocol import channel_from_env
    from spotpipe.runtime.node import build_stage_state
    from spotpipe.runtime.optim import set_lr
    from spotpipe.runtime.replica import flatten_grads
    from spotpipe.runtime.shadow_link import ShadowWriter
    from spotpipe.store.sealed import SealedStore

    cfg, spec, connect = _one_shadow_setup(corpus, monkeypatch, iterations=3,
                                           **{"cluster.timeout_s": 1, "optimizer.grad_clip": 0})
    shadow, runner, lost, ended = _shadow_running(cfg, spec, connect, tmp_path)

    def stage():
        return build_stage_state(job.build_model(cfg), spec.partition, 0, cfg,
                                 torch.device("cpu"))

    def writer(node: str) -> ShadowWriter:
        return ShadowWriter(SealedStore(connect(), channel_from_env(node).key), "spotpipe",
                            node, max_lag=1, timeout_s=1)

    owner, reference = stage(), stage()

    def step(w: ShadowWriter, t: int, value: float, commit: bool = True) -> None:
        for p in owner.params:
            p.grad = torch.full_like(p, value)
        w.post_grad(t, 0, flatten_grads(owner.params))
        w.confirm()
        if commit:
            w.commit(t, None)

    def reference_step(t: int, value: float) -> None:
        set_lr(reference.optimizer, cfg, t)
        for p in reference.params:
            p.grad = torch.full_like(p, value)
        reference.optimizer.step()

    first = writer("node1")
    first.relink({0: (owner.module, owner.optimizer)}, 0, set())
    step(first, 0, 0.01)
    step(first, 1, 0.02)  # committed by this writer alone; then it is lost (it says no more)
    reference_step(0, 0.01)
    assert lost.get(timeout=60) and not ended, ended  # (the shadow gives the link up)
    second = writer("node0")  # the survivor, which resumes at 1 (max_lag 1: no wait on 1)
    second.relink({0: (owner.module, owner.optimizer)}, 1, set())
    for t, value in ((1, 0.05), (2, 0.07)):
        step(second, t, value)
        reference_step(t, value)
    second.close()
    runner.join(timeout=60)
    assert not runner.is_alive() and not ended, ended
    assert shadow.applied == cfg.iterations - 1
    for mine, want in zip(shadow.module.parameters(), reference.module.parameters()):
        assert torch.equal(mine, want)


def test_a_shadow_keeps_nothing_of_the_links_its_writers_ended(tmp_path, corpus, monkeypatch):
    """Each writer change opens a link and ends it (END). The shadow posts the receive of the
    next gradient ahead on a link; it must complete it and drop the link when the link ends.
    It once kept that receive for as long as it ran, and with it a gradient's buffer and the
    link's sockets: four descriptors here for each writer, ten writers here forty. Nor does
    the store keep a link's records once it is over (three keys a link were left: its record
    and its gloo rendezvous's two addresses, thirty here)."""
    import os
    import threading

    from spotpipe import job
    from spotpipe.checkpoint.shadow import Shadow
    from spotpipe.protocol import channel_from_env
    from spotpipe.runtime.node import build_stage_state
    from spotpipe.runtime.replica import flatten_grads
    from spotpipe.runtime.shadow_link import ShadowWriter
    from spotpipe.store.sealed import SealedStore

    cfg, spec, connect = _one_shadow_setup(corpus, monkeypatch, iterations=12,
                                           **{"optimizer.grad_clip": 0})
    shadow = Shadow(cfg, spec, tmp_path, 0, connect(), 0.0, link_store=connect())
    runner = threading.Thread(target=shadow.run, daemon=True)
    runner.start()
    owner = build_stage_state(job.build_model(cfg), spec.partition, 0, cfg,
                              torch.device("cpu"))
    for p in owner.params:
        p.grad = torch.full_like(p, 0.01)

    def write(t: int) -> None:
        """Iteration t, by a writer of its own, which ends its link."""
        writer = ShadowWriter(SealedStore(connect(), channel_from_env(f"node{t}").key),
                              "spotpipe", f"node{t}", max_lag=4, timeout_s=30)
        writer.relink({0: (owner.module, owner.optimizer)}, t, set())
        writer.post_grad(t, 0, flatten_grads(owner.params))
        writer.confirm()
        writer.commit(t, None)
        writer.close()

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    store = connect()
    write(0)
    write(1)
    before, keys_before = descriptors(), store.num_keys()
    for t in range(2, cfg.iterations):
        write(t)
    grew = descriptors() - before
    runner.join(timeout=60)
    assert not runner.is_alive() and shadow.applied == cfg.iterations - 1
    assert grew < cfg.iterations - 2, f"{grew} descriptors more after ten writers"
    more = store.num_keys() - keys_before
    assert more < cfg.iterations - 2, f"{more} keys more in the store after ten writers"


def test_a_shadow_lagging_past_the_timeout_stops_its_writer_naming_it():
    """A writer waits once its shadow lags shadow.max_lag iterations behind (the documented
    policy; behind the iteration that the gradient it sends confirms, see `_Pending`), for at
    most cluster.timeout_s: a shadow that has not caught up by then is hung or too slow, and
    the error names it and the setting (it once passed on the store's "wait timeout after
    500ms, keys: /spotpipe/shadow/1/applied/5")."""
    from datetime import timedelta

    import torch.distributed as dist

    from spotpipe.runtime.shadow_link import ShadowError, ShadowWriter, _Link
    from spotpipe.store.sealed import SealedStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = SealedStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                      timeout=timedelta(seconds=30)), b"k" * 32)
    writer = ShadowWriter(store, "spotpipe", "node0", max_lag=2, timeout_s=0.5)
    # the shadow of stage 1 has applied iteration 4, and marks nothing more
    writer.links[1] = _Link(1, 1, None, applied=4, store=store, resume=8, scale=None,
                            used=float("inf"))  # (never silent for long)
    with pytest.raises(ShadowError, match=r"the shadow of stage 1 has not applied iteration 5 "
                                          r"within cluster.timeout_s \(0.5 s\).*shadow.max_lag"):
        writer.post_grad(8, 1, torch.zeros(3))  # (it confirms 7, which is 2 past 5)
    assert not writer.waiting


def test_a_shadow_keeps_a_bounded_number_of_marks_in_the_store(tmp_path, corpus, monkeypatch):
    """The shadow marks each iteration it applies in the store (its writer waits on those
    marks past shadow.max_lag). A writer waits on none older than max_lag iterations behind
    what it sends, so only those need to stay: the store (in the launcher's memory, or etcd
    with its quota) must not hold one more key per iteration for as long as the job runs."""
    from spotpipe.checkpoint.shadow import Shadow
    from spotpipe.runtime.shadow_link import applied_key

    cfg, spec, connect = _one_shadow_setup(corpus, monkeypatch, iterations=40)
    store = connect()
    shadow = Shadow(cfg, spec, tmp_path, 0, store, 0.0, link_store=connect())

    def apply(iterations: range) -> int:
        """Apply `iterations` as if committed; the keys in the store then."""
        for t in iterations:
            shadow._submit(t, torch.zeros(shadow.grad_size), torch.tensor(1.0))
        assert shadow.applied == iterations[-1]
        return store.num_keys()

    before = apply(range(0, 10))
    after = apply(range(10, 40))
    assert after - before < 10, f"{after - before} keys more after 30 iterations"
    # the marks a writer may still wait on are there
    max_lag = cfg.shadow.max_lag
    assert store.check([applied_key("spotpipe", 0, t) for t in range(39 - max_lag, 40)])
    shadow.applier.close()


def test_a_writer_held_back_by_its_lagging_shadow_past_the_timeout_writes_on(tmp_path, corpus,
                                                                             monkeypatch):
    """The writer waits for a shadow that lags shadow.max_lag behind before it sends the next
    gradient; that wait leaves the link silent too, and the shadow gives the link up after
    cluster.timeout_s. The writer must renew a link that went silent during the wait (it
    looked only before it, and sent on the given-up link)."""
    import queue
    import threading

    from spotpipe import job
    from spotpipe.checkpoint.shadow import LinkBroken, Shadow
    from spotpipe.protocol import channel_from_env
    from spotpipe.runtime.node import build_stage_state
    from spotpipe.runtime.replica import flatten_grads
    from spotpipe.runtime.shadow_link import ShadowWriter
    from spotpipe.store.sealed import SealedStore

    cfg, spec, connect = _one_shadow_setup(
        corpus, monkeypatch, iterations=4,
        **{"cluster.timeout_s": 1, "optimizer.grad_clip": 0, "shadow.max_lag": 1})
    shadow = Shadow(cfg, spec, tmp_path, 0, connect(), 0.0, link_store=connect())
    lost: queue.Queue = queue.Queue()
    told, gate = shadow.channel.event, threading.Event()

    serve = shadow._serve

    def serving(group) -> bool:
        try:
            return serve(group)
        except LinkBroken:
            gate.set()  # the shadow catches up only once it has given the link up
            raise

    def event(kind, **details):
        if kind == "shadow_link_lost":
            lost.put(details)
        told(kind, **details)

    def applied(t: int) -> None:
        assert t == 0 or gate.wait(timeout=60)
        shadow._applied(t)

    shadow._serve, shadow.channel.event, shadow.applier.on_applied = serving, event, applied
    runner = threading.Thread(target=shadow.run, daemon=True)
    runner.start()
    # the writer's own timeout is long: what renews the link is its silence
    writer = ShadowWriter(SealedStore(connect(), channel_from_env("node0").key), "spotpipe",
                          "node0", max_lag=1, timeout_s=30)
    writer.silent_s = 0.5  # (less than the shadow's 1 s, as half of one timeout is)
    owner = build_stage_state(job.build_model(cfg), spec.partition, 0, cfg,
                              torch.device("cpu"))
    for p in owner.params:
        p.grad = torch.full_like(p, 0.01)
    writer.relink({0: (owner.module, owner.optimizer)}, 0, set())
    for t in range(cfg.iterations):  # at t = 2 the writer waits for iteration 1's mark
        writer.post_grad(t, 0, flatten_grads(owner.params))
        writer.confirm()
        writer.commit(t, None)
    writer.close()
    runner.join(timeout=60)
    assert not runner.is_alive() and shadow.applied == cfg.iterations - 1
    assert lost.qsize() == 1 and writer.waited_s > 0
