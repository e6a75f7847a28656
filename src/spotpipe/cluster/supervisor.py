"""Worker processes on one host: start them with torchrun's environment, report their exits.

The local launcher runs every node of a job on this machine; a node agent (`spotpipe agent`)
runs the nodes of its own host. Both start workers the same way, as forks of a server that
has imported torch once (`spotpipe.cluster.forkserver`; `cluster.fork_server: false` starts
each in a fresh interpreter, as torchrun does), and learn of an exit through a callback (a
thread waits on each process: Popen.poll is unreliable while another thread waits on the same
child). A process this supervisor kills, or that dies of a signal of its own (a crash), is
reported at the moment it can no longer act (`spotpipe.cluster.proc`), before the kernel's
teardown ends in its reap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from spotpipe.cluster.forkserver import ForkedChild, SharedForkServer, die_with_parent
from spotpipe.cluster.oom import OomCount, oom_cause, read_oom_kills
from spotpipe.cluster.proc import DeathWatch, killed_past_acting
from spotpipe.config import Config
from spotpipe.faults import Fault

if TYPE_CHECKING:  # (this module stays free of torch: `prestart` runs before it is imported)
    from spotpipe.store.address import StoreAddress

# how long a stopped process has after its SIGTERM before the SIGKILL (a worker's final save,
# a node leaving on its notice)
STOP_GRACE_S = 10.0


class Terminated(KeyboardInterrupt):
    """A SIGTERM to the supervising process: what a batch scheduler sends (Slurm's scancel or
    time limit, then SIGKILL after its grace), or `kill PID`. It stops the job as a Ctrl-C
    does (a KeyboardInterrupt, so every path that stops on one stops on it), where the default
    action killed the launcher at once: no summary, the run's files and lock left as they were,
    and the exit told only as a signal."""


def stop_on_sigterm() -> None:
    """From now on a SIGTERM to this process raises `Terminated` in its main thread."""
    def terminated(*_: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)


def interruption(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the job, as its messages say it, and the exit code a shell reports for a
    process that signal ends (128 + the signal's number)."""
    if isinstance(exc, Terminated):
        return "SIGTERM", 128 + signal.SIGTERM
    return "Ctrl-C", 128 + signal.SIGINT


def search_path(cfg: Config) -> list[str]:
    """Where user factories are imported from: the working folder and the config's folder."""
    return [p for p in dict.fromkeys([os.getcwd(), cfg.source_dir]) if p]


class Starter(Protocol):
    """How a supervisor starts its processes."""

    def start(self, module: str, env: dict[str, str], log: Path,
              name: str) -> subprocess.Popen[bytes] | ForkedChild: ...

    def close(self) -> None: ...


