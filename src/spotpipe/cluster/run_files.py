"""The run's output files, `metrics.jsonl` and `events.jsonl` (and TensorBoard's scalars):
written by the coordinator's loop only, the single writer, and journaled for a successor.

A multi-host job's coordinator can be lost; the lines it wrote since its last books are
kept (`take`) and sealed into the store as a `Journal`, so that a successor's files go on
whole from its own `--out` (`replay`). A line that cannot be written stops the job naming the
file (`RunFilesError`), rather than a run that says it completed with a hole in its record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from spotpipe.protocol import Journal


class RunFilesError(RuntimeError):
    """The launcher cannot write its own files: the job stops, naming the file."""


@dataclass
class RunFiles:
    """The run's output files, written by the launcher only."""

    out: Path
    append: bool = False  # a restart's round goes on with the files of the rounds before
    metrics: TextIO = field(init=False)
    events: TextIO = field(init=False)
    tensorboard: Any = None
    # keep the lines written since the last `take`, for a successor (the journal)
    journaled: bool = False
    _new: tuple[list[dict[str, Any]], list[dict[str, Any]]] = field(
        init=False, default_factory=lambda: ([], []))

    def __post_init__(self) -> None:
        mode = "a" if self.append else "w"
        self.metrics = open(self.out / "metrics.jsonl", mode)
        self.events = open(self.out / "events.jsonl", mode)

    def _append(self, stream: TextIO, name: str, record: dict[str, Any]) -> None:
        try:
            stream.write(json.dumps(record) + "\n")
            stream.flush()
        except OSError as exc:
            raise RunFilesError(f"cannot write {self.out / name}: {exc.strerror or exc}") \
                from None

    def event(self, record: dict[str, Any]) -> None:
        self._append(self.events, "events.jsonl", record)
        if self.journaled:
            self._new[1].append(record)

    def metric(self, record: dict[str, Any]) -> None:
        self._append(self.metrics, "metrics.jsonl", record)
        if self.journaled:
            self._new[0].append(record)
        if self.tensorboard is not None:
            step = record["iter"]
            for key in ("loss", "samples_per_s", "lr", "grad_norm", "live_nodes"):
                # (a null figure, one not known or not finite, has no point: TensorBoard
                # takes no null, and raised)
                if record.get(key) is not None:
                    self.tensorboard.add_scalar(key, record[key], step)

    def take(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The lines written since the last call (metrics, events)."""
        new, self._new = self._new, ([], [])
        return new

    def replay(self, journal: Journal) -> None:
        """A predecessor's lines, written again here (not journaled twice)."""
        for record in journal.metrics:
            self._append(self.metrics, "metrics.jsonl", record)
        for record in journal.events:
            self._append(self.events, "events.jsonl", record)

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
