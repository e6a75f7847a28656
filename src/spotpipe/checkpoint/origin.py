"""Where a checkpoint came from: an HMAC of its manifest under a key the user controls.

The manifest lists a SHA-256 of every file of the checkpoint (and a reader refuses files it
does not list), so a MAC over the manifest vouches for the whole folder: a checkpoint that
verifies was committed by a job that held the key. The key, in order of preference:

1. `checkpoint.key`: a file holding the secret (a path, so that the secret itself is not in
   the configuration that every run folder keeps a copy of);
2. the job's token (SPOTPIPE_JOIN_TOKEN), which every host of a multi-host job shares, through
   a keyed derivation (the token itself is never the MAC key);
3. a per-user key, `$SPOTPIPE_KEY_FILE` or `~/.config/spotpipe/checkpoint.key`, made (mode
   0600) the first time it is needed, so that local runs resume each other's checkpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

MAC_FIELD = "mac"
_DERIVE = b"spotpipe checkpoint manifest v1"


class KeyFileError(ValueError):
    """A configured key that cannot be read; the message names the file."""


def user_key_file() -> Path:
    return Path(os.environ.get("SPOTPIPE_KEY_FILE")
                or Path.home() / ".config" / "spotpipe" / "checkpoint.key")


def _read_key(path: Path, what: str) -> bytes:
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise KeyFileError(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    if len(secret) < 16:
        raise KeyFileError(f"{what} {path}: expected a secret of at least 16 bytes")
    return secret


def resolve_key(key_path: str = "", token: str | None = None) -> bytes:
    """The MAC key for this job (see the module docstring for the order)."""
    if key_path:
        return _read_key(Path(key_path), "checkpoint.key:")
    token = token if token is not None else os.environ.get("SPOTPIPE_JOIN_TOKEN", "")
    if token:
        return hmac.new(token.encode(), _DERIVE, hashlib.sha256).digest()
    path = user_key_file()
    if not path.exists():
        _make_key_file(path)
    return _read_key(path, "key file")


def _make_key_file(path: Path) -> None:
    """Write a new secret to `path` so that it appears whole or not at all: written to a
    file of this process's own, then linked into place, the first job's link winning. (It
    was created empty and then written: a job started beside the first read it in between
    and stopped, "expected a secret of at least 16 bytes"; seen in the test suite, whose
    workers share one key file.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(mine, path)
        except FileExistsError:  # another job made it first: its key is the key
            pass
    finally:
        mine.unlink(missing_ok=True)


def _digest(manifest: dict[str, Any], key: bytes) -> bytes:
    body = {k: v for k, v in manifest.items() if k != MAC_FIELD}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, blob, hashlib.sha256).digest()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The manifest with its MAC."""
    return {**manifest, MAC_FIELD: _digest(manifest, key).hex()}


def problem(manifest: dict[str, Any], key: bytes) -> str:
    """Why the manifest's MAC does not vouch for it under `key` ("" when it does)."""
    mac = manifest.get(MAC_FIELD)
    if not isinstance(mac, str) or not mac:
        return "it carries no MAC (not written by spotpipe with a key)"
    try:
        given = bytes.fromhex(mac)
    except ValueError:
        return "its MAC is not hexadecimal"
    if not hmac.compare_digest(given, _digest(manifest, key)):
        return ("its MAC does not match this job's key (written under another key, or "
                "changed since)")
    return ""
