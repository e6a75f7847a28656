"""Results as text tables and JSON: what a person reads and what a script parses."""

from __future__ import annotations

import json
import math
from typing import Any

from spotpipe.sim.simulator import Result


def result_dict(result: Result, *, timeline: bool = False) -> dict[str, Any]:
    """A run's figures (and optionally its timeline) as JSON-ready data."""
    out = result.summary()
    if timeline:
        out["timeline"] = [vars(p) for p in result.timeline]
    return out


def run_table(results: list[Result]) -> str:
    """One row per run: throughput, cost, value, failures, and the time breakdown in %.
    Under Bamboo's value formula the value is samples/s per $/h (about 1 where samples per
    dollar are thousands): its column says so and keeps three digits."""
    bamboo = any(r.value_formula == "bamboo" for r in results)
    head = ["policy", "samples/s", "$/h", "(samples/s)/($/h)" if bamboo else "samples/$",
            "preempt", "fatal", "useful%", "redund%", "recover%", "restart%", "idle%"]
    rows = []
    for r in results:
        total = sum(r.breakdown.values()) or 1.0
        pct = [100.0 * r.breakdown[k] / total
               for k in ("useful", "redundant", "recovering", "restarting", "idle")]
        value = f"{r.value:.3g}" if bamboo else f"{r.value:.0f}"
        rows.append([r.policy, f"{r.throughput:.2f}", f"{r.cost_per_hour:.2f}", value,
                     str(r.preemptions), str(r.fatal_failures)] + [f"{p:.1f}" for p in pct])
    return format_table(head, rows)


def sweep_table(sweep: dict[str, Any]) -> str:
    """Rates x policies: mean value (p10-p90), mean throughput, mean fatal failures."""
    head = ["rate", "policy", "runs", "samples/$", "p10..p90", "samples/s", "$/h", "fatal"]
    rows = [[f"{r['rate']:.2f}", r["policy"], str(r["runs"]), f"{r['value']:.0f}",
             f"{r['value_p10']:.0f}..{r['value_p90']:.0f}", f"{r['throughput']:.2f}",
             f"{r['cost_per_hour']:.2f}", f"{r['fatal_failures']:.2f}"] for r in sweep["rows"]]
    return format_table(head, rows) + (f"\n{sweep['seeds']} seeds x {len(sweep['rates'])} rates, "
                                  f"{sweep['hours']} h runs, {sweep['nodes']} nodes: "
                                  f"{sweep['seconds']:.1f} s")


def format_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def to_json(data: Any) -> str:
    """One line of JSON; non-finite floats become null (JSON has no inf/nan)."""
    return json.dumps(_finite(data), separators=(",", ":"), sort_keys=True)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
