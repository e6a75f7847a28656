"""spotpipe.data: index-based sampler, token/text datasets, user datasets, demo corpus."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from spotpipe.data import (
    DataError,
    GlobalSampler,
    TextDataset,
    TokenFileDataset,
    collate,
    demo_corpus_text,
    ensure_demo_corpus,
    load_user_dataset,
    write_token_file,
)
from spotpipe.model import FactoryError


def test_every_sample_once_per_epoch() -> None:
    s = GlobalSampler(num_samples=96, global_batch=8, seed=3)
    assert s.iterations_per_epoch == 12
    for epoch in range(3):
        seen = [i for t in range(epoch * 12, (epoch + 1) * 12) for i in s.indices(t)]
        assert sorted(seen) == list(range(96))
    assert s.indices(0) != s.indices(12), "each epoch must be a new permutation"


def test_remainder_dropped_each_epoch() -> None:
    s = GlobalSampler(num_samples=50, global_batch=8, seed=0)
    assert s.iterations_per_epoch == 6
    for epoch in range(2):
        seen = [i for t in range(epoch * 6, epoch * 6 + 6) for i in s.indices(t)]
        assert len(seen) == len(set(seen)) == 48
        assert set(seen) <= set(range(50))


def test_sampler_deterministic_resumable_and_seeded() -> None:
    a = GlobalSampler(64, 4, seed=11)
    sequential = [a.indices(t) for t in range(40)]
    fresh = GlobalSampler(64, 4, seed=11)
    assert [fresh.indices(t) for t in (37, 5, 16, 0)] == [sequential[t] for t in (37, 5, 16, 0)]
    other = GlobalSampler(64, 4, seed=12)
    assert [other.indices(t) for t in range(16)] != sequential[:16]
    assert sequential[:16] != [list(range(t * 4, t * 4 + 4)) for t in range(16)]  # shuffled


def test_the_batches_are_the_documented_scheme_by_hand() -> None:
    """Epoch e is torch.randperm from a generator seeded (seed * 1_000_003 + e) mod 2**63,
    cut into whole global batches in order (the sampler's docstring), computed here without
    the sampler: the data order of checkpoints written before stays what it was."""
    n, b, seed = 103, 10, -7
    s = GlobalSampler(n, b, seed)
    for epoch in (0, 2):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
        perm = torch.randperm(n, generator=gen).tolist()
        for step in range(10):
            got = s.indices(epoch * 10 + step)
            assert got == perm[step * b : (step + 1) * b]
            assert all(type(i) is int for i in got)


def test_the_epoch_permutation_is_held_compactly() -> None:
    """Millions of samples: the cached permutation is not a tuple of Python ints (about 44
    bytes each, hundreds of MiB per worker at a corpus's size)."""
    import tracemalloc

    tracemalloc.start()
    GlobalSampler(2_000_000, 64, seed=5).indices(3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # (a tuple of 2M ints: over 70 MiB)


def test_microbatch_and_pipeline_slicing_cover_the_batch_once() -> None:
    s = GlobalSampler(1000, 24, seed=1)
    for t in (0, 7, 41):
        batch = s.indices(t)
        mbs = [s.microbatch_indices(t, j, 4) for j in range(6)]
        assert [i for mb in mbs for i in mb] == batch
        for d_count, m_count in [(1, 6), (2, 3), (3, 2), (6, 1), (2, 6)]:
            parts = [s.pipeline_microbatches(t, d, d_count, m_count) for d in range(d_count)]
            flat = [i for pipe in parts for mb in pipe for i in mb]
            assert flat == batch  # pipeline d owns global micro-batches d*M .. d*M + M-1
            assert all(len(pipe) == m_count for pipe in parts)
        b = 24 // 6
        assert s.pipeline_microbatches(t, 1, 2, 3)[2] == s.microbatch_indices(t, 1 * 3 + 2, b)


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match="global batch 10 .* 9 samples"):
        GlobalSampler(9, 10, seed=0)
    s = GlobalSampler(100, 12, seed=0)
    with pytest.raises(ValueError, match="not divisible"):
        s.pipeline_microbatches(0, 0, 5, 1)
    with pytest.raises(ValueError, match="does not divide"):
        s.microbatch_indices(0, 0, 5)
    with pytest.raises(ValueError, match="out of range"):
        s.microbatch_indices(0, 3, 4)
    with pytest.raises(ValueError, match="out of range"):
        s.pipeline_microbatches(0, 2, 2, 2)
    with pytest.raises(ValueError, match=">= 0"):
        s.indices(-1)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype: str) -> None:
    tokens = np.arange(0, 41) * (1000 if dtype == "uint32" else 7)
    path = write_token_file(tmp_path / "train.bin", tokens, dtype)
    ds = TokenFileDataset(path, block_size=8, dtype=dtype)
    assert len(ds) == 5  # 41 tokens: 5 samples of 8 + 1 shifted target
    x, y = ds[2]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == tokens[16:24].tolist()
    assert y.tolist() == tokens[17:25].tolist()
    assert ds[4][1].tolist() == tokens[33:41].tolist()  # the last sample uses the last token
    with pytest.raises(IndexError):
        ds[5]
    xb, yb = collate(ds, [3, 0])
    assert xb.shape == (2, 8) and torch.equal(xb[0], ds[3][0]) and torch.equal(yb[1], ds[0][1])


def test_token_file_errors(tmp_path) -> None:
    missing = tmp_path / "nope" / "train.bin"
    with pytest.raises(DataError, match=str(missing)):
        TokenFileDataset(missing, 8)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        TokenFileDataset(empty, 8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="not a multiple of 2"):
        TokenFileDataset(odd, 1)
    short = write_token_file(tmp_path / "short.bin", [1, 2, 3], "uint16")
    with pytest.raises(DataError, match="too few"):
        TokenFileDataset(short, 8)
    with pytest.raises(DataError, match="beyond uint16"):
        write_token_file(tmp_path / "big.bin", [70000], "uint16")
    with pytest.raises(DataError, match="dtype"):
        TokenFileDataset(short, 1, dtype="int8")


def test_token_ids_beyond_the_vocabulary_are_named(tmp_path) -> None:
    """A token id the model has no embedding for (a file of another dtype or tokenizer) is a
    DataError naming the file and the sample when that sample is read; before, training ran
    until the embedding raised a bare "index out of range in self" (on a GPU, a device-side
    assert)."""
    tokens = np.arange(41) % 50
    tokens[19] = 300  # in sample 2 (tokens 16..24), as its input and its neighbour's target
    path = write_token_file(tmp_path / "t.bin", tokens, "uint16")
    ds = TokenFileDataset(path, block_size=8, vocab_size=256)
    assert ds[0][0].tolist() == tokens[:8].tolist() and len(ds[4][1]) == 8
    with pytest.raises(DataError, match=f"{path}.*sample 2 holds token id 300 .token 19.*"
                                        "vocabulary of 256"):
        ds[2]
    ds[1]  # (tokens 8..16: untouched)
    assert TokenFileDataset(path, block_size=8)[2][0][3] == 300  # no vocabulary: no check
    text = tmp_path / "t.txt"
    text.write_bytes(b"abc" * 10 + b"\xff" + b"abc" * 10)
    with pytest.raises(DataError, match=f"{text}.*sample 3 holds token id 255"):
        TextDataset(text, block_size=8, vocab_size=128)[3]


def test_a_token_file_read_as_another_dtype_is_refused_at_launch(tmp_path) -> None:
    """uint16 ids read as uint32 pair into ids far beyond the vocabulary: the launch names
    the data file (before: "model: cannot profile its layers ...: index out of range")."""
    from spotpipe.cluster.launcher import LaunchError, prepare

    from conftest import tiny_config

    path = write_token_file(tmp_path / "t.bin", np.arange(17 * 40) % 256, "uint16")
    cfg = tiny_config(tmp_path, **{"data.kind": "tokens", "data.path": str(path),
                                   "data.dtype": "uint32"})
    with pytest.raises(LaunchError, match=f"^data: data file '{path}': sample .* holds token "
                                          "id .* beyond the model's vocabulary of 256"):
        prepare(cfg)


@pytest.mark.parametrize("top", [50257, 200_000], ids=["GPT-2 ids", "ids over 65535"])
def test_a_uint32_token_file_read_as_uint16_is_refused(tmp_path, top: int) -> None:
    """uint32 ids read as uint16 words are each id's low half, then its high half (0, or
    under 4 for ids under 2**18): every word is a valid id for a vocabulary that covers the
    file's, so the job trained on "id, 0, id, 0" without an error. The file is refused at
    launch, naming it and the key."""
    from spotpipe.cluster.launcher import LaunchError, prepare

    from conftest import tiny_config

    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, 20_000), top - 1)  # a few ids 0..3 in low halves too
    ids[::97] = 0
    path = write_token_file(tmp_path / "t.bin", ids, "uint32")
    with pytest.raises(DataError, match=f"data file '{path}' looks like uint32 token ids "
                                        "read as uint16.*set data.dtype: uint32"):
        TokenFileDataset(path, block_size=8, dtype="uint16", vocab_size=top)
    assert TokenFileDataset(path, 8, dtype="uint32")[3][0].tolist() == ids[24:32].tolist()
    small = write_token_file(tmp_path / "s.bin", np.arange(4, 4 + 17 * 40) % 256, "uint32")
    cfg = tiny_config(tmp_path, **{"data.kind": "tokens", "data.path": str(small),
                                   "data.dtype": "uint16"})
    with pytest.raises(LaunchError, match=f"^data: data file '{small}' looks like uint32"):
        prepare(cfg)


