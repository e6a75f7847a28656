"""Bad input to the simulator's commands (`spotpipe simulate`, `spotpipe plot`, the trace
replay of `spotpipe train --trace`, `python -m spotpipe.sim.validate`): a message naming the
file, line or key, exit code 2, nothing written, no hang. All in-process and quick."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from spotpipe.cli import simulate as cli


def simulate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spotpipe")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate"] + argv)
    return args.func(args)


def write(path: Path, text: str | bytes) -> Path:
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# -- traces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("data,line,words", [
    ('{"metadata": {"gap_seconds": 1e400},\n "data": [2, 1, 2]}', 1, "gap_seconds"),
    ('{"metadata": {"gap_seconds": 60},\n "data": [2,\n 1e400]}', 3, "data[1]"),
    ('{"metadata": {"gap_seconds": 60},\n "data": [1e15, 0]}', 2, "more than"),
    ('{"metadata": {"gap_seconds": 60}, "data": []}', 1, "no data"),
    ("delta_ms,kind,node\n", 1, "no data"),
])
def test_simulate_refuses_a_bad_trace_before_simulating(tmp_path, capsys, data, line, words):
    trace = write(tmp_path / ("t.json" if data.startswith("{") else "t.csv"), data)
    plots = tmp_path / "plots"
    assert simulate(["--trace", str(trace), "--policy", "spotpipe", "--plot", str(plots)]) == 2
    captured = capsys.readouterr()
    assert f"{trace}:{line}:" in captured.err and words in captured.err
    assert captured.out == "" and not plots.exists()


def test_train_refuses_a_trace_count_beyond_a_float(tmp_path, capsys, monkeypatch, corpus):
    from spotpipe.cli.main import main

    monkeypatch.setenv("RES_OPTIONS", os.environ.get("RES_OPTIONS", ""))  # main() sets it
    config = write(tmp_path / "job.yaml", "model: {kind: gpt, gpt: {block_size: 16, n_layer: "
                   f"2, n_head: 2, n_embd: 32}}}}\ndata: {{kind: text, path: {corpus}}}\n"
                   "micro_batch_size: 2\nnum_microbatches: 2\niterations: 2\n")
    trace = write(tmp_path / "t.json", '{"metadata": {"gap_seconds": 60},\n "data": [2,\n 1e400]}')
    out = tmp_path / "out"
    assert main(["train", str(config), "--out", str(out), "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3: data[1]" in err and "Traceback" not in err
    assert not out.exists()
