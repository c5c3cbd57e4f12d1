"""Population-based training: at exploit steps, the bottom of the population is replaced by warm clones of the top.

The policy is given to a study as its pruner (``create_study(pruner=rfopt.PopulationBasedTraining(...))``): it is
then the study's rung policy (`rfopt.pruning.RungPolicy`), what decides which trials stop after a chunk. It is not an
Optuna pruner: it replaces trials with clones, which only rfopt can do. The population is the study's live trials (``max_concurrent`` of
them, or a list's configs), replicates (``study.confirm``: a config run again with new seeds) left out. Every ``interval`` chunks, once every live member has reported the step (as rungs are
decided: the order trials ran in does not matter), :func:`plan_step` ranks the members by their value at that step
and

- replaces each of the bottom ``quantile`` by a clone of a member of the top ``quantile`` (chosen with the policy's
  seeded random generator), warm-started from that parent's checkpoint at the step, with the explored params
  perturbed by one of ``factors`` or resampled with ``resample_probability``, within the parent's Optuna
  distributions (or asked of the study's sampler, ``explore="sampler"``);
- and, first, where the population would train more than ``max_units`` chunk units to the end, stops as many of
  the bottom as the budget needs without a replacement (those that go on would finish within the budget even if
  the population halved at each later exploit step).

A replacement continues from its parent's step, so the population trains at most ``population x chunks`` units,
the compute of training every initial member to the end (``max_units`` lowers it).

What this module decides is a pure function of the stored values (and the seed); `rfopt.engine.trials.population` stores
the plan (`rfopt.storage.schema.PbtStep`), makes the clones (`rfopt.engine.trials.clones.clone`) and stops the members.
"""

from __future__ import annotations

import copy
import math
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt.errors import PopulationBasedTrainingMisplaced, Refusal
from rfopt.storage.schema import PbtStep, Replacement, TrialRecord

EXPLORE_MODES = ("perturb", "sampler")


