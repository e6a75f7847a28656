"""Bad input: a clear message naming the problem, exit code 2, no output folder, no processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from procs import workers_of

BASE = """
model: {kind: gpt, gpt: {block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}
data: {kind: text, path: CORPUS}
micro_batch_size: 2
num_microbatches: 2
iterations: 2
logging: {progress: false}
"""


def spotpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "spotpipe", *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=cwd)


def workers_running(out: Path) -> list[str]:
    return sorted(workers_of(out))


@pytest.fixture
def config(tmp_path, corpus):
    path = tmp_path / "job.yaml"
    path.write_text(BASE.replace("CORPUS", str(corpus)))
    return path


CASES = [
    (["--set", "optimizer.lrr=1"], "unknown key 'optimizer.lrr' (did you mean 'lr'?)"),
    (["--set", "optimizer.lr=fast"], "optimizer.lr: expected a number, got 'fast'"),
    (["--set", "schedule=zigzag"], "schedule: expected one of 'gpipe', '1f1b', got 'zigzag'"),
    (["--set", "micro_batch_size=0"], "micro_batch_size: expected a positive integer"),
    (["--set", "model.gpt.n_embd=30", "--set", "model.gpt.n_head=4"], "not divisible"),
    (["--set", "optimizer.betas=[0.9]"], "optimizer.betas"),
    (["--set", "logging.progress=maybe"], "logging.progress: expected true or false"),
    (["--set", "data.path=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--stages", "5"], "5 stages"),
    (["--set", "model.kind=factory", "--set", "model.factory=no_such_pkg.models:make"],
     "no_such_pkg"),
    (["--set", "model.kind=factory", "--set", "model.factory=fixtures.user_models:nope"],
     "nope"),
    (["--set", "model.partition=explicit", "--set", "model.stage_of_layer=[0,1,0,1]"],
     "stage_of_layer"),
    (["--set", "micro_batch_size=100000"], "fewer than one global batch"),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[c[1][:30] for c in CASES])
def test_bad_input_is_refused_before_anything_starts(tmp_path, config, args, expected):
    out = tmp_path / "out"
    result = spotpipe("train", str(config), "--out", str(out), *args)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists(), "a refused run must not leave an output folder"


def test_missing_config_file(tmp_path):
    result = spotpipe("train", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "no such configuration file" in result.stderr


def test_invalid_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {kind: gpt\n")
    result = spotpipe("train", str(bad), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and str(bad) in result.stderr and "not valid YAML" in result.stderr


def test_port_already_taken(tmp_path, config):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = tmp_path / "out"
        result = spotpipe("train", str(config), "--out", str(out), "--set", f"cluster.port={port}")
    assert result.returncode == 2
    assert f"cluster.port: cannot start the store on 127.0.0.1:{port}" in result.stderr
    assert not out.exists()


def test_existing_output_is_not_overwritten(tmp_path, config):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = spotpipe("train", str(config), "--out", str(out))
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert (out / "precious.txt").read_text() == "keep me"


def _factory_job(config: Path, out: Path, model: str, *args: str
                 ) -> subprocess.CompletedProcess:
    """`spotpipe train` of 2 stages of `fixtures.user_models`'s `model` for 20 iterations."""
    return spotpipe("train", str(config), "--out", str(out), "--stages", "2",
                    "--set", "model.kind=factory",
                    "--set", f"model.factory=fixtures.user_models:{model}",
                    "--set", "data.kind=factory",
                    "--set", "data.factory=fixtures.user_models:regression",
                    "--set", "iterations=20", *args)


def test_worker_failure_stops_the_job_and_names_the_node(tmp_path, config):
    out = tmp_path / "out"
    result = _factory_job(config, out, "failing")
    assert result.returncode == 1, result.stderr
    assert "node1 failed: RuntimeError: boom: this layer fails on purpose" in result.stderr
    assert workers_running(out) == [], "no worker may outlive a failed job"
    events = (out / "events.jsonl").read_text()
    assert '"kind": "worker_failed"' in events and '"kind": "job_failed"' in events
    assert '"status": "failed"' in (out / "summary.json").read_text()


def test_a_worker_that_calls_sys_exit_mid_job_fails_the_job_naming_it(tmp_path, config):
    """User code that calls sys.exit(0) in a worker ended it with code 0, which the launcher
    takes for a node done at the job's end: no loss was seen, the others waited for it in
    three plans of `cluster.timeout_s` each (6 minutes by default), and the job failed
    saying it could not re-form. It is a software error in the worker, which names it."""
    out = tmp_path / "out"
    result = _factory_job(config, out, "exiting", "--set", "cluster.timeout_s=15")
    assert result.returncode == 1, result.stderr
    assert "node1 failed: SystemExit: sys.exit(0) called while training" in result.stderr, \
        result.stderr[-3000:]
    assert workers_running(out) == []


def test_a_worker_that_ends_with_code_0_below_python_is_lost_not_finished(tmp_path, config):
    """A worker ended with code 0 mid-job without a SystemExit to catch (os._exit, a C
    library's exit): the launcher took it for a node done at the job's end, and the recovery
    its peer began waited for its report through plans of cluster.timeout_s each (300 s
    here: past this test's bound). It is lost as soon as that recovery begins, and the job
    goes on from there (here its survivor takes the stage over, and ends the same way)."""
    out = tmp_path / "out"
    result = _factory_job(config, out, "exiting_below_python", "--set", "redundancy=lazy",
                          "--set", "cluster.timeout_s=300")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert lost and lost[0]["node"] == "node1" and lost[0]["returncode"] == 0, lost
    assert "exited with code 0 before the job's end" in lost[0]["reason"]
    assert any(e["kind"] == "takeover" and e["node"] == "node0" for e in events), \
        [e["kind"] for e in events]
    assert result.returncode == 1, result.stderr[-3000:]  # (node0 too ended the same way)
    assert workers_running(out) == []


def test_out_that_is_a_file(tmp_path, config):
    out = tmp_path / "out"
    out.write_text("a file")
    result = spotpipe("train", str(config), "--out", str(out))
    assert result.returncode == 2 and f"--out {out}: is a file, not a folder" in result.stderr
    assert "Traceback" not in result.stderr and out.read_text() == "a file"


def test_an_out_folder_that_cannot_be_made_is_named_without_a_traceback(tmp_path, config):
    """An --out on a file system that takes no new folder (read-only, say: /proc takes none,
    for root as well) ended the launch in a traceback from mkdir."""
    out = Path("/proc/spotpipe-no-such-folder/out")
    result = spotpipe("train", str(config), "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert f"--out {out}: cannot be made" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_time_scale_must_be_a_finite_positive_number(tmp_path, config, value):
    result = spotpipe("train", str(config), "--out", str(tmp_path / "out"),
                      f"--time-scale={value}")
    assert result.returncode == 2 and "--time-scale" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_nan_in_a_trace_names_the_file_and_line(tmp_path, config):
    trace = tmp_path / "ticks.json"
    trace.write_text('{"metadata": {"gap_seconds": 60},\n "data": [2,\n NaN]}\n')
    result = spotpipe("train", str(config), "--out", str(tmp_path / "out"), "--trace",
                      str(trace))
    assert result.returncode == 2, result.stderr
    assert f"{trace}:3: NaN is not a count" in result.stderr  # the file, the line, the value
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_nccl_without_cuda_is_refused_before_anything_starts(tmp_path, config):
    out = tmp_path / "out"
    result = spotpipe("train", str(config), "--out", str(out), "--set", "cluster.backend=nccl")
    assert result.returncode == 2 and "cluster.backend: 'nccl' needs CUDA" in result.stderr
    assert not out.exists()


def test_a_missing_optional_package_is_refused_before_anything_starts(tmp_path, corpus,
                                                                       monkeypatch):
    import importlib.util

    from spotpipe.cluster import launcher
    from conftest import tiny_config

    real = importlib.util.find_spec
    monkeypatch.setattr(launcher.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    out = tmp_path / "out"
    with pytest.raises(launcher.LaunchError, match="logging.tensorboard: true needs the "
                                                    "tensorboard package"):
        launcher.train(tiny_config(corpus, **{"logging.tensorboard": True}), out,
                       progress=False)
    assert not out.exists()


@pytest.mark.parametrize("requested,gpus,workers,want", [
    ("gloo", 8, 2, ("gloo", False)),
    ("auto", 0, 4, ("gloo", False)),
    ("auto", 4, 4, ("nccl", False)),
    ("auto", 8, 3, ("nccl", False)),
    ("auto", 1, 2, ("gloo", True)),  # NCCL would refuse two ranks on the one GPU
    ("nccl", 2, 2, ("nccl", False)),
])
def test_the_backend_takes_nccl_only_with_a_gpu_for_every_worker(requested, gpus, workers,
                                                                   want):
    from spotpipe import job

    backend, why = job.choose_backend(requested, gpus, workers)
    assert (backend, bool(why)) == want
    if why:
        assert f"{gpus} GPU" in why and f"{workers} workers" in why


@pytest.mark.parametrize("gpus,workers,words", [(0, 1, "torch finds none"),
                                                (1, 2, "each of the 2 workers"),
                                                (3, 8, "torch finds 3")])
def test_nccl_without_a_gpu_for_every_worker_names_the_counts(gpus, workers, words):
    from spotpipe import job

    with pytest.raises(ValueError, match="cluster.backend: 'nccl' needs") as caught:
        job.choose_backend("nccl", gpus, workers)
    assert words in str(caught.value)


def test_the_workers_read_the_backend_the_launch_decided(corpus):
    """`auto` is decided once, where the job starts, and written into the configuration the
    workers read, so that no two processes of a job can decide it differently."""
    from conftest import tiny_config
    from spotpipe.cluster.launcher import prepare

    prepared = prepare(tiny_config(corpus, stages=2), workers_here=2)
    assert prepared.cfg.cluster.backend == ("nccl" if __import__("torch").cuda.device_count()
                                            >= 2 else "gloo")


def test_a_host_that_settled_auto_otherwise_is_refused_by_name(corpus):
    """Two hosts of one agent job decide `auto` from what each has: one with a GPU per worker
    takes NCCL, one without takes gloo, and their configurations differ. The refusal names the
    key and says how to make the hosts agree, instead of "another configuration"."""
    import dataclasses

    from conftest import tiny_config
    from spotpipe.cluster.join_checks import join_problem

    job = tiny_config(corpus, stages=2)
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, backend="nccl"))
    host = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, backend="gloo"))
    problem = join_problem(job, token_ok=True, model_digest=host.model_digest(),
                           config_digest=host.digest(), config_keys=host.key_digests())
    assert problem == ("it runs another configuration (cluster.backend differs; "
                       "cluster.backend is settled on each host from its GPUs when it is "
                       "'auto' (here: nccl); set it to one value in every host's "
                       "configuration)")
    two = dataclasses.replace(host, seed=host.seed + 1)
    problem = join_problem(job, token_ok=True, model_digest=two.model_digest(),
                           config_digest=two.digest(), config_keys=two.key_digests())
    assert problem is not None and problem.startswith(
        "it runs another configuration (cluster.backend, seed differ;")
    # a node of an older build sends no per-key digests: the refusal stays the plain one
    assert join_problem(job, token_ok=True, model_digest=two.model_digest(),
                        config_digest=two.digest()) == "it runs another configuration"
    assert join_problem(job, token_ok=True, model_digest=job.model_digest(),
                        config_digest=job.digest(), config_keys=job.key_digests()) is None


