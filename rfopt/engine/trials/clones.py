"""Clones: a new trial with its parent's config changed by overrides, validated before anything is written, optionally
warm-started from the parent's latest checkpoint (its weights; a fresh LR schedule over the remaining steps; it reports
at the parent's step numbers onward). Its lineage is stored on it, and its Optuna params say what it trains.

    >>> study.clone_trial(3, {"learning_rate": 2e-6}, warm_start=True)        # doctest: +SKIP
    7
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.trial import TrialState

from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.config.overrides import override_dict
from rfopt.config.params import admits, field_path, param_holding, param_name, param_value
from rfopt.config.trial import TrialConfig, check_model
from rfopt.errors import ConfigError, OpError
from rfopt.values import is_number
from rfopt.storage import crashpoints, schema
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.schema import Lineage, TrialRecord

from .ops import find_trial

logger = logging.getLogger("rfopt")

# LoRA fields a warm-started clone may change: they do not change the adapter's weight shapes.
_WARM_SAFE_PEFT_FIELDS = {"lora_alpha", "lora_dropout"}


@dataclass(frozen=True)
class Clone:
    """A clone that was enqueued: its number, what the person cloning must know (what could not be checked where
    it was made; a value Optuna's params hold under another name), and the overrides as the clone's config holds
    them (typed: ``{"learning_rate": 2e-06}`` for the text ``"2e-6"``)."""

    number: int
    notes: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    start_unit: int = 0
    """A warm clone's start: its parent's units in the checkpoint it starts from (it trains chunk `start_unit` + 1
    next)."""

    def _start(self, warm_start: bool) -> str:
        return f"from its parent's checkpoint after chunk {self.start_unit}" if warm_start else ""

    def describe(self, parent: int, warm_start: bool) -> str:
        """``trial 7: clone of trial 3 with learning_rate=2e-06 enqueued from its parent's checkpoint after chunk
        2``."""
        changes = ", ".join(f"{name}={value!r}" for name, value in self.overrides.items()) or "no changes"
        start = f" {self._start(warm_start)}" if warm_start else ""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return f"trial {self.number}: clone of trial {parent} with {changes} enqueued{start}{notes}"

    def describe_check(self, parent: int, warm_start: bool) -> str:
        """What a check-only clone found: ``a clone of trial 3 with learning_rate=2e-06 would be accepted ...``."""
        changes = ", ".join(f"{name}={value!r}" for name, value in self.overrides.items()) or "no changes"
        start = f", {self._start(warm_start)}" if warm_start else ""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return (f"checked: a clone of trial {parent} with {changes}{start} would be accepted (nothing written): its "
                f"config, chunk plan, first chunk's GRPOConfig and adapter (on the model's shape); not checked until it "
                f"trains: its model's weights, generation and reward scores{notes}")


def clone(
    study: optuna.Study,
    parent_number: int,
    overrides: Mapping[str, Any],
    *,
    warm_start: bool,
    plan: ChunkPlan,
    checkpoints: Any,
    by: str | None = None,
    token: str | None = None,
    params: Mapping[str, Any] | None = None,
    check_only: bool = False,
    replicate: schema.Replicate | None = None,
) -> Clone:
    """Enqueue a clone of trial `parent_number`. Nothing is written if anything is invalid.

    Checked first: every override (name, type, the values TRL, its optimizer and scheduler would refuse), the
    model if it changes, reward functions that the overrides name, the chunk plan for the new batch shape, and for
    a warm start the parent's checkpoint and an unchanged adapter shape. The parent's own reward functions are
    imported if they can be; where they cannot (a dashboard that does not have the study's code), the clone is
    still made, checked in every other way, and `Clone.notes` says so: the process running the study imports them.

    `token` names the clone's lineage (default: a new one), so that a caller can find it again (`clone_with_token`);
    `params` gives the clone's Optuna params where the caller knows them (population-based training explores params
    and derives the overrides from them). `check_only`: check everything, write nothing (the returned clone has no
    number: -1). `replicate`: the clone is a replicate of its parent (`rfopt.engine.trials.replicates`): its overrides change
    the seed alone, and its Optuna params stay the parent's (to Optuna, the same config).
    """
    parent = TrialRecord(find_trial(study, parent_number))
    if parent.config_json is None:
        raise OpError(f"trial {parent_number} has no rfopt config to clone")
    data = TrialConfig.config_dict(parent.config_json)
    notes: list[str] = []
    try:
        child_data, overrides, child, schedule = _child(data, overrides, plan, notes, check_only)
        # The config as stored: normalized by its own round trip where its code imports here, else as overridden.
        config_json = TrialConfig.json_of(child_data) if notes else child.to_json()
    except (ConfigError, ValueError) as exc:
        raise OpError(f"clone of trial {parent_number}: {exc}") from exc
    start_unit = 0
    state = None
    if warm_start:
        state = checkpoints.load(parent_number)
        if state is None:
            raise OpError(f"trial {parent_number} has no checkpoint yet; clone it without warm start, or after its first chunk")
        refusal = warm_start_refusal(data, child_data)
        if refusal is not None:
            raise OpError(f"clone of trial {parent_number}: {refusal}")
        start_unit = state.units_done
        if start_unit >= schedule.num_units:
            raise OpError(
                f"trial {parent_number} has trained all {schedule.num_units} chunks; a warm-started clone would have "
                "nothing left to train"
            )
    if check_only:
        return Clone(-1, tuple(notes), dict(overrides), start_unit)
    lineage = Lineage(parent=parent_number, overrides=dict(overrides), warm_start=warm_start, start_unit=start_unit,
                      by=by or schema.who(), at=schema.now(), **({"token": token} if token else {}))
    explored = dict(params or {})
    if replicate is not None:
        params, distributions = dict(parent.trial.params), dict(parent.trial.distributions)
    else:
        params, distributions = _clone_params(study, parent.trial, overrides, notes)
    params.update({name: value for name, value in explored.items()
                   if name in distributions and admits(distributions[name], value)})
    if state is not None:  # before the clone exists: whoever starts it, the moment it is enqueued, finds them
        checkpoints.save_warm_start(lineage.token, state.weights, parent_number, start_unit)
        crashpoints.reach("clone-weights-saved", trial=parent_number, unit=start_unit)
    try:
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                params=params,
                distributions=distributions,
                system_attrs={**schema.new_trial_attrs(config_json, lineage=lineage, replicate=replicate),
                              **(schema.inherited_steps(parent.trial, start_unit) if warm_start else {})},
            )
        )
    except BaseException:
        if state is not None and clone_with_token(study, lineage.token) is None:
            checkpoints.discard_warm_start(lineage.token)
        raise
    # Found by its token in any state: a process running the study may have started it already.
    number = clone_with_token(study, lineage.token)
    return Clone(number, tuple(notes), dict(overrides), start_unit)


def _child(data: dict[str, Any], overrides: Mapping[str, Any], plan: ChunkPlan, notes: list[str],
           check_only: bool) -> tuple[dict[str, Any], dict[str, Any], TrialConfig, Any]:
    """A clone's config dict, its overrides as it holds them, its config and its schedule, checked (`_checked`, then
    what its first chunk builds); raises `ConfigError` or `ValueError`."""
    child_data, overrides = override_dict(data, overrides)
    child = _checked(child_data, data, notes)
    schedule = trial_schedule(plan, child.args)
    _check_first_chunk(child, schedule, notes if check_only else [])  # Check says what it could not build
    return child_data, dict(overrides), child, schedule


def clone_refusal(parent: optuna.trial.FrozenTrial, overrides: Mapping[str, Any], *, plan: ChunkPlan,
                  warm_start: bool = True) -> str | None:
    """Why `clone` would refuse a clone of `parent` with `overrides` for what its config holds (TRL's and PEFT's
    refusals, a learning rate of 0, an adapter shape a warm start cannot load), or None: checked as `clone` checks
    it, with nothing written and no checkpoint read. Population-based training asks it before it plans a clone."""
    record = TrialRecord(parent)
    if record.config_json is None:
        return f"trial {parent.number} has no rfopt config to clone"
    data = TrialConfig.config_dict(record.config_json)
    try:
        child_data, _, _, _ = _child(data, overrides, plan, [], False)
    except (ConfigError, ValueError) as exc:
        return f"clone of trial {parent.number}: {exc}"
    refused = warm_start_refusal(data, child_data) if warm_start else None
    return None if refused is None else f"clone of trial {parent.number}: {refused}"


def clone_with_token(study: optuna.Study, token: str) -> int | None:
    """The number of the clone whose lineage has `token`, or None if no such clone was made."""
    for t in study.get_trials(deepcopy=False):
        lineage = TrialRecord(t).lineage
        if lineage is not None and lineage.token == token:
            return t.number
    return None


def warm_start_refusal(parent: Mapping[str, Any], child: Mapping[str, Any]) -> str | None:
    """Why a warm start from config dict `parent` to `child` is refused (a model or adapter shape change), or None."""
    if TrialConfig.base_model_of(parent) != TrialConfig.base_model_of(child):
        return "a warm start needs the parent's base model; the overrides change it"
    if (parent["peft_config"] is None) != (child["peft_config"] is None):
        return "a warm start cannot switch between an adapter and full fine-tuning"
    if parent["peft_config"] is not None:
        before, after = parent["peft_config"], child["peft_config"]
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        shape_changes = [k for k in changed if k not in _WARM_SAFE_PEFT_FIELDS]
        if shape_changes:
            return (f"a warm start loads the parent's adapter weights, so the adapter's shape must stay; the "
                    f"overrides change {shape_changes}. Clone without warm start to change them")
    return None


def clone_in_study(study: optuna.Study, parent_number: int, overrides: Mapping[str, Any], *, warm_start: bool,
                   by: str | None = None, check_only: bool = False) -> Clone:
    """`clone` with the study's own chunk plan and checkpoint store (as the API, the CLI and the dashboard clone)."""
    record = schema.study_record(study)
    if record.plan is None or record.checkpoint_dir is None:
        raise OpError(f"study {study.study_name!r} has not run yet (it has no chunk plan); run it before cloning trials")
    return clone(study, parent_number, overrides, warm_start=warm_start, plan=record.plan,
                 checkpoints=CheckpointStore(record.checkpoint_dir), by=by, check_only=check_only)


