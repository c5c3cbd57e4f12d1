"""Every ``rfopt:*`` key rfopt keeps in an Optuna storage, and the typed records they hold.

rfopt keeps a study's state in Optuna's own storage, as user attrs (JSON), so that any process on any
host can continue, steer or show a study from the storage alone. This module is the only place that
spells those keys: the engine, ops, the command line and the dashboard read a `StudyRecord` or a
`TrialRecord` and write through the functions below.

On the study:  ``rfopt:id`` (its identity, which its checkpoint location carries), ``rfopt:checkpoint_dir``,
``rfopt:plan`` (the chunk plan), ``rfopt:objective``, ``rfopt:eval`` (evaluation settings),
``rfopt:train_fingerprint``, ``rfopt:eval_fingerprint``, ``rfopt:pbt:<step>`` (a population-based training
step: who is replaced by a clone of whom, with what values).

On a trial:    ``rfopt:config`` (the resolved `TrialConfig` as JSON), ``rfopt:list_index`` (its place in a
list of configs), ``rfopt:schedule``, ``rfopt:clone`` (lineage), ``rfopt:metrics:<unit>`` and
``rfopt:samples:<unit>`` (per chunk unit), ``rfopt:pruning:<step>`` (rung decisions),
``rfopt:request:<time>-<id>`` (op requests, one key each, never rewritten) and ``rfopt:ops`` (the ops
applied, with the id of each request), ``rfopt:paused``, ``rfopt:stopped``, ``rfopt:fail_reason``,
``rfopt:adapter``.

A trial's progress is its reported intermediate values: unit ``u`` is committed once step ``u`` is
reported (`TrialRecord.committed`). Nothing else counts progress.

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

from .chunks import ChunkPlan, TrialSchedule

# ---------------------------------------------------------------------- keys (spelled here only)
_STUDY_ID = "rfopt:id"
_CHECKPOINT_DIR = "rfopt:checkpoint_dir"
_PLAN = "rfopt:plan"
_SETTINGS = {"objective": "rfopt:objective", "eval_settings": "rfopt:eval", "train_fingerprint": "rfopt:train_fingerprint",
             "eval_fingerprint": "rfopt:eval_fingerprint", "num_chunks": "rfopt:num_chunks",
             "chunk_seed": "rfopt:chunk_seed"}

_CONFIG = "rfopt:config"
_LIST_INDEX = "rfopt:list_index"
_SCHEDULE = "rfopt:schedule"
_CLONE = "rfopt:clone"
_METRICS = "rfopt:metrics:"
_SAMPLES = "rfopt:samples:"
_DECISION = "rfopt:pruning:"
_REQUEST = "rfopt:request:"
_OPS = "rfopt:ops"
_PAUSED = "rfopt:paused"
_STOPPED = "rfopt:stopped"
_FAIL_REASON = "rfopt:fail_reason"
_ADAPTER = "rfopt:adapter"
_PBT_STEP = "rfopt:pbt:"

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


def decision_key(step: int) -> str:
    """The user-attr key that holds a trial's pruning decision at ``step``."""
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


# ---------------------------------------------------------------------- the study
@dataclass(frozen=True)
class StudyRecord:
    """rfopt's attrs on a study. A study rfopt never planned has no plan (and no identity until it runs)."""

    uid: str | None
    checkpoint_dir: str | None
    plan: ChunkPlan | None
    settings: dict[str, Any]
    """``num_chunks``, ``chunk_seed``, ``objective``, ``eval_settings``, ``train_fingerprint``, ``eval_fingerprint``: what
    every trial must share to be compared."""

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> StudyRecord:
        plan = attrs.get(_PLAN)
        return cls(
            uid=attrs.get(_STUDY_ID),
            checkpoint_dir=attrs.get(_CHECKPOINT_DIR),
            plan=None if plan is None else ChunkPlan.from_dict(plan),
            settings={name: attrs[key] for name, key in _SETTINGS.items() if key in attrs},
        )

    @property
    def objective(self) -> str:
        return self.settings.get("objective", "reward")

    @property
    def planned(self) -> bool:
        return self.plan is not None


