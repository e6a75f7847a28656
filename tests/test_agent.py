"""`spotpipe agent`: agents on loopback, each a separate process with its own --out folder (as
separate hosts would be), meet at a rendezvous (c10d or etcd), elect a coordinator and train
the job to the same final parameters as `spotpipe train`; a stranger is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train

from conftest import REPO, assert_close_where_width_changed, tiny_config
from etcd_server import free_port
from test_cli_errors import workers_running
from test_failover import FAST, assert_samples_exactly_once, events, failure_free

TOKEN = "sesame"
# a run spec where a test reaches only the data digest of it (one host's data: none)
UNREAD_SPEC = SimpleNamespace(data_digest="")


def _config(corpus, iterations: int, **extra):
    return tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                       **{**FAST, "iterations": iterations, **extra})


# Three strangers starting Python and torch at once starve the job's workers on a small
# machine for seconds: detection this lenient keeps a busy worker from being fenced as hung.
LENIENT = {"failover.heartbeat_timeout_s": 30.0, "failover.hang_timeout_s": 30.0}


# An agent that has done everything `spotpipe agent` does before it meets the rendezvous
# (imports, the model's profile, the data's digest: seconds on a busy machine), says so on its
# stdout (AT_THE_GATE), then waits for a line on its stdin: the test opens the gate at the
# moment it chooses, and the agent then acts at once. (Gated before its imports only, a
# stranger once came after the job had ended, took the vacant rendezvous for a job of its own
# and waited there for a second agent.) Its stdin closed without a line, it exits 3.
AT_THE_GATE = "at the gate"
GATED = ("import sys\n"
         "from spotpipe.cluster import agent\n"
         "from spotpipe.cli.main import main\n"
         "run = agent.Agent.run\n"
         "def gated(self):\n"
         f"    print({AT_THE_GATE!r}, flush=True)\n"
         "    return run(self) if sys.stdin.readline() else 3\n"
         "agent.Agent.run = gated\n"
         "raise SystemExit(main(sys.argv[1:]))\n")


def _at_the_gate(proc: subprocess.Popen) -> None:
    """Until a gated agent waits at its gate (it says so on its stdout)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == AT_THE_GATE:
            return
    proc.wait(timeout=60)
    raise AssertionError(f"the gated agent exited {proc.returncode} before its gate: "
                         f"{proc.stderr.read()[-2000:] if proc.stderr else ''}")


