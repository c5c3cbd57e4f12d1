"""Population-based training's executing half: a rung policy (`rfopt.pruning.RungPolicy`) that carries out the plan
`rfopt.pruning.plan_step` makes for a step and returns what it did as data.

At each step every live member reported, `PopulationRungs.judge`

1. loads the step's plan from the study, or plans it now and stores it (`rfopt.storage.schema.PbtStep`): a crash
   after this point is finished from the stored plan, not planned again;
2. makes each replacement's warm clone (`rfopt.engine.trials.clones.clone`), each once: a clone made before a crash is found
   again by its lineage token;
3. stores every judged member's decision (kept, replaced by a clone of trial N, or stopped by the unit budget);

and returns them (`RungOutcome`: the decisions, and the clones it made). The roster tells the replaced and stopped
members PRUNED and starts the clones. Under this policy, members that reported an exploit step wait for its decision
before they train on (`holds`), so a parent's latest checkpoint is the one its clones start from.

    >>> policy = PopulationRungs(rfopt.PopulationBasedTraining(interval=2), space, plan, store)   # doctest: +SKIP
    >>> policy.judge(study, step=1, trial_numbers=[0, 1, 2, 3], n_steps=4).clones                # doctest: +SKIP
    (4,)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.chunks import ChunkPlan
from rfopt.config.overrides import override_dict
from rfopt.config.trial import TrialConfig
from rfopt.errors import ConfigError, OpError
from rfopt.pruning import Member, PopulationBasedTraining, RungOutcome, plan_step
from rfopt.storage import crashpoints, schema
from rfopt.storage.schema import PbtStep, PruneDecision, Replacement, TrialRecord

from .clones import clone, clone_refusal, clone_with_token, warm_start_refusal

logger = logging.getLogger("rfopt")


class PopulationRungs:
    """Population-based training as a study's rung policy: `pbt`'s plan carried out on the study."""

    makes_clones = True

    def __init__(self, pbt: PopulationBasedTraining, space: Any, plan: ChunkPlan, checkpoints: Any) -> None:
        self.pbt = pbt
        self.space = space
        """The study's search space: it turns a clone's explored params into overrides of its parent's config."""
        self.plan = plan
        self.checkpoints = checkpoints
        """The study's checkpoint store, where a warm clone's starting weights are written."""
        self._warned_params: set[str] = set()

    def holds(self, step: int, n_steps: int) -> bool:
        return self.pbt.is_exploit_step(step, n_steps)

    def judge(self, study: optuna.Study, step: int, trial_numbers: list[int], n_steps: int) -> RungOutcome:
        plan = schema.load_pbt_step(study, step)
        if plan is None:
            plan = self._plan(study, step, n_steps)
            schema.write_pbt_step(study, plan)
            crashpoints.reach("pbt-planned", trial=-1, unit=step)
        replaced: dict[int, int | str] = {r.trial: self._replacement(study, r) for r in plan.replacements}
        crashpoints.reach("pbt-cloned", trial=-1, unit=step)
        trials = study.get_trials(deepcopy=False)
        decisions = []
        for number in trial_numbers:
            prune, reason = False, plan.reasons.get(number)
            replicate = TrialRecord(trials[number]).replicate
            if reason is None and replicate is not None:
                reason = (f"kept: a replicate of trial {replicate.of} (seed {replicate.seed}) runs to its end, outside "
                          "the population: never replaced, never cloned (study.confirm)")
            elif reason is None:
                reason = f"kept: not in the population at chunk {step + 1} (it was paused, or joined later)"
            elif number in replaced:
                made = replaced[number]
                if isinstance(made, int):
                    prune, reason = True, f"{reason} (trial {made})"
                else:
                    reason = f"kept: its replacement could not be made ({made})"
            elif number in plan.stopped:
                prune = True
            decision = PruneDecision(trial_number=number, step=step, prune=prune, reason=reason,
                                     peers=tuple(n for n in plan.ranking if n != number),
                                     pruner=type(self.pbt).__name__)
            schema.write_decision(schema.TrialRef.of(study, trials[number]), decision)
            decisions.append(decision)
        return RungOutcome(tuple(decisions), tuple(n for n in replaced.values() if isinstance(n, int)))

    def _plan(self, study: optuna.Study, step: int, n_steps: int) -> PbtStep:
        # Replicates (study.confirm) are one config's runs across seeds, not members: ranked against each other, the
        # bottom run would be replaced by a clone of the top one, and the seed variance they measure would be lost.
        # Nor do their units count against the population's budget.
        trials = [t for t in study.get_trials(deepcopy=False) if TrialRecord(t).replicate is None]
        members = []
        for t in trials:
            record = TrialRecord(t)
            if t.state == TrialState.RUNNING and step in t.intermediate_values and not record.paused:
                units = record.num_units or n_steps
                members.append(Member(t, t.intermediate_values[step], max(0, units - step - 1)))
        spent = sum(len(t.intermediate_values) for t in trials)
        changeable = {m.number: explorable(self.pbt, self.space, m.trial) for m in members}
        self._warn_unexplorable(members, changeable)
        return plan_step(self.pbt, study, step, n_steps, members, spent, changeable, refusal=self._refusal)

    def _refusal(self, parent: Member, params: Mapping[str, Any]) -> str | None:
        """Why a warm clone of `parent` with the Optuna `params` would be refused (`clone_refusal`), or None."""
        try:
            overrides = self.space.overrides_for(parent.trial, params)
        except (ConfigError, ValueError, TypeError) as exc:
            return f"the search space gives no config for {dict(params)}: {exc}"
        return clone_refusal(parent.trial, overrides, plan=self.plan)

    def _warn_unexplorable(self, members: list[Member], explorable: dict[int, list[str]]) -> None:
        """A param named in `PopulationBasedTraining(params=...)` that no clone can change is said once, not skipped
        in silence: a typo, or a param a warm start cannot change (the model, the adapter's shape)."""
        if self.pbt.params is None or not members:
            return
        searched = {name for m in members for name in m.trial.distributions}
        changeable = {name for names in explorable.values() for name in names}
        for name in self.pbt.params:
            if name in changeable or name in self._warned_params:
                continue
            self._warned_params.add(name)
            if name not in searched:
                logger.warning("PopulationBasedTraining(params=...): %r is not a param of this study (its params: "
                               "%s); clones will not change it", name, ", ".join(sorted(searched)) or "none")
            else:
                logger.warning("PopulationBasedTraining(params=...): %r cannot change in a warm-started clone (the "
                               "parent's weights would not load, or it has one value); clones keep the parent's",
                               name)

    def _replacement(self, study: optuna.Study, replacement: Replacement) -> int | str:
        """The clone that replaces a member (made now, or found made before a crash), or why it cannot be made."""
        number = clone_with_token(study, replacement.token)
        if number is not None:  # made before a crash, its warm-start weights first
            return number
        parent = study.get_trials(deepcopy=False)[replacement.parent]
        try:
            overrides = self.space.overrides_for(parent, replacement.params)
            made = clone(study, replacement.parent, overrides, warm_start=True, plan=self.plan,
                             checkpoints=self.checkpoints, by=type(self.pbt).__name__, token=replacement.token,
                             params=replacement.params)
        except (OpError, ConfigError, ValueError) as exc:
            logger.warning("trial %d: its replacement by a clone of trial %d could not be made: %s",
                           replacement.trial, replacement.parent, exc)
            return str(exc)
        logger.info("trial %d replaced by trial %d, a clone of trial %d", replacement.trial, made.number,
                    replacement.parent)
        return made.number


def explorable(pbt: PopulationBasedTraining, space: Any, parent: FrozenTrial) -> list[str]:
    """The params a clone of `parent` may change under `pbt`: those named (or all searched ones) that a warm start
    allows: changing the model, or the adapter's shape, would not load the parent's weights; a param with one value
    has nothing to change to."""
    names = pbt.params if pbt.params is not None else tuple(parent.params)
    stored = TrialRecord(parent).config_json
    if stored is None:
        return []
    data = TrialConfig.config_dict(stored)
    found = []
    for name in names:
        dist = parent.distributions.get(name)
        if dist is None:
            continue
        other = _another_value(dist, parent.params[name])
        if other is None:
            continue
        try:
            overrides = space.overrides_for(parent, {**parent.params, name: other})
            child, _ = override_dict(data, overrides)
        except (ConfigError, ValueError, TypeError):
            continue
        if warm_start_refusal(data, child) is None:
            found.append(name)
    return found


def _another_value(dist: Any, value: Any) -> Any:
    """A value of `dist` other than `value` (to ask what changing the param would change), or None if it has one."""
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return next((c for c in dist.choices if c != value), None)
    if dist.low == dist.high:
        return None
    return dist.high if value != dist.high else dist.low
