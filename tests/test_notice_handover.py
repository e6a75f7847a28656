"""A cloud notice with a standby node waiting: a planned hand-over, no carrier at any point.

P = 3, D = 1 and one joiner, which waits on standby; once it does, node1's metadata endpoint
(AWS, GCP or Azure, served as the clouds serve them) announces its preemption. The job hands
node1's stage to the standby node at the next boundary, from the replica node0 holds, and the
run ends bit-identical to the failure-free one with every sample consumed once. (Without a
standby node the job re-partitions onto the nodes that stay at once, the leaving stage's
layers from its replica: tests/test_failover.py and the last test here; at P = 2 there is no
smaller depth, and the notice is a takeover: tests/test_failover.py, the cloud notice test.)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault

from conftest import tiny_config
from event_tail import when_event
from metadata_servers import MetadataServer
from procs import workers_of
from test_failover import (FAST, assert_nothing_left, assert_samples_exactly_once, config,
                           events, failure_free, store_port)

ITERS = 40


def train_meanwhile(run, cfg, match, then, meta: MetadataServer | None = None,
                    **kw) -> None:
    """Train to the end, calling `then(event)` once the run writes an event that
    `match`es (the metadata server `meta` closed after)."""
    stop = threading.Event()
    tail = when_event(run, match, then, stop)
    try:
        assert train(cfg, run, progress=False, **kw) == 0
    finally:
        stop.set()
        tail.join(timeout=5)
        if meta is not None:
            meta.close()


def standby_placed(event: dict) -> bool:
    """The coordinator's plan that left the joiner node3 waiting on standby."""
    return event["kind"] == "plan" and "node3" in event.get("standby", [])


@pytest.mark.parametrize("service", ["aws", "gcp", "azure"])
def test_notice_hands_the_stage_to_the_standby_node(tmp_path, tmp_path_factory, corpus,
                                                    service):
    meta = MetadataServer()
    run = tmp_path / "run"
    cfg = config(corpus, 3, 1, **{f"failover.{service}_notice_url": meta.urls()[service],
                                  "failover.notice_poll_s": 0.1, "iterations": ITERS})
    train_meanwhile(run, cfg, standby_placed, lambda ev: meta.preempt("node1"), meta,
                    joins=[2])
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan"]
    assert [p["action"] for p in plans if p["action"] != "keep"] == ["handover"], plans
    notice = [e for e in evs if e["kind"] == "notice"]
    assert [e["node"] for e in notice] == ["node1"]
    assert service.upper() in notice[0]["source"].upper()
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(m["carriers"] == 0 for m in metrics), "a node carried two stages"
    assert metrics[-1]["live_nodes"] == 3
    # node3 waited on standby beside the three until it took node1's stage
    assert metrics[0]["standby"] == 0 and metrics[-1]["standby"] == 0
    assert 1 in [m["standby"] for m in metrics], [m["standby"] for m in metrics]
    migrated = [e for e in evs if e["kind"] == "migrated" and e["node"] == "node3"]
    assert migrated and migrated[0]["stages"] == [1]
    assert any(e["kind"] == "worker_left" and e["node"] == "node1" for e in evs)
    if service == "azure":
        assert meta.acks == [("node1", meta.events["node1"]["EventId"])]
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=3, pipelines=1, **{**FAST, "iterations": ITERS})))


def assert_ends_as_failure_free(run, cfg, want: dict) -> None:
    """Bit-identical to the failure-free run's final parameters `want`, every sample
    consumed once, and nothing left running or bound."""
    got = load_file(str(run / "final" / "model.safetensors"))
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the failure-free run"
    assert_samples_exactly_once(run, cfg)
    assert_nothing_left(run, store_port(run))


def both_standby(event: dict) -> bool:
    return event["kind"] == "plan" and {"node4", "node5"} <= set(event.get("standby", []))


def test_adjacent_notices_hand_over_from_the_leaving_node(tmp_path, tmp_path_factory, corpus):
    """P = 4 with two nodes waiting on standby; node1 and node2, adjacent, get their notices
    together (SIGTERM, as a spot market takes machines in bulk). node2's replica went with
    node1, so node2 sends stage 2 itself before it leaves (stage 1 comes from node0's
    replica): one hand-over, nobody carries two stages, and the run ends bit-identical to
    the failure-free one. Before, the job lost stage 2 and stopped."""
    run = tmp_path / "run"
    cfg = config(corpus, 4, 1, iterations=ITERS)

    def preempt(_: dict) -> None:
        pids = workers_of(run)
        for node in ("node1", "node2"):  # (back to back: both notices at one boundary)
            os.kill(pids[node], signal.SIGTERM)

    train_meanwhile(run, cfg, both_standby, preempt, joins=[2, 2])
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [p["action"] for p in plans] == ["handover"], plans
    handed = [e for e in evs if e["kind"] == "handed_over"]
    # (stage 2 to one joiner, its replica to the other, which took stage 1: in the order
    # they asked to join)
    assert [e["node"] for e in handed] == ["node2"], handed
    sent = {what.rsplit(" to ", 1)[0]: what.rsplit(" to ", 1)[1] for what in handed[0]["sent"]}
    assert set(sent) == {"stage 2", "replica 2"} and set(sent.values()) == {"node4", "node5"}
    migrated = {e["node"]: e for e in evs if e["kind"] == "migrated"}
    assert set(migrated) >= {"node4", "node5"}
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(m["carriers"] == 0 for m in metrics), "a node carried two stages"
    assert metrics[-1]["live_nodes"] == 4
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=4, pipelines=1, **{**FAST, "iterations": ITERS})))