def _agent(config: Path, out: Path, backend: str, endpoint: str, *, token: str = TOKEN,
           job: str = "job1", nnodes: str = "2:3", gated: bool = False,
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ, SPOTPIPE_JOIN_TOKEN=token,
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    start = ["-c", GATED] if gated else ["-m", "spotpipe"]
    return subprocess.Popen(
        [sys.executable, *start, "agent", str(config), "--rdzv-backend", backend,
         "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--nnodes", nnodes, "--out", str(out),
         "--no-progress", *(["--on-demand"] if backend == "c10d" else []), *extra], env=env,
        stdin=subprocess.PIPE if gated else None, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # (its own process group, as on its own host's terminal)


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    done = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        done.append((p.returncode, err))
    return done


def _coordinator_out(outs: list[Path]) -> Path:
    """The folder of the agent that coordinated (the only one with the run's summary)."""
    found = [o for o in outs if (o / "summary.json").exists()]
    assert len(found) == 1, found
    return found[0]


def _coordinating_once_training(outs: list[Path], agents: list[subprocess.Popen],
                                before: str) -> int:
    """Wait (on the run's metrics, a real condition) until the job has trained 5 iterations;
    the index of the coordinating agent (the one whose --out has the run's events)."""
    def iteration(out: Path) -> int:
        lines = (out / "metrics.jsonl").read_text().splitlines() \
            if (out / "metrics.jsonl").exists() else []
        return json.loads(lines[-1])["iter"] if lines else -1

    while max(iteration(o) for o in outs) < 5 and all(a.poll() is None for a in agents):
        time.sleep(0.05)
    assert all(a.poll() is None for a in agents), f"the job ended before {before}"
    return next(i for i, o in enumerate(outs) if (o / "events.jsonl").exists())


def _write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


@pytest.mark.parametrize("backend", ["c10d", "etcd-tls"])
def test_agents_train_like_spotpipe_train(tmp_path, tmp_path_factory, corpus, backend,
                                          request):
    """etcd-tls: over an etcd that serves only hosts whose certificate its CA signed (the
    other agent tests meet etcd over plain HTTP); the workers reach it with their agent's
    certificate."""
    cfg = _config(corpus, 12)
    config = _write_config(cfg, tmp_path / "job.yaml")
    extra: tuple[str, ...] = ()
    if backend == "etcd-tls":
        server = request.getfixturevalue("etcd_tls")
        endpoint, backend, certs = server.endpoint, "etcd", server.tls
        extra = ("--rdzv-conf", f"protocol=https,cacert={certs.ca_crt},cert={certs.client_crt}"
                                f",key={certs.client_key}")
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    results = _finish([_agent(config, out, backend, endpoint, extra=extra) for out in outs])
    for code, err in results:
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    admitted = [e for e in events(run) if e["kind"] == "agent_admitted"]
    assert sorted(r for e in admitted for r in e["ranks"]) == [0, 1]
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)  # D = 1: the single-process loop
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # each host ran its own worker and kept its log; no process is left
    assert all((out / "logs").glob("node*.log") for out in outs)
    assert sorted(p.name for out in outs for p in (out / "logs").glob("node*.log")) == \
        ["node0.log", "node1.log"]
    assert all(workers_running(out) == [] for out in outs)


def test_a_host_that_comes_later_than_the_store_timeout_still_starts_the_job(
        tmp_path, tmp_path_factory, corpus):
    """The second of the first layout's hosts comes more than cluster.timeout_s after the
    first (a slower boot), within --rdzv-timeout. The first host's workers once started at
    its admission and gave up forming the job's groups after cluster.timeout_s, and the job
    failed ("timed out after 3.0 s waiting for .../gen0/world/0/1"); the agents are now
    answered once all of them came, and the job completes as the plain loop trains."""
    import time

    cfg = _config(corpus, 12, **{"cluster.timeout_s": 3.0})
    config = _write_config(cfg, tmp_path / "job.yaml")
    endpoint = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    first = _agent(config, outs[0], "c10d", endpoint)  # (it hosts the store, and coordinates)
    said = _Lines(first)
    said.wait_for("coordinates job")
    late = _agent(config, outs[1], "c10d", endpoint, gated=True)
    _at_the_gate(late)  # (ready to arrive at once when told)
    time.sleep(2 * cfg.cluster.timeout_s)  # the late host's delay: what is tested, no wait
    assert first.poll() is None and late.stdin is not None
    late.stdin.write("go\n")
    late.stdin.flush()
    code, err = _finish([late])[0]
    assert code == 0, err[-2000:]
    assert first.wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    got = load_file(str(outs[0] / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stranger_agents_are_refused_and_the_job_completes(tmp_path, tmp_path_factory, corpus,
                                                           etcd):
    cfg = _config(corpus, 200, **LENIENT)
    config = _write_config(cfg, tmp_path / "job.yaml")
    text = config.read_text()
    other_model = tmp_path / "other_model.yaml"
    other_model.write_text(text.replace("n_embd: 32", "n_embd: 16"))
    other_config = tmp_path / "other_config.yaml"
    other_config.write_text(text.replace("seed: 1", "seed: 7"))
    # the strangers are ready before the job starts, and come only once it trains (the gate,
    # see GATED): the job need only outlast their refusal
    strangers = {
        "token": _agent(config, tmp_path / "s_token", "etcd", etcd.endpoint, token="nope",
                        gated=True),
        "model": _agent(other_model, tmp_path / "s_model", "etcd", etcd.endpoint, gated=True),
        "config": _agent(other_config, tmp_path / "s_config", "etcd", etcd.endpoint,
                         gated=True)}
    for stranger in strangers.values():
        _at_the_gate(stranger)
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    agents = [_agent(config, out, "etcd", etcd.endpoint) for out in outs]

    def training() -> bool:  # a real condition: some agent's run folder has metrics
        return any((o / "metrics.jsonl").exists() and (o / "metrics.jsonl").read_text().strip()
                   for o in outs)

    while not training() and all(a.poll() is None for a in agents):
        time.sleep(0.05)
    assert all(a.poll() is None for a in agents), "the job ended before the stranger came"
    # a process with the store's address but not the token takes two arrival numbers: one
    # slot gets bytes that are no record, the other a closing marker of its own (which would
    # end admission); neither may crash or close the coordinator's admission
    from datetime import timedelta

    from spotpipe.protocol import ArrivalsClosed, keys, plain, vouch
    from spotpipe.store.address import job_prefix
    from spotpipe.store.etcd import EtcdStore

    host, port = etcd.endpoint.rsplit(":", 1)
    forger = EtcdStore(host, int(port), job_prefix("job1"), timeout=timedelta(seconds=30))
    junk, marker = forger.add(keys.ARRIVALS, 1), forger.add(keys.ARRIVALS, 1)
    forger.set(keys.arrival(junk), b"\xff not a record")
    forger.set(keys.arrival(marker), plain(vouch(ArrivalsClosed(), "not the token",
                                                 f"job1/{keys.arrival(marker)}")))
    for stranger in strangers.values():
        assert stranger.poll() is None and stranger.stdin is not None
        stranger.stdin.write("go\n")
        stranger.stdin.flush()
    answers = dict(zip(strangers, _finish(list(strangers.values()))))
    for what, (code, err) in answers.items():
        assert code == 2 and "refused" in err, (what, err[-2000:])
    assert "SPOTPIPE_JOIN_TOKEN" in answers["token"][1]
    assert "another model" in answers["model"][1]
    assert "(model.gpt.n_embd differs)" in answers["model"][1]  # named, not only counted
    assert "another configuration (seed differs)" in answers["config"][1]
    for code, err in _finish(agents):
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    reasons = sorted(e["reason"] for e in events(run) if e["kind"] == "join_refused")
    assert len(reasons) == 3 and any("join token" in r for r in reasons)
    assert any("another model" in r for r in reasons)
    assert any("another configuration" in r for r in reasons)
    forged = {e["writer"]: e["reason"] for e in events(run) if e["kind"] == "record_refused"}
    assert "not a JSON record" in forged[f"agent{junk}"], forged
    assert "closing marker without the job's proof" in forged[f"agent{marker}"], forged
    assert [e for e in events(run) if e["kind"] == "plan"] == []  # the job was undisturbed
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)  # D = 1: the single-process loop
    assert all(torch.equal(got[k], want[k]) for k in want)
    for out in outs:  # gather the hosts' sample logs, as one would from real machines
        for log in (out / "logs").glob("samples.*.jsonl"):
            if out != run:
                (run / "logs" / log.name).write_bytes(log.read_bytes())
    assert_samples_exactly_once(run, cfg)
    for what in answers:  # they started no worker
        assert not (tmp_path / f"s_{what}" / "logs").exists()


def test_agent_input_errors_start_nothing(tmp_path, corpus, monkeypatch):
    from spotpipe.cli.main import build_parser

    config = _write_config(_config(corpus, 3), tmp_path / "job.yaml")

    def run(*flags: str, token: str | None = TOKEN) -> tuple[int, str]:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        env.pop("SPOTPIPE_JOIN_TOKEN", None)
        if token:
            env["SPOTPIPE_JOIN_TOKEN"] = token
        p = subprocess.run([sys.executable, "-m", "spotpipe", "agent", str(config), *flags],
                           env=env, capture_output=True, text=True, timeout=120)
        return p.returncode, p.stderr

    base = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "x",
            "--out", str(tmp_path / "out")]
    code, err = run("--nnodes", "2", *base, token=None)
    assert code == 2 and "SPOTPIPE_JOIN_TOKEN" in err
    code, err = run("--nnodes", "3", *base)
    assert code == 2 and "--nnodes 3:3" in err and "2 nodes" in err
    code, err = run("--nnodes", "2", "--rdzv-endpoint", "nohost", "--rdzv-id", "x",
                    "--out", str(tmp_path / "out"))
    assert code == 2 and "--rdzv-endpoint" in err
    code, err = run("--nnodes", "2", "--rdzv-backend", "etcd", *base)
    assert code == 2 and "--rdzv-endpoint" in err and "unreachable" in err
    # (a --resume this host lacks is sent by the coordinating agent; one that is there but
    # is no checkpoint is an input error)
    (tmp_path / "empty").mkdir()
    code, err = run("--nnodes", "2", "--rdzv-backend", "etcd", *base,
                    "--resume", str(tmp_path / "empty"))
    assert code == 2 and "--resume" in err and "nothing to resume from" in err, err[-1000:]
    # the c10d store on this host, which nobody said is on-demand
    code, err = run("--nnodes", "2", "--rdzv-backend", "c10d", *base)
    assert code == 2 and "--on-demand" in err and "spot host" in err
    code, err = run("--nnodes", "2", "--rdzv-backend", "c10d", "--on-demand", *base,
                    "--max-restarts", "-1")
    assert code == 2 and "--max-restarts -1: expected >= 0" in err, err[-1000:]
    # CPU shadows beside a coordinator that etcd elects among hosts the job may lose
    _write_config(_config(corpus, 3, **{"shadow.enabled": True}), config)
    code, err = run("--nnodes", "2", "--rdzv-backend", "etcd", *base)
    assert code == 2 and "shadow.enabled with --rdzv-backend etcd" in err, err[-1000:]
    # torchrun-style environment variables stand in for flags
    monkeypatch.setenv("PET_NNODES", "1:4")
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    args = build_parser().parse_args(["agent", str(config)])
    assert args.nnodes == "1:4" and args.rdzv_backend == "etcd" and args.max_restarts == 3
    # and are checked as the flags are: a usage error naming the flag, not a traceback
    for name, value in (("PET_MAX_RESTARTS", "abc"), ("PET_NPROC_PER_NODE", "two"),
                        ("PET_RDZV_TIMEOUT", "nan")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["agent", str(config)])
        assert exit_.value.code == 2
        monkeypatch.delenv(name)
    assert not (tmp_path / "out").exists()


def test_with_c10d_only_the_agent_hosting_the_store_coordinates():
    """Without succession the coordinator's host must be one the job cannot lose: the
    store's, which the operator said is on-demand. An agent that does not host the store
    never claims the office, even when it finds it vacant (it arrived first)."""
    import torch.distributed as dist

    from spotpipe.cluster.office import c10d_elected
    from spotpipe.cluster.rendezvous import COORDINATOR

    store = dist.HashStore()
    assert not c10d_elected(store, 1, hosts_store=False) and not store.check([COORDINATOR])
    assert c10d_elected(store, 2, hosts_store=True) and store.get(COORDINATOR) == b"2"


def test_a_notice_to_the_c10d_stores_host_says_the_job_goes_with_it(corpus, tmp_path, capfd):
    """With c10d the store and the coordinator live on the host started with --on-demand:
    if that host is reclaimed all the same, nothing can carry the job on, and its agent says
    so at the notice (once, and only there: another host's agent leaves quietly), rather
    than leave the other hosts to fail later on a store that is gone."""
    import torch.distributed as dist

    from spotpipe.cluster.agent import Agent, AgentOptions

    opts = AgentOptions(backend="c10d", endpoint="127.0.0.1:1", rdzv_id="x", min_nodes=2,
                        max_nodes=2, out=tmp_path, on_demand=True)
    hosting = Agent(opts, _config(corpus, 3), None, TOKEN, None,  # type: ignore[arg-type]
                    dist.HashStore())
    hosting._heard_notice("AWS spot instance-action terminate")
    hosting._heard_notice("GCP preempted")
    said = capfd.readouterr().err
    assert said.count("yet it is being reclaimed: the job cannot outlive it") == 1, said
    assert "--rdzv-backend etcd" in said and hosting._signalling
    other = Agent(opts, _config(corpus, 3), None, TOKEN, None, None)  # type: ignore[arg-type]
    other._heard_notice("AWS spot instance-action terminate")
    assert "cannot outlive it" not in capfd.readouterr().err and other._signalling


def test_the_coordinators_host_is_followed_when_it_comes_again(corpus, tmp_path):
    """A fenced node of the coordinating agent's host comes again under a new arrival
    number, its host's nodes moved to it: the coordinator's own nodes (which its hand-over
    waits for) and the books' record of its host (whose nodes a successor counts lost)
    follow, while the office stays under the number it was won with."""
    from spotpipe.cluster.admission import Coordinating
    from spotpipe.cluster.agent import AgentOptions
    from spotpipe.protocol import AgentArrival

    opts = AgentOptions(backend="etcd", endpoint="127.0.0.1:1", rdzv_id="x", min_nodes=2,
                        max_nodes=3, out=tmp_path, nproc=2)
    c = Coordinating(opts, _config(corpus, 3), UNREAD_SPEC, TOKEN, None, me=1)  # type: ignore[arg-type]
    c._admitted, c._nodes = [1, 2], ["node0", "node1", "node2", "node3"]
    c._agent_nodes = {1: ["node0", "node1"], 2: ["node2", "node3"]}
    c._problem = lambda k, info, late: None  # (admission's checks: tested above)
    c._answer = lambda store, k, answer: None
    again = AgentArrival(host="a", nproc=1, node_rank=-1, proof="", model_digest="",
                         config_digest="", rejoin_of=1)
    c._admit(None, 3, again, late=True)
    assert c.own_nodes() == ["node0", "node1", "node4"] and c.me == 1
    assert c.others_nodes() == {"node2", "node3"}
    assert c.admission()["host"] == 3


def test_no_worker_starts_once_the_host_leaves_or_the_job_ended(corpus, tmp_path):
    """A replacement queued for the spawner (a fenced or killed worker's) is started; one that
    a notice overtakes while it starts is given the notice by the spawner (the notice's
    handler does not wait for the spawner); none starts once the job's stop began (it would
    outlive the stop), and it counts as over, so the agent's wait for its workers' exits
    ends."""
    import queue
    import threading

    from spotpipe.cluster.agent import Agent, AgentOptions

    cfg = _config(corpus, 3)
    opts = AgentOptions(backend="c10d", endpoint="127.0.0.1:1", rdzv_id="x", min_nodes=2,
                        max_nodes=2, out=tmp_path)
    agent = Agent(opts, cfg, UNREAD_SPEC, TOKEN, None, None)  # type: ignore[arg-type]
    started: list[list[int]] = []
    agent._spawn = lambda ranks, world, joining, places: started.append(ranks)
    agent._spawns = queue.Queue()
    agent._pending = 2  # the replacement below, and one worker still running
    threading.Thread(target=agent._spawner, daemon=True).start()
    agent._spawns.put(([4], 4, [0]))
    agent._spawns.put(([5], 4, [1]))
    deadline = time.time() + 10
    while len(started) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert started == [[4], [5]]
    # a notice while a replacement starts: the spawner passes it on to the new worker
    signalled: list[str] = []

    class _Supervisor:
        procs: dict = {}

        def signal(self, node, sig):
            signalled.append(node)

    def notice_meanwhile(ranks, world, joining, places):
        started.append(ranks)
        agent._pass_notice()  # the handler, while the worker was being started

    agent.supervisor = _Supervisor()
    agent._spawn = notice_meanwhile
    agent._spawns.put(([7], 4, [0]))
    deadline = time.time() + 10
    while not signalled and time.time() < deadline:
        time.sleep(0.01)
    assert started[-1] == [7] and signalled == ["node7"]
    started.pop()
    agent._pending = 2
    agent._stop_spawning()  # what the job's stop does first (a notice sets the same flag)
    agent._spawns.put(([6], 4, [0]))
    agent._done_with(1)  # the running worker exits
    assert agent._exits_done.wait(10), "the wait for the workers' exits would not end"
    assert started == [[4], [5]]


def test_a_lost_host_fails_over_to_the_other(tmp_path, tmp_path_factory, corpus, etcd):
    """SIGKILL one agent (its host is gone, its worker dies with it): no exit is ever reported,
    so the coordinator fences the silent node after the heartbeat timeout and fails over; the
    job completes with the same parameters as the single-process loop."""
    cfg = _config(corpus, 300)
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    agents = [_agent(config, out, "etcd", etcd.endpoint) for out in outs]
    coordinating = _coordinating_once_training(outs, agents, "a host could be lost")
    lost = agents[1 - coordinating]
    lost.kill()
    (code, err), (lost_code, _) = _finish([agents[coordinating], lost])
    assert code == 0, err[-2000:]
    assert lost_code == -9
    run = outs[coordinating]
    kinds = [e["kind"] for e in events(run)]
    assert "agent_silent" in kinds and "takeover" in kinds
    assert [e["action"] for e in events(run) if e["kind"] == "plan"] == ["failover"]
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)  # D = 1: the single-process loop
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(workers_running(out) == [] for out in outs)


