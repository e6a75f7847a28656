"""Trace-driven simulation of pipeline-parallel training on spot instances (no torch)."""

from spotpipe.sim.models import ModelCosts, bert_large, gpt2_1_5b, load_profile, preset
from spotpipe.sim.params import SimConfig, SimParams, calibrate
from spotpipe.sim.prices import Price, load_prices, price_of
from spotpipe.sim.simulator import Result, on_demand_closed_form, run, run_policies
from spotpipe.sim.synthetic import (bamboo_trace, fixed_interval_trace, poisson_trace,
                                    simple_trace)
from spotpipe.sim.traces import Event, Trace, TraceError, find_trace, load_trace

__all__ = ["Event", "ModelCosts", "Price", "Result", "SimConfig", "SimParams", "Trace",
           "TraceError", "bamboo_trace", "bert_large", "calibrate", "find_trace",
           "fixed_interval_trace",
           "gpt2_1_5b", "load_prices", "load_profile", "load_trace", "on_demand_closed_form",
           "poisson_trace", "preset", "price_of", "run", "run_policies", "simple_trace"]
