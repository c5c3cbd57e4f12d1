"""A config's runs across seeds (its original trial and the replicates `rfopt.engine.trials.replicates.confirm` made), read
from storage alone: each run's best value, their mean and its between-seed standard error, and which config wins
across seeds, by how much, or that the finalists are within their seed variance.

One run's value carries two kinds of noise: the evaluation's (which prompts the eval set holds: `rfopt.noise`) and the
training's (other rollouts, other updates: another seed). Only runs with other seeds see the second. A run's value
here is its best checkpoint's (`rfopt.storage.schema.BestCheckpoint`: the adapter it would give), else its last
value; a group's standard error is the standard deviation of its runs' values over the square root of their number.

    >>> [g.text("reward") for g in groups(study.get_trials(), maximize=True)]          # doctest: +SKIP
    ['trial 3 over 3 seeds: reward 1.95 ± 0.04 (trial 3 2.01, trial 8 1.9, trial 9 1.94)']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from rfopt import noise
from rfopt.config.trial import TrialConfig
from rfopt.storage.schema import TrialRecord

DEFAULT_SEED = 42
"""GRPOConfig's default ``seed``: a config that sets none trains with it."""


@dataclass(frozen=True)
class SeedRun:
    """One run of a config: its trial, seed, best value and state."""

    trial: int
    seed: int
    value: float | None
    """Its best checkpoint's value, else its last reported value; None before it reported."""
    unit: int | None
    """The unit of that value (its best checkpoint's, else its last)."""
    state: str

    @property
    def ended(self) -> bool:
        return self.state in (TrialState.COMPLETE.name, TrialState.PRUNED.name)


@dataclass(frozen=True)
class ReplicateGroup:
    """A config's runs: its original trial first, then its replicates in trial order."""

    original: int
    params: dict
    runs: tuple[SeedRun, ...]

    @property
    def values(self) -> list[float]:
        return [r.value for r in self.runs if r.value is not None and math.isfinite(r.value)]

    @property
    def mean(self) -> float | None:
        """The mean of its runs' best values (runs with none left out)."""
        values = self.values
        return sum(values) / len(values) if values else None

    @property
    def stderr(self) -> float | None:
        """The between-seed standard error of `mean` (None with fewer than two valued runs)."""
        values = self.values
        if len(values) < 2:
            return None
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))

    @property
    def done(self) -> bool:
        """Every run has ended (complete or pruned)."""
        return all(r.ended for r in self.runs)

    def text(self, objective: str) -> str:
        """``trial 3 over 3 seeds: reward 1.95 ± 0.04 (trial 3 2.01, trial 8 1.9, trial 9 1.94)``, with how many
        runs are still training."""
        mean, stderr = self.mean, self.stderr
        shown = "-" if mean is None else f"{mean:.4g}" + ("" if stderr is None else f" ± {stderr:.2g}")
        each = ", ".join(f"trial {r.trial} " + ("-" if r.value is None else f"{r.value:.4g}") for r in self.runs)
        left = sum(not r.ended for r in self.runs)
        training = f"; {left} of {len(self.runs)} still training" if left else ""
        return f"trial {self.original} over {len(self.runs)} seeds: {objective} {shown} ({each}){training}"


@dataclass(frozen=True)
class SeedVerdict:
    """The best config across seeds against the next: the difference of their means and its standard error (the two
    groups' between-seed errors added: different seeds are independent runs)."""

    winner: ReplicateGroup
    runner_up: ReplicateGroup
    difference: float
    stderr: float | None

    @property
    def within_seed_noise(self) -> bool:
        """The gap is no larger than `rfopt.noise.Z` of its standard errors (or a group has a single run: nothing
        says how far another seed would move it)."""
        return self.stderr is None or abs(self.difference) <= noise.Z * self.stderr + 1e-12

    def text(self, objective: str) -> str:
        """``across seeds, the config of trial 3 wins: reward 1.95 ± 0.04 over 3 seeds against trial 1's 1.8 ± 0.05
        (gap 0.15 ± 0.064, more than its seed variance)`` or ``... the finalists are within their seed variance``."""
        w, r = self.winner, self.runner_up
        error = "" if self.stderr is None else f" ± {self.stderr:.2g}"
        against = (f"{objective} {w.mean:.4g}" + ("" if w.stderr is None else f" ± {w.stderr:.2g}")
                   + f" over {len(w.values)} seeds against trial {r.original}'s {r.mean:.4g}"
                   + ("" if r.stderr is None else f" ± {r.stderr:.2g}") + f" over {len(r.values)}")
        if self.within_seed_noise:
            return (f"across seeds, the finalists are within their seed variance: the config of trial {w.original} "
                    f"leads, {against} (gap {abs(self.difference):.3g}{error}); either could win another run")
        return (f"across seeds, the config of trial {w.original} wins: {against} (gap {abs(self.difference):.3g}"
                f"{error}, more than its seed variance)")


def groups(trials: Sequence[FrozenTrial], maximize: bool) -> list[ReplicateGroup]:
    """The study's configs that have replicates, each with its runs, best mean first."""
    records = {t.number: TrialRecord(t) for t in trials}
    members: dict[int, list[TrialRecord]] = {}
    for record in records.values():
        replicate = record.replicate
        if replicate is not None and record.cancelled is None and replicate.of in records:
            members.setdefault(replicate.of, []).append(record)
    out = []
    for original, replicates in members.items():
        ordered = sorted(replicates, key=lambda r: r.number)
        runs = [_run(records[original], seed_of(records[original]))] + [_run(r, r.replicate.seed) for r in ordered]
        out.append(ReplicateGroup(original, dict(records[original].trial.params), tuple(runs)))
    sign = 1.0 if maximize else -1.0
    return sorted(out, key=lambda g: (g.mean is None, -sign * (g.mean or 0.0), g.original))


def across_seeds(found: Sequence[ReplicateGroup], maximize: bool) -> SeedVerdict | None:
    """The best group (`groups`' order) against the next; None with fewer than two groups with values."""
    valued = [g for g in found if g.mean is not None]
    if len(valued) < 2:
        return None
    winner, runner_up = valued[0], valued[1]
    errors = (winner.stderr, runner_up.stderr)
    stderr = None if None in errors else math.hypot(*errors)  # type: ignore[arg-type]
    return SeedVerdict(winner, runner_up, winner.mean - runner_up.mean, stderr)  # type: ignore[operator]


def seed_of(record: TrialRecord) -> int:
    """The seed a trial trains with: its config's ``args.seed`` (GRPOConfig's default, 42, where it sets none)."""
    config_json = record.config_json
    args = (TrialConfig.config_dict(config_json).get("args") or {}) if config_json else {}
    seed = args.get("seed", DEFAULT_SEED)
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else DEFAULT_SEED


def _run(record: TrialRecord, seed: int) -> SeedRun:
    best = record.best
    if best is not None and math.isfinite(best.value):
        value, unit = best.value, best.unit
    else:
        values = record.trial.intermediate_values
        unit = max(values) if values else None
        value = None if unit is None else values[unit]
    return SeedRun(record.number, seed, value, unit, record.shown_state)
