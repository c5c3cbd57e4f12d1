"""What a study produced, read from storage alone: the baselines its trials compare with, each trial's best checkpoint,
whether its completions collapsed or its value degraded, and the study's **recommendation**: the adapter to take.

Optuna's answer stays Optuna's: a trial's value is its last report, and ``study.best_trial`` is the best of those
among COMPLETE trials. A GRPO sweep asks another question, "which adapter should I take?", and answers it as TRL's
``load_best_model_at_end`` does for one run: with the best checkpoint, not the last. The recommendation is the best
kept checkpoint (`rfopt.storage.schema.BestCheckpoint`) over every trial, pruned ones included; one whose completions
had collapsed is never kept, so never recommended.

- **collapsed**: the trial's latest evaluation answers at least half the eval prompts with one text
  (`rfopt.training.diversity.collapse_reason`).
- **degraded**: its last value is below its own best, or below the last value of a trial it outlived (one pruned or
  stopped with fewer chunks), by more than the evaluations' noise: twice the standard error of the difference,
  *paired*: prompt by prompt over the eval prompts both units scored (`rfopt.noise.gap`); for units an earlier rfopt
  stored without per-prompt scores, unpaired (each value's spread over the eval prompts, ``std / sqrt(n)``), and said. The pruner saw the trial at its
  rungs only; what came after is said here.

    >>> found = outcome(study.optuna)                                                # doctest: +SKIP
    >>> found.recommendation.line("reward")                                          # doctest: +SKIP
    'take this adapter: trial 1 after chunk 2, reward 1.8906 (+0.7344 over the base model, 1.1562): ...'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt import noise as noise_of
from rfopt.reports.replicates import across_seeds
from rfopt.reports.replicates import groups as replicate_groups
from rfopt.reports.results import MissingBest, Recommendation, Rival, StudyOutcome, TrialOutcome
from rfopt.storage.files import is_url
from rfopt.storage.schema import Baseline, BestCheckpoint, TrialRecord, UnitMetrics, study_record
from rfopt.training.diversity import collapse_reason


def outcome(study: Any, trials: Sequence[FrozenTrial] | None = None) -> StudyOutcome:
    """`study`'s answer (an `optuna.Study`), from its storage; `trials`: its trials where the caller has read them."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    record = study_record(study)
    single = len(study.directions) == 1
    maximize = not single or study.directions[0] == StudyDirection.MAXIMIZE
    objective = record.objective
    records = [TrialRecord(t) for t in trials if t.state != TrialState.WAITING]
    outcomes = {r.number: _trial_outcome(r, record.baselines, records, objective, maximize) for r in records}
    # A kept checkpoint's folder is looked at only where the study's store is on this machine (a dashboard on another
    # host, or a recorded study, has none of them: they are not missing).
    store = record.checkpoint_dir
    here = store is not None and not is_url(store) and Path(store).is_dir()
    found = replicate_groups(trials, maximize) if single else []
    verdict = across_seeds(found, maximize)
    among = None if verdict is None else {run.trial for run in verdict.winner.runs}
    recommendation, missing = _recommend(records, record.baselines, maximize, objective, look=here, among=among)
    return StudyOutcome(objective=objective, maximize=maximize, baselines=record.baselines, trials=outcomes,
                        recommendation=recommendation, missing=missing, replicates=tuple(found), seeds=verdict,
                        optuna_best=_optuna_best(trials, maximize) if single else None)


def noise(metrics: Mapping[str, float], objective: str) -> float | None:
    """The standard error of an evaluation's `objective` (its std over the prompts, over ``sqrt(n)``); None when it
    was not stored (an evaluation from before rfopt kept the spread)."""
    std = metrics.get("reward_std" if objective == "reward" else f"rewards/{objective}/std")
    count = metrics.get("completions/count")
    if std is None or not count:
        return None
    return std / math.sqrt(count)


def _trial_outcome(record: TrialRecord, baselines: Mapping[str, Baseline], records: list[TrialRecord],
                   objective: str, maximize: bool) -> TrialOutcome:
    values = record.trial.intermediate_values
    final = (max(values), values[max(values)]) if values else None
    units = record.unit_metrics()
    key = record.baseline_key
    baseline = baselines.get(key) if key is not None else None
    collapsed = None
    reference = None if baseline is None else baseline.metrics
    if units and (reason := collapse_reason(units[-1].eval, reference)) is not None:
        collapsed = f"collapsed at chunk {units[-1].unit + 1}: {reason}"
    return TrialOutcome(number=record.number, state=record.shown_state, final=final, best=record.best,
                        baseline=baseline, collapsed=collapsed,
                        degraded=_degraded(record, values, records, baselines, objective, maximize))