def test_eager_replicas_on_the_cpu_of_a_gpu_job_are_refused(corpus, monkeypatch):
    """The replica's forward (FRC) would run on the CPU, whose bf16 and fp32 products differ
    from a GPU's (23 and 45090 of 49152 elements on an H200: spotpipe bench gpu)."""
    from conftest import tiny_config
    from spotpipe import job
    from spotpipe.cluster.launcher import LaunchError, check_environment

    monkeypatch.setattr(job, "cuda_gpus", lambda: 2)
    with pytest.raises(LaunchError, match="replica.device: 'cpu' with redundancy: eager"):
        check_environment(tiny_config(corpus, stages=2, redundancy="eager"), 2)
    for extra in ({"redundancy": "lazy"}, {"redundancy": "eager", "replica.device": "device"},
                  {"redundancy": "eager", "cluster.backend": "gloo"}):
        assert check_environment(tiny_config(corpus, stages=2, **extra), 2).cluster.backend \
            == ("gloo" if "cluster.backend" in extra else "nccl")


def test_cpu_copies_of_gpu_stages_step_with_the_portable_kernel(corpus, monkeypatch):
    import torch

    from conftest import tiny_config
    from spotpipe import job
    from spotpipe.runtime.optim import PortableAdamW, build_optimizer, optimizer_kernel

    monkeypatch.setattr(job, "cuda_gpus", lambda: 4)
    cases = [({"shadow.enabled": True}, "portable"), ({"redundancy": "lazy"}, "portable"),
             ({"redundancy": "lazy", "replica.device": "device"}, "fused"),
             ({"shadow.enabled": True, "cluster.backend": "gloo"}, "fused"),
             ({"shadow.enabled": True, "optimizer.kernel": "fused"}, "fused"),
             ({"optimizer.kernel": "portable"}, "portable")]
    for extra, want in cases:
        cfg = tiny_config(corpus, stages=2, **extra)
        assert optimizer_kernel(cfg) == want, extra
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(build_optimizer(params, tiny_config(corpus, stages=2, redundancy="lazy")),
                      PortableAdamW)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_bench_gpu_without_a_gpu_says_so():
    result = spotpipe("bench", "gpu", "--json")
    assert result.returncode == 1
    assert result.stderr.strip() == ("spotpipe: error: bench gpu: it needs a CUDA GPU, and "
                                     "torch finds none on this machine")


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """`spotpipe ARGV` in this process (what is refused is refused before anything starts):
    the exit code and stderr."""
    from spotpipe.cli.main import main

    monkeypatch.setenv("RES_OPTIONS", os.environ.get("RES_OPTIONS", ""))  # (main sets it)
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("content,expected", [
    (b"stages: 2\n\xff\xfe: 3\n", "not UTF-8 text: byte 10 (line 2)"),
    (b"model:\n  factory_kwargs: {when: 2024-01-01 10:00:00}\n", "model.factory_kwargs.when"),
    (b"stages: 2\nstages: 3\n", "stages: given twice, on line 1 and line 2"),
    (b"", "the file is empty"),
], ids=["non-utf8", "datetime", "duplicate", "empty"])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, monkeypatch, capsys, content,
                                                    expected):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    out = tmp_path / "out"
    code, err = run_main(monkeypatch, capsys, "train", str(path), "--out", str(out))
    assert code == 2 and f"spotpipe: error: {path}: " in err and expected in err, err
    assert not out.exists()


