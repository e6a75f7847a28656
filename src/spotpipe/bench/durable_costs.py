"""What making the durable tier safe costs: the fsyncs, the MAC, and the commit's checks.

One stage of the benchmark GPT (`bench pipeline`'s model, half of its layers, AdamW state
materialised) is written with `durable.save_stage` as a synchronous checkpoint, `repeats`
times with fsync (the default) and as many without (what the tier did before: data left in
the page cache when the manifest is renamed), alternating, so that drift in the machine's
load falls on both alike. The figures are medians in seconds per checkpoint of one stage:

- `durable_blocked_s_per_checkpoint`: the training loop's wait for one stage's write, fsynced;
- `durable_blocked_s_per_checkpoint_nofsync`: the same write without any fsync;
- `durable_fsync_s_per_checkpoint`: the difference (what the fsyncs add to the wait);
- `durable_mac_s_per_checkpoint`: signing the manifest (HMAC-SHA256 of its JSON);
- `durable_commit_s_per_checkpoint`: the launcher's whole commit (manifest written and
  fsynced, renames, and the retention's verification of every kept checkpoint: on the
  launcher, not on training's path).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _stage() -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    from spotpipe import job
    from spotpipe.bench.pipeline import MODEL
    from spotpipe.checkpoint import durable
    from spotpipe.config import from_dict
    from spotpipe.runtime import node as nodelib
    from spotpipe.runtime.optim import materialise_optimizer_state

    cfg = from_dict({"model": {"gpt": dict(MODEL)}, "data": {"path": "unused"}, "stages": 2})
    model = job.build_model(cfg)
    n = len(model.layers)
    partition = [(0, n // 2), (n // 2, n)]
    state = nodelib.build_stage_state(model, partition, 0, cfg, torch.device("cpu"))
    materialise_optimizer_state(state.module, state.optimizer)
    nbytes = sum(t.numel() * t.element_size()
                 for t in durable.stage_tensors(state.module, state.optimizer).values())
    return state.module, state.optimizer, nbytes


def run(repeats: int = 5) -> dict[str, Any]:
    from spotpipe.checkpoint import durable, origin

    module, optimizer, nbytes = _stage()
    key = b"k" * 32
    synced, unsynced, macs, commits = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-durable-") as tmp:
        root = Path(tmp)
        for i in range(repeats):
            for sync in (True, False) if i % 2 == 0 else (False, True):
                started = time.perf_counter()
                sums = durable.save_stage(root, i, 0, module, optimizer, sync=sync)
                (synced if sync else unsynced).append(time.perf_counter() - started)
            manifest = {"format_version": durable.FORMAT_VERSION, "iteration": i,
                        "partition": [[0, 1]], "checksums": sums}
            started = time.perf_counter()
            origin.sign(manifest, key)
            macs.append(time.perf_counter() - started)
            started = time.perf_counter()
            durable.commit(root, i, {"partition": [[0, 1]]}, sums, keep=2, key=key)
            commits.append(time.perf_counter() - started)
    save, nosync = statistics.median(synced), statistics.median(unsynced)
    return {"durable_blocked_s_per_checkpoint": round(save, 5),
            "durable_blocked_s_per_checkpoint_nofsync": round(nosync, 5),
            "durable_fsync_s_per_checkpoint": round(save - nosync, 5),
            "durable_mac_s_per_checkpoint": round(statistics.median(macs), 7),
            "durable_commit_s_per_checkpoint": round(statistics.median(commits), 5),
            "durable_stage_bytes": nbytes, "durable_repeats": repeats}
