"""Tests' view of processes: which are a run's workers, as a person would tell (by the log
their output goes to, `OUT/logs/nodeN.log`, whether each is a fresh interpreter or a fork of
the fork server), and waiting for a condition on them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def workers_of(out: Path) -> dict[str, int]:
    """Node name -> pid of each running worker process of the run in `out`."""
    logs = out.resolve() / "logs"
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            target = Path(os.readlink(f"/proc/{entry}/fd/1"))
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if (target.parent == logs and target.name.startswith("node")
                and b"spotpipe.cli.worker" in cmdline):
            found[target.stem] = int(entry)
    return found
