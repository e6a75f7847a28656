"""Trace loaders: the shared real traces load; malformed ones are rejected naming file+line."""

from pathlib import Path

import pytest

from spotpipe.sim.synthetic import (bamboo_trace, fixed_interval_trace, poisson_trace,
                                    simple_trace)
from spotpipe.sim.traces import ADD, REMOVE, TraceError, find_trace, load_trace



@pytest.mark.parametrize("name,events,adds,removes,peak", [
    ("bamboo-p3.csv", 344, 177, 167, 32),
    ("bamboo-g4dn.csv", 153, 79, 74, 24),
])
def test_shared_traces_load(name, events, adds, removes, peak):
    tr = load_trace(name)
    assert len(tr) == events
    assert sum(e.kind == ADD for e in tr.events) == adds
    assert tr.removals == removes
    assert tr.peak_nodes == peak
    times = [e.time_s for e in tr.events]
    assert times == sorted(times)
    # the step function agrees with replaying the events
    for t in (0.0, 3600.0, 5 * 3600.0 + 17, tr.duration_s):
        assert tr.nodes_available_at(t) == len(tr.nodes_at(t))


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,line,words", [
    ("0,add,a\n1000,remove,b\n", 2, "not present"),
    ("0,add,a\nabc,add,b\n", 2, "bad number"),
    ("0,add,a\n10,launch,b\n", 2, "bad kind"),
    ("0,add,a\n2000,add,b\n1000,remove,a\n", 3, "backwards"),
    ("0,add,a\n0,add,a\n", 2, "already present"),
    ("0,add\n", 1, "3 fields"),
    ("0,add,a\n-5,add,b\n", 2, "non-negative"),
])
def test_event_csv_errors_name_file_and_line(tmp_path, text, line, words):
    assert_rejected(write(tmp_path, "bad.csv", text), line, words)


def assert_rejected(path: Path, line: int, words: str) -> None:
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert str(path) in msg and f":{line}:" in msg and words in msg
    assert err.value.line == line


def test_tick_json(tmp_path):
    p = write(tmp_path, "ticks.json", '{"metadata": {"gap_seconds": 60},\n "data": [2, 3, 1, 1, 4]}')
    tr = load_trace(p)
    assert [tr.nodes_available_at(60 * i) for i in range(5)] == [2, 3, 1, 1, 4]
    assert tr.duration_s == 300
    assert tr.removals == 2


@pytest.mark.parametrize("text,line,words", [
    ('{"metadata": {"gap_seconds": 60},\n "data": [2,\n 3,\n -1]}', 4, "data[2]"),
    ('{"metadata": {"gap_seconds": 0}, "data": [1]}', 1, "gap_seconds"),
    ('{"metadata": {"gap_seconds": 5},\n "data": [1, }', 2, "invalid JSON"),
])
def test_tick_json_errors(tmp_path, text, line, words):
    assert_rejected(write(tmp_path, "bad.json", text), line, words)


def test_dated_series(tmp_path):
    p = write(tmp_path, "gcp.txt", "2021-03-01, 10:00:00, 4\n2021-03-01, 10:05:00, 2\n"
                                   "2021-03-01, 11:00:00, 5\n")
    tr = load_trace(p, victims="oldest")
    assert tr.nodes_available_at(0) == 4
    assert tr.nodes_available_at(300) == 2
    assert tr.nodes_available_at(3600) == 5
    assert tr.nodes_at(300) == {"n2", "n3"}  # oldest leave first
    assert tr.victims == "oldest"
    assert load_trace(p, victims="newest").nodes_at(300) == {"n0", "n1"}


def test_dated_series_with_bamboo_padding_spans_to_the_last_line(tmp_path):
    # as Bamboo publishes them: each reading repeated 1 and 2 minutes later, the repeats
    # running past the next reading (which is earlier than them)
    p = write(tmp_path, "gcp.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:08:45, 80\n"
                                   "2021-12-10, 13:09:45, 80\n2021-12-10, 13:08:45, 70\n"
                                   "2021-12-10, 13:09:45, 70\n2021-12-10, 13:10:45, 70\n")
    tr = load_trace(p)
    assert tr.nodes_available_at(0) == 80 and tr.nodes_available_at(59) == 80
    assert tr.nodes_available_at(60) == 70 and tr.nodes_available_at(179) == 70
    assert tr.duration_s == 180  # to the last line, not to the last change (60 s)
    assert tr.removals == 10