def test_a_node_lost_while_it_uploads_its_stage_fails_only_that_checkpoint(
        tmp_path, tmp_path_factory, corpus):
    """node1's host does not see the coordinator's checkpoint folder, and node1 dies right
    after it announced its stage of iteration 2 (`--fail node1@2:upload`, given to both agents:
    only the host running node1 acts on it). The committer, waiting for that stage's pieces,
    hears of the loss from the coordinator's loop instead of waiting out cluster.timeout_s
    (300 s here): iteration 2 is never committed, the job fails over and commits iteration 5,
    and its parameters are the single-process loop's.

    The second agent starts once the first coordinates: it then arrives second and runs node1
    (started together, the agent that arrives first need not be the one that wins the office,
    and node1 would then be on the coordinator's host, which uploads nothing)."""
    cfg = _config(corpus, 8, **{"checkpoint.every": 3, "cluster.timeout_s": 300.0})
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [_agent(config, outs[0], "c10d", endpoint, extra=("--fail", "node1@2:upload"))]
    said = _Lines(agents[0])
    said.wait_for("coordinates job")
    agents.append(_agent(config, outs[1], "c10d", endpoint, extra=("--fail", "node1@2:upload")))
    assert agents[0].wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    for code, err in _finish(agents[1:]):
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    assert run == outs[0]
    ev = events(run)
    announced = [e for e in ev if e["kind"] == "checkpoint_upload"]
    assert [(e["node"], e["iteration"]) for e in announced] == [("node1", 2)]
    failed = [e for e in ev if e["kind"] == "checkpoint_failed"]
    assert [(e["iteration"], e["message"]) for e in failed] == \
        [(2, "node1 was lost while it sent its stage")]
    assert [e["iteration"] for e in ev if e["kind"] == "checkpoint_committed"] == [5]
    # not held for the 300 s timeout: the job's whole run took a fraction of it
    assert max(e["time_s"] for e in ev) < 150, max(e["time_s"] for e in ev)
    assert "takeover" in [e["kind"] for e in ev]
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)  # D = 1: the single-process loop
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("folders", ["separate", "shared"])
def test_multi_host_checkpoints_are_whole_and_resume_on_another_layout(tmp_path, corpus,
                                                                       monkeypatch, folders):
    """Two agents with their own --out: with the default checkpoint.dir (OUT/checkpoints,
    not shared) the other host's stage travels through the store; with one shared folder it
    is written in place. Either way the coordinator's checkpoint is whole, and resumes at
    P = 1 to the agents' own final parameters."""
    from spotpipe.checkpoint import durable

    extra = {"checkpoint.every": 3}
    if folders == "shared":
        extra["checkpoint.dir"] = str(tmp_path / "shared")
    cfg = _config(corpus, 8, **extra)
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    endpoint = f"127.0.0.1:{free_port()}"
    for code, err in _finish([_agent(config, out, "c10d", endpoint) for out in outs]):
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    other = next(o for o in outs if o != run)
    probes = [e for e in events(run) if e["kind"] == "checkpoint_dir_probe"]
    root = tmp_path / "shared" if folders == "shared" else run / "checkpoints"
    if folders == "shared":
        assert [e["shared"] for e in probes] == [True, True]
    else:  # the coordinator's own host sees its folder; the other host does not
        assert sorted((e["path"], e["shared"]) for e in probes) == sorted(
            [(str(root), True), (str(other / "checkpoints"), False)])
    committed = [e["iteration"] for e in events(run) if e["kind"] == "checkpoint_committed"]
    assert committed == [2, 5]
    newest = durable.verify(root / "iter_00000005")  # every file listed, every file there
    assert {name.split("/")[0] for name in newest.manifest["checksums"]} == {"stage0", "stage1"}
    if folders == "separate":
        assert not list((other / "checkpoints").glob("*iter_*"))  # nothing left behind
        saved = [e for e in events(run) if e["kind"] == "checkpoint_saved"]
        uploaded = [e for e in saved if e.get("uploaded")]
        # sent by the uploader thread, then reported: every iteration's stage, with its time
        assert sorted(e["iteration"] for e in uploaded) == [2, 5]
        assert all(e["upload_s"] > 0 for e in uploaded)
    # resume on another layout, under the same token (the manifests' MAC key)
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", TOKEN)
    resumed = tmp_path / "resumed"
    assert train(tiny_config(corpus, stages=1, pipelines=1, **{**FAST, "iterations": 8}),
                 resumed, progress=False, resume=root / "iter_00000002") == 0
    got = load_file(str(resumed / "final" / "model.safetensors"))
    want = load_file(str(run / "final" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


class _Lines:
    """A running process's stderr, read on a thread: the lines so far, and a wait for one."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float = 120.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: any(text in l for l in self.lines), timeout_s), \
                f"no line with {text!r} in: {''.join(self.lines)[-2000:]}"


def test_agents_resume_from_a_checkpoint_and_refuse_one_without_it(tmp_path, corpus,
                                                                    monkeypatch):
    """`spotpipe agent --resume`: agents start a job from a durable checkpoint that `spotpipe
    train` wrote (under the same token, the manifests' MAC key), each host's workers loading
    their stages from it, and train to the same final parameters as the run that wrote it.
    While the job resumes, an agent given no --resume is refused with a message that says so
    (its workers would start from iteration 0). An agent whose host lacks the checkpoint
    (here: its --resume names a folder that does not exist) is sent the coordinating agent's
    copy through the store (only the stage folder its worker loads: without redundancy, its
    own stage's), checks it, and its workers load from that."""
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", TOKEN)
    first = tmp_path / "first"
    assert train(_config(corpus, 8, **{"checkpoint.every": 3}), first, progress=False) == 0
    checkpoint = first / "checkpoints" / "iter_00000002"
    config = _write_config(tiny_config(corpus, stages=2, pipelines=1, redundancy="none",
                                       **{**FAST, "iterations": 8}), tmp_path / "job.yaml")
    endpoint = f"127.0.0.1:{free_port()}"
    coordinating = _agent(config, tmp_path / "host_a", "c10d", endpoint, nnodes="2",
                          extra=("--resume", str(checkpoint)))
    said = _Lines(coordinating)
    said.wait_for("coordinates job")
    code, err = _finish([_agent(config, tmp_path / "host_b", "c10d", endpoint, nnodes="2")])[0]
    assert code == 2 and "was given no --resume" in err and "iteration 2" in err, err[-2000:]
    elsewhere = tmp_path / "not_on_this_host" / "iter_00000002"
    other = _agent(config, tmp_path / "host_c", "c10d", endpoint, nnodes="2",
                   extra=("--resume", str(elsewhere)))
    code, err = _finish([other])[0]
    assert code == 0 and "received the coordinating agent's copy" in err, err[-2000:]
    assert coordinating.wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    run = tmp_path / "host_a"
    got_events = events(run)
    assert got_events[0]["resumed_from"] == str(checkpoint)
    assert got_events[0]["start_iteration"] == 3
    sent = [e for e in got_events if e["kind"] == "checkpoint_sent"]
    assert [(e["node"], e["nodes"]) for e in sent] == [("agent3", ["node1"])]
    copy = tmp_path / "host_c" / "resume" / "iter_00000002"
    assert (copy / "manifest.json").read_bytes() == (checkpoint / "manifest.json").read_bytes()
    # node1 runs stage 1 and holds no replica: stage1/ and the manifest went, stage0/ did not
    assert sorted(p.name for p in copy.iterdir()) == ["manifest.json", "stage1"]
    whole = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert sent[0]["files"] == 1 + sum(p.parent.name == "stage1" for p in whole)
    assert sent[0]["bytes"] == sum(p.stat().st_size for p in whole
                                   if p.parent.name in ("stage1", checkpoint.name))
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["iter"] for m in metrics] == list(range(3, 8))
    got = load_file(str(run / "final" / "model.safetensors"))
    want = load_file(str(first / "final" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a coordinating agent that lacks the checkpoint cannot send it: the job ends at once
    alone = _agent(config, tmp_path / "host_d", "c10d", f"127.0.0.1:{free_port()}",
                   nnodes="2", extra=("--resume", str(elsewhere)))
    code, err = _finish([alone])[0]
    assert code == 1 and "not found on the coordinating agent's host" in err, err[-2000:]


def test_the_first_layout_admits_only_agents_that_resume_from_the_jobs_checkpoint(corpus,
                                                                                   tmp_path):
    """The coordinating agent's check of what an arriving agent resumes from: the same
    manifest (wherever its copy lies), or none on both sides."""
    from spotpipe.checkpoint.durable import Checkpoint
    from spotpipe.cluster.admission import Coordinating
    from spotpipe.cluster.agent_options import AgentOptions
    from spotpipe.protocol import AgentArrival
    from spotpipe.store.address import StoreAddress

    cfg = _config(corpus, 8)
    opts = AgentOptions("c10d", "127.0.0.1:1", "job", 2, 2, tmp_path)
    ours = Checkpoint(tmp_path / "a" / "iter_00000002", {"next_iteration": 3, "seed": 1})
    copy = Checkpoint(tmp_path / "b" / "iter_00000002", dict(ours.manifest))
    other = Checkpoint(tmp_path / "a" / "iter_00000005", {"next_iteration": 6, "seed": 1})

    def problem(job_resumes: Checkpoint | None, brings: Checkpoint | None,
                fetch: bool = False) -> str | None:
        coordinating = Coordinating(opts, cfg, UNREAD_SPEC,  # type: ignore[arg-type] (spec: unread)
                                    TOKEN, StoreAddress("tcp", "127.0.0.1", 1),
                                    checkpoint=job_resumes)
        arrival = AgentArrival(host="h", nproc=1, node_rank=-1, proof="", model_digest="",
                               config_digest="",
                               resume_from=str(brings.path) if brings else "",
                               resume_digest=brings.digest if brings else "",
                               resume_fetch=fetch)
        return coordinating._resume_problem(arrival)

    assert problem(None, None) is None and problem(ours, ours) is None
    assert problem(ours, copy) is None  # the same checkpoint, copied to another path
    assert "not the same checkpoint" in problem(ours, other)
    assert "was given no --resume" in problem(ours, None)
    assert "starts from iteration 0" in problem(None, ours)
    # given --resume on a host that lacks it: sent the job's copy, or refused if there is none
    assert problem(ours, None, fetch=True) is None
    assert "starts from iteration 0" in problem(None, None, fetch=True)


def test_a_received_checkpoint_that_fails_its_check_ends_the_job_naming_the_node(
        tmp_path, corpus, monkeypatch):
    """The coordinating agent loads a checkpoint of another token's job with
    --trust-checkpoint; an agent whose host lacks it was not given that flag, so the copy it
    receives fails its check (the MAC). It says why in the job's events and reports its node
    failed, and the job ends there, naming the node, instead of when forming the groups times
    out (cluster.timeout_s, 300 s here)."""
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "another job's token")
    first = tmp_path / "first"
    assert train(_config(corpus, 8, **{"checkpoint.every": 3}), first, progress=False) == 0
    checkpoint = first / "checkpoints" / "iter_00000002"
    config = _write_config(_config(corpus, 8, **{"cluster.timeout_s": 300.0}),
                           tmp_path / "job.yaml")
    endpoint = f"127.0.0.1:{free_port()}"
    coordinating = _agent(config, tmp_path / "host_a", "c10d", endpoint, nnodes="2",
                          extra=("--resume", str(checkpoint), "--trust-checkpoint"))
    said = _Lines(coordinating)
    said.wait_for("coordinates job")
    lacking = _agent(config, tmp_path / "host_b", "c10d", endpoint, nnodes="2",
                     extra=("--resume", str(tmp_path / "elsewhere" / checkpoint.name)))
    code, err = _finish([lacking])[0]
    assert code == 1 and "the coordinating agent's copy, received" in err, err[-2000:]
    # (both bounds are half of cluster.timeout_s: the job and the agents' confirmation of its
    # end do not wait out a timeout; the run takes seconds)
    assert coordinating.wait(timeout=150) == 1, "".join(said.lines)[-2000:]
    ev = events(tmp_path / "host_a")
    assert [e["time_s"] < 150 for e in ev if e["kind"] == "job_failed"] == [True]
    [failed] = [e for e in ev if e["kind"] == "resume_failed"]
    assert failed["ranks"] == [1] and "--trust-checkpoint" in failed["message"]
    assert any(e["kind"] == "checkpoint_trusted" for e in ev)
    summary = json.loads((tmp_path / "host_a" / "summary.json").read_text())
    assert summary["status"] == "failed" and "node1" in summary["message"], summary


def test_a_node_hung_while_its_host_regroups_is_fenced_through_its_agent(tmp_path,
                                                                        tmp_path_factory,
                                                                        corpus):
    """Two hosts of two workers each (P = 2 x D = 2). node1 crashes; node0, its heir, stops
    before its new groups form (`--hang node0@3:regroup`, given to both agents: each injects
    only into its own workers). Its agent's supervisor fences it at the hang timeout, named by
    its step, rather than the other pipeline waiting for it until `cluster.timeout_s` (10
    minutes here); the job drops the broken pipeline, takes the re-admitted host's new
    workers back in, and completes with the failure-free run's parameters. Each host's two
    workers send their final stages themselves: an agent that sent them after the workers'
    exits sent each twice on one stream and the job failed or waited at its end."""
    # no biases: the attention key's bias has no true gradient, so AdamW moves it on the
    # rounding noise of the gradients' sums, whose order changes with D (measured here: that
    # slice 0.2 % of its norm off the failure-free run, every other parameter within 1e-6)
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, "iterations": 40, "cluster.timeout_s": 600,
                         "failover.heartbeat_timeout_s": 30.0, "failover.hang_timeout_s": 8.0,
                         "model.gpt.bias": False})
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    endpoint = f"127.0.0.1:{free_port()}"
    faults = ("--fail", "node1@3:backward", "--hang", "node0@3:regroup")
    results = _finish([_agent(config, out, "c10d", endpoint, nnodes="2:2",
                              extra=("--nproc-per-node", "2", *faults)) for out in outs])
    for code, err in results:
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    ev = events(run)
    fenced = [e for e in ev if e["kind"] == "node_fenced"]
    assert [e["node"] for e in fenced] == ["node0"], fenced
    assert "hung: no progress for " in fenced[0]["reason"], fenced[0]
    assert "forming the process groups" in fenced[0]["reason"], fenced[0]
    assert [e["action"] for e in ev if e["kind"] == "plan"][:2] == ["failover", "drop_pipeline"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    got = load_file(str(run / "final" / "model.safetensors"))
    # D went 2 -> 1 -> 2: the gradients' sums ran in another order for a while
    assert_close_where_width_changed(got, failure_free(tmp_path_factory, cfg))
    assert all(workers_running(out) == [] for out in outs)


def test_a_hugging_face_model_trained_by_agents_loads_from_the_coordinators_out(tmp_path,
                                                                               corpus):
    """transformers' GPT-2 at P = 2 on two hosts; node0 crashes and node1 takes its stage
    over, so the final stage 0 is written on node1's host. The coordinating agent's
    `final/` must load with `from_pretrained` and hold the plain transformers loop's bits
    (D = 1 throughout). The model's config.json used to be written by stage 0's final owner
    into its own host's `--out`: when that was not the coordinating host (node0 runs on the
    coordinating one when it arrives first, as here) the result did not load."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from test_hf import TINY, hf_config, plain_transformers_loop

    cfg = hf_config(corpus, "gpt2", stages=2, pipelines=1, redundancy="lazy",
                    **{**FAST, **LENIENT, "iterations": 8})
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    endpoint = f"127.0.0.1:{free_port()}"
    results = _finish([_agent(config, out, "c10d", endpoint, nnodes="2:2",
                              extra=("--fail", "node0@3:backward")) for out in outs])
    for code, err in results:
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    assert "takeover" in [e["kind"] for e in events(run)]
    got = load_file(str(run / "final" / "model.safetensors"))
    want = plain_transformers_loop(cfg, "gpt2", TINY["gpt2"]).state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    loaded = AutoModelForCausalLM.from_pretrained(run / "final")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, got[key]), key


def _hosts_of_two_training(cfg, tmp_path: Path, backend: str, endpoint: str,
                           first_extra: tuple[str, ...] = ()):
    """Two agents of P x D / 2 workers each, the first started alone so that it coordinates
    (with c10d it hosts the store), once the job trains: their --out folders, processes, and
    the first's stderr lines. `first_extra`: more flags for the first."""
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    nproc = str(cfg.stages * cfg.pipelines // 2)
    first = _agent(config, outs[0], backend, endpoint, nnodes="2:2",
                   extra=("--nproc-per-node", nproc, *first_extra))
    said = _Lines(first)
    said.wait_for("coordinates job")
    agents = [first, _agent(config, outs[1], backend, endpoint, nnodes="2:2",
                            extra=("--nproc-per-node", nproc))]
    assert _coordinating_once_training(outs, agents, "the notice") == 0
    return outs, agents, said


@pytest.mark.parametrize("via", ["sigterm", "metadata"])
def test_the_coordinating_agent_hands_its_office_on_at_its_hosts_notice(tmp_path,
                                                                         tmp_path_factory,
                                                                         corpus, etcd, via):
    """Under etcd, the coordinating agent's host is reclaimed: a SIGTERM to the agent, or a
    notice from the cloud's metadata service to each of its workers. Its workers leave at the
    next boundary, as any host's do; then it writes its books a last time, marked handed
    over, resigns (the leader key goes with its lease) and exits 0. The other agent, watching
    the office, is elected without waiting for the lease to expire and coordinates to the end
    from those books: no node counted lost, the run's files whole on its host, the result the
    failure-free run's (D 2 -> 1). Before, the coordinator stayed until its host was gone,
    and the office was vacant for one lease TTL after that."""
    from metadata_servers import MetadataServer
    from spotpipe.checkpoint import durable

    meta = MetadataServer()
    notices = ({"failover.gcp_notice_url": meta.urls()["gcp"], "failover.notice_poll_s": 0.1}
               if via == "metadata" else {})
    folder = tmp_path / "checkpoints"  # (both hosts see it)
    job = {**FAST, **LENIENT, "iterations": 300, "model.gpt.bias": False}
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**job, "checkpoint.every": 40, "checkpoint.dir": str(folder),
                         **notices})
    # (checkpoints and notices change no parameter: the reference is shared with the other
    # tests of this job, which train it once)
    reference = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy", **job)
    outs, agents, said = _hosts_of_two_training(cfg, tmp_path, "etcd", etcd.endpoint)
    first = agents[0]
    theirs = sorted(p.stem for p in (outs[0] / "logs").glob("node*.log"))
    if via == "sigterm":
        first.send_signal(signal.SIGTERM)
    else:
        for node in theirs:
            meta.preempt(node)
    assert first.wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    meta.close()
    assert any("handed the coordinator's office on" in line for line in said.lines), said.lines
    assert agents[1].poll() is None, "the job ended before the hand-over"
    # the folder stays the job's while it runs: its lock names the successor's process
    lock = folder / ".spotpipe.lock"
    while agents[1].poll() is None and not (
            lock.exists() and json.loads(lock.read_text())["pid"] == agents[1].pid):
        time.sleep(0.02)
    assert agents[1].poll() is None, "the job ended with the folder's lock not taken over"
    code, err = _finish([agents[1]])[0]
    assert code == 0, err[-2000:]
    assert "takes over as the coordinator" in err, err[-2000:]
    run = outs[1]
    ev = events(run)
    kinds = [e["kind"] for e in ev]
    assert kinds[0] == "launch" and kinds.count("launch") == 1  # the predecessor's lines first
    handover = ev[kinds.index("coordinator_handover")]
    takeover = ev[kinds.index("coordinator_takeover")]
    assert len(theirs) == 2 and sorted(handover["nodes_left"]) == theirs, (handover, theirs)
    assert takeover["handed_over"] is True and takeover["time_s"] > handover["time_s"]
    assert sorted(takeover["predecessor_nodes"]) == theirs
    assert "agent_lost" not in kinds and "agent_silent" not in kinds
    assert sorted(e["node"] for e in ev if e["kind"] == "notice") == theirs
    # (the metadata service's two notices may come a boundary apart: a failover first)
    acted = [e["action"] for e in ev if e["kind"] == "plan" and e["action"] != "keep"]
    assert acted[-1] == "drop_pipeline" and set(acted) <= {"failover", "drop_pipeline"}, acted
    assert via == "metadata" or acted == ["drop_pipeline"], acted
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iter"] for m in metrics] == list(range(cfg.iterations))
    assert metrics[-1]["time_s"] > takeover["time_s"], "no iteration after the takeover"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    got = load_file(str(run / "final" / "model.safetensors"))
    assert_close_where_width_changed(got, failure_free(tmp_path_factory, reference))
    assert all(workers_running(out) == [] for out in outs)
    # the successor commits the job's checkpoints in the same folder, under the lock it took
    # over, and frees the folder at the end (the hand-over left lock and probe in place)
    committed = [e for e in ev if e["kind"] == "checkpoint_committed"]
    last = cfg.iterations // 40 * 40 - 1  # (every 40th: 39, 79, ..., 279)
    assert [e["iteration"] for e in committed][-1] == last
    assert any(e["time_s"] > takeover["time_s"] for e in committed), committed
    durable.verify(folder / f"iter_{last:08d}")
    assert not (folder / ".spotpipe.lock").exists()
    assert not list(folder.glob(".spotpipe-probe*")), list(folder.iterdir())
    print(f"hand-over: office vacant {takeover['time_s'] - handover['time_s']:.3f} s "
          f"(lease TTL {cfg.failover.heartbeat_timeout_s:.0f} s)")


def test_an_office_handed_on_that_nobody_takes_is_taken_back(tmp_path, tmp_path_factory,
                                                              corpus, etcd):
    """The coordinating host is reclaimed while the only other agent cannot campaign (here
    frozen with SIGSTOP; in the field, a host reclaimed in the same wave, whose notice the
    coordinator had not heard yet): the office handed on stays vacant, so after one lease TTL
    the coordinator takes it back from its own books and ends the job itself, rather than
    leave a job that nobody coordinates. Its workers left; the other host's train on, and its
    agent, running again, finds the office held. Before all this, one of the coordinator's
    workers died and was replaced (--max-restarts): its host came again under a new
    arrival number, which the office is taken back under. One worker per host (P = 2, D = 1):
    every change is a takeover from a replica or a rebalance, so the run ends bit-identical
    to the failure-free one."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                      **{**FAST, "failover.heartbeat_timeout_s": 5.0,
                         "failover.hang_timeout_s": 30.0, "iterations": 800,
                         "model.gpt.bias": False})
    outs, agents, said = _hosts_of_two_training(
        cfg, tmp_path, "etcd", etcd.endpoint,
        first_extra=("--max-restarts", "1", "--fail", "node0@3:backward"))
    first = agents[0]
    said.wait_for("this host joins again as agent")
    agents[1].send_signal(signal.SIGSTOP)
    try:
        first.send_signal(signal.SIGTERM)
        said.wait_for("takes it back", timeout_s=120)
    finally:
        agents[1].send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    code, err = _finish([agents[1]])[0]
    assert code == 0, err[-2000:]
    run = outs[0]
    ev = events(run)
    kinds = [e["kind"] for e in ev]
    assert kinds.count("launch") == 1
    # taken back once, the office stays here to the end (handed on again, it would be vacant
    # again for a lease TTL each time)
    assert kinds.count("coordinator_handover") == 1 == kinds.count("coordinator_takeover")
    handover = ev[kinds.index("coordinator_handover")]
    takeover = ev[kinds.index("coordinator_takeover")]
    assert takeover["handed_over"] is True and takeover["predecessor"] == handover["node"]
    again = takeover["node"].removeprefix("agent")  # (the same host, under its new number)
    assert any(f"this host joins again as agent {again}" in line for line in said.lines)
    assert takeover["time_s"] - handover["time_s"] >= 5.0  # one lease TTL, vacant
    assert "agent_lost" not in kinds
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iter"] for m in metrics] == list(range(cfg.iterations))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    _completed_as_failure_free(run, cfg, outs, tmp_path_factory)


def _two_hosts_of_two(config: Path, tmp_path: Path,
                      *extra: str) -> tuple[list[Path], list[tuple[int, str]]]:
    """Two agents of two workers each (c10d) run the job to its end, each exiting 0: their
    --out folders and (exit code, stderr)."""
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [_agent(config, out, "c10d", endpoint, nnodes="2:2",
                    extra=("--nproc-per-node", "2", *extra)) for out in outs]
    results = _finish(procs)
    for code, err in results:
        assert code == 0, err[-2000:]
    return outs, results


def _completed_as_failure_free(run: Path, cfg, outs: list[Path], tmp_path_factory) -> None:
    """The job completed, bit-identical to its failure-free run, and no worker is left."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    got = load_file(str(run / "final" / "model.safetensors"))
    want = failure_free(tmp_path_factory, cfg)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(workers_running(out) == [] for out in outs)


def test_a_fenced_worker_is_replaced_in_its_own_place_while_its_host_mate_runs_on(
        tmp_path, tmp_path_factory, corpus):
    """Two hosts of two workers each (P = 2 x D = 2). node0 hangs and is fenced; node1, on
    the same host, runs on. Its agent comes again with one fresh node, started in node0's
    place on the host (LOCAL_RANK 0, its GPU), not with a whole host's worth beside the
    worker still running there (which put two workers on one GPU); the job takes it back in
    and ends bit-identical to the failure-free run (D stays 2: node1 holds stage 0's
    replica and takes it over)."""
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, **LENIENT, "iterations": 40, "failover.hang_timeout_s": 4.0})
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs, results = _two_hosts_of_two(config, tmp_path, "--hang", "node0@3:backward")
    run = _coordinator_out(outs)
    ev = events(run)
    assert [e["node"] for e in ev if e["kind"] == "node_fenced"] == ["node0"]
    admitted = [e for e in ev if e["kind"] == "agent_admitted"]
    assert [e["ranks"] for e in admitted][2:] == [[4]], admitted  # one node, node4
    host = next(i for i, out in enumerate(outs) if (out / "logs" / "node0.log").exists())
    said = results[host][1]
    assert "started node4 (local rank 0) joining the running job" in said, said[-3000:]
    assert sorted(p.name for p in (outs[host] / "logs").glob("node*.log")) == [
        "node0.log", "node1.log", "node4.log"]
    assert [e["node"] for e in ev if e["kind"] == "worker_ready" and e["joined"]] == ["node4"]
    _completed_as_failure_free(run, cfg, outs, tmp_path_factory)


