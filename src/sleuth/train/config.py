"""Trainer configs: one dataclass per trainer, read from a YAML (or JSON) file.

Nested mappings fill nested dataclasses (``sampling: {temperature: 1.0}``); unknown keys are errors that name the
file and the key, so a typo never silently trains with a default, and every value is type- and range-checked
(:mod:`sleuth.config_check`: ``FILE: KEY: got X, expected Y``) before anything loads. ``overrides``
(``{"learning_rate": "1e-5"}`` from the command line, dotted keys allowed) are applied after the file.

Renamed options keep loading: a config class's ``renamed`` table (``{"lr": "learning_rate", "lora.r": "lora_r"}``;
a dotted old key is a key of an old nested mapping) maps each old key to its new field; the old key is accepted
with a ``DeprecationWarning`` that names the new one (a list given for a new ``str`` field is joined with commas).

>>> from dataclasses import dataclass
>>> @dataclass
... class Demo:
...     lr: float = 1e-5
...     epochs: int = 1
>>> from_mapping(Demo, {"lr": 2e-5})
Demo(lr=2e-05, epochs=1)
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from sleuth.agents.base import configure, parse_options

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file is unreadable, or names a key the trainer does not have."""


def _flatten(config: Any, mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys for ``configure``: descend only where the config holds a nested dataclass, so dict-valued
    fields (e.g. mixing ratios) take the mapping whole."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}{key!r}: got a {type(key).__name__} key, expected an option name")
        current = getattr(config, key, None)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            out.update(_flatten(current, value, f"{prefix}{key}."))
        elif isinstance(value, list) and isinstance(current, tuple):
            out[f"{prefix}{key}"] = tuple(value)
        else:
            out[f"{prefix}{key}"] = value
    return out


def rename_keys(cls: type, mapping: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``mapping`` with the old keys of ``cls.renamed`` replaced by their new names, each with a
    ``DeprecationWarning``; giving both an old key and its new name is an error."""
    table: dict[str, str] = getattr(cls, "renamed", None) or {}
    out = dict(mapping)
    defaults = cls() if table else None
    for old, new in sorted(table.items(), key=lambda item: "." not in item[0]):  # old nested mappings first
        head, _, leaf = old.partition(".")
        if leaf:
            nested = out.get(head)
            if not isinstance(nested, dict) or leaf not in nested:
                continue
            nested = dict(nested)
            value = nested.pop(leaf)
            if nested:
                out[head] = nested
            else:
                del out[head]
        elif old in out:
            value = out.pop(old)
        else:
            continue
        if new in out:
            raise ConfigError(f"{source}: {old!r} is the old name of {new!r}; give only {new!r}")
        if isinstance(value, list | tuple) and isinstance(getattr(defaults, new, None), str):
            value = ",".join(str(v) for v in value)
        warnings.warn(f"{source}: option {old!r} is renamed {new!r}; use {new!r}", DeprecationWarning, stacklevel=3)
        out[new] = value
    return out


def from_mapping(cls: type[T], mapping: dict[str, Any] | None, source: str = "config") -> T:
    """``cls`` with ``mapping`` applied (nested dicts into nested dataclasses; old keys renamed, see
    :func:`rename_keys`)."""
    try:
        return configure(cls, _flatten(cls(), rename_keys(cls, mapping or {}, source)))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(cls: type[T], path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> T:
    """Read ``path`` (YAML or JSON) into ``cls``, then apply ``overrides`` (a mapping, or ``"key=value"`` strings
    as ``--set`` gives them)."""
    try:
        overrides = parse_options(overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    mapping: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            bad = f"byte {exc.object[exc.start]:#04x} at offset {exc.start}"
            raise ConfigError(f"{path}: not UTF-8 text ({bad})") from None
        try:
            if path.suffix == ".json":
                mapping = json.loads(text)
            else:
                import yaml

                mapping = yaml.safe_load(text) or {}
        except Exception as exc:
            raise ConfigError(f"{path}: not valid YAML/JSON ({exc})") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"{path}: expected a mapping of options at the top level")
    mapping = rename_keys(cls, mapping, str(path or "config"))
    mapping = _merge(mapping, rename_keys(cls, _unflatten(overrides or {}), "overrides"))
    return from_mapping(cls, mapping, source=str(path or "overrides"))


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def to_mapping(config: Any) -> dict[str, Any]:
    """A config as plain JSON-able data (written next to every checkpoint)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))
