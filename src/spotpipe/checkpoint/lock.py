"""One job per checkpoint folder: a lock file that names its holder.

Two jobs writing into one `checkpoint.dir` would delete each other's checkpoints (retention)
and partial folders (the clean-up at start). The job that starts first creates
`DIR/.spotpipe.lock` (O_EXCL, so two starting at once cannot both win) holding JSON: host,
pid and run folder. A second job is refused with the holder's name. A lock left by a process
that is gone (same host, pid not alive) is taken over; one from another host cannot be
checked from here, so the message says which file to remove if that job is over.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

LOCK = ".spotpipe.lock"


class LockHeld(RuntimeError):
    """Another job holds the folder; the message names it."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, run folder {self.run}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["host"]), int(data["pid"]), str(data["run"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder(folder: Path) -> Holder | None:
    """Who holds `folder` now (None: free, or a lock of a dead process on this host)."""
    path = folder / LOCK
    if not path.exists():
        return None
    held = _read(path)
    if held is None:
        return Holder("?", -1, f"unreadable lock file {path}")
    if held.host == socket.gethostname() and not _alive(held.pid):
        return None
    return held


def refuse_if_held(folder: Path) -> None:
    held = holder(folder)
    if held is not None:
        raise LockHeld(f"{folder} is in use by another job ({held.describe()}); give this job "
                       f"another checkpoint.dir, or remove {folder / LOCK} if that job is over")


def acquire(folder: Path, run: Path) -> Holder:
    """Take the folder for this process (creating it), or raise LockHeld."""
    folder.mkdir(parents=True, exist_ok=True)
    me = Holder(socket.gethostname(), os.getpid(), str(run.resolve()))
    path = folder / LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            refuse_if_held(folder)
            path.unlink(missing_ok=True)  # a dead process's lock: taken over
            continue
        _write(os.fdopen(fd, "w"), me)
        return me
    refuse_if_held(folder)
    raise LockHeld(f"{path}: could not be taken (another job started at the same moment)")


def release(folder: Path) -> None:
    """Remove the lock if this process holds it."""
    path = folder / LOCK
    held = _read(path)
    if held is not None and held.pid == os.getpid() and held.host == socket.gethostname():
        path.unlink(missing_ok=True)


def adopt(folder: Path, run: Path) -> Holder:
    """Take over the lock of a job that goes on in this process (a coordinator succeeding
    one on another host): the file names this process from now on, so that it is released
    at the job's end and a later job on this host can tell whether its holder lives."""
    me = Holder(socket.gethostname(), os.getpid(), str(run.resolve()))
    tmp = folder / f"{LOCK}.{me.host}.{me.pid}"
    _write(open(tmp, "w"), me)
    os.replace(tmp, folder / LOCK)
    return me


def _write(f: IO[str], holder: Holder) -> None:
    """The lock's content, durable before the file counts as taken."""
    with f:
        json.dump(asdict(holder), f)
        f.flush()
        os.fsync(f.fileno())
