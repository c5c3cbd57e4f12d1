"""`Tracking`: one process's logging of a study's trials, each into its own run of every tracker rfopt logs to itself
(what a run holds, and how a crash or a later ``report_to`` is caught up from storage)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rfopt.compat import storage_of, study_id_of
from rfopt.storage import schema
from rfopt.storage.schema import TrialRecord, TrialRef, study_record

from ._records import ChunkLog, Leaderboard, Tracker, TrialEnd, TrialInfo, TrialRun
from ._report_to import own, passed_on

logger = logging.getLogger("rfopt")


def _tracker(name: str, study: str, study_id: str) -> Tracker:
    if name == "wandb":
        from ._wandb import WandbTracker

        return WandbTracker(study, study_id)
    if name == "mlflow":
        from ._mlflow import MlflowTracker

        return MlflowTracker(study, study_id)
    if name == "trackio":
        from ._trackio import TrackioTracker

        return TrackioTracker(study, study_id)
    from ._tensorboard import TensorboardTracker

    return TensorboardTracker(study, study_id)


@dataclass
class _Trial:
    """A trial whose runs this process has open."""

    info: TrialInfo
    ref: TrialRef
    runs: dict[str, TrialRun]
    offset: int
    """A warm clone's last inherited step: its trainer counts from 0 again, its run continues the parent's axis."""
    tracked: dict[str, int]
    """Units each tracker is known to hold (``rfopt:tracked``), as this process last wrote it."""
    through: int = 0
    """Units logged by this process (replayed from storage or committed here)."""
    logged: set[int] = field(default_factory=set)
    """Steps logged here while they trained (a committed unit's other steps are logged from storage)."""


class Tracking:
    """One process's logging of a study's trials into the user's trackers (see `rfopt.training.trackers`).

    The engine builds one per run of the study and hands it to every trial's runner, which logs each step
    (`step_listener`); it tells it of each committed unit (`committed`) and each trial it ends (`ended`), and closes
    it when the run ends (`close`). Runs are opened when first needed and kept open until the trial ends or the run
    does.

    A trial's runs hold each committed unit at least once, whatever crashed when: after each committed unit the
    runs are flushed (W&B's is finished, to be resumed at the next step: W&B writes a run's file every 15 s, and a
    killed process loses the rest) and the units each tracker holds are stored on the trial (``rfopt:tracked``). The
    process that opens a trial's runs next logs the committed units after that from storage: the units a crash (or
    a tracker added to ``report_to`` later) left out.

        >>> tracking = Tracking(["wandb"], study)                              # doctest: +SKIP
        >>> runner.train_chunk(on_step=tracking.step_listener(3, on_step))     # trial 3's steps, in its run
    """

    def __init__(self, report_to: Sequence[str], study: Any) -> None:
        self.report_to = list(report_to)
        self.study = study
        self.name: str = study.study_name
        self.own = own(self.report_to)
        """The trackers rfopt logs to itself."""
        self.passed_on = passed_on(self.report_to)
        """The trackers given to each chunk's trainer as TRL's ``report_to``: one run per process."""
        self._trackers: dict[str, Tracker] | None = None
        self._trials: dict[int, _Trial] = {}
        self._broken: set[str] = set()

    def run_name(self, number: int) -> str:
        return f"{self.name}-trial-{number}"

    def trainer_args(self, number: int) -> dict[str, Any]:
        """``report_to`` and ``run_name`` of trial `number`'s chunk trainers (for the trackers passed on to TRL)."""
        return {"report_to": list(self.passed_on), "run_name": self.run_name(number)}

    # ------------------------------------------------------------------ what the engine tells it
    def step_listener(self, number: int, then: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
        """`then` (a `train_chunk` ``on_step``), after logging each step's TRL logs in trial `number`'s runs."""
        if not self.own:
            return then

        def listener(done: Any) -> None:
            if done.step > 0 and done.logs:
                try:
                    trial = self._trial(number)
                except Exception as exc:  # noqa: BLE001 - reading the trial failed: its training goes on regardless
                    logger.warning("trial %d: its runs could not be opened (%s: %s)", number, type(exc).__name__, exc)
                    trial = None
                if trial is not None:
                    row = dict(done.logs) | {"step": done.logs.get("step", done.global_step) + trial.offset}
                    trial.logged.add(int(row["step"]))
                    self._each(trial, "steps", [row])
            if then is not None:
                then(done)

        return listener

    def committed(self, number: int, unit: int, value: float) -> None:
        """Trial `number` committed `unit` with `value`: log its value and eval metrics (and the unit's steps this
        process did not see train: a unit a crash left durable, committed from its checkpoint); flush the runs and
        store that they hold it."""
        if not self.own:
            return
        trial = self._trial(number)
        if trial is None:
            return
        if unit >= trial.through:  # else the runs were opened just now, and the replay logged it
            record = self._record(number)
            steps = _unit_steps(record, unit)
            self._each(trial, "steps", [row for row in steps if int(row["step"]) not in trial.logged])
            self._each(trial, "chunk", _chunk_log(record, unit, steps, value))
            trial.through = unit + 1
        self._flushed(trial)

    def ended(self, study: Any, frozen: Any) -> None:
        """A trial this process ended (as an Optuna callback is called): record how in its runs, and close them."""
        if not self.own:
            return
        trial = self._trial(frozen.number, frozen)
        if trial is not None:
            self._end(frozen.number, trial, _end_of(TrialRecord(frozen)))

    def close(self) -> None:
        """The run of the study ends here: end the runs of trials that ended meanwhile (elsewhere too), release the
        others (they continue later), and show the study's leaderboard. Never raises."""
        if not self.own or self._trackers is None:
            return
        try:
            trials = self.study.get_trials(deepcopy=False)
        except Exception as exc:  # noqa: BLE001 - the storage is gone (why the run ends, maybe): release the runs
            logger.warning("trackers: could not read study %r (%s); its runs are left as they are", self.name, exc)
            trials = None
        for number, trial in list(self._trials.items()):
            record = TrialRecord(trials[number]) if trials is not None and number < len(trials) else None
            if record is not None and record.state.is_finished():
                self._end(number, trial, _end_of(record))
            else:
                self._each(trial, "release")
                self._trials.pop(number, None)
        if trials is not None:
            board = _leaderboard(self.study, trials)
            for name, tracker in self._trackers.items():
                self._call(name, "its leaderboard", lambda t=tracker: t.leaderboard(board))
        for name, tracker in self._trackers.items():
            self._call(name, "closing", tracker.close)

    # ------------------------------------------------------------------ runs
    def _trial(self, number: int, frozen: Any = None) -> _Trial | None:
        """Trial `number`'s open runs, opened now if none is (None if no tracker could open one); a run opened now
        gets the committed units its tracker does not hold yet, from storage."""
        trial = self._trials.get(number)
        if trial is not None:
            return trial
        uid = study_record(self.study).uid or self.name  # the study's identity, given before any trial trains
        if self._trackers is None:
            self._trackers = {}
            for name in self.own:
                tracker = self._call(name, "starting", lambda n=name: _tracker(n, self.name, uid))
                if tracker is not None:
                    self._trackers[name] = tracker
        ref = self._ref(number)
        record = TrialRecord(frozen) if frozen is not None else ref.read()
        info = _info(self.name, uid, record)
        runs: dict[str, TrialRun] = {}
        for name, tracker in self._trackers.items():
            run = self._call(name, f"trial {number}'s run", lambda t=tracker: t.open(info))
            if run is not None:
                runs[name] = run
        if not runs:
            return None
        inherited = [row["step"] for row in record.step_metrics() if row["unit"] < record.start_unit]
        trial = _Trial(info=info, ref=ref, runs=runs, offset=int(max(inherited, default=0)),
                       tracked=self._moved(info, record, runs), through=record.committed)
        self._trials[number] = trial
        self._replay(trial, record)
        return trial

    def _moved(self, info: TrialInfo, record: TrialRecord, runs: dict[str, TrialRun]) -> dict[str, int]:
        """The units each tracker holds of the trial where it writes now: none for a tracker whose place moved since it
        logged the trial (``TENSORBOARD_LOGGING_DIR`` changed, or another working directory for a relative ``runs``):
        the replay then logs the trial there whole, and a warning names both places. Stores where each writes."""
        tracked = dict(record.tracked)
        places = {}
        for name in runs:
            locate = getattr(self._trackers[name], "location", None)
            where = None if locate is None else self._call(name, f"trial {info.number}'s place", lambda f=locate: f(info))
            if where is None:
                continue
            places[name] = where
            before = record.tracked_at.get(name)
            if before is not None and before != where and tracked.get(name, 0) > 0:
                logger.warning("trial %d: report_to %s logged its run to %s, and this process logs it to %s (its "
                               "folder moved: TENSORBOARD_LOGGING_DIR or the working directory changed); its %d "
                               "committed units are logged there again from storage, so the run there is whole",
                               info.number, name, before, where, record.committed)
                tracked[name] = 0
        if places and any(record.tracked_at.get(name) != where for name, where in places.items()):
            try:
                schema.write_tracked_at(self._ref(info.number), record.tracked_at | places)
            except Exception as exc:  # noqa: BLE001 - the trial ended elsewhere: a later move goes untold
                logger.debug("trial %d: could not store where its trackers log (%s)", info.number, exc)
        return tracked

    def _replay(self, trial: _Trial, record: TrialRecord) -> None:
        """Log the committed units each tracker does not hold (after its ``rfopt:tracked`` mark) from storage."""
        behind = {name: trial.tracked.get(name, 0) for name in trial.runs
                  if trial.tracked.get(name, 0) < record.committed}
        if not behind:
            return
        values = record.trial.intermediate_values
        for unit in range(min(behind.values()), record.committed):
            steps = _unit_steps(record, unit)
            log = _chunk_log(record, unit, steps, values[unit]) if unit in values else None
            for name in [n for n, mark in behind.items() if mark <= unit and n in trial.runs]:
                run = trial.runs[name]
                self._call(name, f"trial {trial.info.number}'s replay", lambda r=run, s=steps: r.steps(s))
                if log is not None:
                    self._call(name, f"trial {trial.info.number}'s replay", lambda r=run, c=log: r.chunk(c))
        self._flushed(trial)

    def _flushed(self, trial: _Trial) -> None:
        """Flush the trial's runs; store that the trackers whose flush worked hold its units so far."""
        self._each(trial, "flush")
        held = {name: trial.through for name in trial.runs if name not in self._broken}
        if all(trial.tracked.get(name) == units for name, units in held.items()):
            return
        trial.tracked = trial.tracked | held
        try:
            schema.write_tracked(trial.ref, trial.tracked)
        except Exception as exc:  # noqa: BLE001 - the trial ended elsewhere: the next opener replays a little more
            logger.debug("trial %d: could not store what its trackers hold (%s)", trial.info.number, exc)

    def _end(self, number: int, trial: _Trial, end: TrialEnd) -> None:
        self._each(trial, "end", end)
        self._trials.pop(number, None)

    def _each(self, trial: _Trial, what: str, *args: Any) -> None:
        for name, run in list(trial.runs.items()):
            if name in self._broken:
                trial.runs.pop(name)
                continue
            self._call(name, f"trial {trial.info.number}'s {what}", lambda r=run: getattr(r, what)(*args))

    def _call(self, name: str, what: str, do: Callable[[], Any]) -> Any:
        """`do()`, for tracker `name`; one that fails is warned about once and written to no more by this process
        (None then)."""
        if name in self._broken:
            return None
        try:
            return do()
        except Exception as exc:  # noqa: BLE001 - a tracker's failure is not the trial's
            self._broken.add(name)
            logger.warning("report_to %s: %s failed (%s: %s); this process logs no more to %s, the trials go on",
                           name, what, type(exc).__name__, exc, name)
            return None

    def _ref(self, number: int) -> TrialRef:
        storage = storage_of(self.study)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id_of(self.study), number)
        return TrialRef(storage, trial_id, number)

    def _record(self, number: int) -> TrialRecord:
        trial = self._trials.get(number)
        return (trial.ref if trial is not None else self._ref(number)).read()


def _unit_steps(record: TrialRecord, unit: int) -> list[dict[str, float]]:
    """TRL's logs of `unit`'s steps as stored, on the trial's step axis."""
    return [{k: v for k, v in row.items() if k not in ("unit", "chunk")}
            for row in record.step_metrics() if row["unit"] == unit]


def _chunk_log(record: TrialRecord, unit: int, steps: list[dict[str, float]], value: float) -> ChunkLog:
    metrics = next((m.eval for m in record.unit_metrics() if m.unit == unit), {})
    return ChunkLog(unit=unit, step=max((int(row["step"]) for row in steps), default=0), value=value,
                    eval=dict(metrics))


def _info(study: str, study_id: str, record: TrialRecord) -> TrialInfo:
    import json

    lineage = record.lineage
    config = json.loads(record.config_json) if record.config_json else {}
    return TrialInfo(study=study, study_id=study_id, number=record.number, name=f"{study}-trial-{record.number}",
                     params=dict(record.trial.params), config=config,
                     clone_of=lineage.parent if lineage is not None else None,
                     warm_start=bool(lineage and lineage.warm_start), start_unit=record.start_unit)


def _end_of(record: TrialRecord) -> TrialEnd:
    state = record.state.name
    if record.cancelled is not None:
        name = "cancelled"
    elif state == "COMPLETE":
        name = "complete"
    elif state == "PRUNED":
        name = "stopped" if record.stop is not None else "pruned"
    else:
        name = "failed"
    return TrialEnd(state=name, reason=record.end_reason, value=record.value)


def _leaderboard(study: Any, trials: list[Any]) -> Leaderboard:
    """The study's trials, best first, in the order `Study.leaderboard` gives them (`TrialRecord.leaderboard_rank`)."""
    import optuna

    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    records = [TrialRecord(t) for t in trials if t.state.name != "WAITING"]
    params = sorted({k for r in records for k in r.trial.params})
    records.sort(key=lambda r: r.leaderboard_rank(maximize))
    rows = [[r.number, r.shown_state, r.value, r.committed, *[r.trial.params.get(k) for k in params], r.end_reason]
            for r in records]
    complete = [r for r in records if r.state.name == "COMPLETE" and r.value is not None]
    best = (complete[0].number, complete[0].value) if complete else None
    return Leaderboard(columns=["trial", "state", "value", "chunks", *params, "reason"], rows=rows,
                       finished=all(t.state.is_finished() for t in trials), best=best)
