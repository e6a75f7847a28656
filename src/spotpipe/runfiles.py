"""Reading a run's JSON-lines files (metrics.jsonl, events.jsonl): one reader for the plot,
the benchmarks and the simulator's validation, with errors that name file and line.
Standard library only, so the torch-free simulator can use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
    return out


def blocking_file(folder: str | Path) -> Path | None:
    """What stops `folder` from being made (mkdir parents=True): the folder itself or the
    nearest of its parents that exists, when that is not a folder; None otherwise."""
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            return None if path.is_dir() else path
        if path.is_symlink():  # (a dangling link: mkdir would fail on it too)
            return path
    return None
