"""Instance prices, spot and on-demand, $/h: the denominator of every value figure.

Defaults ship in `data/prices.json` with their source; a study overrides them with its own
file of the same shape, because spot prices move and a stale price skews samples per dollar.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from spotpipe.runfiles import read_text


@dataclass(frozen=True)
class Price:
    instance: str
    spot: float
    on_demand: float


def load_prices(path: str | Path | None = None) -> dict[str, Price]:
    """All instance prices from `path`, or the packaged defaults."""
    if path is None:
        text = resources.files("spotpipe.sim").joinpath("data/prices.json").read_text()
        where = "spotpipe/sim/data/prices.json"
    else:
        where = str(path)
        text = read_text(path, "prices")
    try:
        raw = json.loads(text)
        table = raw["instances"]
        out = {name: Price(name, float(v["spot"]), float(v["on_demand"]))
               for name, v in table.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: expected {{\"instances\": {{NAME: {{\"spot\": $, "
                         f"\"on_demand\": $}}}}}}: {exc}") from None
    for p in out.values():
        for key in ("spot", "on_demand"):
            value = getattr(p, key)
            # (at 0 $/h samples per dollar is undefined: the simulator reports 0 for it, and
            # --advise would rank a free configuration last)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{where}: instances.{p.instance}.{key} must be a finite "
                                 f"price > 0 $/h, got {value!r}")
    return out


def price_of(instance: str, path: str | Path | None = None) -> Price:
    prices = load_prices(path)
    try:
        return prices[instance]
    except KeyError:
        raise ValueError(f"unknown instance type {instance!r}; known: {sorted(prices)}") from None
