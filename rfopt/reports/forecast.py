"""How long a study has left, and how much it will still train: the one estimator the dashboard, ``rfopt status`` and
the progress bar show.

It reads the storage alone: the live trials' records (progress, the unit in flight), the rung decisions stored so
far, and how the study's run trains it (`rfopt.storage.schema.RunShape`: the pruner's schedule as an
`rfopt.pruning.Outlook`, the gang size, the trials it will still start). Then it walks the units left level by level
(every live trial trains unit k before any trains unit k+1: round-robin, least progress first):

- at a rung, only some of the trials that reach it go on: successive halving and Hyperband keep the top
  ``ceil(n / eta)`` of the ``n`` that reached it (known exactly); median and percentile pruners about their share
  (an expectation); a trial's chance to go on is what is left of the rung's places for the trials not judged yet;
- a level's units train in gangs of up to G trials (split evenly, as the scheduler forms them), each gang taking the
  time measured for gangs of its size (training and evaluation, plus the gap measured between rounds; sizes not seen
  yet are scaled from the nearest one seen), spread over the processes running the study.

The result (`Forecast`) is anchored at the time of the newest record it read, so two readers of the same stored data
(the page and ``rfopt status``) give the same end time, whenever they ask. `Forecast.seconds_left_max` is the time if
nothing more is pruned: where the pruner's schedule is an expectation (median, percentile) or unknown (threshold,
Wilcoxon, your own), the page shows the two as a range.

    >>> f = forecast([TrialRecord(t) for t in study.trials], study_record(study).run_shape)   # doctest: +SKIP
    >>> f.text()                                                                                 # doctest: +SKIP
    '~4m10s left (9.5 chunk units; SuccessiveHalvingPruner: rungs after chunks 1, 2, each keeps the top 1/2)'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.trial import TrialState

from rfopt.pruning import Ladder, Outlook
from rfopt.storage.schema import RunShape, TrialRecord, gang_plan

from .timeline import duration, unit_seconds

GANG_SCALING = 0.7
"""How a gang's time grows with its size where only another size was measured: T(g) = T(g0) * (g / g0) ** 0.7 (a
gang shares its generation; BENCHMARKS.md measured 4 trials together at 0.66x the time of 4 alone on the CPU)."""
TRAIN_SHARE = 0.85
"""The share of a unit's time spent training (the rest: its evaluation) when none was measured yet."""


@dataclass(frozen=True)
class Forecast:
    """What a study has left to train, and how long that takes (see the module's docstring)."""

    units_left: float
    """Chunk units the live trials will still train, as the pruner's schedule lets them (expected)."""
    units_left_max: float
    """Chunk units left if nothing more is pruned."""
    units_to_commit: float
    """Chunk units the live trials will still commit, as the pruner's schedule lets them: `units_left` with the
    units in flight counted whole (what a progress bar's total counts)."""
    seconds_left: float | None
    """Time left, from `anchor`; None before any unit's time is known."""
    seconds_left_max: float | None
    """Time left if nothing more is pruned."""
    anchor: float
    """When the newest record it read was written (seconds since the epoch): the end is `anchor` + `seconds_left`."""
    certain: bool
    """Whether the pruner's schedule is known exactly (halving, Hyperband, none): else `seconds_left_max` bounds it."""
    schedule: str
    """The pruner's schedule in words (`rfopt.pruning.Outlook.describe`)."""
    trials: int
    """Live trials counted (paused ones are not: they train again once resumed), those still to start included."""
    firm: bool = True
    """Whether a committed unit's time was measured: before, `seconds_left` is a first guess from the steps in
    flight (they leave out loading, evaluation and the gaps between rounds), and people are shown "after the first
    chunk" rather than a number."""

    @property
    def end_at(self) -> float | None:
        return None if self.seconds_left is None else self.anchor + self.seconds_left

    @property
    def end_at_max(self) -> float | None:
        return None if self.seconds_left_max is None else self.anchor + self.seconds_left_max

    @property
    def ranged(self) -> bool:
        """Whether to show a range: the schedule is uncertain and pruning could still change the end by over 10%."""
        return (not self.certain and self.seconds_left is not None and self.seconds_left_max is not None
                and self.seconds_left_max > 1.1 * self.seconds_left + 1)

    def left(self, now: float) -> tuple[float, float] | None:
        """(expected, if nothing more is pruned) seconds left at `now`; None before any time is known."""
        if self.end_at is None or self.end_at_max is None:
            return None
        return max(0.0, self.end_at - now), max(0.0, self.end_at_max - now)

    def text(self, now: float | None = None) -> str:
        """``~4m10s left (9.5 chunk units; SuccessiveHalvingPruner: ...)``, or with a range where the schedule is an
        expectation: ``~3m left, up to ~7m if nothing more is pruned (...)``."""
        if self.units_left <= 0:
            return "nothing left to train"
        left = self.left(self.anchor if now is None else now)
        units = f"{self.units_left:.3g} chunk units"
        if left is None or not self.firm:
            return f"{units} left ({self.schedule}); its end is estimated after the first chunk commits"
        text = f"~{duration(left[0])} left"
        if self.ranged:
            text += f", up to ~{duration(left[1])} if nothing more is pruned"
        return f"{text} ({units}; {self.schedule})"


