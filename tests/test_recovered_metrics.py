"""The metrics line of a committed iteration whose record a failure took: from the
reports, with figures worked out by hand; what the coordinator hears at an agreement; and
when the job loop writes the line (an in-memory store, no processes). The end-to-end cases
are in tests/test_failover.py."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch
import torch.distributed as dist

from spotpipe.cluster.checkpoint_parts import CheckpointParts
from spotpipe.cluster.coordinator import Agreed, Coordinator
from spotpipe.cluster.metrics_lines import MetricsLines
from spotpipe.cluster.run_files import RunFiles
from spotpipe.cluster.recovered_metrics import recovered_metrics
from spotpipe.plan import Layout
from spotpipe.protocol import Channel, CoordinatorState, Metrics, Report, job_key, keys
from spotpipe.runtime.executor import InFlight

from conftest import tiny_config
from test_coordinator import _make

P, D = 2, 2  # node0 node1 | node2 node3: node1 and node3 hold the last stages
LAYOUT = Layout.build(P, D, ["node0", "node1", "node2", "node3"])


def _reports(**by_node: dict) -> dict[str, Report]:
    coord = Coordinator(cfg=tiny_config("unused", stages=P, pipelines=D), store=dist.HashStore(),
                        layout=LAYOUT, kill=lambda n: None, emit=lambda e: None,
                        now=lambda: 0.0, channel=Channel(job_key(b"k", "t"), "coordinator"))
    return {node: _make(coord, node, **extra) for node, extra in by_node.items()}


def _line(reports: dict[str, Report], previous: dict | None = None) -> dict:
    cfg = tiny_config("unused", stages=P, pipelines=D, iterations=11,
                      **{"lr_schedule.warmup_iters": 1})
    return recovered_metrics(cfg, 5, generation=3, layout=LAYOUT, reports=reports,
                             previous=previous, now=12.5)


def test_the_loss_is_the_sum_of_every_pipelines_share():
    line = _line(_reports(node1=dict(unposted_iteration=5, unposted_loss=1.25),
                          node3=dict(unposted_iteration=5, unposted_loss=0.5),
                          node0=dict(committed_through=5, committed_grad_norm=2.0)),
                 previous={"iter": 4, "time_s": 12.0})
    assert line["recovered"] is True
    assert line["loss"] == 1.75 and line["grad_norm"] == 2.0
    # 2 samples x 4 micro-batches x 2 pipelines a step, 6 steps done; 0.5 s since the line
    # before; cosine from 1e-2 over 10 steps after 1 of warm-up: step 5 is 4/10 of the way
    assert line["samples"] == 96 and line["iter_time_s"] == 0.5
    assert line["samples_per_s"] == 32.0
    assert line["lr"] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 0.4)), rel=1e-12)
    assert (line["iter"], line["time_s"], line["generation"]) == (5, 12.5, 3)
    assert (line["live_nodes"], line["carriers"], line["standby"]) == (4, 0, 0)
    # the line has the posted lines' fields, so every reader of metrics.jsonl reads it
    assert set(line) - {"recovered"} == {f.name for f in dataclasses.fields(Metrics)}


def test_the_nodes_on_standby_are_counted_and_shown_beside_those_running_stages():
    """The line counted only the nodes running stages, and the progress bar showed that
    count over P x D: a node waiting on standby (which takes a stage at once on a loss or a
    notice) was seen nowhere."""
    from spotpipe.cluster.jobloop import nodes_label

    cfg = tiny_config("unused", stages=P, pipelines=D, iterations=11)
    line = recovered_metrics(cfg, 5, generation=3, layout=LAYOUT.with_standby(("node4",)),
                             reports=_reports(node1=dict(unposted_iteration=5)),
                             previous=None, now=1.0)
    assert (line["live_nodes"], line["standby"]) == (4, 1)
    assert nodes_label(line, P * D) == "nodes 4/4 +1 standby"
    assert nodes_label({**line, "live_nodes": 3, "standby": 0}, P * D) == "nodes 3/4"
    # a line of a build before `standby`: none shown
    assert nodes_label({"live_nodes": 4}, P * D) == "nodes 4/4"


@pytest.mark.parametrize("reports", [
    dict(node1=dict(unposted_iteration=5, unposted_loss=1.25)),  # node3 lost with its share
    dict(node1=dict(unposted_iteration=5, unposted_loss=1.25),
         node3=dict(unposted_iteration=4, unposted_loss=0.5)),  # another iteration's
    dict(node1=dict(unposted_iteration=5, unposted_loss=None),  # not finite
         node3=dict(unposted_iteration=5, unposted_loss=0.5)),
    dict(node0=dict(unposted_iteration=5, unposted_loss=1.0),  # not a last stage's
         node3=dict(unposted_iteration=5, unposted_loss=0.5)),
    dict(node1=dict(unposted_iteration=5, unposted_loss=3e38),  # finite shares, a sum that
         node3=dict(unposted_iteration=5, unposted_loss=3e38)),  # is not (float32)
], ids=["share-lost", "other-iteration", "not-finite", "not-last-stage", "overflow"])
def test_a_loss_not_known_whole_is_null(reports):
    line = _line(_reports(**reports))
    assert line["loss"] is None
    assert line["grad_norm"] is None  # no report committed iteration 5 with a norm
    assert line["iter_time_s"] == 12.5  # (the first line of the run: since the start)


def test_the_coordinator_says_what_was_agreed_before_it_publishes(corpus):
    heard: list[Agreed] = []
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy")
    layout = Layout.build(2, 1, ["node0", "node1"])
    coord = Coordinator(cfg=cfg, store=dist.HashStore(), layout=layout, kill=lambda n: None,
                        emit=lambda e: None, now=lambda: 0.0,
                        channel=Channel(job_key(b"k", "t"), "coordinator"),
                        partition=[(0, 2), (2, 4)], agreed=heard.append)
    coord.node_exited("node1", -9)
    report = _make(coord, "node0", committed_through=6, iteration=7, formed=True)
    coord.report(report, "node0")
    assert heard == [Agreed(0, layout, 7, {"node0": report})]


def test_a_loss_is_whole_once_every_micro_batch_went_through_the_last_stage():
    flight = InFlight(4, microbatches=3, loss_sum=torch.tensor(0.75))
    flight.done |= {("forward", 1, 0), ("forward", 1, 1), ("backward", 1, 0),
                    ("forward", 0, 2)}
    assert flight.whole_loss(1) is None  # micro-batch 2 has not reached stage 1
    flight.done.add(("forward", 1, 2))
    assert flight.whole_loss(1) == 0.75
    assert InFlight(4, microbatches=3).whole_loss(1) is None  # (nothing computed)


KEY = job_key(b"k", "t")


def _loop(tmp_path) -> tuple[MetricsLines, list[dict]]:
    """The job loop's metrics lines, on a run folder of their own; the records refused."""
    refused: list[dict] = []
    tmp_path.mkdir(exist_ok=True)
    files, t0 = RunFiles(tmp_path), time.time()
    lines = MetricsLines(tiny_config("unused", stages=P, pipelines=D, iterations=20), 0,
                         write=files.metric, event=files.event,
                         refused=lambda writer, why: refused.append({"writer": writer,
                                                                     "reason": why}),
                         now=lambda: time.time() - t0, current=lambda: (0, LAYOUT))
    return lines, refused


