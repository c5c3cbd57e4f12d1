"""How much an eval value can be trusted: its standard error over the eval prompts, and whether two trials' values
differ by more than noise.

A trial's value after a chunk is a mean over the eval set (one completion per prompt, `rfopt.training.evaluation`);
each unit stores the per-prompt scores it is the mean of (`rfopt.storage.schema.UnitMetrics.scores`). Every trial of a
study is evaluated on the same prompts, so two trials are compared prompt by prompt (a paired difference): its
standard error is small when the two trials score alike on each prompt, and zero when their completions score the
same everywhere (then the gap is zero too, and they tie).

Where the two evaluations scored different prompts (a different count), the gap falls back to two independent means,
whose standard errors add (`Gap.paired` False, and its text says "unpaired"): usually much larger, since the prompts
that are hard for one trial are hard for the other too, and pairing takes that shared part out.

A gap is *within noise* when it is no larger than `Z` standard errors of the gap (about a 95% interval): such a
gap could come from which prompts the eval set happens to hold, not from the configs.

    >>> gap([1, 0, 1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0]).within_noise
    True
    >>> estimate([0.0, 1.0, 1.0, 0.0]).text()
    '0.5 ± 0.29 (4 prompts)'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z = 2.0
"""Standard errors a gap must exceed to count as more than noise (about a 95% interval)."""


@dataclass(frozen=True)
class Estimate:
    """A mean over eval prompts, with its standard error (None for fewer than two scored prompts)."""

    mean: float
    stderr: float | None
    n: int
    """Prompts scored (a prompt whose every reward was None is not counted)."""

    def text(self) -> str:
        """``0.3 ± 0.05 (8 prompts)``: the mean with its standard error and the prompt count."""
        if self.stderr is None:
            return f"{self.mean:.4g} ({_prompts(self.n)})"
        return f"{self.mean:.4g} ± {self.stderr:.2g} ({_prompts(self.n)})"


@dataclass(frozen=True)
class Gap:
    """How much trial A's mean exceeds trial B's, with the standard error of that difference."""

    difference: float
    stderr: float | None
    n: int
    paired: bool
    """Compared prompt by prompt (the same eval prompts, as every trial of a study has)."""

    @property
    def within_noise(self) -> bool:
        """The gap is no larger than `Z` standard errors (or both trials scored every prompt the same)."""
        if self.stderr is None:
            return False
        return abs(self.difference) <= Z * self.stderr + 1e-12

    @property
    def margin(self) -> float | None:
        """How large a gap noise could make: `Z` standard errors of the gap (None without one)."""
        return None if self.stderr is None else Z * self.stderr

    def text(self) -> str:
        """``paired gap 0.005 ± 0.031 over 8 eval prompts`` (prompt by prompt), or ``unpaired gap 0.05 ± 0.12 (the two
        evaluations scored different prompts)``."""
        error = "" if self.stderr is None else f" ± {self.stderr:.2g}"
        if self.paired:
            return f"paired gap {abs(self.difference):.3g}{error} over {self.n} eval prompts"
        return f"unpaired gap {abs(self.difference):.3g}{error} (the two evaluations scored different prompts)"


def estimate(scores: Sequence[float]) -> Estimate | None:
    """The mean of `scores` (NaN skipped) with its standard error; None when none is a number."""
    kept = [float(s) for s in scores if isinstance(s, (int, float)) and math.isfinite(s)]
    if not kept:
        return None
    mean = sum(kept) / len(kept)
    return Estimate(mean, _stderr(kept, mean), len(kept))


def gap(a: Sequence[float], b: Sequence[float]) -> Gap | None:
    """A's mean minus B's. Scores of the same eval prompts (same length) are compared prompt by prompt, the prompts
    either trial left unscored left out; otherwise as two independent means. None when either has no score."""
    if len(a) == len(b):
        pairs = [(x, y) for x, y in zip(a, b) if _number(x) and _number(y)]
        if not pairs:
            return None
        diffs = [x - y for x, y in pairs]
        mean = sum(diffs) / len(diffs)
        return Gap(mean, _stderr(diffs, mean), len(diffs), True)
    ea, eb = estimate(a), estimate(b)
    if ea is None or eb is None:
        return None
    stderr = None if ea.stderr is None or eb.stderr is None else math.hypot(ea.stderr, eb.stderr)
    return Gap(ea.mean - eb.mean, stderr, min(ea.n, eb.n), False)


def _stderr(values: list[float], mean: float) -> float | None:
    if len(values) < 2:
        return None
    if max(values) == min(values):  # no spread: 0, not the rounding of their mean (a "± 8.4e-17")
        return 0.0
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(variance / len(values))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _prompts(n: int) -> str:
    return f"{n} prompt" if n == 1 else f"{n} prompts"
