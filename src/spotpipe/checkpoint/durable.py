"""Durable checkpoints on disk, written with torch.distributed.checkpoint (DCP).

Layout of one checkpoint: `ROOT/iter_00000041/` holding one DCP folder per stage of the layout
that wrote it (`stage0/`, `stage1/`, ...) and `manifest.json`. Tensors are keyed by the
unpartitioned model's names (`3.attn.c_attn.weight`, and `optim/3.attn.c_attn.weight/exp_avg`),
so a checkpoint written at one P x D loads at any other: each new stage reads the keys of its
layers from whichever old stage folders hold them (DCP loads only the keys asked for).

Commit is atomic: stages are written into `.iter_N.partial/`, the launcher writes the manifest
(with a SHA-256 of every file) once every stage has reported, then renames the folder. A reader
takes the newest folder whose manifest and checksums verify, and names the file that does not.
Nothing is unpickled: DCP's files hold tensors and DCP metadata; the manifest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from spotpipe.runtime.optim import materialise_optimizer_state  # noqa: F401 (re-exported)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def iter_dir(root: Path, iteration: int, partial: bool = False) -> Path:
    name = f"iter_{iteration:08d}"
    return root / (f".{name}.partial" if partial else name)


def _optimizer_items(module: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> dict[str, torch.Tensor]:
    by_param = {id(p): name for name, p in module.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{by_param[id(p)]}/{key}"] = value
    return out


def stage_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything that defines a stage's training state, under global names."""
    return {**{k: v.detach() for k, v in module.state_dict().items()},
            **_optimizer_items(module, optimizer)}


def file_checksums(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def prepare_stage_folder(root: Path, iteration: int, stage: int) -> Path:
    """An empty folder for one stage of an uncommitted checkpoint."""
    folder = iter_dir(root, iteration, partial=True) / f"stage{stage}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def save_stage(root: Path, iteration: int, stage: int, module: nn.Module,
               optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Write one stage of iteration `iteration`; return its files' checksums."""
    folder = prepare_stage_folder(root, iteration, stage)
    tensors = {k: v.to("cpu") for k, v in stage_tensors(module, optimizer).items()}
    dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    return {f"stage{stage}/{k}": v for k, v in file_checksums(folder).items()}


def commit(root: Path, iteration: int, info: dict[str, Any], checksums: dict[str, str],
           keep: int) -> Path:
    """Write the manifest and make the checkpoint visible; keep the newest `keep`."""
    partial = iter_dir(root, iteration, partial=True)
    manifest = {"format_version": FORMAT_VERSION, "iteration": iteration,
                "next_iteration": iteration + 1, **info, "checksums": checksums}
    tmp = partial / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, partial / MANIFEST)
    final = iter_dir(root, iteration)
    os.replace(partial, final)
    committed = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in committed[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def next_iteration(self) -> int:
        return int(self.manifest["next_iteration"])

    @property
    def partition(self) -> list[tuple[int, int]]:
        return [tuple(r) for r in self.manifest["partition"]]


def read_manifest(manifest_path: Path, version: int = FORMAT_VERSION) -> dict[str, Any]:
    """A JSON manifest that commits a checkpoint, checked for presence and format version."""
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing (the checkpoint was not committed)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from None
    if manifest.get("format_version") != version:
        raise CheckpointError(f"{manifest_path}: format version {manifest.get('format_version')}"
                              f" is not supported (this spotpipe reads {version})")
    return manifest


def verify(path: Path) -> Checkpoint:
    """Read and check one checkpoint folder; raise CheckpointError naming what is wrong."""
    manifest = read_manifest(path / MANIFEST)
    for name, digest in manifest["checksums"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise CheckpointError(f"{file}: checksum mismatch (corrupted or truncated)")
    return Checkpoint(path, manifest)


def newest(root: Path, problems: list[str] | None = None) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies; skipped ones are named in `problems`."""
    for path in sorted((p for p in root.glob("iter_*") if p.is_dir()), reverse=True):
        try:
            return verify(path)
        except CheckpointError as exc:
            if problems is not None:
                problems.append(str(exc))
    return None


def resolve(path: Path) -> tuple[Checkpoint, list[str]]:
    """A checkpoint folder, a checkpoints root, or a run folder -> the checkpoint to load."""
    problems: list[str] = []
    if (path / MANIFEST).exists() or path.name.startswith("iter_"):
        return verify(path), problems
    for root in (path, path / "checkpoints"):
        found = newest(root, problems)
        if found is not None:
            return found, problems
    detail = "; ".join(problems) if problems else "no committed checkpoint there"
    raise CheckpointError(f"{path}: nothing to resume from ({detail})")


def load_stage(ckpt: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fill `module` (layers `layers` of the model) and its optimizer from the checkpoint,
    reading from every old stage folder that holds some of those layers."""
    wanted = stage_tensors(module, materialise_optimizer_state(module, optimizer))
    for old, (start, end) in enumerate(ckpt.partition):
        keys = {k: v for k, v in wanted.items()
                if start <= int(k.split("/")[-2 if k.startswith("optim/") else 0].split(".")[0])
                < end}
        if not keys:
            continue
        buffers = {k: torch.empty_like(v, device="cpu") for k, v in keys.items()}
        dcp.load(buffers, checkpoint_id=str(ckpt.path / f"stage{old}"), no_dist=True)
        with torch.no_grad():
            for k, v in buffers.items():
                keys[k].copy_(v)
