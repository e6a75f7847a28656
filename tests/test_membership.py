"""Nodes joining a running job: rebalance, a new pipeline, and refusal of strangers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train
from spotpipe.faults import Fault

from conftest import assert_close_where_width_changed, tiny_config
from test_failover import (FAST, assert_nothing_left, assert_samples_exactly_once, events,
                           failure_free, store_port)

SGD = {"optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.lr": 0.05}


def test_joining_node_rebalances_a_carrier_exactly(tmp_path, tmp_path_factory, corpus):
    """After a takeover one node carries two stages; a joining node takes one back (stage and
    replicas move peer to peer) and training stays bit-identical."""
    # the joining node boots while the job runs (as a spot instance that becomes available
    # has booted); its iteration comes late enough for a slow boot on a loaded machine, with
    # enough iterations after it for the rebalance to happen before the end
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 80, "logging.state_digests": True})
    faults = [Fault.parse("fail", "node1@12", ["node0", "node1"])]
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=faults, joins=[15]) == 0
    kinds = [e["kind"] for e in events(run)]
    assert "join_accepted" in kinds and "migrated" in kinds
    plans = [e["action"] for e in events(run) if e["kind"] == "plan"]
    assert plans == ["failover", "rebalance"]
    # the rebalance was known when node2 was accepted: both nodes, node2 while it waited,
    # formed its groups ahead, and took them
    rebalance = [e for e in events(run) if e["kind"] == "plan"][1]
    assert rebalance["early_groups"]
    assert [e["early_groups"] for e in events(run) if e["kind"] == "migrated"] == [True, True]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics[-1]["live_nodes"] == 2 and metrics[-1]["carriers"] == 0
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=1,
                                                      **{**FAST, "iterations": 80}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_samples_exactly_once(run, cfg)
    # the moved replicas are exact from the first iteration after the move on
    seen: dict = {}
    for path in (run / "logs").glob("digests.*.jsonl"):
        for line in open(path):
            r = json.loads(line)
            if "params" in r:
                seen.setdefault((r["role"], r["stage"], r["iter"]), set()).add(r["params"])
    last = cfg.iterations - 1
    assert seen[("replica", 0, last)] == seen[("owner", 0, last)]
    assert seen[("replica", 1, last)] == seen[("owner", 1, last)]
    assert_nothing_left(run, store_port(run))


def test_a_joiner_that_boots_slowly_still_asks_at_its_iteration(tmp_path, corpus, monkeypatch):
    """`joins=[k]` means a node that has booted asks to join at iteration k (a spot instance
    that becomes available has booted before it asks): the job's first nodes start training
    only once the nodes started to join later have booted. Here the joiner's interpreter
    sleeps 4 s before it runs anything (a loaded machine), longer than the whole job takes;
    without the wait the job would end first and the node be told it came too late."""
    _joiners_start_with(tmp_path, monkeypatch, "import time\ntime.sleep(4)\n")
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 12, "cluster.fork_server": False})
    run = tmp_path / "run"
    faults = [Fault.parse("fail", "node1@2", ["node0", "node1"])]
    assert train(cfg, run, progress=False, faults=faults, joins=[3]) == 0
    got = events(run)
    kinds = [(e["kind"], e["node"]) for e in got]
    assert ("join_accepted", "node2") in kinds and ("join_too_late", "node2") not in kinds
    assert [e["action"] for e in got if e["kind"] == "plan"] == ["failover", "rebalance"]
    booted = next(e["time_s"] for e in got if e["kind"] == "join_waiting")
    first = min(e["time_s"] for e in got if e["kind"] == "worker_ready" and not e["joined"])
    assert booted <= first
    assert_nothing_left(run, store_port(run))


def test_a_joiner_that_dies_while_booting_holds_nothing_up(tmp_path, corpus, monkeypatch):
    """The first nodes wait for the nodes started to join later to boot; one that exits
    before it has booted must not leave them waiting: the job trains to its end without it."""
    _joiners_start_with(tmp_path, monkeypatch, "import os\nos._exit(2)\n")
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 6, "cluster.fork_server": False})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, joins=[2]) == 0
    kinds = [e["kind"] for e in events(run)]
    assert "join_accepted" not in kinds and "job_completed" in kinds
    assert_nothing_left(run, store_port(run))


def _joiners_start_with(tmp_path, monkeypatch, code: str) -> None:
    """Joining nodes' interpreters run `code` first (a sitecustomize module on their path);
    the fork server is off in the configs that use this, so each worker starts afresh."""
    from spotpipe.cluster import launcher
    first = tmp_path / "joiner_site"
    first.mkdir()
    (first / "sitecustomize.py").write_text(code)
    real = launcher.worker_env

    def joiners_env(cfg, **kw):
        env = real(cfg, **kw)
        if kw.get("joining"):
            env["PYTHONPATH"] = os.pathsep.join([str(first), env["PYTHONPATH"]])
        return env

    monkeypatch.setattr(launcher, "worker_env", joiners_env)


def test_a_node_arriving_after_the_last_iteration_is_told_so(tmp_path, corpus):
    """Once the last iteration is committed no plan will place a node: one that asks to join
    then is answered at once (join_too_late), never accepted, and exits cleanly."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 6})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, joins=[5]) == 0
    kinds = [(e["kind"], e["node"]) for e in events(run)]
    assert ("node_available", "node2") in kinds and ("join_too_late", "node2") in kinds
    assert ("join_accepted", "node2") not in kinds
    assert_nothing_left(run, store_port(run))