def test_workers_killed_on_a_live_host_are_replaced_while_max_restarts_allows(
        tmp_path, tmp_path_factory, corpus):
    """Two hosts of two workers each (P = 2 x D = 2), agents with --max-restarts 1. node0 dies
    of SIGKILL (its host lives): the job fails over, and its agent starts a fresh node in its
    place, which joins the running job and takes its stage back. Later node1, on the same
    host, dies too: the one restart is spent, so the agent says so and the job goes on
    without it. The job ends bit-identical to the failure-free run (each loss taken over from
    the replica, D = 2)."""
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, **LENIENT, "iterations": 300, "model.gpt.bias": False})
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs, results = _two_hosts_of_two(config, tmp_path, "--max-restarts", "1",
                                      "--fail", "node0@3:backward", "--fail", "node1@250:forward")
    run = _coordinator_out(outs)
    ev = events(run)
    assert sorted(e["node"] for e in ev if e["kind"] == "node_lost") == ["node0", "node1"]
    assert not [e for e in ev if e["kind"] == "node_fenced"]
    host = next(i for i, out in enumerate(outs) if (out / "logs" / "node0.log").exists())
    said = results[host][1]
    assert ("node0 died of SIGKILL while its host lives; replaced (restart 1 of "
            "--max-restarts 1)") in said, said[-3000:]
    assert "started node4 (local rank 0) joining the running job" in said, said[-3000:]
    assert "node1 died of SIGKILL while its host lives; not replaced: --max-restarts 1 used" \
        in said, said[-3000:]
    crashed = [(e["worker"], e["signal"], e["replaced"], e["restarts"]) for e in ev
               if e["kind"] == "worker_crashed"]
    assert crashed == [("node0", "SIGKILL", True, 1), ("node1", "SIGKILL", False, 1)], crashed
    joined = [e for e in ev if e["kind"] == "worker_ready" and e["joined"]]
    assert [e["node"] for e in joined] == ["node4"]
    second = next(e for e in ev if e["kind"] == "fault_injected" and e["node"] == "node1")
    assert joined[0]["time_s"] < second["time_s"], "node4 joined after the second crash"
    assert [e["action"] for e in ev if e["kind"] == "plan"] == [
        "failover", "rebalance", "failover"]
    _completed_as_failure_free(run, cfg, outs, tmp_path_factory)


