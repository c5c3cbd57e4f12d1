"""Every ``rfopt:*`` key rfopt keeps in an Optuna storage, and the typed records they hold.

rfopt keeps a study's state in Optuna's own storage, as *system* attrs (JSON) of the study and its trials, so that
any process on any host can continue, steer or show a study from the storage alone. This module is the only place
that spells those keys: the engine, ops, the command line and the dashboard read a `StudyRecord` or a `TrialRecord`
and write through the functions below.

Why system attrs: user attrs are the user's. optuna-dashboard shows every user attr of a trial in its trial page and
trial table (as text cut at 1024 characters, so rfopt's JSON records made the page thousands of pixels wide) and a
study's user attrs on the study page; it shows no system attrs. Optuna, its samplers and `trials_dataframe` leave
``rfopt:*`` system attrs alone. A study written by an earlier rfopt keeps its records in user attrs: they are read
from there too (`TrialRecord`, `StudyRecord`; a system attr wins over a user attr of the same key), and new records go
to system attrs.

On the study:  ``rfopt:id`` (its identity, which its checkpoint location carries), ``rfopt:checkpoint_dir``,
``rfopt:plan`` (the chunk plan), ``rfopt:objective``, ``rfopt:eval`` (evaluation settings),
``rfopt:train_fingerprint``, ``rfopt:eval_fingerprint``, ``rfopt:report_to`` (the trackers its trials report to),
``rfopt:pbt:<step>`` (a population-based training step: who is replaced by a clone of whom, with what values),
``rfopt:halt`` (a request that every process running the study stop at its trials' next chunk boundary).

On a trial:    ``rfopt:config`` (the resolved `TrialConfig` as JSON), ``rfopt:list_index`` (its place in a
list of configs), ``rfopt:schedule``, ``rfopt:clone`` (lineage), ``rfopt:metrics:<unit>`` and
``rfopt:samples:<unit>`` (per chunk unit), ``rfopt:steps:<unit>`` (TRL's logs of each optimizer step of the unit, by
column: see `StepColumns`), ``rfopt:pruning:<step>`` (rung decisions),
``rfopt:request:<time>-<id>`` (op requests, one key each, never rewritten), ``rfopt:withdrawn:<id>`` (a
request taken back before it applied) and ``rfopt:ops`` (the ops applied, with the id of each request),
``rfopt:cancelled`` (a WAITING clone cancelled before it started), ``rfopt:paused``, ``rfopt:stopped``, ``rfopt:fail_reason``,
``rfopt:adapter``, ``rfopt:progress`` (where the chunk it trains now stands: see `ProgressRecord`) and
``rfopt:gang:<unit>`` (the gang that trains the unit: see `GangPlan`).

A trial's progress is its reported intermediate values: unit ``u`` is committed once step ``u`` is
reported (`TrialRecord.committed`). Nothing else counts progress; ``rfopt:progress`` only says how far the unit in
flight has got.

    >>> record = TrialRecord(study.trials[3])                          # doctest: +SKIP
    >>> record.committed, record.paused, [r.op for r in record.pending]  # doctest: +SKIP
    (2, False, ['stop'])
"""

from __future__ import annotations

import datetime
import getpass
import math
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.compat import storage_of, study_id_of, trial_id_of

# ---------------------------------------------------------------------- keys (spelled here only)
_STUDY_ID = "rfopt:id"
_CHECKPOINT_DIR = "rfopt:checkpoint_dir"
_PLAN = "rfopt:plan"
_SETTINGS = {"objective": "rfopt:objective", "eval_settings": "rfopt:eval", "train_fingerprint": "rfopt:train_fingerprint",
             "eval_fingerprint": "rfopt:eval_fingerprint", "num_chunks": "rfopt:num_chunks",
             "chunk_seed": "rfopt:chunk_seed", "report_to": "rfopt:report_to"}

_CONFIG = "rfopt:config"
_LIST_INDEX = "rfopt:list_index"
_SCHEDULE = "rfopt:schedule"
_CLONE = "rfopt:clone"
_METRICS = "rfopt:metrics:"
_STEPS = "rfopt:steps:"
_SAMPLES = "rfopt:samples:"
_DECISION = "rfopt:pruning:"
_REQUEST = "rfopt:request:"
_WITHDRAWN = "rfopt:withdrawn:"
_OPS = "rfopt:ops"
_CANCELLED = "rfopt:cancelled"
_PAUSED = "rfopt:paused"
_STOPPED = "rfopt:stopped"
_FAIL_REASON = "rfopt:fail_reason"
_ADAPTER = "rfopt:adapter"
_PBT_STEP = "rfopt:pbt:"
_PROGRESS = "rfopt:progress"
_HALT = "rfopt:halt"
_PREFIX = "rfopt:"
_GANG = "rfopt:gang:"

