"""Configuration values read from YAML text: a file's or a `--set key=value`'s.

PyYAML's safe loader reads more than a configuration may hold and forgives what it should not:
a key given twice keeps the second without a word, dates and binary data become Python
objects that JSON (which the config is hashed, stored and sent as) cannot hold, an alias may
contain itself. This module reads with a loader that refuses those, naming the line or key,
so that `spotpipe.config` only ever maps plain JSON values onto its dataclasses.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what was expected."""


# what a configuration value may be: what JSON holds (the config is hashed, stored and sent
# as JSON), not the dates, binary data or sets YAML also reads
_SCALARS = (str, int, float, bool, type(None))
_YAML_TYPES = {"date": "a YAML date", "datetime": "a YAML date and time",
               "bytes": "YAML binary data (!!binary)", "set": "a YAML set (!!set)"}


def plain_value(value: Any, key: str, _inside: tuple[int, ...] = ()) -> Any:
    """A copy of `value` with only JSON's types (mapping keys as JSON writes them), or a
    ConfigError naming the key that holds something else."""
    where = key or "the top level"
    if isinstance(value, _SCALARS):
        return value
    if id(value) in _inside:
        raise ConfigError(f"{where}: refers to itself (a YAML alias inside its own anchor)")
    inside = _inside + (id(value),)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, _SCALARS):
                raise ConfigError(f"{where}: a key is {_kind(k)}; keys are names (strings)")
            name = k if isinstance(k, str) else json.dumps(k)
            out[name] = plain_value(v, f"{key}.{name}" if key else name, inside)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_value(v, f"{key}[{i}]", inside) for i, v in enumerate(value)]
    raise ConfigError(f"{where}: {_kind(value)} is not a configuration value (numbers, strings, "
                      "true/false, null, lists and mappings are); quote it to make it a string")


def _kind(value: Any) -> str:
    kind = _YAML_TYPES.get(type(value).__name__, f"a {type(value).__name__}")
    return f"{kind} ({value})" if kind in ("a YAML date", "a YAML date and time") else kind


class _Loader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the
    last and drops the first without a word)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _no_duplicate_keys(node, "", set())
        return super().construct_document(node)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # (Python reads at most 4300 digits)
            raise ConfigError(f"line {node.start_mark.line + 1}: an integer of "
                              f"{len(node.value)} digits; expected 64 bits at most") from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _no_duplicate_keys(node: yaml.Node, key: str, walked: set[int]) -> None:
    if id(node) in walked:  # (an alias: walked where its anchor is)
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        own: dict[tuple[str, str], yaml.Node] = {}
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            dotted = f"{key}.{name}" if key else name
            if isinstance(key_node, yaml.ScalarNode) and not key_node.tag.endswith(":merge"):
                # (`<<: *base` merges a mapping; the mapping's own keys override its keys)
                first = own.setdefault((key_node.tag, name), key_node)
                if first is not key_node:
                    raise ConfigError(
                        f"{dotted}: given twice, on line {first.start_mark.line + 1} and line "
                        f"{key_node.start_mark.line + 1} (YAML would keep the second and drop "
                        "the first without a word); remove one")
            _no_duplicate_keys(value_node, dotted, walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _no_duplicate_keys(item, f"{key}[{i}]", walked)


def read_yaml(text: str) -> Any:
    """YAML text -> data (yaml.YAMLError, or ConfigError for a key given twice)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ValueError as exc:  # (a date that is none, such as 2024-13-45)
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot read a value: {exc}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value); the value is read as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = plain_value(read_yaml(raw) if raw.strip() else "", key.strip())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: cannot read the value: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"--set {text!r}: {exc}") from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data
