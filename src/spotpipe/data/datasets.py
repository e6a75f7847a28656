"""Datasets: anything with ``__len__`` and ``__getitem__(i) -> (x, y)`` tensors.

The built-ins read token streams (a nanoGPT-style ``.bin`` of token ids, or a text file's
bytes) and cut them into non-overlapping samples: sample i is ``tokens[i*T : i*T + T + 1]``,
x its first T tokens and y the same shifted by one. Sample i depends only on i, which the
index-based sampler relies on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from spotpipe.factories import call_factory

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A dataset that cannot be read or used, with the path or spec that caused it."""


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]: ...


class _TokenChunks:
    """Non-overlapping (x, y) samples of ``block_size`` tokens over a 1-D token array.

    ``vocab_size``: the model's, where known. A token id beyond it (a file of another dtype
    or tokenizer) is a DataError naming the file and sample when that sample is read, not
    an embedding's bare IndexError (or a device-side assert on a GPU) mid-run; checked per
    sample, since scanning a memory-mapped corpus of gigabytes at launch would cost minutes.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, source: str,
                 vocab_size: int | None = None) -> None:
        if block_size < 1:
            raise DataError(f"block_size must be >= 1, got {block_size}")
        if len(tokens) < block_size + 1:
            raise DataError(
                f"{source} holds {len(tokens)} tokens, too few for one sample of "
                f"block_size {block_size} (needs {block_size + 1})"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.source = source
        self.vocab_size = vocab_size
        self._len = (len(tokens) - 1) // block_size

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} is out of range for {self._len} samples")
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            at = start + int(np.argmax(window >= self.vocab_size))
            raise DataError(
                f"data file {self.source}: sample {i} holds token id {int(self.tokens[at])} "
                f"(token {at} of the file), beyond the model's vocabulary of {self.vocab_size}: "
                "a file of another dtype or tokenizer?")
        chunk = torch.from_numpy(np.array(window, dtype=np.int64))
        return chunk[:-1], chunk[1:]


def _existing_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {str(p)!r} does not exist or is not a file")
    if p.stat().st_size == 0:
        raise DataError(f"data file {str(p)!r} is empty")
    return p


class TokenFileDataset(_TokenChunks):
    """A nanoGPT-style ``.bin``: raw little-endian token ids, memory-mapped (not loaded)."""

    def __init__(self, path: str | os.PathLike, block_size: int, dtype: str = "uint16",
                 vocab_size: int | None = None) -> None:
        if dtype not in DTYPES:
            raise DataError(f"token dtype {dtype!r} is not one of {sorted(DTYPES)}")
        p = _existing_file(path)
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        size = p.stat().st_size
        if size % itemsize:
            raise DataError(
                f"data file {str(p)!r} has {size} bytes, not a multiple of {itemsize} "
                f"({dtype}): wrong dtype or a truncated file"
            )
        self.path = p
        tokens = np.memmap(p, dtype=DTYPES[dtype], mode="r")
        if dtype == "uint16":
            _refuse_uint32_read_as_uint16(tokens, p)
        super().__init__(tokens, block_size, repr(str(p)), vocab_size)


# uint32 ids read as uint16 words: word 2i is id i's low half, word 2i+1 its high half, which is
# under 4 for every id under 2**18 (every tokenizer's vocabulary, 256000 at most). Each pair
# of words reads as two valid ids, so the vocabulary check never fires, and the job trains on
# "id, 0, id, 0" without an error.
HIGH_HALF_BOUND = 4
SAMPLE_WINDOWS, WINDOW_WORDS = 64, 64  # 8 KiB read, spread over the file
# the words at or over the bound in even places, with none in odd ones, to call it uint32:
# in a uint16 stream a token's place's parity is a coin toss (documents start anywhere), so
# a real corpus puts all of them in even places with a chance of 2**-64 at most
EVIDENCE_WORDS = 64


def sampled_words(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the words, their places in the file): windows of WINDOW_WORDS spread evenly over
    the file, each starting at an even place, or the whole of a small file."""
    n = len(tokens)
    if n <= SAMPLE_WINDOWS * WINDOW_WORDS:
        return np.asarray(tokens), np.arange(n)
    starts = np.linspace(0, n - WINDOW_WORDS, SAMPLE_WINDOWS).astype(np.int64) & ~1
    places = (starts[:, None] + np.arange(WINDOW_WORDS)).reshape(-1)
    return np.asarray(tokens[places]), places


