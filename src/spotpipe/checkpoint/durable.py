"""Durable checkpoints on disk, written with torch.distributed.checkpoint (DCP).

Layout of one checkpoint: `ROOT/iter_00000041/` holding one DCP folder per stage of the layout
that wrote it (`stage0/`, `stage1/`, ...) and `manifest.json`. Tensors are keyed by the
unpartitioned model's names (`3.attn.c_attn.weight`, and `optim/3.attn.c_attn.weight/exp_avg`),
so a checkpoint written at one P x D loads at any other: each new stage reads the keys of its
layers from whichever old stage folders hold them (DCP loads only the keys asked for).

Commit is atomic and durable: stages are written into `.iter_N.partial/` (each file and folder
fsynced by its writer), the launcher writes the manifest (a SHA-256 of every file, and an HMAC
under the job's key, `origin.py`) once every stage has reported, fsyncs it and the folder, then
renames the folder and fsyncs the root. A reader takes the newest folder whose manifest and
checksums verify, refuses any file the manifest does not list, and names the file that is
wrong. Nothing is unpickled: DCP's metadata is JSON (`dcp_json.py`), its data files are read
with `torch.load(weights_only=True)`, and the manifest is JSON. Retention counts only
checkpoints that verify, so a damaged newest one never pushes out the good one before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spotpipe.checkpoint import (latest, lock, origin,  # noqa: F401 (used through this module)
                                 transfer)
from spotpipe.checkpoint.origin import KeyFileError, resolve_key  # noqa: F401 (re-exported)
from spotpipe.checkpoint.fsync import fsync_path, sha256_file
from spotpipe.runtime.optim import materialise_optimizer_state  # noqa: F401 (re-exported)
from spotpipe.runtime.precision import SCALER_STATE


class WriteError(OSError):
    """A DCP write that could not complete (DCP wraps the OS's error in its own exception,
    which is not imported until a checkpoint is written: see `fsync.py`)."""


# what a write that cannot complete raises: the OS's errors, and DCP's, as a WriteError
WRITE_ERRORS = (OSError,)
FORMAT_VERSION = 2  # 1 kept DCP's pickled .metadata, which is not read any more
MANIFEST = "manifest.json"
_ASIDE = ".replaced"  # an older folder of the same iteration, moved aside while replaced


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def iter_dir(root: Path, iteration: int, partial: bool = False) -> Path:
    name = f"iter_{iteration:08d}"
    return root / (f".{name}.partial" if partial else name)


def _optimizer_items(module: nn.Module, optimizer: torch.optim.Optimizer, aliases: bool
                     ) -> dict[str, torch.Tensor]:
    """The optimizer's state under the global name of its parameter; with `aliases`, under
    every name of a parameter that has several (tied embeddings: `wte` and `lm_head` are one
    parameter in a stage that holds both layers, two in separate stages, updated alike), so
    that a checkpoint written with both in one stage loads at any P, where a stage may hold
    only the second name. Without, under the first only: what a stage holding both loads (a
    checkpoint written before the aliases were has only that one)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=not aliases):
        names.setdefault(id(p), []).append(name)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    for name in names[id(p)]:
                        out[f"optim/{name}/{key}"] = value
    return out


def stage_tensors(module: nn.Module, optimizer: torch.optim.Optimizer, aliases: bool = True
                  ) -> dict[str, torch.Tensor]:
    """Everything that defines a stage's training state, under global names (`aliases`: see
    `_optimizer_items`; False for what a load wants)."""
    return {**{k: v.detach() for k, v in module.state_dict().items()},
            **_optimizer_items(module, optimizer, aliases)}


