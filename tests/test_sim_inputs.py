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


# -- profile, prices and calibration files ----------------------------------------------------

PROFILE = {"forward_s": [0.1, 0.1], "backward_s": [0.2, 0.2], "micro_batch_size": 4,
           "global_microbatches": 8}


@pytest.mark.parametrize("change,words", [
    ({"forward_s": [float("nan"), 0.1]}, "forward_s[0] must be a finite number > 0 seconds"),
    ({"forward_s": [0, 0], "backward_s": [0, 0]}, "forward_s[0] must be a finite number > 0"),
    ({"backward_s": [0.2, 0]}, "backward_s[1]"),
    ({"backward_s": [0.2, 1e400]}, "backward_s[1]"),
    ({"network_bytes_s": -5}, "network_bytes_s must be a finite number > 0 bytes/s"),
    ({"network_bytes_s": 0}, "network_bytes_s"),
    ({"param_bytes": [-1e9, -1e9]}, "param_bytes[0] must be a finite number >= 0 bytes"),
    ({"activation_bytes": float("nan")}, "activation_bytes"),
    ({"micro_batch_size": 1e400}, "micro_batch_size must be a whole number >= 1"),
    ({"global_microbatches": 2.5}, "global_microbatches"),
    ({"forward_s": []}, "forward_s must be a non-empty list"),
    ({"forward_s": [0.1]}, "forward_s and backward_s must be equally long"),
])
def test_a_bad_profile_names_the_file_and_key(tmp_path, capsys, change, words):
    prof = write(tmp_path / "prof.json", json.dumps({**PROFILE, **change}))
    assert simulate(["--model", str(prof), "--stages", "2", "--pipelines", "1",
                     "--synthetic", "fixed", "--hours", "1", "--policy", "spotpipe"]) == 2
    err = capsys.readouterr().err
    assert f"{prof}: {words}" in err, err


def test_a_good_profile_still_simulates(tmp_path, capsys):
    prof = write(tmp_path / "prof.json", json.dumps({**PROFILE, "network_bytes_s": 1e9}))
    assert simulate(["--model", str(prof), "--stages", "2", "--pipelines", "1",
                     "--synthetic", "fixed", "--hours", "1", "--policy", "spotpipe"]) == 0


@pytest.mark.parametrize("prices,words", [
    ('{"instances": {"p3.2xlarge": {"spot": NaN, "on_demand": 3.06}}}',
     "instances.p3.2xlarge.spot must be a finite price > 0 $/h, got nan"),
    ('{"instances": {"p3.2xlarge": {"spot": 0.9, "on_demand": 1e400}}}',
     "instances.p3.2xlarge.on_demand"),
    ('{"instances": {"p3.2xlarge": {"spot": -1, "on_demand": 3}}}',
     "instances.p3.2xlarge.spot must be"),
    # free: samples per dollar is undefined (reported as 0, so --advise ranked the spot
    # configurations that cost nothing below every paid one)
    ('{"instances": {"p3.2xlarge": {"spot": 0, "on_demand": 3}}}',
     "instances.p3.2xlarge.spot must be a finite price > 0 $/h, got 0.0"),
])
def test_a_bad_price_names_the_file_and_key(tmp_path, capsys, prices, words):
    path = write(tmp_path / "prices.json", prices)
    assert simulate(["--prices", str(path), "--synthetic", "fixed", "--hours", "1"]) == 2
    assert f"{path}: {words}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prices", "--calibrate", "--model"])