@dataclass
class _Live:
    number: int
    progress: int
    """Units committed: the next unit it trains."""
    units: int
    done: float
    """The share of its unit in flight already done (0 when none is in flight)."""
    gang: tuple[int, ...]
    group: int
    ladder: Ladder | None
    chance: float = 1.0
    """How likely it still trains at the level being walked (the rungs before it may prune it)."""


def forecast(records: Sequence[TrialRecord], shape: RunShape | None, processes: int = 1) -> Forecast:
    """The study's time and units left (see the module's docstring). `shape`: how its run trains it (the study
    record's `run_shape`; None for a study an earlier rfopt ran: as if nothing more is pruned, one trial at a time)."""
    records = [r for r in records if r.cancelled is None]
    longest = max((r.num_units for r in records if r.num_units is not None), default=1)
    outlook = Outlook.from_attr(shape.pruning) if shape is not None else Outlook("", "unknown", longest)
    gang_size = max(1, shape.gang_size if shape is not None else 1)
    pace = _Pace.of(records)
    live = _live_trials(records, outlook, longest, pace.train_share)
    if shape is not None and shape.target_trials is not None:
        started = sum(r.state != TrialState.WAITING and r.lineage is None for r in records)
        first = max((r.number for r in records), default=-1) + 1
        for i in range(max(0, shape.target_trials - started)):  # asked later, from the start
            live.append(_Live(first + i, 0, longest, 0.0, (), outlook.group(first + i), outlook.ladder(first + i)))
    anchor = max([r.in_flight.updated for r in records if r.in_flight is not None and r.state == TrialState.RUNNING]
                 + pace.ends, default=0.0)
    expected = _walk(live, records, outlook, gang_size, processes, pace, prune=True)
    at_most = _walk(live, records, outlook, gang_size, processes, pace, prune=False)
    schedule = outlook.describe() if shape is not None else "no pruning schedule stored: as if nothing more is pruned"
    return Forecast(expected[0], at_most[0], expected[2], expected[1], at_most[1], anchor,
                    outlook.certain and shape is not None, schedule, len(live), firm=bool(pace.ends))


