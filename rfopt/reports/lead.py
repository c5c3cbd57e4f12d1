"""Which trial leads a study and by how much: the best (or leading) trial, whether its lead over the runner-up is more
than noise, and Optuna's param importances over the trials' values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt import noise
from rfopt.storage.schema import TrialRecord


def best_trial(trials: Sequence[FrozenTrial], direction: StudyDirection | None) -> tuple[int | None, str]:
    """The trial to mark as best and how to call it: Optuna's best trial (the best value among COMPLETE trials) when
    there is one, else ``leading``: the best last reported value among trials still running. None for a
    multi-objective study (`direction` None) or when no trial has a value."""
    if direction is None:
        return None, ""
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    complete = [(t.values[0], t.number) for t in trials if t.state == TrialState.COMPLETE and t.values]
    if complete:
        return max(complete, key=lambda vn: (sign * vn[0], -vn[1]))[1], "best"
    running = [(v, t.number) for t in trials if t.state == TrialState.RUNNING and not (r := TrialRecord(t)).paused
               and (v := r.last_value) is not None]  # only a live, trained trial leads
    if running:
        return max(running, key=lambda vn: (sign * vn[0], -vn[1]))[1], "leading"
    return None, ""


@dataclass(frozen=True)
class Lead:
    """The best (or leading) trial against the runner-up (the next best value), prompt by prompt on their values'
    evaluations (`rfopt.noise.gap`): whether the lead is more than noise."""

    best: int
    runner_up: int
    gap: noise.Gap

    @property
    def tie(self) -> bool:
        """The lead is within noise: the two values could swap on other eval prompts."""
        return self.gap.within_noise

    def text(self) -> str:
        """``tie: within noise of trial 2 (gap 0 ± 0 over 8 eval prompts)`` or ``ahead of trial 2 by more than noise
        (...)``."""
        if self.tie:
            return f"tie: within noise of trial {self.runner_up} ({self.gap.text()})"
        return f"ahead of trial {self.runner_up} by more than noise ({self.gap.text()})"


def lead(trials: Sequence[FrozenTrial], direction: StudyDirection | None, objective: str = "reward") -> Lead | None:
    """The best trial (`best_trial`) against the runner-up; None without two valued trials or stored scores."""
    best, _ = best_trial(trials, direction)
    if best is None or direction is None:
        return None
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    by_number = {t.number: TrialRecord(t) for t in trials}
    others = [(r.value, n) for n, r in by_number.items() if n != best and r.value is not None
              and math.isfinite(r.value) and r.cancelled is None]
    if not others:
        return None
    runner_up = max(others, key=lambda vn: (sign * vn[0], -vn[1]))[1]
    found = noise.gap(_value_scores(by_number[best], objective), _value_scores(by_number[runner_up], objective))
    return None if found is None else Lead(best, runner_up, found)


def _value_scores(record: TrialRecord, objective: str) -> list[float]:
    """The per-prompt scores behind the trial's value (its last reported unit)."""
    values = record.trial.intermediate_values
    if not values:
        return []
    unit = max(values)
    return next((m.scores_of(objective) for m in record.unit_metrics() if m.unit == unit), [])


@dataclass(frozen=True)
class Importance:
    """Optuna's param importances (`optuna.importance.get_param_importances`, fANOVA) over the trials' values after
    one chunk: the deepest chunk at least three trials reached (values after different chunks do not compare)."""

    importances: dict[str, float]
    trials: int
    step: int
    noise: noise.Gap | None = None
    """The gap between the best and the worst of those trials' values, prompt by prompt (`rfopt.noise.gap`): when it
    is within noise, every value could be noise, and so could the importances; None without per-prompt scores."""

    @property
    def within_noise(self) -> bool:
        return self.noise is not None and self.noise.within_noise

    def caution(self) -> str | None:
        """``its 4 trials' values are all within noise of each other (...): the importances may reflect noise, not
        the params``, or None."""
        if not self.within_noise:
            return None
        assert self.noise is not None
        return (f"its {self.trials} trials' values are all within noise of each other (best against worst: "
                f"{self.noise.text()}): the importances may reflect noise, not the params")


def param_importance(trials: Sequence[FrozenTrial], direction: StudyDirection | None,
                     objective: str = "reward") -> Importance | None:
    """The study's param importances (`Importance`), with whether its trials' values are all within noise of each
    other (their per-prompt scores of `objective`); None with fewer than three trials with values, no param that
    varies, or a search space Optuna cannot evaluate."""
    import optuna

    valued = [t for t in trials if t.intermediate_values and t.params]
    if direction is None or len(valued) < 3:
        return None
    steps = sorted({s for t in valued for s in t.intermediate_values}, reverse=True)
    step = next((s for s in steps if sum(s in t.intermediate_values for t in valued) >= 3), None)
    if step is None:
        return None
    at = [t for t in valued if step in t.intermediate_values and math.isfinite(t.intermediate_values[step])]
    if not any(len({repr(t.params.get(k)) for t in at}) > 1 for k in at[0].params):
        return None
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        view = optuna.create_study(direction=direction)
        for t in at:
            view.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                     value=t.intermediate_values[step]))
        found = optuna.importance.get_param_importances(view)
    except (ValueError, RuntimeError):  # a dynamic search space, a param of one value
        return None
    finally:
        optuna.logging.set_verbosity(verbosity)
    if not found:
        return None
    ranked = sorted(at, key=lambda t: t.intermediate_values[step])
    spread = noise.gap(_unit_scores(TrialRecord(ranked[-1]), step, objective),
                       _unit_scores(TrialRecord(ranked[0]), step, objective))
    return Importance(dict(found), len(at), step, spread)


def _unit_scores(record: TrialRecord, unit: int, objective: str) -> list[float]:
    return next((m.scores_of(objective) for m in record.unit_metrics() if m.unit == unit), [])