def _posted(lines: MetricsLines, iteration: int, loss: float = 2.0, generation: int = 0) -> None:
    """node1's Metrics record of `iteration`, as read from the mailbox."""
    lines.posted(Metrics(
        iter=iteration, loss=loss, samples=0, time_s=float(iteration), iter_time_s=1.0,
        samples_per_s=1.0, lr=0.01, grad_norm=1.0, live_nodes=4, carriers=0,
        generation=generation), "node1")


def _handed_on(lines: MetricsLines) -> CoordinatorState:
    """The books a coordinator leaves with these lines, through the store as a successor
    reads them."""
    coord = Coordinator(cfg=lines.cfg, store=dist.HashStore(), layout=LAYOUT,
                        kill=lambda n: None, emit=lambda e: None, now=lambda: 0.0,
                        channel=Channel(KEY, "coordinator"))
    sealed = Channel(KEY, "coordinator").seal(
        CoordinatorState(**coord.books(), **lines.books(), cursor=0, exited={},
                         checkpoints=CheckpointParts().to_json(), journal=0, admission={},
                         time_s=0.0), 0, at=keys.COORDINATOR_STATE)
    return Channel(KEY, "successor").open(sealed, at=keys.COORDINATOR_STATE,
                                          expect=CoordinatorState).message


