"""`spotpipe plot DIR`: a run as a picture (loss, throughput, live nodes; cluster events marked).

Reads only the run's output files, so it works on a finished, failed or still running job.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from spotpipe.runfiles import read_json, read_jsonl, run_status

MARKED = {"node_lost": ("tab:red", "lost"), "node_fenced": ("tab:red", "fenced"),
          "notice": ("tab:orange", "notice"), "takeover": ("tab:green", "takeover"),
          "resumed": ("tab:blue", "resumed"), "job_failed": ("black", "failed")}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw a run (loss, throughput, live nodes, events) as PNG")
    p.add_argument("run", help="a run's output folder (with metrics.jsonl and events.jsonl)")
    p.add_argument("--out", help="a .png file to write, or a folder to write run.png into "
                   "(default RUN/run.png); missing folders are made")
    p.set_defaults(func=run)


def _read(path: Path, require: dict[str, str]) -> list[dict[str, Any]]:
    """A run file's records; its last line may be unfinished (a running job's, or a killed
    one's) and is then left out."""
    return read_jsonl(path, require, partial_tail=True)


# what the plot reads of each record (a non-finite loss is recorded as null)
METRIC_KEYS = {"time_s": "number", "loss": "number or null", "samples_per_s": "number",
               "live_nodes": "number"}
EVENT_KEYS = {"time_s": "number", "kind": "string"}


def plot_run(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _read(run_dir / "metrics.jsonl", METRIC_KEYS)
    events = _read(run_dir / "events.jsonl", EVENT_KEYS)
    if not metrics:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no iterations recorded yet")
    title = _title(run_dir)
    t = [m["time_s"] for m in metrics]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    axes[0].plot(t, [math.nan if m["loss"] is None else m["loss"] for m in metrics],
                 color="tab:purple")
    axes[0].set_ylabel("loss")
    axes[1].plot(t, _throughput(metrics), color="tab:gray", lw=0.8)
    axes[1].set_ylabel("samples/s")
    axes[2].step(t, [m["live_nodes"] for m in metrics], where="post", color="tab:green",
                 label="live nodes")
    if any("carriers" in m for m in metrics):
        axes[2].step(t, [m.get("carriers", 0) for m in metrics], where="post",
                     color="tab:orange", label="nodes carrying two stages")
    axes[2].set_ylabel("nodes")
    axes[2].set_xlabel("time since launch (s)")
    axes[2].legend(loc="lower left", fontsize=8)
    labelled = set()
    for ev in events:
        if ev["kind"] not in MARKED:
            continue
        color, label = MARKED[ev["kind"]]
        for ax in axes:
            ax.axvline(ev["time_s"], color=color, lw=0.8, ls="--",
                       label=None if (label in labelled or ax is not axes[0]) else label)
        labelled.add(label)
        axes[0].annotate(ev.get("node", ""), (ev["time_s"], 1), xycoords=("data", "axes fraction"),
                         fontsize=7, rotation=90, va="top", color=color)
    if labelled:
        axes[0].legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as exc:
        plt.close(fig)
        raise ValueError(f"{out}: cannot write: {exc.strerror or exc}") from None
    plt.close(fig)
    return out


def _throughput(metrics: list[dict[str, Any]]) -> list[float]:
    """Samples per second of run time between each line and the one before. A line's own
    `samples_per_s` is its iteration's rate alone: the pause before a resumed iteration is
    not in it, nor, after a takeover, the part of the iteration done before the loss; drawn
    as they are, a failover's or a hang's pause showed no dip. The first line (startup before
    it), and one without `iter` and `samples` (a global batch), keep their own rate."""
    out = [float(metrics[0]["samples_per_s"])]
    for before, m in zip(metrics, metrics[1:]):
        took = m["time_s"] - before["time_s"]
        if took > 0 and isinstance(m.get("iter"), int) and isinstance(m.get("samples"), int):
            out.append(m["samples"] / (m["iter"] + 1) / took)
        else:
            out.append(float(m["samples_per_s"]))
    return out


def _title(run_dir: Path) -> str:
    """The run's name, with its status from summary.json when there is one."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return run_dir.name
    s = read_json(summary)
    if not isinstance(s, dict):
        raise ValueError(f"{summary}: expected a JSON object")
    return (f"{run_dir.name}: {run_status(s)}, {s.get('iterations')} iterations, "
            f"P={s.get('stages')} D={s.get('pipelines')}")


def _out_path(run_dir: Path, out: str | None) -> Path:
    """Where the PNG goes: --out as a .png file, or run.png in the folder --out names; the
    folders above it must be folders (missing ones are made when it is written)."""
    if out is None:
        return run_dir / "run.png"
    path = Path(out)
    if path.is_dir():
        path = path / "run.png"
    elif path.suffix.lower() != ".png":
        raise ValueError(f"--out {out}: neither a folder nor a .png file name")
    existing = next(p for p in path.absolute().parents if os.path.exists(p))
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a folder")
    return path


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    for name in ("metrics.jsonl", "events.jsonl"):
        if not (run_dir / name).is_file():
            print(f"spotpipe: error: {run_dir / name}: not found (is {run_dir} a run folder?)",
                  file=sys.stderr)
            return 2
    try:
        out = _out_path(run_dir, args.out)
        plot_run(run_dir, out)
    except ValueError as exc:
        print(f"spotpipe: error: {exc}", file=sys.stderr)
        return 2
    print(f"spotpipe: wrote {out}")
    return 0
