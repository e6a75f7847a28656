"""A stage's state as one thing to copy, send, write and check: the baselines' common format.

- `take`: a copy of the stage's tensors (parameters, buffers, optimizer state under the
  unpartitioned model's names, as `durable.stage_tensors` names them) in CPU memory, so that the
  optimizer may go on while the copy is written or sent.
- `flatten` / `unflatten`: one byte buffer and a JSON layout (names, dtypes, shapes), for a copy
  sent to a peer over torch.distributed (tensors travel as tensors, metadata as JSON).
- `write_file` / `read_file`: one torch.save file per stage and iteration, written to a
  temporary name, fsynced and renamed, then a JSON sidecar with its SHA-256 (written the same
  way) that commits it; a failed write leaves neither and is a `durable.WriteError`. Loading
  checks the sidecar first and reads with `torch.load(weights_only=True)`, which unpickles
  nothing but tensors and plain containers; a file of another model or format is refused.
- `fingerprint`: the SHA-256 digests `spotpipe.runtime.digest.stage_digest` computes for a live
  stage, computed from a copy, so tests can check a copy against the owner bit for bit.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from spotpipe.checkpoint import durable
from spotpipe.checkpoint.durable import CheckpointError
from spotpipe.checkpoint.fsync import fsync_path, sha256_file
from spotpipe.runtime.digest import tensors_digest

FORMAT_VERSION = 1
SUFFIX = ".pt"
SIDECAR = ".json"


@dataclass
class Snapshot:
    """A stage's state at the end of `iteration`, in memory the training loop no longer
    touches."""

    stage: int
    iteration: int
    tensors: dict[str, torch.Tensor]
    params: list[str]  # parameter names in module order (what the digests cover)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def take(stage: int, iteration: int, module: nn.Module, optimizer: torch.optim.Optimizer,
         copy: bool = True) -> Snapshot:
    """The stage's state in CPU memory: a copy (even when it already lives there) unless
    `copy` is false, for a caller that is done with it before the next optimizer step."""
    tensors = {k: v.detach().to("cpu", copy=copy) for k, v in
               durable.stage_tensors(module, optimizer).items()}
    return Snapshot(stage, iteration, tensors, [n for n, _ in module.named_parameters()])


def fingerprint(tensors: dict[str, torch.Tensor], params: list[str]) -> dict[str, str]:
    """The digests `stage_digest(module, optimizer)` gives for the stage these tensors came
    from: parameters in module order, then each parameter's optimizer state by sorted key."""
    optim = []
    for name in params:
        prefix = f"optim/{name}/"
        optim += [tensors[k] for k in sorted(k for k in tensors if k.startswith(prefix))]
    return {"params": tensors_digest(tensors[n] for n in params),
            "optim": tensors_digest(optim)}


# ---------------------------------------------------------------------- flat, for peers