def test_pipelines_go_two_one_two(tmp_path, tmp_path_factory, corpus):
    """D = 2 -> 1 (adjacent losses drop a pipeline) -> 2 (two nodes join and form one)."""
    check_pipelines_two_one_two(tmp_path, tmp_path_factory, corpus)


def _two_by_two(corpus, **store):
    """P = 2 x D = 2, lazy, SGD, 40 iterations; `store` selects the store."""
    return tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                       **{**FAST, **SGD, "iterations": 40, **store})


def _pipeline_0_lost(iteration: int) -> list[Fault]:
    """Both stages of pipeline 0 (node0, node1) killed in `iteration`'s backward."""
    nodes = [f"node{r}" for r in range(4)]
    return [Fault.parse("fail", f"{n}@{iteration}:backward", nodes) for n in nodes[:2]]


def check_pipelines_two_one_two(tmp_path, tmp_path_factory, corpus, **store) -> None:
    """The D = 2 -> 1 -> 2 run and its checks; `store` selects the store (test_etcd.py)."""
    cfg = _two_by_two(corpus, **store)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=_pipeline_0_lost(3), joins=[5, 5]) == 0
    plans = [e["action"] for e in events(run) if e["kind"] == "plan"]
    assert "drop_pipeline" in plans and plans[-1] == "add_pipeline"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    widths = [m["live_nodes"] for m in metrics]
    assert widths[0] == 4 and 2 in widths and widths[-1] == 4
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=2,
                                                      **{**FAST, **SGD, "iterations": 40}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert_close_where_width_changed(got, want)  # D changed twice: other summation orders
    assert_nothing_left(run, store_port(run) if not store else None)


def _stranger(run, node, token, config_path=None):
    """A worker process that tries to join the running job."""
    launch = events(run)[0]
    host, port = launch["store"].rsplit(":", 1)
    env = dict(os.environ, RANK=node[4:], WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=host,
               MASTER_PORT=port, SPOTPIPE_RUN_DIR=str(run), SPOTPIPE_T0=str(launch["t0"]),
               SPOTPIPE_JOIN="1", SPOTPIPE_JOIN_TOKEN=token, SPOTPIPE_FAULTS="[]",
               SPOTPIPE_INSTANCE=launch["instance"],
               SPOTPIPE_RESUME="", SPOTPIPE_CONFIG=str(config_path or run / "config.yaml"))
    return subprocess.Popen([sys.executable, "-m", "spotpipe.cli.worker"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answered(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_strangers_are_refused_and_the_job_is_undisturbed(tmp_path, tmp_path_factory, corpus,
                                                          monkeypatch):
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "sesame")  # the job's token (else a random one)
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 600})
    run = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(code=train(cfg, run, progress=False)))
    job.start()
    # the strangers need the job's store: wait until it trains (a real condition: a metric)
    while job.is_alive() and not ((run / "metrics.jsonl").exists()
                                  and (run / "metrics.jsonl").read_text().strip()):
        time.sleep(0.05)
    assert job.is_alive(), "the job finished before the strangers could try"
    other_model = tmp_path / "other_model.yaml"
    text = (run / "config.yaml").read_text()
    other_model.write_text(text.replace("n_embd: 32", "n_embd: 16"))
    other_config = tmp_path / "other_config.yaml"
    other_config.write_text(text.replace("seed: 1", "seed: 7"))
    # all three at once: one after the other, the job (600 iterations of 10-30 ms) could end
    # before the last one asked, on a loaded machine
    strangers = {
        "token": _stranger(run, "node91", "not-the-token"),
        "model": _stranger(run, "node92", "sesame", other_model),
        "config": _stranger(run, "node93", "sesame", other_config),
    }
    answers = {what: _answered(proc) for what, proc in strangers.items()}
    job.join()
    assert result["code"] == 0
    for what, answer in answers.items():
        assert answer.returncode == 2, (what, answer.stderr[-500:])
        assert "refused by the job" in answer.stderr, answer.stderr[-500:]
    assert "did not present this job's join token" in answers["token"].stderr
    assert "another model or optimizer (model.gpt.n_embd differs)" in answers["model"].stderr
    assert "another configuration (seed differs)" in answers["config"].stderr
    refused = [e for e in events(run) if e["kind"] == "join_refused"]
    assert sorted(e["node"] for e in refused) == ["node91", "node92", "node93"]
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=1,
                                                      **{**FAST, "iterations": 600}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_trace_additions_join_the_job(tmp_path, tmp_path_factory, corpus):
    """A replayed trace removes a node, then offers a new one: failover, then a rebalance."""
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n500,remove,b\n1500,add,e\n")
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, "iterations": 300})
    from spotpipe.cluster.trace_replay import replay_actions
    from spotpipe.sim.traces import load_trace

    actions = replay_actions(load_trace(trace), [f"node{r}" for r in range(4)], 1.0)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, trace_actions=actions) == 0
    plans = [e["action"] for e in events(run) if e["kind"] == "plan"]
    assert plans == ["failover", "rebalance"]
    assert any(e["kind"] == "join_accepted" for e in events(run))
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=2,
                                                      **{**FAST, "iterations": 300}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)



