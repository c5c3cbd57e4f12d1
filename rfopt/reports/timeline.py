"""Time and cost of a study, read from its records: when each trial started and ended, how long each chunk took, what
trains now and when it should end, and the compute spent against a run without pruning.

Everything here is computed from storage alone (`rfopt.storage.schema` records), so the dashboard, ``rfopt status`` and a
person's script agree:

- `TrialTimes`: a trial's start, end, elapsed time and each chunk's duration (training, from the swap-in on, plus its
  evaluation: the ``seconds`` and ``eval_seconds`` each unit stores);
- `NowTraining`: the unit a trial (or a gang, as one) trains now (its ``rfopt:progress`` records): its phase and what it
  does within it (`activity_text`: rollouts decoded so far, member k of n, eval prompts done), with an ETA for
  that chunk from the step times measured so far, and its `Silence`: how long it has not moved against its usual step
  time (slow, or stuck: then its ETAs are on hold);
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

from rfopt.storage.schema import Activity, ProgressRecord, TrialRecord, UnitMetrics


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
STUCK_UNKNOWN = 600.0
"""Seconds without a sign of life before a unit reads as stuck where no time is known to compare with (a study's very
first step, loading or evaluation, the base model's evaluation): a generous bound, said as such, so that loading a
model, evaluating the base model or a first gang step on a busy machine is not called stuck."""

PHASE_WORDS = {"baseline": "evaluating the base model with no adapter (the study's baseline)",
               "loading": "loading (swapping the trial in)", "saving": "saving its checkpoint and committing"}
"""What a unit in flight is doing, in words, for the phases that are not counted in steps."""


def activity_text(activity: Activity | None, now: float | None = None, short: bool = False) -> str:
    """What a unit in flight does within its phase (`rfopt.storage.schema.Activity`), in words: ``decoding rollouts:
    40 of at most 128 new tokens (12 tokens/s)`` (``decoding rollouts: prefilling the prompts`` before the first
    token), ``training member 2 of 3 (trial 4), 35s into its turn`` (the time with `now` only), ``the gang's batched
    step, all 3 members at once``, ``16 of 32 prompts (the batch now: 40 of at most 128 tokens)``; `short`, for the
    terminal's line: ``dec 40/128tok``, ``m2/3 t4``, ``batched x3``, ``16/32 prompts``. Empty for None."""
    if activity is None:
        return ""
    a = activity
    if short:
        return {"decoding": f"dec {a.done}/{a.total}tok" if a.total else "dec prefill",
                "member": f"m{a.done}/{a.total} t{a.trial}", "batched": f"batched x{a.total}",
                "prompts": f"{a.done}/{a.total} prompts"}.get(a.what, a.what)
    rate = f" ({a.rate:.0f} tokens/s)" if a.rate and a.rate >= 10 else f" ({a.rate:.2g} tokens/s)" if a.rate else ""
    if a.what == "decoding":
        if not a.total:  # no token yet: its most new tokens come with the first
            return "decoding rollouts: prefilling the prompts"
        return f"decoding rollouts: {a.done} of at most {a.total} new tokens{rate}"
    if a.what == "member":
        since = "" if now is None or not a.since else f", {duration(now - a.since)} into its turn"
        return f"training member {a.done} of {a.total} (trial {a.trial}){since}"
    if a.what == "batched":
        return f"the gang's batched step, all {a.total} members at once"
    if a.what == "prompts":
        batch = f" (the batch now: {a.tokens} of at most {a.max_tokens} tokens{rate})" if a.tokens else ""
        return f"{a.done} of {a.total} prompts{batch}"
    return a.what


@dataclass(frozen=True)
class Silence:
    """How long a unit in flight has not moved (no optimizer step ended, no phase began), against how long its phase
    usually takes: "slow" and "stuck" told apart. Past `stuck_at` the unit reads as stuck (a hung reward function, a
    dead process): its ETAs stop counting down and the page, ``rfopt status`` and the progress bar say so.

    The usual time is the unit's own median step time (one stall does not inflate it), else its earlier units', else
    a prior: the median of the study's other trials (`prior`), else none: then `STUCK_UNKNOWN`, a generous bound named
    as such. A gang's members share one silence (`now_training`)."""

    since: float
    """When it last moved (seconds since the epoch)."""
    usual: float | None
    """How long its phase's next sign of life usually takes: a step, the evaluation, the loading; None if unknown."""
    what: str
    """``step``, ``evaluation``, ``loading``, ``baseline`` or ``saving``."""
    prior: bool = False
    """Whether `usual` is the study's other trials' (its own not measured yet): a prior, named as such."""

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
        """``a step takes ~8.1 s``; ``a step of this study's other trials takes ~8.1 s (its own: not measured yet)``;
        ``no step time to compare with yet: stuck only after 10m00s, a generous bound``."""
        noun = {"baseline": "base-model evaluation", "saving": "saving"}.get(self.what, self.what)
        if self.usual is None:
            return f"no {noun} time to compare with yet: stuck only after {duration(self.limit)}, a generous bound"
        article = "an" if noun[0] in "aeiou" else "a"
        if self.prior:
            return (f"{article} {noun} of this study's other trials takes ~{_seconds(self.usual)} (its own: not "
                    "measured yet)")
        return f"{article} {noun} takes ~{_seconds(self.usual)}"

    def text(self, now: float | None = None) -> str:
        """``no step for 1m40s (a step takes ~8.1 s)``."""
        quiet = (time.time() if now is None else now) - self.since
        noun = {"step": "no step", "evaluation": "evaluating", "loading": "loading",
                "baseline": "evaluating the base model", "saving": "saving"}[self.what]
        return f"{noun} for {duration(quiet)} ({self.usual_text()})"

    @classmethod
    def of(cls, record: TrialRecord, peers: Sequence[TrialRecord] = ()) -> Silence | None:
        """The silence of `record`'s unit in flight; None when none is in flight. `peers`: the study's other trials,
        whose times are the prior while its own are not measured yet."""
        progress = record.in_flight
        if progress is None:
            return None
        others = [p for p in peers if p.number != record.number]
        if progress.phase in ("baseline", "saving"):  # no time of theirs is stored: the generous bound
            return cls(progress.moved, None, progress.phase)
        if progress.phase in ("evaluating", "loading"):
            key, what = ("eval_seconds", "evaluation") if progress.phase == "evaluating" else ("swap_seconds", "loading")
            own = [m.train[key] for m in record.unit_metrics() if key in m.train]
            if own:
                return cls(progress.moved, statistics.median(own), what)
            prior = [m.train[key] for p in others for m in p.unit_metrics() if key in m.train]
            return cls(progress.moved, statistics.median(prior) if prior else None, what, prior=bool(prior))
        if progress.step_seconds is not None:
            return cls(progress.moved, progress.step_seconds, "step")
        own = _step_paces(record)
        if own:  # its earlier units' pace
            return cls(progress.moved, statistics.median(own), "step")
        prior = [pace for p in others for pace in _step_paces(p)]
        prior += [f.step_seconds for p in others if (f := p.in_flight) is not None and f.step_seconds is not None]
        return cls(progress.moved, statistics.median(prior) if prior else None, "step", prior=bool(prior))


def _step_paces(record: TrialRecord) -> list[float]:
    """Seconds per optimizer step of each of `record`'s committed units (their training, less the swap-in)."""
    schedule = record.schedule
    if schedule is None or not schedule.steps_per_chunk:
        return []
    return [(m.train["seconds"] - m.train.get("swap_seconds", 0.0)) / schedule.steps_per_chunk
            for m in record.unit_metrics() if "seconds" in m.train]


@dataclass(frozen=True)
class NowTraining:
    """The unit a trial (or a gang: its members, in lockstep) trains now, from the ``rfopt:progress`` records, with the
    chunk's ETA from the measured step times. A gang is one: one step counter (the steps every member has done), one
    pace (the members' median) and one stuck verdict (it moved when any member moved)."""

    trial: int
    """The trial, or the gang's first member."""
    progress: ProgressRecord
    """Its unit's progress (a gang's: the members' records merged as said above)."""
    chunk_end_at: float | None
    """When this chunk should be trained and evaluated, at its pace so far (seconds since the epoch; counted from the
    record's write, so it stays put between writes). The study's end is `rfopt.reports.forecast`'s alone."""
    silence: Silence | None = None
    """How long the unit has not moved, against its usual pace: whether it reads as stuck."""
    members: tuple[int, ...] = ()
    """A gang's trials in flight (its first, `trial`, included); empty for a trial training alone."""

    @property
    def trials(self) -> tuple[int, ...]:
        return self.members or (self.trial,)

    def chunk_left(self, now: float | None = None) -> float | None:
        return None if self.chunk_end_at is None else max(0.0, self.chunk_end_at - (time.time() if now is None else now))

    @classmethod
    def of(cls, record: TrialRecord, peers: Sequence[TrialRecord] = ()) -> NowTraining | None:
        """`record`'s unit in flight, or None. `peers`: the study's trials (the prior of `Silence.of`)."""
        progress = record.in_flight
        if progress is None:
            return None
        evals = [m.train["eval_seconds"] for m in record.unit_metrics() if "eval_seconds" in m.train]
        return cls(record.number, progress, _chunk_end(progress, statistics.median(evals) if evals else 0.0),
                   Silence.of(record, peers))

    def stuck(self, now: float | None = None) -> bool:
        return self.silence is not None and self.silence.stuck(now)

    def what(self, now: float | None = None) -> str:
        """Its phase in words, and what it does within it (`activity_text`): ``5 of 8 steps done``, ``0 of 8 steps
        done, training member 2 of 3 (trial 4), 35s into its turn`` (the turn's time with `now` only: the page counts
        it by its own clock), ``evaluating after its 8 steps: 16 of 32 prompts``, ``loading (...)``."""
        p = self.progress
        if p.phase == "evaluating":
            text = f"evaluating after its {p.steps} steps"
        else:
            text = PHASE_WORDS.get(p.phase) or f"{p.step} of {p.steps} steps done"
        doing = activity_text(p.activity, now)
        if not doing:
            return text
        return f"{text}: {doing}" if p.activity.what == "prompts" else f"{text}, {doing}"

    def who(self) -> str:
        """``trial 3``, or ``trials 3, 4, 5 (one gang)``."""
        if self.members:
            return f"trials {', '.join(map(str, self.members))} (one gang)"
        return f"trial {self.trial}"

    def line(self, now: float | None = None) -> str:
        """One line for a person: ``trial 3 · chunk 2 of 4 · 5 of 8 steps done · for 1m12s · 14.1 s/step · ...``."""
        p = self.progress
        now = time.time() if now is None else now
        parts = [self.who(), f"chunk {p.unit + 1} of {p.num_units}", self.what(now), f"for {duration(now - p.started)}"]
        if p.step_seconds is not None and p.phase == "training":
            parts.append(f"{p.step_seconds:.3g} s/step")
        if self.stuck(now):
            assert self.silence is not None
            parts.append(f"STUCK? {self.silence.text(now)}: its ETAs are on hold until it moves")
        elif self.chunk_end_at is not None:
            parts.append(f"chunk ends in ~{duration(self.chunk_left(now))}")
        return " · ".join(parts)


def _chunk_end(progress: ProgressRecord, eval_seconds: float) -> float | None:
    if progress.phase == "evaluating":
        return progress.updated + eval_seconds
    if progress.phase == "training" and progress.step_seconds is not None:
        return progress.updated + (progress.steps - progress.step) * progress.step_seconds + eval_seconds
    return None


_PHASE_ORDER = {"baseline": 0, "loading": 1, "training": 2, "evaluating": 3, "saving": 4}


def now_training(records: Iterable[TrialRecord], processes: int = 1) -> list[NowTraining]:
    """Every trial alone with a unit in flight, and every gang in flight as one (`NowTraining`), by (first) trial
    number (whether its process lives is `rfopt.reports.status.liveness`). `processes` is kept for callers; the
    study's end is `rfopt.reports.forecast`'s."""
    records = list(records)
    singles = [n for r in records if (n := NowTraining.of(r, records)) is not None]
    gangs: dict[tuple, list[NowTraining]] = {}
    out = []
    for n in singles:
        p = n.progress
        if len(p.gang) > 1:
            gangs.setdefault((p.holder, p.unit, p.gang), []).append(n)
        else:
            out.append(n)
    for members in gangs.values():
        out.append(members[0] if len(members) == 1 else _gang(sorted(members, key=lambda n: n.trial)))
    return sorted(out, key=lambda n: n.trial)


def _gang(members: list[NowTraining]) -> NowTraining:
    """A gang's members in flight as one: the steps every member has done, the least advanced member's phase, the
    members' median pace, and one silence (since the last move of any member, against the members' median usual)."""
    progresses = [n.progress for n in members]
    behind = min(progresses, key=lambda p: (_PHASE_ORDER.get(p.phase, 2), p.step))
    paces = [p.step_seconds for p in progresses if p.step_seconds is not None]
    # What the gang does now: the newest activity of the members in that phase (every member hears the gang's; an
    # evaluation's prompts: the member furthest behind).
    doing = [p.activity for p in progresses if p.activity is not None and p.phase == behind.phase]
    merged = ProgressRecord(
        unit=behind.unit, num_units=behind.num_units, phase=behind.phase, step=behind.step, steps=behind.steps,
        global_step=behind.global_step, started=min(p.started for p in progresses),
        updated=max(p.updated for p in progresses), step_seconds=statistics.median(paces) if paces else None,
        logs={}, holder=behind.holder, gang=behind.gang, stepped=max(p.moved for p in progresses),
        activity=max(doing, key=lambda a: (a.since, -a.done)) if doing else None)
    silences = [n.silence for n in members if n.silence is not None]
    silence = None
    if silences:
        last = max(silences, key=lambda s: s.since)
        alike = [s for s in silences if s.what == last.what and s.usual is not None]
        own = [s.usual for s in alike if not s.prior]
        usual = statistics.median(own) if own else statistics.median([s.usual for s in alike]) if alike else None
        silence = Silence(last.since, usual, last.what, prior=not own and usual is not None)
    ends = [n.chunk_end_at for n in members if n.chunk_end_at is not None]
    return NowTraining(members[0].trial, merged, max(ends) if ends else None, silence,
                       tuple(n.trial for n in members))


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
            text += f", and stopping trials by hand {self.units_stopped} more"
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
