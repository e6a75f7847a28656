"""A node the supervisor kills is reported gone once it can no longer act, before its reap;
a node that ends by itself is reported by its reaper with its own exit code; once each."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spotpipe.cluster.forkserver import ForkServer
from spotpipe.cluster.proc import killed_past_acting
from spotpipe.cluster.supervisor import FreshInterpreters, Starter, Supervisor

from procs import until

# Two threads that never stop writing: a counter each, in a file both processes map.
SPINNER = """
import mmap, os, struct, sys, threading
f = open(os.environ["SPIN_FILE"], "r+b")
m = mmap.mmap(f.fileno(), 16)
def spin(slot):
    n = 0
    while True:
        n += 1
        m[8 * slot:8 * slot + 8] = struct.pack("q", n)
threading.Thread(target=spin, args=(1,), daemon=True).start()
spin(0)
"""


@pytest.fixture(params=["fresh", "forked"])
def starter(request, tmp_path: Path) -> Starter:
    """Both ways a supervisor starts its processes: fresh interpreters, forks of a server."""
    if request.param == "fresh":
        return FreshInterpreters()
    return ForkServer([], tmp_path / "logs" / "forkserver.log")


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_bytes()
    return text[text.rindex(b")") + 2:].split()[0].decode()


def test_a_killed_node_is_reported_once_when_it_can_no_longer_act(tmp_path: Path,
                                                                   starter: Starter) -> None:
    spin_file = tmp_path / "spin"
    spin_file.write_bytes(bytes(16))
    (tmp_path / "spinner.py").write_text(SPINNER)
    counts = mmap.mmap(os.open(spin_file, os.O_RDWR), 16)

    def read() -> tuple[int, int]:
        return struct.unpack("qq", counts[:16])  # type: ignore[return-value]

    exits: list[tuple[str, int, tuple[int, int]]] = []
    told = threading.Event()

    def on_exit(node: str, code: int) -> None:
        exits.append((node, code, read()))
        told.set()

    sup = Supervisor(tmp_path / "logs", on_exit, module="spinner", starter=starter)
    env = dict(os.environ, SPIN_FILE=str(spin_file), PYTHONPATH=str(tmp_path))
    sup.spawn("node0", env)
    proc = sup.procs["node0"]
    until(lambda: min(read()) > 1000, "both threads to spin")
    assert not killed_past_acting(proc.pid)

    assert sup.kill("node0")
    assert told.wait(30)
    node, code, at_report = exits[0]
    assert (node, code) == ("node0", -signal.SIGKILL)
    # no thread wrote after the report: the process could no longer act
    proc.wait(30)
    until(lambda: sup._exits["node0"].reaped.is_set(), "the waiter to see the reap")
    assert read() == at_report
    assert len(exits) == 1, exits  # the reap is not told again
    assert not sup.kill("node0")  # gone: nothing to kill
    sup.stop_all()


def test_proc_tells_a_kill_from_an_exit_of_its_own() -> None:
    own = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        until(lambda: _state(own.pid) == "Z", "the exiting child to become a zombie")
        assert not killed_past_acting(own.pid)  # ended by itself: its reaper reports its code
        assert not killed_past_acting(killed.pid)  # running
        os.kill(killed.pid, signal.SIGKILL)
        until(lambda: killed_past_acting(killed.pid), "the killed child to be past acting")
    finally:
        own.wait()
        killed.kill()
        killed.wait()
    assert (own.returncode, killed.returncode) == (1, -signal.SIGKILL)
    assert not killed_past_acting(killed.pid)  # reaped: the reaper knows


@pytest.mark.parametrize("code", [0, 1, 3])
def test_a_node_that_ends_by_itself_is_reported_with_its_code(tmp_path: Path, code: int,
                                                              starter: Starter) -> None:
    (tmp_path / "ender.py").write_text(f"import sys; sys.exit({code})")
    got: list[int] = []
    told = threading.Event()
    sup = Supervisor(tmp_path / "logs", lambda node, c: (got.append(c), told.set()),
                     module="ender", starter=starter)
    sup.spawn("node0", dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert told.wait(30)
    assert got == [code]
    sup.stop_all()


def test_workers_ask_for_huge_pages_unless_the_user_chose(monkeypatch) -> None:
    from spotpipe.cluster.supervisor import huge_page_tunables

    assert huge_page_tunables(None) == "glibc.malloc.hugetlb=1"
    assert huge_page_tunables("") == "glibc.malloc.hugetlb=1"
    assert huge_page_tunables("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"
    assert huge_page_tunables("glibc.malloc.arena_max=2") == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_the_tunable_gives_a_worker_huge_pages() -> None:
    """What the tunable is for: a tensor's memory in transparent huge pages (where the kernel
    offers them on request, as on the machines this project runs on)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    from spotpipe.cluster.supervisor import huge_page_tunables

    code = ("import torch; x = torch.ones(16 * 2**20); "
            "print([l.split()[1] for l in open('/proc/self/smaps_rollup') "
            "if l.startswith('AnonHugePages')][0])")
    env = dict(os.environ, GLIBC_TUNABLES=huge_page_tunables(None))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert int(out.stdout.strip()) >= 32 * 1024  # kB: most of the tensor's 64 MiB


