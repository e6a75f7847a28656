"""Bamboo's own table setup (`spotpipe simulate --table --setup bamboo`): its simulator's
10,000-seed table as uclasystem/bamboo computes it (project_pactum/simulation/api.py,
`generate_table`), run with the `bamboo` policy.

Why a setup of its own: this project's table runs 3 h at P x D nodes of a GPT-2 preset, so
its figures cannot be set beside Bamboo's. Bamboo's table runs its simulator's default model
(BERT: 264 samples a step, 22,194 steps, 12 stages, a step table per number of pipelines) on
a cluster of capacity 48 until the job's last step, at start hour 0 with the add
probabilities drawn per seed, and reports per rate the mean over seeds of: preemptions,
fatal failures, instances, performance (samples/s from the first rendezvous to the last
step), cost ($/h from 0 to the last step) and value (the time average of samples/s per $/h
while running). The constants below are read from its `Simulator.__init__`;
tests/test_bamboo_table.py checks them against the ones its code reported
(tests/fixtures/bamboo_table_reference.json) and our figures against its per-seed ones.
"""

from __future__ import annotations

from spotpipe.sim.bamboo_reference import reference_config
from spotpipe.sim.params import SimConfig
from spotpipe.sim.simulator import HOUR, Result, run
from spotpipe.sim.synthetic import SyntheticModel

# Simulator(model='BERT'), its default, as generate_table runs it
SETUP: dict = {
    "model": "BERT", "samples_per_step": 264, "steps_per_run": 22_194, "num_stages": 12,
    "capacity": 48,
    # bert_simulate_step_delta at 12 stages, seconds per step by number of pipelines
    "step_s_by_pipelines": {"1": 4.31, "2": 2.39, "3": 1.805, "4": 1.45},
    "spot_price": 0.91, "on_demand_price": 3.06,  # $/h per instance
    "creation_s": 45.0, "global_rendezvous_s": 30.0, "local_rendezvous_s": 20.0,
    "fallback_slowdown": 1.5,
    # its on-demand comparison: 4 x 5 instances at 264 samples per 2.51 s
    "on_demand": {"instances": 20, "performance": 264 / 2.51, "cost": 20 * 3.06,
                  "value": 264 / 2.51 / (20 * 3.06)},
}
# its table's synthetic traces: generate_addition_probabilities=True, start_hour=0
SYNTHETIC = SyntheticModel("bamboo", "drawn", 0, boot_order=True)
FIRST_HOURS = 48.0  # trace length tried first; doubled until the job ends within it
MAX_HOURS = 3072.0


def setup_config() -> SimConfig:
    """The simulator configuration of Bamboo's table: its model's step table and batch,
    its prices, boot and rendezvous times, and its value formula."""
    return reference_config({"config": SETUP}, name="bamboo-bert")


def run_to_end(rate: float, seed: int, cfg: SimConfig | None = None,
               synthetic: SyntheticModel = SYNTHETIC) -> Result:
    """One seed of its table: the `bamboo` policy on its synthetic trace until the job's
    last step. The trace is generated hour by hour, so a longer one starts with the same
    events: it is lengthened until the job ends within it."""
    cfg = cfg or setup_config()
    hours = FIRST_HOURS
    while True:
        trace = synthetic.trace(rate, hours, SETUP["capacity"], seed)
        r = run(trace, "bamboo", cfg, duration_s=hours * HOUR, record=False,
                iterations=SETUP["steps_per_run"])
        if r.duration_s < hours * HOUR or hours >= MAX_HOURS:
            return r
        hours *= 2


def figures(r: Result) -> dict[str, float]:
    """A run's figures under the names of Bamboo's `Result`."""
    return {"num_preemptions": r.preemptions, "num_fatal_failures": r.fatal_failures,
            "average_instances": r.window_cost_per_hour / SETUP["spot_price"],
            "average_performance": r.window_throughput,
            "average_cost": r.window_cost_per_hour,
            "average_value": r.time_average_value,
            "end_hours": r.duration_s / HOUR, "start_hours": r.run_window[0] / HOUR}