def study_record(study: Any) -> StudyRecord:
    """The record of an `optuna.Study` (or a `FrozenStudy`, as storages list them)."""
    return StudyRecord.of(study.user_attrs)


def write_identity(study: Any, uid: str, checkpoint_dir: str) -> None:
    """Give the study its identity and checkpoint location (once, when it first runs; see `study.py`)."""
    study.set_user_attr(_STUDY_ID, uid)
    study.set_user_attr(_CHECKPOINT_DIR, checkpoint_dir)


def write_checkpoint_dir(study: Any, checkpoint_dir: str) -> None:
    study.set_user_attr(_CHECKPOINT_DIR, checkpoint_dir)


def write_plan(study: Any, plan: ChunkPlan) -> None:
    study.set_user_attr(_PLAN, plan.to_dict())


def write_settings(study: Any, settings: Mapping[str, Any]) -> None:
    """Store study settings (`StudyRecord.settings` names) that the study does not have yet."""
    for name, value in settings.items():
        study.set_user_attr(_SETTINGS[name], value)


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
    value = study.user_attrs.get(f"{_PBT_STEP}{step}")
    return None if value is None else PbtStep.from_attr(step, value)


def write_pbt_step(study: Any, decided: PbtStep) -> None:
    study.set_user_attr(f"{_PBT_STEP}{decided.step}", decided.to_attr())


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


def load_decision(trial: FrozenTrial, step: int) -> PruneDecision | None:
    """The decision stored on ``trial`` for ``step``, or None if it was never decided."""
    value = trial.user_attrs.get(decision_key(step))
    return None if value is None else PruneDecision.from_attr(trial.number, step, value)


class TrialRecord:
    """rfopt's view of one stored trial (a `FrozenTrial`): its config, progress, ops and how it ended."""

    def __init__(self, trial: FrozenTrial) -> None:
        self.trial = trial
        self.attrs = trial.user_attrs

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
        """Each unit's sample completions, by unit."""
        return {int(k[len(_SAMPLES):]): list(self.attrs[k] or []) for k in sorted(self.attrs)
                if k.startswith(_SAMPLES)}

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

    @property
    def pending(self) -> list[Request]:
        """Requests not applied yet, oldest first."""
        done = {op.id for op in self.applied}
        return [r for r in self.requests if r.id not in done]

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
            return f"{self.stop.reason} after chunk {self.stop.after_chunk}"
        decision = self.pruned_by_rung
        return decision.reason if decision is not None else None


def _numbers(data: Any) -> dict[str, float]:
    if not isinstance(data, Mapping):
        return {}
    return {str(k): float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


# ---------------------------------------------------------------------- trial writers
@dataclass(frozen=True)
class TrialRef:
    """Where to write a trial's attrs: its storage and id. Optuna's `Trial` is not needed to write an attr, and
    building one runs the sampler's ``before_trial`` (which may write), so writers take this instead."""

    storage: BaseStorage
    trial_id: int
    number: int

    def set(self, key: str, value: Any) -> None:
        self.storage.set_trial_user_attr(self.trial_id, key, value)

    def read(self) -> TrialRecord:
        return TrialRecord(self.storage.get_trial(self.trial_id))


def new_trial_attrs(config_json: str, *, list_index: int | None = None, lineage: Lineage | None = None
                    ) -> dict[str, Any]:
    """The user attrs of an enqueued trial: a listed config, or a clone."""
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


def write_unit(ref: TrialRef, unit: int, metrics: Mapping[str, Any], samples: list[Any]) -> None:
    """A unit's metrics and samples (its report, ``trial.report(value, step=unit)``, follows)."""
    ref.set(metrics_key(unit), json_safe(metrics))
    ref.set(samples_key(unit), json_safe(samples))


def write_decision(ref: TrialRef, decision: PruneDecision) -> None:
    ref.set(decision_key(decision.step), decision.to_attr())


def write_request(ref: TrialRef, request: Request) -> None:
    """A new request under a key of its own: a request never overwrites another, so none is lost."""
    ref.set(request.key, {"op": request.op, "by": request.by, "at": request.at, "id": request.id})


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
