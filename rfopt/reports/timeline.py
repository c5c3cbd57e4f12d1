"""Time and cost of a study, read from its records: when each trial started and ended, how long each chunk took, what
trains now and when it should end, and the compute spent against a run without pruning.

Everything here is computed from storage alone (`rfopt.storage.schema` records), so the dashboard, ``rfopt status`` and a
person's script agree:

- `TrialTimes`: a trial's start, end, elapsed time and each chunk's duration (training, from the swap-in on, plus its
  evaluation: the ``seconds`` and ``eval_seconds`` each unit stores);
- `NowTraining`: the unit a trial trains now (its ``rfopt:progress`` record), with an ETA for that chunk and for the
  trial's training left, from the step times measured so far, and its `Silence`: how long it has not moved against
  its usual step time (slow, or stuck: then its ETAs are on hold);
- `StudyCost`: what pruning saved of the units a run without pruning needs (every started trial trained to its end),
  the time spent summed over trials, and the wall time. The study's time left is `rfopt.reports.forecast`'s.

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


STUCK_TIMES = 5.0
"""A unit in flight that has not moved for this many times its usual step (evaluation, loading) time reads as stuck."""
STUCK_FLOOR = 10.0
"""...and for at least this many seconds."""
STUCK_UNKNOWN = 120.0
"""Seconds without a sign of life before a unit reads as stuck where its usual pace is not known yet."""


@dataclass(frozen=True)
class Silence:
    """How long a unit in flight has not moved (no optimizer step ended, no phase began), against how long its phase
    usually takes: "slow" and "stuck" told apart. Past `stuck_at` the unit reads as stuck (a hung reward function, a
    dead process): its ETAs stop counting down and the page, ``rfopt status`` and the progress bar say so."""

    since: float
    """When it last moved (seconds since the epoch)."""
    usual: float | None
    """How long its phase's next sign of life usually takes: a step, the evaluation, the loading; None if unknown."""
    what: str
    """``step``, ``evaluation`` or ``loading``."""

    @property
    def limit(self) -> float:
        return STUCK_UNKNOWN if self.usual is None else max(STUCK_TIMES * self.usual, STUCK_FLOOR)

    @property
    def stuck_at(self) -> float:
        """When it reads as stuck if nothing moves before."""
        return self.since + self.limit

    def stuck(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.stuck_at

    def usual_text(self) -> str:
        """``a step takes ~8.1 s``."""
        if self.usual is None:
            return f"its usual {self.what} time is not known yet"
        article = "an" if self.what == "evaluation" else "a" if self.what == "step" else ""
        return f"{article} {self.what} takes ~{_seconds(self.usual)}".strip()

    def text(self, now: float | None = None) -> str:
        """``no step for 1m40s (a step takes ~8.1 s)``."""
        quiet = (time.time() if now is None else now) - self.since
        noun = {"step": "no step", "evaluation": "evaluating", "loading": "loading"}[self.what]
        return f"{noun} for {duration(quiet)} ({self.usual_text()})"

    @classmethod
    def of(cls, record: TrialRecord) -> Silence | None:
        """The silence of `record`'s unit in flight; None when none is in flight."""
        progress = record.in_flight
        if progress is None:
            return None
        units = record.unit_metrics()
        if progress.phase == "evaluating":
            evals = [m.train["eval_seconds"] for m in units if "eval_seconds" in m.train]
            return cls(progress.moved, statistics.fmean(evals) if evals else None, "evaluation")
        if progress.phase == "loading":
            swaps = [m.train["swap_seconds"] for m in units if "swap_seconds" in m.train]
            return cls(progress.moved, statistics.fmean(swaps) if swaps else None, "loading")
        usual = progress.step_seconds
        if usual is None and progress.steps:  # its earlier units' pace
            paces = [(m.train["seconds"] - m.train.get("swap_seconds", 0.0)) / progress.steps
                     for m in units if "seconds" in m.train]
            usual = statistics.fmean(paces) if paces else None
        return cls(progress.moved, usual, "step")


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
    silence: Silence | None = None
    """How long the unit has not moved, against its usual pace: whether it reads as stuck."""

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
        return cls(record.number, progress, chunk_end, trial_end, Silence.of(record))

    def stuck(self, now: float | None = None) -> bool:
        return self.silence is not None and self.silence.stuck(now)

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
        if self.stuck(now):
            assert self.silence is not None
            parts.append(f"STUCK? {self.silence.text(now)}: its ETAs are on hold until it moves")
        else:
            if self.chunk_end_at is not None:
                parts.append(f"chunk ends in ~{duration(self.chunk_left(now))}")
            if self.trial_end_at is not None and p.unit + 1 < p.num_units:
                parts.append(f"its last chunk done in ~{duration(self.trial_left(now))}")
        if len(p.gang) > 1:
            parts.append(f"trained together with trials {', '.join(str(n) for n in p.gang if n != self.trial)}")
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
    """Compute spent, and what pruning saved, against a run without pruning (every started trial trained to its
    end)."""

    units_trained: int
    """Chunk units the study's trials trained (a warm clone's inherited units are its parent's)."""
    units_without_pruning: int
    """Units a run without pruning would train: every started trial's units, from where it started."""
    seconds: float
    """Time spent training and evaluating the committed units, summed over trials (measured; units without times not
    counted): trials trained together in a gang each count the gang's time."""
    units_left: int
    """Units the live trials (RUNNING, and WAITING ones with a schedule) still have to train if none is pruned."""
    units_saved: int = 0
    """Units pruned trials will never train (the rest of their plan)."""
    units_stopped: int = 0
    """Units trials a person stopped will never train."""
    wall_seconds: float | None = None
    """Wall time from the study's first chunk's start to its last chunk's end (or to now while a chunk trains)."""
    processes: int = 1
    in_flight: list[int] = field(default_factory=list)

    @property
    def fraction(self) -> float | None:
        return self.units_trained / self.units_without_pruning if self.units_without_pruning else None

    def line(self) -> str:
        """``pruning saved 12 of 26 chunk units (46%) · 17m02s of training and evaluation summed over trials ·
        6m45s wall time since the first chunk started``."""
        if not self.units_without_pruning:
            return "compute: no trial has started"
        total = self.units_without_pruning
        text = f"pruning saved {self.units_saved} of {total} chunk units ({100 * self.units_saved / total:.0f}%)"
        if self.units_stopped:
            text += f", stops {self.units_stopped} more"
        text += (f" · {self.units_trained} trained so far · {duration(self.seconds)} of training and evaluation "
                 "summed over trials")
        if self.wall_seconds is not None:
            text += f" · {duration(self.wall_seconds)} wall time since the first chunk started"
        return text


def study_cost(records: Sequence[TrialRecord], processes: int = 1, now: float | None = None) -> StudyCost:
    """What the study's trials trained, what pruning saved, and the time it took (see `StudyCost`)."""
    trained = without = left = saved = stopped = 0
    seconds = 0.0
    in_flight: list[int] = []
    first, last = None, None
    for record in records:
        if record.cancelled is not None or record.num_units is None:
            continue
        start = record.start_unit
        trained += max(0, record.committed - start)
        for m in record.unit_metrics():
            took = unit_seconds(m)
            seconds += took or 0.0
            if "started_at" in m.train:
                first = min(first or m.train["started_at"], m.train["started_at"])
                last = max(last or 0.0, m.train["started_at"] + (took or 0.0))
        if record.state == TrialState.WAITING:
            left += record.num_units - start
            continue
        without += record.num_units - start
        if record.state == TrialState.PRUNED:
            never = max(0, record.num_units - record.committed)
            if record.stop is not None:
                stopped += never
            else:
                saved += never
        if record.state == TrialState.RUNNING:
            left += record.num_units - record.committed
            flight = record.in_flight
            if flight is not None and flight.steps:
                in_flight.append(record.number)
                first = min(first or flight.started, flight.started)
    if in_flight:
        last = time.time() if now is None else now
    wall = None if first is None or last is None else max(0.0, last - first)
    return StudyCost(trained, without, seconds, left, saved, stopped, wall, max(1, processes), in_flight)


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


def clock_time(epoch: float, millis: bool = False) -> str:
    """The local time of day (with the date when not today), as this machine's clock reads it: ``12:03:40``.
    `millis`: to the millisecond, ``12:03:40.412`` (`epoch` rounded as ``f"{epoch:.3f}"`` rounds it), to name one
    version of a study's records: they change several times a second while a chunk trains."""
    when = datetime.datetime.fromtimestamp(round(epoch, 3) if millis else epoch).astimezone()
    today = datetime.datetime.now().astimezone().date()
    day = "" if when.date() == today else "%Y-%m-%d "
    if millis:
        return when.strftime(f"{day}%H:%M:%S.%f")[:-3]
    return when.strftime(f"{day}%H:%M" if day else "%H:%M:%S")


def _seconds(seconds: float) -> str:
    """``8.1 s``, ``45 s``, ``3m05s``: a short time, with a decimal below 10 s."""
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 60 else duration(seconds)


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
