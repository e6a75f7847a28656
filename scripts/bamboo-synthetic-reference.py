"""Record the spot-instance events Bamboo's own simulator generates, as test data for
`spotpipe.sim.synthetic.bamboo_trace` (tests/fixtures/bamboo_synthetic_reference.json).

Bamboo's generator draws from `random.Random(seed)` (project_pactum/simulation/simulator.py,
`Simulator.generate_spot_instance_initial_events` and `generate_spot_instance_events`), so
for a seed its events can be compared one for one with ours. This runs Bamboo's simulator
unchanged (its full event loop, training included) and records every add and remove event
it creates before the run's end; nothing of its code is kept. Usage, with a checkout of
uclasystem/bamboo:

    python scripts/bamboo-synthetic-reference.py BAMBOO_CHECKOUT [COMMIT] > tests/fixtures/bamboo_synthetic_reference.json
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SIMULATOR = "project_pactum/simulation/simulator.py"
HOUR_MS = 3_600_000
# (model, seed, start_hour, generated addition probabilities, removal probability or None
# for its hour-of-day table, hours):
# the models set the capacity (GPT-2 48, ResNet 32, VGG 24 nodes)
CASES = [
    ("GPT-2", 1, 0, True, 0.10, 6),
    ("GPT-2", 2, 0, True, 0.50, 6),
    ("ResNet", 3, 0, True, 0.25, 6),
    ("VGG", 4, 2, False, 0.25, 8),
    ("GPT-2", 5, 22, False, 0.05, 10),
    ("VGG", 6, 3, False, 0.50, 4),
    # no removal probability: its hour-of-day removal table (0.25 from 15 to 22 h)
    ("GPT-2", 7, 12, False, None, 14),
    ("ResNet", 8, 20, True, None, 10),
]


def _load(checkout: Path):
    spec = importlib.util.spec_from_file_location("bamboo_simulator", checkout / SIMULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(module, model, seed, start_hour, generate, removal, hours) -> dict:
    created: list[tuple[int, int, int, str]] = []  # (delta ms, kind, creation order, node)
    base = module.Simulator

    class Recording(base):
        def create_spot_instance_add_event(self, delta, name=None):
            event = super().create_spot_instance_add_event(delta, name)
            created.append((event.delta, 1, len(created), event.data["name"]))
            return event

        def create_spot_instance_remove_event(self, delta, name):
            event = super().create_spot_instance_remove_event(delta, name)
            created.append((event.delta, 2, len(created), event.data["name"]))
            return event

    sim = Recording(seed=seed, start_hour=start_hour, model=model,
                    generate_addition_probabilities=generate, removal_probability=removal)
    duration = hours * HOUR_MS
    try:
        sim.simulate(duration=duration)
    except (IndexError, ValueError, ZeroDivisionError) as exc:  # StatisticsError too
        # its result summary fails on runs that never trained; the events are all made
        print(f"# {model} seed {seed}: summary failed ({type(exc).__name__})", file=sys.stderr)
    events = sorted(e for e in created if e[0] < duration)
    return {"model": model, "capacity": sim.spot_instance_desired_capacity, "seed": seed,
            "start_hour": start_hour, "generate_addition_probabilities": generate,
            "removal_probability": removal, "hours": hours,
            "addition_probabilities": [sim.spot_instance_addition_probability[h]
                                       for h in range(24)],
            "events": [[d / 1000.0, "add" if k == 1 else "remove", n]
                       for d, k, _, n in events]}


def main(argv: list[str]) -> None:
    checkout = Path(argv[0])
    commit = argv[1] if len(argv) > 1 else subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        capture_output=True, text=True).stdout.strip() or "unknown"
    module = _load(checkout)
    print(json.dumps({
        "source": f"uclasystem/bamboo @ {commit}, {SIMULATOR}, run unchanged as "
                  "Simulator(seed, start_hour, model, generate_addition_probabilities, "
                  "removal_probability).simulate(duration=hours h) by "
                  "scripts/bamboo-synthetic-reference.py; the add and remove events it "
                  "created before the end, by (time, kind, creation order); its outputs only, "
                  f"no code; Python {sys.version.split()[0]}",
        "cases": [_record(module, *case) for case in CASES]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
