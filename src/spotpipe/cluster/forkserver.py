"""A fork server: one process that has imported the worker's modules forks every worker.

A fresh worker interpreter spends about 3 s of CPU importing torch and spotpipe before it
does anything (3.4 s on our 2-core VMs): four workers starting together on two cores wait
7 s, a replacement node as long. The server pays the import once; each worker is then a fork
of it, ready in milliseconds, with the same modules and nothing run yet.

Why our own and not multiprocessing's forkserver: that one is a single server per parent
process, started with whatever environment the parent had at the time, whose children
re-import the parent's `__main__` and run a pickled callable. Ours is one per start-time
environment (`start_key`), started in the workers' own, because glibc's tunables and OpenMP
read theirs when a process starts; it dies with the process that started it; and it runs a
module as `python -m` runs it.

Safe to fork because the server never runs torch: no thread pool has started, no device is
initialised, and the one thread it runs is the one that forks. Messages travel as JSON lines:
requests (`Spawn`) on the server's stdin; `Spawned` and `Exited` on its stdout (which nothing
else writes to: the server's own fd 1 goes to its log), in the order that the server saw them,
so a child's `Spawned` always comes before its `Exited`.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import setproctitle

from spotpipe.cluster.proc import killed_past_acting, signal_name


@dataclass(frozen=True)
class Spawn:
    """Fork a child that runs `module` as `python -m module` would, with `env` as its whole
    environment, `cwd` as its working folder, its stdout and stderr appended to `log`, and
    `title` as its name in ps."""
    module: str
    log: str
    title: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Spawned:
    pid: int


@dataclass(frozen=True)
class Exited:
    pid: int
    code: int  # as Popen.returncode: the exit status, or minus the signal that ended it


_MESSAGES: dict[str, type[Any]] = {"spawn": Spawn, "spawned": Spawned, "exited": Exited}
_KINDS = {cls: kind for kind, cls in _MESSAGES.items()}


def encode(message: Spawn | Spawned | Exited) -> bytes:
    return (json.dumps({"kind": _KINDS[type(message)], **asdict(message)}) + "\n").encode()


def decode(line: bytes) -> Spawn | Spawned | Exited:
    record = json.loads(line)
    cls = _MESSAGES[record.pop("kind")]
    return cls(**record)  # type: ignore[no-any-return]


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)


# --- the server's side -------------------------------------------------------------------------


def _child(request: Spawn, server: int, keep_out: Sequence[int], base_path: list[str]) -> None:
    """In the forked child: become the worker, as a fresh `python -m` would be; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent()  # the chain: supervisor -> server -> worker
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        for fd in keep_out:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(request.env)
        if request.cwd:
            os.chdir(request.cwd)
        # sys.path as `python -m` makes it: the working folder, PYTHONPATH's folders, the rest
        sys.path[:] = [os.getcwd(), *_folders(request.env.get("PYTHONPATH", "")), *base_path]
        if request.env.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.argv = [request.module]
        if request.title:
            setproctitle.setproctitle(request.title)
        # run_module warns that the module was imported before it ran: here that is the point
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                message=".* found in sys.modules after import of package")
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _folders(pythonpath: str) -> list[str]:
    return [p for p in pythonpath.split(os.pathsep) if p]