def looks_like_uint32(words: np.ndarray, places: np.ndarray) -> bool:
    """Whether uint16 words are uint32 ids' halves: no word in an odd place reaches
    HIGH_HALF_BOUND, while EVIDENCE_WORDS in even places do (a small or mostly-zero sample
    tells nothing either way: it passes)."""
    large = words >= HIGH_HALF_BOUND
    odd = (places & 1).astype(bool)
    return not large[odd].any() and int(large[~odd].sum()) >= EVIDENCE_WORDS


def _refuse_uint32_read_as_uint16(tokens: np.ndarray, path: Path) -> None:
    words, places = sampled_words(tokens)
    if looks_like_uint32(words, places):
        raise DataError(
            f"data file {str(path)!r} looks like uint32 token ids read as uint16: of the "
            f"{len(words)} words sampled, every second one (an id's high half) is under "
            f"{HIGH_HALF_BOUND} while the others are not; set data.dtype: uint32 (or write "
            "the file as uint16)")


class TextDataset(_TokenChunks):
    """A text file's bytes as tokens 0..255 (byte-level; any bytes work, UTF-8 or not).

    Memory-mapped like a token file: every worker opens the dataset, and a corpus read into
    memory cost each of them the file's whole size."""

    vocab_size = 256

    def __init__(self, path: str | os.PathLike, block_size: int,
                 vocab_size: int | None = None) -> None:
        p = _existing_file(path)
        self.path = p
        super().__init__(np.memmap(p, dtype=np.uint8, mode="r"), block_size, repr(str(p)),
                         vocab_size)


def write_token_file(
    path: str | os.PathLike, tokens: Sequence[int] | np.ndarray | Tensor, dtype: str = "uint16"
) -> Path:
    """Write token ids as a ``.bin`` readable by TokenFileDataset (temp file, then rename)."""
    if dtype not in DTYPES:
        raise DataError(f"token dtype {dtype!r} is not one of {sorted(DTYPES)}")
    arr = np.asarray(tokens.cpu().numpy() if isinstance(tokens, Tensor) else tokens).reshape(-1)
    info = np.iinfo(DTYPES[dtype])
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise DataError(f"token ids range over [{arr.min()}, {arr.max()}], beyond {dtype}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    arr.astype(DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, p)
    return p


def load_user_dataset(spec: str, kwargs: dict[str, Any]) -> Dataset:
    """Call a ``package.module:function`` that returns a dataset. Loading errors are
    :class:`~spotpipe.model.factory.FactoryError`; an unusable result is a DataError."""
    ds = call_factory(spec, kwargs)
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise DataError(
            f"dataset spec {spec!r} returned a {type(ds).__name__}, which lacks "
            "__len__ and __getitem__"
        )
    if len(ds) == 0:
        raise DataError(f"dataset spec {spec!r} returned an empty dataset")
    return CheckedDataset(ds, f"dataset spec {spec!r}")


class CheckedDataset:
    """A user's dataset, each sample checked as it is read: a pair ``(x, y)`` of tensors.

    A sample of another kind, or one whose ``__getitem__`` raises, used to surface as a bare
    error from ``torch.stack`` or the model's first layer, naming neither the dataset nor the
    sample; the job now stops with a DataError that names both (`collate` names the samples
    of a batch whose shapes or dtypes differ)."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        try:
            sample = self.dataset[i]
        except Exception as exc:
            raise DataError(f"{self.name}: sample {i} cannot be read "
                            f"({type(exc).__name__}: {exc})"[:500]) from exc
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2
                and all(isinstance(t, Tensor) for t in sample)):
            kinds = (", ".join(type(t).__name__ for t in sample)
                     if isinstance(sample, (tuple, list)) else type(sample).__name__)
            raise DataError(f"{self.name}: sample {i} is ({kinds}); expected a pair (x, y) of "
                            "tensors")
        return sample[0], sample[1]


def collate(dataset: Dataset, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Stack samples ``indices`` (in order) into a batch ``(x, y)``."""
    if len(indices) == 0:
        raise DataError("cannot collate an empty list of indices")
    xs, ys = zip(*(dataset[i] for i in indices))
    try:
        return torch.stack(xs), torch.stack(ys)
    except RuntimeError as exc:  # shapes (or devices) that differ within the batch
        shapes = sorted({f"{tuple(x.shape)}->{tuple(y.shape)}" for x, y in zip(xs, ys)})
        name = getattr(dataset, "name", type(dataset).__name__)
        raise DataError(f"{name}: samples {list(indices)[:16]} do not stack into a batch "
                        f"(x -> y shapes {', '.join(shapes[:8])}): {exc}"[:600]) from exc
