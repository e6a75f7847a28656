"""PNG plots (matplotlib, Agg backend: no display needed on a server or in CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from spotpipe.sim.simulator import Result  # noqa: E402


def plot_run(results: list[Result], out_dir: str | Path, trace_name: str = "") -> Path:
    """Instances, throughput and cumulative cost over time, one line per policy."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for r in results:
        if not r.timeline:
            continue
        hours = [p.time_s / 3600.0 for p in r.timeline]
        axes[0].step(hours, [p.used for p in r.timeline], where="post", label=f"{r.policy} used")
        axes[1].step(hours, [p.throughput for p in r.timeline], where="post", label=r.policy)
        axes[2].plot(hours, [p.dollars for p in r.timeline], label=r.policy)
    first = next((r for r in results if r.timeline and r.policy != "on_demand"), None)
    if first is not None:
        axes[0].step([p.time_s / 3600.0 for p in first.timeline],
                     [p.available for p in first.timeline], where="post", color="black",
                     linestyle=":", label="available")
    axes[0].set_ylabel("instances")
    axes[1].set_ylabel("samples/s")
    axes[2].set_ylabel("cumulative $")
    axes[2].set_xlabel("hours")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"spotpipe simulate {trace_name}".strip())
    path = out / "run.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(sweep: dict[str, Any], out_dir: str | Path) -> Path:
    """Mean samples per dollar against hourly preemption rate, one line per policy."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = dict.fromkeys(r["policy"] for r in sweep["rows"])
    for name in policies:
        rows = [r for r in sweep["rows"] if r["policy"] == name]
        ax.plot([r["rate"] for r in rows], [r["value"] for r in rows], marker="o", label=name)
    ax.set_xlabel("hourly preemption probability")
    ax.set_ylabel("samples per $")
    ax.set_title(f"value vs preemption rate ({sweep['seeds']} seeds, {sweep['hours']} h runs)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "value_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