def layout_of(tensors: dict[str, torch.Tensor], params: list[str]) -> dict[str, Any]:
    return {"params": params,
            "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                        for k, v in tensors.items()]}


def flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A copy of all tensors' bytes, concatenated in `layout_of` order, as one uint8 tensor on
    the tensors' device (all must share one)."""
    parts = [v.detach().contiguous().reshape(-1).view(torch.uint8) for v in tensors.values()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unflatten(flat: torch.Tensor, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = flat.to("cpu")
    sizes = []
    for name, dtype, shape in layout["tensors"]:
        dt = getattr(torch, dtype)
        sizes.append((name, dt, shape, math.prod(shape) * torch.empty((), dtype=dt).element_size()))
    expected = sum(size for *_, size in sizes)
    if expected != flat.numel():
        raise CheckpointError(f"a peer's copy has {flat.numel()} bytes, its layout {expected}")
    out, offset = {}, 0
    for name, dt, shape, size in sizes:
        out[name] = flat[offset: offset + size].view(dt).reshape(shape).clone()
        offset += size
    return out


# ---------------------------------------------------------------------- files

def file_path(folder: Path, stage: int, iteration: int) -> Path:
    return folder / f"stage{stage}" / f"iter_{iteration:08d}{SUFFIX}"


def write_file(folder: Path, snapshot: Snapshot, model_digest: str, keep: int, *,
               sidecar: bool = True) -> int:
    """Write, fsync, rename, then commit with the sidecar; keep the newest `keep`; return bytes.
    Without `sidecar`, the file alone, as a plain torch.save user writes it (nothing hashed,
    nothing fsynced): bench checkpoint's baselines, which no resume reads (`read_file` needs
    the sidecar).

    A write that fails (a full disk: torch's own file writer says so only as a RuntimeError
    about stream positions, so the file is written through a Python file, whose error is the
    OS's) is a `durable.WriteError` naming the file, which the schemes report as
    checkpoint_failed; neither the file nor its temporary is left, so nothing half-written
    takes the space or later reads as a checkpoint."""
    path = file_path(folder, snapshot.stage, snapshot.iteration)
    side = path.with_suffix(SIDECAR)
    replaced = False  # (until then, a file of this iteration there is whole, and stays)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace_durably(path, lambda f: torch.save(
            {"format_version": FORMAT_VERSION, "iteration": snapshot.iteration,
             "stage": snapshot.stage, "model_digest": model_digest,
             "params": snapshot.params, "tensors": snapshot.tensors}, f), sync=sidecar)
        replaced = True
        if sidecar:
            digest = sha256_file(path)
            text = json.dumps({"format_version": FORMAT_VERSION, "sha256": digest,
                               "iteration": snapshot.iteration, "stage": snapshot.stage})
            _replace_durably(side, lambda f: f.write(text.encode()))
            fsync_path(path.parent)  # (the renames are durable once their folder is)
    except (OSError, RuntimeError) as exc:
        if replaced:  # a file without its sidecar (or with an older one) commits nothing
            side.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        cause = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise durable.WriteError(f"{path}: {type(exc).__name__}: {cause}") from exc
    nbytes = path.stat().st_size
    _keep_newest(path.parent, keep, SIDECAR if sidecar else SUFFIX, snapshot.iteration)
    return nbytes


def _keep_newest(folder: Path, keep: int, by: str, upto: int) -> None:
    """Remove all but the newest `keep` files of a stage up to iteration `upto` (the one just
    written), each with its sidecar; `by`: the suffix that marks a file as written (the
    sidecar, or the file where there is none). Files of later iterations are another
    timeline's (a run gone back to an older checkpoint in this folder): they neither count nor
    go, as in `durable.retain`; counting them deleted the file just written. Ordered by the
    iteration, not the name (which grows a digit at 10^8)."""
    files = sorted((f for f in folder.glob(f"iter_*{by}") if 0 <= _iteration_of(f) <= upto),
                   key=_iteration_of)
    for old in files[:-keep]:
        old.with_suffix(SUFFIX).unlink(missing_ok=True)
        old.with_suffix(SIDECAR).unlink(missing_ok=True)


def _iteration_of(path: Path) -> int:
    """The iteration in a file's name, `iter_N.pt` or its sidecar; -1 for a name not ours."""
    digits = path.name[len("iter_"):].split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


def _replace_durably(path: Path, write: Callable[[BinaryIO], Any], sync: bool = True) -> None:
    """`write` into a temporary file beside `path`, flushed to the disk (unless not `sync`),
    then renamed to `path` (the temporary removed if anything fails), so `path` is whole or
    absent."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_file(path: Path, model_digest: str | None = None) -> Snapshot:
    """Load one committed file; CheckpointError names the file and what is wrong."""
    meta = durable.read_manifest(path.with_suffix(SIDECAR), FORMAT_VERSION)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    if sha256_file(path) != meta.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.load refuses, name the file
        raise CheckpointError(f"{path}: cannot be read safely ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]})") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a spotpipe stage snapshot of format "
                              f"{FORMAT_VERSION}")
    if model_digest is not None and data.get("model_digest") != model_digest:
        raise CheckpointError(f"{path}: a snapshot of another model or optimizer "
                              f"(model digest {data.get('model_digest')}, expected "
                              f"{model_digest})")
    return Snapshot(int(data["stage"]), int(data["iteration"]), dict(data["tensors"]),
                    list(data["params"]))


def newest_file(folder: Path, stage: int, model_digest: str | None = None,
                problems: list[str] | None = None) -> Snapshot | None:
    """The newest snapshot of `stage` that verifies; the ones skipped are named in
    `problems`."""
    for path in sorted((folder / f"stage{stage}").glob(f"iter_*{SUFFIX}"), key=_iteration_of,
                       reverse=True):
        try:
            return read_file(path, model_digest)
        except CheckpointError as exc:
            if problems is not None:
                problems.append(str(exc))
    return None


def load_into(snapshot: Snapshot, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Copy a snapshot into a live stage (every tensor it names must be there)."""
    wanted = durable.stage_tensors(module,
                                   durable.materialise_optimizer_state(module, optimizer))
    missing = sorted(set(wanted) - set(snapshot.tensors))
    if missing:
        raise CheckpointError(f"snapshot of stage {snapshot.stage} lacks {missing[:3]}")
    with torch.no_grad():
        for k, v in wanted.items():
            v.copy_(snapshot.tensors[k])