def _checked(child_data: dict[str, Any], parent_data: dict[str, Any], notes: list[str]) -> TrialConfig:
    """The clone's config, checked as far as this process can. Where the study's code (reward functions, callbacks,
    model factory) does not import here, its import paths are left unresolved, everything else is checked, and a note
    says so."""
    try:
        config = TrialConfig.from_dict(child_data)
    except ConfigError as exc:
        own_code = (child_data["reward_funcs"] == parent_data["reward_funcs"] and child_data["model"] == parent_data["model"]
                    and child_data.get("callbacks") == parent_data.get("callbacks"))
        if not own_code or "cannot be imported" not in str(exc):
            raise  # a reward or model factory the overrides name must import here
        notes.append(f"the study's code cannot be imported here ({exc}); the process running the study imports it, "
                     "so its reward functions were not checked here")
        config = TrialConfig.from_dict(child_data, resolve_code=False)
        config.validate(check_code=False)
        _check_model_if_changed(config, child_data, parent_data)
        return config
    config.validate()
    _check_model_if_changed(config, child_data, parent_data)
    return config


def _check_first_chunk(config: TrialConfig, schedule: Any, notes: list[str]) -> None:
    """Build what the clone's first chunk builds before it trains, without training: its GRPOConfig as a chunk trains
    it (the plan's ``max_steps``; TRL's own checks) and its adapter on the base model on the meta device (PEFT's own
    checks). What cannot be built here is said in `notes`."""
    from rfopt.training.loading import check_adapter, position_limit

    inert = _inert_values(config)
    if inert:
        raise ConfigError("; ".join(inert))
    limit, length = position_limit(config), config.args.max_completion_length
    if limit is not None and isinstance(length, int) and length >= limit:
        raise ConfigError(f"args.max_completion_length: {length} tokens, and {config.model!r} has {limit} positions "
                          f"(its max_position_embeddings) for a prompt and its completion together; give less than "
                          f"{limit}")
    try:
        replace(config.args, max_steps=schedule.total_steps, use_cpu=True, bf16=False, fp16=False,
                            report_to=[], save_strategy="no", generation_batch_size=None, model_init_kwargs=None)
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"args: TRL refuses the first chunk's GRPOConfig (max_steps={schedule.total_steps}): "
                          f"{exc}") from None
    note = check_adapter(config)
    if note is not None:
        notes.append(note)