@pytest.mark.parametrize("stages,mode,leaving", [(4, "lazy", ["node1", "node2"]),
                                                 (3, "none", ["node1"])],
                         ids=["adjacent-lazy-P4", "no-redundancy-P3"])
def test_a_leaving_node_with_no_replica_hands_its_stage_to_a_neighbour(
        tmp_path, tmp_path_factory, corpus, stages, mode, leaving):
    """No standby node. Adjacent notices (node2's replica holder leaves too), or a notice
    without redundancy (no replica at all): the leaving node hands its stage whole to its
    successor, and the job re-partitions onto the nodes that stay in the same plan, that
    stage's layers going on from there (before, the successor carried two stages until a
    re-partition at the next boundary). A crash there stops the job (tests/test_failover.py);
    a notice leaves time to hand the stage over."""
    cfg = config(corpus, stages, 1, mode)
    nodes = [f"node{r}" for r in range(stages)]
    faults = [Fault.parse("notice", f"{n}@3", nodes) for n in leaving]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [(p["action"], p["stages"]) for p in plans] == [("repartition", stages - len(
        leaving))], plans
    assert plans[0]["resume"] == 4  # at the boundary: nothing trained again
    assert plans[0]["transfers"] == [["stage", int(leaving[-1][4:]), leaving[-1],
                                      f"node{int(leaving[-1][4:]) + 1}"]], plans[0]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(m["carriers"] == 0 for m in metrics), "a node carried two stages"
    handed = [e for e in evs if e["kind"] == "handed_over"]
    last = leaving[-1]
    after = f"node{int(last[4:]) + 1}"
    assert [(e["node"], e["sent"]) for e in handed] == [
        (last, [f"stage {int(last[4:])} to {after}"])], handed
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=stages, **FAST)))


def test_a_crash_right_after_a_notice_without_standby_is_taken_over(
        tmp_path, tmp_path_factory, corpus):
    """P = 3, no standby node: node2 leaves on a notice at iteration 5, and node0 crashes in
    the next iteration. The notice re-partitions the job onto node0 and node1 at once (P = 2,
    the ring whole again), so node1 holds stage 0's replica and takes it over. Before, node1
    took node2's stage over and carried two stages until the next boundary, holding no
    replica: node0's crash in that iteration stopped the job."""
    cfg = config(corpus, 3, 1, **{"iterations": 10})
    nodes = [f"node{r}" for r in range(3)]
    faults = [Fault.parse("notice", "node2@5", nodes),
              Fault.parse("fail", "node0@6:forward", nodes)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [(p["action"], p["stages"]) for p in plans] == [("repartition", 2),
                                                           ("failover", 2)], plans
    assert plans[0]["resume"] == 6 and "on a notice" in plans[0]["reason"]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["carriers"] for m in metrics if m["iter"] < 6] == [0] * 6
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=3, **{**FAST, "iterations": 10})))


def test_two_of_three_nodes_leaving_together_leave_the_model_on_the_third(
        tmp_path, tmp_path_factory, corpus):
    """P = 3: node1 and node2 get their notices in one iteration (a chaos run of two faults
    found it stopping the job): the tiny model fits on one node, so node0 promotes its
    replica of stage 1 and takes stage 2 from node2 as it leaves, and runs all three stages
    to the end, bit-identical to the failure-free run."""
    cfg = config(corpus, 3, 1)
    nodes = [f"node{r}" for r in range(3)]
    faults = [Fault.parse("notice", f"{n}@3", nodes) for n in ("node1", "node2")]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [p["action"] for p in plans] == ["failover"], plans
    handed = [(e["node"], e["sent"]) for e in evs if e["kind"] == "handed_over"]
    assert handed == [("node2", ["stage 2 to node0"])], handed
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics[-1]["live_nodes"] == 1
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=3, **FAST)))


