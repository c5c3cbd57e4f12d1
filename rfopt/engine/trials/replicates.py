"""Replicates: the study's best configs trained again with new seeds, as new Optuna trials linked to their original
(``rfopt:replicate_of``, `rfopt.storage.schema.Replicate`), so that the answer is a config's across seeds and not one
seed's (`rfopt.reports.replicates` reads the groups).

A replicate is a clone of its original (`rfopt.engine.trials.clones.clone`) whose only override is ``seed`` (GRPOConfig's:
the adapter's initialization, the rollouts' sampling, dropout) and whose Optuna params are its original's: to Optuna it
is the same config, run again. It trains through the same engine as every trial (gangs, leases, resume after a crash,
ops): a run of the study (``study.optimize`` / ``work``, ``rfopt run``, ``rfopt worker``) starts it as it starts any
clone, and a running one picks it up when a slot frees. It is never pruned unless made with ``prune=True`` (then the
run's pruner judges it at rungs as any trial): a config's runs go to their end, so that their best values compare.
Population-based training leaves replicates out of its population, ``prune=True`` or not
(`rfopt.engine.trials.population`): it never replaces one, or clones one as if it were another config.

`confirm` tops each config up to `seeds` replicates: asked again (after a crash while it was enqueueing, or twice), it
makes only the missing ones.

    >>> made = confirm(study, top=2, seeds=2)          # doctest: +SKIP
    >>> [(m.number, m.of, m.seed) for m in made]       # doctest: +SKIP
    [(8, 3, 43), (9, 3, 44), (10, 1, 43), (11, 1, 44)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from rfopt.reports.replicates import seed_of
from rfopt.storage import crashpoints, schema
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.schema import TrialRecord

from .clones import clone
from rfopt.errors import OpError

@dataclass(frozen=True)
class Made:
    """A replicate enqueued by `confirm`."""

    number: int
    of: int
    seed: int

    def describe(self) -> str:
        """``trial 8: replicate of trial 3 with seed 43 enqueued``."""
        return f"trial {self.number}: replicate of trial {self.of} with seed {self.seed} enqueued"


def finalists(study: optuna.Study, top: int) -> list[int]:
    """The `top` best configs of the study's sweep, best first: its trials that are not replicates, ranked as the
    leaderboard ranks them (complete ones by value first), leaving out failed, cancelled and waiting trials and those
    with no value yet."""
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    ranked = []
    for trial in study.get_trials(deepcopy=False):
        record = TrialRecord(trial)
        if record.replicate is not None or record.config_json is None or record.value is None \
                or trial.state in (TrialState.WAITING, TrialState.FAIL):
            continue
        ranked.append((record.leaderboard_rank(maximize), trial.number))
    return [number for _, number in sorted(ranked)[:top]]


def confirm(study: optuna.Study, top: int, seeds: int, *, prune: bool = False, by: str | None = None) -> list[Made]:
    """Enqueue replicates of the study's `top` best configs (`finalists`) until each has `seeds` of them, each with a
    seed none of the config's runs has used (the original's seed + 1, + 2, ...). Returns the ones made now (none
    where every finalist has its replicates already). `prune`: the replicates are judged at rung boundaries by the
    run's pruner; by default they run to their end.

    Refused (`OpError`, nothing written) when `top` or `seeds` is below 1, the study has not run, or no trial of it
    has a value yet."""
    for name, value in (("top", top), ("seeds", seeds)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OpError(f"confirm: {name}={value!r}; give a whole number of at least 1 (top: how many of the best "
                          "configs to replicate; seeds: replicates of each, beside its original run)")
    record = schema.study_record(study)
    if record.plan is None or record.checkpoint_dir is None:
        raise OpError(f"study {study.study_name!r} has not run yet (it has no chunk plan); run it before confirming "
                      "its best configs")
    if len(study.directions) != 1:
        raise OpError(f"study {study.study_name!r} has {len(study.directions)} objectives; confirm compares the runs "
                      "of a config on one objective")
    chosen = finalists(study, top)
    if not chosen:
        raise OpError(f"study {study.study_name!r} has no trial with a value yet: confirm replicates the best configs "
                      "once trials have reported")
    checkpoints = CheckpointStore(record.checkpoint_dir)
    made = []
    for original in chosen:
        runs = _replicates_of(study.get_trials(deepcopy=False), original)
        used = {seed_of(TrialRecord(study.get_trials(deepcopy=False)[original]))} | {r.seed for r in runs}
        for seed in _new_seeds(used, seeds - len(runs)):
            replicate = schema.Replicate(of=original, seed=seed, prune=prune)
            number = clone(study, original, {"seed": seed}, warm_start=False, plan=record.plan,
                           checkpoints=checkpoints, by=by, replicate=replicate).number
            crashpoints.reach("replicate-enqueued", trial=original, unit=len(made))
            made.append(Made(number, original, seed))
    return made


def _replicates_of(trials: Sequence[optuna.trial.FrozenTrial], original: int) -> list[schema.Replicate]:
    """The replicates of trial `original` made so far (a cancelled one counts as never made)."""
    found = []
    for trial in trials:
        record = TrialRecord(trial)
        if record.replicate is not None and record.replicate.of == original and record.cancelled is None:
            found.append(record.replicate)
    return found


def _new_seeds(used: set[int], count: int) -> list[int]:
    start = min(used)
    out: list[int] = []
    candidate = start + 1
    while len(out) < count:
        if candidate not in used:
            out.append(candidate)
        candidate += 1
    return out
