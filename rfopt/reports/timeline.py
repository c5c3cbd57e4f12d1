"""Time and cost of a study, read from its records: when each trial started and ended, how long each chunk took, what
trains now and when it should end, and the compute spent against a run without pruning.

Everything here is computed from storage alone (`rfopt.storage.schema` records), so the dashboard, ``rfopt status`` and a
person's script agree:

- `TrialTimes`: a trial's start, end, elapsed time and each chunk's duration (training, from the swap-in on, plus its
  evaluation: the ``seconds`` and ``eval_seconds`` each unit stores);
- `NowTraining`: the unit a trial trains now (its ``rfopt:progress`` record), with an ETA for that chunk and for the
  trial's training left, from the step times measured so far;
- `StudyCost`: units trained of the units a run without pruning needs (every started trial trained to its end), and
  the time spent; `eta_seconds`: the study's time left at the measured pace if nothing more is pruned.

Chunks are counted from 1 for people ("chunk 2 of 4" is unit 1, Optuna's step 1), as everywhere rfopt writes text.

    >>> [NowTraining.of(TrialRecord(t)).line() for t in study.trials if TrialRecord(t).in_flight]  # doctest: +SKIP
    ['trial 3 · chunk 2 of 4 · 5 of 8 steps done · for 1m12s · 14.1 s/step · chunk ends in ~45s']
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from optuna.trial import TrialState

from rfopt.storage.schema import ProgressRecord, TrialRecord, UnitMetrics


def unit_seconds(metrics: UnitMetrics) -> float | None:
    """A committed unit's duration: its training (from the swap-in on) plus its evaluation; None if not measured
    (a unit committed from its checkpoint after a crash stores no training times)."""
    train = metrics.train.get("seconds")
    if train is None:
        return None
    return train + metrics.train.get("eval_seconds", 0.0)


@dataclass(frozen=True)
class TrialTimes:
    """When a trial ran and how long its chunks took."""

    number: int
    start: datetime.datetime | None
    end: datetime.datetime | None
    """When it finished (COMPLETE, PRUNED, FAIL); None while it runs."""
    chunk_seconds: dict[int, float]
    """Each committed unit's duration (training and evaluation), by unit."""
    chunk_started: dict[int, float]
    """When each committed unit started (seconds since the epoch), where it was recorded."""

    @classmethod
    def of(cls, record: TrialRecord) -> TrialTimes:
        trial = record.trial
        units = record.unit_metrics()
        seconds = {m.unit: s for m in units if (s := unit_seconds(m)) is not None}
        started = {m.unit: m.train["started_at"] for m in units if "started_at" in m.train}
        return cls(trial.number, trial.datetime_start, trial.datetime_complete, seconds, started)

    def elapsed(self, now: datetime.datetime | None = None) -> float | None:
        """Seconds from its start to its end (or to `now` while it runs)."""
        if self.start is None:
            return None
        end = self.end or now or datetime.datetime.now()
        return max(0.0, (end - self.start).total_seconds())

    @property
    def trained_seconds(self) -> float:
        """Time spent on its committed chunks (its units' durations)."""
        return sum(self.chunk_seconds.values())


