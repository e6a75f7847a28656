"""Tensor dtypes by the names files and records write them with ("float32").

A name read back from a file or the store may be only one of a known list: `getattr(torch,
name)` would take any attribute of torch. Its own module so that readers of records need not
import what reads DCP's files (torch.distributed.checkpoint: 0.6 s at a worker's start).
"""

from __future__ import annotations

import torch


def dtypes_by_name(*dtypes: torch.dtype) -> dict[str, torch.dtype]:
    """`dtypes` by their names without torch's prefix: what such a name may be read back as."""
    return {str(dt).removeprefix("torch."): dt for dt in dtypes}
