"""Deterministic, resumable sampling by global sample index; token-file and text datasets."""

from spotpipe.data.corpus import demo_corpus_text, ensure_demo_corpus
from spotpipe.data.datasets import (
    DTYPES,
    DataError,
    Dataset,
    TextDataset,
    TokenFileDataset,
    collate,
    load_user_dataset,
    write_token_file,
)
from spotpipe.data.sampler import GlobalSampler

__all__ = [
    "DTYPES",
    "DataError",
    "Dataset",
    "GlobalSampler",
    "TextDataset",
    "TokenFileDataset",
    "collate",
    "demo_corpus_text",
    "ensure_demo_corpus",
    "load_user_dataset",
    "write_token_file",
]
