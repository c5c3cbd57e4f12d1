"""The trials of a study as rfopt's dashboard shows them, and the fingerprint of what its study page shows.

- `TrialView`: one trial's state, progress, value, params, lineage, gangs, times and which controls it offers;
  `trial_views` lists them in leaderboard order (`leaderboard_order`).
- `data_version`: a fingerprint of the stored data the study page shows; the page sends it back as an ETag and is told
  "not modified" while nothing changed.

`rfopt.dashboard.pages` renders them as HTML; ``GET /rfopt/api/studies/<id>/trials`` serves them as JSON.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from rfopt import noise
from rfopt.reports.charts import colour, trial_labels
from rfopt.reports.lead import best_trial
from rfopt.reports.leaderboard import held_as
from rfopt.reports.outcome import outcome
from rfopt.reports.results import StudyOutcome, TrialOutcome
from rfopt.reports.status import SITUATIONS, Liveness, situation
from rfopt.reports.timeline import TrialTimes
from rfopt.storage.schema import TrialRecord, gang_plan, pbt_steps, study_record

_ORDER = {state: i for i, state in enumerate(SITUATIONS)}


@dataclass
class TrialView:
    """One trial, as the control page shows it."""

    number: int
    state: str
    """Optuna's state name, or ``CANCELLED`` for a clone cancelled before it started."""
    paused: bool
    pending: list[str]
    """Ops requested and not applied (nor withdrawn) yet, oldest first; none once the trial ended (they never
    apply)."""
    steps_done: int
    """Chunks trained, a warm clone's inherited ones included."""
    num_steps: int | None
    value: float | None
    """The last reported value (the final value once COMPLETE)."""
    value_step: int | None
    """The unit of `value` (Optuna's step; shown as chunk ``value_step + 1``)."""
    params: dict[str, Any]
    clone_of: dict[str, Any] | None
    reason: str | None
    can_clone: bool
    can_cancel: bool
    """A WAITING clone no process has started (`rfopt.engine.trials.ops.cancel`)."""
    colour: str
    label: str = ""
    """Its series name in the charts: ``t3 lr=0.05``."""
    eval: dict[str, float] = field(default_factory=dict)
    """The eval metrics of its latest chunk."""
    held_as: dict[str, str] = field(default_factory=dict)
    """A clone's fields whose values its Optuna params hold under an alternate name (`rfopt.reports.leaderboard.held_as`)."""
    gangs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """The trials it trained each unit with (a gang: `rfopt.training.gang`), by unit; units it trained alone are absent."""
    sample_units: list[int] = field(default_factory=list)
    """The units whose eval samples are stored."""
    replaced_by: int | None = None
    """The clone that replaced it (population-based training)."""
    started: float | None = None
    """When it started (seconds since the epoch)."""
    ended: float | None = None
    chunk_seconds: dict[int, float] = field(default_factory=dict)
    """Each committed unit's duration, training and evaluation."""
    situation: str = ""
    """What it is doing, in the words every view uses (`rfopt.reports.status.situation`): queued, training, paused,
    interrupted, complete, pruned, stopped, failed, cancelled."""
    gang: tuple[int, ...] = ()
    """The trials it trains with now (its unit in flight's gang, else its last one's), itself included."""
    value_error: float | None = None
    """The standard error of `value` over the eval prompts (`rfopt.noise`); None where not stored."""
    eval_count: int | None = None
    """Eval prompts `value` is the mean of."""
    vs_base: float | None = None
    """Its value minus its baseline's (the base model with no adapter, `rfopt.reports.outcome`)."""
    best_value: float | None = None
    """Its best checkpoint's value (`rfopt.storage.schema.BestCheckpoint`)."""
    best_step: int | None = None
    """Its best checkpoint's unit (shown as chunk ``best_step + 1``)."""
    flags: list[str] = field(default_factory=list)
    """``collapsed at chunk 4: ...``, ``degraded after chunk 3: ...`` (`rfopt.reports.results.TrialOutcome`)."""

    @classmethod
    def of(cls, trial: optuna.trial.FrozenTrial, label: str = "", replaced_by: int | None = None,
           live: Liveness | None = None, objective: str = "reward", judged: TrialOutcome | None = None) -> TrialView:
        """`trial` as the page shows it; `live`: who runs the study; `judged`: its outcome in the study
        (`rfopt.reports.outcome.outcome`), which gives its baseline difference, best checkpoint and flags."""
        record = TrialRecord(trial)
        units = record.unit_metrics()
        values = trial.intermediate_values
        times = TrialTimes.of(record)
        flight = record.in_flight
        last_gang = gang_plan(trial, max(values)) if values else None
        estimate = _value_estimate(record, objective)
        return cls(
            number=trial.number,
            state=record.shown_state,
            paused=record.paused,
            pending=[r.op for r in record.pending] if trial.state == TrialState.RUNNING else [],
            steps_done=record.committed,
            num_steps=record.num_units,
            value=record.value,
            value_step=max(values) if values else None,
            params=dict(trial.params),
            held_as=held_as(trial),
            gangs={unit: plan.numbers for unit in range(record.committed + 1)
                   if (plan := gang_plan(trial, unit)) is not None and len(plan.numbers) > 1},
            clone_of=None if record.lineage is None else record.lineage.to_attr(),
            reason=record.end_reason,  # a cancelled clone's too: cancelling stores it as the fail reason
            can_clone=record.config_json is not None,
            can_cancel=trial.state == TrialState.WAITING and record.lineage is not None,
            colour=colour(trial.number),
            label=label or f"t{trial.number}",
            eval=units[-1].eval if units else {},
            sample_units=sorted(record.samples()),
            replaced_by=replaced_by,
            started=_epoch(times.start),
            ended=_epoch(times.end),
            chunk_seconds=times.chunk_seconds,
            situation=situation(record, live),
            gang=flight.gang if flight is not None and flight.gang else last_gang.numbers if last_gang else (),
            value_error=None if estimate is None else estimate.stderr,
            eval_count=None if estimate is None else estimate.n,
            vs_base=None if judged is None else judged.vs_baseline,
            best_value=None if judged is None or judged.best is None else judged.best.value,
            best_step=None if judged is None or judged.best is None else judged.best.unit,
            flags=[] if judged is None else judged.flags,
        )

    @property
    def controls(self) -> list[str]:
        """The control buttons shown for this trial (the server checks each request again). A pending request's one
        undo is its "Withdraw" (`pending`): while one is pending, no button asks for its opposite."""
        shown = []
        if self.state == "RUNNING" and not self.pending:
            shown.append("resume" if self.paused else "pause")
            shown.append("stop")
        elif self.state == "RUNNING" and "stop" not in self.pending:
            shown.append("stop")
        if self.can_cancel:
            shown.append("cancel")
        return shown + (["clone"] if self.can_clone else [])

    def value_text(self) -> str:
        """``0.3 ± 0.05 (8 prompts)``: the value with its standard error where the unit stored its scores."""
        if self.value is None:
            return "-"
        if self.eval_count is None:
            return f"{self.value:.4g}"
        return noise.Estimate(self.value, self.value_error, self.eval_count).text()

    @property
    def lineage(self) -> str:
        """``clone of t3, warm from chunk 2`` and/or ``replaced by t14``; empty for an original trial."""
        parts = []
        if self.clone_of:
            parent = self.clone_of.get("parent")
            warm = (f", warm from chunk {int(self.clone_of.get('start_unit', 0)) + 1}"
                    if self.clone_of.get("warm_start") else "")
            parts.append(f"clone of t{parent}{warm}")
        if self.replaced_by is not None:
            parts.append(f"replaced by t{self.replaced_by}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["controls"] = self.controls
        data["lineage"] = self.lineage
        data["chunk_seconds"] = {str(k): v for k, v in self.chunk_seconds.items()}
        return data


def trial_views(trials: Sequence[optuna.trial.FrozenTrial], study: Any = None,
                live: Liveness | None = None, found: StudyOutcome | None = None) -> list[TrialView]:
    """Every trial, in leaderboard order when `study` (its direction) is given (`leaderboard_order`), else live
    first (`rfopt.reports.status.SITUATIONS`), then finished; by number within each. `live`: who runs the study
    (a RUNNING trial nobody runs is ``interrupted``). `found`: the study's outcome where the caller has it
    (`rfopt.reports.outcome.outcome`; made here when `study` is given)."""
    labels = trial_labels(trials)
    replaced = _replacements(trials, study) if study is not None else {}
    objective = study_record(study).objective if study is not None else "reward"
    if found is None and study is not None:
        found = outcome(study, trials)
    judged = found.trials if found is not None else {}
    views = [TrialView.of(t, labels[t.number], replaced.get(t.number), live, objective, judged.get(t.number))
             for t in trials]
    if study is not None and len(study.directions) == 1:
        return leaderboard_order(views, best_trial(trials, study.directions[0])[0], study.directions[0])
    return sorted(views, key=lambda v: (_ORDER.get(v.situation, 9), v.number))


def _value_estimate(record: TrialRecord, objective: str) -> noise.Estimate | None:
    """The value's mean and standard error over the eval prompts, from its unit's stored scores."""
    values = record.trial.intermediate_values
    if not values:
        return None
    unit = max(values)
    scores = next((m.scores_of(objective) for m in record.unit_metrics() if m.unit == unit), [])
    return noise.estimate(scores) if scores else None


def leaderboard_order(views: list[TrialView], best: int | None, direction: Any) -> list[TrialView]:
    """Best first: the best (or leading) trial, then trials with a value, by value, then the rest by number."""
    maximize = direction is not None and direction.name == "MAXIMIZE"

    def rank(v: TrialView) -> tuple:
        key = (-v.value if maximize else v.value) if v.value is not None else float("inf")
        return (v.number != best, v.value is None, key, v.number)

    return sorted(views, key=rank)


def _replacements(trials: Sequence[optuna.trial.FrozenTrial], study: Any) -> dict[int, int]:
    """Population-based training's replacements: replaced trial -> the clone that replaced it."""
    steps = pbt_steps(study)
    if not steps:
        return {}
    by_token = {}
    for t in trials:
        lineage = TrialRecord(t).lineage
        if lineage is not None:
            by_token[lineage.token] = t.number
    return {r.trial: by_token[r.token] for step in steps for r in step.replacements if r.token in by_token}


def data_version(trials: Iterable[optuna.trial.FrozenTrial], live: Liveness, study_attrs: dict[str, Any]) -> str:
    """A fingerprint of what the study page shows: every trial's state, params, values and attrs, the study's rfopt
    records, and who runs it. The page sends it back (If-None-Match) and is told "not modified" while it holds."""
    digest = hashlib.sha1()
    for t in trials:
        digest.update(json.dumps([t.number, t.state.name, t.params, t.values, sorted(t.intermediate_values.items()),
                                  t.user_attrs, t.system_attrs, str(t.datetime_start), str(t.datetime_complete)],
                                 sort_keys=True, default=str).encode())
    digest.update(json.dumps([sorted(study_attrs.items()), live.running, live.holders, live.message],
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()[:20]


def _epoch(when: datetime.datetime | None) -> float | None:
    if when is None:
        return None
    return when.timestamp() if when.tzinfo is not None else when.astimezone().timestamp()
