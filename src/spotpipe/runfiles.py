"""Reading a run's JSON-lines files (metrics.jsonl, events.jsonl) and the JSON files users
give (a run's summary, a simulator profile, prices, a calibration): one reader for the plot,
the benchmarks and the simulator, with errors that name file and line. Standard library
only, so the torch-free simulator can use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path, require: dict[str, str] | None = None, *,
               partial_tail: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. With `require` ({key: "number" | "number or null" |
    "string"}), each record must be an object holding those keys with values of that kind.
    With `partial_tail`, a last line without its newline that is not JSON is left out: the
    line a running job is writing, or the one a job killed mid-write (a full disk) cut."""
    path = Path(path)
    text = read_text(path)
    lines = text.splitlines()
    out = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if partial_tail and lineno == len(lines) and not text.endswith("\n"):
                    break
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
            if require is not None:
                _check_record(record, require, f"{path}:{lineno}")
            out.append(record)
    return out


def read_text(path: str | Path, what: str = "") -> str:
    """A file's text; ValueError naming the file (and `what` it was read as) when it cannot
    be read or is not UTF-8."""
    cannot = f"cannot read {what}" if what else "cannot read"
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: {cannot}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: {cannot}: not a text file: {exc.reason}") from None


def read_json(path: str | Path, what: str = "") -> Any:
    """A JSON file's value; ValueError naming the file and line (`read_text`'s, or the line
    where the JSON breaks)."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: "
                         f"{f'cannot read {what}: ' if what else ''}invalid JSON: "
                         f"{exc.msg}") from None


def run_status(summary: dict[str, Any]) -> str:
    """A run's outcome as a user reads it: summary.json says "failed" for a run stopped by
    Ctrl-C (every consumer of the file knows two statuses), but nothing failed there."""
    status = str(summary.get("status"))
    if status == "failed" and str(summary.get("message", "")).startswith("interrupted"):
        return "interrupted"
    return status


def blocking_file(folder: str | Path) -> Path | None:
    """What stops `folder` from being made (mkdir parents=True): the folder itself or the
    nearest of its parents that exists, when that is not a folder; None otherwise."""
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            return None if path.is_dir() else path
        if path.is_symlink():  # (a dangling link: mkdir would fail on it too)
            return path
    return None


_KINDS = {"number": (int, float), "number or null": (int, float, type(None)), "string": (str,)}


def _check_record(record: Any, require: dict[str, str], where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {json.dumps(record)[:60]}")
    for key, kind in require.items():
        if key not in record:
            raise ValueError(f"{where}: the record has no {key!r}")
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, _KINDS[kind]):
            raise ValueError(f"{where}: {key} must be a {kind}, got {json.dumps(value)[:60]}")
