"""Record the per-seed figures of Bamboo's own simulator table, as test data for the `bamboo`
policy under `--setup bamboo` (tests/fixtures/bamboo_table_reference.json).

Bamboo's table (project_pactum/simulation/api.py, `generate_table`) runs
`Simulator(seed, start_hour=0, generate_addition_probabilities=True, removal_probability=rate)`
with its default model (BERT: 264 samples a step, 22,194 steps, 12 stages, capacity 48) to the
end of the job (`simulate()` without a duration) for seeds 1 to 10,000 at rates 0.01, 0.05,
0.10, 0.25 and 0.50, and prints the mean of each `Result` field. This runs the same call,
unchanged, for fewer seeds and keeps every seed's `Result`, the time of its last step, the
order its heap took simultaneous events in, and its step table; nothing of its code is
kept. Usage, with a checkout of uclasystem/bamboo:

    python scripts/bamboo-table-reference.py BAMBOO_CHECKOUT [SEEDS [COMMIT]] > \
        tests/fixtures/bamboo_table_reference.json
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import json
import subprocess
import sys
from pathlib import Path

SIMULATOR = "project_pactum/simulation/simulator.py"
RATES = (0.01, 0.05, 0.10, 0.25, 0.50)  # api.generate_table's removal_probabilities
WIDTHS = (1, 2, 3, 4)  # pipelines its BERT step table has at 12 stages


def _load(checkout: Path):
    spec = importlib.util.spec_from_file_location("bamboo_simulator", checkout / SIMULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(module, rate: float, seed: int) -> dict:
    """api.simulate((rate, seed)), the time of its last step, and the order its heap took
    simultaneous grants, removals and boots in (`ties`: each a group of node names)."""
    applied: list[tuple[int, str, str]] = []  # (ms, kind, node) in the order taken

    class Recording(module.Simulator):
        def simulate_spot_instance_add(self, delta, data):
            applied.append((delta, "add", data["name"]))
            super().simulate_spot_instance_add(delta, data)

        def simulate_spot_instance_remove(self, delta, data):
            applied.append((delta, "remove", data["name"]))
            super().simulate_spot_instance_remove(delta, data)

        def simulate_spot_instance_ready(self, delta, data):
            if data["name"] in self.spot_instances:
                applied.append((delta, "ready", data["name"]))
            super().simulate_spot_instance_ready(delta, data)

    sim = Recording(seed=seed, start_hour=0, generate_addition_probabilities=True,
                    removal_probability=rate)
    result = sim.simulate()
    out = dataclasses.asdict(result)
    out["seed"] = seed
    out["end_hours"] = sim.performance_xs[-1]
    out["start_hours"] = sim.start_delta / sim.milliseconds_per_hour
    out["ties"] = _ties(applied)
    return out


def _ties(applied: list[tuple[int, str, str]]) -> dict[str, list[str]]:
    """Per kind, the groups of two or more events of one millisecond, in the order taken
    (each the names joined by spaces)."""
    groups: dict[str, list[str]] = {"add": [], "remove": [], "ready": []}
    i = 0
    while i < len(applied):
        j = i
        while j < len(applied) and applied[j][:2] == applied[i][:2]:
            j += 1
        if j - i > 1:
            groups[applied[i][1]].append(" ".join(name for _, _, name in applied[i:j]))
        i = j
    return groups


def _config(module) -> dict:
    """The constants of its default model, read from a Simulator instance."""
    sim = module.Simulator()
    steps = {}
    for width in WIDTHS:
        sim.num_pipelines, sim.num_stages = width, sim.num_stages_target
        sim.simulate_step_delta()
        steps[width] = sim.step_delta / 1000.0
    return {"model": sim.model, "samples_per_step": sim.samples_per_step,
            "steps_per_run": sim.steps_per_run, "num_stages": sim.num_stages_target,
            "capacity": sim.spot_instance_desired_capacity,
            "step_s_by_pipelines": steps, "spot_price": sim.spot_instance_cost_per_hour,
            "on_demand_price": sim.on_demand_cost_per_hour,
            "creation_s": sim.spot_instance_creation_time / 1000.0,
            "global_rendezvous_s": sim.global_rendezvous_timeout_delta / 1000.0,
            "local_rendezvous_s": sim.local_rendezvous_timeout_delta / 1000.0,
            "fallback_slowdown": sim.fallback_slowdown,
            "on_demand": {"instances": sim.on_demand_num_instances,
                          "performance": sim.on_demand_performance,
                          "cost": sim.on_demand_cost, "value": sim.on_demand_value}}


def main(argv: list[str]) -> None:
    checkout = Path(argv[0])
    seeds = int(argv[1]) if len(argv) > 1 else 20
    commit = argv[2] if len(argv) > 2 else subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        capture_output=True, text=True).stdout.strip() or "unknown"
    logging.disable(logging.INFO)
    module = _load(checkout)
    runs = {str(rate): [_run(module, rate, seed) for seed in range(1, seeds + 1)]
            for rate in RATES}
    print(json.dumps({
        "source": f"uclasystem/bamboo @ {commit}, {SIMULATOR}, run unchanged as api.simulate "
                  "does for api.generate_table: Simulator(seed, start_hour=0, "
                  "generate_addition_probabilities=True, removal_probability=rate).simulate() "
                  f"for seeds 1-{seeds}, by scripts/bamboo-table-reference.py; its outputs "
                  f"only, no code; Python {sys.version.split()[0]}",
        "config": _config(module), "runs": runs}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
