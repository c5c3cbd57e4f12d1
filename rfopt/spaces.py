"""Search spaces: what `Study.optimize` asks Optuna for.

- a define-by-run function ``space(trial) -> TrialConfig`` (any Optuna sampler works);
- an explicit list of `TrialConfig` (each is enqueued as one trial; the fields that differ between
  them become the trial's Optuna params, so the dashboard can compare them);
- a grid: `grid(base, learning_rate=[...], lora_r=[...])` is such a list, one config per combination.

    >>> configs = grid(base_config, learning_rate=[1e-5, 1e-4], lora_r=[8, 16])   # doctest: +SKIP
    >>> len(configs)                                                             # doctest: +SKIP
    4
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna

from . import schema
from .config import ConfigError, TrialConfig
from .schema import TrialRecord

SpaceFunction = Callable[[optuna.Trial], TrialConfig]


def grid(base: TrialConfig, **axes: Sequence[Any]) -> list[TrialConfig]:
    """One config per combination of the axes' values, each made with `TrialConfig.with_overrides`."""
    if not axes:
        return [base]
    names = list(axes)
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"grid axis {name!r}: give a non-empty list of values")
    return [base.with_overrides(dict(zip(names, combo))) for combo in itertools.product(*(axes[n] for n in names))]


class ListSpace:
    """An explicit list of configs, enqueued once each in the study."""

    def __init__(self, configs: Sequence[TrialConfig]) -> None:
        if not configs:
            raise ConfigError("the list of trial configs is empty")
        for i, config in enumerate(configs):
            if not isinstance(config, TrialConfig):
                raise ConfigError(f"configs[{i}]: expected a TrialConfig, got {type(config).__name__}")
        self.configs = list(configs)
        self.params = _varying_params([c.to_dict() for c in self.configs])

    def __len__(self) -> int:
        return len(self.configs)

    def enqueue_missing(self, study: optuna.Study) -> int:
        """Enqueue the configs this study has not seen yet (a rerun does not enqueue twice); return how many."""
        seen = {TrialRecord(t).list_index for t in study.get_trials(deepcopy=False)}
        added = 0
        for index, config in enumerate(self.configs):
            if index in seen:
                continue
            study.enqueue_trial(
                {name: values[index] for name, values in self.params.items()},
                user_attrs=schema.new_trial_attrs(config.to_json(), list_index=index),
                skip_if_exists=False,
            )
            added += 1
        return added

    def config_for(self, trial: optuna.Trial) -> TrialConfig:
        record = TrialRecord(trial)
        if record.config_json is None:
            raise ConfigError(
                f"trial {trial.number} was not enqueued from this list of configs; "
                "a study driven by a list of configs runs only those"
            )
        if record.lineage is None:  # a clone's params were set when it was made
            for name, values in self.params.items():
                trial.suggest_categorical(name, sorted(set(values), key=_sort_key))
        return TrialConfig.from_json(record.config_json)


class FunctionSpace:
    """A define-by-run space: the function suggests params and returns the trial's config."""

    def __init__(self, function: SpaceFunction) -> None:
        self.function = function

    def config_for(self, trial: optuna.Trial) -> TrialConfig:
        stored = TrialRecord(trial).config_json
        if stored is not None:  # enqueued (e.g. a clone): the stored config wins
            return TrialConfig.from_json(stored)
        config = self.function(trial)
        if not isinstance(config, TrialConfig):
            raise ConfigError(
                f"the search space function returned {type(config).__name__}; it must return an rfopt.TrialConfig"
            )
        return config


def as_space(space: Any) -> ListSpace | FunctionSpace:
    if isinstance(space, (ListSpace, FunctionSpace)):
        return space
    if isinstance(space, TrialConfig):
        return ListSpace([space])
    if callable(space):
        return FunctionSpace(space)
    if isinstance(space, Sequence):
        return ListSpace(space)
    raise ConfigError(
        f"a search space is a function trial -> TrialConfig, a list of TrialConfig or rfopt.grid(...); "
        f"got {type(space).__name__}"
    )


def _varying_params(dicts: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The leaf fields that differ between configs, as Optuna categorical params (name -> value per config)."""
    flat = [_flatten(d) for d in dicts]
    names = sorted(set().union(*flat))
    params: dict[str, list[Any]] = {}
    for name in names:
        values = [_param_value(f.get(name)) for f in flat]
        if len({json.dumps(v) for v in values}) > 1:
            params[_short(name, names)] = values
    return params


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and key in ("grpo", "peft", "model_kwargs", "tokenizer_kwargs"):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _param_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


def _short(name: str, names: list[str]) -> str:
    """``grpo.learning_rate`` -> ``learning_rate`` and ``peft.r`` -> ``lora_r`` when that is unambiguous."""
    tail = name.split(".", 1)[-1]
    if name == "peft.r":
        return "lora_r"
    if sum(n.split(".", 1)[-1] == tail for n in names) == 1:
        return tail
    return name


def _sort_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, "" if value is None else value)
