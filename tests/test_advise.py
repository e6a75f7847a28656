"""`spotpipe simulate --advise`: each check can fail, against figures computed apart."""

import argparse
import json

import pytest
from test_sim_memory import layout_fits

from spotpipe.cli import simulate as cli
from spotpipe.sim.advise import advise, candidates, young_daly_interval
from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.models import gpt2_1_5b
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import price_of
from spotpipe.sim.synthetic import poisson_trace, simple_trace

CFG = SimConfig(gpt2_1_5b(), price_of("p3.2xlarge"), 8, 2,
                params=SimParams(checkpoint_cost_s=10.0))


def ranked_on(trace):
    return advise(CFG, trace, space=candidates(CFG, trace, depths=(2, 3, 4, 8)))


def test_on_demand_when_preemptions_are_extreme():
    # every node lives 3 minutes on average, less than its 2-minute boot and a restart
    trace = poisson_trace(20.0, 3, 16, seed=0, replace_s=300)
    best = ranked_on(trace)[0]
    assert best.candidate.market == "on_demand"


def test_spot_when_preemptions_are_rare_and_the_clear_winner_is_picked():
    """16 spot nodes, never preempted: nothing to protect against, so the winner must be
    spot (a third of the price), without redundancy or shadows (they only cost), with the
    longest checkpoint interval (each checkpoint stalls 10 s), on all 16 nodes, in the layout
    that iterates fastest (all nodes are billed whether used or not)."""
    trace = simple_trace(0.0, 3, 16, seed=0)
    ranked = ranked_on(trace)
    best = ranked[0].candidate
    assert (best.market, best.redundancy, best.shadows) == ("spot", "none", False)
    assert best.checkpoint_interval_s == 3600.0
    layouts = [(p, 16 // p) for p in (2, 4, 8) if layout_fits(CFG, p, 1, False, "none", True)]
    fastest = min(layouts, key=lambda pd: iteration_time(CFG.model, "1f1b", pd[0], pd[1],
                                                         ((),), False))
    assert (best.stages, best.pipelines) == fastest
    values = [r.value for r in ranked if r.refused is None]
    assert values == sorted(values, reverse=True)


def test_never_picks_a_layout_that_does_not_fit():
    trace = simple_trace(0.25, 2, 16, seed=1)
    ranked = ranked_on(trace)
    refused = [r for r in ranked if r.refused]
    assert refused and all("does not fit" in r.refused for r in refused)
    assert any(r.candidate.stages == 2 for r in refused)  # GPT-2 XL halves: 13 GB + a replica
    for r in ranked:
        c = r.candidate
        red = c.redundancy if c.market == "spot" else "none"
        d = 1 if c.market == "spot" else c.pipelines  # spotpipe may shrink D to 1
        # with redundancy a node may carry two stages after a takeover, with shadows after a
        # stage is restored onto it: that must fit too
        fits = layout_fits(CFG, c.stages, d, red != "none" or c.shadows, red, True)
        assert fits == (r.refused is None), c


def test_young_daly():
    trace = simple_trace(0.25, 2, 16, seed=1)
    mtbf = trace.duration_s / trace.removals
    assert young_daly_interval(CFG, trace) == pytest.approx((2 * 10.0 * mtbf) ** 0.5)
    assert young_daly_interval(SimConfig(gpt2_1_5b(), price_of("p3.2xlarge")), trace) is None


def test_cli_advise_json(capsys):
    parser = argparse.ArgumentParser(prog="spotpipe")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--synthetic", "bamboo", "--rate", "0", "--hours",
                              "1", "--nodes", "8", "--advise", "--json"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert data["advice"] == data["table"][0] and data["advice"]["market"] == "spot"
    assert any(line.startswith("advice: spot") for line in out)


def _advise_cli(trace_file, capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="spotpipe")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--trace", str(trace_file), "--advise"])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_advise_refuses_a_trace_on_which_nothing_trains(tmp_path, capsys):
    """8 nodes for 100 s: a node boots for 120 s and an on-demand job for 120 s + a 10 s
    rendezvous (SimParams' defaults), so no configuration trains a sample; the advice used
    to be the first candidate tried, 'on-demand 2x1: 0 samples/$', exit 0."""
    assert SimParams().boot_s + SimParams().rendezvous_s > 100
    trace = tmp_path / "short.csv"
    trace.write_text("".join(f"0,add,n{i}\n" for i in range(8))
                     + "".join(f"100000,remove,n{i}\n" for i in range(8)))
    rc, out, err = _advise_cli(trace, capsys)
    assert rc == 2 and "advice:" not in out
    assert "short.csv: no configuration trains a sample in the 100 s" in err
    assert "Traceback" not in err


def test_cli_advise_says_the_trace_has_too_few_nodes(tmp_path, capsys):
    """One node at most: no depth of 2 or more can be tried; the error used to blame memory
    ('no configuration fits memory: no candidates')."""
    trace = tmp_path / "one.csv"
    trace.write_text("0,add,a\n3600000,remove,a\n")
    rc, out, err = _advise_cli(trace, capsys)
    assert rc == 2 and "advice:" not in out
    assert "one.csv: no configuration to try: the trace offers at most 1 nodes" in err
    assert "memory" not in err
