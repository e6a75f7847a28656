"""Wait for an event of a running job (its events.jsonl) from a test's own thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path


def when_event(run: Path, match: Callable[[dict], bool], then: Callable[[dict], None],
               stop: threading.Event, timeout_s: float = 120.0) -> threading.Thread:
    """Call `then(event)` once the run writes an event that `match`es (read as it grows;
    the file is re-read every 50 ms until then, `stop`, or the timeout)."""

    def watch() -> None:
        offset = 0
        waited = 0.0
        while not stop.is_set() and waited < timeout_s:
            path = run / "events.jsonl"
            if path.exists():
                with open(path) as f:
                    f.seek(offset)
                    for line in f:
                        if not line.endswith("\n"):
                            break  # a line still being written: read it whole next time
                        offset += len(line.encode())
                        event = json.loads(line)
                        if match(event):
                            then(event)
                            return
            stop.wait(0.05)
            waited += 0.05

    thread = threading.Thread(target=watch, name="event-tail", daemon=True)
    thread.start()
    return thread
