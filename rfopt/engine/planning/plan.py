"""The unit's plan: which trials train together, on which rollout backend, and why a trial trains alone, decided in
one place (`Planner.plan`) and carried out by `rfopt.engine.running.unit.run_units` as one value (`UnitPlan`).

What goes into it, in order:

1. **the gang size** (`planned_gang_size`): the run's ``gang_size``, else rfopt's default (`DEFAULT_GANG_SIZE`; 1 for a trial
   over several devices), and 1 when a tracker in ``report_to`` goes through TRL's integration, which keeps one
   active run per process (said once);
2. **who may share a batch** (`Planner.alone_because`): asked once per trial of the backend a gang would use
   (`rfopt.training.rollouts.RolloutBackend.refusal`, the batched backend of the trial's base model: its config gate
   and its own check of the model); a trial it refuses trains alone on the exact backend, and the reason is logged
   once per trial;
3. **who trains next** (`rfopt.engine.planning.scheduler.next_gang`): least progress first; the trials at that progress that
   share its gang key (`rfopt.training.gang.gang_key`), split evenly, or the gang stored before a crash;
4. **what fits** (the `fit` the driver gives: `rfopt.engine.running.roster.Roster.fit_gang`, the device's memory plan), in
   the gang's training mode: a batched step holds every member's activations at once; a batched gang that fits only
   taking its members' steps one after another trains so (said once), rather than smaller.

The plan's `gang_id` names the record every member carries (`rfopt.storage.schema.GangPlan`, written by the unit from
the plan before it trains) so that a rerun forms the same gang again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rfopt.training.gang import DEFAULT_GANG_SIZE, DEFAULT_GANG_TRAINING, gang_key
from rfopt.training.rollouts import BATCHED, EXACT

from .scheduler import LiveTrial, next_gang

logger = logging.getLogger("rfopt")

SEQUENTIAL = "sequential"
"""A gang's members take their optimizer steps one after another, each through its own trainer."""


@dataclass(frozen=True)
class UnitPlan:
    """One unit of work as decided: its members (trial numbers, in the order they run), the rollout backend they
    generate and are evaluated through (a kind: `EXACT` or `BATCHED`; the model pool builds it), why a trial trains alone (None for a
    gang, or when the run trains one trial at a time), the id of the gang record, and how the gang trains.

    >>> UnitPlan(members=(3, 5), backend=BATCHED, gang_id="4f1c0e")      # doctest: +SKIP
    """

    members: tuple[int, ...]
    backend: str = EXACT
    alone_because: str | None = None
    gang_id: str | None = None
    """Set when the members train as a gang (several, or one on a backend that shares batches): the stored
    `rfopt.storage.schema.GangPlan`'s id."""
    training: str = SEQUENTIAL
    """How the gang's members train (`rfopt.training.gang.GANG_TRAINING`): one after another, each its own forwards
    and backward (`SEQUENTIAL`), or ``"batched"``: one forward and backward for all, each its own optimizer step."""

    def __post_init__(self) -> None:
        if self.backend not in (EXACT, BATCHED):
            raise ValueError(f"UnitPlan.backend={self.backend!r}: give {EXACT!r} or {BATCHED!r}")

    @property
    def in_gang(self) -> bool:
        return self.gang_id is not None

    def keeping(self, numbers: Iterable[int]) -> UnitPlan:
        """The plan for those of its members in `numbers` (the ones this process holds, or could load)."""
        keep = set(numbers)
        return replace(self, members=tuple(n for n in self.members if n in keep))


def alone(number: int) -> UnitPlan:
    """The plan of one trial alone on the exact backend (its last unit's end, a run that trains one at a time)."""
    return UnitPlan(members=(number,))


def planned_gang_size(given: int | None, *, data_parallel: bool = False, single_run_trackers: Sequence[str] = ()) -> int:
    """The gang size a run trains with: `given`, else rfopt's default (1 for a trial over several devices); 1 (with a
    warning) when `single_run_trackers` (trackers TRL's integration logs, one active run per process) would mix the
    members' runs."""
    size = given if given is not None else 1 if data_parallel else DEFAULT_GANG_SIZE
    if size > 1 and single_run_trackers:
        # rfopt logs each trial's run itself for tensorboard, wandb, mlflow and trackio; TRL's integrations of the
        # others keep one active run per process, so gang members would write into each other's runs.
        names = list(single_run_trackers)
        logger.warning("report_to %s: one trial at a time (gang_size 1 instead of %d): TRL's integration of %s "
                       "keeps one active run per process, so gang members would write into each other's runs",
                       ", ".join(names), size, " and ".join(names))
        return 1
    return size


class Plannable(Protocol):
    """What the planner reads of a live trial (`rfopt.engine.running.unit.Live`)."""

    number: int
    config: Any

    def candidate(self) -> LiveTrial: ...


class Planner:
    """Makes each unit's plan for one run (see the module docstring).

    `gate(trial)`: why the backend a gang would use refuses the trial (`RolloutBackend.refusal` of its base model's
    batched backend), or None; asked once per trial, and only when gangs are formed. `training`: how its gangs take
    their training steps (`UnitPlan.training`).
    """

    def __init__(self, size: int, gate: Callable[[Any], str | None], training: str = DEFAULT_GANG_TRAINING) -> None:
        self.size = size
        self.training = training
        self._gate = gate
        self._alone: dict[int, str | None] = {}

    def alone_because(self, trial: Plannable) -> str | None:
        """Why `trial` trains alone on the exact backend although gangs are formed, or None (asked of its backend
        once; the reason is logged once per trial)."""
        if self.size <= 1:
            return None
        if trial.number not in self._alone:
            try:
                why = self._gate(trial)
            except Exception as exc:  # noqa: BLE001 - its model cannot be loaded, say: its unit fails alone, with it
                return f"{type(exc).__name__}: {exc}"
            self._alone[trial.number] = why
            if why is not None:
                logger.warning("trial %d trains alone, on the exact backend (its rollouts cannot share a batch): %s",
                               trial.number, why)
        return self._alone[trial.number]

    def plan(self, free: Sequence[Plannable], resident: set[str] = frozenset(),
             stored: Mapping[int, Sequence[int]] | None = None,
             fit: Callable[[list[int], str], tuple[list[int], str]] | None = None) -> UnitPlan | None:
        """The next unit's plan among the `free` live trials, or None when none can run. `resident`: the base models
        on the device (preferred among equals); `stored`: gangs stored before a crash, by first member; `fit`: given a
        gang's members and its training mode, the first of them that fit in the device's memory and the mode they fit
        in (a batched gang that fits only taking its steps one after another trains ``"sequential"``)."""
        why = {trial.number: self.alone_because(trial) for trial in free}
        candidates = [replace(trial.candidate(), gang_key=gang_key(trial.config) if self.size > 1 and
                              why[trial.number] is None else None) for trial in free]
        picks = next_gang(candidates, self.size, resident, stored)
        if not picks:
            return None
        numbers = [p.number for p in picks]
        if self.size <= 1:
            return alone(numbers[0])
        if picks[0].gang_key is None:
            return UnitPlan(members=(numbers[0],), alone_because=why[numbers[0]])
        training = self.training
        if fit is not None:
            numbers, training = fit(numbers, training)
        return UnitPlan(members=tuple(numbers), backend=BATCHED, gang_id=uuid.uuid4().hex[:12], training=training)


__all__ = ["BATCHED", "EXACT", "SEQUENTIAL", "Planner", "UnitPlan", "alone", "planned_gang_size"]
