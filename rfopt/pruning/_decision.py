"""The record of one pruning decision, and where it lives on the trial."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

#: A decision for step ``k`` is the user attr ``f"{DECISION_ATTR_PREFIX}{k}"`` on the trial.
DECISION_ATTR_PREFIX = "rfopt:pruning:"


def decision_key(step: int) -> str:
    """The user-attr key that holds a trial's pruning decision at ``step``."""
    return f"{DECISION_ATTR_PREFIX}{step}"


@dataclass(frozen=True)
class PruneDecision:
    """Whether a trial stops after the chunk of ``step``, and why.

    Example::

        PruneDecision(trial_number=5, step=0, prune=True,
                      reason="best value 0.12 up to chunk 0 is below the median 0.8 of 7 peers",
                      peers=(0, 1, 2, 3, 4, 6, 7), pruner="MedianPruner")
    """

    trial_number: int
    step: int
    prune: bool
    #: Human text for logs and the dashboard.
    reason: str
    #: Numbers of the trials this one was compared against (empty when none were).
    peers: tuple[int, ...]
    #: Class name of the pruner that decided.
    pruner: str

    def to_attr(self) -> dict[str, Any]:
        """The JSON value stored under :func:`decision_key` (trial and step are in the key)."""
        return {
            "prune": self.prune,
            "reason": self.reason,
            "peers": list(self.peers),
            "pruner": self.pruner,
        }

    @classmethod
    def from_attr(cls, trial_number: int, step: int, value: dict[str, Any]) -> PruneDecision:
        return cls(
            trial_number=trial_number,
            step=step,
            prune=bool(value["prune"]),
            reason=str(value["reason"]),
            peers=tuple(int(n) for n in value["peers"]),
            pruner=str(value["pruner"]),
        )


def load_decision(trial: FrozenTrial, step: int) -> PruneDecision | None:
    """The decision stored on ``trial`` for ``step``, or None if it was never decided.

    Example::

        decision = load_decision(study.trials[3], step=1)
        if decision is not None and decision.prune:
            print(decision.reason)
    """
    value = trial.user_attrs.get(decision_key(step))
    if value is None:
        return None
    return PruneDecision.from_attr(trial.number, step, value)