class _HeldReap:
    """A started process whose reap its supervisor's waiter sees only when the test says so:
    whatever reports its exit before that is not the reap."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.pid, self.args = proc, proc.pid, proc.args
        self.gate = threading.Event()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.gate.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        self.gate.wait()
        return self.proc.wait(timeout)

    def poll(self) -> int | None:
        return self.proc.poll() if self.gate.is_set() else None

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


class _HeldStarter:
    def __init__(self) -> None:
        self.inner = FreshInterpreters()

    def start(self, module: str, env: dict[str, str], log: Path, name: str) -> _HeldReap:
        return _HeldReap(self.inner.start(module, env, log, name))

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_node_that_dies_of_a_signal_is_reported_before_its_reap(tmp_path: Path,
                                                                  signum: int) -> None:
    """A crash (a signal nobody here sent: the OOM killer, a fault) is reported by the crash
    watch once the process can no longer act: its peers would otherwise learn of it only when
    its sockets close, at the end of the kernel's teardown (seconds on a busy machine)."""
    spin_file = tmp_path / "spin"
    spin_file.write_bytes(bytes(16))
    (tmp_path / "spinner.py").write_text(SPINNER)
    counts = mmap.mmap(os.open(spin_file, os.O_RDWR), 16)
    exits: list[tuple[int, tuple[int, ...]]] = []
    told = threading.Event()

    def on_exit(node: str, code: int) -> None:
        exits.append((code, struct.unpack("qq", counts[:16])))
        told.set()

    sup = Supervisor(tmp_path / "logs", on_exit, module="spinner", starter=_HeldStarter())
    sup.spawn("node0", dict(os.environ, SPIN_FILE=str(spin_file), PYTHONPATH=str(tmp_path)))
    proc = sup.procs["node0"]
    until(lambda: min(struct.unpack("qq", counts[:16])) > 1000, "both threads to spin")
    os.kill(proc.pid, signum)
    assert told.wait(30)
    assert not proc.gate.is_set()  # the waiter has not seen the reap: the watch told it
    code, at_report = exits[0]
    assert code == -signum
    proc.gate.set()
    until(lambda: sup._exits["node0"].reaped.is_set(), "the waiter to see the reap")
    assert struct.unpack("qq", counts[:16]) == at_report  # nothing ran after the report
    assert len(exits) == 1, exits
    sup.stop_all()


def test_an_exit_of_its_own_is_left_to_the_reaper(tmp_path: Path) -> None:
    """The crash watch tells only deaths by signal: a process that exits by itself is reported
    by its reaper with its own code (its files and records are complete only by then)."""
    (tmp_path / "ender.py").write_text("import sys; sys.exit(3)")
    got: list[int] = []
    sup = Supervisor(tmp_path / "logs", lambda node, code: got.append(code), module="ender",
                     starter=_HeldStarter())
    sup.spawn("node0", dict(os.environ, PYTHONPATH=str(tmp_path)))
    proc = sup.procs["node0"]
    until(lambda: _state(proc.pid) == "Z", "the child to exit")
    sup.look_for_crashes()
    assert got == []
    proc.gate.set()
    until(lambda: got != [], "the reaper's report")
    assert got == [3]
    sup.stop_all()


def test_a_death_watch_reads_the_same_as_proc_and_nothing_once_reaped() -> None:
    """The crash watch's open descriptor says what `signalled_past_acting` says, from one
    pread; once the process is reaped it says nothing (the descriptor stays bound to it)."""
    from spotpipe.cluster.proc import DeathWatch

    own = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watches = {p.pid: DeathWatch(p.pid) for p in (own, killed)}
    try:
        assert watches[killed.pid].signalled_past_acting() is None  # running
        until(lambda: _state(own.pid) == "Z", "the exiting child to become a zombie")
        assert watches[own.pid].signalled_past_acting() is None  # its own exit: the reaper's
        os.kill(killed.pid, signal.SIGTERM)
        until(lambda: watches[killed.pid].signalled_past_acting() == signal.SIGTERM,
              "the signalled child to be past acting")
    finally:
        own.wait()
        killed.kill()
        killed.wait()
    assert all(w.signalled_past_acting() is None for w in watches.values())  # reaped
    for w in watches.values():
        w.close()