def _lines(tmp_path) -> list[tuple[int, float | None, bool]]:
    return [(m["iter"], m["loss"], bool(m.get("recovered")))
            for m in map(json.loads, open(tmp_path / "metrics.jsonl"))]


def test_the_first_agreement_makes_the_line_and_the_gap_writes_it(tmp_path):
    loop, _ = _loop(tmp_path)
    for t in range(3):
        _posted(loop, t)
    reports = _reports(node1=dict(unposted_iteration=3, unposted_loss=1.0),
                       node3=dict(unposted_iteration=3, unposted_loss=0.5))
    loop.agreed(Agreed(0, LAYOUT, 4, reports))
    # a second failure while the first is carried out: its layout's last stages hold nothing
    # of iteration 3, and it does not replace the line the first made
    other = Layout.build(P, D, ["node2", "node3", "node0", "node1"])
    loop.agreed(Agreed(1, other, 4, _reports(node3=dict(committed_through=3))))
    assert _lines(tmp_path) == [(0, 2.0, False), (1, 2.0, False), (2, 2.0, False)]  # not yet
    _posted(loop, 4, generation=2)
    assert _lines(tmp_path)[3:] == [(3, 1.5, True), (4, 2.0, False)]
    said = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["kind"], e["iteration"], e["loss_known"]) for e in said] == [
        ("metrics_recovered", 3, True)]
    assert json.loads(open(tmp_path / "metrics.jsonl").readlines()[3])["generation"] == 0


def test_a_record_on_its_way_at_the_agreement_wins_over_its_line(tmp_path):
    loop, refused = _loop(tmp_path)
    _posted(loop, 0)
    loop.agreed(Agreed(0, LAYOUT, 2, _reports()))  # iteration 1's record not read yet
    _posted(loop, 1, loss=3.0)
    _posted(loop, 2)
    assert _lines(tmp_path) == [(0, 2.0, False), (1, 3.0, False), (2, 2.0, False)]
    _posted(loop, 1, loss=4.0, generation=1)  # a late copy: refused, naming its generation
    assert _lines(tmp_path)[-1] == (2, 2.0, False)
    assert refused == [{"writer": "node1", "reason": "metrics of iteration 1 (generation 1), "
                                                     "which metrics.jsonl has already"}]


def test_the_last_iterations_lines_are_kept_in_the_books_and_written_at_the_end(tmp_path):
    loop, _ = _loop(tmp_path / "predecessor")
    _posted(loop, 0)
    loop.agreed(Agreed(0, LAYOUT, 3, _reports(
        node1=dict(unposted_iteration=1, unposted_loss=1.0))))
    # the predecessor is lost before the gap shows; a successor restores from its books
    state = _handed_on(loop)
    successor, _ = _loop(tmp_path / "successor")
    successor.restore(state)
    successor.drain()  # (what the end of the job does after the last records)
    assert _lines(tmp_path / "successor") == [(1, None, True), (2, None, True)]


def test_a_successor_of_a_resumed_job_makes_no_line_below_its_first_iteration(tmp_path):
    first, _ = _loop(tmp_path / "first")
    first.first = 50  # (resumed from a checkpoint of iteration 49; no line written yet)
    successor, _ = _loop(tmp_path / "successor")  # (a successor is given no checkpoint)
    successor.restore(_handed_on(first))
    successor.agreed(Agreed(0, LAYOUT, 51, _reports()))
    _posted(successor, 51)
    assert _lines(tmp_path / "successor") == [(50, None, True), (51, 2.0, False)]
