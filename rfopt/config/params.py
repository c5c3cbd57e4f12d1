"""The one naming of a trial config's fields as Optuna params, and the distributions that hold their values.

A config field is named by its path in a config dict (`TrialConfig.to_dict()`, flattened by `fields`):
``args.learning_rate``, ``peft_config.r``, ``reward_funcs``, ``args.model_init_kwargs.dtype``. Where a study searches
a field, its Optuna param is named after the field's last part (``learning_rate``, ``lora_alpha``), except for the
fields of `RENAMED` (the first rfopt's names, kept so that the studies it ran keep their params) and where two fields
of a config share a last part (then the param is the path).

An override (``study.clone_trial(3, {...})``, ``rfopt clone --set``, `rfopt.grid`) names a field by its path, its
param name, a GRPOConfig field's bare name, one of `ALIASES`, or the first rfopt's path (``grpo.``, ``peft.``):
`field_path` says which field. List spaces name their params with `param_name`, clones record their overrides
under the same names, and a list's params turn back into overrides with `override_name`, so the three always agree.

    >>> field_path("lora_r"), param_name("peft_config.r"), param_name(field_path("grpo.learning_rate"))
    ('peft_config.r', 'lora_r', 'learning_rate')
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from rfopt.errors import ConfigError
from rfopt.values import is_finite_number

RENAMED: dict[str, str] = {"peft_config.r": "lora_r", "reward_funcs": "rewards", "quantization_config": "quantization"}
"""Config fields whose param is not named after the field's last part (path -> param name), both ways."""
ALIASES: dict[str, str] = {"r": "peft_config.r", "lora_alpha": "peft_config.lora_alpha",
                           "lora_dropout": "peft_config.lora_dropout"}
"""Bare override names of PEFT fields (a bare name is otherwise a GRPOConfig field), besides `RENAMED`'s params."""
OLD_PREFIXES: dict[str, str] = {"grpo.": "args.", "peft.": "peft_config."}
"""The first rfopt's sections of a config, by their current names."""
SECTIONS = ("args", "peft_config", "model_init_kwargs")
"""The mappings of a config dict whose entries are fields of their own (`fields`)."""
_FIELDS_OF_PARAMS = {param: path for path, param in RENAMED.items()}


def field_path(name: str) -> str:
    """The config field an override or param name means: ``lora_r`` -> ``peft_config.r``, ``learning_rate`` and
    ``grpo.learning_rate`` -> ``args.learning_rate``; a path, ``model`` or an unknown name as it is (the caller says
    whether the field exists)."""
    path = _FIELDS_OF_PARAMS.get(name) or ALIASES.get(name) or name
    for old, new in OLD_PREFIXES.items():
        if path.startswith(old):
            path = new + path[len(old):]
    if "." not in path and path in _grpo_fields():
        path = f"args.{path}"
    return path


def param_name(path: str, paths: Collection[str] = ()) -> str:
    """The Optuna param of config field `path`: `RENAMED`'s name, else its last part, or the path itself where another
    of `paths` (the config's fields) has the same last part."""
    if path in RENAMED:
        return RENAMED[path]
    tail = path.rsplit(".", 1)[-1]
    if any(other != path and other.rsplit(".", 1)[-1] == tail for other in paths):
        return path
    return tail


def override_name(path: str, paths: Collection[str] = ()) -> str:
    """The name an override gives config field `path` by: its param name where that means the field again
    (``lora_r``, ``learning_rate``), else the path (``peft_config.target_modules``)."""
    name = param_name(path, paths)
    return name if field_path(name) == path else path


