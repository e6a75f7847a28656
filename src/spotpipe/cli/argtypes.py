"""Argument types and flags the commands share. Numbers: argparse's `float` takes 'nan' and
'inf', which end in a traceback or a run that never stops; these refuse them, naming the flag.
Faults: `spotpipe train` and `spotpipe agent` inject the same ones."""

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


FAULT_FLAGS = ("fail", "notice", "hang")  # the flags below, by `spotpipe.faults` kind


def add_fault_flags(group: argparse._ArgumentGroup) -> None:
    """`--fail`, `--notice` and `--hang`, the faults `spotpipe train` and `spotpipe agent`
    both inject (parsed by `spotpipe.faults.Fault.parse`)."""
    group.add_argument(
        "--fail", action="append", default=[], metavar="NODE@ITER[:PHASE]",
        help="kill NODE (SIGKILL) at iteration ITER, at the start or in PHASE (forward, "
             "backward, all-reduce, optimizer, checkpoint; upload: once NODE has announced a "
             "checkpoint stage it sends through the store; or regroup, transfer: while the "
             "first recovery resuming at ITER or later forms its groups or moves the node's "
             "state; handover: as NODE, leaving on a notice, is about to send its stages)")
    group.add_argument("--notice", action="append", default=[], metavar="NODE@ITER",
                       help="send NODE a preemption notice (SIGTERM) at iteration ITER")
    group.add_argument("--hang", action="append", default=[], metavar="NODE@ITER[:PHASE]",
                       help="make NODE stop making progress at iteration ITER")
