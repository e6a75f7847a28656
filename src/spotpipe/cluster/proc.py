"""What Linux's /proc says of a process that is dying: whether it can still act.

A SIGKILLed worker is reaped only after the kernel has freed its memory, 20-55 ms for a Python
process holding torch on our VMs, and only then are its sockets closed. A fenced (hung) node
is killed by this host's supervisor, which knows it sent the kill; waiting for the reap makes
every survivor wait out that teardown before the job can agree on the failover.

The process can do nothing more once every one of its threads has entered the kernel's exit
path: the kernel sets PF_EXITING on a thread when it leaves its last system call for good (a
system call in progress when the signal came, a write to disk say, has ended by then), no
thread can be created once a fatal signal is pending, and what follows is the kernel's own
clean-up (memory, then the open files). The exit code confirms that it is our kill that ends
the process, not an exit of its own in the same instant (whose code the reaper must report).
No notification exists for this moment (pidfd and waitid report the reap), so it is polled.

The same holds for a worker that dies of a signal nobody here sent (a crash, the OOM killer,
an injected fault): its teardown is as long, and longer where other processes keep the cores
busy, since every thread of the dying process must be scheduled to run its exit (measured: a
self-killed worker's peers saw its sockets close 2-3 s later with two busy loops beside a
P = 2 job on 2 cores, against 10 ms on the idle machine).
"""

from __future__ import annotations

import os
import signal

PF_EXITING = 0x4  # include/linux/sched.h
_FLAGS, _EXIT_CODE = 6, 49  # fields 9 and 52 of proc_pid_stat(5), counted after "(comm)"


def signal_name(number: int) -> str:
    """A signal's name ("SIGKILL"), or "signal 40" for one that has none: the real-time
    signals between SIGRTMIN and SIGRTMAX, which `signal.Signals` does not list, and which
    end a process that does not handle them."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stat_fields(path: str) -> list[bytes] | None:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(b")") + 2:].split()  # comm may hold spaces and parentheses


def signalled_past_acting(pid: int) -> int | None:
    """The signal that ends process `pid`, once every one of its threads is past its last
    system call; None for a process that still runs, that ends by exiting itself (its reaper
    reports its code), or that is gone (reaped: its reaper knows how it ended)."""
    leader = _stat_fields(f"/proc/{pid}/stat")
    if leader is None or len(leader) <= _EXIT_CODE:
        return None
    signum = int(leader[_EXIT_CODE]) & 0x7F  # a wait status: the signal, or 0 and a code
    if not signum:
        return None
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    for tid in threads:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None and not int(fields[_FLAGS]) & PF_EXITING:
            return None
    return signum


def killed_past_acting(pid: int) -> bool:
    """Whether process `pid` is ending by SIGKILL with every thread past its last system call
    (the exit code confirms that it is a kill that ends it, not an exit of its own)."""
    return signalled_past_acting(pid) == signal.SIGKILL


class DeathWatch:
    """One process's `/proc` stat kept open, for a watch that looks every few milliseconds:
    its exit code (the stat's last field) read with one pread, about 1 us where opening the
    file each time costs 6. The descriptor stays bound to that process: once it is reaped,
    reads fail, even if its number goes to a new process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd: int | None = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except OSError:  # gone already: its reaper tells how it ended
            self._fd = None

    def signalled_past_acting(self) -> int | None:
        """As the function of that name, for this process."""
        if self._fd is None:
            return None
        try:
            raw = os.pread(self._fd, 4096, 0)
        except OSError:  # reaped
            return None
        if not int(raw.rsplit(None, 1)[-1]) & 0x7F:  # running, or ending by its own exit
            return None
        return signalled_past_acting(self.pid)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
