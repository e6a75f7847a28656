"""Bamboo's own simulator's figures, reproduced: the configuration of its GPT-2 runs and the
error of the `bamboo` policy against its outputs (tests/fixtures/bamboo_reference.json)."""

from __future__ import annotations

from dataclasses import replace

from spotpipe.sim.models import gpt2_1_5b
from spotpipe.sim.params import SimConfig, SimParams
from spotpipe.sim.prices import Price
from spotpipe.sim.simulator import run
from spotpipe.sim.traces import Trace


def reference_config(ref: dict, name: str = "bamboo") -> SimConfig:
    """The configuration of Bamboo's GPT-2 runs from the `config` of a reference file
    (tests/fixtures/bamboo_reference.json): its step table, prices, timings and batch.
    Its table's BERT runs take the same keys (`spotpipe.sim.bamboo_table.SETUP`); the
    GPT-2 preset only carries the batch there, as the step table replaces its timing."""
    c = ref["config"]
    p = int(c["num_stages"])
    steps = {int(d): float(s) for d, s in c["step_s_by_pipelines"].items()}
    model = replace(gpt2_1_5b(), micro_batch_size=1,
                    global_microbatches=int(c["samples_per_step"]))
    return SimConfig(model, Price(name, float(c["spot_price"]), float(c["on_demand_price"])),
                     p, max(steps),
                     params=SimParams(boot_s=float(c["creation_s"]),
                                      rendezvous_s=float(c["global_rendezvous_s"]),
                                      reconfig_pause_s=float(c["local_rendezvous_s"])),
                     shape_times=tuple(((p, d, ((),) * d), s) for d, s in sorted(steps.items())),
                     value_formula="bamboo", memory=None)


def reproduction_errors(ref: dict, traces: dict[str, Trace],
                        key: str = "results") -> dict[str, dict[str, float]]:
    """Relative error of the bamboo policy against each reference figure, per trace:
    performance (samples/s while running), cost ($/h up to the last step), value (its
    time-averaged samples/s per $/h)."""
    cfg = reference_config(ref)
    out: dict[str, dict[str, float]] = {}
    for name, trace in traces.items():
        want = ref[key][name]
        r = run(trace, "bamboo", cfg, record=False)
        got = {"average_performance": r.window_throughput,
               "average_cost": r.window_cost_per_hour, "average_value": r.time_average_value}
        out[name] = {k: (v - want[k]) / want[k] for k, v in got.items()}
        out[name]["fatal_failures"] = float(r.fatal_failures - want["num_fatal_failures"])
    return out
