"""`spotpipe plot DIR`: a run as a picture (loss, throughput, live nodes; cluster events marked).

Reads only the run's output files, so it works on a finished, failed or still running job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spotpipe.runfiles import read_jsonl

MARKED = {"node_lost": ("tab:red", "lost"), "node_fenced": ("tab:red", "fenced"),
          "notice": ("tab:orange", "notice"), "takeover": ("tab:green", "takeover"),
          "resumed": ("tab:blue", "resumed"), "job_failed": ("black", "failed")}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw a run (loss, throughput, live nodes, events) as PNG")
    p.add_argument("run", help="a run's output folder (with metrics.jsonl and events.jsonl)")
    p.add_argument("--out", help="PNG file to write (default RUN/run.png)")
    p.set_defaults(func=run)


_read = read_jsonl


def plot_run(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _read(run_dir / "metrics.jsonl")
    events = _read(run_dir / "events.jsonl")
    if not metrics:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no iterations recorded yet")
    t = [m["time_s"] for m in metrics]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    axes[0].plot(t, [m["loss"] for m in metrics], color="tab:purple")
    axes[0].set_ylabel("loss")
    axes[1].plot(t, [m["samples_per_s"] for m in metrics], color="tab:gray", lw=0.8)
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
    summary = run_dir / "summary.json"
    title = run_dir.name
    if summary.exists():
        s = json.loads(summary.read_text())
        title += (f": {s.get('status')}, {s.get('iterations')} iterations, "
                  f"P={s.get('stages')} D={s.get('pipelines')}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    for name in ("metrics.jsonl", "events.jsonl"):
        if not (run_dir / name).is_file():
            print(f"spotpipe: error: {run_dir / name}: not found (is {run_dir} a run folder?)",
                  file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else run_dir / "run.png"
    try:
        plot_run(run_dir, out)
    except ValueError as exc:
        print(f"spotpipe: error: {exc}", file=sys.stderr)
        return 2
    print(f"spotpipe: wrote {out}")
    return 0
