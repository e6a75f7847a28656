"""Shared fixtures: a tiny corpus and config, and a runner for local-cluster jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotpipe.config import Config, from_dict
from spotpipe.data import ensure_demo_corpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return ensure_demo_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


def tiny_config(corpus: Path, **overrides) -> Config:
    """A GPT small enough that P x D worker processes start and train in seconds on 2 cores."""
    data = {
        "model": {"kind": "gpt", "gpt": {"vocab_size": 256, "block_size": 16, "n_layer": 2,
                                         "n_head": 2, "n_embd": 32}},
        "data": {"kind": "text", "path": str(corpus)},
        "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5},
        "lr_schedule": {"kind": "cosine", "warmup_iters": 1},
        "micro_batch_size": 2, "num_microbatches": 4, "iterations": 3, "seed": 1,
        "logging": {"progress": False},
        "cluster": {"timeout_s": 60},
    }
    flat = [f"{k}={v}" for k, v in overrides.items()]
    return from_dict(data, flat)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))


def _etcd_server(tmp_path_factory, tls: bool):
    """An etcd server on loopback (free ports, a temporary data directory), stopped after the
    test; with `tls`, serving TLS only, to clients whose certificate its CA signed (the
    server's `tls` holds the certificates' paths). Skipped only when the etcd binary is
    missing (.ci/run installs it)."""
    import shutil

    from etcd_server import EtcdServer, make_certificates

    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    folder = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(folder / "data", make_certificates(folder / "certs") if tls else None)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd(tmp_path_factory):
    yield from _etcd_server(tmp_path_factory, tls=False)


@pytest.fixture
def etcd_tls(tmp_path_factory):
    yield from _etcd_server(tmp_path_factory, tls=True)


def positive(value: object) -> bool:
    """A benchmark figure that is a finite number above zero."""
    import math

    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def bench_figures(name: str, timeout: float) -> dict:
    """Run `spotpipe bench NAME --json --quick`; its figures (the last line of stdout)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "spotpipe", "bench", name, "--json", "--quick"],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# manifests are signed under a per-user key when no token or checkpoint.key is given: the
# tests use a key of their own (workers and `spotpipe` subprocesses inherit it), not ~/.config
_TEST_KEY = Path(__import__("tempfile").gettempdir()) / f"spotpipe-test-key-{os.getpid()}"
os.environ.setdefault("SPOTPIPE_KEY_FILE", str(_TEST_KEY))


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's own key goes with it (one per run was left in /tmp)."""
    if os.environ.get("SPOTPIPE_KEY_FILE") == str(_TEST_KEY):
        _TEST_KEY.unlink(missing_ok=True)


def assert_close_where_width_changed(got: dict, want: dict) -> None:
    """Final parameters of a run whose data-parallel width changed against its failure-free
    run: per tensor within 1e-4 of its norm (`spotpipe.bench.checks.parameter_problems`), not
    element by element, since AdamW moves a coordinate with a zero gradient (an attention key
    bias) on the summation order's rounding noise alone."""
    from spotpipe.bench.checks import parameter_problems

    problems = parameter_problems(got, want, exact=False)
    assert not problems, problems
