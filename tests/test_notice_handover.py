"""A cloud notice with a standby node waiting: a planned hand-over, no carrier at any point.

P = 3, D = 1 and one joiner, which waits on standby; once it does, node1's metadata endpoint
(AWS, GCP or Azure, served as the clouds serve them) announces its preemption. The job hands
node1's stage to the standby node at the next boundary, from the replica node0 holds, and the
run ends bit-identical to the failure-free one with every sample consumed once. (Without a
standby node the notice is a takeover: tests/test_failover.py, the cloud notice test.)
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train

from conftest import tiny_config
from event_tail import when_event
from metadata_servers import MetadataServer
from test_failover import (FAST, assert_nothing_left, assert_samples_exactly_once, config,
                           events, failure_free, store_port)

ITERS = 40


def standby_placed(event: dict) -> bool:
    """The coordinator's plan that left the joiner node3 waiting on standby."""
    return event["kind"] == "plan" and "node3" in event.get("standby", [])


@pytest.mark.parametrize("service", ["aws", "gcp", "azure"])
def test_notice_hands_the_stage_to_the_standby_node(tmp_path, tmp_path_factory, corpus,
                                                    service):
    meta = MetadataServer()
    stop = threading.Event()
    run = tmp_path / "run"
    cfg = config(corpus, 3, 1, **{f"failover.{service}_notice_url": meta.urls()[service],
                                  "failover.notice_poll_s": 0.1, "iterations": ITERS})
    tail = when_event(run, standby_placed, lambda ev: meta.preempt("node1"), stop)
    try:
        assert train(cfg, run, progress=False, joins=[2]) == 0
    finally:
        stop.set()
        tail.join(timeout=5)
        meta.close()
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
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=3, pipelines=1,
                                                      **{**FAST, "iterations": ITERS}))
    got = load_file(str(run / "final" / "model.safetensors"))
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the failure-free run"
    assert_samples_exactly_once(run, cfg)
    assert_nothing_left(run, store_port(run))
