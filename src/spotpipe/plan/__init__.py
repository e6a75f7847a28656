"""Pure planning: the P x D layout over live nodes, the replica ring, and what to do on change."""

from spotpipe.plan.layers import LayerMove, exchange_order, held_replica, layer_plan
from spotpipe.plan.layout import Layout, Slot, layer_moves, splits_evenly, uniform_partition
from spotpipe.plan.policy import PEERS, SHADOW, Action, Decision, Move, MoveKind, decide

__all__ = ["PEERS", "SHADOW", "Action", "Decision", "LayerMove", "Layout", "Move", "MoveKind",
           "Slot", "decide", "exchange_order", "held_replica", "layer_moves", "layer_plan",
           "splits_evenly", "uniform_partition"]
