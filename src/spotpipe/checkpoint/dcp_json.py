"""torch.distributed.checkpoint without pickle: DCP's metadata written and read as JSON.

DCP's own filesystem storage keeps a stage folder's metadata in `.metadata`, a pickle, which
`FileSystemReader.read_metadata` loads with `pickle.load`: a checkpoint folder someone hands
us would run code in every worker. These two subclasses change only that file. The writer
stores the same `Metadata` (tensor sizes, dtypes, chunks, and where each item lies in the
data files) as `dcp_metadata.json`; the reader builds `Metadata` back from that JSON and
never opens `.metadata`. The data files are DCP's own and are read by DCP's reader, which
loads each tensor with `torch.load(weights_only=True)`. Resharding is unchanged: DCP plans
the reads from this metadata exactly as from its own.

Only plain tensors are stored (what `durable.stage_tensors` gives); anything else in the
metadata is refused on write and on read, so the JSON names nothing but numbers, strings and
dtypes from a fixed list.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from spotpipe.checkpoint.dtypes import dtypes_by_name
from spotpipe.checkpoint.fsync import fsync_path

METADATA = "dcp_metadata.json"
FORMAT = "spotpipe-dcp-json/1"


_DTYPES = dtypes_by_name(torch.float64, torch.float32, torch.float16, torch.bfloat16,
                         torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                         torch.bool)


class MetadataError(ValueError):
    """JSON metadata that does not describe a DCP folder of plain tensors."""


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    tensors = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise MetadataError(f"{fqn}: only tensors are stored, got {type(item).__name__}")
        tensors[fqn] = {"dtype": str(item.properties.dtype).removeprefix("torch."),
                        "size": list(item.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    storage = [{"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                "index": index.index, "path": info.relative_path, "start": info.offset,
                "length": info.length, "transforms": list(info.transform_descriptors or [])}
               for index, info in md.storage_data.items()]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {"format": FORMAT, "version": md.version, "tensors": tensors, "storage": storage,
            "planner": planner}


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              for v in value):
        raise MetadataError(f"{what}: expected a list of integers, got {value!r}")
    return value


def metadata_from_json(data: Any) -> Metadata:
    """The Metadata that `metadata_to_json` wrote; MetadataError naming the entry otherwise."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise MetadataError(f"not {FORMAT} metadata")
    tensors: dict[str, Any] = {}
    for fqn, t in dict(data.get("tensors") or {}).items():
        if not isinstance(t, dict) or t.get("dtype") not in _DTYPES:
            raise MetadataError(f"{fqn}: unknown tensor entry {t!r}")
        chunks = [ChunkStorageMetadata(torch.Size(_ints(o, fqn)), torch.Size(_ints(s, fqn)))
                  for o, s in t.get("chunks", [])]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=_DTYPES[t["dtype"]]),
                                             torch.Size(_ints(t.get("size"), fqn)), chunks)
    storage = {}
    for s in data.get("storage") or []:
        if not isinstance(s, dict) or s.get("fqn") not in tensors:
            raise MetadataError(f"storage entry for an unknown tensor: {s!r}")
        path = s.get("path")
        if not isinstance(path, str) or "/" in path or path.startswith("."):
            raise MetadataError(f"{s['fqn']}: data file {path!r} is not a file of this folder")
        offset = None if s.get("offset") is None else _ints(s["offset"], s["fqn"])
        start, length = _ints([s.get("start"), s.get("length")], s["fqn"])
        storage[MetadataIndex(s["fqn"], offset, s.get("index"))] = _StorageInfo(
            path, start, length, [str(x) for x in s.get("transforms") or []])
    planner = {k: tuple(str(p) for p in v) for k, v in dict(data.get("planner") or {}).items()}
    return Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(), version=str(data.get("version")))


class JsonMetadataWriter(FileSystemWriter):
    """DCP's filesystem writer, with the metadata as JSON (fsynced) instead of a pickle."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        folder = Path(self.path)
        tmp = folder / (METADATA + ".tmp")
        with open(tmp, "w") as f:
            json.dump(metadata_to_json(metadata), f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, folder / METADATA)
        if self.sync_files:
            fsync_path(folder)


class JsonMetadataReader(FileSystemReader):
    """DCP's filesystem reader, taking the metadata from the JSON file; `.metadata` is never
    opened."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA
        try:
            md = metadata_from_json(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise MetadataError(f"{path}: {exc}") from None
        md.storage_meta.load_id = self.load_id
        return md