def file_checksums(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = sha256_file(path)
    return out


def prepare_stage_folder(root: Path, iteration: int, stage: int) -> Path:
    """An empty folder for one stage of an uncommitted checkpoint."""
    folder = iter_dir(root, iteration, partial=True) / f"stage{stage}"
    if folder.exists():
        shutil.rmtree(folder)
    for _ in range(7):
        try:
            folder.mkdir(parents=True)
            return folder
        except FileNotFoundError:
            # a peer whose write of this iteration failed removed the partial folder while it
            # was empty, between our making it and our stage's folder in it (`discard_stage`):
            # make both again (each round, a peer can do that once: there are few peers)
            pass
    folder.mkdir(parents=True)  # a last time: its error is the write's
    return folder


def written_root(cfg: Any, out: Path) -> Path | None:
    """The folder this job's durable checkpoints go to (`checkpoint.dir`, or OUT/checkpoints),
    or None when it writes none (every: 0, or a baseline scheme, which has folders of its own)."""
    c = cfg.checkpoint
    if not c.every or (c.scheme not in ("durable", "dcp_async") and not cfg.shadow.enabled):
        return None
    return Path(c.dir or out / "checkpoints")


def discard_stage(root: Path, iteration: int, stage: int) -> None:
    """Remove what a failed (or sent away) write of one stage left: it would only take space."""
    partial = iter_dir(root, iteration, partial=True)
    shutil.rmtree(partial / f"stage{stage}", ignore_errors=True)
    try:
        partial.rmdir()  # only once no stage is left in it
    except OSError:
        pass


def stage_writer(folder: Path, sync: bool = True) -> Any:
    """DCP's storage writer for one stage folder: files fsynced, metadata as JSON (`sync`
    false only to measure what the fsyncs cost)."""
    from spotpipe.checkpoint.dcp_json import JsonMetadataWriter

    return JsonMetadataWriter(str(folder), sync_files=sync)


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the
    intent is to save in a single process" on every save and load without a default process
    group, even told `no_dist=True` (torch 2.13): each stage is its own DCP checkpoint here, so
    that is always the intent, and the line in every worker's log only misleads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def dcp_save(tensors: dict[str, torch.Tensor], folder: Path, sync: bool = True) -> None:
    """DCP's save into one stage folder, its failure a WriteError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process():
            dcp.save(tensors, storage_writer=stage_writer(folder, sync), no_dist=True)
    except CheckpointException as exc:
        raise write_error(folder, exc) from exc


def write_error(folder: Path, exc: Exception) -> WriteError:
    """DCP's failure to write `folder`, as the WriteError the schemes catch, naming what the
    write raised (DCP's own first line names only the ranks that failed, not a full disk)."""
    cause = dcp_cause(exc)
    return WriteError(f"{folder}: {cause.splitlines()[0][:300] if cause else type(exc).__name__}")


def stage_checksums(folder: Path, stage: int, sync: bool = True) -> dict[str, str]:
    """A written stage folder's checksums under the names the manifest uses; the folder and
    its parent are fsynced first, so that what is hashed is on the disk."""
    if sync:
        fsync_path(folder)
        fsync_path(folder.parent)
    return {f"stage{stage}/{k}": v for k, v in file_checksums(folder).items()}


def save_stage(root: Path, iteration: int, stage: int, module: nn.Module,
               optimizer: torch.optim.Optimizer, sync: bool = True) -> dict[str, str]:
    """Write one stage of iteration `iteration`; return its files' checksums."""
    folder = prepare_stage_folder(root, iteration, stage)
    tensors = {k: v.to("cpu") for k, v in stage_tensors(module, optimizer).items()}
    dcp_save(tensors, folder, sync)
    return stage_checksums(folder, stage, sync)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def commit(root: Path, iteration: int, info: dict[str, Any], checksums: dict[str, str],
           keep: int, key: bytes, apply_retention: bool = True) -> Path:
    """Write the signed manifest and make the checkpoint visible, durably; keep the newest
    `keep` that verify (unless not `apply_retention`: a later commit applies it, which
    hashes every kept checkpoint again). A folder of the same iteration already there (a
    job resumed from an older checkpoint into the same folder) is replaced. A stage file the checksums list but
    the folder lacks (its host sent it to a coordinator deposed since, whose successor does not
    see that coordinator's folder) fails the commit: FileNotFoundError, naming it. A name that
    is not a file of the checkpoint folder (absolute, `..`, a symlink out, the manifest) is a
    ValueError naming it, before anything is written; with `apply_retention`, a file that
    differs from its checksum is a CheckpointError naming it, before the rename."""
    partial = iter_dir(root, iteration, partial=True)
    _refuse_outside(partial, iteration, checksums)
    missing = sorted(rel for rel in checksums if not (partial / rel).is_file())
    if missing:
        raise FileNotFoundError(f"checkpoint {iteration}: {len(missing)} stage file(s) listed "
                                f"but not in {partial}, e.g. {missing[0]}")
    manifest = origin.sign({"format_version": FORMAT_VERSION, "iteration": iteration,
                            "next_iteration": iteration + 1, **info, "checksums": checksums},
                           key)
    _write_durably(partial / MANIFEST, json.dumps(manifest, indent=1))
    if apply_retention:
        _check_before_rename(partial, iteration)
    final = iter_dir(root, iteration)
    aside = root / f".{final.name}{_ASIDE}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(partial, final)
    fsync_path(root)
    latest.advance(root, iteration)
    shutil.rmtree(aside, ignore_errors=True)
    if apply_retention:
        retain(root, keep, key, upto=iteration, checked=final)
    for stale in root.glob(".iter_*.partial"):  # writes of earlier iterations that failed
        if _iteration_of(stale) < iteration:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _check_before_rename(partial: Path, iteration: int) -> None:
    """Hash the files against the manifest just written (`verify`) before the checkpoint is
    made visible: the checksums are the writers' reports, and a file that differs on disk
    would be a checkpoint said committed that never verifies. Done where retention applies,
    which hashed the new checkpoint just after the rename anyway (it is told it is checked);
    a commit that leaves retention to a newer one stays a rename (that one's retention
    hashes it). A failure removes the manifest and names the file (CheckpointError)."""
    try:
        verify(partial)
    except CheckpointError as exc:
        (partial / MANIFEST).unlink(missing_ok=True)
        raise CheckpointError(f"checkpoint {iteration} not committed: {exc}") from None


def _refuse_outside(partial: Path, iteration: int, checksums: dict[str, str]) -> None:
    """ValueError naming the first entry of `checksums` that is not a file of the checkpoint
    folder `partial`: not a plain relative path (absolute, empty parts, `.` or `..`), the
    manifest's own place, or one whose path leads out through a symlink. The coordinator
    checks each stage's names as they are reported, but `commit` is public and the manifest
    it signs would vouch for whatever file such a name reaches (what `verify` refuses, once
    the checkpoint is on disk and counted)."""
    inside = partial.resolve()
    for name in sorted(checksums):
        if transfer.outside(name) or name == MANIFEST \
                or not (partial / name).resolve().is_relative_to(inside):
            raise ValueError(f"checkpoint {iteration}: the checksums list {name[:200]!r}, "
                             f"not a file of the checkpoint folder {partial} (nothing was "
                             "committed)")


def _iteration_of(folder: Path) -> int:
    """The iteration a checkpoint's name carries (-1: none). Names are ordered by it, not as
    text: `iter_{:08d}` grows a ninth digit at iteration 10^8, and `iter_100000000` sorts
    before `iter_99999999` as text, which made the newest checkpoint the oldest."""
    digits = "".join(c for c in folder.name if c.isdigit())
    return int(digits) if digits else -1


def retain(root: Path, keep: int, key: bytes | None, upto: int | None = None,
           checked: Path | None = None) -> list[Path]:
    """Delete what is older than the newest `keep` checkpoints that verify (checksums, and the
    MAC under `key`); folders that do not verify count for nothing. Returns what was deleted.

    `upto`: the iteration just committed. Folders of later iterations are not this job's
    timeline (another run's, left in the folder, or the one a job resumed from an older
    checkpoint is rewriting): they neither count nor go, so the checkpoint just committed and
    this job's good ones before it are never deleted for them. `checked`: a checkpoint
    verified just now under `key` (the one just committed), counted without hashing it
    again."""
    good = 0
    deleted = []
    for path in sorted((p for p in root.glob("iter_*") if p.is_dir()), key=_iteration_of,
                       reverse=True):
        if upto is not None and _iteration_of(path) > upto:
            continue
        if good >= keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
            continue
        if path == checked:
            good += 1
            continue
        try:
            ckpt = verify(path)
        except CheckpointError:
            continue
        if key is None or not ckpt.origin_problem(key):
            good += 1
    return deleted


def restore_replaced(root: Path) -> list[Path]:
    """Put back each checkpoint that a commit had moved aside to replace it (`commit`) and
    that the job stopped before replacing: the folders restored.

    A commit onto an existing iteration renames the old folder aside, then the new one into
    place; a job that stops between the two leaves neither under the iteration's name. The old
    one is put back, not the new one rolled forward: a commit is made by the rename into place
    (a job that stops before it leaves a partial folder, removed at the next start, whatever
    it holds), and nothing was told of the new one (no checkpoint_committed event), so this
    makes the two renames one step, done or not done. Only an aside folder that verifies is
    put back (a damaged one is removed with the partials)."""
    restored = []
    for aside in sorted(root.glob(f".iter_*{_ASIDE}")):
        final = root / aside.name[1:-len(_ASIDE)]
        if not aside.is_dir() or final.exists():
            continue  # the commit was done: only removing the aside folder was left
        try:
            verify(aside)
        except CheckpointError:
            continue
        os.replace(aside, final)
        restored.append(final)
    if restored:
        fsync_path(root)
    return restored


def clean_partials(root: Path) -> list[Path]:
    """Remove folders of checkpoints that were never committed (a job that stopped while
    writing), once a replaced checkpoint the stop left aside is put back (`restore_replaced`):
    called at start, by the job that holds the folder's lock."""
    restore_replaced(root)
    found = [p for p in root.glob(".iter_*") if p.is_dir()
             and (p.name.endswith(".partial") or p.name.endswith(_ASIDE))]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def next_iteration(self) -> int:
        return int(self.manifest["next_iteration"])

    @property
    def iteration(self) -> int:
        """The iteration whose state it holds (the last one done)."""
        return self.next_iteration - 1

    @property
    def partition(self) -> list[tuple[int, int]]:
        return [tuple(r) for r in self.manifest["partition"]]

    def origin_problem(self, key: bytes) -> str:
        """Why the manifest's MAC does not vouch for this checkpoint ("" when it does)."""
        return origin.problem(self.manifest, key)

    @property
    def digest(self) -> str:
        """What makes two copies the same checkpoint: its manifest (which lists every file's
        checksum), wherever the copy lies. Agents on separate hosts compare it."""
        text = json.dumps(self.manifest, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(manifest_path: Path, version: int = FORMAT_VERSION) -> dict[str, Any]:
    """A JSON manifest that commits a checkpoint, checked for presence and format version."""
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing (the checkpoint was not committed)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: not a JSON object (a {type(manifest).__name__})")
    if manifest.get("format_version") != version:
        raise CheckpointError(f"{manifest_path}: format version {manifest.get('format_version')}"
                              f" is not supported (this spotpipe reads {version})")
    return manifest


def verify(path: Path, layers: Collection[int] | None = None) -> Checkpoint:
    """Read and check one checkpoint folder; raise CheckpointError naming what is wrong.

    `layers`: only the stage folders that hold some of these layers must be there (a host's
    copy of a checkpoint may hold only the folders its workers load, `cluster.resume_copy`);
    a file of another folder is checked where it is there. Every file there must be listed."""
    manifest = read_manifest(path / MANIFEST)
    checksums = _checksums(path / MANIFEST, manifest)
    next_iteration = manifest.get("next_iteration")
    if not isinstance(next_iteration, int) or isinstance(next_iteration, bool):
        raise CheckpointError(f"{path / MANIFEST}: next_iteration is {next_iteration!r}, not "
                              "an iteration number")
    # where the data resumes (the sampler is a function of the iteration): a checkpoint holds
    # the state after iteration `iteration` >= 0, and is resumed at the one after it. One
    # that said otherwise (with --trust-checkpoint: a MAC is not asked for) would consume
    # samples twice, or fail at the first batch
    if next_iteration < 1 or manifest.get("iteration") != next_iteration - 1:
        raise CheckpointError(f"{path / MANIFEST}: next_iteration {next_iteration} does not "
                              f"follow iteration {manifest.get('iteration')!r} (a checkpoint "
                              "holds the state after an iteration >= 0)")
    needed = None if layers is None else folders_holding(_partition(path, manifest), layers)
    for name, digest in checksums.items():
        file = path / name
        if "\0" in name or not file.resolve().is_relative_to(path.resolve()) \
                or name == MANIFEST:
            raise CheckpointError(f"{path / MANIFEST}: lists {name!r}, not a file of the "
                                  "checkpoint")
        if not file.is_file() and needed is not None and folder_of(name) not in needed:
            continue  # a folder this copy need not hold
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch (corrupted or truncated)")
    for file in sorted(path.rglob("*")):
        name = str(file.relative_to(path))
        if (file.is_file() or file.is_symlink()) and name != MANIFEST and name not in checksums:
            raise CheckpointError(f"{file}: not listed in the manifest (not written by the job "
                                  "that committed this checkpoint)")
    return Checkpoint(path, manifest)


def _checksums(manifest_path: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """The manifest's file -> SHA-256 table, checked for shape: a manifest is read before its
    MAC is (a checkpoint of another key is named, not trusted), so anything may be in it, and
    what is wrong must be a CheckpointError naming it, never a TypeError later on."""
    checksums = manifest.get("checksums")
    if not isinstance(checksums, dict) or not checksums:
        raise CheckpointError(f"{manifest_path}: lists no files")
    for name, digest in checksums.items():
        if not isinstance(digest, str):
            raise CheckpointError(f"{manifest_path}: the checksum of {name!r} is {digest!r}, "
                                  "not a string")
    return checksums


def newest(root: Path, problems: list[str] | None = None) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies, on the timeline of the job that last
    held the folder (its `latest` pointer, `latest.py`; by the folders' names where there is
    none); skipped ones are named in `problems`. CheckpointError for a pointer that is not
    one spotpipe wrote."""
    try:
        pointer = latest.read(root)
    except latest.PointerError as exc:
        raise CheckpointError(str(exc)) from None
    if pointer is not None and pointer.iteration is None:
        if problems is not None:
            problems.append(f"{root / latest.NAME}: the job that last started in this folder "
                            "has committed no checkpoint yet (the older ones there are another "
                            "run's: name one, iter_N, to resume from it)")
        return None
    return next(verified(root, problems, upto=pointer and pointer.iteration), None)


def verified(root: Path, problems: list[str] | None = None, upto: int | None = None
             ) -> Iterator[Checkpoint]:
    """The checkpoints under `root` that verify, newest first, none past iteration `upto`;
    skipped ones are named in `problems`. A checkpoint that a stopped commit left moved aside
    (`restore_replaced`, which puts it back once a job holds the folder) is one of them."""
    for path in _folders(root):
        if upto is not None and _iteration_of(path) > upto:
            continue
        try:
            yield verify(path)
        except CheckpointError as exc:
            if problems is not None:
                problems.append(str(exc))


def _folders(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, newest first: `iter_N`, or where a commit replacing
    it stopped between its two renames, `.iter_N.replaced`."""
    found = {p.name: p for p in root.glob("iter_*") if p.is_dir()}
    for aside in root.glob(f".iter_*{_ASIDE}"):
        found.setdefault(aside.name[1:-len(_ASIDE)], aside)
    return [found[name] for name in sorted(found, key=lambda n: _iteration_of(Path(n)),
                                           reverse=True) if found[name].is_dir()]


def settled(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` where it lies once the job holds its folder: a checkpoint found moved aside is
    put back under its name by `clean_partials`."""
    if ckpt.path.exists() or not ckpt.path.name.endswith(_ASIDE):
        return ckpt
    return Checkpoint(ckpt.path.with_name(ckpt.path.name[1:-len(_ASIDE)]), ckpt.manifest)


def take_up(root: Path, start: Checkpoint | None) -> tuple[list[Path], Checkpoint | None]:
    """The job now holds `root` (its lock) and goes on from `start`: remove what jobs stopped
    mid-write left (`clean_partials`, which puts back a checkpoint a stopped commit moved
    aside), find `start` where it now lies (`settled`) and point the folder's timeline at it
    (`begin_timeline`). Returns the folders removed and `start`."""
    removed = clean_partials(root)
    start = settled(start) if start is not None else None
    begin_timeline(root, start)
    return removed, start


def begin_timeline(root: Path, start: Checkpoint | None) -> None:
    """The job that now holds `root` goes on from `start` (None: from iteration 0): point the
    folder there (`latest.py`), so that a `--resume` of it before this job's first commit takes
    what this job started from, not a later checkpoint of the timeline it left."""
    here = start is not None and start.path.parent.resolve() == root.resolve()
    latest.write(root, start.iteration if here and start is not None else None)


def resolve(path: Path, layers: Collection[int] | None = None) -> tuple[Checkpoint, list[str]]:
    """A checkpoint folder, a checkpoints root, or a run folder -> the checkpoint to load
    (`layers`: see `verify`)."""
    problems: list[str] = []
    baseline = _baseline_snapshots(path)
    if path.is_file() and baseline:
        raise CheckpointError(f"{path}: {baseline}")
    if (path / MANIFEST).exists() or path.name.startswith("iter_"):
        return verify(path, layers), problems
    for root in (path, path / "checkpoints"):
        found = newest(root, problems)
        if found is not None:
            return found, problems
    detail = "; ".join(problems) if problems else "no committed checkpoint there"
    raise CheckpointError(f"{path}: nothing to resume from ({detail})"
                          + (f"; it {baseline}" if baseline else ""))


def _baseline_snapshots(path: Path) -> str:
    """What to say where `path` holds the files of a baseline scheme (`snapshot.py`:
    `stageS/iter_N.pt`, in a run's `checkpoints_<scheme>`), which no job resumes from; "not
    committed" or "nothing there" alone would send the user looking for a fault."""
    if path.is_file():
        found = path.suffix == ".pt" and path.name.startswith("iter_")
    else:
        found = any(next(path.glob(pattern), None) is not None for pattern in (
            "iter_*.pt", "stage*/iter_*.pt", "checkpoints_*/stage*/iter_*.pt"))
    return ("holds snapshots of a baseline checkpoint scheme (torch_save or checkfreq), "
            "written to measure what checkpointing costs, not to resume from: --resume takes "
            "the durable tier (checkpoint.scheme durable or dcp_async)") if found else ""


def _partition(path: Path, manifest: dict[str, Any]) -> list[tuple[int, int]]:
    try:
        partition = Checkpoint(path, manifest).partition
        if all(isinstance(a, int) and isinstance(b, int) for a, b in partition):
            return partition
    except (KeyError, TypeError, ValueError):
        pass
    raise CheckpointError(f"{path / MANIFEST}: has no partition (layer ranges per stage)")


def layer_of(key: str) -> int:
    """The model layer a stage tensor's global name belongs to ("3.attn.weight", and the
    optimizer's "optim/3.attn.weight/exp_avg")."""
    return int(key.split("/")[-2 if key.startswith("optim/") else 0].split(".")[0])


def layers_of(module: nn.Module) -> set[int]:
    """The layers a stage module holds, by its tensors' global names."""
    return {layer_of(key) for key in module.state_dict()}


def folder_of(name: str) -> str:
    """The top folder of a file the manifest lists ("stage1/__0_0.distcp" -> "stage1")."""
    return name.split("/")[0]


def folders_holding(partition: Sequence[tuple[int, int]], layers: Collection[int]) -> set[str]:
    """The stage folders of a checkpoint written with `partition` that hold some of `layers`:
    the ones `load_stage` reads for them."""
    return {f"stage{old}" for old, (start, end) in enumerate(partition)
            if any(start <= layer < end for layer in layers)}


def load_stage(ckpt: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer
               ) -> list[str]:
    """Fill `module` (layers `layers` of the model) and its optimizer from the checkpoint,
    reading from every old stage folder that holds some of those layers.

    Every tensor the stage wants must be in a folder of the checkpoint, with its shape and
    dtype (each folder's JSON metadata says what it holds), or CheckpointError names the
    tensor, both shapes or dtypes, and the file: a tensor left at its initial value would
    train on silently (a model with more layers than the checkpoint's, or wider ones).

    The one exception is fp16's loss-scaler state (`runtime.precision`), which a checkpoint
    written in fp32 or bf16 does not hold: it starts at `loss_scale.init`, where the optimizer
    put it, as a fresh GradScaler does. Returns the names of those left so."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from spotpipe.checkpoint.dcp_json import JsonMetadataReader, MetadataError

    wanted = stage_tensors(module, materialise_optimizer_state(module, optimizer),
                           aliases=False)
    by_folder: dict[int, dict[str, torch.Tensor]] = {}
    partition = ckpt.partition
    for k, v in wanted.items():
        layer = layer_of(k)
        old = next((i for i, (start, end) in enumerate(partition) if start <= layer < end),
                   None)
        if old is None:
            raise CheckpointError(f"{ckpt.path / MANIFEST}: no stage holds layer {layer} "
                                  f"({k}): the checkpoint's partition {partition} has layers "
                                  f"0 to {max(end for _, end in partition) - 1} (it is of a "
                                  "model with fewer layers)")
        by_folder.setdefault(old, {})[k] = v
    fresh: list[str] = []
    for old, keys in sorted(by_folder.items()):
        folder = ckpt.path / f"stage{old}"
        reader = JsonMetadataReader(str(folder))
        try:
            held = reader.read_metadata().state_dict_metadata
            fresh += [k for k in keys if k not in held and k.rsplit("/", 1)[-1] in SCALER_STATE]
            keys = {k: v for k, v in keys.items() if k not in fresh}
            _check_held(folder, keys, held)
            buffers = {k: torch.empty_like(v, device="cpu") for k, v in keys.items()}
            with _one_process():
                dcp.load(buffers, storage_reader=reader, no_dist=True)
        except (MetadataError, CheckpointException) as exc:
            raise CheckpointError(f"{folder}: cannot be loaded ({dcp_cause(exc)})") from None
        with torch.no_grad():
            for k, v in buffers.items():
                keys[k].copy_(v)
    return fresh


def _check_held(folder: Path, keys: dict[str, torch.Tensor], held: dict[str, Any]) -> None:
    """Each of `keys` is in the folder's metadata (`held`) with its shape and dtype."""
    from spotpipe.checkpoint.dcp_json import METADATA

    for k, v in keys.items():
        meta = held.get(k)
        if meta is None:
            raise CheckpointError(f"{folder / METADATA}: has no tensor {k} (this stage's model "
                                  "or optimizer has one the checkpoint's does not)")
        size, dtype = list(meta.size), meta.properties.dtype
        if size != list(v.shape) or dtype != v.dtype:
            raise CheckpointError(
                f"{folder / METADATA}: {k} is {_described(size, dtype)} in the checkpoint, "
                f"{_described(list(v.shape), v.dtype)} in this stage's model or optimizer")


def _described(size: list[int], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')} of shape {size}"


def dcp_cause(exc: BaseException) -> str:
    """What DCP's exception says went wrong: the cause each rank raised (its CheckpointException
    leads with the ranks, then their tracebacks), else its message."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"{type(cause).__name__}: {cause}" for cause, _ in failures.values())
    return str(exc)
