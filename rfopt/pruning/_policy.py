"""The rung-policy slot: how a run judges a rung once every live trial reported its step. Two implementations:

- `PrunerRungs`: any Optuna pruner at rung boundaries, with every peer's value at the step visible (`decide`): each
  judged trial is kept or pruned.
- `rfopt.engine.trials.population.PopulationRungs`: population-based training (`PopulationBasedTraining`): at exploit steps
  the bottom of the population is replaced by warm clones of the top (it makes trials, so it lives in the engine).

A study is given either as its ``pruner`` (``rfopt.create_study(pruner=...)``). A policy stores what it decided, then
returns it as data (`RungOutcome`); the run carries it out (tells the pruned trials, starts the clones), so a
decision made before a crash is carried out, not decided again.

    >>> policy = PrunerRungs(optuna.pruners.SuccessiveHalvingPruner())                 # doctest: +SKIP
    >>> policy.judge(study, step=1, trial_numbers=[0, 1, 2, 3], n_steps=4).pruned     # doctest: +SKIP
    [2, 3]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import optuna

from rfopt.storage.schema import PruneDecision

from ._decide import decide
from ._pbt import PopulationBasedTraining


@dataclass(frozen=True)
class RungOutcome:
    """What a rung policy decided at one step: a stored decision for each judged trial, and the trials it made."""

    decisions: tuple[PruneDecision, ...]
    clones: tuple[int, ...] = ()
    """Trials made at this step (population-based training's replacements), enqueued for a process to start."""

    @property
    def pruned(self) -> list[int]:
        return [d.trial_number for d in self.decisions if d.prune]


class RungPolicy(Protocol):
    """Judges rungs: which trials stop after a step, once every trial compared there has reported it."""

    makes_clones: bool
    """Whether judging makes trials: then one process at a time judges (under the coordinator's asking lock)."""

    def holds(self, step: int, n_steps: int) -> bool:
        """Whether a trial that reported `step` waits for the rung's decision before it trains on (its clones start
        from its checkpoint at the step)."""

    def judge(self, study: optuna.Study, step: int, trial_numbers: list[int], n_steps: int) -> RungOutcome:
        """Decide `step` for `trial_numbers` (each reported it), store the decisions, and return them. Raises
        `rfopt.errors.StaleRead` when a peer ended elsewhere since it was read (decide next round), and
        `rfopt.errors.PrunerFailed` when the user's pruner raised on a trial."""


@dataclass(frozen=True)
class PrunerRungs:
    """An Optuna pruner at rung boundaries (`decide`; the package docstring says what each pruner compares against)."""

    pruner: optuna.pruners.BasePruner
    makes_clones = False

    def holds(self, step: int, n_steps: int) -> bool:
        return False

    def judge(self, study: optuna.Study, step: int, trial_numbers: list[int], n_steps: int) -> RungOutcome:
        return RungOutcome(tuple(decide(study, trial_numbers, step, self.pruner, n_steps=n_steps)))


def optuna_pruner(pruner: Any) -> optuna.pruners.BasePruner | None:
    """What the Optuna study holds as its pruner when rfopt's is `pruner`: population-based training is rfopt's alone
    (Optuna's own ``trial.should_prune()`` then prunes nothing), any other pruner is Optuna's own."""
    return optuna.pruners.NopPruner() if isinstance(pruner, PopulationBasedTraining) else pruner