def fields(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict's fields by path: ``{"args": {"learning_rate": 1e-4}}`` -> ``{"args.learning_rate": 1e-4}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and key in SECTIONS:
            out.update(fields(value, f"{path}."))
        else:
            out[path] = value
    return out


def param_value(value: Any) -> Any:
    """A field's value as an Optuna param holds it: a number, string, bool or None as it is, anything else (a list of
    reward functions, a dict) as its JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


def admits(dist: BaseDistribution, value: Any) -> bool:
    """Whether an Optuna distribution holds `value` (from its public fields): one of its choices, or a number in its
    range and on its step."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if not is_finite_number(value):
        return False
    if not dist.low <= value <= dist.high:
        return False
    step = getattr(dist, "step", None)
    return step is None or abs((value - dist.low) / step - round((value - dist.low) / step)) < 1e-8


def distribution(values: Sequence[Any], existing: BaseDistribution | None = None, *, name: str,
                 given: str) -> BaseDistribution:
    """The distribution of param `name` that holds `values`, beside `existing` (the study's own for the param, or None
    where its trials do not have it yet): Optuna refuses another kind, other choices or another scale under one name.

    - `existing` where it admits every value;
    - a range widened to the values: `existing`'s kind and log scale, its step where the values lie on its grid
      (a float range loses its step);
    - with no `existing`: a range of the values where all are numbers (integers when all are), else categorical
      choices of them.

    `ConfigError` where Optuna cannot hold them: a choice a categorical param's trials did not have, a value that is
    not a number (or not a whole one, or not > 0 on a log scale) for a range. `given` says where the values come
    from in the message (``"the list now gives"``).
    """
    numbers = all(is_finite_number(v) for v in values)
    if existing is None:
        if not numbers:
            return CategoricalDistribution(sorted(set(values), key=_sort_key))
        if all(isinstance(v, int) for v in values):
            return IntDistribution(min(values), max(values))
        return FloatDistribution(float(min(values)), float(max(values)))
    if all(admits(existing, v) for v in values):
        return existing
    if isinstance(existing, CategoricalDistribution):
        new = [v for v in sorted(set(values), key=_sort_key) if v not in existing.choices]
        raise ConfigError(f"{name}: {given} {new}, which the study's trials did not have as choices of this param "
                          f"({list(existing.choices)}); Optuna cannot add a choice to a categorical param once trials "
                          "have it")
    if not numbers:
        raise ConfigError(f"{name}: the study's trials have it as a number range, {given} {list(values)}")
    if existing.log and min(values) <= 0:
        raise ConfigError(f"{name}: the study's trials have it on a log scale, {given} {list(values)}")
    low, high = min(existing.low, *values), max(existing.high, *values)
    if isinstance(existing, IntDistribution):
        if not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{name}: the study's trials have it as whole numbers, {given} {list(values)}")
        on_grid = all((v - existing.low) % existing.step == 0 for v in values)
        return IntDistribution(low, high, log=existing.log, step=existing.step if on_grid else 1)
    return FloatDistribution(float(low), float(high), log=existing.log)  # a widened range need not keep its grid


ALTERNATE_PARAM = "{name}#{index}"
"""The param that holds a clone's value of field `name` which `name`'s categorical cannot hold (index 2, 3, ...)."""


def param_holding(name: str, value: Any, distributions: Mapping[str, BaseDistribution]
                  ) -> tuple[str, BaseDistribution] | None:
    """``(param name, distribution)`` under which a trial's Optuna params hold `value` of the field whose param is
    `name`, beside the study's `distributions` (by param name): `name` itself where its distribution holds the value
    or widens to hold it (`distribution`), or where the study has no such param; else (a categorical that cannot gain
    a choice) the first alternate ``name#2``, ``name#3``, ... (`ALTERNATE_PARAM`) whose distribution holds the value,
    or that is new (a one-choice categorical). So a clone that trains another model reads ``model#2='...'`` in its
    params, never its parent's model.

        >>> param_holding("model", "m2", {"model": CategoricalDistribution(["m1"])})
        ('model#2', CategoricalDistribution(choices=('m2',)))
    """
    holders = (name, *(ALTERNATE_PARAM.format(name=name, index=index) for index in range(2, 10_000)))
    for holder in holders:
        try:
            return holder, distribution([value], distributions.get(holder), name=holder, given="the clone has")
        except ConfigError:
            continue
    return None


def _sort_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, "" if value is None else value)


@functools.cache
def _grpo_fields() -> frozenset[str]:
    import dataclasses

    from trl import GRPOConfig

    return frozenset(f.name for f in dataclasses.fields(GRPOConfig) if f.init)
