"""rfopt's view of one stored trial (`TrialRecord`: its config, progress, ops and how it ended) and where its records
are written (`TrialRef` and the ``write_*`` functions)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from rfopt.chunks import TrialSchedule
from rfopt.compat import storage_of, trial_id_of

from ._keys import (
    _ADAPTER,
    _BASELINE_KEY,
    _BEST,
    _CANCELLED,
    _CLONE,
    _REPLICATE,
    _CONFIG,
    _DECISION,
    _FAIL_REASON,
    _LIST_INDEX,
    _METRICS,
    _OPS,
    _PAUSED,
    _PROGRESS,
    _REQUEST,
    _SAMPLES,
    _SCHEDULE,
    _STEPS,
    _STOPPED,
    _TRACKED,
    _TRACKED_AT,
    _WITHDRAWN,
    decision_key,
    metrics_key,
    samples_key,
    steps_key,
    trial_attrs,
)
from ._records import (
    CONTROL_OPS,
    STOP_REASON,
    AppliedOp,
    BestCheckpoint,
    Cancel,
    Lineage,
    ProgressRecord,
    Replicate,
    PruneDecision,
    Stop,
    TrialRequest,
    UnitMetrics,
    Withdrawal,
)
from ._values import StepColumns, _numbers, _sample, _score_lists, json_safe


# ---------------------------------------------------------------------- reading a trial
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

    @cached_property
    def replicate(self) -> Replicate | None:
        """Set on a replicate: the trial whose config it runs again, and its seed."""
        return Replicate.from_attr(self.attrs.get(_REPLICATE))

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
                                   eval=_numbers(data.get("eval")), scores=_score_lists(data.get("scores"))))
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
    def requests(self) -> list[TrialRequest]:
        """Every op requested on the trial, oldest first."""
        found = []
        for key in sorted(k for k in self.attrs if k.startswith(_REQUEST)):
            value = self.attrs[key]
            if isinstance(value, Mapping) and value.get("op") in CONTROL_OPS:
                found.append(TrialRequest(op=value["op"], by=str(value.get("by", "unknown")),
                                          at=str(value.get("at", "")), id=str(value["id"])))
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
    def pending(self) -> list[TrialRequest]:
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

    def leaderboard_rank(self, maximize: bool) -> tuple[int, float, int, int]:
        """Where the trial stands on a leaderboard, smaller first (the study's and the trackers'): complete, running,
        pruned, failed, then the rest; within a state by value, best first (none or not finite last); then by chunks
        trained, most first; then by number."""
        value = self.value
        sign = 1 if maximize else -1
        return (_RANKED_STATES.get(self.shown_state, len(_RANKED_STATES)),
                -sign * value if value is not None and math.isfinite(value) else math.inf, -self.committed, self.number)

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
    def tracked(self) -> dict[str, int]:
        """Units whose logs each tracker of ``report_to`` is known to hold, by tracker (`rfopt.training.trackers`):
        a process that opens the trial's runs logs the committed units after these again, from storage."""
        data = self.attrs.get(_TRACKED)
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, Mapping) else {}

    @property
    def tracked_at(self) -> dict[str, str]:
        """Where each tracker of ``report_to`` wrote the trial's run, by tracker, where that depends on the process (a
        TensorBoard folder): a process that would write elsewhere says so, and logs the trial there whole."""
        data = self.attrs.get(_TRACKED_AT)
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, Mapping) else {}

    @property
    def baseline_key(self) -> str | None:
        """The key of its base model's `Baseline` on the study (`StudyRecord.baselines`); None before it started."""
        return self.attrs.get(_BASELINE_KEY)

    @property
    def best(self) -> BestCheckpoint | None:
        """Its best checkpoint so far (`BestCheckpoint`): the unit, its value and its kept adapter; None before one."""
        return BestCheckpoint.from_attr(self.attrs.get(_BEST))

    @property
    def pruned_by_rung(self) -> PruneDecision | None:
        """The stored rung decision that pruned it, if one did."""
        for step in sorted(self.trial.intermediate_values, reverse=True):
            decision = self.decision(step)
            if decision is not None and decision.prune:
                return decision
        return None

    @property
    def told_outside(self) -> str | None:
        """How an rfopt trial was ended outside rfopt (optuna-dashboard's "Mark as Complete"/"Fail Trial" buttons,
        Optuna's ``tell``), or None: rfopt writes its adapter before telling COMPLETE, its reason before FAIL, and its
        stop or rung decision before PRUNED, so a finished rfopt trial without them was told by someone else."""
        if self.config_json is None or not self.state.is_finished():
            return None
        if self.state == TrialState.COMPLETE and self.adapter is None:
            what = f"COMPLETE with value {self.trial.value:g}" if self.trial.values else "COMPLETE"
        elif self.state == TrialState.FAIL and not self.fail_reason:
            what = "FAIL"
        elif self.state == TrialState.PRUNED and self.stop is None and not self.decided_steps:
            what = "PRUNED"
        else:
            return None
        done = f" after {self.committed} of {self.num_units} chunks" if self.num_units else ""
        return (f"told {what} outside rfopt{done} (optuna-dashboard's buttons, or Optuna's tell)"
                + ("; no adapter was saved" if self.state == TrialState.COMPLETE else ""))

    @property
    def end_reason(self) -> str | None:
        """Why it failed, was stopped or was pruned, or how it was ended outside rfopt (None for a trial that did
        none of these)."""
        if self.fail_reason:
            return self.fail_reason
        outside = self.told_outside
        if outside is not None:
            return outside
        if self.state != TrialState.PRUNED and self.state != TrialState.RUNNING:
            return None
        if self.stop is not None:
            return f"{self.stop.reason} after chunk {self.stop.after_chunk + 1}"  # stored as Optuna's step
        decision = self.pruned_by_rung
        return decision.reason if decision is not None else None


# ---------------------------------------------------------------------- trial writers
_FAIL_REASON_LIMIT = 2000
_RANKED_STATES = {"COMPLETE": 0, "RUNNING": 1, "PRUNED": 2, "FAIL": 3}
"""The leaderboard's order of states (`TrialRecord.leaderboard_rank`); any other state after them."""


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


def new_trial_attrs(config_json: str, *, list_index: int | None = None, lineage: Lineage | None = None,
                    replicate: Replicate | None = None) -> dict[str, Any]:
    """The system attrs of an enqueued trial: a listed config, or a clone (a replicate too)."""
    attrs: dict[str, Any] = {_CONFIG: config_json}
    if list_index is not None:
        attrs[_LIST_INDEX] = list_index
    if lineage is not None:
        attrs[_CLONE] = lineage.to_attr()
    if replicate is not None:
        attrs[_REPLICATE] = replicate.to_attr()
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


def write_request(ref: TrialRef, request: TrialRequest) -> None:
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


def write_tracked(ref: TrialRef, tracked: Mapping[str, int]) -> None:
    ref.set(_TRACKED, dict(tracked))


def write_tracked_at(ref: TrialRef, places: Mapping[str, str]) -> None:
    ref.set(_TRACKED_AT, dict(places))


def write_baseline_key(ref: TrialRef, key: str) -> None:
    ref.set(_BASELINE_KEY, key)


def write_best(ref: TrialRef, best: BestCheckpoint) -> None:
    ref.set(_BEST, best.to_attr())
