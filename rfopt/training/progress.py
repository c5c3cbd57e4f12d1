"""A trial's progress inside the chunk it trains, published while it trains: which unit, step s of S, since when, how
fast, and TRL's logs of the steps so far.

A chunk can take many minutes (tens, on a real model), and a person watching the dashboard, ``rfopt status`` or the
progress bar must be able to tell "slow" from "stuck". So the process training a unit publishes it:

- to storage, as the trial's ``rfopt:progress`` record (`rfopt.storage.schema.ProgressRecord`), which any process reads:
  written when a base model is evaluated for the study's baseline before the trial's first unit (phase ``baseline``),
  when the unit starts (phase ``loading``: the trial is being swapped in), when its first optimizer step
  starts (``training``, 0 steps done: a step generates first, which can take long) and ends, then at most every `interval`
  seconds (a few seconds; never once per token or per step), and once more when training ends (phase
  ``evaluating``, with every step's logs), and when its evaluation ends (``saving``: its checkpoint and report are
  written next). One key per trial, replaced at each write: a row, not a growing history. What a throttled call
  changed is written when the interval is over, from a timer thread, even if nothing else happens before (a reward
  call that hangs in a member's turn is shown in that turn, not in the one before).
  A write that fails is skipped (and logged at debug level): progress is for people, the unit goes on;
- to in-process listeners (the progress bar), at every optimizer step and phase: a call, no write.

Within a phase, `ProgressPublisher.doing` says what the unit does now, finer than the phase
(`rfopt.storage.schema.Activity`): a gang's rollouts decoded so far (tokens of the most new tokens, tokens per second),
whose turn it is in a gang's step (member k of n), the gang's one batched step, eval prompts done (k of n, the base
model's too). The gang (`rfopt.training.gang.Gang`'s `on_activity`) and the decoders (`rfopt.training.rollouts
.Decoded`, through `evaluation_progress`) tell it; it is written with the record (throttled as above) and told to
listeners when it changes kind or member, or at most every `LISTEN_SECONDS` (a token is not an event for a display).

The runner calls `ProgressPublisher.step` from its TrainerCallback at each optimizer step
(`TrialRunner.train_chunk(on_step=...)`), so several trials trained at once in one process (a gang) each publish
their own record, throttled each on its own. What is published changes nothing in training: no RNG, no trainer
state, no Optuna record but the progress one.

    >>> publisher = ProgressPublisher(ref, unit=2, num_units=4, steps=8, listeners=[bar])   # doctest: +SKIP
    >>> publisher.loading(); runner.train_chunk(on_step=publisher.step); publisher.evaluating()   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rfopt.storage.leases import worker_id
from rfopt.storage.schema import Activity, ProgressRecord, StepColumns, TrialRef, write_progress

from .rollouts import Decoded
from .runner import StepDone

logger = logging.getLogger("rfopt")

INTERVAL_SECONDS = float(os.environ.get("RFOPT_PROGRESS_SECONDS", "3"))
"""At most one progress write per trial in this many seconds while its chunk trains (``RFOPT_PROGRESS_SECONDS``)."""
LISTEN_SECONDS = 0.5
"""An activity that only advances (tokens decoded, prompts done) is told to in-process listeners at most this often."""


@dataclass(frozen=True)
class UnitProgress:
    """What in-process listeners (the progress bar) hear: a trial's unit at a step, or changing phase."""

    trial: int
    unit: int
    num_units: int
    phase: str
    """``baseline`` (the base model evaluated with no adapter, before the trial's first unit), ``loading``,
    ``training``, ``evaluating`` or ``saving``."""
    step: int
    steps: int
    step_seconds: float | None
    """The median seconds per optimizer step of the unit so far."""
    gang: tuple[int, ...] = ()
    """The trials trained together with it (itself included; empty: alone): one group, one pace, one verdict."""
    activity: Activity | None = None
    """What it does now within the phase (`rfopt.storage.schema.Activity`); None where nothing finer is known."""


