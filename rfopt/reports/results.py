"""What a study produced, as its user receives it: the one home of the result types.

- `LeaderboardRow`: one trial on the leaderboard (``Study.leaderboard()``, built by `rfopt.reports.leaderboard`;
  offered as ``rfopt.LeaderboardRow`` too);
- `StudyOutcome`: the study's answer (``Study.outcome()``, computed by `rfopt.reports.outcome`): its baselines, every
  trial's `TrialOutcome`, the `Recommendation` (the adapter to take, with its `Rival`), the kept checkpoints gone
  missing (`MissingBest`), and Optuna's best trial.

    >>> from rfopt.reports.results import LeaderboardRow, Recommendation, StudyOutcome
    >>> found: StudyOutcome = study.outcome()                                        # doctest: +SKIP
    >>> found.recommendation.line("reward")                                          # doctest: +SKIP
    'take this adapter: trial 1 after chunk 2, reward 1.8906 (+0.7344 over the base model, 1.1562): ...'

Records only: each is computed from storage elsewhere, and what it says of itself (``line``, ``lines``) is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rfopt import noise as noise_of
from rfopt.reports.replicates import ReplicateGroup, SeedVerdict
from rfopt.storage.schema import Baseline, BestCheckpoint


@dataclass
class LeaderboardRow:
    """One trial on the study's leaderboard (`rfopt.Study.leaderboard`, built by `rfopt.reports.leaderboard`)."""

    number: int
    state: str
    value: float | None
    chunks_done: int
    params: dict[str, Any]
    adapter: str | None = None
    reason: str | None = None
    held_as: dict[str, str] = field(default_factory=dict)
    """A clone's fields whose values its Optuna params hold under an alternate name (`rfopt.reports.leaderboard.held_as`)."""
    situation: str = ""
    """What it is doing, in the words the dashboard and ``rfopt status`` use (`rfopt.reports.status.situation`)."""
    value_error: float | None = None
    """The standard error of `value` over the eval prompts (`rfopt.noise`); None where not stored."""
    eval_count: int | None = None
    vs_base: float | None = None
    """Its value minus its baseline's (the base model with no adapter); None without a baseline."""
    best_value: float | None = None
    """The value of its best checkpoint (`rfopt.storage.schema.BestCheckpoint`); None before one."""
    best_chunk: int | None = None
    """The chunk of its best checkpoint, counted from 1."""
    flags: list[str] = field(default_factory=list)
    """What went wrong: ``collapsed at chunk 4: ...``, ``degraded after chunk 3: ...`` (`rfopt.reports.outcome`)."""


@dataclass(frozen=True)
class TrialOutcome:
    """One trial's answer: its last value, its best checkpoint, the baseline it compares with, and what went wrong."""

    number: int
    state: str
    final: tuple[int, float] | None
    """(unit, value) of its last report; None before one."""
    best: BestCheckpoint | None
    baseline: Baseline | None
    collapsed: str | None = None
    """``collapsed at chunk 4: one completion answers 16 of 16 eval prompts``, or None."""
    degraded: str | None = None
    """``degraded after chunk 3: reward 2.25 at chunk 3, 0.125 at chunk 4 (-2.125, beyond the paired noise ±0.41 over 16 eval prompts)``, or None."""

    @property
    def vs_baseline(self) -> float | None:
        """Its last value minus its baseline's; None without either."""
        if self.final is None or self.baseline is None:
            return None
        return self.final[1] - self.baseline.value

    @property
    def flags(self) -> list[str]:
        return [text for text in (self.collapsed, self.degraded) if text]


DECIDE = ("what would decide: more eval prompts (4x the prompts halve the noise), or a confirmation run, "
          "`rfopt confirm` / study.confirm(), training the finalists again with new seeds")
"""What a pick within noise of its runner-up is told would decide between them."""


@dataclass(frozen=True)
class Rival:
    """The runner-up to a recommended checkpoint: another trial's best checkpoint, and the paired gap between the two
    evaluations (`rfopt.noise.gap`, the recommended one first)."""

    trial: int
    unit: int
    value: float
    gap: noise_of.Gap

    def line(self, objective: str) -> str:
        """``ahead of trial 2's best checkpoint (chunk 3, reward 1.8) by more than noise: paired gap ...`` or
        ``within noise of trial 2's best checkpoint (...): ...; either could lead on other eval prompts (what would
        decide: ...)``."""
        other = f"trial {self.trial}'s best checkpoint (chunk {self.unit + 1}, {objective} {self.value:.4g})"
        if self.gap.within_noise:
            return (f"within noise of {other}: {self.gap.text()}; either could lead on other eval prompts ({DECIDE})")
        return f"ahead of {other} by more than noise: {self.gap.text()}"