def test_a_crash_beside_a_leaving_node_is_repaired_from_the_replica_it_holds(
        tmp_path, tmp_path_factory, corpus):
    """P = 4: node0 gets a notice at iteration 3 and node1 crashes in that iteration, before
    its boundary (found by a chaos run of two faults). node0 holds stage 1's replica and is
    still there: it copies it to node2 before it goes, node3 promotes its replica of stage
    0, and the run ends bit-identical to the failure-free one. Before, the job stopped as
    for two adjacent crashes."""
    cfg = config(corpus, 4, 1)
    nodes = [f"node{r}" for r in range(4)]
    faults = [Fault.parse("notice", "node0@3", nodes), Fault.parse("fail", "node1@3:forward",
                                                                    nodes)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert plans[0]["action"] == "failover", plans
    assert plans[0]["resume"] == 3  # (iteration 3, in flight at the crash, trained again)
    handed = [(e["node"], e["sent"]) for e in evs if e["kind"] == "handed_over"]
    assert handed == [("node0", ["stage 1 to node2"])], handed
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=4, **FAST)))


def test_a_notice_cut_short_in_the_hand_over_stops_the_job_clearly(tmp_path, corpus):
    """node1 and node2 leave together and node2 is gone before it sends stage 2 (its
    notice window cut short): node3, which was to receive it for the re-partition, did not,
    so the re-partition is rolled back (no survivor's state had changed), and with node1 gone
    too stage 2 is on no node: the job stops saying so, without waiting out the groups'
    timeout (120 s here) for the node that will never send."""
    cfg = config(corpus, 4, 1, **{"cluster.timeout_s": 120.0})
    nodes = [f"node{r}" for r in range(4)]
    faults = [Fault.parse("notice", "node1@3", nodes), Fault.parse("notice", "node2@3", nodes),
              Fault.parse("fail", "node2@3:handover", nodes)]
    run = tmp_path / "run"
    started = time.monotonic()
    assert train(cfg, run, progress=False, faults=faults) != 0
    assert time.monotonic() - started < 60
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert summary["message"].startswith(
        "lost node1 (pipeline 0, stage 1), node2 (pipeline 0, stage 2) in iteration 4 (the "
        "last committed iteration is 3): adjacent stages of one pipeline, so no replica of one "
        "of them survives"), summary["message"]
    assert [e.get("rolled_back") for e in events(run) if e["kind"] == "agreement"] == [
        None, True]
    assert_nothing_left(run, store_port(run))


def test_a_leaving_node_hung_in_its_hand_over_is_fenced_at_the_hang_timeout(
        tmp_path, tmp_path_factory, corpus):
    """As above, but node2's main thread stops in its hand-over instead of dying (its
    heartbeat goes on): it reports its stall at the hang timeout (2 s) and is fenced though
    the plan let it go, and with shadows the stage comes back from its shadow; the run ends
    bit-identical. Before, no check watched a node the plan had let go: node3 waited for the
    stage until `cluster.timeout_s` (120 s here), and the job's end for node2's exit for
    ever."""
    cfg = config(corpus, 4, 1, **{"shadow.enabled": True, "cluster.timeout_s": 120.0})
    nodes = [f"node{r}" for r in range(4)]
    faults = [Fault.parse("notice", "node1@3", nodes), Fault.parse("notice", "node2@3", nodes),
              Fault.parse("hang", "node2@3:handover", nodes)]
    run = tmp_path / "run"
    started = time.monotonic()
    assert train(cfg, run, progress=False, faults=faults) == 0
    assert time.monotonic() - started < 60
    evs = events(run)
    fenced = [e for e in evs if e["kind"] == "node_fenced"]
    assert [e["node"] for e in fenced] == ["node2"], fenced
    assert "handing over stage 2" in fenced[0]["reason"], fenced
    plans = [e["action"] for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert plans[0] == "failover" and "restore_from_shadow" in plans, plans
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=4, **FAST)))