@pytest.mark.parametrize("at", ["-1", "1", "999"])
def test_a_join_outside_the_job_is_refused(tmp_path, config, monkeypatch, capsys, at):
    """The job runs iterations 0..1: a node joining when iteration 1 (the last) or 999
    completes would have nothing to train, and one at -1 joined at once."""
    out = tmp_path / "out"
    code, err = run_main(monkeypatch, capsys, "train", str(config), "--out", str(out),
                         f"--join={at}")
    assert code == 2 and f"--join {at}: " in err and "ITER must be 0..0" in err, err
    assert not out.exists()


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("keep me")
    return path


@pytest.mark.parametrize("where,scheme", [("out", "durable"), ("dir", "durable"),
                                          ("dir", "torch_save"), ("dir/sub", "durable")])
def test_a_file_in_the_way_of_a_folder_is_refused_before_anything_is_written(
        tmp_path, config, monkeypatch, capsys, where, scheme):
    """--out under a file, or checkpoint.dir that is (or is under) a file: refused naming
    the option before the model is built or --out written (the workers' fork server is off:
    the refusal comes before any process would start)."""
    blocker = _a_file(tmp_path)
    out = tmp_path / "out"
    args = ["--set", "cluster.fork_server=false", "--set", "checkpoint.every=1",
            "--set", f"checkpoint.scheme={scheme}"]
    if where == "out":
        out = blocker / "sub"
        expected = f"--out {out}: cannot be made, {blocker} is a file"
    elif where == "dir":
        args += ["--set", f"checkpoint.dir={blocker}"]
        expected = f"checkpoint.dir {blocker}: is a file, not a folder"
    else:
        args += ["--set", f"checkpoint.dir={blocker}/sub"]
        expected = f"checkpoint.dir {blocker}/sub: cannot be made, {blocker} is a file"
    code, err = run_main(monkeypatch, capsys, "train", str(config), "--out", str(out), *args)
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert blocker.read_text() == "keep me" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,expected", [
    (["--node-rank", "-5"], "--node-rank -5: expected 0..1, or -1 (by order of arrival)"),
    (["--node-rank", "2"], "--node-rank 2: expected 0..1, or -1"),
    (["--out", "FILE"], "--out FILE: is a file, not a folder"),
    (["--out", "FILE/sub"], "--out FILE/sub: cannot be made, FILE is a file"),
], ids=["rank-negative", "rank-too-big", "out-file", "out-under-file"])
def test_agent_flags_are_refused_before_anything_starts(tmp_path, config, monkeypatch, capsys,
                                                        flags, expected):
    blocker = _a_file(tmp_path)
    monkeypatch.setenv("SPOTPIPE_JOIN_TOKEN", "secret")
    flags = [f.replace("FILE", str(blocker)) for f in flags]
    out = ["--out", str(tmp_path / "out")] if "--out" not in flags else []
    code, err = run_main(monkeypatch, capsys, "agent", str(config), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x", "--nnodes", "2",
                         *out, *flags)
    assert code == 2 and expected.replace("FILE", str(blocker)) in err, err
    assert blocker.read_text() == "keep me" and not (tmp_path / "out").exists()


