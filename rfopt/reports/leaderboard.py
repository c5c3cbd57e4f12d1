"""The study's leaderboard: every trial as a `LeaderboardRow` (`rfopt.reports.results`), best first, built in this one
place for ``Study.leaderboard()``, ``Study.leaderboard_text()`` and ``rfopt status``.

    >>> rows = leaderboard(study.optuna)                                             # doctest: +SKIP
    >>> rows[0].number, rows[0].value, rows[0].situation                             # doctest: +SKIP
    (3, 1.25, 'complete')

Its order is `TrialRecord.leaderboard_rank` (the trackers' leaderboard ranks by it too): complete, running, pruned,
failed, then the rest; within a state by value, best first.
"""

from __future__ import annotations

from collections.abc import Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.config.params import field_path, param_name
from rfopt.noise import estimate
from rfopt.reports.outcome import outcome
from rfopt.reports.results import LeaderboardRow, StudyOutcome
from rfopt.reports.status import liveness, situation
from rfopt.storage.schema import TrialRecord, study_record


def leaderboard(study: optuna.Study, trials: Sequence[FrozenTrial] | None = None,
                found: StudyOutcome | None = None) -> list[LeaderboardRow]:
    """Every trial of `study` but the waiting ones, best first: what it is doing, its value's noise, its difference from
    its baseline, its best checkpoint and what went wrong (`rfopt.reports.outcome`). `trials`, `found`: the study's
    trials and outcome where the caller has read them."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    found = outcome(study, trials) if found is None else found
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    objective = study_record(study).objective
    live = liveness(study, list(trials))
    rows, ranks = [], {}
    for t in trials:
        if t.state == TrialState.WAITING:
            continue
        record = TrialRecord(t)
        ranks[t.number] = record.leaderboard_rank(maximize)
        last = max(t.intermediate_values, default=None)
        scores = next((m.scores_of(objective) for m in record.unit_metrics() if m.unit == last), [])
        noise = estimate(scores) if scores else None
        judged = found.trials[t.number]
        rows.append(
            LeaderboardRow(
                number=t.number,
                state=record.shown_state,
                value=record.value,
                chunks_done=record.committed,  # a warm clone's count includes the units it inherited
                params=dict(t.params),
                adapter=record.adapter,
                reason=record.end_reason,
                held_as=held_as(t),
                situation=situation(record, live),
                value_error=None if noise is None else noise.stderr,
                eval_count=None if noise is None else noise.n,
                vs_base=None if judged.baseline is None or record.value is None
                else record.value - judged.baseline.value,
                best_value=None if judged.best is None else judged.best.value,
                best_chunk=None if judged.best is None else judged.best.unit + 1,
                flags=judged.flags,
            )
        )
    rows.sort(key=lambda r: ranks[r.number])
    return rows


def held_as(trial: FrozenTrial) -> dict[str, str]:
    """For a clone whose overridden values Optuna's params hold under an alternate name (a clone's own choice of a
    categorical its parent's distribution lacks: `rfopt.config.params.param_holding`): the field's param name -> the
    param that holds it (``{"model": "model#2"}``); empty for any other trial."""
    lineage = TrialRecord(trial).lineage
    if lineage is None:
        return {}
    found = {}
    for given in lineage.overrides:
        path = field_path(given)
        name = path if path in trial.params else param_name(path)
        if name in trial.params:
            continue
        holder = next((p for p in trial.params
                       if p.startswith(f"{name}#") and p[len(name) + 1:].isdigit()), None)
        if holder is not None:
            found[name] = holder
    return found
