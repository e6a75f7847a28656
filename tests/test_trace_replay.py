"""Trace replay's schedule (`cluster.trace_replay`): which worker each trace event hits,
checked against the schedules worked out by hand in each test."""

import pytest

from spotpipe.cluster.trace_replay import replay_actions
from spotpipe.traces import parse_event_csv

NODES = [f"node{r}" for r in range(4)]


def actions_of(csv: str, nodes: list[str] = NODES) -> list[tuple]:
    got = replay_actions(parse_event_csv(csv), nodes, 1.0)
    return [(round(a.at_s, 6), a.kind, a.node, a.trace_node) for a in got]


def test_a_worker_started_for_a_grant_is_killed_at_its_removal():
    """b lost, e granted: node4 is started for e, so e's removal must kill node4 (it was
    never killed: the replacement outlived its instance)."""
    csv = "0,add,a\n0,add,b\n0,add,c\n0,add,d\n500,remove,b\n1500,add,e\n2500,remove,e\n"
    assert actions_of(csv) == [(0.5, "kill", "node1", "b"), (1.5, "available", "node4", "e"),
                               (2.5, "kill", "node4", "e")]


def test_the_workers_stand_for_the_nodes_present_at_the_start():
    """a leaves before the trace offers 2 nodes; the job starts at 20 ms on b and c, so c's
    removal kills node1 (it was mapped to a, and nothing was killed)."""
    csv = "0,add,a\n10,remove,a\n20,add,b\n20,add,c\n30,remove,c\n"
    assert actions_of(csv, NODES[:2]) == [(0.01, "kill", "node1", "c")]


def test_a_name_granted_again_is_a_new_instance():
    """a lost (node0), then granted again under its name: a new worker, node2, stands for
    it and is the one its second removal kills (the old schedule named node0 twice more)."""
    csv = "0,add,a\n0,add,b\n10,remove,a\n20,add,a\n30,remove,a\n"
    assert actions_of(csv, NODES[:2]) == [(0.01, "kill", "node0", "a"),
                                          (0.02, "available", "node2", "a"),
                                          (0.03, "kill", "node2", "a")]


def test_a_trace_with_more_nodes_than_the_job():
    """6 nodes offered, 4 used (a-d): e and f stand for no worker, so their removal kills
    nothing; g, granted once b is lost, gets node4."""
    csv = ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n0,add,e\n0,add,f\n100,remove,e\n"
           "200,remove,b\n300,add,g\n400,add,h\n500,remove,g\n")
    assert actions_of(csv) == [(0.2, "kill", "node1", "b"), (0.3, "available", "node4", "g"),
                               (0.4, "available", "", "h"), (0.5, "kill", "node4", "g")]


def test_a_node_taken_in_the_instant_it_is_granted_is_not_offered():
    """At 0 a and b are granted and a taken: 2 nodes are offered only from 1 s (c), so the
    job starts then (it started at 0, on a node the trace had already taken)."""
    csv = "0,add,a\n0,add,b\n0,remove,a\n1000,add,c\n2000,remove,c\n"
    assert actions_of(csv, NODES[:2]) == [(1.0, "kill", "node1", "c")]
    with pytest.raises(ValueError, match="never offers 2 nodes"):
        actions_of("0,add,a\n0,add,b\n0,remove,a\n", NODES[:2])