class FreshInterpreters:
    """Each process a new `python -m module`, as torchrun starts its workers."""

    def start(self, module: str, env: dict[str, str], log: Path,
              name: str) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:  # (a restarted node goes on with its log)
            # workers get SIGKILL if their launcher or agent dies: none outlives its job
            return subprocess.Popen([sys.executable, "-m", module], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def close(self) -> None:
        pass


def starter(cfg: Config, module: str, logs: Path) -> Starter:
    """The job's way to start `module`'s processes: forks of this process's server that
    imported it, unless the config asks for fresh interpreters."""
    if cfg.cluster.fork_server:
        return SharedForkServer(preload(cfg, module),
                                logs / f"forkserver-{module.rsplit('.', 1)[-1]}.log")
    return FreshInterpreters()


WORKER = "spotpipe.cli.worker"
# transformers' own import is most of a worker's start with a transformers model: 7-8 s of CPU
# for `transformers.modeling_utils` alone on our 2-core VMs, paid by every worker unless the
# server pays it once
TRANSFORMERS = ("transformers", "transformers.modeling_utils", "transformers.masking_utils",
                "spotpipe.model.hf")
TRANSFORMERS_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")  # spotpipe.model.hf's


SHADOW = "spotpipe.checkpoint.shadow"
# torch.optim's Optimizer.__init__ imports torch._dynamo at its first call (the
# `_disable_dynamo` wrapper): 1.5 s of CPU on our 2-core VMs, which every worker and shadow
# paid after its fork, as it built its stage's optimizer, unless the server pays it once
OPTIMIZER = ("torch._dynamo",)
# a job that writes checkpoints: DCP's package, imported at a stage's first save (0.5-2 s)
CHECKPOINTS = ("torch.distributed.checkpoint", "spotpipe.checkpoint.dcp_json",
               "torch.utils.serialization")


def preload(cfg: Config, module: str) -> list[str]:
    """What the fork server imports before it forks `module`'s processes. A job's workers and
    its shadows fork from one server: the list is the same for both (and so is the server's
    key, `forkserver.start_key`), where two servers each imported torch and the rest, 3-5 s of
    CPU more per job with shadows. It holds the modules they run, what building an optimizer
    and (in a job that writes them) saving a checkpoint import, and for a transformers model
    the library and the model family's module, which a shadow needs as much as a worker: both
    build the model."""
    if module not in (WORKER, SHADOW):
        return [module]
    runs = [WORKER, *([SHADOW] if cfg.shadow.enabled or module == SHADOW else [])]
    common = [*runs, *OPTIMIZER, *(CHECKPOINTS if cfg.checkpoint.every else ())]
    if cfg.model.kind != "hf":
        return common
    family = _transformers_model_type(cfg.model.hf.config)
    return [*common, *TRANSFORMERS] + (
        [f"transformers.models.{family}.modeling_{family}"]
        if family in TRANSFORMERS_FAMILIES else [])


def _transformers_model_type(spec: str) -> str:
    """The model type a `model.hf.config` names: the type itself, or a folder's config.json's
    `model_type` ("" when it cannot be read: the worker then reports the problem)."""
    folder = Path(spec)
    if not folder.is_dir():
        return spec
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return model_type if isinstance(model_type, str) else ""


def huge_page_tunables(current: str | None) -> str:
    """glibc's tunables for a worker: its malloc asks for transparent huge pages
    (`glibc.malloc.hugetlb=1`, glibc 2.35 and later; ignored elsewhere). A killed worker's
    memory is then freed in 2 MiB pages rather than 4 KiB ones, and the kernel's teardown,
    which peers wait out before its sockets close, takes half as long (measured: 15-18 ms
    against 30-37 ms for a worker holding torch, median of 6 kills). A choice the user made
    in GLIBC_TUNABLES stands."""
    if not current:
        return "glibc.malloc.hugetlb=1"
    if "glibc.malloc.hugetlb" in current:
        return current
    return f"{current}:glibc.malloc.hugetlb=1"


# torch's TCPStore client looks up the name of the address it connected to on every connection
# (it formats the v4-mapped address with getnameinfo, which /etc/hosts does not answer); so
# does its server for each peer it accepts, in the loop thread that serves every client. When
# the resolver drops such a query, glibc asks again only after its default 5 s: measured on a
# VM whose resolver drops about one query in 25, 8 of 200 connections took 5.0 s, and a
# connection accepted meanwhile held every other client's get for 5.0 s. A regroup that takes
# a connection then stalls for 5 s. One second per try and five tries bound that stall at 1 s
# (7 of 200 at 1.0 s) and leave a real lookup its patience. RES_OPTIONS amends resolv.conf
# per process (resolv.conf(5)); a user's own setting is kept.
RESOLVER_OPTIONS = "timeout:1 attempts:5"


def resolver_options(environ: Mapping[str, str]) -> str:
    """The RES_OPTIONS for the job's processes: the user's, else `RESOLVER_OPTIONS`."""
    return environ.get("RES_OPTIONS") or RESOLVER_OPTIONS


def start_env(cfg: Config, search_path: Sequence[str]) -> dict[str, str]:
    """What every process of the job starts with, before its own variables: this process's
    environment, glibc's tunables and resolver options, the torch threads and the search
    path."""
    return dict(os.environ, GLIBC_TUNABLES=huge_page_tunables(os.environ.get("GLIBC_TUNABLES")),
                RES_OPTIONS=resolver_options(os.environ),
                OMP_NUM_THREADS=str(cfg.cluster.threads_per_worker),
                PYTHONPATH=os.pathsep.join(list(search_path) + [os.environ.get("PYTHONPATH", "")])
                .rstrip(os.pathsep))


def prestart(cfg: Config, logs: Path | None = None) -> None:
    """Start the job's fork servers now, so that they import torch while this process does
    (`spotpipe train` before it imports the launcher): on two cores that halves the time to
    the first iteration's start."""
    if not cfg.cluster.fork_server:
        return
    # (the shadows' server is the workers', see `preload`)
    SharedForkServer(preload(cfg, WORKER), logs).prestart(start_env(cfg, search_path(cfg)))


def worker_env(cfg: Config, *, rank: int, world: int, local_rank: int, local_world: int,
               address: StoreAddress, run_dir: Path, t0: float, token: str, instance: str,
               search_path: Sequence[str], faults: Sequence[Fault] = (),
               joining: bool = False, gated: bool = False, resume: str = "",
               start_after: Sequence[str] = ()) -> dict[str, str]:
    """The environment of one worker process (worker.py's docstring lists what it reads)."""
    return dict(start_env(cfg, search_path),
                RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(local_world), **address.env(), SPOTPIPE_RUN_DIR=str(run_dir),
                SPOTPIPE_T0=repr(t0), SPOTPIPE_FAULTS=json.dumps([f.to_json() for f in faults]),
                SPOTPIPE_JOIN="1" if joining else "", SPOTPIPE_JOIN_GATED="1" if gated else "",
                SPOTPIPE_START_AFTER=",".join(start_after), SPOTPIPE_JOIN_TOKEN=token,
                SPOTPIPE_INSTANCE=instance, SPOTPIPE_RESUME=resume)


class _Exit:
    """One process's exit, told once: by the waiter at the reap, or earlier by `kill`'s
    watch when the process can no longer act."""

    def __init__(self, tell: Callable[[int], None]) -> None:
        self.tell = tell
        self.reaped = threading.Event()
        self._told = False
        self._lock = threading.Lock()

    @property
    def told(self) -> bool:
        return self._told

    def report(self, code: int) -> None:
        with self._lock:
            if self._told:
                return
            self._told = True
        self.tell(code)


class Supervisor:
    """The worker processes this process started, by node name."""

    # how often the crash watch looks at the processes (a wake-up and a pread of /proc per
    # process each time: measured, the supervising process's CPU 0.31 % of a core with 4
    # sleeping workers, 0.46 % with 8), for a crash seen 5 ms after it on average rather than
    # when the kernel's teardown of the process ends
    CRASH_POLL_S = 0.01

    def __init__(self, logs: Path, on_exit: Callable[[str, int], None], *,
                 module: str = "spotpipe.cli.worker", starter: Starter | None = None) -> None:
        self.logs = logs
        self.on_exit = on_exit
        self.module = module  # what the processes run (workers; or the CPU shadows)
        self.starter = starter or FreshInterpreters()
        self.procs: dict[str, subprocess.Popen[bytes] | ForkedChild] = {}
        self._exits: dict[str, _Exit] = {}
        self._stopped = threading.Event()
        self._watch: threading.Thread | None = None
        self._deaths: dict[str, DeathWatch] = {}  # the crash watch's, by node
        self._looking = threading.Lock()
        # the cgroup's OOM kill count, read as each node started (`oom.py`), and the nodes
        # this supervisor killed: an OOM kill is told apart from a SIGKILL by the count
        self.oom_kills: Callable[[], OomCount | None] = read_oom_kills
        self._oom_at_start: dict[str, OomCount | None] = {}
        self._killed: set[str] = set()

    def spawn(self, node: str, env: dict[str, str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._killed.discard(node)
        self._oom_at_start[node] = self.oom_kills()  # (before: an OOM kill as it starts counts)
        proc = self.starter.start(self.module, env, self.logs / f"{node}.log", node)
        self.procs[node] = proc
        exit_ = self._exits[node] = _Exit(lambda code: self.on_exit(node, code))
        if self._watch is None:
            self._watch = threading.Thread(target=self._watch_crashes, name="crash-watch",
                                           daemon=True)
            self._watch.start()

        def wait() -> None:
            code = proc.wait()
            exit_.reaped.set()
            exit_.report(code)

        threading.Thread(target=wait, name=f"wait-{node}", daemon=True).start()

    def lost_with_its_server(self, node: str) -> str:
        """Why `node`'s process died, where its fork server's end killed it (every worker
        it had forked dies with it): "" for a process that died on its own."""
        proc = self.procs.get(node)
        server = proc.server if isinstance(proc, ForkedChild) else None
        how = server.ended_how() if server is not None else ""
        return f"the fork server that starts the workers {how}, and they died with it" \
            if how else ""

    def exit_cause(self, node: str, code: int) -> str:
        """What this supervisor knows of why `node` exited with `code`, beyond the code: its
        fork server's end, which kills its workers with a signal, or the kernel's OOM killer
        ("": nothing more)."""
        if code >= 0:
            return ""
        return self.lost_with_its_server(node) or self.oom_killed(node, code)

    def oom_killed(self, node: str, code: int) -> str:
        """The OOM killer, said with its count (`oom.oom_cause`), where `node` died of a
        SIGKILL that this supervisor did not send and its cgroup's count of OOM kills grew
        since the node started; else ""."""
        if code != -signal.SIGKILL or node in self._killed:
            return ""
        return oom_cause(self._oom_at_start.get(node), self.oom_kills())

    def signal(self, node: str, signum: int) -> bool:
        """Send a signal to a node's process if it still runs; whether it was sent."""
        proc = self.procs.get(node)
        if proc is None or proc.returncode is not None:
            return False
        if signum == signal.SIGKILL:  # (before the kill: its exit may be told at once)
            self._killed.add(node)
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def kill(self, node: str, poll_s: float = 0.001) -> bool:
        """SIGKILL a node's process and report its exit (code -9) as soon as it can no longer
        act, instead of at its reap; whether the kill was sent."""
        proc, exit_ = self.procs.get(node), self._exits.get(node)
        if proc is None or exit_ is None or not self.signal(node, signal.SIGKILL):
            return False

        def watch() -> None:
            # polled: the kernel offers no event for this moment (spotpipe.cluster.proc); the
            # reap ends the watch in any case, and then the waiter reports
            while not exit_.reaped.wait(poll_s):
                if killed_past_acting(proc.pid):
                    exit_.report(-signal.SIGKILL)
                    return

        threading.Thread(target=watch, name=f"killed-{node}", daemon=True).start()
        return True

    def _watch_crashes(self) -> None:
        """Report a process that dies of a signal once it can no longer act, not at its reap:
        its peers learn of a crash when its sockets close, at the end of the kernel's
        teardown, which takes tens of milliseconds on an idle machine and seconds where the
        cores are busy (`spotpipe.cluster.proc`); the job learns of it here first."""
        while not self._stopped.is_set():
            time.sleep(self.CRASH_POLL_S)  # (an Event's timed wait costs twice the CPU per wake)
            self.look_for_crashes()

    def look_for_crashes(self) -> None:
        """One look of the crash watch at every process not yet reported (one look at a time:
        a descriptor is never closed while another look reads it)."""
        with self._looking:
            self._look()

    def _look(self) -> None:
        for node, exit_ in list(self._exits.items()):
            watch = self._deaths.get(node)
            if exit_.told or exit_.reaped.is_set():
                if watch is not None:
                    watch.close()
                    del self._deaths[node]
                continue
            if watch is None or watch.pid != self.procs[node].pid:  # (a node started again)
                if watch is not None:
                    watch.close()
                watch = self._deaths[node] = DeathWatch(self.procs[node].pid)
            signum = watch.signalled_past_acting()
            if signum is not None:
                exit_.report(-signum)

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; returns when every process is gone, and with
        them the way they were started."""
        self._stopped.set()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + grace_s
        for node, p in list(self.procs.items()):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._killed.add(node)
                p.kill()
                p.wait()
        self.starter.close()
