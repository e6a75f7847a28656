"""Flushing a path to the disk and hashing a file, without importing
torch.distributed.checkpoint (whose import, DTensor and all, costs a worker about a second at
start, and is only needed once a DCP checkpoint is written or read)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The file's SHA-256, read in pieces: a stage file of a large model is gigabytes, which
    `read_bytes()` would hold in memory at once (in the launcher, for every file it checks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to the disk (a rename is durable only once its
    directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