def serve(preload: Sequence[str]) -> None:
    """The server's loop: import `preload` (the first module must import; the others are
    only a head start), then fork on each request and report each exit.
    Ends when its stdin closes (the supervisor is done or gone); children still running
    then die with it (PR_SET_PDEATHSIG)."""
    # a Ctrl-C in the terminal reaches the whole process group: the supervisor stops the
    # workers and then closes stdin, which ends this server; it must not die first (with a
    # traceback on the user's terminal, and its children killed before they were told)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the messages go out on a copy of fd 1, and fd 1 itself to the server's log (its stderr):
    # what a preloaded module prints, from Python or from C, cannot corrupt a message
    channel = os.dup(1)
    os.dup2(2, 1)
    # what each child's sys.path keeps: not the server's working folder nor its PYTHONPATH
    own = set(_folders(os.environ.get("PYTHONPATH", "")))
    base_path = [p for p in sys.path[1:] if p not in own]
    # torch.cuda.is_available(), which a preloaded module may call, then asks NVML instead of
    # initialising CUDA, which no forked child could use after that
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for i, module in enumerate(preload):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if i == 0:  # what the children run: nothing can start without it
                raise
            # the rest only speed the children up; one that needs it imports it itself, and
            # says what is missing
            print(f"spotpipe fork server: not preloaded: {module} ({exc})", file=sys.stderr,
                  flush=True)
    sys.stdout.flush()  # (not into a child's log, after a fork)
    # a fork's name in ps is written over the server's command line, never over its environment
    # (which /proc/PID/environ shows: the first worker's, as the server started with it)
    os.environ["SPT_NOENV"] = "1"
    setproctitle.setproctitle(f"spotpipe fork server [{' '.join(preload)}]")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up byte is what matters)
    me, pending = os.getpid(), b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            os.write(channel, encode(Exited(pid, os.waitstatus_to_exitcode(status))))
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = decode(line)
            if not isinstance(request, Spawn):
                raise TypeError(f"fork server: a {type(request).__name__} is not a request")
            pid = os.fork()
            if pid == 0:
                _child(request, me, (0, channel, wake_r, wake_w), base_path)
            os.write(channel, encode(Spawned(pid)))


# --- the supervisor's side ---------------------------------------------------------------------


class ForkedChild:
    """A worker forked by the server, with the parts of Popen's interface a supervisor uses."""

    def __init__(self, module: str) -> None:
        self.args = [module]
        self.pid = 0
        self.returncode: int | None = None
        self._forked = threading.Event()
        self._ended = threading.Event()
        self._error = ""
        self.server: ForkServer | None = None  # the server it was forked from

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended_with(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class ForkServer:
    """Starts workers as forks of a server that imported `preload`. The server starts with the
    first worker, in that worker's environment, and ends with `close`."""

    def __init__(self, preload: Sequence[str], log: Path | None,
                 start_timeout_s: float = 300.0) -> None:
        self.preload = list(preload)
        self.log = log
        self.start_timeout_s = start_timeout_s
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._waiting: deque[ForkedChild] = deque()  # sent, not yet forked
        self._children: dict[int, ForkedChild] = {}
        self._gone = False
        self._garbled = ""  # a line from the server that was not a message
        self._reaped = threading.Event()  # the server has ended and been waited for

    def start(self, module: str, env: dict[str, str], log: Path, name: str) -> ForkedChild:
        child = ForkedChild(module)
        child.server = self
        with self._lock:
            if self._gone:
                raise RuntimeError(f"the fork server has ended (its output: {self._output})")
            if self._server is None:
                self._launch(env)
            assert self._server is not None and self._server.stdin is not None
            self._waiting.append(child)
            title = f"python -m {module} [{name}]"  # (`pgrep -f MODULE` finds it as before)
            self._server.stdin.write(encode(Spawn(module, str(log), title, os.getcwd(), env)))
            self._server.stdin.flush()
        if not child._forked.wait(self.start_timeout_s) or not child.pid:
            raise RuntimeError(f"the fork server did not start {module}"
                               f"{': ' + child._error if child._error else ''} "
                               f"(its output: {self._output})")
        return child

    @property
    def _output(self) -> str:
        return str(self.log) if self.log is not None else "stderr"

    @property
    def gone(self) -> bool:
        return self._gone

    def close(self) -> None:
        """End the server (after the supervisor's own children are gone)."""
        with self._lock:
            server, self._gone = self._server, True
        if server is not None and server.stdin is not None:
            server.stdin.close()
            server.wait()

    def launch(self, env: dict[str, str]) -> None:
        """Start the server in `env`, if it has not started (it imports its modules while
        this process goes on)."""
        with self._lock:
            if self._server is None and not self._gone:
                self._launch(env)

    def _launch(self, env: dict[str, str]) -> None:
        launched = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            # this thread starts the server and reads it until it ends: the server dies with
            # the thread that started it (PR_SET_PDEATHSIG), so that thread must live as long
            try:
                if self.log is not None:
                    self.log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log or os.devnull, "ab") as log:
                    self._server = subprocess.Popen(
                        [sys.executable, "-m", "spotpipe.cluster.forkserver", *self.preload],
                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=log if self.log is not None else None,
                        preexec_fn=die_with_parent)
            except BaseException as exc:
                failed.append(exc)
                return
            finally:
                launched.set()
            assert self._server.stdout is not None
            for line in self._server.stdout:
                try:
                    message = decode(line)
                except (ValueError, KeyError, TypeError):  # not ours: nothing can be trusted
                    self._garbled = line[:200].decode(errors="replace")
                    self._server.kill()
                    break
                self._receive(message)
            self._server.wait()
            self._reaped.set()
            self._lost()

        threading.Thread(target=run, name="fork-server", daemon=True).start()
        launched.wait()
        if failed:
            self._gone = True
            raise RuntimeError(f"cannot start the fork server: {failed[0]}") from failed[0]

    def ended_how(self, wait_s: float = 5.0) -> str:
        """How the server ended ("was killed by SIGKILL", "exited with code 1"), or "" while
        it runs. Its children die with it (PR_SET_PDEATHSIG), as it becomes a zombie: a
        child seen dead may come before this process has read the server's end, which is
        then waited for (its pipe's end comes at once)."""
        server = self._server
        if server is None or not (self._reaped.is_set() or _ended(server.pid)):
            return ""
        self._reaped.wait(wait_s)
        code = server.returncode
        if code is None:
            return "ended"
        return (f"was killed by {signal_name(-code)}" if code < 0
                else f"exited with code {code}")

    def _receive(self, message: Spawn | Spawned | Exited) -> None:
        if isinstance(message, Spawned):
            with self._lock:
                child = self._waiting.popleft()
                child.pid = message.pid
                self._children[message.pid] = child
            child._forked.set()
        elif isinstance(message, Exited):
            with self._lock:
                ended = self._children.pop(message.pid, None)
            if ended is not None:
                ended._ended_with(message.code)

    def _lost(self) -> None:
        """The server ended: its children die with it (PR_SET_PDEATHSIG). A child is told
        ended once it can no longer act, as `Supervisor.kill` tells a kill."""
        with self._lock:
            self._gone = True
            waiting, self._waiting = list(self._waiting), deque()
            children, self._children = dict(self._children), {}
        for child in waiting:
            child._error = (f"it wrote {self._garbled!r} where a message belongs"
                            if self._garbled else "it ended first")
            child._forked.set()
        for pid, child in children.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10.0
            while (os.path.exists(f"/proc/{pid}") and not killed_past_acting(pid)
                   and time.monotonic() < deadline):
                time.sleep(0.001)
            child._ended_with(-signal.SIGKILL)


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: a zombie, or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")


