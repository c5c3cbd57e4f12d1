"""rfopt's records on a study: its identity, plan and settings (`StudyRecord`), a halt request (`Halt`), and the steps
population-based training decided (`PbtStep`); read and written here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rfopt.chunks import ChunkPlan

from ._keys import (
    _BASELINE,
    _CHECKPOINT_DIR,
    _HALT,
    _PBT_STEP,
    _PLAN,
    _RUN_SHAPE,
    _SETTINGS,
    _STUDY_ID,
    _set_study,
    study_attrs,
)
from ._values import _numbers, _sample, json_safe


@dataclass(frozen=True)
class Halt:
    """A request that every process running the study stop at its trials' next chunk boundary (``rfopt:halt``): the
    chunks in flight commit, the trials stay RUNNING and resumable. It applies to the processes that were running the
    study when it was made (`at`, seconds since the epoch); one started later runs."""

    by: str
    at: float

    def to_attr(self) -> dict[str, Any]:
        return {"by": self.by, "at": self.at}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Halt:
        return cls(by=str(value.get("by", "unknown")), at=float(value.get("at", 0.0)))


@dataclass(frozen=True)
class RunShape:
    """How the last run of a study trains it (``rfopt:run_shape``, written when a run starts): what a forecast of the
    time left needs besides the trials' own records (`rfopt.reports.forecast`)."""

    pruning: dict[str, Any]
    """The rung policy's schedule (`rfopt.pruning.Outlook.to_attr`)."""
    gang_size: int = 1
    """Trials trained at once per process (`rfopt.training.gang`)."""
    target_trials: int | None = None
    """Trials the study will have started once the run has asked every new trial it means to (None: not known, a
    run until a timeout or Ctrl-C)."""

    def to_attr(self) -> dict[str, Any]:
        return {"pruning": dict(self.pruning), "gang_size": self.gang_size, "target_trials": self.target_trials}

    @classmethod
    def from_attr(cls, value: Any) -> RunShape | None:
        if not isinstance(value, Mapping) or not isinstance(value.get("pruning"), Mapping):
            return None
        target = value.get("target_trials")
        return cls(dict(value["pruning"]), int(value.get("gang_size") or 1), None if target is None else int(target))


@dataclass(frozen=True)
class Baseline:
    """A base model evaluated as it is, with no adapter, on the study's eval set with its settings
    (``rfopt:baseline:<key>``): the reference its trials' values are read against. Trials that share a base model,
    reward functions and weights and a completion budget share one (`key`, `rfopt.training.baseline.baseline_key`;
    each trial names its own: `TrialRecord.baseline_key`). Written once per study, before its first trial trains."""

    key: str
    model: str
    """The base model as a person names it (a Hub id, a directory, ``smollm2``)."""
    objective: str
    value: float
    """The study's objective on the eval set: what a trial's value compares with."""
    metrics: dict[str, float]
    """Its eval metrics, as a trial's unit stores them (reward means, spreads, diversity)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    at: float = 0.0
    """When it was evaluated (seconds since the epoch)."""
    seconds: float = 0.0
    """How long the evaluation took."""

    def to_attr(self) -> dict[str, Any]:
        return json_safe({"model": self.model, "objective": self.objective, "value": self.value,
                          "metrics": self.metrics, "samples": self.samples, "at": self.at, "seconds": self.seconds})

    @classmethod
    def from_attr(cls, key: str, value: Any) -> Baseline | None:
        if not isinstance(value, Mapping):
            return None
        try:
            return cls(key=key, model=str(value["model"]), objective=str(value["objective"]), value=float(value["value"]),
                       metrics=_numbers(value.get("metrics")),
                       samples=[_sample(x) for x in value.get("samples") or [] if isinstance(x, Mapping)],
                       at=float(value.get("at", 0.0)), seconds=float(value.get("seconds", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class StudyRecord:
    """rfopt's attrs on a study. A study rfopt never planned has no plan (and no identity until it runs)."""

    uid: str | None
    checkpoint_dir: str | None
    plan: ChunkPlan | None
    settings: dict[str, Any]
    """``num_chunks``, ``chunk_seed``, ``objective``, ``eval_settings``, ``train_fingerprint``, ``eval_fingerprint``: what
    every trial must share to be compared."""
    halt: Halt | None = None
    """The last request that every process running the study stop (`rfopt.engine.trials.ops.halt`)."""
    run_shape: RunShape | None = None
    """How its last run trains it: the pruner's schedule, the gang size, the trials it means to start."""
    baselines: dict[str, Baseline] = field(default_factory=dict)
    """Its base models evaluated with no adapter (`Baseline`), by key; empty before its first trial starts."""

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> StudyRecord:
        plan = attrs.get(_PLAN)
        halt = attrs.get(_HALT)
        baselines = {key[len(_BASELINE):]: Baseline.from_attr(key[len(_BASELINE):], value)
                     for key, value in attrs.items() if key.startswith(_BASELINE)}
        return cls(
            uid=attrs.get(_STUDY_ID),
            checkpoint_dir=attrs.get(_CHECKPOINT_DIR),
            plan=None if plan is None else ChunkPlan.from_dict(plan),
            settings={name: attrs[key] for name, key in _SETTINGS.items() if key in attrs},
            halt=Halt.from_attr(halt) if isinstance(halt, Mapping) else None,
            run_shape=RunShape.from_attr(attrs.get(_RUN_SHAPE)),
            baselines={key: baseline for key, baseline in baselines.items() if baseline is not None},
        )

    @property
    def objective(self) -> str:
        return self.settings.get("objective", "reward")

    @property
    def planned(self) -> bool:
        return self.plan is not None