def test_bamboo_gcp_trace_as_published_loads():
    tr = load_trace(Path(__file__).parent / "fixtures" / "traces" /
                    "bamboo-gcp-v100x1-east1c.txt")
    # its 1477 lines: 2021-12-10 13:07:45 to 2021-12-11 13:17:58, at most 80 V100s
    assert tr.duration_s == 24 * 3600 + 10 * 60 + 13
    assert tr.peak_nodes == 80 and tr.nodes_available_at(0) == 80
    assert tr.nodes_available_at(tr.duration_s) == 80
    times = [e.time_s for e in tr.events]
    assert times == sorted(times)


def test_count_series_victims_random_is_seeded():
    text = "".join(f"2021-03-01, 10:{m:02d}:00, {n}\n" for m, n in
                   enumerate([12, 9, 11, 6, 10, 3, 8]))
    from spotpipe.sim.traces import parse_dated_series
    a, b = parse_dated_series(text, "x", "random", 1), parse_dated_series(text, "x", "random", 1)
    c = parse_dated_series(text, "x", "random", 2)
    assert a.events == b.events and a.events != c.events
    assert a.victims == "random(seed=1)"
    for tr in (a, c):  # the counts are the series' whatever the victims
        assert [tr.nodes_available_at(60 * i) for i in range(7)] == [12, 9, 11, 6, 10, 3, 8]
    oldest = parse_dated_series(text, "x", "oldest")
    assert a.events != oldest.events
    with pytest.raises(ValueError, match="victims"):
        load_trace("whatever.txt", victims="youngest")


@pytest.mark.parametrize("name,text,line", [
    ("t.csv", "0,add,a\nNaN,add,b\n", 2),
    ("t.csv", "0,add,a\ninf,add,b\n", 2),
    ("t.json", '{"metadata": {"gap_seconds": 60},\n "data": [2,\n NaN]}', 3),
    ("t.json", '{"metadata": {"gap_seconds": Infinity},\n "data": [2]}', 1),
    ("t.txt", "2021-03-01, 10:00:00, 4\n2021-03-01, 10:05:00, nan\n", 2),
])
def test_non_finite_numbers_are_refused_naming_the_line(tmp_path, name, text, line):
    with pytest.raises(TraceError) as err:
        load_trace(write(tmp_path, name, text))
    assert f":{line}:" in str(err.value) and err.value.line == line

@pytest.mark.parametrize("name,text,line,words", [
    # json reads a number beyond a float's range as inf, with no NaN/Infinity to see
    ("t.json", '{"metadata": {"gap_seconds": 1e400},\n "data": [2, 1, 2]}', 1, "gap_seconds"),
    ("t.json", '{"metadata": {"gap_seconds": 60},\n "data": [2,\n 1e400]}', 3, "data[1]"),
    ("t.json", '{"metadata": {"gap_seconds": -1e400}, "data": [2]}', 1, "gap_seconds"),
    # a finite gap whose span of time is not (2 x 1e308 s)
    ("t.json", '{"metadata": {"gap_seconds": 1e308},\n "data": [2, 1, 2]}', 1, "finite span"),
    ("t.txt", "2021-03-01, 10:00:00, 4\n2021-03-01, 10:05:00, 1e400\n", 2, "instance count"),
    ("t.csv", "0,add,a\n1e400,remove,a\n", 2, "delta_ms"),
])
def test_numbers_beyond_a_float_are_refused_naming_the_line(tmp_path, name, text, line, words):
    assert_rejected(write(tmp_path, name, text), line, words)