def _inert_values(config: TrialConfig) -> list[str]:
    """What TRL and PEFT accept in a clone that trains nothing or trains wrongly: a learning rate or ``lora_alpha`` of 0
    or less (the adapter's scale is ``lora_alpha / r``), a negative clipping range. (A study's own configs may keep a
    learning rate of 0, a control that never moves; a clone is made to train.)"""
    problems = []
    lr = config.args.learning_rate
    if is_number(lr) and lr <= 0:
        problems.append(f"args.learning_rate: {lr}; give a number > 0 (a clone with a learning rate of {lr} trains "
                        "nothing)")
    for name in ("epsilon", "epsilon_high"):
        value = getattr(config.args, name, None)
        if is_number(value) and value < 0:
            problems.append(f"args.{name}: {value}; the clipping range is a number >= 0 (TRL's default epsilon: 0.2)")
    alpha = getattr(config.peft_config, "lora_alpha", None)
    if is_number(alpha) and alpha <= 0:
        problems.append(f"peft_config.lora_alpha: {alpha}; give a number > 0 (the adapter's scale is lora_alpha / r)")
    return problems


def _check_model_if_changed(config: TrialConfig, child_data: dict[str, Any], parent_data: dict[str, Any]) -> None:
    """A model that cannot be found (asked only when the overrides change the model); what training refuses is
    checked by `TrialConfig.validate`."""
    if TrialConfig.base_model_of(child_data) != TrialConfig.base_model_of(parent_data):
        check_model(config)