def test_a_file_that_is_not_text_is_named(tmp_path, capsys, flag):
    path = write(tmp_path / "input.json", b'{"a": "\xff\xfe"}')
    assert simulate([flag, str(path), "--synthetic", "fixed", "--hours", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: cannot read" in err and "not a text file" in err


# -- simulate's outputs and synthetic traces --------------------------------------------------

@pytest.mark.parametrize("extra", [
    ["--synthetic", "fixed", "--hours", "1", "--policy", "spotpipe"],
    ["--table", "--seeds", "1", "--processes", "1", "--rates", "0.1", "--hours", "1"],
])
def test_plot_under_a_file_is_refused_before_simulating(tmp_path, capsys, extra):
    afile = write(tmp_path / "afile", "hi\n")
    assert simulate(extra + ["--plot", str(afile / "sub" / "deeper")]) == 2
    captured = capsys.readouterr()
    assert f"--plot {afile}/sub/deeper: {afile} is a file, not a directory" in captured.err
    assert captured.out == ""  # refused before anything was simulated
    assert afile.read_text() == "hi\n"


def test_plot_into_a_new_nested_folder(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert simulate(["--synthetic", "fixed", "--hours", "1", "--policy", "spotpipe",
                     "--plot", str(out)]) == 0
    assert (out / "run.png").is_file()


@pytest.mark.parametrize("argv,words", [
    (["--synthetic", "fixed", "--interval", "1e-9", "--hours", "1"], "--interval 1e-09"),
    (["--synthetic", "fixed", "--interval", "0.001", "--hours", "1"], "longer interval"),
    (["--synthetic", "poisson", "--rate", "1e12", "--hours", "1"], "--rate 1e+12"),
    (["--synthetic", "bamboo", "--rate", "0.1", "--hours", "1e9"], "--hours 1e+09"),
    (["--table", "--seeds", "1", "--processes", "1", "--hours", "1e9"], "--hours 1e+09"),
    (["--synthetic", "fixed", "--nodes", "1000000000"], "1000000000 nodes: more than the 100000"),
])
def test_a_synthetic_trace_too_big_to_generate_is_refused_at_once(tmp_path, capsys, argv,
                                                                  words):
    # (each would take hours or run out of memory: refused from the arithmetic alone)
    plots = tmp_path / "plots"
    assert simulate(argv + ["--policy", "spotpipe", "--plot", str(plots)]) == 2
    err = capsys.readouterr().err
    assert words in err and ("more than the 1000000 a synthetic trace may take" in err
                             or "a trace may offer" in err), err
    assert not plots.exists()


def test_the_synthetic_bound_is_on_the_steps_taken(monkeypatch):
    from spotpipe.sim import synthetic

    monkeypatch.setattr(synthetic, "MAX_STEPS", 1000)
    assert synthetic.fixed_interval_trace(3.6, 1.0, 8).duration_s == 3600.0  # 1000 steps
    with pytest.raises(ValueError, match="every 3.59 s for 1 h makes preemptions: 1e"):
        synthetic.fixed_interval_trace(3.59, 1.0, 8)
    assert synthetic.bamboo_trace(0.1, 10, 100, 0).duration_s == 36000.0
    with pytest.raises(ValueError, match="100 nodes for 10.5 h are node-hours to draw: 1.1e"):
        synthetic.bamboo_trace(0.1, 10.5, 100, 0)


# -- spotpipe plot ----------------------------------------------------------------------------

METRIC = {"iter": 0, "loss": 5.5, "samples": 32, "time_s": 1.0, "samples_per_s": 73.7,
          "live_nodes": 2, "carriers": 0}
EVENT = {"time_s": 0.5, "kind": "node_lost", "node": "node1"}


def plot(argv: list[str]) -> int:
    from spotpipe.cli import plot as plot_cli

    parser = argparse.ArgumentParser(prog="spotpipe")
    plot_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plot"] + argv)
    return args.func(args)


def run_folder(tmp_path: Path, metrics: list | bytes = (METRIC,), events: list = (EVENT,),
               summary: str | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write(run / "metrics.jsonl", metrics if isinstance(metrics, bytes)
          else "".join(json.dumps(m) + "\n" for m in metrics))
    write(run / "events.jsonl", "".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        write(run / "summary.json", summary)
    return run


@pytest.mark.parametrize("files,where,words", [
    ({"metrics": [METRIC, {"iter": 0}]}, "metrics.jsonl:2", "the record has no 'time_s'"),
    ({"metrics": [[1, 2]]}, "metrics.jsonl:1", "expected a JSON object, got [1, 2]"),
    ({"metrics": [{**METRIC, "live_nodes": "two"}]}, "metrics.jsonl:1",
     'live_nodes must be a number, got "two"'),
    ({"events": [{"kind": "node_lost"}]}, "events.jsonl:1", "the record has no 'time_s'"),
    ({"metrics": b'\xff\xfe\n'}, "metrics.jsonl", "cannot read: not a text file"),
    ({"summary": "{bad"}, "summary.json:1", "invalid JSON"),
    ({"summary": "[1]"}, "summary.json", "expected a JSON object"),
])
def test_plot_names_the_file_line_and_key_of_a_bad_record(tmp_path, capsys, files, where,
                                                          words):
    run = run_folder(tmp_path, **files)
    assert plot([str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run}/{where}: {words}" in err, err
    assert not (run / "run.png").exists()


def test_plot_draws_a_run_with_a_non_finite_loss(tmp_path, capsys):
    run = run_folder(tmp_path, [METRIC, {**METRIC, "time_s": 2.0, "loss": None}],
                     summary='{"status": "completed", "iterations": 2}')
    assert plot([str(run)]) == 0
    assert (run / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_a_run_whose_last_line_was_cut_short(tmp_path, capsys):
    """A run killed mid-write (or a full disk) leaves a last line without its end, and a
    running job's last line can be read half written: the plot refused the whole run
    ("metrics.jsonl:3: invalid JSON"). That line is left out; a broken line that ended, or
    one before the last, is still named."""
    whole = "".join(json.dumps({**METRIC, "iter": t, "time_s": 1.0 + t}) + "\n" for t in (0, 1))
    cut = json.dumps({**METRIC, "iter": 2, "time_s": 3.0})[:40]
    run = run_folder(tmp_path, (whole + cut).encode())
    events = run / "events.jsonl"
    write(events, events.read_text() + json.dumps(EVENT)[:20])
    assert plot([str(run)]) == 0, capsys.readouterr().err
    assert (run / "run.png").read_bytes()[:4] == b"\x89PNG"
    write(run / "metrics.jsonl", whole + cut + "\n")
    assert plot([str(run)]) == 2
    assert f"{run}/metrics.jsonl:3: invalid JSON" in capsys.readouterr().err
    write(run / "metrics.jsonl", cut + "\n" + whole)
    assert plot([str(run)]) == 2
    assert f"{run}/metrics.jsonl:1: invalid JSON" in capsys.readouterr().err


def test_plot_throughput_drops_over_a_pause(tmp_path, capsys, monkeypatch):
    """A line's samples_per_s is its iteration's own rate, the pause before it left out (and
    after a takeover that replays the rest of an iteration, the rest's alone): a failover or
    a 5 s hang drew no dip at all. The plot draws what the run did between its lines."""
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: drawn.append(real(*a, **k))
                        or drawn[-1])
    # 8 samples an iteration, every 0.1 s, then 2.0 s between iterations 2 and 3 (a pause);
    # each line says 80 samples/s, or 160 for the rest of iteration 3 after the takeover
    times = [1.0, 1.1, 1.2, 3.2, 3.3]
    run = run_folder(tmp_path, [{**METRIC, "iter": t, "samples": 8 * (t + 1), "time_s": at,
                                 "samples_per_s": 160.0 if t == 3 else 80.0}
                                for t, at in enumerate(times)])
    assert plot([str(run)]) == 0, capsys.readouterr().err
    fig, axes = drawn[0]
    assert list(axes[1].lines[0].get_ydata()) == pytest.approx([80.0, 80.0, 80.0, 4.0, 80.0])


def test_plot_out_as_a_folder_or_a_png_or_neither(tmp_path, capsys):
    run = run_folder(tmp_path)
    folder = tmp_path / "pictures"
    folder.mkdir()
    assert plot([str(run), "--out", str(folder)]) == 0  # into the folder, as --help says
    assert f"wrote {folder / 'run.png'}" in capsys.readouterr().out
    assert (folder / "run.png").is_file() and not (tmp_path / "pictures.png").exists()
    assert plot([str(run), "--out", str(tmp_path / "new" / "x.png")]) == 0
    assert (tmp_path / "new" / "x.png").is_file()
    assert plot([str(run), "--out", str(tmp_path / "nothing")]) == 2
    assert "neither a folder nor a .png file name" in capsys.readouterr().err
    assert not list(tmp_path.glob("nothing*"))


def test_plot_out_under_a_file_is_refused(tmp_path, capsys):
    run = run_folder(tmp_path)
    afile = write(tmp_path / "afile", "hi\n")
    assert plot([str(run), "--out", str(afile / "x.png")]) == 2
    assert f"--out {afile}/x.png: {afile} is a file, not a folder" in capsys.readouterr().err
    assert afile.read_text() == "hi\n"


# -- python -m spotpipe.sim.validate ----------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--time-scale", "nan"], "--time-scale: expected a finite number above 0, got 'nan'"),
    (["--time-scale", "0"], "--time-scale: expected a finite number above 0, got '0'"),
    (["--time-scale", "inf"], "--time-scale"),
    (["--calibration-repeats", "0"], "--calibration-repeats: expected a whole number >= 1"),
    (["--calibration-repeats", "two"], "--calibration-repeats: expected a whole number"),
])
def test_validate_refuses_bad_flags_before_writing(tmp_path, capsys, argv, words):
    from spotpipe.sim.validate import main

    work = tmp_path / "work"
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--work", str(work)])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert not work.exists()


@pytest.mark.parametrize("kw,words", [
    ({"time_scale": float("nan")}, "time_scale"),
    ({"calibration_repeats": 0}, "calibration_repeats"),
])
def test_validate_checks_its_arguments_before_writing(tmp_path, kw, words):
    from spotpipe.sim.validate import validate

    with pytest.raises(ValueError, match=words):
        validate(tmp_path / "work", **kw)
    assert not (tmp_path / "work").exists()