STOP_REASON = "stopped by user"
CONTROL_OPS = ("pause", "resume", "stop")
_FAIL_REASON_LIMIT = 2000


def unit_key(prefix: str, unit: int) -> str:
    return f"{prefix}{unit:04d}"


def metrics_key(unit: int) -> str:
    """``rfopt:metrics:0002``: the training and eval metrics of a trial's unit 2."""
    return unit_key(_METRICS, unit)


def samples_key(unit: int) -> str:
    return unit_key(_SAMPLES, unit)


def steps_key(unit: int) -> str:
    """``rfopt:steps:0002``: the trial system attr that holds TRL's per-step logs of its unit 2."""
    return unit_key(_STEPS, unit)


class StepColumns:
    """TRL's logs of one unit's optimizer steps as they are stored: one trial *system* attr per unit, by column.

    ``{"step": [5, 6], "reward": [0.4, 0.5], "kl": [null, 0.01], ...}``: one list per metric, aligned with ``step``
    (the trainer's global step), ``null`` where a step did not log that metric. Why this layout:

    - per unit, not per step: a trial gets one attr per chunk it trains (as its ``rfopt:metrics:<unit>``), not
      hundreds; the unit's steps are written once, in the write that commits its metrics, and never rewritten;
    - by column: each metric name is spelled once per unit, not once per step (a third of the size of a list of
      dicts for 4 steps of ~25 metrics, less for longer chunks);
    - a system attr, as all of rfopt's records (see the module's docstring). `get_trials` still loads them: some
      20 numbers a step, which is small next to a chunk's samples;
    - not the artifact store: `TrialRecord` reads a trial from storage alone (the dashboard, ``rfopt status`` and
      another host may not reach the study's checkpoint location), and artifacts can only be added while the trial
      runs.
    """

    @staticmethod
    def encode(steps: list[Mapping[str, float]]) -> dict[str, list[float | None]]:
        keys = sorted({k for log in steps for k in log if k != "step"})
        columns: dict[str, list[float | None]] = {"step": [int(log["step"]) for log in steps]}
        for key in keys:
            columns[key] = [_finite(log.get(key)) for log in steps]
        return columns

    @staticmethod
    def decode(columns: Any) -> list[dict[str, float]]:
        if not isinstance(columns, Mapping) or not isinstance(columns.get("step"), list):
            return []
        rows: list[dict[str, float]] = [{"step": int(step)} for step in columns["step"]]
        for key, values in columns.items():
            if key == "step" or not isinstance(values, list):
                continue
            for row, value in zip(rows, values):
                if (number := _finite(value)) is not None:
                    row[str(key)] = number
        return rows


def decision_key(step: int) -> str:
    """The key that holds a trial's pruning decision at ``step``."""
    return f"{_DECISION}{step}"


DECISION_ATTR_PREFIX = _DECISION


def who() -> str:
    """``user@host``: who asked for an op or a clone."""
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def json_safe(data: Any) -> Any:
    """A copy that SQL storages can keep as JSON: NaN and infinities become strings."""
    if isinstance(data, Mapping):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    return data


# ---------------------------------------------------------------------- where records are kept
def _ours(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k.startswith(_PREFIX)}


def trial_attrs(trial: FrozenTrial) -> dict[str, Any]:
    """rfopt's records on a stored trial: its ``rfopt:*`` system attrs, over the user attrs an earlier rfopt wrote."""
    return {**_ours(trial.user_attrs), **_ours(trial.system_attrs)}


def study_attrs(study: Any) -> dict[str, Any]:
    """rfopt's records on a study (an `optuna.Study` or a `FrozenStudy`): its ``rfopt:*`` system attrs, over the
    user attrs an earlier rfopt wrote."""
    system = getattr(study, "system_attrs", None)  # a FrozenStudy's; an optuna.Study (5.0) has none: ask its storage
    if system is None:
        system = storage_of(study).get_study_system_attrs(study_id_of(study))
    return {**_ours(study.user_attrs), **_ours(system)}


