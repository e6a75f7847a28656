"""Stage files of a durable checkpoint carried to the committing host through the job's store.

Under `spotpipe agent`, the coordinating agent commits every checkpoint in its own
`checkpoint.dir`. When another host does not see that folder (the probe each agent makes at
start says so), its workers write their stage as usual, then put each file into the store in
pieces (etcd refuses requests over 1.5 MiB) before they report the stage (on a thread of their
own: `schemes.Uploader`); the coordinator takes the pieces, checks each file's SHA-256 against
the checksums the worker reported, writes and fsyncs them into the uncommitted folder, and only
then counts the stage. A file that is missing or damaged fails the whole checkpoint: nothing of
that iteration is committed.

Both ends handle one piece at a time (read from disk, or written and hashed as it comes, and
taken out of the store at once), so neither holds a stage in memory: a stage is GBs for real
models. The store holds a stage's pieces from the upload until the coordinator has taken them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from spotpipe.checkpoint.fsync import fsync_path
from spotpipe.protocol.auth import Refused

CHUNK = 512 * 1024  # etcd refuses requests over 1.5 MiB; base64 makes 512 KiB about 683 KiB


def _key(iteration: int, stage: int, part: str) -> str:
    return f"spotpipe/checkpoint/files/{iteration}/{stage}/{part}"


def send_stage(store: Any, iteration: int, stage: int, folder: Path,
               checksums: dict[str, str]) -> int:
    """Put the files of one written stage (`checksums`' names, relative to the iteration's
    folder `folder`) into the store (sealed: `store/sealed.py`); return the bytes sent. Each
    file is read one piece at a time, so the sender holds a piece, not the stage."""
    files, sent, written = [], 0, []
    try:
        for index, name in enumerate(sorted(checksums)):
            parts = 0
            for part in read_pieces(folder / name):
                written.append(_key(iteration, stage, f"{index}.{parts}"))
                store.set(written[-1], part)
                parts += 1
                sent += len(part)
            files.append([name, parts])
        store.set(_key(iteration, stage, "meta"), json.dumps({"files": files}))
    except BaseException:
        # nobody will take an unreported stage's pieces: take back what went (if the store
        # still answers), instead of leaving up to a stage's bytes there for the whole job
        for key in written:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - the error that ended the upload is the one
                break
        raise
    return sent


def read_pieces(path: Path) -> Iterator[bytes]:
    """The file in pieces of at most CHUNK bytes (one empty piece for an empty file)."""
    with open(path, "rb") as f:
        part = f.read(CHUNK)
        yield part
        while part := f.read(CHUNK):
            yield part


def write_pieces(path: Path, pieces: Iterable[bytes], sha256: str) -> str:
    """Write `pieces` to `path` as they come, hashing them on the way, and fsync it; "" when
    the bytes have the SHA-256 `sha256`, else what is wrong (the file is then removed). The
    receiver holds a piece at a time, not the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in pieces:
            digest.update(part)
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    if digest.hexdigest() != sha256:
        path.unlink(missing_ok=True)
        return f"{path.name} arrived damaged (checksum differs)"
    fsync_path(path.parent)
    return ""


def receive_stage(store: Any, iteration: int, stage: int, checksums: dict[str, str],
                  folder: Path) -> str:
    """Write the stage's files from the store into `folder` (the iteration's uncommitted
    folder), each checked against `checksums`; "" when whole, else what is wrong. The pieces
    are removed from the store either way, each as soon as it is written. `store` is sealed
    (`store/sealed.py`): a record written without the job's key is what is wrong, never a
    crash."""
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
                problem = write_pieces(folder / name, _taken(store, keys), checksums[name])
            except Refused as why:
                (folder / name).unlink(missing_ok=True)
                problem = str(why)
        for k in keys:  # (those not taken: after a problem)
            store.delete_key(k)
    store.delete_key(meta_key)
    return problem


def _taken(store: Any, keys: list[str]) -> Iterator[bytes]:
    """Each key's value, removed from the store once read."""
    for k in keys:
        part = store.get(k)
        store.delete_key(k)
        yield part


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
