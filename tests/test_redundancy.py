"""Replicas stay exact every iteration; redundancy changes nothing in the training result."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.config import ConfigError

from conftest import tiny_config
from test_equivalence import reference


def digests(run_dir):
    """(role, stage, iter[, mb]) -> set of digests seen across all nodes and pipelines."""
    out = defaultdict(set)
    for path in (run_dir / "logs").glob("digests.*.jsonl"):
        for line in open(path):
            r = json.loads(line)
            key = (r["role"], r["stage"], r["iter"], r.get("mb"))
            out[key].add((r.get("params"), r.get("optim")) if "params" in r else r["digest"])
    return out


CASES = [
    # P, D, optimizer, redundancy
    (2, 1, "adamw", "eager"), (3, 1, "adamw", "lazy"), (4, 1, "adamw", "eager"),
    (2, 2, "adamw", "lazy"), (3, 2, "sgd", "eager"), (4, 2, "adamw", "lazy"),
    (2, 1, "sgd", "lazy"),
]


@pytest.mark.parametrize("stages,pipelines,optimizer,mode", CASES)
def test_replicas_are_bit_identical_to_owners_every_iteration(tmp_path, corpus, stages, pipelines,
                                                               optimizer, mode):
    extra = {"optimizer.momentum": 0.9} if optimizer == "sgd" else {}
    cfg = tiny_config(corpus, stages=stages, pipelines=pipelines, redundancy=mode,
                      iterations=4, **{"optimizer.name": optimizer,
                                       "logging.state_digests": True}, **extra)
    assert train(cfg, tmp_path / "run", progress=False) == 0
    seen = digests(tmp_path / "run")
    for t in range(cfg.iterations):
        for s in range(stages):
            owner, replica = seen[("owner", s, t, None)], seen[("replica", s, t, None)]
            assert len(owner) == 1, f"data-parallel owners of stage {s} disagree at iteration {t}"
            assert replica == owner, f"replica of stage {s} differs from its owner after {t}"
            if mode == "eager" and stages > 2 and s < stages - 1:
                for mb in range(cfg.num_microbatches):
                    frc, own = seen[("frc", s, t, mb)], seen[("output", s, t, mb)]
                    assert frc and frc == own, f"FRC of stage {s} mb {mb} at {t} != own forward"
            elif mode == "eager":  # outputs that would go on to nobody but the heir: no FRC
                assert not any(seen[("frc", s, t, mb)] for mb in range(cfg.num_microbatches))
    # the iteration count moved the state: replicas were not trivially equal at init
    assert seen[("owner", 0, 0, None)] != seen[("owner", 0, cfg.iterations - 1, None)]
    # training with redundancy is the training without it
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    want, _ = reference(tiny_config(corpus, pipelines=pipelines, iterations=4,
                                    **{"optimizer.name": optimizer}, **extra))
    for key in want:
        if pipelines == 1:
            assert torch.equal(got[key], want[key]), key
        else:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def test_frc_of_every_replica_as_bamboo_runs_it(tmp_path, corpus):
    """`replica.frc: every` runs FRC of every replica, as Bamboo's engine does, on two stages
    too (where plain eager runs none): each FRC output is its owner's own output bit for bit,
    and a crash of stage 0's node in its backward, taken over with those outputs in hand,
    ends where the plain loop does."""
    from spotpipe.faults import Fault

    from spotpipe.job import memory_rules

    cfg = tiny_config(corpus, stages=2, redundancy="eager", iterations=4,
                      **{"replica.frc": "every", "logging.state_digests": True})
    # the launch's memory check counts the FRC outputs this holds (tests/test_memory.py)
    assert memory_rules(cfg, 2).frc_every_stage
    assert not memory_rules(tiny_config(corpus, stages=2, redundancy="eager"),
                            2).frc_every_stage
    fault = Fault.parse("fail", "node0@2:backward", ["node0", "node1"])
    assert train(cfg, tmp_path / "run", progress=False, faults=[fault]) == 0
    seen = digests(tmp_path / "run")
    for s in (0, 1):
        for mb in range(cfg.num_microbatches):
            frc, own = seen[("frc", s, 1, mb)], seen[("output", s, 1, mb)]
            assert frc and frc == own, f"FRC of stage {s} mb {mb} != its own forward"
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    want, _ = reference(tiny_config(corpus, iterations=4))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_state_sync_baseline_copies_every_k(tmp_path, corpus):
    cfg = tiny_config(corpus, stages=2, redundancy="lazy", iterations=4,
                      **{"replica.sync": "state", "replica.sync_every": 2,
                         "logging.state_digests": True})
    assert train(cfg, tmp_path / "run", progress=False) == 0
    seen = digests(tmp_path / "run")
    for s in range(2):
        assert seen[("replica", s, 1, None)] == seen[("owner", s, 1, None)]
        assert seen[("replica", s, 3, None)] == seen[("owner", s, 3, None)]
        # in between the replica is stale: it still holds iteration 1's state
        assert seen[("replica", s, 2, None)] == seen[("owner", s, 1, None)]
        assert seen[("replica", s, 2, None)] != seen[("owner", s, 2, None)]


def test_tied_embeddings_with_redundancy(tmp_path, corpus):
    cfg = tiny_config(corpus, stages=2, redundancy="eager", iterations=3,
                      **{"model.gpt.tie_embeddings": True, "logging.state_digests": True})
    assert train(cfg, tmp_path / "run", progress=False) == 0
    seen = digests(tmp_path / "run")
    for s in range(2):
        assert seen[("replica", s, 2, None)] == seen[("owner", s, 2, None)]


def test_redundancy_needs_two_stages(corpus):
    with pytest.raises(ConfigError, match="needs stages >= 2"):
        tiny_config(corpus, stages=1, redundancy="eager")


def test_a_replica_the_node_waits_on_runs_at_normal_priority():
    """The replica's thread runs at idle priority while the node has work of its own; while
    the node waits on it, at normal priority: an idle-priority thread gets the core only when
    no other process wants it, so with more processes than cores the node would wait until
    every other one blocks."""
    import os
    import threading
    from types import SimpleNamespace

    from spotpipe.config import Config
    from spotpipe.runtime.replica import ReplicaApplier

    entered, release = threading.Event(), threading.Event()
    seen: list[int] = []

    class Held(ReplicaApplier):
        def _apply_gradient(self, iteration, flat, scale=None):
            entered.set()
            assert release.wait(60)
            seen.append(os.sched_getscheduler(0))  # the policy the update itself ran at

    applier = Held(SimpleNamespace(index=0), Config(), None, max_lag=None)
    applier.submit(0, "grad", None)
    assert entered.wait(60)
    thread = applier._native_id
    if thread is None:
        pytest.skip("this system does not let a thread take idle priority")
    assert os.sched_getscheduler(thread) == os.SCHED_IDLE  # the node has not waited yet
    waiter = threading.Thread(target=applier.wait_applied, args=(0,))
    waiter.start()
    deadline = time.monotonic() + 60
    while os.sched_getscheduler(thread) != os.SCHED_OTHER:  # the node now waits on it
        assert time.monotonic() < deadline, "the replica's priority was never raised"
        time.sleep(0.001)
    release.set()
    waiter.join(60)
    assert not waiter.is_alive() and seen == [os.SCHED_OTHER]
    # nothing left to do: it sleeps at normal priority (a process is torn down only once every
    # thread has run its exit, which an idle-priority thread on a busy machine does last)
    assert os.sched_getscheduler(thread) == os.SCHED_OTHER
    entered.clear()
    release.clear()
    applier.submit(1, "grad", None)  # work nobody waits for: idle again
    assert entered.wait(60)
    assert os.sched_getscheduler(thread) == os.SCHED_IDLE
    release.set()
    while applier.applied < 1:  # (not wait_applied: a wait would raise its priority)
        assert time.monotonic() < deadline + 60, "the second update never ended"
        time.sleep(0.001)
    assert seen == [os.SCHED_OTHER, os.SCHED_IDLE]
    assert os.sched_getscheduler(thread) == os.SCHED_OTHER
    applier.close()


def test_closing_waits_for_the_applier_at_normal_priority():
    """A takeover closes the replica's applier and waits for its thread to end: at idle
    priority on a busy core that thread would get the core last (1.2 ms of a takeover's
    regroup here), so the close raises it first."""
    import os
    from types import SimpleNamespace

    from spotpipe.config import Config
    from spotpipe.runtime.replica import ReplicaApplier

    import threading

    at_exit: list[int] = []
    entered, release = threading.Event(), threading.Event()

    class Recorded(ReplicaApplier):
        def _apply_gradient(self, iteration, flat, scale=None):
            entered.set()
            assert release.wait(60)

        def _loop(self):
            super()._loop()
            at_exit.append(os.sched_getscheduler(0))

    applier = Recorded(SimpleNamespace(index=0, params=[None]), Config(), None, max_lag=None)
    applier.submit(0, "grad", None)  # an update in hand, nobody waiting: idle priority
    assert entered.wait(60)
    thread = applier._native_id
    if thread is None:
        pytest.skip("this system does not let a thread take idle priority")
    assert os.sched_getscheduler(thread) == os.SCHED_IDLE
    closer = threading.Thread(target=applier.close)
    closer.start()
    deadline = time.monotonic() + 60
    while os.sched_getscheduler(thread) != os.SCHED_OTHER:  # raised before the join
        assert time.monotonic() < deadline, "the close never raised the replica's priority"
        time.sleep(0.001)
    release.set()
    closer.join(60)
    assert not closer.is_alive()
    assert at_exit == [os.SCHED_OTHER] and not applier.waiting


def test_a_backlog_at_the_writers_limit_raises_the_applier_before_anyone_waits():
    """A CPU shadow's writer (another process) waits once the shadow's backlog reaches
    `shadow.max_lag`, and cannot raise the shadow's thread itself: from that backlog on the
    applier runs at normal priority, and back at idle once it falls below."""
    import os
    import threading
    from types import SimpleNamespace

    import torch

    from spotpipe.config import Config
    from spotpipe.runtime.replica import ReplicaApplier

    entered, release = threading.Event(), threading.Event()
    seen: dict[int, int] = {}
    clipped: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    class Held(ReplicaApplier):
        def _apply_gradient(self, iteration, flat, scale=None):
            if iteration == 0:
                entered.set()
                assert release.wait(60)
            seen[iteration] = os.sched_getscheduler(0)
            clipped.append((flat.clone(), scale))

    applier = Held(SimpleNamespace(index=0, params=[None]), Config(), None, max_lag=None,
                   urgent_lag=2)
    grad = torch.tensor([1.0, 2.0, 1.0])  # two values and one parameter's flag
    applier.submit(0, "grad", grad.clone(), scale=torch.tensor(0.5))
    assert entered.wait(60)
    thread = applier._native_id
    if thread is None:
        pytest.skip("this system does not let a thread take idle priority")
    assert os.sched_getscheduler(thread) == os.SCHED_IDLE  # backlog 1: below the limit
    applier.submit(1, "grad", grad.clone())  # backlog 2: the writer's next gradient would wait
    assert os.sched_getscheduler(thread) == os.SCHED_OTHER
    release.set()
    # (not `drain` nor `close`: a caller's wait raises the priority too)
    with applier._cond:
        assert applier._cond.wait_for(lambda: applier._applied >= 1, timeout=60)
    applier.close()
    assert seen == {0: os.SCHED_OTHER, 1: os.SCHED_IDLE}  # 1 ran with a backlog of 1
    # the clipping scale goes to the update on the applier's thread (which applies it out of
    # place: the message, possibly lent, is left as it came)
    assert [(flat.tolist(), None if scale is None else scale.item())
            for flat, scale in clipped] == [([1.0, 2.0, 1.0], 0.5), ([1.0, 2.0, 1.0], None)]