def study_record(study: Any) -> StudyRecord:
    """The record of an `optuna.Study` (or a `FrozenStudy`, as storages list them)."""
    return StudyRecord.of(study_attrs(study))


def write_identity(study: Any, uid: str, checkpoint_dir: str) -> None:
    """Give the study its identity and checkpoint location (once, when it first runs; see `study.py`)."""
    _set_study(study, _STUDY_ID, uid)
    _set_study(study, _CHECKPOINT_DIR, checkpoint_dir)


def write_checkpoint_dir(study: Any, checkpoint_dir: str) -> None:
    _set_study(study, _CHECKPOINT_DIR, checkpoint_dir)


def write_plan(study: Any, plan: ChunkPlan) -> None:
    _set_study(study, _PLAN, plan.to_dict())


def write_run_shape(study: Any, shape: RunShape) -> None:
    _set_study(study, _RUN_SHAPE, shape.to_attr())


def write_baseline(study: Any, baseline: Baseline) -> None:
    _set_study(study, f"{_BASELINE}{baseline.key}", baseline.to_attr())


def write_halt(study: Any, halt: Halt) -> None:
    _set_study(study, _HALT, halt.to_attr())


def write_settings(study: Any, settings: Mapping[str, Any]) -> None:
    """Store study settings (`StudyRecord.settings` names) that the study does not have yet. The objective also
    names the study's metric (Optuna's ``set_metric_names``): optuna-dashboard then calls it by its name, not
    "Objective 0"."""
    for name, value in settings.items():
        _set_study(study, _SETTINGS[name], value)
    if "objective" in settings:
        name_metric(study, str(settings["objective"]))


def name_metric(study: Any, objective: str) -> None:
    """Name the study's one metric after its objective (Optuna's ``set_metric_names``), unless it is so named."""
    import warnings

    import optuna

    if len(study.directions) != 1 or study.metric_names == [objective]:
        return
    with warnings.catch_warnings():  # experimental in Optuna 5.0, and stable since 3.2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([objective])


@dataclass(frozen=True)
class Replacement:
    """One member of a population replaced at a PBT step: by a warm clone of `parent` with `params` explored."""

    trial: int
    parent: int
    params: dict[str, Any]
    """The clone's Optuna params (the parent's, with the explored ones changed)."""
    changed: dict[str, list[Any]]
    """Explored params that changed: name -> [parent's value, clone's value]."""
    token: str
    """The clone's lineage token: finds the clone again after a crash, so it is made once."""

    def to_attr(self) -> dict[str, Any]:
        return {"trial": self.trial, "parent": self.parent, "params": dict(self.params),
                "changed": {k: list(v) for k, v in self.changed.items()}, "token": self.token}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Replacement:
        return cls(trial=int(value["trial"]), parent=int(value["parent"]), params=dict(value["params"]),
                   changed={k: list(v) for k, v in value.get("changed", {}).items()}, token=str(value["token"]))


@dataclass(frozen=True)
class PbtStep:
    """What population-based training decided at one step (``rfopt:pbt:<step>`` on the study), stored once, before
    any clone is made or any member stopped: a crash in between is finished from it, never decided again."""

    step: int
    ranking: tuple[int, ...]
    """The population at the step (every trial with a value there, FAIL excepted), best first."""
    replacements: tuple[Replacement, ...]
    stopped: tuple[int, ...] = ()
    """Members stopped without a replacement: the unit budget left no room."""
    reasons: dict[int, str] = field(default_factory=dict)
    """Why each member was kept, replaced or stopped, by trial number."""

    def to_attr(self) -> dict[str, Any]:
        return {"ranking": list(self.ranking), "replacements": [r.to_attr() for r in self.replacements],
                "stopped": list(self.stopped), "reasons": {str(k): v for k, v in self.reasons.items()}}

    @classmethod
    def from_attr(cls, step: int, value: Mapping[str, Any]) -> PbtStep:
        return cls(step=step, ranking=tuple(int(n) for n in value["ranking"]),
                   replacements=tuple(Replacement.from_attr(r) for r in value["replacements"]),
                   stopped=tuple(int(n) for n in value.get("stopped", [])),
                   reasons={int(k): str(v) for k, v in value.get("reasons", {}).items()})


def load_pbt_step(study: Any, step: int) -> PbtStep | None:
    value = study_attrs(study).get(f"{_PBT_STEP}{step}")
    return None if value is None else PbtStep.from_attr(step, value)


def pbt_steps(study: Any) -> list[PbtStep]:
    """Every population-based training step stored on the study, in step order."""
    attrs = study_attrs(study)
    steps = sorted(int(k[len(_PBT_STEP):]) for k in attrs if k.startswith(_PBT_STEP))
    return [PbtStep.from_attr(step, attrs[f"{_PBT_STEP}{step}"]) for step in steps]


def write_pbt_step(study: Any, decided: PbtStep) -> None:
    _set_study(study, f"{_PBT_STEP}{decided.step}", decided.to_attr())
