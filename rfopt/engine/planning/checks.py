"""What a run is checked for before anything is stored: the study's name, the datasets, the search space's configs
against the chunk plan, the objective and the datasets' columns, the study's settings against the stored ones, the
pruner, population-based training. `check_run` refuses what would fail every trial, naming the field and the fix;
what it returns (`CheckedRun`) is what the run trains with and what the study stores once it runs
(`rfopt.engine.running.run`).

    >>> checked = check_run(study.optuna, RunRequest(space, train, test, n_trials=8))   # doctest: +SKIP
    >>> checked.plan.num_chunks, checked.settings.objective                             # doctest: +SKIP
    (4, 'reward')
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from rfopt import compat
from rfopt.chunks import ChunkPlan, dataset_fingerprint, rows_left_out, trial_schedule
from rfopt.config.rewardfuncs import reward_columns, reward_name
from rfopt.config.settings import StudySettings
from rfopt.config.spaces import ListSpace, as_space
from rfopt.config.trial import TrialConfig
from rfopt.config.usercode import importing_user_file, study_on_import
from rfopt.errors import ConfigError, MissingPackage, PlanError, Refusal, StudyNameError, TypeRefusal
from rfopt.pruning import PopulationBasedTraining
from rfopt.storage import schema
from rfopt.storage.schema import study_record
from rfopt.training.quantization import bitsandbytes_refusal
from rfopt.training.rollouts.batched import decode_env
from rfopt.training.trackers import check as check_trackers
from rfopt.training.trackers import normalize as trackers_of

from rfopt.engine.trials.population import explorable

from .request import RunRequest

logger = logging.getLogger("rfopt")


@dataclass(frozen=True)
class CheckedRun:
    """A `RunRequest` checked against the study: what the run trains with, and what the study stores once it runs."""

    request: RunRequest
    space: Any
    """The request's space as a search space (`rfopt.config.spaces`)."""
    plan: ChunkPlan
    """The study's chunk plan: the stored one, or the one it is planned with now."""
    settings: StudySettings
    """Every setting of the study, resolved (`StudySettings.resolved`)."""
    attrs: dict[str, Any]
    """The settings and the datasets' fingerprints, as the study stores them."""
    configs: list[TrialConfig]
    """The configs checked: a list's, or one sampled from a function space."""
    report_to: list[str]
    """The trackers the trials report to (`rfopt.training.trackers`): the one given, else the study's stored one."""
    pruner: Any
    """What judges the study's rungs: an Optuna pruner, or `rfopt.PopulationBasedTraining` (`rfopt.pruning.RungPolicy`)."""
    deadline: float | None
    """`time.monotonic()` after which no unit starts (`timeout`)."""

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def check_run(study: optuna.Study, request: RunRequest) -> CheckedRun:
    """Check `request` against the study and its datasets (its arguments were checked when it was made); nothing is
    written."""
    started = time.monotonic()
    script = importing_user_file()
    if script is not None:  # what the check of the file's top level (`rfopt.config.usercode.study_on_import`) missed
        raise study_on_import(script, "a study run reached while importing it")
    check_study_name(study.study_name)  # a study made by Optuna itself, with any name, becomes folders here
    space = as_space(request.space)
    train_dataset, eval_dataset, n_trials = request.train_dataset, request.eval_dataset, request.n_trials
    _check_dataset(train_dataset, "train_dataset")
    _check_dataset(eval_dataset, "eval_dataset")
    if request.n_trials_total is not None and isinstance(space, ListSpace):
        raise Refusal("n_trials_total is for a search space function; a study driven by a list of configs "
                         "runs its configs (n_trials limits how many of them this call starts)")
    pruner = request.pruner if request.pruner is not None else study.pruner
    check_pruner(pruner)
    decode_env(None if request.executor is not None else request.device)  # a cluster's workers have their own devices
    record = study_record(study)
    settings = request.settings.resolved(StudySettings.from_attrs(record.settings, record.plan), study.study_name)
    plan = record.plan
    if plan is not None:
        if plan.num_rows != len(train_dataset):
            raise PlanError(
                f"study {study.study_name!r} was planned with a train_dataset of {plan.num_rows} rows; this call "
                f"gives {len(train_dataset)}. Use the same dataset to continue it, or a new study name"
            )
    else:
        plan = ChunkPlan.build(len(train_dataset), settings.num_chunks, settings.chunk_seed)
    attrs = {"train_fingerprint": dataset_fingerprint(train_dataset),
             "eval_fingerprint": dataset_fingerprint(eval_dataset)}
    for name, value in attrs.items():
        if name in record.settings and record.settings[name] != value:
            raise Refusal(f"study {study.study_name!r}: {_SETTING_CHANGED[name](record.settings[name], value)}; "
                             "trials would not be comparable. Use the same one to continue the study, or a new "
                             "study name")
    attrs.update(settings.to_attrs())
    sample = None
    if isinstance(space, ListSpace):
        configs = list(enumerate(space.configs))
        left = space.check_study(study)
        if n_trials is not None and n_trials > left:
            raise Refusal(
                f"n_trials={n_trials}, but {left} of the list's {len(space)} configs are left to run; a study "
                "driven by a list of configs runs its configs: leave n_trials out to run them all, or append "
                "configs to the list"
            )
    else:
        sample = _sample_config(space, study.direction)
        # The study's own inputs (plan, objective, datasets) are checked against one sampled config.
        configs = [] if sample is None else [("the search space function's config", sample.config)]
    for where, config in configs:  # refuse what would fail every trial before training anything
        label = f"configs[{where}]" if isinstance(where, int) else where
        try:
            if isinstance(where, int):  # a function's configs vary: each is validated as its trial starts
                config.validate()
            config.to_json()  # what cannot be stored (a function no other process can import) fails every trial
            trial_schedule(plan, config.args)
            _check_objective(settings.objective, config)
            _check_columns(config, train_dataset, "train_dataset")
            _check_columns(config, eval_dataset, "eval_dataset")
            if request.executor is None:  # a cluster's workers have their own devices and packages
                refused = bitsandbytes_refusal(config, request.device)
                if refused is not None:
                    raise ConfigError(refused)
        except ValueError as exc:  # a Refusal (ConfigError, PlanError, ...): the note says which config it refuses
            exc.add_note(f"in {label}")
            raise
    _check_population(pruner, space, plan, [config for _, config in configs], sample)
    _say_rows_left_out(study, plan, configs)
    # The stored trackers are checked too: one uninstalled since would fail every trial.
    trackers = trackers_of(request.report_to if request.report_to is not None
                           else record.settings.get("report_to", []))
    check_trackers(trackers)  # one that cannot log here (unreachable, no credentials) would lose every trial's run
    return CheckedRun(request, space, plan, settings, attrs, [config for _, config in configs], trackers, pruner,
                      None if request.timeout is None else started + request.timeout)