def test_agents_that_lose_etcd_for_good_end_the_job_saying_so(tmp_path, corpus, etcd):
    """etcd, the agents' rendezvous and the job's store, goes away for good while they
    train: every agent stops its workers and exits 1 saying it lost the store, and the
    coordinating one's --out holds the job's summary saying so. Before, each agent's wait
    for the job's end raised the store's error (a traceback), the process ending under its
    coordinator's thread before the summary was written."""
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                      **{**FAST, **LENIENT, "iterations": 5000, "cluster.timeout_s": 5.0})
    outs, agents, said = _hosts_of_two_training(cfg, tmp_path, "etcd", etcd.endpoint)
    etcd.kill()
    lost = f"lost the store: etcd at {etcd.endpoint} unreachable for 5 s"
    code, err = _finish([agents[1]])[0]
    assert code == 1 and lost in err and "Traceback" not in err, err[-2000:]
    assert agents[0].wait(timeout=600) == 1
    said.wait_for(lost)  # (the first agent's lines are read by `said`)
    assert not any("Traceback" in line for line in said.lines), "".join(said.lines)[-2000:]
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["message"].startswith(lost), summary
    assert all(workers_running(out) == [] for out in outs)


@pytest.mark.parametrize("via", ["sigterm", "metadata", "ctrl-c"])
def test_an_agent_whose_host_is_reclaimed_leaves_with_its_workers_while_the_job_runs(
        tmp_path, tmp_path_factory, corpus, via):
    """A host's preemption notice: a SIGTERM to its agent, passed on to its workers, or the
    cloud's metadata service, which the workers and the agent read alike. The workers leave
    at the next iteration boundary and the job goes on without them; once they have left,
    an agent that neither coordinates nor hosts the store leaves too (exit 0, as a host
    being reclaimed should), while the job runs on. Before, with a SIGTERM the agent waited
    for the job's end in a store call, where Python never ran the signal's handler (the
    job completed with no notice at all); with the metadata service the agent did not hear
    the notice, and stayed to the job's end. (The first agent, started alone, hosts the
    store and coordinates.) A Ctrl-C on the host's terminal (SIGINT to its whole process
    group) takes the host out the same way; before, the agent died of it with a traceback and
    then of its store's threads (SIGABRT), its workers killed unsaid."""
    from metadata_servers import MetadataServer

    meta = MetadataServer()
    job = {**FAST, **LENIENT, "iterations": 300, "model.gpt.bias": False}
    notices = ({"failover.azure_notice_url": meta.urls()["azure"],
                "failover.notice_poll_s": 0.1} if via == "metadata" else {})
    cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy", **{**job, **notices})
    # (notices change no parameter: the reference is shared with the other tests of this job)
    reference = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy", **job)
    try:
        outs, agents, said = _hosts_of_two_training(cfg, tmp_path, "c10d",
                                                    f"127.0.0.1:{free_port()}")
        first, coordinating = agents[0], 0
        theirs = sorted(p.stem for p in (outs[1 - coordinating] / "logs").glob("node*.log"))
        if via == "sigterm":
            agents[1].send_signal(signal.SIGTERM)
        elif via == "ctrl-c":
            os.killpg(agents[1].pid, signal.SIGINT)
        else:
            for node in theirs:
                meta.preempt(node)
        code, err = _finish([agents[1]])[0]
        trained = [json.loads(line)["iter"]
                   for line in (outs[0] / "metrics.jsonl").read_text().splitlines()]
        assert code == 0 and "left the job on this host's preemption notice" in err, \
            err[-2000:]
        assert via != "ctrl-c" or ("Ctrl-C: this host leaves the job" in err
                                   and "Traceback" not in err), err[-2000:]
        assert via != "metadata" or "this host's preemption notice (Azure Scheduled" in err, \
            err[-2000:]
        # the host's event acknowledged once, by its agent after both workers had left (each
        # worker acknowledged it as it left, the first while the other was still leaving;
        # here each node has its own URL, and the agent reads its first node's)
        assert via != "metadata" or meta.acks == [
            (theirs[0], meta.events[theirs[0]]["EventId"])], meta.acks
        assert first.poll() is None and trained[-1] < cfg.iterations - 1, \
            "the agent did not leave before the job's end"
        assert first.wait(timeout=600) == 0, "".join(said.lines)[-2000:]
    finally:
        meta.close()
    # the agent that left counted as one that confirmed the end: the store's host did not
    # wait for it (cluster.timeout_s) before leaving
    assert not any("not every agent confirmed" in line for line in said.lines), said.lines
    run = outs[coordinating]
    ev = events(run)
    leaving = sorted(e["node"] for e in ev if e["kind"] == "notice")
    assert leaving == theirs and len(theirs) == 2, (leaving, theirs)
    assert sorted(e["node"] for e in ev if e["kind"] == "worker_left") == leaving
    # (the metadata service's two notices may come a boundary apart: a failover first)
    acted = [e["action"] for e in ev if e["kind"] == "plan" and e["action"] != "keep"]
    assert acted[-1] == "drop_pipeline" and set(acted) <= {"failover", "drop_pipeline"}, acted
    assert via == "metadata" or acted == ["drop_pipeline"], acted
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    got = load_file(str(run / "final" / "model.safetensors"))
    assert_close_where_width_changed(got, failure_free(tmp_path_factory, reference))  # D 2->1