@dataclass(frozen=True)
class NowTraining:
    """The unit a trial trains now, from its ``rfopt:progress`` record, with ETAs from the measured step times."""

    trial: int
    progress: ProgressRecord
    chunk_end_at: float | None
    """When this chunk should be trained and evaluated, at its pace so far (seconds since the epoch; counted from the
    record's write, so it stays put between writes)."""
    trial_end_at: float | None
    """When the trial should have trained its last chunk, at the study's measured pace, its later chunks taking turns
    with the other live trials' (round-robin, least progress first), if nothing is pruned (`trial_etas`)."""

    def chunk_left(self, now: float | None = None) -> float | None:
        return None if self.chunk_end_at is None else max(0.0, self.chunk_end_at - (time.time() if now is None else now))

    def trial_left(self, now: float | None = None) -> float | None:
        return None if self.trial_end_at is None else max(0.0, self.trial_end_at - (time.time() if now is None else now))

    @classmethod
    def of(cls, record: TrialRecord, trial_eta: float | None = None) -> NowTraining | None:
        """`record`'s unit in flight, or None. `trial_eta`: seconds until the trial's last chunk is done, counted from
        the record's write (`trial_etas`)."""
        progress = record.in_flight
        if progress is None:
            return None
        evals = [m.train["eval_seconds"] for m in record.unit_metrics() if "eval_seconds" in m.train]
        eval_left = statistics.fmean(evals) if evals else 0.0
        chunk_end = None
        if progress.phase == "evaluating":
            chunk_end = progress.updated + eval_left
        elif progress.step_seconds is not None:
            chunk_end = progress.updated + (progress.steps - progress.step) * progress.step_seconds + eval_left
        trial_end = None if trial_eta is None else progress.updated + trial_eta
        return cls(record.number, progress, chunk_end, trial_end)

    def line(self, now: float | None = None) -> str:
        """One line for a person: ``trial 3 · chunk 2 of 4 · 5 of 8 steps done · for 1m12s · 14.1 s/step · ...``."""
        p = self.progress
        now = time.time() if now is None else now
        parts = [f"trial {self.trial}", f"chunk {p.unit + 1} of {p.num_units}"]
        if p.phase == "loading":
            parts.append("loading (swapping the trial in)")
        elif p.phase == "evaluating":
            parts.append(f"evaluating after its {p.steps} steps")
        else:
            parts.append(f"{p.step} of {p.steps} steps done")
        parts.append(f"for {duration(now - p.started)}")
        if p.step_seconds is not None and p.phase == "training":
            parts.append(f"{p.step_seconds:.3g} s/step")
        if self.chunk_end_at is not None:
            parts.append(f"chunk ends in ~{duration(self.chunk_left(now))}")
        if self.trial_end_at is not None and p.unit + 1 < p.num_units:
            parts.append(f"its last chunk done in ~{duration(self.trial_left(now))}")
        if len(p.gang) > 1:
            parts.append(f"trained together with trials {', '.join(str(n) for n in p.gang if n != self.trial)}")
        quiet = now - p.updated
        if p.phase == "training" and p.step_seconds is not None and quiet > max(60.0, 3 * p.step_seconds):
            parts.append(f"last heard {duration(quiet)} ago")
        return " · ".join(parts)


def now_training(records: Iterable[TrialRecord], processes: int = 1) -> list[NowTraining]:
    """Every trial with a unit in flight, by trial number, with its ETAs (whether its process lives is
    `rfopt.reports.status.liveness`)."""
    records = list(records)
    etas = trial_etas(records, processes)
    found = [NowTraining.of(r, etas.get(r.number)) for r in records]
    return sorted((n for n in found if n is not None), key=lambda n: n.trial)


def trial_etas(records: Sequence[TrialRecord], processes: int = 1) -> dict[int, float]:
    """Seconds until each live trial has trained its last chunk, at the study's measured pace (`mean_unit_seconds`),
    if nothing is pruned. Under round-robin (least progress first) the units in flight finish first, then a trial
    with L units not started finishes once every live trial has trained min(L, its own units not started): so
    (what is left of the units in flight + the sum of those minimums) units, spread over `processes`."""
    per_unit = mean_unit_seconds(records)
    flights = [r.in_flight for r in records if r.state == TrialState.RUNNING and r.in_flight is not None]
    if per_unit is None:
        paced = [f for f in flights if f.step_seconds is not None]
        if not paced:
            return {}
        per_unit = statistics.fmean(f.steps * f.step_seconds for f in paced)
    in_flight = sum(1 - f.step / f.steps for f in flights if f.steps)
    later: dict[int, int] = {}
    for record in records:
        if record.state != TrialState.RUNNING or record.num_units is None or record.paused:
            continue
        started = 1 if record.in_flight is not None else 0
        later[record.number] = max(0, record.num_units - record.committed - started)
    return {n: (in_flight + sum(min(other, mine) for other in later.values())) * per_unit / max(1, processes)
            for n, mine in later.items()}


def mean_unit_seconds(records: Iterable[TrialRecord]) -> float | None:
    """The mean duration of the study's committed units (training and evaluation), None before any is measured."""
    times = [s for r in records for m in r.unit_metrics() if (s := unit_seconds(m)) is not None]
    return statistics.fmean(times) if times else None


