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
  written next). One key per trial, replaced at each write: a row, not a growing history.
  A write that fails is skipped (and logged at debug level): progress is for people, the unit goes on;
- to in-process listeners (the progress bar), at every optimizer step: a call, no write.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rfopt.storage.leases import worker_id
from rfopt.storage.schema import ProgressRecord, StepColumns, TrialRef, write_progress

from .runner import StepDone

logger = logging.getLogger("rfopt")

INTERVAL_SECONDS = float(os.environ.get("RFOPT_PROGRESS_SECONDS", "3"))
"""At most one progress write per trial in this many seconds while its chunk trains (``RFOPT_PROGRESS_SECONDS``)."""


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
        self.writes = 0
        self._written_at: float | None = None
        self._moved = self.started
        self._step_times: list[float] = []
        """Each optimizer step's seconds so far (from `StepDone.seconds`, cumulative)."""

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
        if done.step > self.done.step:
            self._step_times.append(max(0.0, done.seconds - self.done.seconds) / (done.step - self.done.step))
        self.done = done
        if done.logs:
            self.logs.append(dict(done.logs))
        self._publish("training", force=self._written_at is None or done.step <= 1)

    def saving(self) -> None:
        """The unit is evaluated; its checkpoint is saved and its report committed next."""
        self._publish("saving", force=True)

    def evaluating(self) -> None:
        """Training ended (every step's logs are written with it); the unit's evaluation runs next."""
        self._publish("evaluating", force=True)

    def _publish(self, phase: str, force: bool) -> None:
        self._moved = self.clock()
        event = UnitProgress(self.ref.number, self.unit, self.num_units, phase, self.done.step, self.steps,
                             self.step_seconds, self.gang)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - a display's failure is not the trial's
                logger.debug("trial %d: a progress listener failed: %s", self.ref.number, exc)
        now = self.clock()
        if not force and self._written_at is not None and now - self._written_at < self.interval:
            return
        record = ProgressRecord(unit=self.unit, num_units=self.num_units, phase=phase, step=self.done.step,
                                steps=self.steps, global_step=self.done.global_step, started=self.started,
                                updated=now, step_seconds=self.step_seconds,
                                logs=StepColumns.encode(self.logs) if self.logs else {}, holder=worker_id(),
                                gang=self.gang, stepped=self._moved)
        try:
            write_progress(self.ref, record)
        except Exception as exc:  # noqa: BLE001 - progress is for people: the unit goes on without it
            logger.debug("trial %d: progress not published: %s", self.ref.number, exc)
            return
        self._written_at = now
        self.writes += 1

