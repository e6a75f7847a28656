"""Workers forked from a server that imported their modules once: each runs as `python -m`
would run it (its own environment, log, exit code), nothing is imported again, and no
process outlives the supervisor that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from spotpipe.cluster.forkserver import (Exited, ForkServer, SharedForkServer, Spawn, Spawned,
                                         decode, encode, start_key)
from spotpipe.cluster.supervisor import FreshInterpreters, Supervisor, preload, starter
from spotpipe.config import Config

from procs import until

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return text[text.rindex(b")") + 2:].split()[0] != b"Z"


class Exits:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.changed = threading.Condition()

    def __call__(self, node: str, code: int) -> None:
        with self.changed:
            self.codes[node] = code
            self.changed.notify_all()

    def wait_for(self, nodes: set[str], limit_s: float = 60.0) -> dict[str, int]:
        with self.changed:
            assert self.changed.wait_for(lambda: nodes <= set(self.codes), limit_s), self.codes
            return dict(self.codes)


def test_messages_print_and_parse_back() -> None:
    for message in (Spawn("m", "/tmp/x.log", "python -m m [n]", "/tmp", {"A": "1"}),
                    Spawned(12), Exited(12, -9)):
        assert decode(encode(message)) == message
        assert encode(message).endswith(b"\n") and encode(message).count(b"\n") == 1


def test_children_run_their_module_with_their_own_environment_log_and_code(
        tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    # imported by the server: it records who imported it, once per import
    (lib / "heavy.py").write_text(textwrap.dedent("""
        import os
        IMPORTED_BY = os.getpid()
        with open(os.environ["IMPORTS"], "a") as f:
            f.write(f"{IMPORTED_BY}\\n")
    """))
    (lib / "job.py").write_text(textwrap.dedent("""
        import os, sys
        import heavy
        print("out", os.environ["NODE"], os.environ.get("ONLY_IN_SERVER"), heavy.IMPORTED_BY,
              os.getpid(), flush=True)
        print("err", os.environ["NODE"], file=sys.stderr, flush=True)
        if os.environ["NODE"] == "boom":
            raise ValueError("the job failed")
        sys.exit(int(os.environ["CODE"]))
    """))
    imports = tmp_path / "imports"
    exits = Exits()
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lib), SRC]), IMPORTS=str(imports))
    server = ForkServer(["heavy"], tmp_path / "logs" / "forkserver.log")
    sup = Supervisor(tmp_path / "logs", exits, module="job", starter=server)
    # the server starts in the first child's environment; a later child does not inherit it
    sup.spawn("a", dict(base, NODE="a", CODE="0", ONLY_IN_SERVER="x"))
    sup.spawn("b", dict(base, NODE="b", CODE="3"))
    sup.spawn("boom", dict(base, NODE="boom", CODE="0"))
    assert exits.wait_for({"a", "b", "boom"}) == {"a": 0, "b": 3, "boom": 1}
    sup.stop_all()

    importers = imports.read_text().split()
    assert len(importers) == 1  # imported once, by the server, never by a child
    server_pid = int(importers[0])
    for node, seen in (("a", "x"), ("b", "None")):
        out, err = (tmp_path / "logs" / f"{node}.log").read_text().splitlines()
        word, name, only, imported_by, pid = out.split()
        assert (word, name, only, int(imported_by)) == ("out", node, seen, server_pid)
        assert int(pid) not in (server_pid, os.getpid())
        assert err == f"err {node}"
    boom = (tmp_path / "logs" / "boom.log").read_text()
    assert "ValueError: the job failed" in boom and "Traceback" in boom


def test_a_server_lost_takes_its_children_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    exits = Exits()
    server = ForkServer([], tmp_path / "logs" / "forkserver.log")
    sup = Supervisor(tmp_path / "logs", exits, module="sleeper", starter=server)
    sup.spawn("node0", dict(os.environ, PYTHONPATH=str(tmp_path)))
    child = sup.procs["node0"].pid
    assert _alive(child)
    assert server._server is not None
    assert sup.lost_with_its_server("node0") == ""  # (the server runs)
    server._server.kill()
    assert exits.wait_for({"node0"}) == {"node0": -signal.SIGKILL}
    # the exit's cause, for the job's messages (before: "node0 exited with code -9")
    assert sup.lost_with_its_server("node0") == (
        "the fork server that starts the workers was killed by SIGKILL, and they died with it")
    # what the local launcher and a node agent say of the exit (the code alone: no more)
    assert sup.exit_cause("node0", -signal.SIGKILL) == sup.lost_with_its_server("node0")
    assert sup.exit_cause("node0", 1) == ""
    until(lambda: not _alive(child), "the orphaned child to die")
    with pytest.raises(RuntimeError, match="fork server has ended"):
        sup.spawn("node1", dict(os.environ, PYTHONPATH=str(tmp_path)))


def test_a_server_ended_by_a_signal_without_a_name_is_said_by_its_number() -> None:
    """A real-time signal (SIGRTMIN+6) ends a process that does not handle it, and has no
    name in `signal.Signals`: the server's end is said by its number. (Before: ValueError,
    out of the local launcher's loop, which stopped the job with a traceback in place of the
    loss's message; and out of an agent's report of the exit, which it then never sent.)"""
    server = ForkServer.__new__(ForkServer)
    server._reaped = threading.Event()
    server._reaped.set()
    for number, said in ((signal.SIGRTMIN + 6, f"signal {signal.SIGRTMIN + 6}"),
                         (signal.SIGKILL, "SIGKILL")):
        server._server = types.SimpleNamespace(pid=os.getpid(), returncode=-number)
        assert server.ended_how() == f"was killed by {said}"


def test_no_process_outlives_its_supervisor(tmp_path: Path) -> None:
    """The supervisor's process dies (SIGKILL: nothing of it runs): its server and every
    worker forked from it die too."""
    (tmp_path / "sleeper.py").write_text(textwrap.dedent("""
        import os, time
        with open(os.environ["PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)
    """))
    pids = tmp_path / "pids"
    program = textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        from spotpipe.cluster.forkserver import ForkServer
        from spotpipe.cluster.supervisor import Supervisor
        folder, pids = Path(sys.argv[1]), sys.argv[2]
        sup = Supervisor(folder / "logs", lambda *a: None, module="sleeper",
                         starter=ForkServer([], folder / "logs" / "fs.log"))
        env = dict(os.environ, PYTHONPATH=str(folder), PIDS=pids)
        sup.spawn("node0", env)
        sup.spawn("node1", env)
        print(sup.starter._server.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", program, str(tmp_path), str(pids)],
                              stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=SRC))
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        until(lambda: pids.exists() and len(pids.read_text().split()) == 2, "both workers")
        workers = [int(p) for p in pids.read_text().split()]
        assert all(_alive(p) for p in [server, *workers])
        # in ps, each worker has its own name
        names = sorted(Path(f"/proc/{p}/cmdline").read_bytes().rstrip(b"\0").decode()
                       for p in workers)
        assert names == ["python -m sleeper [node0]", "python -m sleeper [node1]"]
    finally:
        parent.kill()
        parent.wait()
    for pid in [server, *workers]:
        until(lambda: not _alive(pid), f"process {pid} to die with the supervisor")


def test_the_config_chooses_how_workers_start(tmp_path: Path) -> None:
    cfg = Config()
    assert cfg.cluster.fork_server  # the default: forks of this process's server
    made = starter(cfg, "spotpipe.cli.worker", tmp_path)
    assert isinstance(made, SharedForkServer) and made.preload[0] == "spotpipe.cli.worker"
    cfg.cluster.fork_server = False  # as torchrun: each worker a fresh interpreter
    assert isinstance(starter(cfg, "spotpipe.cli.worker", tmp_path), FreshInterpreters)


def test_a_transformers_model_has_the_library_preloaded(tmp_path: Path) -> None:
    """With `model.kind: hf` the server imports transformers and the model family's module
    once, instead of every worker on its own; the family comes from the type or from the
    folder's config.json."""
    cfg = Config()
    cfg.model.kind = "hf"
    cfg.model.hf.config = "gpt2"
    made = starter(cfg, "spotpipe.cli.worker", tmp_path)
    assert isinstance(made, SharedForkServer)
    assert made.preload[0] == "spotpipe.cli.worker"
    assert {"transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2"} <= \
        set(made.preload)
    folder = tmp_path / "llama-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cfg.model.hf.config = str(folder)
    assert "transformers.models.qwen2.modeling_qwen2" in preload(cfg, "spotpipe.cli.worker")
    (folder / "config.json").write_text("not json")  # the worker will say what is wrong
    assert not any(m.startswith("transformers.models.")
                   for m in preload(cfg, "spotpipe.cli.worker"))
    from spotpipe.cluster.supervisor import TRANSFORMERS_FAMILIES
    from spotpipe.model.hf import FAMILIES
    # written twice, since the supervisor stays free of torch: the lists must agree
    assert set(TRANSFORMERS_FAMILIES) == set(FAMILIES)
    # a shadow builds the model too: it forks from the same server, transformers and all
    cfg.model.hf.config = "gpt2"
    cfg.shadow.enabled = True
    assert preload(cfg, "spotpipe.checkpoint.shadow") == preload(cfg, "spotpipe.cli.worker")
    # a GPT needs no transformers
    cfg.model.kind = "gpt"
    for module in ("spotpipe.checkpoint.shadow", "spotpipe.cli.worker"):
        assert not any(m.startswith("transformers") for m in preload(cfg, module)), module


def test_a_jobs_workers_and_shadows_fork_from_one_server(tmp_path: Path) -> None:
    """One server per job, not one for the workers and one for the shadows: each imported
    torch and the rest (3-5 s of CPU on our VMs)."""
    from spotpipe.cluster.forkserver import start_key
    from spotpipe.cluster.supervisor import SHADOW, WORKER, search_path, start_env

    cfg = Config()
    cfg.shadow.enabled = True
    env = start_env(cfg, search_path(cfg))
    workers, shadows = starter(cfg, WORKER, tmp_path), starter(cfg, SHADOW, tmp_path)
    assert isinstance(workers, SharedForkServer) and isinstance(shadows, SharedForkServer)
    # (the key under which this process keeps its servers)
    assert start_key(workers.preload, env) == start_key(shadows.preload, env)
    assert preload(cfg, WORKER)[:2] == [WORKER, SHADOW]
    cfg.shadow.enabled = False  # a job without shadows preloads none of theirs
    assert SHADOW not in preload(cfg, WORKER)


@pytest.mark.parametrize("module,every", [("spotpipe.cli.worker", 0),
                                          ("spotpipe.checkpoint.shadow", 5)])
def test_a_forked_child_builds_its_optimizer_and_saves_without_importing(
        tmp_path: Path, module: str, every: int) -> None:
    """A worker or shadow forked from its server imports nothing more to build its stage's
    optimizer, nor, in a job that writes checkpoints, to save one (torch.optim imports
    torch._dynamo at its first optimizer, DCP is imported at the first save: 1.5 s and up to
    2 s of CPU per process on our VMs, when each child paid them)."""
    (tmp_path / "child.py").write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import torch
        from spotpipe.config import Config
        from spotpipe.runtime.optim import build_optimizer
        before = set(sys.modules)
        for name in ("adamw", "sgd"):
            cfg = Config()
            cfg.optimizer.name = name
            build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg)
        if {every}:
            from spotpipe.checkpoint.durable import dcp_save
            dcp_save({{"w": torch.zeros(3)}}, Path({str(tmp_path / "ckpt")!r}))
        print("imported:", sorted(set(sys.modules) - before))
    """))
    cfg = Config()
    cfg.checkpoint.every = every
    exits = Exits()
    server = ForkServer(preload(cfg, module), tmp_path / "logs" / "forkserver.log")
    sup = Supervisor(tmp_path / "logs", exits, module="child", starter=server)
    sup.spawn("node0", dict(os.environ, PYTHONPATH=f"{tmp_path}:{SRC}"))
    assert exits.wait_for({"node0"}) == {"node0": 0}
    sup.stop_all()
    said = (tmp_path / "logs" / "node0.log").read_text().splitlines()
    assert [line for line in said if line.startswith("imported:")] == ["imported: []"], said
    assert (tmp_path / "ckpt").exists() == bool(every)


def test_a_preload_that_does_not_import_is_named_and_skipped(tmp_path: Path) -> None:
    """Only the module the children run must import; a missing extra (transformers not
    installed) leaves its import to the child, which reports it itself."""
    (tmp_path / "job.py").write_text("import present\nprint('ran')\n")
    (tmp_path / "present.py").write_text("")
    exits = Exits()
    log = tmp_path / "logs" / "forkserver.log"
    server = ForkServer(["present", "no_such_module_of_spotpipe_tests"], log)
    sup = Supervisor(tmp_path / "logs", exits, module="job", starter=server)
    sup.spawn("node0", dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert exits.wait_for({"node0"}) == {"node0": 0}
    sup.stop_all()
    assert (tmp_path / "logs" / "node0.log").read_text().split() == ["ran"]
    assert "not preloaded: no_such_module_of_spotpipe_tests" in log.read_text()


def test_what_a_preload_prints_goes_to_the_log_not_into_the_messages(tmp_path: Path) -> None:
    """The server's messages travel on its stdout: a preloaded module that prints there, from
    Python or straight to fd 1 as C code would, must not break them."""
    (tmp_path / "job.py").write_text("import noisy\nprint('ran')\n")
    (tmp_path / "noisy.py").write_text(
        "import os\nprint('hello from python')\nos.write(1, b'{not json from C}\\n')\n")
    exits = Exits()
    log = tmp_path / "logs" / "forkserver.log"
    server = ForkServer(["noisy"], log)
    sup = Supervisor(tmp_path / "logs", exits, module="job", starter=server)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    sup.spawn("node0", env)
    sup.spawn("node1", env)
    assert exits.wait_for({"node0", "node1"}) == {"node0": 0, "node1": 0}
    sup.stop_all()
    for node in ("node0", "node1"):
        assert (tmp_path / "logs" / f"{node}.log").read_text().split() == ["ran"]
    said = log.read_text()
    assert "hello from python" in said and "{not json from C}" in said


def test_jobs_in_one_process_share_a_server_yet_start_as_fresh_ones_would(
        tmp_path: Path, monkeypatch) -> None:
    """Two jobs one after the other, from different working folders and with different
    PYTHONPATHs: the second's child is forked at once from the first's server (the preload
    imported once), and each child has its own working folder and sys.path, as `python -m`
    would give it; a different start-time environment gets a server of its own."""
    lib, one, two = tmp_path / "lib", tmp_path / "one", tmp_path / "two"
    for folder in (lib, one, two):
        folder.mkdir()
    (lib / "heavy.py").write_text(textwrap.dedent("""
        import os
        with open(os.environ["IMPORTS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
    """))
    (one / "job.py").write_text(textwrap.dedent("""
        import json, os, sys
        import heavy
        print(json.dumps({"cwd": os.getcwd(), "path": sys.path[:3]}))
    """))
    (two / "job.py").write_text((one / "job.py").read_text())
    imports = tmp_path / "imports"
    monkeypatch.setenv("IMPORTS", str(imports))
    for job in (one, two):
        monkeypatch.chdir(job)
        exits = Exits()
        sup = Supervisor(tmp_path / f"logs-{job.name}", exits, module="job",
                         starter=SharedForkServer(["heavy"], tmp_path / "forkserver.log"))
        pythonpath = os.pathsep.join([str(job), str(lib), SRC])
        sup.spawn("node0", dict(os.environ, PYTHONPATH=pythonpath, TAG=str(tmp_path)))
        assert exits.wait_for({"node0"}) == {"node0": 0}
        sup.stop_all()
        seen = json.loads((tmp_path / f"logs-{job.name}" / "node0.log").read_text())
        assert seen == {"cwd": str(job), "path": [str(job), str(job), str(lib)]}
    assert len(imports.read_text().split()) == 1  # one server for both jobs
    other = dict(os.environ, OMP_NUM_THREADS="3")
    assert start_key(["heavy"], other) != start_key(["heavy"], dict(os.environ))


# Runs a spotpipe command with `supervisor.prestart` replaced by one that says whether torch
# was imported when it was called (the command then stops on the bad input it was given).
_PRESTART_PROBE = textwrap.dedent("""
    import sys
    import spotpipe.cluster.supervisor as supervisor
    def probe(cfg, logs=None):
        print("prestart: torch imported:", "torch" in sys.modules, flush=True)
    supervisor.prestart = probe
    from spotpipe.cli.main import main
    raise SystemExit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("command", ["train", "agent"])
def test_commands_start_the_fork_server_before_they_import_torch(tmp_path: Path,
                                                                  command: str) -> None:
    """So that the server's import of torch overlaps the command's own."""
    config = str(Path(__file__).resolve().parents[1] / "examples" / "gpt_tiny.yaml")
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("")  # not empty, no --overwrite: train stops there
    args = {"train": ["train", config, "--out", str(out), "--no-progress"],
            # flags that fit the job; nothing listens on the endpoint: the agent stops there
            "agent": ["agent", config, "--rdzv-backend", "etcd", "--rdzv-endpoint",
                      "127.0.0.1:1", "--rdzv-id", "j", "--nnodes", "2",
                      "--out", str(tmp_path / "agent-out")]}[command]
    done = _probe(args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.splitlines()[0] == "prestart: torch imported: False", done.stdout
    assert "error" in done.stderr


def test_an_agent_with_bad_flags_starts_no_server(tmp_path: Path) -> None:
    """Flags that cannot work are named before the fork server starts (nor torch imported)."""
    config = str(Path(__file__).resolve().parents[1] / "examples" / "gpt_tiny.yaml")
    done = _probe(["agent", config, "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j",
                   "--nnodes", "3:2", "--out", str(tmp_path / "out")])  # MIN above MAX
    assert done.returncode == 2, done.stderr[-2000:]
    assert "prestart" not in done.stdout and "--nnodes '3:2'" in done.stderr, done.stderr


def _probe(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PRESTART_PROBE, *args], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=SRC, SPOTPIPE_JOIN_TOKEN="t"))