def test_a_notice_with_time_to_spare_trains_on_until_its_lead(tmp_path, tmp_path_factory,
                                                              corpus):
    """AWS says node1 goes in 4 s (whole seconds: 3-4 s); with `failover.notice_lead_s: 1`
    node1 trains on and leaves 1 s before then, not when the notice came: the job keeps its
    two nodes for most of the window, then fails over at a boundary, bit-identical."""
    meta = MetadataServer()
    run = tmp_path / "run"
    iters = 400  # (several seconds of a P = 2 job: it is still running when node1 leaves)
    cfg = config(corpus, 2, 1, **{"failover.aws_notice_url": meta.urls()["aws"],
                                  "failover.notice_poll_s": 0.1,
                                  "failover.notice_lead_s": 1.0, "iterations": iters})
    train_meanwhile(run, cfg, lambda ev: ev["kind"] == "worker_ready" and ev["node"] == "node1",
                    lambda ev: meta.preempt("node1", in_s=4.0), meta)
    evs = events(run)
    deferred = [e for e in evs if e["kind"] == "notice_deferred"]
    assert [e["node"] for e in deferred] == ["node1"], deferred
    # (2-3 s, less the time the worker took to read it)
    assert 0.5 < deferred[0]["leaves_in_s"] <= 3.0
    assert deferred[0]["lead_s"] >= 1.0  # (the configured lead, or what the node needs)
    notice = next(e for e in evs if e["kind"] == "notice")
    assert notice["time_s"] - deferred[0]["time_s"] >= deferred[0]["leaves_in_s"] - 0.05
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [p["action"] for p in plans] == ["failover"], plans
    assert plans[0]["resume"] < iters  # it left while the job ran
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=2, pipelines=1, **{**FAST, "iterations": iters})))


def test_a_node_whose_state_takes_longer_to_send_than_the_notice_gives_leaves_at_once(
        tmp_path, corpus):
    """As above (AWS: node1 goes in 4 s, a lead of 1 s), but node1's state, its stage and
    the replica it holds, would take longer to send than the notice gives it at the network's
    `failover.handover_gbps` (here a trickle: 1e-6 Gb/s, a kilobit a second): it acts on
    the notice at once instead of training on (no `notice_deferred`). Before, the lead
    counted only its iterations, and a large stage met the instance's end mid-transfer."""
    meta = MetadataServer()
    run = tmp_path / "run"
    cfg = config(corpus, 2, 1, **{"failover.aws_notice_url": meta.urls()["aws"],
                                  "failover.notice_poll_s": 0.1,
                                  "failover.notice_lead_s": 1.0,
                                  "failover.handover_gbps": 1e-6, "iterations": 400})
    train_meanwhile(run, cfg, lambda ev: ev["kind"] == "worker_ready" and ev["node"] == "node1",
                    lambda ev: meta.preempt("node1", in_s=4.0), meta)
    evs = events(run)
    assert not [e for e in evs if e["kind"] == "notice_deferred"], evs
    plans = [e for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert [p["action"] for p in plans] == ["failover"], plans
    assert plans[0]["resume"] < 400


def test_with_shadows_a_hand_over_cut_short_is_restored_from_them(tmp_path, tmp_path_factory,
                                                                  corpus):
    """As above, node2 gone before it sends stage 2, but the job keeps CPU shadows: the
    stage node3 did not receive comes back from its shadow, and the run ends bit-identical
    to the failure-free one."""
    cfg = config(corpus, 4, 1, **{"shadow.enabled": True})
    nodes = [f"node{r}" for r in range(4)]
    faults = [Fault.parse("notice", "node1@3", nodes), Fault.parse("notice", "node2@3", nodes),
              Fault.parse("fail", "node2@3:handover", nodes)]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    plans = [e["action"] for e in evs if e["kind"] == "plan" and e["action"] != "keep"]
    assert plans[0] == "failover" and "restore_from_shadow" in plans, plans
    assert any(e["kind"] == "shadow_restored" for e in evs)
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=4, **FAST)))


def test_an_error_in_a_node_after_it_left_does_not_fail_the_job(tmp_path, tmp_path_factory,
                                                               corpus, monkeypatch):
    """node1 of P = 3 leaves on a notice (node0 takes its stage from the replica), then its
    process ends with an error (code 1: the test knob raises once it has left). A software
    error in a node still in the job ends the job (failing over would repeat it); in a node
    the plan let go it is said, with the node's log, and the job trains on to the failure-free
    run's bits. Before, it failed the job."""
    monkeypatch.setenv("SPOTPIPE_TEST_ERROR_AFTER_LEAVING", "node1=1")
    cfg = config(corpus, 3, 1)
    run = tmp_path / "run"
    faults = [Fault.parse("notice", "node1@3", ["node0", "node1", "node2"])]
    assert train(cfg, run, progress=False, faults=faults) == 0
    evs = events(run)
    assert not [e for e in evs if e["kind"] == "worker_failed"]
    errors = [e for e in evs if e["kind"] == "worker_error" and e["node"] == "node1"]
    assert errors and "an error after leaving" in errors[0]["message"]
    # (said once the plan no longer needs it; a loss, replayed, if it came before that)
    said = [e for e in evs if e["kind"] in ("left_node_exited", "node_lost")
            and e["node"] == "node1"]
    assert [e["returncode"] for e in said] == [1], said
    assert "node1.log" in said[0]["reason"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert_ends_as_failure_free(run, cfg, failure_free(tmp_path_factory, tiny_config(
        corpus, stages=3, **FAST)))
