"""What a rung policy will do to the trials still to train, known before it does it: the pruner's schedule as a
record (`Outlook`) that a study stores when a run starts, so that anyone reading the storage can tell how much is
left to train (`rfopt.reports.forecast`), not only what is left if nothing more is pruned.

- successive halving: rungs after chunks ``min_resource * eta**(rate + i)``; at each, the top ``ceil(n / eta)`` of
  the ``n`` trials that reached it go on (`Ladder`, known exactly);
- Hyperband: the same, per bracket (a trial's bracket from its number, as Optuna places it);
- Median and Percentile: from ``n_warmup_steps`` on, every ``interval_steps``, a trial below the median (the
  percentile cut) stops once ``n_startup_trials`` peers reached the step: about half (``1 - percentile/100``) of
  the trials go on at each check; an expectation, not a schedule;
- population-based training replaces members with clones of others: as many trials train on; NopPruner prunes
  nothing; any other pruner (Threshold, Patient, Wilcoxon, your own) cannot be foreseen.

    >>> outlook = describe(optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), 4, "demo")
    >>> outlook.ladder(3)                                                             # doctest: +SKIP
    Ladder(rungs=(0, 1), keep='top', factor=2.0, bootstrap_count=0, startup=0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.pruners import (
    BasePruner,
    HyperbandPruner,
    MedianPruner,
    NopPruner,
    PercentilePruner,
    SuccessiveHalvingPruner,
)

from rfopt.compat import pruner_settings

from ._halving import Brackets, successive_halving
from ._pbt import PopulationBasedTraining


@dataclass(frozen=True)
class Ladder:
    """The rungs one trial faces: the steps at which some of the trials that reached them stop."""

    rungs: tuple[int, ...]
    keep: str
    """``top``: the top ``ceil(n / factor)`` of the ``n`` trials that reached the rung go on (halving); ``share``: about
    ``1 / factor`` of them go on (an expectation: median and percentile pruners)."""
    factor: float
    bootstrap_count: int = 0
    startup: int = 0
    """Peers a rung needs before it prunes anyone (``n_startup_trials``)."""

    def kept(self, n: float) -> float:
        """How many of `n` trials that reach a rung go on."""
        if n <= 0:
            return 0.0
        if self.keep == "top":
            return 0.0 if n <= self.bootstrap_count else float(math.ceil(n / self.factor - 1e-9))
        return n if n - 1 < self.startup else n / self.factor


@dataclass(frozen=True)
class Outlook:
    """A rung policy's schedule, as a study stores it (`to_attr`) and reads it back (`from_attr`)."""

    pruner: str
    """The pruner's class name."""
    kind: str
    """``halving``, ``hyperband``, ``share`` (median, percentile), ``none`` (prunes nothing: NopPruner, and
    population-based training, whose clones train on in their members' stead) or ``unknown``."""
    n_steps: int
    rungs: tuple[int, ...] = ()
    factor: float = 1.0
    bootstrap_count: int = 0
    startup: int = 0
    brackets: tuple[int, ...] = ()
    """Hyperband's bracket budgets (a trial's bracket: `Brackets.index_of`)."""
    min_resource: int = 1
    study_name: str = ""

    @property
    def certain(self) -> bool:
        """Whether the number of trials that go on at each rung is known (halving, Hyperband, none)."""
        return self.kind in ("halving", "hyperband", "none")

    def ladder(self, trial_number: int) -> Ladder | None:
        """The rungs `trial_number` faces; None when the policy prunes nothing or cannot be foreseen."""
        if self.kind == "halving" or self.kind == "share":
            return Ladder(self.rungs, "top" if self.kind == "halving" else "share", self.factor,
                          self.bootstrap_count, self.startup)
        if self.kind == "hyperband":
            bracket = self._brackets().index_of(trial_number)
            rungs = self._brackets().halving(bracket).rung_steps(self.n_steps)
            return Ladder(tuple(rungs), "top", self.factor, self.bootstrap_count)
        return None

    def group(self, trial_number: int) -> int:
        """The trials a trial is ranked with at a rung: its Hyperband bracket (0 for every other policy)."""
        return self._brackets().index_of(trial_number) if self.kind == "hyperband" else 0

    def describe(self) -> str:
        """``SuccessiveHalvingPruner: rungs after chunks 1, 2, each keeps the top 1/2``."""
        chunks = ", ".join(str(r + 1) for r in self.rungs)
        if self.kind == "halving":
            return f"{self.pruner}: rungs after chunks {chunks or '(none)'}, each keeps the top 1/{self.factor:g}"
        if self.kind == "hyperband":
            return f"{self.pruner}: {len(self.brackets)} brackets, each keeps the top 1/{self.factor:g} at its rungs"
        if self.kind == "share":
            return (f"{self.pruner}: checks after chunks {chunks or '(none)'}, about 1/{self.factor:g} going on at "
                    "each (an expectation)")
        if self.kind == "none" and self.pruner == PopulationBasedTraining.__name__:
            return f"{self.pruner}: a replaced member's clone trains on in its place (as many units)"
        if self.kind == "none":
            return f"{self.pruner}: prunes nothing"
        return f"{self.pruner}: its pruning cannot be foreseen"

    def _brackets(self) -> Brackets:
        return Brackets(self.study_name, self.brackets, self.min_resource, int(self.factor), self.bootstrap_count)

    def to_attr(self) -> dict[str, Any]:
        return {"pruner": self.pruner, "kind": self.kind, "n_steps": self.n_steps, "rungs": list(self.rungs),
                "factor": self.factor, "bootstrap_count": self.bootstrap_count, "startup": self.startup,
                "brackets": list(self.brackets), "min_resource": self.min_resource, "study_name": self.study_name}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Outlook:
        return cls(pruner=str(value.get("pruner", "")), kind=str(value.get("kind", "unknown")),
                   n_steps=int(value.get("n_steps", 1)), rungs=tuple(int(r) for r in value.get("rungs") or ()),
                   factor=float(value.get("factor", 1.0)), bootstrap_count=int(value.get("bootstrap_count", 0)),
                   startup=int(value.get("startup", 0)), brackets=tuple(int(b) for b in value.get("brackets") or ()),
                   min_resource=int(value.get("min_resource", 1)), study_name=str(value.get("study_name", "")))