def start_key(preload: Sequence[str], env: dict[str, str]) -> tuple[str, ...]:
    """What a server's children inherit from the server's start, not from their request: the
    interpreter, the modules imported, and the environment read when a process starts (the
    dynamic loader's, glibc's tunables, OpenMP's and MKL's thread counts, the interpreter's
    own settings). PYTHONPATH and the working folder each child sets for itself."""
    started = sorted(f"{k}={v}" for k, v in env.items()
                     if k.startswith(("LD_", "GLIBC_", "OMP_", "MKL_", "KMP_", "PYTHON"))
                     and k != "PYTHONPATH")
    return (sys.executable, *preload, "", *started)


_SHARED: dict[tuple[str, ...], ForkServer] = {}
_SHARED_LOCK = threading.Lock()


class SharedForkServer:
    """A job's way to start its workers: this process's fork server for the job's module and
    start-time environment (`start_key`), made at the first start and kept for the next job
    in the same process (a restart by `failover.restarts`, a test suite's jobs), whose
    workers are then forks at once. The servers end with this process; `close` leaves them."""

    def __init__(self, preload: Sequence[str], log: Path | None) -> None:
        self.preload = list(preload)
        self.log = log  # the server's own output: the job's logs (None: this process's stderr)

    def start(self, module: str, env: dict[str, str], log: Path, name: str) -> ForkedChild:
        return self._server(env).start(module, env, log, name)

    def prestart(self, env: dict[str, str]) -> None:
        """Start the server for `env` now, without a child yet."""
        self._server(env).launch(env)

    def _server(self, env: dict[str, str]) -> ForkServer:
        key = start_key(self.preload, env)
        with _SHARED_LOCK:
            server = _SHARED.get(key)
            if server is None or server.gone:
                server = _SHARED[key] = ForkServer(self.preload, self.log)
        return server

    def close(self) -> None:
        pass


if __name__ == "__main__":
    serve(sys.argv[1:])