def uint16_corpora(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """uint16 corpora as real data can be, each the hardest case of its kind for a check
    of the high halves: many small ids, long runs of padding, a tiny vocabulary."""
    text = np.minimum(rng.zipf(1.2, 200_000), 50256)
    padded = np.zeros(200_000, dtype=np.int64)  # documents of 100 tokens, padded to 1000
    for start in range(0, len(padded), 1000):
        padded[start:start + 100] = text[start:start + 100]
    dna = rng.integers(0, 4, 200_000)  # ACGT as 0..3, an N (4) once in a thousand
    dna[rng.random(len(dna)) < 0.001] = 4
    frequent_zero = np.where(rng.random(200_000) < 0.9, 0, text)  # id 0 nine times in ten
    return {"text": text, "padded": padded, "dna": dna, "frequent zero": frequent_zero,
            "tiny": np.arange(4, 4 + 41) * 7, "short": text[:9]}


def test_a_uint16_corpus_is_never_taken_for_uint32(tmp_path) -> None:
    """A token's place in a uint16 stream is even or odd by chance (documents start
    anywhere), so all of the >= 64 sampled words at or over 4 in even places happens with a
    chance of 2**-64 at most; these corpora (5 seeds each) read as uint16 and as nothing
    else, small test corpora included."""
    from spotpipe.data.datasets import looks_like_uint32, sampled_words

    for seed in range(5):
        for name, tokens in uint16_corpora(np.random.default_rng(seed)).items():
            path = write_token_file(tmp_path / "c.bin", tokens, "uint16")
            ds = TokenFileDataset(path, block_size=8)
            assert ds[0][0].tolist() == tokens[:8].tolist(), name
            # the same ids as uint32 are refused, where the sample holds 64 ids of 4 or more
            words, places = sampled_words(tokens.astype(np.uint32).view(np.uint16))
            assert looks_like_uint32(words, places) == (name not in ("dna", "tiny", "short"))


def test_text_dataset_is_bytes(tmp_path) -> None:
    text = "héllo wörld, " * 5
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    raw = list(text.encode("utf-8"))
    ds = TextDataset(path, block_size=10)
    assert len(ds) == (len(raw) - 1) // 10
    x, y = ds[1]
    assert x.tolist() == raw[10:20] and y.tolist() == raw[11:21]
    with pytest.raises(DataError, match="missing.txt"):
        TextDataset(tmp_path / "missing.txt", 10)


def test_a_text_corpus_is_read_where_it_lies_not_copied_into_each_process(tmp_path) -> None:
    """Every worker opens the dataset: a text corpus read into memory cost each of them its
    whole size (a 300 MB corpus: 286 MiB more per worker), where a token file costs none."""
    import tracemalloc

    path = tmp_path / "big.txt"
    raw = bytes(range(256)) * (32 * 2**20 // 256)  # 32 MiB
    path.write_bytes(raw)
    tracemalloc.start()
    ds = TextDataset(path, block_size=64)
    x, y = ds[len(ds) - 1]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2**20, peak
    start = (len(ds) - 1) * 64
    assert len(ds) == (len(raw) - 1) // 64
    assert x.tolist() == list(raw[start : start + 64])
    assert y.tolist() == list(raw[start + 1 : start + 65])


def test_load_user_dataset(tmp_path, monkeypatch) -> None:
    (tmp_path / "sp_user_data.py").write_text(
        textwrap.dedent(
            """
            import torch

            def pairs(n=3):
                return [(torch.tensor([i]), torch.tensor([i + 1])) for i in range(n)]

            def nothing():
                return 42

            class Broken:
                def __len__(self):
                    return 4

                def __getitem__(self, i):
                    if i == 1:
                        raise KeyError("row 1 is missing")
                    if i == 2:
                        return [1, 2]  # not tensors
                    return torch.zeros(i + 1), torch.zeros(i + 1)  # shapes differ

            def broken():
                return Broken()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = load_user_dataset("sp_user_data:pairs", {"n": 4})
    assert len(ds) == 4 and collate(ds, [2])[1].tolist() == [[3]]
    with pytest.raises(DataError, match="sp_user_data:nothing.*int"):
        load_user_dataset("sp_user_data:nothing", {})
    with pytest.raises(DataError, match="empty"):
        load_user_dataset("sp_user_data:pairs", {"n": 0})
    with pytest.raises(FactoryError, match="no attribute"):
        load_user_dataset("sp_user_data:missing", {})
    # a sample that is not a pair of tensors, or cannot be read, or a batch whose shapes
    # differ: a DataError naming the spec and the samples (a bare KeyError, or torch.stack's
    # "stack expects each tensor to be equal size", before)
    broken = load_user_dataset("sp_user_data:broken", {})
    with pytest.raises(DataError, match=r"dataset spec 'sp_user_data:broken': sample 1 cannot "
                                        r"be read \(KeyError: 'row 1 is missing'\)"):
        collate(broken, [1])
    with pytest.raises(DataError, match=r"sp_user_data:broken'?: sample 2 is \(int, int\); "
                                        "expected a pair"):
        collate(broken, [2])
    with pytest.raises(DataError, match=r"sp_user_data:broken'?: samples \[0, 3\] do not "
                                        r"stack into a batch \(x -> y shapes \(1,\)->\(1,\), "
                                        r"\(4,\)->\(4,\)\)"):
        collate(broken, [0, 3])


def test_demo_corpus(tmp_path) -> None:
    path = ensure_demo_corpus(tmp_path / "corpus" / "demo.txt")
    data = path.read_bytes()
    assert 200_000 <= len(data) <= 500_000
    assert data == demo_corpus_text().encode("utf-8")  # deterministic
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind
    path.write_text("kept")
    assert ensure_demo_corpus(path).read_text() == "kept"  # an existing corpus is not rewritten
    assert len(TextDataset(ensure_demo_corpus(tmp_path / "d2.txt"), 64)) > 3000


def test_a_worker_refuses_data_of_another_length_than_the_launchers(tmp_path) -> None:
    """A host whose copy of the data file differs (here: cut short) must not train on it:
    its sampler would permute another count of samples, and its pipelines would take
    samples that other pipelines take too."""
    from spotpipe import job

    from conftest import tiny_config

    path = tmp_path / "corpus.txt"
    path.write_bytes(demo_corpus_text(4000).encode())
    cfg = tiny_config(path)
    launched = len(job.build_dataset(cfg))
    assert len(job.build_job_dataset(cfg, launched)) == launched
    path.write_bytes(path.read_bytes()[:2000])  # this host's copy, cut short
    with pytest.raises(DataError, match=f"{path}.* holds {(2000 - 1) // 16} samples.*"
                                        f"launched with {launched}"):
        job.build_job_dataset(cfg, launched)


HOST_DATA = '''
import os
import torch


class Tokens:
    def __init__(self, n):  # node1's "host" holds 7 samples more
        self.n = n + (7 if os.environ.get("RANK") == "1" else 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(i))
        return t[:-1], t[1:]


def make(n=64):
    return Tokens(n)
'''


def test_a_job_whose_processes_see_different_data_stops_naming_it(tmp_path, monkeypatch,
                                                                  corpus) -> None:
    """End to end: before, node1 drew its half of each batch from a permutation of 71
    samples and the job ended with status 0, its batches not the launcher's."""
    import json
    import os

    from spotpipe.cluster.launcher import train

    from conftest import tiny_config

    (tmp_path / "sp_host_data.py").write_text(HOST_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cfg = tiny_config(corpus, stages=1, pipelines=2, iterations=2,
                      **{"data.kind": "factory", "data.factory": "sp_host_data:make"})
    out = tmp_path / "run"
    assert train(cfg, out, progress=False) != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "dataset spec 'sp_host_data:make' holds 71 samples" in summary["message"]
    assert "launched with 64" in summary["message"]


def test_the_data_digest_is_every_bytes_sha256_and_names_an_unreadable_file(corpus, tmp_path):
    """What hosts compare before an agent is admitted (`job.data_digest`): the SHA-256 of
    the file's bytes, so two copies of one length that differ in one byte differ; a factory
    dataset has none; a file that cannot be read is a DataError naming it."""
    import hashlib

    from spotpipe import job

    from conftest import tiny_config

    assert job.data_digest(tiny_config(corpus)) == hashlib.sha256(corpus.read_bytes()).hexdigest()
    edited = tmp_path / "edited.txt"
    text = bytearray(corpus.read_bytes())
    text[-1] ^= 1
    edited.write_bytes(bytes(text))
    assert job.data_digest(tiny_config(edited)) != job.data_digest(tiny_config(corpus))
    factory = tiny_config(corpus, **{"data.kind": "factory", "data.factory": "m:f"})
    assert job.data_digest(factory) == ""
    gone = tiny_config(tmp_path / "gone.txt")
    with pytest.raises(DataError, match="gone.txt"):
        job.data_digest(gone)
