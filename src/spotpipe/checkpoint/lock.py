"""One job per checkpoint folder: a lock file that names its holder.

Two jobs writing into one `checkpoint.dir` would delete each other's checkpoints (retention)
and partial folders (the clean-up at start). The job that starts first creates
`DIR/.spotpipe.lock` (O_EXCL, so two starting at once cannot both win) holding JSON: host,
pid and run folder. A second job is refused with the holder's name. A lock left by a process
that is gone (same host, pid not alive) is taken over; one from another host cannot be
checked from here, so the message says which file to remove if that job is over.

Taking a stale lock over is removing it and creating ours, two steps: two jobs doing it at
once could each remove the lock the other had just made, and both run. So takeovers are done
one at a time, under an flock of `DIR/.spotpipe.lock.takeover` (which the kernel releases when
its holder dies, so it is never stale itself): under it, a lock is removed only while it is
still a dead process's, and creating ours stays O_EXCL. A lock is only ever judged dead on
the host it names, so the jobs that race to take it over are on one host, where flock holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

LOCK = ".spotpipe.lock"
TAKEOVER = LOCK + ".takeover"  # flocked while a stale lock is taken over (`_takeover`)


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


def refuse_if_held(folder: Path, instead: str = "checkpoint.dir") -> None:
    """LockHeld if a live job holds `folder`; its message says to give this one another
    `instead` (the setting that chose the folder)."""
    held = holder(folder)
    if held is not None:
        raise LockHeld(f"{folder} is in use by another job ({held.describe()}); give this job "
                       f"another {instead}, or remove {folder / LOCK} if that job is over")


def acquire(folder: Path, run: Path) -> Holder:
    """Take the folder for this process (creating it), or raise LockHeld."""
    folder.mkdir(parents=True, exist_ok=True)
    me = Holder(socket.gethostname(), os.getpid(), str(run.resolve()))
    path = folder / LOCK
    try:
        return _create(path, me)
    except FileExistsError:
        refuse_if_held(folder)  # a live holder: refused without waiting for the takeover
    with _takeover(folder):
        # the holder seen dead above may have been taken over since, by a job whose takeover
        # came first: only a lock that is a dead process's now is removed
        if _stale(path):
            path.unlink(missing_ok=True)
        try:
            return _create(path, me)
        except FileExistsError:
            pass
    refuse_if_held(folder)
    raise LockHeld(f"{path}: could not be taken (another job started at the same moment)")


def _create(path: Path, me: Holder) -> Holder:
    """Create the lock naming `me` (FileExistsError when there is one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    _write(os.fdopen(fd, "w"), me)
    return me


def _stale(path: Path) -> bool:
    """Whether the lock file is there and is a process's of this host that is gone (an
    unreadable one is not: its writer may be between creating and writing it)."""
    held = _read(path)
    return held is not None and held.host == socket.gethostname() and not _alive(held.pid)


@contextlib.contextmanager
def _takeover(folder: Path) -> Iterator[None]:
    """Hold the folder's takeover flock: one job at a time takes a stale lock over. The file
    is removed by whoever holds it when done; a job that locked a file removed meanwhile
    (its inode is no longer the path's) locks the path's file again."""
    path = folder / TAKEOVER
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:  # a file system without locks: no safe takeover
                raise LockHeld(f"{folder / LOCK} is a stale lock, but {path} cannot be locked "
                               f"to take it over ({exc}); remove {folder / LOCK} if that job "
                               "is over") from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    path.unlink(missing_ok=True)  # still locked: no one else is in it
                return
        finally:
            os.close(fd)


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
