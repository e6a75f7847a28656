"""A node's stacks in its log (`spotpipe.runtime.stacks`): on SIGUSR1 the process goes on
after writing them, and a watchdog writes them once its block outlives the timeout, from C,
while the main thread is blocked (here in a read of stdin, as in a store's C++ wait).

Each child blocks in that read until the parent has seen the stacks on its stderr, so no step
here waits on a clock."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    from spotpipe.runtime import stacks

    def blocked_in_a_read(ready=False, watchdog=None):
        if ready:  # (said from inside: a signal after it finds this frame on the stack)
            print("ready", flush=True)
        if watchdog is None:
            return sys.stdin.read()
        with stacks.watchdog(watchdog):  # (entered inside: a dump finds this frame)
            return sys.stdin.read()

    {body}
    print("went on", flush=True)
""")


def _child(body: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD.format(body=body)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stderr_until(child: subprocess.Popen[str], marker: str = "<module>") -> str:
    """stderr's lines up to the first one holding `marker` (EOF fails the test); by default
    to the end of the main thread's stack, whatever frame it was in, so that a dump taken
    elsewhere fails the test instead of leaving it waiting for a line that never comes."""
    lines = []
    assert child.stderr is not None
    for line in child.stderr:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"the child ended without writing {marker!r}: {''.join(lines)}")


def _finish(child: subprocess.Popen[str]) -> str:
    out, _ = child.communicate("", timeout=60)  # closes stdin: the read returns
    assert child.returncode == 0
    return out


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on():
    child = _child("stacks.install()\nblocked_in_a_read(ready=True)")
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGUSR1)
    dumped = _stderr_until(child)
    assert "most recent call first" in dumped and "in blocked_in_a_read" in dumped, dumped
    assert "went on" in _finish(child)


def test_a_watchdog_writes_the_stacks_when_its_block_outlives_the_timeout():
    child = _child("blocked_in_a_read(watchdog=0.05)")
    dumped = _stderr_until(child)
    assert "Timeout (0:00:00.05" in dumped and "in blocked_in_a_read" in dumped, dumped
    assert "went on" in _finish(child)


def test_a_block_done_in_time_writes_nothing():
    child = _child("blocked_in_a_read(watchdog=60)")
    out, err = child.communicate("", timeout=60)
    assert child.returncode == 0 and "went on" in out and "Timeout" not in err


def test_dump_says_why_first():
    child = _child("stacks.dump('node3 stalled 2.0 s')\nblocked_in_a_read()")
    dumped = _stderr_until(child, "<module>")
    assert dumped.startswith("spotpipe: node3 stalled 2.0 s; every thread's stack follows")
    _finish(child)