class PopulationBasedTraining:
    """Population-based training (exploit and explore) over rfopt's live trials, given as the study's pruner.

    Args:
        interval: chunks between exploit steps: members are ranked after chunks ``interval - 1``,
            ``2 * interval - 1``, ... (never after the last chunk, which ends the trials).
        quantile: the fraction of the population replaced at each exploit step (the bottom), and the fraction whose
            members are parents (the top); ``0 < quantile <= 0.5``. At least one member is replaced in a population
            of two or more.
        factors: the multipliers a perturbed number is multiplied by (one chosen at random per param); each > 0.
            Results are clipped to the param's range and rounded to its step (integers to whole numbers).
        resample_probability: the chance that a param is drawn afresh from its distribution instead of perturbed
            (log-uniform for a log-scale range). Categorical params change only this way.
        params: names of the Optuna params to explore; default: every searched param that a warm start can change
            (not the model, nor the adapter's rank or target modules: the clone loads its parent's weights).
        explore: ``"perturb"`` (factors and resampling) or ``"sampler"``: ask the study's Optuna sampler (a copy
            of it, so the study's own is not advanced) for the explored params, given every trial's value at the
            step (members as COMPLETE trials with that value, trials stopped earlier as PRUNED).
        max_units: a compute budget in chunk units for the whole study. At an exploit step where finishing every
            member would exceed it, the bottom members are stopped without a replacement, as many as the budget
            needs: those that go on would finish within it even if the population halved at each later exploit
            step, so the first cuts are the gentlest (one member is always kept). The bottom quantile of those
            that go on is then replaced as at any exploit step. None: no budget beyond ``population x chunks``.
            Replicates' units (``study.confirm``) are not counted: they are asked for apart.
        seed: seeds the choices (parents, factors, resampling); None draws a fresh seed for each step. Either way
            each step's plan is stored before it is carried out, so a resumed study carries out the same plan.

    Example::

        study = rfopt.create_study(study_name="pbt", pruner=rfopt.PopulationBasedTraining(interval=2, seed=0))
        study.optimize(configs, train, test, num_chunks=8, max_concurrent=len(configs))
    """

    def __init__(
        self,
        interval: int = 1,
        quantile: float = 0.25,
        factors: Sequence[float] = (0.8, 1.25),
        resample_probability: float = 0.25,
        *,
        params: Sequence[str] | None = None,
        explore: str = "perturb",
        max_units: int | None = None,
        seed: int | None = None,
    ) -> None:
        problems = []
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            problems.append(f"interval={interval!r}: give a whole number of chunks >= 1")
        if not isinstance(quantile, (int, float)) or isinstance(quantile, bool) or not 0 < quantile <= 0.5:
            problems.append(f"quantile={quantile!r}: give a fraction in (0, 0.5] (the bottom and the top must not "
                            "overlap)")
        factors = tuple(factors) if isinstance(factors, (list, tuple)) else factors
        if (not isinstance(factors, tuple) or not factors
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                           for f in factors)):
            problems.append(f"factors={factors!r}: give one or more finite numbers > 0, e.g. (0.8, 1.25)")
        if (not isinstance(resample_probability, (int, float)) or isinstance(resample_probability, bool)
                or not 0 <= resample_probability <= 1):
            problems.append(f"resample_probability={resample_probability!r}: give a probability in [0, 1]")
        if params is not None and (isinstance(params, str) or not all(isinstance(p, str) for p in params)
                                   or not params):
            problems.append(f"params={params!r}: give a list of Optuna param names, e.g. ['learning_rate']")
        if explore not in EXPLORE_MODES:
            problems.append(f"explore={explore!r}: use one of {', '.join(map(repr, EXPLORE_MODES))}")
        if max_units is not None and (isinstance(max_units, bool) or not isinstance(max_units, int)
                                      or max_units < 1):
            problems.append(f"max_units={max_units!r}: give a whole number of chunk units >= 1, or None")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            problems.append(f"seed={seed!r}: give an int or None")
        if problems:
            raise Refusal("PopulationBasedTraining: " + "; ".join(problems))
        self.interval = interval
        self.quantile = float(quantile)
        self.factors = tuple(float(f) for f in factors)
        self.resample_probability = float(resample_probability)
        self.params = None if params is None else tuple(params)
        self.explore = explore
        self.max_units = max_units
        self.seed = seed

    def __repr__(self) -> str:
        return (f"PopulationBasedTraining(interval={self.interval}, quantile={self.quantile:g}, "
                f"factors={self.factors}, resample_probability={self.resample_probability:g}, "
                f"params={self.params}, explore={self.explore!r}, max_units={self.max_units}, seed={self.seed})")

    def prune(self, study: Any, trial: Any) -> bool:
        """Refused: an Optuna study that holds this as its pruner (``optuna.create_study(pruner=...)``) would call it
        from ``trial.should_prune()``, and only rfopt can replace trials by clones of others."""
        raise PopulationBasedTrainingMisplaced(
            f"trial {trial.number}: PopulationBasedTraining is not an Optuna pruner: it replaces trials by clones of "
            "others, which only rfopt can do. Give it to rfopt.create_study(pruner=...) (or rfopt.load_study, or "
            "rfopt.Study(optuna_study, pruner=...)) and run the study with study.optimize or study.work; an Optuna "
            "study made with optuna.create_study(pruner=PopulationBasedTraining(...)) cannot use it")

    def is_exploit_step(self, step: int, n_steps: int) -> bool:
        """Whether members are ranked after the chunk of `step` (the last chunk ends the trials instead)."""
        return 0 <= step < n_steps - 1 and (step + 1) % self.interval == 0


@dataclass(frozen=True)
class Member:
    """A member of the population at a step: its trial, its value there, and the chunk units it has left."""

    trial: FrozenTrial
    value: float
    units_left: int

    @property
    def number(self) -> int:
        return self.trial.number


DRAWS = 10
"""Explorations drawn for one replacement, at most, while its clone would be refused (`plan_step`'s `refusal`)."""


