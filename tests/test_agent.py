"""`spotpipe agent`: agents on loopback, each a separate process with its own --out folder (as
separate hosts would be), meet at a rendezvous (c10d or etcd), elect a coordinator and train
the job to the same final parameters as `spotpipe train`; a stranger is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spotpipe.cluster.launcher import train

from conftest import REPO, tiny_config
from etcd_server import free_port
from test_cli_errors import workers_running
from test_failover import FAST, assert_samples_exactly_once, events

TOKEN = "sesame"
_TRAINED: dict = {}


def _config(corpus, iterations: int):
    return tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                       **{**FAST, "iterations": iterations})


def _trained(tmp_path_factory, cfg) -> dict:
    """Final parameters of `spotpipe train` for the same configuration (run once)."""
    key = cfg.digest()
    if key not in _TRAINED:
        out = tmp_path_factory.mktemp("train") / "run"
        assert train(cfg, out, progress=False) == 0
        _TRAINED[key] = load_file(str(out / "final" / "model.safetensors"))
    return _TRAINED[key]


def _agent(config: Path, out: Path, backend: str, endpoint: str, *, token: str = TOKEN,
           job: str = "job1", nnodes: str = "2:3") -> subprocess.Popen:
    env = dict(os.environ, SPOTPIPE_JOIN_TOKEN=token,
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-m", "spotpipe", "agent", str(config), "--rdzv-backend", backend,
         "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--nnodes", nnodes, "--out", str(out),
         "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def _write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_agents_train_like_spotpipe_train(tmp_path, tmp_path_factory, corpus, backend,
                                          request):
    cfg = _config(corpus, 12)
    config = _write_config(cfg, tmp_path / "job.yaml")
    if backend == "etcd":
        endpoint = request.getfixturevalue("etcd").endpoint
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    results = _finish([_agent(config, out, backend, endpoint) for out in outs])
    for code, err in results:
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == cfg.iterations
    admitted = [e for e in events(run) if e["kind"] == "agent_admitted"]
    assert sorted(r for e in admitted for r in e["ranks"]) == [0, 1]
    got = load_file(str(run / "final" / "model.safetensors"))
    want = _trained(tmp_path_factory, cfg)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # each host ran its own worker and kept its log; no process is left
    assert all((out / "logs").glob("node*.log") for out in outs)
    assert sorted(p.name for out in outs for p in (out / "logs").glob("node*.log")) == \
        ["node0.log", "node1.log"]
    assert all(workers_running(out) == [] for out in outs)


def test_a_stranger_agent_is_refused_and_the_job_completes(tmp_path, tmp_path_factory, corpus,
                                                           etcd):
    cfg = _config(corpus, 600)
    config = _write_config(cfg, tmp_path / "job.yaml")
    outs = [tmp_path / "host_a", tmp_path / "host_b"]
    agents = [_agent(config, out, "etcd", etcd.endpoint) for out in outs]

    def training() -> bool:  # a real condition: some agent's run folder has metrics
        return any((o / "metrics.jsonl").exists() and (o / "metrics.jsonl").read_text().strip()
                   for o in outs)

    while not training() and all(a.poll() is None for a in agents):
        time.sleep(0.05)
    assert all(a.poll() is None for a in agents), "the job ended before the stranger came"
    stranger = _agent(config, tmp_path / "stranger", "etcd", etcd.endpoint,
                      token="not-the-token")
    code, err = _finish([stranger])[0]
    assert code == 2, err[-2000:]
    assert "refused" in err and "SPOTPIPE_JOIN_TOKEN" in err, err[-2000:]
    for code, err in _finish(agents):
        assert code == 0, err[-2000:]
    run = _coordinator_out(outs)
    refused = [e for e in events(run) if e["kind"] == "join_refused"]
    assert len(refused) == 1 and "join token" in refused[0]["reason"]
    assert [e for e in events(run) if e["kind"] == "plan"] == []  # the job was undisturbed
    got = load_file(str(run / "final" / "model.safetensors"))
    want = _trained(tmp_path_factory, cfg)
    assert all(torch.equal(got[k], want[k]) for k in want)
    for out in outs:  # gather the hosts' sample logs, as one would from real machines
        for log in (out / "logs").glob("samples.*.jsonl"):
            if out != run:
                (run / "logs" / log.name).write_bytes(log.read_bytes())
    assert_samples_exactly_once(run, cfg)
    assert not (tmp_path / "stranger" / "logs").exists()  # it started no worker


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
    # torchrun-style environment variables stand in for flags
    monkeypatch.setenv("PET_NNODES", "1:4")
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    args = build_parser().parse_args(["agent", str(config)])
    assert args.nnodes == "1:4" and args.rdzv_backend == "etcd"
    assert not (tmp_path / "out").exists()