@pytest.mark.parametrize("name,text,line,words", [
    ("t.json", '{"metadata": {"gap_seconds": 60},\n "data": [1e15, 0]}', 2, "data[0]"),
    ("t.json", '{"metadata": {"gap_seconds": 60}, "data": [2, 100001]}', 1, "100000"),
    ("t.txt", "2021-03-01, 10:00:00, 4\n2021-03-01, 10:05:00, 1e15\n", 2, "more than"),
])
def test_node_counts_are_bounded(tmp_path, name, text, line, words):
    # (1e15 nodes would be made one by one: refused at once instead)
    assert_rejected(write(tmp_path, name, text), line, words)


def test_the_largest_count_loads(tmp_path):
    from spotpipe.sim.traces import MAX_NODES

    tr = load_trace(write(tmp_path, "t.json", '{"metadata": {"gap_seconds": 60}, '
                                              f"\"data\": [{MAX_NODES}]}}"))
    assert tr.peak_nodes == MAX_NODES


@pytest.mark.parametrize("name,text", [
    ("t.csv", ""),
    ("t.csv", "\n\n"),
    ("t.csv", "delta_ms,kind,node\n"),
    ("t.json", '{"metadata": {"gap_seconds": 60}, "data": []}'),
    ("t.txt", "\n"),
])
def test_a_trace_without_data_is_refused(tmp_path, name, text):
    # every format alike: an empty trace is a mistake, not a cluster that never had a node
    assert_rejected(write(tmp_path, name, text), 1, "no data")


@pytest.mark.parametrize("text,line,words", [
    ("2021-03-01, 10:00:00, 4\n2021-03-01, 09:00:00, 2\n", 2, "backwards"),
    ("2021-03-01, 10:00:00, 4\n2021-13-01, 10:00:00, 2\n", 2, "bad date"),
    ("2021-03-01, 10:00:00, x\n", 1, "bad number"),
    ("2021-03-01, 10:00:00, 2.5\n", 1, "whole"),
])
def test_dated_series_errors(tmp_path, text, line, words):
    assert_rejected(write(tmp_path, "bad.txt", text), line, words)


def test_missing_file_is_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_synthetic_traces_are_deterministic_and_consistent():
    a = bamboo_trace(0.25, 5, 16, seed=3)
    b = bamboo_trace(0.25, 5, 16, seed=3)
    c = bamboo_trace(0.25, 5, 16, seed=4)
    assert a.events == b.events and a.events != c.events
    for tr in (a, simple_trace(0.25, 5, 16, 3), poisson_trace(0.5, 5, 16, 1),
               fixed_interval_trace(600, 5, 16)):
        live: set[str] = set()
        for ev in tr.events:  # a valid trace never removes an absent node
            if ev.kind == ADD:
                assert ev.node not in live
                live.add(ev.node)
            else:
                assert ev.kind == REMOVE and ev.node in live
                live.remove(ev.node)
            assert len(live) <= 16
    assert bamboo_trace(0.0, 5, 16, 0).removals == 0
    assert simple_trace(0.0, 5, 16, 0).removals == 0
    assert simple_trace(1.0, 1, 16, 0).removals == 16  # it starts full
    with pytest.raises(ValueError):
        bamboo_trace(1.5, 1, 4, 0)
    with pytest.raises(ValueError):
        simple_trace(1.5, 1, 4, 0)


def test_traces_are_found_beside_the_checkout_or_in_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTPIPE_SHARED", str(tmp_path))  # nothing there
    monkeypatch.chdir(tmp_path)
    bundled = find_trace("p3")
    assert bundled.name == "bamboo-p3.csv" and bundled.is_file()
    assert (bundled.parent / "LICENSE-bamboo-traces").is_file()
    assert len(load_trace("g4dn")) == 153
    (tmp_path / "traces").mkdir()
    shared = tmp_path / "traces" / "bamboo-p3.csv"
    shared.write_text("0,add,a\n")
    assert find_trace("bamboo-p3.csv") == shared  # a shared copy comes first
    with pytest.raises(TraceError, match="cannot read"):
        load_trace("no-such-trace.csv")