def plan_step(
    pbt: PopulationBasedTraining,
    study: optuna.Study,
    step: int,
    n_steps: int,
    members: Sequence[Member],
    spent_units: int,
    explorable: Mapping[int, Sequence[str]],
    refusal: Callable[[Member, Mapping[str, Any]], str | None] | None = None,
) -> PbtStep:
    """What population-based training does at `step`: from the members' values there, and the seed, only.

    `spent_units` are the chunk units every trial of the study has trained so far; `explorable` gives, for each
    member that may be a parent, the params its clones may change (`PopulationBasedTraining.params`, or the searched
    ones a warm start can change). `refusal` says why a clone of a parent with the given params would be refused
    (None: it would be made), as a clone with a learning rate of 0 is: such an exploration is drawn again (up to
    `DRAWS` times), then the parent's own values are tried (exploit without explore); where even those would be
    refused, the member is kept, and its reason says why. So a plan never holds a clone that cannot be made.
    """
    sign = -1.0 if study.direction == StudyDirection.MAXIMIZE else 1.0
    ranking = sorted(members, key=lambda m: (math.isnan(m.value), 0.0 if math.isnan(m.value) else sign * m.value,
                                             m.number))
    n = len(ranking)
    numbers = tuple(m.number for m in ranking)
    if not pbt.is_exploit_step(step, n_steps):
        every = f"every {pbt.interval} chunks" if pbt.interval > 1 else "after every chunk"
        return PbtStep(step, numbers, (), (), {m.number: f"kept: chunk {step + 1} is not an exploit step ({every})"
                                               for m in ranking})
    reasons = {}
    stopped: Sequence[Member] = ()
    projected = spent_units + sum(m.units_left for m in ranking)
    if pbt.max_units is not None and projected > pbt.max_units and n >= 2:
        # The bottom stop without a replacement, as many as the budget needs: those that go on would train within
        # it even if the population then halved at each later exploit step.
        keep = _population_within(pbt, step, n_steps, n, pbt.max_units - spent_units)
        stopped = ranking[keep:]
        for rank, m in enumerate(stopped, keep + 1):
            reasons[m.number] = (f"stopped: rank {rank} of {n} at chunk {step + 1}; finishing the population would "
                                 f"train {projected} chunk units, over max_units={pbt.max_units}, so {keep} go on")
    live = ranking[:n - len(stopped)]
    count = max(1, math.floor(pbt.quantile * len(live))) if len(live) >= 2 else 0
    top, bottom = live[:count], live[len(live) - count:] if count else []
    for rank, m in enumerate(live, 1):
        where = "top" if m in top else "middle"
        reasons[m.number] = f"kept: rank {rank} of {n} at chunk {step + 1} ({where} of the population)"
    rng = random.Random(f"{pbt.seed}:{step}") if pbt.seed is not None else random.Random(uuid.uuid4().int)
    stopped_numbers = tuple(m.number for m in stopped)

    parents = [m for m in top if not math.isnan(m.value)]
    if not parents:
        reasons.update({m.number: f"kept: no member has a value at chunk {step + 1} to clone" for m in live})
        return PbtStep(step, numbers, (), stopped_numbers, reasons)
    asked = _SamplerAsk(study, step) if pbt.explore == "sampler" else None
    replacements = []
    for m in bottom:
        parent = rng.choice(parents)
        names = list(explorable.get(parent.number, ()))
        refused: str | None = None
        for _ in range(DRAWS):
            if asked is not None:
                new = asked.ask({name: parent.trial.distributions[name] for name in names})
            else:
                new = {name: perturb(parent.trial.params[name], parent.trial.distributions[name], pbt, rng)
                       for name in sorted(names)}
            params = {**parent.trial.params, **new}
            refused = None if refusal is None else refusal(parent, params)
            if refused is None:
                break
        if refused is not None:  # no exploration draws a clone that would train: the parent's own values
            params = dict(parent.trial.params)
            own = refusal(parent, params) if refusal is not None else None
            if own is not None:
                reasons[m.number] = (f"kept: rank {numbers.index(m.number) + 1} of {n} at chunk {step + 1} (bottom of "
                                     f"the population), but no clone of trial {parent.number} can be made: {own}")
                continue
        changed = {name: [parent.trial.params[name], params[name]] for name in sorted(names)
                   if params[name] != parent.trial.params[name]}
        replacements.append(Replacement(trial=m.number, parent=parent.number, params=params, changed=changed,
                                        token=f"pbt-{uuid.uuid4().hex}"))
        rank = numbers.index(m.number) + 1
        shown = ", ".join(f"{k} {_shown(a)} -> {_shown(b)}" for k, (a, b) in changed.items()) or "no value changed"
        reasons[m.number] = (f"replaced by a clone of trial {parent.number}: rank {rank} of {n} at chunk {step + 1} "
                             f"(bottom of the population); the clone has {shown}")
        if refused is not None:
            reasons[m.number] += f" (every exploration drawn would have been refused: {refused})"
    return PbtStep(step, numbers, tuple(replacements), stopped_numbers, reasons)