def _say_rows_left_out(study: optuna.Study, plan: ChunkPlan, configs: list[tuple[Any, TrialConfig]]) -> None:
    """Warn, naming how many, when the chunk plan leaves training rows out of a config's training (a chunk holds
    whole steps; the rows do not divide into chunks): the config that leaves the most out."""
    notes = []
    for where, config in configs:
        left = rows_left_out(plan, config.args)
        if left is not None:
            notes.append((-left[0], f"configs[{where}]" if isinstance(where, int) else where, left[1]))
    if notes:
        _, label, note = min(notes)
        logger.warning("study %r: %s: %s", study.study_name, label, note)


def say_placement(placement: Any, checked: CheckedRun) -> None:
    """Warn when configs ask for a precision (``bf16``, ``fp16``) the device does not train in: placement is the
    device's (`rfopt.training.models.Placement`), and a config's own fields are not used."""
    precision = "bf16" if placement.bf16 else "fp16" if placement.fp16 else "fp32"
    asked = {}
    for index, config in enumerate(checked.configs):
        fields = [f"{name}=True" for name in ("bf16", "fp16") if getattr(config.args, name) and not getattr(placement, name)]
        if fields:
            label = f"configs[{index}]" if isinstance(checked.space, ListSpace) else "the search space function's config"
            asked[label] = ", ".join(fields)
    if asked:
        which = "; ".join(f"{label} sets {fields}" for label, fields in asked.items())
        logger.warning("%s, which rfopt does not use: where a chunk trains, and in what precision, is the device's "
                       "choice, and this study trains in %s on %s. Give the precision to the run instead: "
                       "optimize(device=..., precision=...), rfopt run --device cuda --precision bf16", which,
                       precision, placement.device)
    study_trackers = list(checked.report_to or [])
    for index, config in enumerate(checked.configs):  # a TRL user writes report_to in the GRPOConfig: not used here
        if list(config.args.report_to or []) not in ([], study_trackers):
            label = f"configs[{index}]" if isinstance(checked.space, ListSpace) else "the search space function's config"
            logger.warning("%s sets report_to=%s in its GRPOConfig, which rfopt does not use: the study's report_to "
                           "applies to every trial (now %s). Give it to the study instead: create_study(report_to=...), "
                           "optimize(report_to=...), rfopt run --report-to", label, list(config.args.report_to),
                           study_trackers or "none")
            break



