"""Agents on hosts that really are separate (tests/netns.py: one network namespace per host,
etcd in its own), with faults at the network level.

Each run is checked against `spotpipe train` of the same configuration (bit for bit where D
does not change), every sample consumed exactly once, and nothing left behind (namespaces,
links, processes: the cluster fixture asserts it at teardown).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from netns import SUBNET, cluster_factory, netns_pids  # noqa: F401 (the fixture)
from test_agent import LENIENT, _trained, _write_config
from test_failover import assert_samples_exactly_once, events

from conftest import tiny_config

TOKEN = "sesame"
DETECT = {"failover.heartbeat_s": 0.2, "failover.heartbeat_timeout_s": 4.0,
          "failover.hang_timeout_s": 30.0, "logging.sample_log": True}


def job(corpus, stages: int, pipelines: int, iterations: int, **extra):
    return tiny_config(corpus, stages=stages, pipelines=pipelines, redundancy="lazy",
                       **{**DETECT, "iterations": iterations, **extra})


def iteration(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["iter"] if lines else -1


def wait_until(condition, procs, what: str, timeout_s: float = 300.0) -> None:
    """Poll a real condition (files the agents write) while every agent runs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert all(p.poll() is None for p in procs), f"an agent ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def finish(procs, timeout_s: float = 600.0) -> list[int]:
    return [p.wait(timeout=timeout_s) for p in procs]


def coordinator_of(outs: list[Path]) -> int:
    found = [i for i, o in enumerate(outs) if (o / "events.jsonl").exists()]
    assert len(found) == 1, found
    return found[0]


def gather_samples(outs: list[Path], run: Path) -> None:
    """Each host's sample log into the run folder, as one would copy them from machines."""
    for out in outs:
        if out != run:
            for log in (out / "logs").glob("samples.*.jsonl"):
                (run / "logs" / log.name).write_bytes(log.read_bytes())


def start(cluster, corpus, tmp_path, cfg, hosts: int, nnodes: str):
    config = _write_config(cfg, tmp_path / "job.yaml")
    cluster.start_etcd()
    outs = [tmp_path / f"host{i}" for i in range(hosts)]
    procs = [cluster.agent(i, config, outs[i], token=TOKEN, nnodes=nnodes)
             for i in range(hosts)]
    return outs, procs


def check_result(tmp_path_factory, cfg, run: Path, outs: list[Path], exact: bool = True):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    got = load_file(str(run / "final" / "model.safetensors"))
    want = _trained(tmp_path_factory, cfg)
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), f"{k} differs from spotpipe train"
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    gather_samples(outs, run)
    assert_samples_exactly_once(run, cfg)


def test_hosts_train_over_their_own_interfaces(cluster_factory, corpus, tmp_path,
                                               tmp_path_factory):
    """P = 3 x D = 1 over 3 namespaced hosts: the workers' gloo pairs and their store
    connections use the host's interface address, never loopback."""
    cluster = cluster_factory(3)
    cfg = job(corpus, 3, 1, 60, **LENIENT)
    outs, procs = start(cluster, corpus, tmp_path, cfg, 3, "3:3")
    wait_until(lambda: max(iteration(o) for o in outs) >= 3, procs, "training began")
    seen = {}
    for i, host in enumerate(cluster.hosts):
        agent_pid = procs[i].pid
        workers = set(netns_pids(host.name)) - {agent_pid}
        assert workers, f"no worker on {host.name}"
        seen[i] = cluster.gloo_sockets(i, workers)
    assert all(code == 0 for code in finish(procs))
    for i, conns in seen.items():
        addr = cluster.hosts[i].addr
        assert conns, f"host {i}'s worker has no connection"
        assert all(local == addr for local, _ in conns), conns
        assert all(peer.startswith(SUBNET + ".") for _, peer in conns), conns
        # gloo: the worker is connected to both other hosts' workers directly
        peers = {peer for _, peer in conns}
        assert {h.addr for j, h in enumerate(cluster.hosts) if j != i} <= peers, conns
    run = outs[coordinator_of(outs)]
    check_result(tmp_path_factory, cfg, run, outs)
