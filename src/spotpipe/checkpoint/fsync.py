"""Flushing a path to the disk, without importing torch.distributed.checkpoint (whose import,
DTensor and all, costs a worker about a second at start, and is only needed once a DCP
checkpoint is written or read)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to the disk (a rename is durable only once its
    directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