STUDY_NAME_MAX = 128
"""The longest study name, in characters (also at most `STUDY_NAME_MAX_BYTES` in UTF-8): the checkpoint folder
``<name>-<id>`` must fit a file system's 255-byte name."""
STUDY_NAME_MAX_BYTES = 200
STUDY_NAME_PUNCTUATION = "._-+=@ "
"""What a study name may hold besides letters and digits."""
STUDY_NAME_RULE = (f"a study name is also a folder name (rfopt-checkpoints/<name>-<id>, a tracker's run): use "
                   f"letters, digits, spaces and {' '.join(STUDY_NAME_PUNCTUATION.strip())}, at most {STUDY_NAME_MAX} "
                   "characters, not starting with '.', '-' or a space")


def check_study_name(name: Any) -> None:
    """Refuse a study name that would choose a location: a path separator, a leading ``.``, ``~`` or ``-``, a
    control character, or more than `STUDY_NAME_MAX` characters (`STUDY_NAME_RULE` says what is allowed). None is
    Optuna's generated name.

        >>> check_study_name("../../x")                                       # doctest: +SKIP
        StudyNameError: study name '../../x': '/' is not allowed; a study name is also a folder name ...
    """
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeRefusal(f"study_name must be text, got {type(name).__name__} {name!r}")
    shown = repr(name if len(name) <= 60 else name[:60] + "...")
    problem = None
    if not name.strip():
        problem = "it is empty"
    elif len(name) > STUDY_NAME_MAX or len(name.encode()) > STUDY_NAME_MAX_BYTES:
        problem = f"it is {len(name)} characters long"
    elif bad := sorted({c for c in name if not (c.isalnum() or c in STUDY_NAME_PUNCTUATION)}):
        problem = f"{', '.join(repr(c) for c in bad)} {'is' if len(bad) == 1 else 'are'} not allowed"
    elif name[0] in ".- ":
        problem = f"it starts with {name[0]!r}"
    elif name[-1] == " ":
        problem = "it ends with a space"
    if problem is not None:
        raise StudyNameError(f"study name {shown}: {problem}; {STUDY_NAME_RULE}. Nothing was stored")



