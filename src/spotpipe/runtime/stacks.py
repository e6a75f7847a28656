"""A node's threads' stacks, written to its log where a hang is seen.

A hung node is fenced: killed, and what it was doing goes with it. A hang that comes once in
25 runs is then a guess (one was: a wait for a store connection that a dropped DNS query held
5 s, found only from stacks). So the node writes them itself, with `faulthandler`, which
writes from C: it works while the main thread is blocked inside torch's C++ (a store wait, a
gloo wait), where no Python signal handler would run. They go to stderr, which is the node's
log (`logs/nodeN.log`):

- on SIGUSR1, at any time: `kill -USR1 PID` shows what a worker is doing, without a tool;
- when the node's own hang watch reports a stall (`runtime.stall`), before the coordinator
  fences it;
- when carrying out a Decision takes longer than the hang timeout (`watchdog`): a node stuck
  there reports nothing when a peer fails meanwhile, and is fenced for its silence. The dump
  begins with faulthandler's own line, `Timeout (0:00:10)!`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
from collections.abc import Iterator


def install() -> None:
    """Dump every thread's stack on SIGUSR1 (the process goes on)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def dump(why: str) -> None:
    """Every thread's stack now, after a line that says why."""
    print(f"spotpipe: {why}; every thread's stack follows", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)


@contextlib.contextmanager
def watchdog(timeout_s: float) -> Iterator[None]:
    """Dump every thread's stack if the block is still running after `timeout_s` (once; the
    block goes on). One watchdog per process at a time: faulthandler keeps a single timer."""
    faulthandler.dump_traceback_later(timeout_s, repeat=False, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