def describe(pruner: Any, n_steps: int, study_name: str) -> Outlook:
    """The schedule of `pruner` (an Optuna pruner or `PopulationBasedTraining`) over a plan of `n_steps` chunks."""
    name = type(pruner).__name__
    if isinstance(pruner, (PopulationBasedTraining, NopPruner)) or pruner is None:
        return Outlook(name, "none", n_steps)
    if isinstance(pruner, HyperbandPruner):
        brackets = Brackets.of(pruner, study_name, n_steps)
        return Outlook(name, "hyperband", n_steps, factor=float(brackets.reduction_factor),
                       bootstrap_count=brackets.bootstrap_count, brackets=brackets.budgets,
                       min_resource=brackets.min_resource, study_name=study_name)
    if isinstance(pruner, SuccessiveHalvingPruner):
        halving = successive_halving(pruner, n_steps)
        return Outlook(name, "halving", n_steps, rungs=tuple(halving.rung_steps(n_steps)),
                       factor=float(halving.reduction_factor), bootstrap_count=halving.bootstrap_count)
    if type(pruner) in (MedianPruner, PercentilePruner):
        settings = pruner_settings(pruner)
        share = settings["percentile"] / 100.0  # the top `percentile`% go on
        warmup, interval = settings["n_warmup_steps"], max(1, settings["interval_steps"])
        rungs = tuple(s for s in range(warmup, n_steps - 1) if (s - warmup) % interval == 0)  # the last chunk ends it
        return Outlook(name, "share", n_steps, rungs=rungs, factor=1.0 / share if share > 0 else 1.0,
                       startup=settings["n_startup_trials"])
    if isinstance(pruner, BasePruner):
        return Outlook(name, "unknown", n_steps)
    return Outlook(name, "unknown", n_steps)