def _check_dataset(dataset: Any, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None or not hasattr(dataset, "select"):
        raise TypeRefusal(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}")
    if "prompt" not in columns:
        raise Refusal(
            f"{name} has no 'prompt' column (columns: {columns}); rename the column holding the prompts to 'prompt', "
            "e.g. dataset.rename_column('question', 'prompt')"
        )
    if len(dataset) == 0:
        use = "training splits it into chunks" if name == "train_dataset" else "evaluation after each chunk needs it"
        raise Refusal(f"{name} is empty; {use}: give at least one row")
    for i, prompt in enumerate(dataset["prompt"]):
        if not _is_prompt(prompt):
            shown = repr(prompt)
            raise Refusal(
                f"{name} row {i}: the prompt is {type(prompt).__name__} {shown[:80]}; a prompt is text, or a list of chat "
                "messages such as [{'role': 'user', 'content': '...'}]. Fix or drop such rows, e.g. "
                f"{name}.filter(lambda row: isinstance(row['prompt'], str))"
            )


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def _check_objective(objective: str, config: TrialConfig) -> None:
    names = config.reward_names
    if objective != "reward" and objective not in names:
        raise Refusal(f"objective={objective!r} is neither 'reward' (the weighted total of the rewards) nor the "
                         f"name of one of the reward functions {names}")


def _check_columns(config: TrialConfig, dataset: Any, name: str) -> None:
    """Refuse a dataset that lacks a column a reward function declares as a parameter (TRL passes every column)."""
    for func in config.reward_funcs:
        missing = [c for c in reward_columns(func) if c not in dataset.column_names]
        if missing:
            raise Refusal(
                f"reward function {reward_name(func)!r} takes {', '.join(map(repr, missing))}, which {name} has no "
                f"column for (its columns: {dataset.column_names}); add the column, or give the parameter a default"
            )


def check_pruner(pruner: Any) -> None:
    """Refuse a pruner that cannot run here (before the study trains anything that it would then fail to judge)."""
    import importlib.util

    while isinstance(pruner, optuna.pruners.PatientPruner):
        pruner = compat.pruner_settings(pruner)["wrapped_pruner"]
    if isinstance(pruner, optuna.pruners.WilcoxonPruner) and importlib.util.find_spec("scipy") is None:
        raise MissingPackage("WilcoxonPruner needs scipy, which is not installed: pip install scipy (or choose "
                          "another pruner)")


def _check_population(pruner: Any, space: Any, plan: ChunkPlan, configs: list[TrialConfig],
                      sample: _Sample | None) -> None:
    """Refuse population-based training that would never act, or whose clones would copy their parents: a list that
    varies no param, `params` naming a param the space does not search (a typo) or one no warm-started clone can
    change (the model, the adapter's shape), no explorable param at all, or an `interval` the trials never reach.
    `sample`: a function space's config drawn on scratch trials (None for a list, or where the function raised)."""
    if not isinstance(pruner, PopulationBasedTraining):
        return
    named = list(pruner.params) if pruner.params is not None else None
    if isinstance(space, ListSpace):
        searched = sorted(space.distributions)
        if not searched:
            raise Refusal("PopulationBasedTraining explores the trials' searched params (their Optuna params), and "
                             "this list of configs varies none: its clones would copy their parents unchanged. List "
                             "configs that differ in what to explore (e.g. learning_rate), or search with a function "
                             "space")
        missing = sorted(set(named or ()) - set(searched))
        if missing:
            raise Refusal(f"PopulationBasedTraining(params={named}): the list of configs does not vary "
                             f"{missing}, so they are not searched params and have no range to explore in; its "
                             f"searched params are {searched}")
        parent = _scratch_member(space.configs[0], {name: values[0] for name, values in space.params.items()},
                                 space.distributions)
    elif sample is None:
        return  # the function raised on a scratch trial: each trial is checked as it runs, and the plan warns
    else:
        if set(named or ()) - set(sample.distributions):  # one draw may miss a param suggested only sometimes
            searched = _searched_params(space, SAMPLE_DRAWS) | set(sample.distributions)
            missing = sorted(set(named or ()) - searched)
            if missing:
                raise Refusal(f"PopulationBasedTraining(params={named}): the search space function suggests no "
                                 f"param {missing} (in {SAMPLE_DRAWS} calls on scratch trials it suggested "
                                 f"{sorted(searched)}); a param is named as the function suggests it "
                                 "(trial.suggest_float('learning_rate', ...) is 'learning_rate')")
        parent = _scratch_member(sample.config, sample.params, sample.distributions)
    changeable = explorable(pruner, space, parent)
    fixed = [name for name in (named or ()) if name in parent.distributions and name not in changeable]
    if fixed:
        raise Refusal(f"PopulationBasedTraining(params={named}): a warm-started clone cannot change {fixed} (it "
                         "loads its parent's weights, so the model and the adapter's shape stay; a param with one "
                         "value has nothing to change to): its clones would copy their parents in them. Leave them "
                         "out of params")
    if not changeable:
        raise Refusal(f"PopulationBasedTraining: no searched param ({sorted(parent.distributions)}) can change in a "
                         "warm-started clone (it loads its parent's weights, so the model and the adapter's shape "
                         "stay), so every clone would copy its parent. Search a param it can explore, such as "
                         "learning_rate or lora_alpha")
    units = max((trial_schedule(plan, config.args).num_units for config in configs), default=None)
    if units is not None and pruner.interval >= units:
        raise Refusal(f"PopulationBasedTraining(interval={pruner.interval}): the trials train {units} chunks "
                         f"({plan.num_chunks} chunks a pass over the train set), and it acts every {pruner.interval} "
                         f"chunks but never after a trial's last, so it would never act. Give interval <= "
                         f"{units - 1}, or more chunks (num_chunks)")


def _scratch_member(config: TrialConfig, params: dict[str, Any], distributions: dict[str, Any]) -> FrozenTrial:
    """A trial with `config` and `params`, in no study: what a population's member looks like to its clones."""
    return optuna.trial.create_trial(params=params, distributions=distributions, value=0.0,
                                     user_attrs=schema.new_trial_attrs(config.to_json()))


@dataclass(frozen=True)
class _Sample:
    """A function space's config, drawn on a scratch trial of an in-memory study (nothing is stored)."""

    config: TrialConfig
    params: dict[str, Any]
    distributions: dict[str, Any]


SAMPLE_DRAWS = 8
"""Scratch calls of a function space whose suggested param names are gathered (`_searched_params`)."""


def _sample_config(space: Any, direction: Any) -> _Sample | None:
    """A config of a function space, from one call on a scratch trial of an in-memory study (nothing is stored), to
    check the study before it starts; None if the function raises there (a trial it fails on fails alone, with the
    reason)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(direction=direction, sampler=optuna.samplers.RandomSampler(seed=0))
        trial = scratch.ask()
        config = space.function(trial)
    except Exception as exc:  # noqa: BLE001 - checked again, trial by trial, when the study runs
        logger.debug("the search space function raised on a scratch trial (%s); not checked before the run", exc)
        return None
    finally:
        optuna.logging.set_verbosity(verbosity)
    return _Sample(space.checked(config), dict(trial.params), dict(trial.distributions))


def _searched_params(space: Any, draws: int) -> set[str]:
    """The names of the params a function space suggests in `draws` calls on scratch trials (a param suggested only
    for some configs shows in some); the calls that raise are skipped."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names: set[str] = set()
    try:
        scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
        for _ in range(draws):
            trial = scratch.ask()
            try:
                space.function(trial)
            except Exception:  # noqa: BLE001 - a draw the function fails on adds nothing
                pass
            names |= set(trial.distributions)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return names


_SETTING_CHANGED = {
    "train_fingerprint": lambda old, new: (f"this call's train_dataset is not the one it was run with (fingerprint "
                                           f"{new}, recorded {old})"),
    "eval_fingerprint": lambda old, new: (f"this call's eval_dataset is not the one its trials were evaluated on "
                                          f"(fingerprint {new}, recorded {old})"),
}
