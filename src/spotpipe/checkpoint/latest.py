"""The checkpoint folder's pointer to its timeline's newest checkpoint: the file `latest`.

Which checkpoint a `--resume ROOT` goes on from cannot be read off the folder names alone:
a folder can hold more than one run's checkpoints. A job resumed from `iter_50` in a folder
that holds `iter_100` writes `iter_60`, and a job started afresh in it writes `iter_10`;
the highest iteration there is then another timeline's, and resuming from it would train on
silently from a run the user left. So, as DeepSpeed's `latest` file, the job that holds the
folder's lock says where its timeline stands: at its start (the checkpoint it resumed from
when that is in the folder, else none yet) and after each commit. Readers take the newest
checkpoint at or before it. A folder without the file (written by an older spotpipe) is read
by its names, as before.

The pointer is not signed: it only picks among checkpoints, each of which is verified (its
checksums, and its MAC under the job's key) before anything is loaded from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from spotpipe.checkpoint.fsync import fsync_path

NAME = "latest"
_MAX_BYTES = 4096


class PointerError(ValueError):
    """A `latest` file that is not one this module wrote; the message names it."""


@dataclass(frozen=True)
class Latest:
    """Where the timeline of the job that last held the folder stands."""

    iteration: int | None  # its newest committed checkpoint; None: none committed yet

    def to_json(self) -> str:
        return json.dumps({"iteration": self.iteration})


def write(root: Path, iteration: int | None) -> None:
    """Point the folder at `iteration` (None: the job that holds it has committed nothing
    yet), atomically and durably: a reader sees the old pointer or the new one."""
    path = root / NAME
    tmp = root / f".{NAME}.tmp"
    with open(tmp, "w") as f:
        f.write(Latest(iteration).to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(root)


def read(root: Path) -> Latest | None:
    """The folder's pointer; None where there is none. PointerError where the file is not
    one `write` wrote (a reader must not guess which timeline is meant)."""
    path = root / NAME
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            raise ValueError(f"over {_MAX_BYTES} bytes")
        value = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise PointerError(_unreadable(path, str(exc))) from None
    iteration = value.get("iteration", "absent") if isinstance(value, dict) else "absent"
    if iteration is not None and (not isinstance(iteration, int) or isinstance(iteration, bool)
                                  or iteration < 0):
        raise PointerError(_unreadable(path, f"its iteration is {iteration!r}"))
    return Latest(iteration)


def _unreadable(path: Path, why: str) -> str:
    return (f"{path}: not a pointer to a checkpoint ({why}); remove it to resume from the "
            "highest iteration there, or name the checkpoint folder (iter_N) to resume from")


def advance(root: Path, iteration: int) -> None:
    """Point the folder at `iteration`, just committed, unless it points at a later one
    already. Within a job's timeline commits only go forward (`write` at its start sets where
    it goes on from); a later pointer there is the job's own, written by the coordinator that
    succeeded one which lost the store and went on committing what it held: moving the
    pointer back to that one's commit made a `--resume` go on from the older checkpoint."""
    try:
        now = read(root)
    except PointerError:
        now = None  # (one `write` did not write: this commit's pointer replaces it)
    if now is not None and now.iteration is not None and now.iteration > iteration:
        return
    write(root, iteration)

