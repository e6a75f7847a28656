"""Pure planning: the P x D layout over live nodes, the replica ring, and what to do on change."""

from spotpipe.plan.layout import Layout, Slot, layer_moves, uniform_partition
from spotpipe.plan.policy import SHADOW, Action, Decision, Move, MoveKind, decide

__all__ = ["SHADOW", "Action", "Decision", "Layout", "Move", "MoveKind", "Slot", "decide",
           "layer_moves", "uniform_partition"]
