"""Type and range checks of config values, so a bad value stops a command before any model loads.

Every value a YAML file or a ``--set KEY=VALUE`` option gives to a config dataclass (the agents' configs, the
trainers' configs, :class:`~sleuth.eval.evaluate.EvalConfig`) goes through :func:`check_field`: its type is read
from the field's annotation (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``X | None``, ``tuple[X,
...]`` / ``list[X]``, ``dict``, a nested dataclass or a mapping of its options) and its range from :data:`RANGES`,
looked up by field name, so the config dataclasses stay plain. A failed check raises :class:`ConfigValueError`
with one line ``KEY: got X, expected Y``. Numbers must be finite everywhere (no nan, no inf), ``bool`` is not an
``int``, and an ``int`` field takes no fraction (``12.5``).

>>> from dataclasses import dataclass
>>> @dataclass
... class Demo:
...     k: int = 5
...     top_p: float = 1.0
>>> check_field(Demo, "k", -5, "k")
Traceback (most recent call last):
...
sleuth.config_check.ConfigValueError: k: got -5, expected an integer >= 1
>>> check_field(Demo, "top_p", 0.0, "sampling.top_p")
Traceback (most recent call last):
...
sleuth.config_check.ConfigValueError: sampling.top_p: got 0.0, expected a finite number in (0, 1]
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


class ConfigValueError(ValueError):
    """A config value of the wrong type or out of its range: ``KEY: got X, expected Y``."""


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; ``low_open`` / ``high_open`` exclude the bound."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return ""


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


POSITIVE = Range(1)  # counts, lengths, budgets, batch sizes
NON_NEGATIVE = Range(0)
ABOVE_ZERO = Range(0, low_open=True)  # learning rates, epochs, timeouts
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
UNIT = Range(0, 1)  # [0, 1]

# Ranges by field name (the same name means the same thing in every config); ``Class.field`` entries win.
RANGES: dict[str, Range] = {
    **dict.fromkeys(
        (
            "k",
            "k_initial",
            "n",
            "max_new_tokens",
            "batch_size",
            "per_device_batch_size",
            "micro_batch",
            "mini_batches",
            "ppo_epochs",
            "prompts_per_step",
            "group_size",
            "iterations",
            "decompositions",
            "solutions",
            "samples",
            "best_of",
            "save_steps",
            "save_total_limit",
            "logging_steps",
            "eval_steps",
            "steps",
            "max_turns",
            "max_subquestions",
            "total_passages",
            "context_passages",
            "max_length",
            "max_episode_tokens",
            "max_obs_tokens",
            "max_references",
            "memory_mb",
            "lora_r",
            "lora_alpha",
            "patience",
            "concurrency",
            "gradient_accumulation_steps",
            "num_examples",
        ),
        POSITIVE,
    ),
    **dict.fromkeys(
        (
            "limit",
            "warmup_steps",
            "critic_warmup_steps",
            "critic_lr_warmup_steps",
            "warmup_synth",
            "max_selected",  # s3: 0 keeps every valid id
            "weight",
            "weight_decay",
            "beta",
            "kl_coef",
            "entropy_coef",
            "vf_coef",
            "nll_weight",
            "min_weight",
            "clip_eps",
            "value_clip",
            "warmup_epochs",
            "temperature",
        ),
        NON_NEGATIVE,
    ),
    **dict.fromkeys(
        (
            "epochs",
            "learning_rate",
            "critic_learning_rate",
            "later_learning_rate",
            "warmup_lr",
            "max_grad_norm",
            "timeout_s",
            "adv_eps",
            "repetition_penalty",
        ),
        ABOVE_ZERO,
    ),
    **dict.fromkeys(("val_fraction", "warmup_ratio", "lora_dropout", "adam_beta1", "adam_beta2"), FRACTION),
    **dict.fromkeys(("gamma", "lam"), UNIT),
    "top_p": Range(0, 1, low_open=True),
    "max_steps": Range(-1),  # trainers: -1 trains for ``epochs``; > 0 stops after this many optimizer steps
    "ExSearchConfig.max_steps": POSITIVE,  # the agent's search cap
}
# Suffix rules for families of fields (``answer_max_new_tokens``, ``dev_limit``).
SUFFIX_RANGES: dict[str, Range] = {"_max_new_tokens": POSITIVE, "_limit": NON_NEGATIVE}


def range_of(owner: type, name: str) -> Range | None:
    """The allowed range of ``owner.name``, None when any value of its type is allowed."""
    for cls in getattr(owner, "__mro__", (owner,)):
        if f"{cls.__name__}.{name}" in RANGES:
            return RANGES[f"{cls.__name__}.{name}"]
    if name in RANGES:
        return RANGES[name]
    return next((r for suffix, r in SUFFIX_RANGES.items() if name.endswith(suffix)), None)


def _hints(owner: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(owner)
    except Exception:  # an annotation that cannot be resolved at run time: left unchecked
        return {}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_field(owner: type, name: str, value: Any, key: str | None = None) -> None:
    """Raise :class:`ConfigValueError` unless ``value`` fits field ``name`` of dataclass ``owner`` (``key``: the
    name shown, e.g. ``sampling.temperature``). Fields without a resolvable annotation are not checked."""
    hint = _hints(owner).get(name)
    if hint is None:
        return
    _check(hint, value, key or name, range_of(owner, name))


def check_dataclass(config: Any, prefix: str = "") -> None:
    """Check every field of a dataclass instance, nested dataclasses included (e.g. a config's defaults)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        check_field(type(config), f.name, value, prefix + f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_dataclass(value, f"{prefix}{f.name}.")


def describe(hint: Any, bounds: Range | None = None) -> str:
    """What a value of ``hint`` (within ``bounds``) is, in words: ``an integer >= 1``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    limit = f" {bounds.describe()}" if bounds is not None and bounds.describe() else ""
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a, bounds) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return f"{text} or none" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is bool:
        return "true or false"
    if hint is int:
        return f"an integer{limit}"
    if hint is float:
        return f"a finite number{limit}"
    if hint is str:
        return "a string"
    if origin in (list, tuple):
        inner = args[0] if args else Any
        return "a list" if inner is Any else f"a list of {_plural(describe(inner))}"
    if origin is dict or hint is dict:
        return "a mapping"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} options"
    return getattr(hint, "__name__", str(hint))


def _plural(text: str) -> str:
    """'an integer >= 1' -> 'integers >= 1' (good enough for the element types configs use)."""
    for article, noun in (("an integer", "integers"), ("a finite number", "finite numbers"), ("a string", "strings")):
        if text.startswith(article):
            return noun + text[len(article) :]
    return text


def _check(hint: Any, value: Any, key: str, bounds: Range | None) -> None:
    if _fits(hint, value, key, bounds):
        return
    raise ConfigValueError(f"{key}: got {_shown(value)}, expected {describe(hint, bounds)}")


def _fits(hint: Any, value: Any, key: str, bounds: Range | None) -> bool:
    """Whether ``value`` fits ``hint``; nested values that do not fit raise with their own key."""
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _fits(options[0], value, key, bounds)
        return any(_fits_quietly(a, value, key, bounds) for a in options)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and (bounds is None or value in bounds)
    if hint is float:
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (bounds is None or value in bounds)
        )
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            return False
        inner = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else Any
        for i, item in enumerate(value):
            _check(inner, item, f"{key}[{i}]", None)
        return True
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return True
        if not isinstance(value, dict):
            return False
        fields = {f.name for f in dataclasses.fields(hint)}
        for name, item in value.items():
            if name in fields:  # unknown keys are reported by the loader, with the known ones listed
                check_field(hint, name, item, f"{key}.{name}")
        return True
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _fits_quietly(hint: Any, value: Any, key: str, bounds: Range | None) -> bool:
    try:
        return _fits(hint, value, key, bounds)
    except ConfigValueError:
        return False
