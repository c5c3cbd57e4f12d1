"""A read-only view of a study as of one step, for handing to a pruner's ``prune()``.

Optuna's Median/Percentile/Wilcoxon pruners compare against COMPLETE trials. In a round-robin
sweep nothing is COMPLETE until the end, so the view presents every other trial that reached the
step as COMPLETE, with its value at that step as its objective value and its intermediate values
cut at the step. The judged trial is the only RUNNING trial. Trials that did not reach the step
are absent, so the view depends only on values stored at or before the step: the same whatever
order trials reported in, and whenever the question is asked.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt.compat import StudyView, frozen_copy


def cut_at(trial: FrozenTrial, step: int, state: TrialState) -> FrozenTrial:
    """``trial`` as it stood after reporting ``step``, in ``state``."""
    intermediate = {s: v for s, v in trial.intermediate_values.items() if s <= step}
    complete = state == TrialState.COMPLETE
    return frozen_copy(
        trial,
        state=state,
        value=intermediate[step] if complete else None,
        datetime_complete=(trial.datetime_complete or trial.datetime_start) if complete else None,
        intermediate_values=intermediate,
    )


class StepView(StudyView):
    """The study at one step: peers COMPLETE with their value at the step, the judged one RUNNING.

    It reads like an :class:`optuna.Study` (``get_trials``, ``trials``, ``direction``,
    ``best_trial``, ``best_value``, ``user_attrs``) and has no storage: anything that would write,
    or read beyond the step, raises AttributeError.
    """

    def __init__(
        self, study: optuna.Study, trials: list[FrozenTrial], pruner: optuna.pruners.BasePruner
    ) -> None:
        super().__init__(study.study_name, list(study.directions), trials)
        self._source = study
        self.pruner = pruner

    def _best_of(self, deepcopy: bool) -> FrozenTrial:
        if len(self.directions) > 1:
            raise RuntimeError("A multi-objective study has no single best trial.")
        complete = [
            t
            for t in self._view_trials
            if t.state == TrialState.COMPLETE and t.value is not None and not math.isnan(t.value)
        ]
        if not complete:
            raise ValueError("No trials are completed yet.")  # Optuna's own message and type
        sign = -1.0 if self.direction == StudyDirection.MAXIMIZE else 1.0
        best = min(complete, key=lambda t: (sign * t.value, t.number))
        return copy.deepcopy(best) if deepcopy else best

    @property
    def user_attrs(self) -> dict[str, Any]:
        return self._source.user_attrs

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached for attributes the view does not define (storage, sampler, writers).
        raise AttributeError(
            f"rfopt gives pruners a read-only view of the study at one step; it has no {name!r}. "
            "A pruner may read trials, direction, best_trial and user_attrs, and must not write: "
            "rfopt stores each decision itself."
        )


def step_view(
    study: optuna.Study,
    judged: FrozenTrial,
    peers: Mapping[int, FrozenTrial],
    step: int,
    pruner: optuna.pruners.BasePruner,
) -> tuple[StepView, FrozenTrial]:
    """The view to judge ``judged`` at ``step`` and the judged trial as seen in it.

    ``peers`` are the COMPLETE cuts at ``step`` (see :func:`cut_at`) of the trials that reached
    it; the judged trial's own entry, if any, is left out.
    """
    running = cut_at(judged, step, TrialState.RUNNING)
    others = [t for n, t in peers.items() if n != judged.number]
    return StepView(study, [*others, running], pruner), running
