"""Stage files of a durable checkpoint carried to the committing host through the job's store.

Under `spotpipe agent`, the coordinating agent commits every checkpoint in its own
`checkpoint.dir`. When another host does not see that folder (the probe each agent makes at
start says so), its workers write their stage as usual, then put each file into the store in
pieces (etcd refuses requests over 1.5 MiB) before they report the stage; the coordinator takes
the pieces, checks each file's SHA-256 against the checksums the worker reported, writes and
fsyncs them into the uncommitted folder, and only then counts the stage. A file that is missing
or damaged fails the whole checkpoint: nothing of that iteration is committed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from spotpipe.checkpoint.fsync import fsync_path
from spotpipe.protocol.auth import Refused

CHUNK = 512 * 1024


def _key(iteration: int, stage: int, part: str) -> str:
    return f"spotpipe/checkpoint/files/{iteration}/{stage}/{part}"


def send_stage(store: Any, iteration: int, stage: int, folder: Path,
               checksums: dict[str, str]) -> int:
    """Put the files of one written stage (`checksums`' names, relative to the iteration's
    folder `folder`) into the store (sealed: `store/sealed.py`); return the bytes sent."""
    files, sent = [], 0
    for index, name in enumerate(sorted(checksums)):
        data = (folder / name).read_bytes()
        parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for i, part in enumerate(parts):
            store.set(_key(iteration, stage, f"{index}.{i}"), part)
        files.append([name, len(parts)])
        sent += len(data)
    store.set(_key(iteration, stage, "meta"), json.dumps({"files": files}))
    return sent


def receive_stage(store: Any, iteration: int, stage: int, checksums: dict[str, str],
                  folder: Path) -> str:
    """Write the stage's files from the store into `folder` (the iteration's uncommitted
    folder), each checked against `checksums`; "" when whole, else what is wrong. The pieces
    are removed from the store either way. `store` is sealed (`store/sealed.py`): a record
    written without the job's key is what is wrong, never a crash."""
    meta_key = _key(iteration, stage, "meta")
    if not store.check([meta_key]):
        _remove_parts(store, iteration, stage, len(checksums))
        return f"the files of stage {stage} never arrived through the store"
    try:
        files = json.loads(store.get(meta_key))["files"]
    except Refused as why:
        _remove_parts(store, iteration, stage, len(checksums))
        store.delete_key(meta_key)
        return f"the files of stage {stage}: {why}"
    problem = ""
    if sorted(name for name, _ in files) != sorted(checksums):
        problem = f"stage {stage} sent other files than it reported"
    elif any(Path(name).is_absolute() or ".." in Path(name).parts for name, _ in files):
        problem = f"stage {stage} sent a file outside its folder"
    for index, (name, parts) in enumerate(files):
        keys = [_key(iteration, stage, f"{index}.{i}") for i in range(parts)]
        if not problem:
            try:
                data = b"".join(store.get(k) for k in keys)
            except Refused as why:
                problem = str(why)
            else:
                if hashlib.sha256(data).hexdigest() != checksums.get(name):
                    problem = f"{name} arrived damaged (checksum differs)"
                else:
                    _write(folder / name, data)
        for k in keys:
            store.delete_key(k)
    store.delete_key(meta_key)
    return problem


def _remove_parts(store: Any, iteration: int, stage: int, files: int) -> None:
    """Remove the pieces of a stage whose file list is missing or did not verify: the worker
    put `files` files (as many as it reported checksums for), each in consecutive pieces from
    0, so each file's pieces are those present from 0 on. Without this, a forged or deleted
    list would leave the genuine pieces (up to a stage's size) in the store for the rest of
    the job."""
    for index in range(files):
        i = 0
        while store.check([key := _key(iteration, stage, f"{index}.{i}")]):
            store.delete_key(key)
            i += 1


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path.parent)


# ---------------------------------------------------------------------- is the folder shared?

def probe_name(job: str) -> str:
    return f".spotpipe-probe-{job}"


def check_writable(root: Path) -> None:
    """Write, read back and remove a file in `root` (OSError when it cannot be done)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".spotpipe-probe-{os.getpid()}"
    nonce = os.urandom(16).hex()
    path.write_text(nonce)
    try:
        if path.read_text() != nonce:
            raise OSError(f"{path}: reads back other bytes than were written")
    finally:
        path.unlink(missing_ok=True)


def sees_probe(root: Path, job: str, nonce: str) -> bool:
    """Whether `root` holds the probe the committing host wrote (the same folder, shared)."""
    try:
        return (root / probe_name(job)).read_text() == nonce
    except OSError:
        return False