def _training(config: Path, out: Path, *args: str) -> subprocess.Popen:
    """`spotpipe train` of a long job in a session of its own, once it has trained two
    iterations."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}"
                                      f"{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "spotpipe", "train", str(config), "--out",
                             str(out), "--stages", "2", "--set", "iterations=100000", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True,
                            # (as from a terminal: a shell's background job, as a CI runner
                            # may be, passes SIGINT on ignored, and Python then keeps it so)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)  # (polling for the condition: training has begun)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


def test_ctrl_c_stops_the_workers_and_says_so_without_a_traceback(tmp_path, config):
    """Ctrl-C in a terminal sends SIGINT to the whole process group, and users press it
    twice. The fork server died of it first (a KeyboardInterrupt traceback on the user's
    terminal, the workers killed before they were told), and a second one cut the stop short
    with another traceback and no summary. Now: the stop runs to its end, the job says it was
    interrupted, exits 130, and leaves no worker, no lock and a summary."""
    import signal
    import time

    out = tmp_path / "out"
    proc = _training(config, out)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole group
        deadline = time.time() + 60
        while workers_running(out) and proc.poll() is None:
            assert time.time() < deadline, "the workers outlived a Ctrl-C by 60 s"
            time.sleep(0.05)  # (the stop is under way: a second Ctrl-C now)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    assert "training interrupted (Ctrl-C)" in stderr and "Traceback" not in stderr, stderr
    assert "spotpipe: interrupted: " in stdout and " iterations, " in stdout, stdout
    assert workers_running(out) == []
    summary = (out / "summary.json").read_text()
    assert '"status": "failed"' in summary and "interrupted" in summary
    assert not (out / "checkpoints" / ".spotpipe.lock").exists()
    from spotpipe.cli.plot import _title

    assert _title(out).startswith("out: interrupted, ")  # (the plot's title says it too)


def test_sigterm_stops_the_job_as_ctrl_c_does(tmp_path, config):
    """A batch scheduler stops a job with SIGTERM (Slurm's scancel or time limit, SIGKILL
    after its grace), to the launcher alone with `kill PID`. The launcher died of it at once:
    no summary, no last event, the initial weights and the checkpoint folder's lock left
    behind, and an exit by signal. Now it stops as on a Ctrl-C: the workers stopped, the job
    said interrupted, exit 143 (128 + SIGTERM, as a shell reports it)."""
    import signal

    out = tmp_path / "out"
    proc = _training(config, out, "--set", "checkpoint.every=1")
    try:
        assert len(workers_running(out)) == 2
        proc.send_signal(signal.SIGTERM)  # the launcher alone
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, (proc.returncode, stderr[-3000:])
    assert "training interrupted (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert "spotpipe: interrupted: " in stdout, stdout
    assert workers_running(out) == []
    summary = (out / "summary.json").read_text()
    assert '"status": "failed"' in summary and "interrupted (SIGTERM)" in summary
    assert '"kind": "job_failed"' in (out / "events.jsonl").read_text()
    assert not (out / "checkpoints" / ".spotpipe.lock").exists()
    assert not (out / "initial.safetensors").exists()


def test_overwrite_of_a_running_jobs_folder_is_refused(tmp_path, config):
    """Two `spotpipe train --overwrite` on one --out (the default, runs/latest, in two
    terminals): the second deleted the running job's folder under it and wrote its own
    there, and both said they completed, with their results in that folder. A job without
    durable checkpoints had no lock to stop it. Now the run folder is locked too."""
    import signal

    out = tmp_path / "out"
    first = _training(config, out)
    try:
        second = spotpipe("train", str(config), "--out", str(out), "--overwrite")
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"--out {out} --overwrite: {out} is in use by another job (pid {first.pid}" \
        in second.stderr and "another --out" in second.stderr, second.stderr[-3000:]
    summary = (out / "summary.json").read_text()
    assert "interrupted (SIGTERM)" in summary  # (the first job's, in its own folder)
    assert not (out / ".spotpipe.lock").exists()


def test_workers_left_when_a_job_fails_get_no_grace_to_leave():
    """SIGTERM is a worker's preemption notice: it leaves at the next boundary, on a plan.
    Once the job failed or was interrupted nobody plans any more, and the supervisor's grace
    between SIGTERM and SIGKILL was only waited out (`spotpipe train` of a job whose worker
    raised said so 10 s after the error); a job handed to a successor coordinator goes on,
    and its workers keep the grace to leave at a boundary."""
    from spotpipe.cluster.jobloop import stop_grace
    from spotpipe.cluster.supervisor import STOP_GRACE_S

    assert stop_grace("failed", interrupted=False, deposed=False) == 0.0
    assert stop_grace("completed", interrupted=True, deposed=False) == 0.0
    assert stop_grace("failed", interrupted=False, deposed=True) == STOP_GRACE_S
    assert stop_grace("completed", interrupted=False, deposed=False) == STOP_GRACE_S