def test_a_worker_started_for_a_trace_grant_is_lost_with_it(tmp_path, corpus):
    """The trace grants e after b is lost, then takes e away: the worker started for e
    (node4) must be the one killed (it was never killed, and the trace's later preemptions
    missed the job)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n500,remove,b\n1500,add,e\n"
                     "4000,remove,e\n")
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, "iterations": 600})
    from spotpipe.cluster.trace_replay import replay_actions
    from spotpipe.sim.traces import load_trace

    actions = replay_actions(load_trace(trace), [f"node{r}" for r in range(4)], 1.0)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, trace_actions=actions) == 0
    evs = events(run)
    started = [e["node"] for e in evs if e["kind"] == "node_started"]
    killed = [(e["node"], e["trace_node"]) for e in evs if e["kind"] == "trace_kill"]
    assert started == ["node4"] and killed == [("node1", "b"), ("node4", "e")], evs
    assert_samples_exactly_once(run, cfg)

def _signalled_on_standby(cfg, run, signum: int) -> bool:
    """Train `cfg` (P = 2 x D = 1) with node2 joining at iteration 5, and send it `signum`
    once a plan puts it on standby; whether it was sent."""
    from event_tail import when_event
    from procs import until, workers_of

    stop, sent = threading.Event(), []

    def send(_plan: dict) -> None:
        until(lambda: "node2" in workers_of(run), "node2's process")
        os.kill(workers_of(run)["node2"], signum)
        sent.append(signum)

    tail = when_event(run, lambda e: e["kind"] == "plan" and "node2" in e.get("standby", []),
                      send, stop)
    try:
        assert train(cfg, run, progress=False, joins=[5]) == 0
    finally:
        stop.set()
        tail.join(timeout=5)
    return bool(sent)


def test_a_standby_node_lost_costs_training_nothing(tmp_path, tmp_path_factory, corpus):
    """A joiner with no place in the layout waits on standby; killed there, it is counted out
    without a plan: no abort, no agreement, no new generation, and the run ends bit-identical
    to the failure-free one."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 40})
    run = tmp_path / "run"
    assert _signalled_on_standby(cfg, run, signal.SIGKILL), "node2 was never put on standby"
    evs = events(run)
    lost = [i for i, e in enumerate(evs) if e["kind"] == "standby_lost"]
    assert [evs[i]["node"] for i in lost] == ["node2"]
    after = {e["kind"] for e in evs[lost[0]:]}
    assert not after & {"failure_detected", "agreement", "plan", "node_lost"}, after
    assert [e["action"] for e in evs if e["kind"] == "plan"] == ["keep"]  # the placement
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == list(range(40))
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=1,
                                                      **{**FAST, "iterations": 40}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_samples_exactly_once(run, cfg)
    assert_nothing_left(run, store_port(run))


