"""Exact fingerprints of tensors and of a stage's state, for the invariants' tests.

SHA-256 over the raw bytes: two digests are equal only if every bit is, which is what
"the replica is bit-identical to its owner" means.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state in parameter order and key order (step counts included)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                out.append(value if isinstance(value, torch.Tensor) else torch.tensor(value))
    return out


def stage_digest(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    return {"params": tensors_digest(p for p in module.parameters()),
            "optim": tensors_digest(optimizer_tensors(optimizer))}


class DigestLog:
    """One JSON line per fingerprint; written from the main and the replica thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
