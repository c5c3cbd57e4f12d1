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

from rfopt import compat
from rfopt.errors import ConfigError
from rfopt.storage import schema
from rfopt.storage.schema import TrialRecord

from .codec import grpo_default
from .params import distribution, field_path, fields, override_name, param_name, param_value
from .trial import TrialConfig

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
    """An explicit list of configs, enqueued once each in the study.

    The list may grow between runs of a study (the new configs become new trials); a config the study has run
    cannot change, since its results are the old config's. The fields that differ between configs are the trials'
    Optuna params: numbers as ranges (which grow with the list), anything else as categorical choices (fixed by the
    first run: Optuna cannot add a choice to a param its trials already have).
    """

    def __init__(self, configs: Sequence[TrialConfig]) -> None:
        if not configs:
            raise ConfigError("the list of trial configs is empty")
        for i, config in enumerate(configs):
            if not isinstance(config, TrialConfig):
                raise ConfigError(f"configs[{i}]: expected a TrialConfig, got {type(config).__name__}")
        self.configs = list(configs)
        varying = _varying_fields([c.to_dict() for c in self.configs])
        self.params = {name: values for name, (_, values) in varying.items()}
        """The list's params (the fields that differ between its configs): name -> value per config."""
        self.paths = {name: path for name, (path, _) in varying.items()}
        """The config field each param is (`rfopt.config.params`)."""
        self.distributions = {name: _distribution(name, values, None) for name, values in self.params.items()}

    def __len__(self) -> int:
        return len(self.configs)

    def check_study(self, study: optuna.Study) -> int:
        """Check the list against what `study` ran; return how many of its configs are left to run (enqueued and
        not started, or not enqueued yet). `ConfigError` if a config the study has changed, or a param gains a
        categorical choice its trials do not have; nothing is written."""
        listed: dict[int, str] = {}
        waiting = 0
        existing: dict[str, optuna.distributions.BaseDistribution] = {}
        for t in study.get_trials(deepcopy=False):
            record = TrialRecord(t)
            if record.list_index is None or record.lineage is not None:
                continue
            listed[record.list_index] = record.config_json or ""
            waiting += t.state == optuna.trial.TrialState.WAITING
            for name, dist in t.distributions.items():
                existing.setdefault(name, dist)
        for index, stored in sorted(listed.items()):
            now = TrialConfig.config_dict(self.configs[index].to_json()) if index < len(self.configs) else None
            if now is not None and TrialConfig.config_dict(stored) != now:
                changed = _changes(TrialConfig.config_dict(stored), now)
                raise ConfigError(
                    f"configs[{index}] is not the config this study ran as its trial for list position {index} "
                    f"({changed}); a config that has run cannot change. Keep it as it was and append the changed "
                    "config at the end of the list (it becomes a new trial), or use a new study name"
                )
        self.distributions = {name: _distribution(name, values, existing.get(name))
                              for name, values in self.params.items()}
        return waiting + sum(index not in listed for index in range(len(self.configs)))

    def enqueue_missing(self, study: optuna.Study) -> int:
        """Enqueue the configs this study has not seen yet (a rerun does not enqueue twice); return how many."""
        seen = {TrialRecord(t).list_index for t in study.get_trials(deepcopy=False)}
        added = 0
        for index, config in enumerate(self.configs):
            if index in seen:
                continue
            compat.enqueue_trial(study, {name: values[index] for name, values in self.params.items()},
                                 schema.new_trial_attrs(config.to_json(), list_index=index))
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
            for name, dist in self.distributions.items():
                _suggest(trial, name, dist)
        return TrialConfig.from_json(record.config_json)

    def overrides_for(self, parent: optuna.trial.FrozenTrial, params: Mapping[str, Any]) -> dict[str, Any]:
        """The clone overrides that give trial `parent`'s config the Optuna `params`: each param's field, by the name
        an override gives it (`rfopt.config.params.override_name`: ``lora_r``, ``peft_config.target_modules``)."""
        return {override_name(self.paths.get(name) or field_path(name)): value for name, value in params.items()
                if parent.params.get(name) != value}


class FunctionSpace:
    """A define-by-run space: the function suggests params and returns the trial's config."""

    def __init__(self, function: SpaceFunction) -> None:
        self.function = function

    def config_for(self, trial: optuna.Trial) -> TrialConfig:
        stored = TrialRecord(trial).config_json
        if stored is not None:  # enqueued (e.g. a clone): the stored config wins
            return TrialConfig.from_json(stored)
        return self.checked(self.function(trial))

    @staticmethod
    def checked(config: Any) -> TrialConfig:
        """What the space function returned, if it is a `TrialConfig`; else `ConfigError`."""
        if not isinstance(config, TrialConfig):
            raise ConfigError(
                f"the search space function returned {type(config).__name__}; it must return an rfopt.TrialConfig"
            )
        return config

    def overrides_for(self, parent: optuna.trial.FrozenTrial, params: Mapping[str, Any]) -> dict[str, Any]:
        """The clone overrides that give trial `parent`'s config the Optuna `params`: the fields in which the
        function's config for `params` (called on an `optuna.trial.FixedTrial`) differs from the parent's."""
        stored = TrialRecord(parent).config_json
        if stored is None:
            raise ConfigError(f"trial {parent.number} has no rfopt config")
        config = self.checked(self.function(optuna.trial.FixedTrial(dict(params), number=parent.number)))
        before = fields(TrialConfig.config_dict(stored))
        after = fields(TrialConfig.config_dict(config.to_json()))
        return {name: after.get(name) for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)}


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


def _distribution(name: str, values: list[Any], existing: Any) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution of a list param (`rfopt.config.params.distribution`): a range for numbers, else categorical;
    the study's own where its trials have the param already, widened to the list's values where a range can be."""
    try:
        return distribution(values, existing, name=name, given="the list now gives")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; use a new study name for this list") from None


def _suggest(trial: optuna.Trial, name: str, dist: optuna.distributions.BaseDistribution) -> None:
    """Set the enqueued value of a list param, under its distribution."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        trial.suggest_categorical(name, dist.choices)
    elif isinstance(dist, IntDistribution):
        trial.suggest_int(name, dist.low, dist.high)
    else:
        trial.suggest_float(name, dist.low, dist.high)


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``learning_rate 0.001 -> 0.005, ...``: the leaf fields that differ between two config dicts."""
    a, b = fields(old), fields(new)
    names = [n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    return ", ".join(f"{n.split('.', 1)[-1]} {a.get(n)!r} -> {b.get(n)!r}" for n in names[:4]) + (
        ", ..." if len(names) > 4 else "")


def _varying_fields(dicts: list[dict[str, Any]]) -> dict[str, tuple[str, list[Any]]]:
    """The fields that differ between configs, as Optuna params: param name -> (field path, value per config);
    `_distribution` says which distribution each gets."""
    flat = [fields(d) for d in dicts]
    paths = sorted(set().union(*flat))
    params: dict[str, tuple[str, list[Any]]] = {}
    for path in paths:
        # A GRPOConfig field a config leaves at its default is not stored: its value is the declared default.
        default = grpo_default(path.split(".", 1)[1]) if path.startswith("args.") else None
        values = [param_value(f.get(path, default)) for f in flat]
        if len({json.dumps(v) for v in values}) > 1:
            params[param_name(path, paths)] = (path, values)
    return params