def test_spares_form_again_the_pipeline_a_drop_took_away(tmp_path, tmp_path_factory, corpus):
    """Two joiners wait on standby (4 micro-batches do not split over 3 pipelines); when both
    stages of pipeline 0 are lost, it is dropped, and at the next boundary the two spares
    form a pipeline again, with no node joining in between."""
    cfg = _two_by_two(corpus)
    run = tmp_path / "run"
    assert train(cfg, run, progress=False, faults=_pipeline_0_lost(12), joins=[3, 3]) == 0
    evs = events(run)
    plans = [e for e in evs if e["kind"] == "plan"]
    actions = [p["action"] for p in plans]
    assert "drop_pipeline" in actions, actions
    drop = actions.index("drop_pipeline")
    assert actions[drop + 1:] == ["add_pipeline"], actions
    assert sorted(plans[drop]["standby"]) == ["node4", "node5"]
    assert not [e for e in evs[evs.index(plans[drop]):] if e["kind"] == "join_accepted"]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    widths = [m["live_nodes"] for m in metrics]
    assert widths[0] == 4 and 2 in widths and widths[-1] == 4, widths
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=2,
                                                      **{**FAST, **SGD, "iterations": 40}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert_close_where_width_changed(got, want)  # D changed twice: other summation orders
    assert_nothing_left(run, store_port(run))


def test_a_drop_keeps_a_width_the_batch_splits_over_and_spares_form_two_pipelines(
        tmp_path, tmp_path_factory, corpus):
    """P = 2 x D = 4 with 8 micro-batches; both stages of pipeline 0 are lost. Three pipelines
    would not split the batch (this used to stop the job): pipelines 1 and 2 run on, pipeline
    3's nodes wait on standby. Two nodes join later: with the two waiting they form pipelines
    2 and 3 in one decision (D = 3 would not split the batch either)."""
    cfg = tiny_config(corpus, stages=2, pipelines=4, redundancy="lazy", num_microbatches=2,
                      **{**FAST, **SGD, "iterations": 24})
    run = tmp_path / "run"
    nodes = [f"node{r}" for r in range(8)]
    faults = [Fault.parse("fail", f"{n}@5:backward", nodes) for n in nodes[:2]]
    assert train(cfg, run, progress=False, faults=faults, joins=[12, 12]) == 0
    plans = [e for e in events(run) if e["kind"] == "plan"]
    actions = [p["action"] for p in plans]
    drop = actions.index("drop_pipeline")
    assert sorted(plans[drop]["standby"]) == ["node6", "node7"], plans[drop]
    add = actions.index("add_pipeline")
    assert add > drop and actions[add + 1:] == [], actions
    assert sorted(plans[add]["standby"]) == [], plans[add]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    widths = [m["live_nodes"] for m in metrics]
    assert widths[0] == 8 and 4 in widths and widths[-1] == 8, widths
    assert 6 not in widths, widths  # never three pipelines
    assert_samples_exactly_once(run, cfg)
    want = failure_free(tmp_path_factory, tiny_config(
        corpus, stages=2, pipelines=4, num_microbatches=2, **{**FAST, **SGD, "iterations": 24}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert_close_where_width_changed(got, want)
    assert_nothing_left(run, store_port(run))


def test_a_standby_node_with_a_notice_leaves_at_once(tmp_path, tmp_path_factory, corpus):
    """A joiner waiting on standby gets SIGTERM (a preemption notice): it leaves while the job
    trains, so no plan can place a node about to go, and training goes on untouched. Before,
    the node waited for its answer inside the store's C++ wait, where Python runs no signal
    handler: the notice was handled only when the job ended and answered "finished"."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "iterations": 100})
    run = tmp_path / "run"
    assert _signalled_on_standby(cfg, run, signal.SIGTERM), "node2 was never put on standby"
    evs = events(run)
    kinds = [(e["kind"], e.get("node")) for e in evs]
    assert ("notice", "node2") in kinds and ("leaving_standby", "node2") in kinds, kinds
    lost = [e for e in evs if e["kind"] == "standby_lost"]
    assert [(e["node"], e["returncode"]) for e in lost] == [("node2", 0)]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == list(range(100))
    assert lost[0]["time_s"] < metrics[-1]["time_s"]  # it left while the job trained
    assert [e["action"] for e in evs if e["kind"] == "plan"] == ["keep"]  # the placement
    want = failure_free(tmp_path_factory, tiny_config(corpus, stages=2, pipelines=1,
                                                      **{**FAST, "iterations": 100}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_samples_exactly_once(run, cfg)
    assert_nothing_left(run, store_port(run))
