"""Failover pause when a host is lost: agents on namespaced hosts (tests/netns.py) against the
same agents on loopback. Not a test (pytest does not collect it); run as root:

    PYTHONPATH=$PWD/src:$PWD/tests python tests/bench_netns_pause.py [REPEATS] [--coordinator]
        [--handover]

Each run: P = 3 x D = 1, three agents on etcd; past iteration 10 every process of a host
that does not coordinate is SIGKILLed at once (netns: `ip netns pids`; loopback: the agent's
process group, its worker included). The pause is from the kill to the first iteration
completed after the takeover, on the coordinator's clock (its launch event's t0); its parts
are detection (kill to the first failure event), agreement (to the plan) and takeover.
Prints one JSON object as its last line.

`--coordinator` measures the coordinator's takeover instead, on namespaced hosts only: every
process of the coordinating host (its agent, the coordinator, its worker) is SIGKILLed; the
figure is from the kill to the first iteration of the successor's failover of the lost node
(completed after its plan), read from the successor's
run folder, with its parts: election (kill to the successor's `coordinator_takeover`: the
lease expiring is most of it) and recovery (from there to that iteration).

`--handover` measures the coordinator's hand-over at its host's notice instead, on namespaced
hosts only: a SIGTERM to the coordinating agent; its worker leaves at the next boundary, then
the coordinator hands its office on. Figures from the SIGTERM, on the successor's files:
`pause_s` to the first iteration completed after the notice's plan (training's own pause),
`handover_s` to the last books (`coordinator_handover`), `election_s` to the successor's
`coordinator_takeover`, and `vacant_s` between those two (what `--coordinator`'s election
costs when the host is lost instead).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import REPO, tiny_config
from etcd_server import EtcdServer
from netns import Cluster
from test_agent import _write_config
from test_netns import DETECT, coordinator_of, iteration

from spotpipe.data.corpus import ensure_demo_corpus


def _pause(run: Path, kill_wall: float) -> dict[str, float]:
    events = [json.loads(line) for line in open(run / "events.jsonl")]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    t_kill = kill_wall - events[0]["t0"]
    after = [e for e in events if e["time_s"] >= t_kill]
    detect = min(e["time_s"] for e in after if e["kind"] in ("report", "failure_detected",
                                                            "node_fenced"))
    plan = next(e for e in after if e["kind"] == "plan")
    done = _first_iteration_of(plan, metrics)
    return {"pause_s": done["time_s"] - t_kill, "detection_s": detect - t_kill,
            "agreement_s": plan["time_s"] - detect, "takeover_s": done["time_s"] - plan["time_s"]}


def _successor(outs: list[Path]) -> tuple[list[dict], list[dict], dict]:
    """The events and metrics in the successor's --out, and its `coordinator_takeover`."""
    for out in outs:
        path = out / "events.jsonl"
        events = [json.loads(line) for line in open(path)] if path.exists() else []
        took = [e for e in events if e["kind"] == "coordinator_takeover"]
        if took:
            return events, [json.loads(line) for line in open(out / "metrics.jsonl")], took[0]
    raise RuntimeError("no agent took over")


def _first_iteration_of(plan: dict, metrics: list[dict]) -> dict:
    """The first iteration completed under `plan` (one committed before the fault can be
    recorded after it)."""
    return next(m for m in metrics if m["time_s"] >= plan["time_s"] and m["iter"] >= plan["resume"])


def _takeover(outs: list[Path], kill_wall: float) -> dict[str, float]:
    events, metrics, took = _successor(outs)
    t_kill = kill_wall - events[0]["t0"]
    plan = next(e for e in events if e["kind"] == "plan" and e["time_s"] >= took["time_s"])
    done = _first_iteration_of(plan, metrics)
    return {"pause_s": done["time_s"] - t_kill, "election_s": took["time_s"] - t_kill,
            "recovery_s": done["time_s"] - took["time_s"]}


def _handover(outs: list[Path], term_wall: float) -> dict[str, float]:
    events, metrics, took = _successor(outs)
    t_term = term_wall - events[0]["t0"]
    handed = next(e for e in events if e["kind"] == "coordinator_handover")
    plan = next(e for e in events if e["kind"] == "plan" and e["time_s"] >= t_term)
    done = _first_iteration_of(plan, metrics)
    return {"pause_s": done["time_s"] - t_term, "handover_s": handed["time_s"] - t_term,
            "election_s": took["time_s"] - t_term, "vacant_s": took["time_s"] - handed["time_s"]}


def _agents(config: Path, outs: list[Path], endpoint: str, wrap) -> list[subprocess.Popen]:
    procs = []
    for i, out in enumerate(outs):
        env = dict(os.environ, SPOTPIPE_JOIN_TOKEN="sesame",
                   PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        cmd, extra_env = wrap(i)
        procs.append(subprocess.Popen(
            [*cmd, sys.executable, "-m", "spotpipe", "agent", str(config), "--rdzv-backend", "etcd",
             "--rdzv-endpoint", endpoint, "--rdzv-id", "job1", "--nnodes", "3:3", "--out", str(out),
             "--no-progress"], env={**env, **extra_env}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True))
    return procs


def one(mode: str, tmp: Path, corpus: Path) -> dict[str, float]:
    cfg = tiny_config(corpus, stages=3, pipelines=1, redundancy="lazy",
                      **{**DETECT, "iterations": 300})
    tmp.mkdir(parents=True)
    config = _write_config(cfg, tmp / "job.yaml")
    outs = [tmp / f"host{i}" for i in range(3)]
    if mode in ("netns", "coordinator", "handover"):
        cluster = Cluster(3, tmp)
        cluster.start_etcd()
        procs = [cluster.agent(i, config, outs[i], token="sesame", nnodes="3:3")
                 for i in range(3)]
    else:
        cluster = None
        etcd = EtcdServer(tmp / "etcd-data")
        etcd.start()
        procs = _agents(config, outs, etcd.endpoint, lambda i: ([], {}))
    try:
        while max(iteration(o) for o in outs) < 10:
            time.sleep(0.05)
        c = coordinator_of(outs)
        lost = c if mode in ("coordinator", "handover") else max(i for i in range(3) if i != c)
        kill_wall = time.time()
        if mode == "handover":  # (`ip netns exec` execs the agent: the Popen's pid is its)
            procs[lost].send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=900)
            return _handover(outs, kill_wall)
        if cluster is not None:
            cluster.lose_host(lost)
        else:
            os.killpg(procs[lost].pid, signal.SIGKILL)
        for i, p in enumerate(procs):
            if i != lost:
                p.wait(timeout=900)
        if mode == "coordinator":
            return _takeover(outs, kill_wall)
        return _pause(outs[c], kill_wall)
    finally:
        if cluster is not None:
            cluster.close()
        else:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            etcd.stop()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    repeats = int(args[0]) if args else 2
    root = Path(tempfile.mkdtemp(prefix="netns-pause-"))
    corpus = ensure_demo_corpus(root / "corpus.txt")
    result: dict[str, object] = {"load_before": os.getloadavg()[0]}
    modes = [m for m in ("coordinator", "handover") if f"--{m}" in sys.argv]
    for mode in modes or ("loopback", "netns"):
        runs = [one(mode, root / f"{mode}{k}", corpus) for k in range(repeats)]
        for key in runs[0]:
            result[f"{mode}_{key}"] = round(statistics.median(r[key] for r in runs), 3)
        result[f"{mode}_runs"] = [round(r["pause_s"], 3) for r in runs]
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
