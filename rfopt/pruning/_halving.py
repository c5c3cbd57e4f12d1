"""Synchronous successive halving over chunks, for SuccessiveHalvingPruner and HyperbandPruner.

Resources are counted in chunks: a trial that reported ``step`` has completed ``step + 1`` chunks.
Optuna's rung ``i`` completes at resource ``min_resource * reduction_factor ** (
min_early_stopping_rate + i)`` (``_successive_halving.py``), so under rfopt it is decided at step
``min_resource * reduction_factor ** (min_early_stopping_rate + i) - 1``. The last chunk of the
plan is the end of the budget (Hyperband's R), never a rung: a trial that got there is finished,
not halved.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass

from optuna.pruners import HyperbandPruner, SuccessiveHalvingPruner
from optuna.study import StudyDirection

from rfopt.errors import Refusal
from rfopt.compat import pruner_settings

#: With ``min_resource="auto"`` the first rung comes after about ``n_steps / eta**3`` chunks, so a
#: trial that runs the whole plan passes up to three halvings before its last chunk.
AUTO_HALVINGS = 3


@dataclass(frozen=True)
class Halving:
    """One successive-halving schedule in chunks (plain SHA, or one Hyperband bracket)."""

    min_resource: int
    reduction_factor: int
    min_early_stopping_rate: int
    bootstrap_count: int

    def rung_steps(self, n_steps: int) -> list[int]:
        """Steps at which rungs are decided, in order (rung ``i`` at index ``i``)."""
        steps = []
        resource = self.min_resource * self.reduction_factor**self.min_early_stopping_rate
        while resource < n_steps:
            steps.append(resource - 1)
            resource *= self.reduction_factor
        return steps

    def judge(
        self,
        number: int,
        values: Mapping[int, float],
        step: int,
        n_steps: int,
        direction: StudyDirection,
    ) -> tuple[bool, str, tuple[int, ...]]:
        """Keep ``number`` iff it ranks in the top ceil(n / eta) of ``values`` at this rung.

        ``values`` are the values at ``step`` of every trial that reached it (``number``
        included). Ties go to the lower trial number; NaN ranks last and is always pruned.
        Returns (prune, reason, peers).
        """
        rungs = self.rung_steps(n_steps)
        if not rungs:
            return False, "kept: no rung comes before the last chunk", ()
        if step not in rungs:
            where = ", ".join(str(r + 1) for r in rungs)
            return False, f"kept: chunk {step + 1} is not a rung (rungs after chunks {where})", ()
        rung = rungs.index(step)
        peers = tuple(sorted(n for n in values if n != number))
        n = len(values)
        if math.isnan(values[number]):
            return True, f"value at rung {rung} (chunk {step + 1}) is NaN", peers
        if n <= self.bootstrap_count:
            # Optuna prunes every trial that completes a rung before more than bootstrap_count
            # trials have; synchronously that is every trial at a rung with too few arrivals.
            return (
                True,
                f"only {n} trials reached rung {rung} (chunk {step + 1}); "
                f"bootstrap_count={self.bootstrap_count} needs more before promoting any",
                peers,
            )
        sign = -1.0 if direction == StudyDirection.MAXIMIZE else 1.0
        order = sorted(values, key=lambda t: _rank_key(values[t], sign, t))
        rank = order.index(number) + 1
        keep = math.ceil(n / self.reduction_factor)
        text = f"rank {rank} of {n} at rung {rung} (chunk {step + 1}; keeps top {keep})"
        if rank <= keep:
            return False, f"kept: {text}", peers
        return True, text, peers


def _rank_key(value: float, sign: float, number: int) -> tuple[bool, float, int]:
    nan = math.isnan(value)
    return (nan, 0.0 if nan else sign * value, number)


def successive_halving(pruner: SuccessiveHalvingPruner, n_steps: int) -> Halving:
    """The schedule of ``pruner`` over a plan of ``n_steps`` chunks.

    ``min_resource="auto"`` becomes ``max(1, n_steps // reduction_factor**AUTO_HALVINGS)``:
    from the chunk plan, not from Optuna's "1% of a completed trial's steps".
    """
    settings = pruner_settings(pruner)
    eta = settings["reduction_factor"]
    min_resource = settings["min_resource"]
    if min_resource is None:  # "auto"
        min_resource = max(1, n_steps // eta**AUTO_HALVINGS)
    return Halving(min_resource, eta, settings["min_early_stopping_rate"], settings["bootstrap_count"])


@dataclass(frozen=True)
class Brackets:
    """HyperbandPruner's brackets, placed exactly as Optuna 5.0 places trials.

    Reproduces ``HyperbandPruner._try_initialization`` and ``_get_bracket_id``: the number of
    brackets from ``max_resource / min_resource``, a budget per bracket, and a trial's bracket
    from a CRC32 of ``"{study_name}_{trial_number}"``. Bracket ``b`` is successive halving with
    ``min_early_stopping_rate=b``.
    """

    study_name: str
    budgets: tuple[int, ...]
    min_resource: int
    reduction_factor: int
    bootstrap_count: int

    @classmethod
    def of(cls, pruner: HyperbandPruner, study_name: str, n_steps: int) -> Brackets:
        """``max_resource="auto"`` is ``n_steps``, the plan's number of chunks."""
        settings = pruner_settings(pruner)
        min_resource = settings["min_resource"]
        max_resource = n_steps if settings["max_resource"] == "auto" else settings["max_resource"]
        assert isinstance(max_resource, int)
        eta = settings["reduction_factor"]
        # Same expression as Optuna, so float rounding agrees too.
        n_brackets = math.floor(math.log(max_resource / min_resource, eta)) + 1
        if n_brackets < 1:
            raise Refusal(
                f"HyperbandPruner: max_resource={max_resource} is below "
                f"min_resource={min_resource}; set max_resource to the number of chunks or 'auto'."
            )
        budgets = []
        for bracket in range(n_brackets):
            s = n_brackets - 1 - bracket
            budgets.append(math.ceil(n_brackets * (eta**s) / (s + 1)))
        return cls(study_name, tuple(budgets), min_resource, eta, settings["bootstrap_count"])

    def index_of(self, trial_number: int) -> int:
        n = binascii.crc32(f"{self.study_name}_{trial_number}".encode()) % sum(self.budgets)
        for bracket, budget in enumerate(self.budgets):
            n -= budget
            if n < 0:
                return bracket
        raise AssertionError("unreachable: the budgets sum to the modulus")

    def halving(self, bracket: int) -> Halving:
        return Halving(self.min_resource, self.reduction_factor, bracket, self.bootstrap_count)
