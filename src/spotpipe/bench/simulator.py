"""`spotpipe bench simulator`: the simulator's speed and its headline figures."""

from __future__ import annotations

from typing import Any


def run(quick: bool = False) -> dict[str, Any]:
    from spotpipe.sim.bench import bench_simulator

    return bench_simulator(seeds=500 if quick else 10_000, replay=not quick)