def _live_trials(records: Sequence[TrialRecord], outlook: Outlook, longest: int, train_share: float) -> list[_Live]:
    out = []
    for r in records:
        if r.state == TrialState.RUNNING and not r.paused:
            flight = r.in_flight
            done = 0.0
            if flight is not None and flight.steps:
                done = (1.0 if flight.phase == "saving" else train_share if flight.phase == "evaluating"
                        else train_share * flight.step / flight.steps)
            progress, gang = r.committed, flight.gang if flight is not None else ()
        elif r.state == TrialState.WAITING:
            progress, done, gang = r.start_unit, 0.0, ()
        else:
            continue
        if any(d is not None and d.prune for d in map(r.decision, r.decided_steps)):
            continue  # decided: it is told PRUNED next
        units = r.num_units or longest
        if progress < units:
            out.append(_Live(r.number, progress, units, done, gang, outlook.group(r.number), outlook.ladder(r.number)))
    return out


def _walk(live: list[_Live], records: Sequence[TrialRecord], outlook: Outlook, gang_size: int, processes: int,
          pace: _Pace, prune: bool) -> tuple[float, float | None, float]:
    """Units and seconds left, and units to commit (those in flight whole), walking the levels (units) in order; with
    `prune`, the rungs prune as scheduled."""
    trials = [_Live(t.number, t.progress, t.units, t.done, t.gang, t.group, t.ladder) for t in live]
    if not trials:
        return 0.0, 0.0, 0.0
    units = whole = 0.0
    seconds: float | None = 0.0
    # From the level below the least progress: a rung there may still be undecided for trials that reported it.
    for level in range(max(0, min(t.progress for t in trials) - 1), max(t.units for t in trials)):
        here = [t for t in trials if t.progress <= level < t.units]
        mass = sum(t.chance for t in here)
        done = sum(t.chance * t.done for t in here if t.progress == level)
        units += mass - done
        whole += mass
        took = _level_seconds(here, level, gang_size, processes, pace)
        seconds = None if seconds is None or took is None else seconds + took
        if prune:
            _rung(trials, records, outlook, level)
    return units, seconds, whole


def _rung(trials: list[_Live], records: Sequence[TrialRecord], outlook: Outlook, level: int) -> None:
    """The trials' chances after the rung at `level`, where their ladders have one."""
    groups: dict[int, list[_Live]] = {}
    for t in trials:
        if t.ladder is not None and level in t.ladder.rungs and level < t.units - 1 and t.progress <= level + 1:
            groups.setdefault(t.group, []).append(t)
    for group, judged in groups.items():
        ladder = judged[0].ladder
        assert ladder is not None
        decided = kept = 0
        numbers = {t.number for t in judged}
        for r in records:  # the trials that reported this step and were judged already
            if level in r.trial.intermediate_values and r.state != TrialState.FAIL and outlook.group(r.number) == group:
                decision = r.decision(level)
                if decision is not None:
                    decided += 1
                    kept += not decision.prune
                elif r.number not in numbers:
                    decided += 1  # ended or paused with a value there: it holds a place
                    kept += 1
        stored = {r.number for r in records if r.number in numbers and r.decision(level) is not None}
        undecided = [t for t in judged if t.number not in stored]
        mass = sum(t.chance for t in undecided)
        reach = decided + mass
        if mass <= 0:
            continue
        share = min(1.0, max(0.0, (ladder.kept(reach) - kept) / mass))
        for t in undecided:
            t.chance *= share


def _level_seconds(here: list[_Live], level: int, gang_size: int, processes: int, pace: _Pace) -> float | None:
    """The time to train one level's units: gangs of up to `gang_size` (split evenly), over `processes`."""
    mass = sum(t.chance for t in here)
    if mass <= 1e-9:
        return 0.0
    trials = max(1, math.ceil(mass - 1e-6))
    gangs = math.ceil(trials / gang_size)
    size = mass / gangs
    per_gang = pace.gang_seconds(size)
    if per_gang is None:
        return None
    rounds = math.ceil(gangs / max(1, processes))
    flying: dict[tuple[int, ...], list[float]] = {}
    for t in here:
        if t.progress == level and t.done > 0:
            flying.setdefault(t.gang or (t.number,), []).append(t.done)
    done = sum(statistics.fmean(parts) for parts in flying.values()) / max(1, processes)
    return max(0.0, rounds - done) * per_gang


