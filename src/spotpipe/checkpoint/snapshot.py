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
from spotpipe.checkpoint.dtypes import dtypes_by_name
from spotpipe.checkpoint.durable import CheckpointError
from spotpipe.checkpoint.fsync import fsync_path, sha256_file
from spotpipe.protocol.bounds import Unreadable, load_record
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

# The dtypes a peer's copy carries, by the names `layout_of` writes: a layout read from the store
# names one of these or is refused
DTYPES = dtypes_by_name(torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                        torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                        torch.complex64, torch.complex128)


def layout_of(tensors: dict[str, torch.Tensor], params: list[str]) -> dict[str, Any]:
    for k, v in tensors.items():
        if str(v.dtype).removeprefix("torch.") not in DTYPES:
            raise CheckpointError(f"{k}: a {v.dtype} tensor, which a peer's copy does not carry")
    return {"params": params,
            "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                        for k, v in tensors.items()]}


def flatten(tensors: dict[str, torch.Tensor], device: torch.device | None = None
            ) -> torch.Tensor:
    """A copy of all tensors' bytes, concatenated in `layout_of` order, as one uint8 tensor on
    `device` (by default the first tensor's). A stage's tensors need not share one: AdamW
    keeps its step counts on the CPU beside parameters on the GPU unless it is fused."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8, device=device)
    device = device or next(iter(tensors.values())).device
    return torch.cat([v.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
                      for v in tensors.values()])


def read_layout(text: bytes | str, size: int, where: str) -> dict[str, Any]:
    """A copy's layout as read from the store (`where`: its key and writer, for the error),
    checked to be one `layout_of` wrote for a buffer of `size` bytes: CheckpointError naming
    `where` for anything else (not JSON, over the record cap, a field of the wrong type, a
    dtype not in DTYPES, names twice, sizes that do not sum to `size`)."""
    try:
        layout = load_record(text)
    except Unreadable as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    problem = _layout_problem(layout, size)
    if problem:
        raise CheckpointError(f"{where}: not a copy's layout: {problem}")
    return layout


def _layout_problem(layout: Any, size: int) -> str:
    """What makes `layout` other than a layout of `size` bytes ("" if nothing)."""
    if not isinstance(layout, dict) or set(layout) != {"params", "tensors"}:
        return "expected an object of params and tensors"
    params, tensors = layout["params"], layout["tensors"]
    if not isinstance(params, list) or not all(isinstance(n, str) for n in params):
        return "params: expected a list of names"
    if not isinstance(tensors, list) or not all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) for t in tensors):
        return "tensors: expected a list of [name, dtype, shape]"
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names) or not set(params) <= set(names):
        return "tensors: a name twice, or a parameter without its tensor"
    for name, dtype, shape in tensors:
        if dtype not in DTYPES:
            return f"{name[:100]}: {str(dtype)[:40]!r} is not a dtype a copy carries"
        if not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape):  # (not a bool, a float, a NaN)
            return f"{name[:100]}: expected a shape of non-negative integers"
    total = sum(nbytes for *_, nbytes in extents(layout))
    if total != size:
        return f"its tensors take {total} bytes, the copy has {size}"
    return ""


def extents(layout: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int], int]]:
    """(name, dtype, shape, bytes) of each tensor, in buffer order."""
    out = []
    for name, dtype, shape in layout["tensors"]:
        dt = DTYPES[dtype]
        out.append((name, dt, shape, math.prod(shape) * dt.itemsize))
    return out


def unflatten(flat: torch.Tensor, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = flat.to("cpu")
    sizes = extents(layout)
    expected = sum(size for *_, size in sizes)
    if expected != flat.numel():
        raise CheckpointError(f"a peer's copy has {flat.numel()} bytes, its layout {expected}")
    out, offset = {}, 0
    for name, dt, shape, size in sizes:
        # (cloned before the view: a tensor's bytes may start at an offset that is no multiple
        # of its element size, a BatchNorm's int64 count after float32s of odd length)
        out[name] = flat[offset: offset + size].clone().view(dt).reshape(shape)
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
