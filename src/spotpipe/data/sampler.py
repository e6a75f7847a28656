"""Deterministic, resumable sampling by global sample index.

Which samples make up iteration t is a pure function of (seed, t): no sampler state, no
iterator to checkpoint. A job resumed at iteration t, or re-laid-out onto a different number of
pipelines, sees the same global batch, which is what lets every sample of an epoch be consumed
exactly once whatever happens to the cluster.

Scheme: epoch e is ``torch.randperm(num_samples)`` drawn from a generator seeded with
``(seed * 1_000_003 + e) mod 2**63``. Each epoch yields ``num_samples // global_batch``
batches, taken in order from the start of its permutation; the last ``num_samples %
global_batch`` entries of the permutation (different samples each epoch) are skipped, so a
batch never straddles two epochs.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """Kept as an int64 tensor (8 bytes a sample), not a tuple of Python ints (about 44):
    every worker holds the permutation of each epoch it reaches, and a corpus of millions of
    samples made that hundreds of MiB per worker."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_samples, generator=gen)


class GlobalSampler:
    """The global batch of every iteration, and its split into micro-batches and pipelines."""

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if num_samples < 1 or global_batch < 1:
            raise ValueError(
                f"num_samples ({num_samples}) and global_batch ({global_batch}) must be >= 1"
            )
        if num_samples // global_batch == 0:
            raise ValueError(
                f"global batch {global_batch} is larger than the dataset's {num_samples} "
                "samples: an epoch would have no iteration"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.iterations_per_epoch = num_samples // global_batch

    def epoch_of(self, iteration: int) -> int:
        return iteration // self.iterations_per_epoch

    def indices(self, iteration: int) -> list[int]:
        """Sample indices of iteration ``iteration``'s global batch, in batch order."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        epoch, step = divmod(iteration, self.iterations_per_epoch)
        perm = _epoch_permutation(self.num_samples, self.seed, epoch)
        b = self.global_batch
        return perm[step * b : (step + 1) * b].tolist()

    def microbatch_indices(
        self, iteration: int, microbatch_global_index: int, microbatch_size: int
    ) -> list[int]:
        """Global micro-batch j of the iteration: entries ``[j*b, (j+1)*b)`` of its batch."""
        if microbatch_size < 1 or self.global_batch % microbatch_size:
            raise ValueError(
                f"micro-batch size {microbatch_size} does not divide the global batch "
                f"{self.global_batch}"
            )
        count = self.global_batch // microbatch_size
        if not 0 <= microbatch_global_index < count:
            raise ValueError(
                f"micro-batch index {microbatch_global_index} is out of range: the global batch "
                f"{self.global_batch} holds {count} micro-batches of {microbatch_size}"
            )
        start = microbatch_global_index * microbatch_size
        return self.indices(iteration)[start : start + microbatch_size]

    def pipeline_microbatches(
        self, iteration: int, pipeline: int, num_pipelines: int, num_microbatches: int
    ) -> list[list[int]]:
        """The M micro-batches of pipeline d of D: global micro-batches ``d*M + m``.

        The global batch must equal D * M * b for a whole micro-batch size b, so that changing
        D (with M or b adjusted) still covers the same samples exactly once.
        """
        if num_pipelines < 1 or num_microbatches < 1:
            raise ValueError(
                f"num_pipelines ({num_pipelines}) and num_microbatches ({num_microbatches}) "
                "must be >= 1"
            )
        if not 0 <= pipeline < num_pipelines:
            raise ValueError(f"pipeline {pipeline} is out of range for {num_pipelines} pipelines")
        parts = num_pipelines * num_microbatches
        if self.global_batch % parts:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by {num_pipelines} pipelines "
                f"x {num_microbatches} micro-batches"
            )
        b = self.global_batch // parts
        batch = self.indices(iteration)
        first = pipeline * num_microbatches
        return [batch[(first + m) * b : (first + m + 1) * b] for m in range(num_microbatches)]
