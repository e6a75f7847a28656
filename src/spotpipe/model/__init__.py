"""Layer-list models (user factories, nn.Sequential, the built-in GPT) and their partitioning
into pipeline stages."""

from spotpipe.model.factory import FactoryError, build_user_model, call_factory, load_factory
from spotpipe.model.gpt import GPTConfig, build_gpt, gpt_loss
from spotpipe.model.layered import LayeredModel, find_tied
from spotpipe.model.partition import (
    METHODS,
    PartitionError,
    balanced_partition,
    build_stage,
    compute_weights,
    parameter_counts,
    partition,
    profile_layer_times,
)

__all__ = [
    "FactoryError",
    "GPTConfig",
    "LayeredModel",
    "METHODS",
    "PartitionError",
    "balanced_partition",
    "build_gpt",
    "build_stage",
    "build_user_model",
    "call_factory",
    "compute_weights",
    "find_tied",
    "gpt_loss",
    "load_factory",
    "parameter_counts",
    "partition",
    "profile_layer_times",
]