def _clone_params(study: optuna.Study, parent: optuna.trial.FrozenTrial, overrides: Mapping[str, Any],
                  notes: list[str] | None = None):
    """The clone's Optuna params: the parent's, with every overridden value recorded, so that Optuna's parameter views
    (optuna-dashboard's, `trials_dataframe`, `best_params`, importance) describe the clone and not its parent.

    Each overridden value goes to the param `rfopt.config.params.param_holding` names for its field's param (named as a list
    study names it, `rfopt.config.params`): that param where it holds the value (a number outside the range widens it); a
    new param for a field the study has none for; and for a categorical param that cannot gain the value as a choice
    (Optuna fixes a categorical's choices once trials have it), an alternate param ``<name>#2`` (``#3``, ...), said in
    `notes` (shown where the clone is made) and on the leaderboard and page (`held_as`). The parent's value of that
    field never stays in the clone's params.
    """
    params = dict(parent.params)
    distributions = dict(parent.distributions)
    known: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        for name, dist in trial.distributions.items():
            known.setdefault(name, dist)
    for given, value in overrides.items():
        path = field_path(given)
        name = path if path in known else param_name(path)  # a list study's param may be the field's path
        value = param_value(value)
        study_dist = distributions.get(name) or known.get(name)
        held = param_holding(name, value, {**known, **distributions})
        params.pop(name, None)
        distributions.pop(name, None)
        if held is None:  # an unbounded name space makes this unreachable in practice
            logger.warning("clone of trial %d: %s=%r cannot be an Optuna param of the study; it is in the clone's "
                           "config", parent.number, name, value)
            continue
        holder, dist = held
        params[holder], distributions[holder] = value, dist
        if holder != name and notes is not None:
            notes.append(f"{name}={value!r} cannot be a value of the study's param {name!r} ({_shown(study_dist)}): "
                         f"Optuna fixes a param's kind, and a categorical's choices, once trials have it. The clone's "
                         f"Optuna params hold it as {holder!r}; its config, study.best_config, the leaderboard and the "
                         "dashboard's page say what it trains")
    return params, distributions


def _shown(dist: Any) -> str:
    """A distribution as a person reads it: ``choices ['a', 'b']``, ``a range 0.001..0.01 (log)``."""
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    return f"a range {dist.low}..{dist.high}{' (log)' if dist.log else ''}"