class ProgressPublisher:
    """Publishes one unit's progress for trial `ref` (see the module's docstring)."""

    def __init__(self, ref: TrialRef, *, unit: int, num_units: int, steps: int,
                 listeners: Sequence[Callable[[UnitProgress], None]] = (), interval: float = INTERVAL_SECONDS,
                 gang: tuple[int, ...] = (), clock: Callable[[], float] = time.time) -> None:
        self.ref = ref
        self.unit = unit
        self.num_units = num_units
        self.steps = steps
        self.listeners = list(listeners)
        self.interval = interval
        self.gang = tuple(gang)
        """The trials trained together with this one in this process (the gang's), shown with its progress."""
        self.clock = clock
        self.started = clock()
        self.logs: list[dict[str, float]] = []
        self.done = StepDone(step=0, steps=steps, global_step=0, seconds=0.0, logs={})
        self.phase = "loading"
        self.activity: Activity | None = None
        """What the unit does now within its phase (`doing`)."""
        self.writes = 0
        self._written_at: float | None = None
        self._moved = self.started
        self._step_times: list[float] = []
        """Each optimizer step's seconds so far (from `StepDone.seconds`, cumulative)."""
        self._told: tuple[Activity | None, float] = (None, -float("inf"))
        """The activity listeners last heard, and when."""
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        """A pending write of what a throttled call changed."""

    @property
    def step_seconds(self) -> float | None:
        """The median seconds per optimizer step of the unit so far (None before its first step ends): a median, so
        that one stall (a hung reward call, a busy machine) neither inflates the pace nor hides a second one."""
        return statistics.median(self._step_times) if self._step_times else None

    def baseline(self) -> None:
        """The base model is evaluated with no adapter (the study's baseline) before this trial trains: said as what
        the study is doing, not as a silent unit."""
        self._publish("baseline", force=True)

    def loading(self) -> None:
        """The unit starts: the trial is being swapped in (its checkpoint, adapter, trainer)."""
        self._publish("loading", force=True)

    def step(self, done: StepDone) -> None:
        """The chunk's first step started (``done.step == 0``: the trial is swapped in) or an optimizer step ended (the
        runner's hook): tell listeners; write if the last write is old enough (always for the first two)."""
        with self._lock:
            if done.step > self.done.step:
                self._step_times.append(max(0.0, done.seconds - self.done.seconds) / (done.step - self.done.step))
            self.done = done
            if done.logs:
                self.logs.append(dict(done.logs))
        self._publish("training", force=self._written_at is None or done.step <= 1, activity=self.activity)

    def doing(self, activity: Activity | None) -> None:
        """What the unit does now within its phase (see the module's docstring): written with the record, throttled;
        told to listeners when it changes kind or member, or at most every `LISTEN_SECONDS`. Not a sign of life by
        itself (`ProgressRecord.stepped` stays the last step or phase): an activity has its own start
        (`Activity.since`)."""
        self._publish(self.phase, force=False, activity=activity, moved=False)

    def saving(self) -> None:
        """The unit is evaluated; its checkpoint is saved and its report committed next."""
        self._publish("saving", force=True)

    def evaluating(self) -> None:
        """Training ended (every step's logs are written with it); the unit's evaluation runs next."""
        self._publish("evaluating", force=True)

    def _publish(self, phase: str, force: bool, activity: Activity | None = None, moved: bool = True) -> None:
        """Tell listeners and write the record (throttled unless `force`): the unit is in `phase`, doing `activity`;
        `moved`: a phase began or a step ended."""
        now = self.clock()
        with self._lock:  # a timer's write reads these from its thread
            if moved:
                self._moved = now
            self.phase, self.activity = phase, activity
        told, at = self._told
        same = (activity is not None and told is not None
                and (activity.what, activity.trial, activity.since) == (told.what, told.trial, told.since))
        if moved or not same or now - at >= LISTEN_SECONDS:
            self._told = (activity, now)
            event = UnitProgress(self.ref.number, self.unit, self.num_units, phase, self.done.step, self.steps,
                                 self.step_seconds, self.gang, activity)
            for listener in self.listeners:
                try:
                    listener(event)
                except Exception as exc:  # noqa: BLE001 - a display's failure is not the trial's
                    logger.debug("trial %d: a progress listener failed: %s", self.ref.number, exc)
        with self._lock:
            left = None if self._written_at is None else self.interval - (now - self._written_at)
            if not force and left is not None and left > 0:
                if self._timer is None:  # what this call changed is written when the interval is over
                    self._timer = threading.Timer(left, self._flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._write(now)

    def _flush(self) -> None:
        """The timer's write of what throttled calls changed (unless a later write made it moot)."""
        with self._lock:
            if self._timer is not None and self._timer is threading.current_thread():
                self._timer = None
                self._write(self.clock())

    def _write(self, now: float) -> None:
        """Write the record as it stands now (the lock held); a pending timed write is then moot."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        record = ProgressRecord(unit=self.unit, num_units=self.num_units, phase=self.phase, step=self.done.step,
                                steps=self.steps, global_step=self.done.global_step, started=self.started,
                                updated=now, step_seconds=self.step_seconds,
                                logs=StepColumns.encode(self.logs) if self.logs else {}, holder=worker_id(),
                                gang=self.gang, stepped=self._moved, activity=self.activity)
        try:
            write_progress(self.ref, record)
        except Exception as exc:  # noqa: BLE001 - progress is for people: the unit goes on without it
            logger.debug("trial %d: progress not published: %s", self.ref.number, exc)
            return
        self._written_at = now
        self.writes += 1


def gang_progress(publishers: Sequence[ProgressPublisher]) -> Callable[[Activity], None]:
    """A gang's `rfopt.training.gang.Gang` ``on_activity``: what the gang does now (its rollouts decoded, whose turn it
    is, its batched step) is each member's (`ProgressPublisher.doing`)."""
    def heard(activity: Activity) -> None:
        for publisher in publishers:
            publisher.doing(activity)
    return heard


def evaluation_progress(publishers: Sequence[ProgressPublisher], clock: Callable[[], float] = time.time
                        ) -> Callable[[Decoded], None]:
    """An evaluation's `rfopt.training.rollouts.RolloutBackend.generate` ``progress``: request i is the trial of
    ``publishers[i]`` (a gang's members in order; the base model's evaluation: the trial it is evaluated for), which
    hears its prompts done of its prompts, and the tokens of the batch decoding now (an `Activity` ``prompts``)."""
    since = clock()
    said: list[Any] = [None, -float("inf")]  # the prompts done last told, and when (`time.monotonic`)

    def heard(decoded: Decoded) -> None:
        now = time.monotonic()
        if decoded.rows_done == said[0] and now - said[1] < LISTEN_SECONDS / 2:
            return  # only a token more: not worth telling every member
        said[:] = [decoded.rows_done, now]
        for publisher, done, rows in zip(publishers, decoded.rows_done, decoded.rows):
            publisher.doing(Activity("prompts", done=done, total=rows, tokens=decoded.tokens,
                                     max_tokens=decoded.max_tokens, rate=decoded.rate, since=since))
    return heard