def _degraded(record: TrialRecord, values: Mapping[int, float], records: list[TrialRecord],
              baselines: Mapping[str, Baseline], objective: str,
              maximize: bool) -> str | None:
    if len(values) < 2:
        return None
    sign = 1.0 if maximize else -1.0
    last = max(values)
    peak = max(values, key=lambda u: (sign * values[u], -u))
    units = {m.unit: m for m in record.unit_metrics()}
    said = []
    gap = _beyond_noise(values[peak], values[last], units.get(peak), units.get(last), objective, sign)
    if peak != last and gap is not None:
        said.append(f"{objective} {values[peak]:.4g} at chunk {peak + 1}, {values[last]:.4g} at chunk {last + 1} "
                    f"({values[last] - values[peak]:+.4g}{gap})")
    outlived = []
    for other in records:
        other_values = other.trial.intermediate_values
        if other.number == record.number or other.state != TrialState.PRUNED or not other_values \
                or max(other_values) >= last:
            continue
        unit = max(other_values)
        theirs = next((m for m in other.unit_metrics() if m.unit == unit), None)
        if _collapsed(other, None if theirs is None else theirs.eval, baselines):  # a collapsed value is no bar
            continue
        gap = _beyond_noise(other_values[unit], values[last], theirs, units.get(last), objective, sign)
        if gap is not None:
            outlived.append((sign * other_values[unit], other.number, unit, other_values[unit], gap))
    if outlived:
        _, number, unit, value, gap = max(outlived)
        said.append(f"ends below trial {number} ({value:.4g} after chunk {unit + 1}), which it outlived{gap}")
    if not said:
        return None
    return (f"degraded after chunk {peak + 1}: " if peak != last else "degraded: ") + "; ".join(said)


def _collapsed(record: TrialRecord, metrics: Mapping[str, float] | None, baselines: Mapping[str, Baseline]) -> bool:
    """Whether `record`'s evaluation `metrics` found its completions collapsed (`collapse_reason`)."""
    if metrics is None:
        return False
    baseline = baselines.get(record.baseline_key) if record.baseline_key is not None else None
    return collapse_reason(metrics, None if baseline is None else baseline.metrics) is not None


def _beyond_noise(better: float, worse: float, better_unit: UnitMetrics | None, worse_unit: UnitMetrics | None,
                  objective: str, sign: float) -> str | None:
    """How `worse` falls short of `better` beyond the noise: ``, beyond the paired noise ±0.05 over 16 eval prompts``
    when both units stored their per-prompt scores (`rfopt.noise.gap`: prompt by prompt, as both scored the study's
    eval prompts), else ``, beyond the noise ±0.41 (unpaired: ...)`` from each value's spread over the prompts (empty
    where that is unknown too); None when it does not."""
    drop = sign * (better - worse)
    if drop <= 0:
        return None
    scores = [u.scores_of(objective) if u is not None else [] for u in (better_unit, worse_unit)]
    if all(scores):
        found = noise_of.gap(*scores)
        if found is not None and found.margin is not None:
            if not drop > found.margin:
                return None
            if found.paired:
                return f", beyond the paired noise ±{found.margin:.2g} over {found.n} eval prompts"
            return f", beyond the noise ±{found.margin:.2g} (unpaired: the two evaluations scored different prompts)"
    errors = [noise(u.eval, objective) if u is not None else None for u in (better_unit, worse_unit)]
    if any(e is None for e in errors):
        return ""
    margin = noise_of.Z * math.sqrt(sum(e * e for e in errors))  # type: ignore[operator]
    return (f", beyond the noise ±{margin:.2g} (unpaired: no per-prompt scores stored)" if drop > margin else None)


def _recommend(records: list[TrialRecord], baselines: Mapping[str, Baseline], maximize: bool, objective: str,
               look: bool, among: set[int] | None = None) -> tuple[Recommendation | None, tuple[MissingBest, ...]]:
    """The best kept checkpoint whose folder exists, and the better ones whose folder is gone (`look`: the store is on
    this machine; else every kept checkpoint is taken to exist). The next best kept checkpoint of another trial is its
    `Rival`, compared prompt by prompt. `among`: the trials to choose from (the winning config's runs across seeds);
    None: every trial."""
    sign = 1.0 if maximize else -1.0
    kept = [(r, r.best) for r in records if r.best is not None and math.isfinite(r.best.value)]
    kept.sort(key=lambda rb: (-sign * rb[1].value, rb[0].number))
    missing = []
    for record, best in kept:
        if among is not None and record.number not in among:
            continue
        if look and not is_url(best.location) and not Path(best.location).exists():
            missing.append(MissingBest(record.number, best.unit, best.value, str(best.location)))
            continue
        unit = next((m for m in record.unit_metrics() if m.unit == best.unit), None)
        key = record.baseline_key
        return (Recommendation(trial=record.number, unit=best.unit, value=best.value, location=best.location,
                               metrics={} if unit is None else unit.eval,
                               baseline=baselines.get(key) if key is not None else None,
                               rival=_rival(unit, [(r, b) for r, b in kept if r.number != record.number], objective)),
                tuple(missing))
    return None, tuple(missing)


def _rival(unit: UnitMetrics | None, others: list[tuple[TrialRecord, BestCheckpoint]], objective: str) -> Rival | None:
    """The next best of `others` (best first) against the recommended checkpoint's `unit`, prompt by prompt."""
    if unit is None or not others:
        return None
    other, theirs = others[0]
    other_unit = next((m for m in other.unit_metrics() if m.unit == theirs.unit), None)
    found = None if other_unit is None else noise_of.gap(unit.scores_of(objective), other_unit.scores_of(objective))
    return None if found is None else Rival(other.number, theirs.unit, theirs.value, found)


def _optuna_best(trials: Sequence[FrozenTrial], maximize: bool) -> tuple[int, float] | None:
    complete = [(t.values[0], t.number) for t in trials if t.state == TrialState.COMPLETE and t.values]
    if not complete:
        return None
    sign = 1.0 if maximize else -1.0
    value, number = max(complete, key=lambda vn: (sign * vn[0], -vn[1]))
    return number, value