@dataclass(frozen=True)
class _Pace:
    """The measured times: a round's training and evaluation by gang size (recent rounds weigh more: a trial's
    completions, and so its steps, change as it learns), and the gap between rounds per trial in the round (its
    checkpoint, commit and rung, the next round's loading)."""

    rounds: list[tuple[int, float]]
    """Each round measured, oldest first: its gang's size and its time (training and evaluation)."""
    scaling: float
    """How a round's time grows with its gang's size: T(g) = T(1) * g ** scaling."""
    gap: float
    """Seconds between one round's end and the next one's start, per trial of the round."""
    train_share: float
    ends: list[float]
    """When each committed unit ended (seconds since the epoch)."""

    @classmethod
    def of(cls, records: Sequence[TrialRecord]) -> _Pace:
        rounds: dict[float, list[float]] = {}  # a round's start -> its units' durations (a gang's start together)
        sizes: dict[float, int] = {}  # a round's start -> its gang's size (some members may not have committed yet)
        trained = evaluated = 0.0
        ends = []
        for r in records:
            for m in r.unit_metrics():
                took = unit_seconds(m)
                if took is None or "started_at" not in m.train:
                    continue
                trained += m.train.get("seconds", 0.0)
                evaluated += m.train.get("eval_seconds", 0.0)
                start = m.train["started_at"]
                ends.append(start + took)
                near = next((s for s in rounds if abs(s - start) < ROUND_SECONDS), start)
                rounds.setdefault(near, []).append(took)
                plan = gang_plan(r.trial, m.unit)
                sizes[near] = len(plan.numbers) if plan is not None else 1
        measured = [(sizes.get(start, len(rounds[start])), max(rounds[start])) for start in sorted(rounds)]
        if not measured:  # no unit committed: the units in flight, from their steps so far
            for r in records:
                flight = r.in_flight if r.state == TrialState.RUNNING else None
                if flight is not None and flight.step_seconds is not None:
                    measured.append((max(1, len(flight.gang)), flight.steps * flight.step_seconds / TRAIN_SHARE))
        starts = sorted(rounds)
        gaps = [max(0.0, b - (a + max(rounds[a]))) / sizes[a] for a, b in zip(starts, starts[1:])]
        share = trained / (trained + evaluated) if trained + evaluated > 0 else TRAIN_SHARE
        return cls(measured, _scaling(measured), statistics.median(gaps) if gaps else 0.0, share, ends)

    def gang_seconds(self, size: float) -> float | None:
        """A round's time for a gang of `size` trials (fractional: an expected size), its gap after it included: the
        rounds measured, each scaled to this size (`scaling`), the latest weighing most."""
        if not self.rounds:
            return None
        took = _recent_mean([t * (size / g) ** self.scaling for g, t in self.rounds])
        return took + size * self.gap


ROUND_SECONDS = 2.0
"""Units that started within this many seconds of each other trained in one round (a gang's members start together)."""


def _scaling(rounds: list[tuple[int, float]]) -> float:
    """The exponent of T(g) = T(1) * g ** a that fits the rounds measured (least squares on logs), within [0.3, 1.2];
    `GANG_SCALING` while a single gang size was measured."""
    points = [(math.log(g), math.log(t)) for g, t in rounds if t > 0]
    if len({x for x, _ in points}) < 2:
        return GANG_SCALING
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return min(1.2, max(0.3, slope))


STALL = 2.0
"""A round that took over this many times the median round (of three or more) stalled (a hung reward call, a busy
machine): it is left out of the pace, so that one stall does not push the study's end out; once most rounds are that
slow, the median is, and they count."""


def _recent_mean(values: list[float]) -> float:
    """A mean that weighs the latest values most (each value weighs twice the one before it), stalls left out
    (`STALL`)."""
    if len(values) >= 3:
        middle = statistics.median(values)
        values = [v for v in values if v <= STALL * middle]
    weights = [2.0 ** i for i in range(len(values))]
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)