def _set_study(study: Any, key: str, value: Any) -> None:
    storage_of(study).set_study_system_attr(study_id_of(study), key, value)


# ---------------------------------------------------------------------- the study
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
class StudyRecord:
    """rfopt's attrs on a study. A study rfopt never planned has no plan (and no identity until it runs)."""

    uid: str | None
    checkpoint_dir: str | None
    plan: ChunkPlan | None
    settings: dict[str, Any]
    """``num_chunks``, ``chunk_seed``, ``objective``, ``eval_settings``, ``train_fingerprint``, ``eval_fingerprint``: what
    every trial must share to be compared."""
    halt: Halt | None = None
    """The last request that every process running the study stop (`rfopt.engine.ops.halt`)."""

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> StudyRecord:
        plan = attrs.get(_PLAN)
        halt = attrs.get(_HALT)
        return cls(
            uid=attrs.get(_STUDY_ID),
            checkpoint_dir=attrs.get(_CHECKPOINT_DIR),
            plan=None if plan is None else ChunkPlan.from_dict(plan),
            settings={name: attrs[key] for name, key in _SETTINGS.items() if key in attrs},
            halt=Halt.from_attr(halt) if isinstance(halt, Mapping) else None,
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


# ---------------------------------------------------------------------- trial records
@dataclass(frozen=True)
class Lineage:
    """Where a clone comes from (``rfopt:clone``)."""

    parent: int
    overrides: dict[str, Any]
    warm_start: bool
    start_unit: int
    """The parent's committed units when a warm clone was made: the clone reports from this step on."""
    by: str
    at: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_attr(self) -> dict[str, Any]:
        return {"parent": self.parent, "overrides": dict(self.overrides), "warm_start": self.warm_start,
                "start_unit": self.start_unit, "by": self.by, "at": self.at, "token": self.token}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Lineage:
        return cls(parent=int(value["parent"]), overrides=dict(value.get("overrides") or {}),
                   warm_start=bool(value.get("warm_start")), start_unit=int(value.get("start_unit", 0)),
                   by=str(value.get("by", "unknown")), at=str(value.get("at", "")), token=str(value.get("token", "")))


@dataclass(frozen=True)
class Request:
    """An op asked for on a running trial (pause, resume, stop), not necessarily applied yet."""

    op: str
    by: str
    at: str
    id: str

    @property
    def key(self) -> str:
        # Sorts by time, then id: the order in which requests are applied.
        return f"{_REQUEST}{self.at}-{self.id}"

    @classmethod
    def new(cls, op: str, by: str | None = None) -> Request:
        return cls(op=op, by=by or who(), at=now(), id=uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class Withdrawal:
    """A pending request taken back before it applied (``rfopt:withdrawn:<request id>``)."""

    request: Request
    by: str
    at: str


@dataclass(frozen=True)
class Cancel:
    """Who cancelled a WAITING clone before it started, and when (``rfopt:cancelled``); it ends FAIL with `reason`."""

    by: str
    at: str

    @property
    def reason(self) -> str:
        return f"cancelled by {self.by} at {self.at} before it started"

    def to_attr(self) -> dict[str, Any]:
        return {"by": self.by, "at": self.at}


@dataclass(frozen=True)
class AppliedOp:
    """One entry of a trial's ``rfopt:ops`` history: a request and when it took effect."""

    op: str
    by: str
    requested_at: str
    applied_at: str
    id: str

    def to_attr(self) -> dict[str, Any]:
        return {"op": self.op, "by": self.by, "requested_at": self.requested_at, "applied_at": self.applied_at,
                "id": self.id}


@dataclass(frozen=True)
class Stop:
    """Why and when a person stopped a trial (``rfopt:stopped``)."""

    by: str
    at: str
    after_chunk: int
    """The unit it stopped after (Optuna's step; shown to people as chunk ``after_chunk + 1``)."""
    reason: str = STOP_REASON

    def to_attr(self) -> dict[str, Any]:
        return {"reason": self.reason, "by": self.by, "at": self.at, "after_chunk": self.after_chunk}


@dataclass(frozen=True)
class PruneDecision:
    """Whether a trial stops after the chunk of ``step``, and why (``rfopt:pruning:<step>``).

    Example::

        PruneDecision(trial_number=5, step=0, prune=True,
                      reason="best value 0.12 up to chunk 0 is below the median 0.8 of 7 peers",
                      peers=(0, 1, 2, 3, 4, 6, 7), pruner="MedianPruner")
    """

    trial_number: int
    step: int
    prune: bool
    #: Human text for logs and the dashboard.
    reason: str
    #: Numbers of the trials this one was compared against (empty when none were).
    peers: tuple[int, ...]
    #: Class name of the pruner that decided.
    pruner: str

    def to_attr(self) -> dict[str, Any]:
        """The JSON value stored under :func:`decision_key` (trial and step are in the key)."""
        return {"prune": self.prune, "reason": self.reason, "peers": list(self.peers), "pruner": self.pruner}

    @classmethod
    def from_attr(cls, trial_number: int, step: int, value: Mapping[str, Any]) -> PruneDecision:
        return cls(trial_number=trial_number, step=step, prune=bool(value["prune"]), reason=str(value["reason"]),
                   peers=tuple(int(n) for n in value["peers"]), pruner=str(value["pruner"]))


@dataclass(frozen=True)
class UnitMetrics:
    """What the engine stored for one chunk unit of a trial (``rfopt:metrics:<unit>``): finite numbers only."""

    unit: int
    chunk: int
    train: dict[str, float]
    eval: dict[str, float]


@dataclass(frozen=True)
class ProgressRecord:
    """How far the unit a trial trains now has got (``rfopt:progress``), published by the process training it while
    the chunk runs (`rfopt.training.progress.ProgressPublisher`): a few times a minute at most, not once per token or step, and
    a last time when the chunk's training ends. Anyone reading the storage shows it: the dashboard's "now training"
    line, ``rfopt status``.

    It says nothing of what is committed (the unit counts once its report is stored: `TrialRecord.committed`); a
    record whose unit is committed is history (`TrialRecord.in_flight`).
    """

    unit: int
    """The unit in flight (unit ``u`` is the trial's ``u+1``-th chunk; Optuna's step ``u`` once committed)."""
    num_units: int
    phase: str
    """``loading`` (swapping the trial in: its checkpoint, adapter, trainer), ``training``, or ``evaluating``."""
    step: int
    """Optimizer steps of this unit done so far, 0 to `steps`."""
    steps: int
    """Optimizer steps in the unit."""
    global_step: int
    """The trainer's global step after `step` (the per-step charts' x axis)."""
    started: float
    """When the unit started (seconds since the epoch, the writer's clock)."""
    updated: float
    """When this record was written."""
    step_seconds: float | None
    """Mean seconds per optimizer step of this unit so far (None before its first step ends)."""
    logs: dict[str, list[float | None]] = field(default_factory=dict)
    """TRL's logs of the unit's steps so far, by column (`StepColumns`): the charts draw them before the commit."""
    holder: str = ""
    """The process training it: ``host:pid``."""
    gang: tuple[int, ...] = ()
    """The trials training together with it in one process, itself included (empty: it trains alone)."""

    def step_logs(self) -> list[dict[str, float]]:
        """The logs of the unit's steps so far, one dict per step (`StepColumns.decode`)."""
        return StepColumns.decode(self.logs)

    def to_attr(self) -> dict[str, Any]:
        return json_safe({"unit": self.unit, "num_units": self.num_units, "phase": self.phase, "step": self.step,
                          "steps": self.steps, "global_step": self.global_step, "started": self.started,
                          "updated": self.updated, "step_seconds": self.step_seconds, "logs": self.logs,
                          "holder": self.holder, "gang": list(self.gang)})

    @classmethod
    def from_attr(cls, value: Any) -> ProgressRecord | None:
        if not isinstance(value, Mapping):
            return None
        try:
            seconds = value.get("step_seconds")
            return cls(unit=int(value["unit"]), num_units=int(value["num_units"]), phase=str(value["phase"]),
                       step=int(value["step"]), steps=int(value["steps"]), global_step=int(value["global_step"]),
                       started=float(value["started"]), updated=float(value["updated"]),
                       step_seconds=None if _finite(seconds) is None else float(seconds),
                       logs=dict(value.get("logs") or {}), holder=str(value.get("holder", "")),
                       gang=tuple(int(n) for n in value.get("gang") or ()))
        except (KeyError, TypeError, ValueError):
            return None


def load_decision(trial: FrozenTrial, step: int) -> PruneDecision | None:
    """The decision stored on ``trial`` for ``step``, or None if it was never decided."""
    value = trial_attrs(trial).get(decision_key(step))
    return None if value is None else PruneDecision.from_attr(trial.number, step, value)


class TrialRecord:
    """rfopt's view of one stored trial (a `FrozenTrial`, or an `optuna.Trial`, read from its storage): its config,
    progress, ops and how it ended."""

    def __init__(self, trial: FrozenTrial | Any) -> None:
        if not isinstance(trial, FrozenTrial):
            trial = storage_of(trial.study).get_trial(trial_id_of(trial))
        self.trial = trial
        self.attrs = trial_attrs(trial)

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def state(self) -> TrialState:
        return self.trial.state

    # -------------------------------------------------------------- what it is
    @property
    def config_json(self) -> str | None:
        return self.attrs.get(_CONFIG)

    @property
    def list_index(self) -> int | None:
        return self.attrs.get(_LIST_INDEX)

    @cached_property
    def schedule(self) -> TrialSchedule | None:
        data = self.attrs.get(_SCHEDULE)
        return None if data is None else TrialSchedule(**data)

    @property
    def num_units(self) -> int | None:
        return None if self.schedule is None else self.schedule.num_units

    @cached_property
    def lineage(self) -> Lineage | None:
        data = self.attrs.get(_CLONE)
        return None if not data else Lineage.from_attr(data)

    @property
    def start_unit(self) -> int:
        """The first unit it trains: 0, or for a warm clone its parent's progress when it was made."""
        return self.lineage.start_unit if self.lineage is not None and self.lineage.warm_start else 0

    # -------------------------------------------------------------- progress
    @property
    def committed(self) -> int:
        """Units committed: the trial's progress (a warm clone reports from its parent's step onward)."""
        values = self.trial.intermediate_values
        return max(values) + 1 if values else self.start_unit

    @property
    def last_value(self) -> float | None:
        values = self.trial.intermediate_values
        return values[max(values)] if values else None

    @property
    def value(self) -> float | None:
        """Its final value once COMPLETE, else its last reported one."""
        if self.state == TrialState.COMPLETE and self.trial.values:
            return self.trial.values[0]
        return self.last_value

    def raw_metrics(self, unit: int) -> dict[str, Any] | None:
        return self.attrs.get(metrics_key(unit))

    def unit_metrics(self) -> list[UnitMetrics]:
        """Per-unit metrics in unit order; values that are not finite numbers are left out."""
        out = []
        for key in sorted(k for k in self.attrs if k.startswith(_METRICS)):
            data = self.attrs[key]
            if not isinstance(data, Mapping):
                continue
            unit = int(key[len(_METRICS):])
            out.append(UnitMetrics(unit=unit, chunk=int(data.get("chunk", unit)), train=_numbers(data.get("train")),
                                   eval=_numbers(data.get("eval"))))
        return out

    def samples(self) -> dict[int, list[dict[str, Any]]]:
        """Each unit's sample completions, by unit: ``{unit: [{"prompt", "completion", "reward", <reward function
        name>: score, ...}]}`` (``reward`` is the weighted total; a score a reward function gave as None is NaN: stored
        as the text ``"nan"``, read back as a float)."""
        return {int(k[len(_SAMPLES):]): [_sample(x) for x in self.attrs[k] or [] if isinstance(x, Mapping)]
                for k in sorted(self.attrs) if k.startswith(_SAMPLES)}

    def step_metrics(self) -> list[dict[str, float]]:
        """TRL's logged metrics of each optimizer step, in step order: dicts with ``step`` (the trainer's global step,
        continuing across chunks), ``unit``, ``chunk`` and TRL's own keys as TRL names them (``reward``,
        ``reward_std``, ``rewards/<func>/mean``, ``kl`` when logged, ``entropy``, ``completions/mean_length``,
        ``loss``, ``clip_ratio/...``, ``learning_rate``, ...); finite numbers only.

        A warm clone's first units are its parent's (copied onto the clone when it is made, `StepColumns`), so its
        curve starts where the parent's was; its own trainer counts steps from 0 again (a fresh optimizer and LR
        schedule), so its own steps are shifted by the last inherited step to continue the parent's axis.

            >>> TrialRecord(study.trials[3]).step_metrics()[0]                 # doctest: +SKIP
            {'step': 1, 'unit': 0, 'chunk': 2, 'reward': 0.41, 'loss': 0.0, 'learning_rate': 1e-05, ...}
        """
        chunks = {m.unit: m.chunk for m in self.unit_metrics()}
        offset = self._inherited_last_step()
        rows: list[dict[str, float]] = []
        for key in sorted(k for k in self.attrs if k.startswith(_STEPS)):
            unit = int(key[len(_STEPS):])
            shift = offset if unit >= self.start_unit else 0
            for row in StepColumns.decode(self.attrs[key]):
                row["step"] += shift
                row["unit"], row["chunk"] = unit, chunks.get(unit, unit)
                rows.append(row)
        rows.sort(key=lambda r: (r["step"], r["unit"]))
        return rows

    def in_flight_steps(self) -> list[dict[str, float]]:
        """TRL's logs of the steps of the unit in flight (`in_flight`) so far, as `step_metrics` gives committed ones
        (on the same step axis, with ``unit`` and ``chunk``); empty when no unit is in flight."""
        progress = self.in_flight
        if progress is None:
            return []
        schedule = self.schedule
        chunk = schedule.chunk_of_unit(progress.unit) if schedule is not None else progress.unit
        shift = self._inherited_last_step()
        return [row | {"step": row["step"] + shift, "unit": progress.unit, "chunk": chunk}
                for row in progress.step_logs()]

    def _inherited_last_step(self) -> int:
        """The last step a warm clone inherited from its parent (0 for any other trial): its own trainer counts from 0
        again, so its steps are shifted by this to continue the parent's axis."""
        last = 0
        for key, columns in self.attrs.items():
            if key.startswith(_STEPS) and int(key[len(_STEPS):]) < self.start_unit:
                last = max([last, *(int(row["step"]) for row in StepColumns.decode(columns))])
        return last

    @cached_property
    def progress(self) -> ProgressRecord | None:
        """The last progress record its training process published (`ProgressRecord`), committed or not."""
        return ProgressRecord.from_attr(self.attrs.get(_PROGRESS))

    @property
    def in_flight(self) -> ProgressRecord | None:
        """The progress of the unit it trains now: a RUNNING trial's record of a unit not committed yet (None when
        no process has published one since its last commit). Whether that process still lives is the study's
        liveness (`rfopt.reports.status.liveness`)."""
        record = self.progress
        if self.state != TrialState.RUNNING or record is None or record.unit < self.committed:
            return None
        return record

    def decision(self, step: int) -> PruneDecision | None:
        return load_decision(self.trial, step)

    @property
    def decided_steps(self) -> set[int]:
        return {int(k[len(_DECISION):]) for k in self.attrs if k.startswith(_DECISION)}

    # -------------------------------------------------------------- ops
    @cached_property
    def requests(self) -> list[Request]:
        """Every op requested on the trial, oldest first."""
        found = []
        for key in sorted(k for k in self.attrs if k.startswith(_REQUEST)):
            value = self.attrs[key]
            if isinstance(value, Mapping) and value.get("op") in CONTROL_OPS:
                found.append(Request(op=value["op"], by=str(value.get("by", "unknown")), at=str(value.get("at", "")),
                                     id=str(value["id"])))
        return found

    @cached_property
    def applied(self) -> list[AppliedOp]:
        return [AppliedOp(op=e["op"], by=e.get("by", "unknown"), requested_at=e.get("requested_at", ""),
                          applied_at=e.get("applied_at", ""), id=e.get("id", ""))
                for e in self.attrs.get(_OPS, [])]

    @cached_property
    def withdrawn(self) -> list[Withdrawal]:
        """Requests taken back before they applied (`ops.withdraw`)."""
        requests = {r.id: r for r in self.requests}
        found = []
        for key in sorted(k for k in self.attrs if k.startswith(_WITHDRAWN)):
            value = self.attrs[key]
            request = requests.get(key[len(_WITHDRAWN):])
            if request is not None and isinstance(value, Mapping):
                found.append(Withdrawal(request, by=str(value.get("by", "unknown")), at=str(value.get("at", ""))))
        return found

    @property
    def pending(self) -> list[Request]:
        """Requests neither applied nor withdrawn yet, oldest first."""
        done = {op.id for op in self.applied} | {w.request.id for w in self.withdrawn}
        return [r for r in self.requests if r.id not in done]

    @property
    def cancelled(self) -> Cancel | None:
        """Set on a WAITING clone cancelled before it started (it ends FAIL, and never trains)."""
        data = self.attrs.get(_CANCELLED)
        if not isinstance(data, Mapping):
            return None
        return Cancel(by=str(data.get("by", "unknown")), at=str(data.get("at", "")))

    @property
    def shown_state(self) -> str:
        """The state a person is shown: Optuna's state name, or ``CANCELLED`` for a clone cancelled before it
        started (Optuna keeps it FAIL)."""
        return "CANCELLED" if self.cancelled is not None else self.state.name

    @property
    def paused(self) -> bool:
        return bool(self.attrs.get(_PAUSED))

    @property
    def stop(self) -> Stop | None:
        data = self.attrs.get(_STOPPED)
        if not data:
            return None
        return Stop(by=str(data.get("by", "unknown")), at=str(data.get("at", "")), after_chunk=int(data["after_chunk"]),
                    reason=str(data.get("reason", STOP_REASON)))

    # -------------------------------------------------------------- how it ended
    @property
    def fail_reason(self) -> str | None:
        return self.attrs.get(_FAIL_REASON)

    @property
    def adapter(self) -> str | None:
        return self.attrs.get(_ADAPTER)

    @property
    def pruned_by_rung(self) -> PruneDecision | None:
        """The stored rung decision that pruned it, if one did."""
        for step in sorted(self.trial.intermediate_values, reverse=True):
            decision = self.decision(step)
            if decision is not None and decision.prune:
                return decision
        return None

    @property
    def end_reason(self) -> str | None:
        """Why it failed, was stopped or was pruned (None for a trial that did neither)."""
        if self.fail_reason:
            return self.fail_reason
        if self.state != TrialState.PRUNED and self.state != TrialState.RUNNING:
            return None
        if self.stop is not None:
            return f"{self.stop.reason} after chunk {self.stop.after_chunk + 1}"  # stored as Optuna's step
        decision = self.pruned_by_rung
        return decision.reason if decision is not None else None


_NOT_FINITE = {"nan", "inf", "-inf"}


def _sample(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A stored sample with its scores as numbers again (`json_safe` stored NaN and infinities as text)."""
    return {k: float(v) if k not in ("prompt", "completion") and isinstance(v, str) and v in _NOT_FINITE else v
            for k, v in sample.items()}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _numbers(data: Any) -> dict[str, float]:
    if not isinstance(data, Mapping):
        return {}
    return {str(k): float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


@dataclass(frozen=True)
class GangPlan:
    """The gang a trial's unit trains in (``rfopt:gang:<unit>``, a trial system attr): its members, in the order
    they run, and the unit each trains. Written on every member before the gang trains, so that a rerun after a crash
    forms the same gang again (its members' rollouts are decoded together: who shares a batch changes its numerics),
    and so that the study page can show which trials run together."""

    id: str
    members: tuple[tuple[int, int], ...]
    """(trial, unit) of each member."""

    @property
    def numbers(self) -> tuple[int, ...]:
        return tuple(n for n, _ in self.members)

    def to_attr(self) -> dict[str, Any]:
        return {"id": self.id, "members": [[n, u] for n, u in self.members]}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> GangPlan:
        return cls(id=str(value["id"]), members=tuple((int(n), int(u)) for n, u in value["members"]))


def gang_plan(trial: FrozenTrial, unit: int) -> GangPlan | None:
    """The gang that trains (or trained) `trial`'s unit `unit`, if it trains in one."""
    value = trial.system_attrs.get(unit_key(_GANG, unit))
    return None if not isinstance(value, Mapping) else GangPlan.from_attr(value)


def write_gang_plan(refs: list[TrialRef], plan: GangPlan) -> None:
    """Store `plan` on each member (before the gang trains)."""
    units = dict(plan.members)
    for ref in refs:
        ref.set(unit_key(_GANG, units[ref.number]), plan.to_attr())


# ---------------------------------------------------------------------- trial writers
@dataclass(frozen=True)
class TrialRef:
    """Where to write a trial's attrs: its storage and id. Optuna's `Trial` is not needed to write an attr, and
    building one runs the sampler's ``before_trial`` (which may write), so writers take this instead."""

    storage: BaseStorage
    trial_id: int
    number: int

    @classmethod
    def of(cls, study: Any, trial: Any) -> TrialRef:
        """The ref of `trial` (an `optuna.Trial` or a `FrozenTrial`) of `study` (an `optuna.Study`)."""
        return cls(storage_of(study), trial_id_of(trial), trial.number)

    def set(self, key: str, value: Any) -> None:
        self.storage.set_trial_system_attr(self.trial_id, key, value)

    def read(self) -> TrialRecord:
        return TrialRecord(self.storage.get_trial(self.trial_id))


def new_trial_attrs(config_json: str, *, list_index: int | None = None, lineage: Lineage | None = None
                    ) -> dict[str, Any]:
    """The system attrs of an enqueued trial: a listed config, or a clone."""
    attrs: dict[str, Any] = {_CONFIG: config_json}
    if list_index is not None:
        attrs[_LIST_INDEX] = list_index
    if lineage is not None:
        attrs[_CLONE] = lineage.to_attr()
    return attrs


def write_config(ref: TrialRef, config_json: str) -> None:
    ref.set(_CONFIG, config_json)


def write_schedule(ref: TrialRef, schedule: TrialSchedule) -> None:
    ref.set(_SCHEDULE, schedule.to_dict())


def write_unit(ref: TrialRef, unit: int, metrics: Mapping[str, Any], samples: list[Any],
               steps: list[Mapping[str, float]] = ()) -> None:
    """A unit's metrics, samples and per-step logs (its report, ``trial.report(value, step=unit)``, follows)."""
    if steps:
        ref.set(steps_key(unit), StepColumns.encode(list(steps)))
    ref.set(metrics_key(unit), json_safe(metrics))
    ref.set(samples_key(unit), json_safe(samples))


def inherited_steps(parent: FrozenTrial, units: int) -> dict[str, Any]:
    """The system attrs that give a warm clone its parent's per-step logs of the first `units` units, on the parent's
    step axis (a clone of a warm clone gets the steps as its parent shows them)."""
    by_unit: dict[int, list[dict[str, float]]] = {}
    for row in TrialRecord(parent).step_metrics():
        if row["unit"] < units:
            by_unit.setdefault(int(row["unit"]), []).append({k: v for k, v in row.items() if k not in ("unit", "chunk")})
    return {steps_key(unit): StepColumns.encode(rows) for unit, rows in by_unit.items()}


def write_progress(ref: TrialRef, progress: ProgressRecord) -> None:
    """The trial's in-chunk progress, replacing the last one (one key per trial: a write costs one row)."""
    ref.set(_PROGRESS, progress.to_attr())


def write_decision(ref: TrialRef, decision: PruneDecision) -> None:
    ref.set(decision_key(decision.step), decision.to_attr())


def write_request(ref: TrialRef, request: Request) -> None:
    """A new request under a key of its own: a request never overwrites another, so none is lost."""
    ref.set(request.key, {"op": request.op, "by": request.by, "at": request.at, "id": request.id})


def write_withdrawal(ref: TrialRef, withdrawal: Withdrawal) -> None:
    ref.set(f"{_WITHDRAWN}{withdrawal.request.id}", {"by": withdrawal.by, "at": withdrawal.at})


def write_cancel(ref: TrialRef, cancel: Cancel) -> None:
    """Mark a cancelled clone (with its fail reason: a process that finds it RUNNING fails it, `roster`)."""
    ref.set(_CANCELLED, cancel.to_attr())
    write_fail_reason(ref, cancel.reason)


def write_applied(ref: TrialRef, applied: list[AppliedOp]) -> None:
    """The trial's whole ops history (written by the one process that holds the trial)."""
    ref.set(_OPS, [op.to_attr() for op in applied])


def write_paused(ref: TrialRef, paused: bool) -> None:
    ref.set(_PAUSED, paused)


def write_stop(ref: TrialRef, stop: Stop) -> None:
    ref.set(_STOPPED, stop.to_attr())


def write_fail_reason(ref: TrialRef, reason: str) -> None:
    ref.set(_FAIL_REASON, reason[:_FAIL_REASON_LIMIT])


def write_adapter(ref: TrialRef, location: str) -> None:
    ref.set(_ADAPTER, location)