@dataclass(frozen=True)
class Recommendation:
    """The adapter a study recommends: the best checkpoint over all its trials, with its trial, chunk and value."""

    trial: int
    unit: int
    """Its unit (Optuna's step): chunk ``unit + 1``."""
    value: float
    location: str
    """Its adapter (PEFT format): a directory, or a URL in an object store."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The eval metrics of that unit (reward means, spreads, diversity)."""
    baseline: Baseline | None = None
    rival: Rival | None = None
    """The best checkpoint of another trial, the next best, compared with this one prompt by prompt; None without one
    (or without per-prompt scores)."""

    @property
    def vs_baseline(self) -> float | None:
        return None if self.baseline is None else self.value - self.baseline.value

    def line(self, objective: str, maximize: bool = True) -> str:
        """``take this adapter: trial 1 after chunk 2, reward 1.8906 (+0.7344 over the base model, 1.1562): <path>``."""
        text = f"take this adapter: trial {self.trial} after chunk {self.unit + 1}, {objective} {self.value:.4f}"
        gain = self.vs_baseline
        if gain is not None:
            beats = gain > 0 if maximize else gain < 0
            text += (f" ({gain:+.4f} {'over' if beats else 'against'} the base model, {self.baseline.value:.4f}"
                     + ("" if beats else ": no checkpoint beat the untrained model") + ")")
        return f"{text}: {self.location}"


@dataclass(frozen=True)
class MissingBest:
    """A kept best checkpoint, better than the recommendation, whose adapter folder is gone (deleted by hand)."""

    trial: int
    unit: int
    value: float
    location: str

    def line(self, objective: str) -> str:
        """``missing: trial 1's best checkpoint (after chunk 2, reward 2.2500) is gone from <path>``."""
        return (f"missing: trial {self.trial}'s best checkpoint (after chunk {self.unit + 1}, {objective} "
                f"{self.value:.4f}) is gone from {self.location}")


@dataclass(frozen=True)
class StudyOutcome:
    """A study's answer: its baselines, every trial's `TrialOutcome`, the `Recommendation`, and Optuna's best trial."""

    objective: str
    maximize: bool
    baselines: dict[str, Baseline]
    trials: dict[int, TrialOutcome]
    recommendation: Recommendation | None
    optuna_best: tuple[int, float] | None
    """(number, value) of Optuna's ``best_trial`` (the best last value among COMPLETE trials); None before one."""
    missing: tuple[MissingBest, ...] = ()
    """Better kept checkpoints than `recommendation` whose folder is gone, best first: the recommendation is the best
    one that exists (looked at where the study's checkpoint store is a folder on this machine; a store elsewhere, or
    in an object store, is taken to hold them all)."""
    replicates: tuple[ReplicateGroup, ...] = ()
    """The configs run again with other seeds (`rfopt.reports.replicates.groups`), best mean first."""
    seeds: SeedVerdict | None = None
    """The best config across seeds against the next (with two configs replicated or more): then `recommendation` is
    the best checkpoint of the winning config's runs."""

    def baseline_purposes(self) -> dict[str, str]:
        """What each baseline is for, where two share a base model (so the model alone does not tell them apart):
        ``for trials 0, 2; rewards: correctness, format`` by key (its reward functions, read from its metrics, where
        they differ from the other's). Baselines of a model of their own get none."""
        out = {}
        for key, baseline in self.baselines.items():
            twins = [b for b in self.baselines.values() if b.model == baseline.model and b.key != key]
            if not twins:
                continue
            served = sorted(n for n, t in self.trials.items() if t.baseline is not None and t.baseline.key == key)
            said = [f"for trial{'s' if len(served) > 1 else ''} {', '.join(map(str, served))}" if served
                    else "for no trial yet"]
            rewards = _reward_names(baseline.metrics)
            if rewards and any(_reward_names(b.metrics) != rewards for b in twins):
                said.append(f"rewards: {', '.join(rewards)}")
            out[key] = "; ".join(said)
        return out

    def lines(self) -> list[str]:
        """What the leaderboard says under its rows: each replicated config across its seeds and which wins, the
        recommendation, and Optuna's best trial beside it."""
        out = [f"{group.text(self.objective)}" for group in self.replicates]
        if self.seeds is not None:
            out.append(self.seeds.text(self.objective))
        out += [m.line(self.objective) for m in self.missing]
        if self.missing:
            out.append("its folder was deleted; " + ("the best checkpoint that exists is recommended instead"
                                                     if self.recommendation is not None else
                                                     "no kept best checkpoint exists any more"))
        if self.recommendation is not None:
            out.append(self.recommendation.line(self.objective, self.maximize))
            if self.recommendation.rival is not None:
                out.append(f"the adapter to take is {self.recommendation.rival.line(self.objective)}")
        elif self.missing:
            out.append("no adapter to take: export_best(path, best_trial=True) exports Optuna's best trial's final "
                       "adapter")
        elif any(t.final is not None for t in self.trials.values()):
            out.append("no adapter to take: no trial kept a best checkpoint (every chunk committed so far collapsed, "
                       "or the study ran before rfopt kept them); export_best(path, best_trial=True) exports Optuna's "
                       "best trial's final adapter")
        elif self.trials:
            out.append("no adapter to take yet: no trial has committed a chunk")
        if self.optuna_best is not None:
            number, value = self.optuna_best
            same = self.recommendation is not None and self.recommendation.trial == number and \
                self.recommendation.value == value
            out.append(f"Optuna's best_trial (the best last value among complete trials): trial {number}, "
                       f"{self.objective} {value:.4f}" + ("" if same else
                                                          "; its final adapter: export_best(path, best_trial=True)"))
        return out


def _reward_names(metrics: Mapping[str, float]) -> list[str]:
    """The reward functions an evaluation scored with (its ``rewards/<name>/mean`` metrics)."""
    return sorted(k[len("rewards/"):-len("/mean")] for k in metrics if k.startswith("rewards/") and k.endswith("/mean"))
