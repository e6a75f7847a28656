"""Seconds per optimizer step on this machine's CPU for GPT-2 small's parameter shapes (124M):
torch's fused and per-tensor AdamW against spotpipe's portable kernel, which CPU shadows and
CPU replicas of GPU stages use (`optimizer.kernel`). Median of 5 steps after one warm-up, the
kernels alternating twice. Usage: python scripts/optimizer-step-cost.py"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from spotpipe.runtime.optim import PortableAdamW

BLOCK = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
         (768, 3072), (3072,), (3072, 768), (768,)]
SHAPES = [(50257, 768), (1024, 768)] + BLOCK * 12 + [(768,), (768,)]
KW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KERNELS = {"fused": lambda ps: torch.optim.AdamW(ps, fused=True, **KW),
           "per_tensor": lambda ps: torch.optim.AdamW(ps, foreach=False, **KW),
           "portable": lambda ps: PortableAdamW(ps, **KW)}


def step_seconds(make) -> float:
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = make(params)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    load = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name in KERNELS}
    for _ in range(2):
        for name, make in KERNELS.items():
            runs[name].append(round(step_seconds(make), 4))
    figures = {"params": sum(torch.Size(s).numel() for s in SHAPES),
               "threads": torch.get_num_threads(),
               "step_s": {name: round(statistics.median(v), 4) for name, v in runs.items()},
               "runs": runs,
               "portable_over_fused": round(statistics.median(runs["portable"])
                                            / statistics.median(runs["fused"]), 2),
               "load_average_before_after": [round(load, 2), round(os.getloadavg()[0], 2)]}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
