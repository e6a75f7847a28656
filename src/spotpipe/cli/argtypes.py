"""Argument types for numbers on the command line: argparse's `float` takes 'nan' and 'inf',
which end in a traceback or a run that never stops; these refuse them, naming the flag."""

from __future__ import annotations

import argparse
import math


def finite_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_number(text: str) -> float:
    value = finite_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value