@dataclass(frozen=True)
class StudyCost:
    """Compute spent, against a run without pruning (every started trial trained to its end)."""

    units_trained: int
    """Chunk units the study's trials trained (a warm clone's inherited units are its parent's)."""
    units_without_pruning: int
    """Units a run without pruning would train: every started trial's units, from where it started."""
    seconds: float
    """Time spent training and evaluating the committed units (measured; units without times not counted)."""
    units_left: int
    """Units the live trials (RUNNING, and WAITING ones with a schedule) still have to train."""
    eta_seconds: float | None
    """The study's time left at the measured pace if nothing more is pruned (the units left, spread over
    `processes`); None before any unit is measured."""
    processes: int = 1
    in_flight: list[int] = field(default_factory=list)

    @property
    def fraction(self) -> float | None:
        return self.units_trained / self.units_without_pruning if self.units_without_pruning else None

    def line(self) -> str:
        """``compute: 18 of 32 chunk units (56%) of a run without pruning · 7m12s so far · ~5m left ...``."""
        if not self.units_without_pruning:
            return "compute: no trial has started"
        text = (f"compute: {self.units_trained} of {self.units_without_pruning} chunk units "
                f"({100 * (self.fraction or 0):.0f}%) of a run without pruning · {duration(self.seconds)} of training "
                "and evaluation so far")
        if self.units_left and self.eta_seconds is not None:
            spread = f" over {self.processes} processes" if self.processes > 1 else ""
            text += (f" · study: ~{duration(self.eta_seconds)} left at this pace if nothing more is pruned "
                     f"({self.units_left} chunk units of the trials started{spread})")
        return text


def study_cost(records: Sequence[TrialRecord], processes: int = 1) -> StudyCost:
    """What the study's trials trained and would train without pruning, and its ETA (see `StudyCost`)."""
    trained = without = left = 0
    seconds = 0.0
    in_flight: list[int] = []
    done_in_flight = 0.0
    for record in records:
        if record.cancelled is not None or record.num_units is None:
            continue
        start = record.start_unit
        trained += max(0, record.committed - start)
        seconds += sum(s for m in record.unit_metrics() if (s := unit_seconds(m)) is not None)
        if record.state == TrialState.WAITING:
            left += record.num_units - start
            continue
        without += record.num_units - start
        if record.state == TrialState.RUNNING:
            left += record.num_units - record.committed
            flight = record.in_flight
            if flight is not None and flight.steps:
                in_flight.append(record.number)
                done_in_flight += flight.step / flight.steps
    per_unit = mean_unit_seconds(records)
    eta = None
    if per_unit is not None:
        eta = max(0.0, left - done_in_flight) * per_unit / max(1, processes)
    return StudyCost(trained, without, seconds, left, eta, max(1, processes), in_flight)


def step_times(record: TrialRecord) -> dict[tuple[int, int], float]:
    """When each logged optimizer step of a trial ended (seconds since the epoch), by (unit, global step): the unit's
    start plus its swap-in, plus TRL's ``step_time`` of each step so far (steps spaced evenly over the unit's training
    time where TRL logged none). Units that recorded no start are left out. The in-flight unit's steps too."""
    out: dict[tuple[int, int], float] = {}
    by_unit: dict[int, list[dict[str, float]]] = {}
    for row in record.step_metrics():
        by_unit.setdefault(int(row["unit"]), []).append(row)
    for metrics in record.unit_metrics():
        rows = by_unit.get(metrics.unit, [])
        start = metrics.train.get("started_at")
        if start is None or not rows:
            continue
        train = metrics.train.get("seconds", 0.0) - metrics.train.get("swap_seconds", 0.0)
        out.update(_placed(rows, metrics.unit, start + metrics.train.get("swap_seconds", 0.0), train))
    flight = record.in_flight
    rows = record.in_flight_steps()
    if flight is not None and rows:
        out.update(_placed(rows, flight.unit, flight.started, (flight.step_seconds or 0.0) * flight.step))
    return out


def value_times(record: TrialRecord) -> dict[int, float]:
    """When each committed unit's value was known (its start, training and evaluation), by unit, where recorded."""
    return {m.unit: m.train["started_at"] + (unit_seconds(m) or 0.0)
            for m in record.unit_metrics() if "started_at" in m.train}


def _placed(rows: list[dict[str, float]], unit: int, start: float, train_seconds: float) -> dict[tuple[int, int], float]:
    out = {}
    clock = start
    even = train_seconds / len(rows) if rows else 0.0
    for row in sorted(rows, key=lambda r: r["step"]):
        clock += row.get("step_time", even)
        out[(unit, int(row["step"]))] = clock
    return out


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h04m``: a duration for people."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
