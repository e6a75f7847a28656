"""Load user code named by a ``package.module:function`` spec, and turn it into a LayeredModel.

Configs name models and datasets by import spec rather than by pickled objects, so every
worker builds the same model from code (nothing is unpickled) and a typo is reported before
any process starts, naming the spec.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from spotpipe.factories import FactoryError, call_factory, load_factory  # noqa: F401 (re-exported)
from spotpipe.model.layered import LayeredModel, find_tied
from spotpipe.model.named import split_by_names


def _as_layers(obj: Any, spec: str) -> list[nn.Module]:
    if isinstance(obj, nn.Sequential):
        layers = list(obj)
    elif isinstance(obj, (list, tuple)):
        layers = list(obj)
    else:
        raise FactoryError(
            f"factory spec {spec!r} returned a {type(obj).__name__}; expected an nn.Sequential, "
            "a list of layers, a tuple (layers, loss_fn) or a LayeredModel"
        )
    if not layers:
        raise FactoryError(f"factory spec {spec!r} returned no layers")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise FactoryError(
                f"factory spec {spec!r}: layer {i} is a {type(layer).__name__}, not an nn.Module"
            )
    return layers


def _is_loss(obj: Any) -> bool:
    """A plain callable or a torch loss module; any other module is a layer, not a loss."""
    return callable(obj) and (
        not isinstance(obj, nn.Module) or isinstance(obj, nn.modules.loss._Loss)
    )


def build_user_model(spec: str, kwargs: dict[str, Any], seed: int) -> LayeredModel:
    """Build a user model: ``torch.manual_seed(seed)``, then ``function(**kwargs)``.

    The function may return a LayeredModel (used as is), an ``nn.Sequential`` or a list of
    layers, any other ``nn.Module`` (split by module names, `spotpipe.model.named`), or a
    tuple ``(any of these, loss_fn)``. Without a loss, ``F.cross_entropy
    (output, target)`` is used, which suits a classifier whose last layer gives (b, classes)
    logits; any other output shape needs an explicit loss. An ``nn.Sequential``'s own child
    names are dropped: global names are always ``"{layer_index}.{param}"``. Parameters shared
    between layers (one Parameter assigned to two layers) are recorded as tied pairs.
    """
    torch.manual_seed(seed)
    return _fp32_weights(_layered(call_factory(spec, kwargs), spec), spec)


def _fp32_weights(model: LayeredModel, spec: str) -> LayeredModel:
    """Refuse weights that are not float32. spotpipe keeps fp32 weights (the master copy),
    gradients and optimizer state whatever the compute precision, which `precision` sets
    (autocast); a bf16 weight would be trained as one, and the paths that move a stage's
    state as one fp32 buffer (CPU shadows, replica gradients) would round or misread it."""
    for i, layer in enumerate(model.layers):
        for name, p in layer.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                raise FactoryError(
                    f"factory spec {spec!r}: parameter {i}.{name} is {p.dtype}; build the "
                    "model in float32 (spotpipe keeps fp32 weights) and set `precision: "
                    "bf16` or `fp16` to compute in 16 bits")
    return model


def _layered(out: Any, spec: str) -> LayeredModel:
    if isinstance(out, LayeredModel):
        return out
    loss_fn: Callable = F.cross_entropy
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], (nn.Module, list, tuple))
        and _is_loss(out[1])
    ):
        out, loss_fn = out
    if isinstance(out, nn.Module) and not isinstance(out, nn.Sequential):
        # a whole model (torchtitan style): split by its module names
        return split_by_names(out, loss_fn)
    layers = _as_layers(out, spec)
    return LayeredModel(layers=layers, loss_fn=loss_fn, tied=find_tied(layers))