def _population_within(pbt: PopulationBasedTraining, step: int, n_steps: int, n: int, units: int) -> int:
    """How many of `n` members may go on from `step` within `units` chunk units: the most whose training to the end
    fits if the population then halved at each later exploit step (as successive halving with ``eta=2`` does), so
    that the first cuts, made on the least evidence, are the gentlest. At least one goes on."""
    ends = [s for s in range(step + 1, n_steps - 1) if pbt.is_exploit_step(s, n_steps)] + [n_steps - 1]
    segments = [end - start for start, end in zip([step, *ends], ends)]

    def cost(size: int) -> int:
        return sum(chunks * math.ceil(size / 2**j) for j, chunks in enumerate(segments))

    return max([1, *(size for size in range(1, n + 1) if cost(size) <= units)])


def perturb(value: Any, dist: BaseDistribution, pbt: PopulationBasedTraining, rng: random.Random) -> Any:
    """`value` explored within `dist`: resampled with `pbt.resample_probability`, else multiplied by one of
    `pbt.factors`, clipped to the range and rounded to its step. A categorical value is only resampled."""
    resample = rng.random() < pbt.resample_probability
    if isinstance(dist, CategoricalDistribution):
        return rng.choice(list(dist.choices)) if resample else value
    if not isinstance(dist, (FloatDistribution, IntDistribution)):
        return value
    if resample:
        if dist.log:
            new = math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))
        else:
            new = rng.uniform(dist.low, dist.high)
    else:
        new = value * rng.choice(pbt.factors)
    return _within(new, dist)


def _within(value: float, dist: FloatDistribution | IntDistribution) -> Any:
    value = min(max(value, dist.low), dist.high)
    if dist.step is not None:
        value = dist.low + round((value - dist.low) / dist.step) * dist.step
        value = min(value, dist.high)
    if isinstance(dist, IntDistribution):
        return round(value)
    return float(value)


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


class _SamplerAsk:
    """The study's sampler, asked on an in-memory copy of the study as of `step`: trials that reached the step are
    COMPLETE with their value there, trials stopped before it PRUNED with their values (replicates left out: their
    params are their original's). Each ask stays RUNNING in
    the copy, so the next one (with a constant liar, as TPE's default) proposes elsewhere."""

    def __init__(self, study: optuna.Study, step: int) -> None:
        self.copy = optuna.create_study(storage=optuna.storages.InMemoryStorage(), directions=study.directions,
                                        sampler=copy.deepcopy(study.sampler))
        for t in study.get_trials(deepcopy=False):
            if t.state == TrialState.FAIL or not t.params or not t.intermediate_values:
                continue
            if TrialRecord(t).replicate is not None:  # a config's run again with a new seed, not another config
                continue
            values = {s: v for s, v in t.intermediate_values.items() if s <= step}
            if step in values and not math.isnan(values[step]):
                state, value = TrialState.COMPLETE, values[step]
            elif t.state == TrialState.PRUNED and values:
                state, value = TrialState.PRUNED, None
            else:
                continue
            self.copy.add_trial(optuna.trial.create_trial(
                state=state, value=value, params=dict(t.params), distributions=dict(t.distributions),
                intermediate_values=values))

    def ask(self, distributions: Mapping[str, BaseDistribution]) -> dict[str, Any]:
        if not distributions:
            return {}
        return dict(self.copy.ask(dict(distributions)).params)
