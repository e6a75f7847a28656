"""Load user code named by a ``package.module:function`` spec, and call it.

Configs name models and datasets by import spec rather than by pickled objects, so every
worker builds the same thing from code (nothing is unpickled) and a typo is reported before
any process starts, naming the spec. Shared by `spotpipe.model` and `spotpipe.data`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable


class FactoryError(ValueError):
    """A factory spec that cannot be loaded or called, or that returned something unusable."""


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``"package.module:function"`` (the attribute may be dotted: ``mod:Cls.make``)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise FactoryError(
            f"factory spec {spec!r} is not of the form 'package.module:function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(
            f"factory spec {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(
                f"factory spec {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise FactoryError(
            f"factory spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    return obj


def call_factory(spec: str, kwargs: dict[str, Any]) -> Any:
    """Load the spec and call it with ``**kwargs``, reporting bad keyword names up front."""
    fn = load_factory(spec)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise FactoryError(f"factory spec {spec!r}: bad arguments {sorted(kwargs)}: {exc}") from exc
    except ValueError:  # builtins without a signature: let the call itself complain
        pass
    return fn(**kwargs)
