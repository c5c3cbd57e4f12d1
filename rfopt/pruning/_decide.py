"""decide(): judge trials at a rung boundary, once per (trial, step), from storage alone."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import optuna
from optuna.pruners import (
    BasePruner,
    HyperbandPruner,
    MedianPruner,
    NopPruner,
    PatientPruner,
    PercentilePruner,
    SuccessiveHalvingPruner,
    ThresholdPruner,
    WilcoxonPruner,
)
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt import noise
from rfopt.compat import patience_gate, percentile_helpers, pruner_settings
from rfopt.errors import PrunerFailed, Refusal, StaleRead
from rfopt.storage.schema import PruneDecision, TrialRecord, TrialRef, load_decision, study_record, write_decision

from ._halving import Brackets, successive_halving
from ._view import StepView, cut_at, step_view


def decide(
    study: optuna.Study,
    trial_numbers: Sequence[int],
    step: int,
    pruner: BasePruner,
    *,
    n_steps: int,
) -> list[PruneDecision]:
    """Decide, once and for all, whether each trial stops after the chunk of ``step``.

    Call it at a rung boundary: when every trial to be compared at ``step`` has reported it.
    Each decision is stored on its trial (user attr ``rfopt:pruning:<step>``) before it is
    returned; asking again returns the stored decision and does not run the pruner. The caller
    stops the pruned trials (``study.tell(number, state=TrialState.PRUNED)``) after this returns.

    Args:
        study: the Optuna study; everything is read from its storage.
        trial_numbers: trials to judge; each must have reported ``step``. Unfinished trials are
            decided; finished ones must already have a stored decision for ``step``.
        step: the step (chunk index) being judged.
        pruner: the user's pruner, unmodified; see the package docstring for what each pruner
            compares against under rfopt.
        n_steps: chunks in the plan; sets ``"auto"`` resources and the end of the budget.

    Returns:
        One decision per entry of ``trial_numbers``, in that order.

    Raises:
        StaleRead: a trial ended in another process since it was read (it is finished with no decision stored for
            ``step``, or it ended before its decision was written): read the study again and decide then.
        PrunerFailed: the pruner raised judging a trial (``trial_number``; the pruner's exception is its cause).
        ValueError: a call that can never be decided (a step outside the plan, a trial that has not reported it).

    Example::

        # every live trial has reported step 2
        for d in decide(study, live, step=2, pruner=study.pruner, n_steps=8):
            if d.prune:
                study.tell(d.trial_number, state=optuna.trial.TrialState.PRUNED)
    """
    _check_study_and_step(study, step, n_steps)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    stored = {n: _stored_or_check(study, trials, n, step) for n in trial_numbers}

    reached = {
        n: t
        for n, t in trials.items()
        if t.state != TrialState.FAIL and step in t.intermediate_values
    }
    at = _Step(study, step, n_steps, reached)
    decided = {n: d for n, d in stored.items() if d is not None}
    verdicts: dict[int, _Verdict] = {}
    failed: PrunerFailed | None = None
    for number in trial_numbers:
        if number in decided or number in verdicts:  # stored earlier, or listed twice
            continue
        replicate = TrialRecord(trials[number]).replicate
        if replicate is not None and not replicate.prune:  # a config's runs across seeds go to their end
            verdicts[number] = _Verdict(False, f"kept: a replicate of trial {replicate.of} (seed {replicate.seed}) "
                                               "runs to its end, never pruned (study.confirm)")
            continue
        try:
            verdicts[number] = _judge(pruner, at, trials[number])
        except PrunerFailed as exc:  # the trials judged before it keep their decisions
            failed = exc
            break
    for number, verdict in verdicts.items():
        note = _noise_note(at, number, verdict, verdicts) if verdict.prune else None
        decision = PruneDecision(
            trial_number=number,
            step=step,
            prune=verdict.prune,
            reason=verdict.reason + (note or ""),
            peers=verdict.peers,
            pruner=type(pruner).__name__,
        )
        try:
            write_decision(TrialRef.of(study, trials[number]), decision)
        except optuna.exceptions.UpdateFinishedTrialError as e:
            raise StaleRead(f"trial {number} ended in another process while step {step} was being decided") from e
        decided[number] = decision
    if failed is not None:
        raise failed
    return [decided[n] for n in trial_numbers]


def _noise_note(at: _Step, number: int, verdict: _Verdict, verdicts: Mapping[int, _Verdict]) -> str | None:
    """`` (within noise of trial 3, the weakest kept: gap 0.005 ± 0.031 over 8 eval prompts)`` when the pruned trial's
    value at the step is within noise (`rfopt.noise`) of the weakest peer kept there; None otherwise, or when the
    units store no per-prompt scores."""
    objective = study_record(at.study).objective
    kept = []
    for peer in verdict.peers:
        trial = at.reached.get(peer)
        if trial is None:
            continue
        decision = verdicts.get(peer) or load_decision(trial, at.step)
        if decision is None or not decision.prune:
            kept.append(peer)
    if not kept:
        return None
    sign = 1.0 if at.direction == StudyDirection.MAXIMIZE else -1.0
    values = at.values()
    weakest = min(kept, key=lambda n: (sign * values[n], -n))
    scores = {n: next((m.scores_of(objective) for m in TrialRecord(at.reached[n]).unit_metrics() if m.unit == at.step),
                      []) for n in (number, weakest)}
    found = noise.gap(scores[weakest], scores[number])
    if found is None or not found.within_noise:
        return None
    return f" (within noise of trial {weakest}, the weakest kept: {found.text()})"


def _check_study_and_step(study: optuna.Study, step: int, n_steps: int) -> None:
    if len(study.directions) != 1:
        raise Refusal(
            f"study {study.study_name!r} has {len(study.directions)} objectives; Optuna pruners "
            "judge single-objective studies only."
        )
    if n_steps < 1:
        raise Refusal(f"n_steps={n_steps}: a chunk plan has at least one chunk.")
    if not 0 <= step < n_steps:
        raise Refusal(f"step={step} is outside the chunk plan: steps run 0..{n_steps - 1}.")


def _stored_or_check(
    study: optuna.Study, trials: dict[int, FrozenTrial], number: int, step: int
) -> PruneDecision | None:
    """The stored decision, or None after checking that the trial can be decided now."""
    trial = trials.get(number)
    if trial is None:
        raise Refusal(f"trial {number}: no such trial in study {study.study_name!r}.")
    decision = load_decision(trial, step)
    if decision is not None:
        return decision
    if step not in trial.intermediate_values:
        raise Refusal(
            f"trial {number} has not reported step {step}; decide only once it has "
            f"(its last reported step is {trial.last_step})."
        )
    if trial.state.is_finished():  # told elsewhere (a stop, a failure) since the caller read it
        raise StaleRead(
            f"trial {number} is {trial.state.name} with no decision stored for step {step}; "
            "decide before telling the trial's final state."
        )
    return None


@dataclass(frozen=True)
class _Step:
    """One read of storage at one step: what every verdict at that step is based on."""

    study: optuna.Study
    step: int
    n_steps: int
    #: Every trial (any state but FAIL) with a value at ``step``, by number.
    reached: dict[int, FrozenTrial]

    @property
    def direction(self) -> StudyDirection:
        return self.study.direction

    def values(self, numbers: Callable[[int], bool] = lambda n: True) -> dict[int, float]:
        return {n: t.intermediate_values[self.step] for n, t in self.reached.items() if numbers(n)}

    @functools.cached_property
    def as_complete(self) -> dict[int, FrozenTrial]:
        """Every trial that reached the step, as a COMPLETE trial with its value there."""
        return {n: cut_at(t, self.step, TrialState.COMPLETE) for n, t in self.reached.items()}

    def view(self, trial: FrozenTrial, pruner: BasePruner) -> tuple[StepView, FrozenTrial]:
        return step_view(self.study, trial, self.as_complete, self.step, pruner)


@dataclass(frozen=True)
class _Verdict:
    prune: bool
    reason: str
    peers: tuple[int, ...] = ()


def _judge(pruner: BasePruner, at: _Step, trial: FrozenTrial) -> _Verdict:
    # Halving pruners keep their state in storage and depend on arrival order, so their
    # parameters drive rfopt's synchronous version instead of their prune().
    if isinstance(pruner, HyperbandPruner):
        return _judge_hyperband(pruner, at, trial)
    if isinstance(pruner, SuccessiveHalvingPruner):
        prune, reason, peers = successive_halving(pruner, at.n_steps).judge(
            trial.number, at.values(), at.step, at.n_steps, at.direction
        )
        return _Verdict(prune, reason, peers)
    if isinstance(pruner, PatientPruner):
        return _judge_patient(pruner, at, trial)
    return _judge_by_view(pruner, at, trial)


def _judge_hyperband(pruner: HyperbandPruner, at: _Step, trial: FrozenTrial) -> _Verdict:
    brackets = Brackets.of(pruner, at.study.study_name, at.n_steps)
    bracket = brackets.index_of(trial.number)
    values = at.values(lambda n: brackets.index_of(n) == bracket)
    prune, reason, peers = brackets.halving(bracket).judge(
        trial.number, values, at.step, at.n_steps, at.direction
    )
    where = f" [bracket {bracket} of {len(brackets.budgets)}]"
    return _Verdict(prune, reason + where, peers)


def _judge_patient(pruner: PatientPruner, at: _Step, trial: FrozenTrial) -> _Verdict:
    # Optuna's own patience test, on the trial's history up to the step: the wrapped pruner is
    # consulted only when it says "stalled", and then with rfopt's semantics for that pruner.
    settings = pruner_settings(pruner)
    view, running = at.view(trial, pruner)
    stalled = patience_gate(pruner).prune(view, running)
    patience, min_delta = settings['patience'], settings['min_delta']
    if not stalled:
        n_values = len(running.intermediate_values)
        if n_values <= patience + 1:
            return _Verdict(
                False,
                f"kept: {_count(n_values, 'value')} up to chunk {at.step + 1}; "
                f"patience={patience} needs at least {patience + 2}",
            )
        return _Verdict(
            False,
            f"kept: improved within the last {patience + 1} chunks "
            f"(patience={patience}, min_delta={min_delta:g})",
        )
    stall = (
        f"no improvement in the last {patience + 1} chunks "
        f"(patience={patience}, min_delta={min_delta:g})"
    )
    inner = settings['wrapped_pruner']
    if inner is None:
        return _Verdict(True, stall)
    verdict = _judge(inner, at, trial)
    prefix = "" if verdict.prune else "kept: "
    return _Verdict(
        verdict.prune, f"{prefix}{stall}; {type(inner).__name__}: {verdict.reason}", verdict.peers
    )


def _judge_by_view(pruner: BasePruner, at: _Step, trial: FrozenTrial) -> _Verdict:
    """Ask the pruner itself, on the study as of this step (peers COMPLETE at their step value)."""
    view, running = at.view(trial, pruner)
    name = type(pruner).__name__
    try:
        prune = bool(pruner.prune(view, running))
    except ImportError as e:
        raise PrunerFailed(
            f"trial {trial.number}, step {at.step}: {name}.prune needs a package that is not "
            f"installed ({e}). Install it (WilcoxonPruner needs scipy) or use another pruner.",
            trial.number, at.step,
        ) from e
    except Exception as e:  # the user's pruner (or Optuna's): its trial fails with it, as should_prune() would
        raise PrunerFailed(
            f"trial {trial.number}, step {at.step}: {name}.prune raised {type(e).__name__}: {e}",
            trial.number, at.step,
        ) from e
    peers = tuple(t.number for t in view.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    explain = _EXPLAIN.get(type(pruner))  # exact types only: a subclass may decide differently
    reason = explain(pruner, view, running, prune) if explain else None
    if reason is None:
        verb = "pruned" if prune else "kept"
        reason = (
            f"{'' if prune else 'kept: '}{name}.prune {verb} it, given "
            f"{_count(len(peers), 'peer')} at chunk {at.step + 1} as COMPLETE trials"
        )
    if type(pruner) in (ThresholdPruner, NopPruner):
        peers = ()  # they look at the trial's own values only
    return _Verdict(prune, reason, peers)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# Explanations: human text for a verdict the pruner itself returned. Each returns None when its
# own reading of the pruner disagrees with the verdict, so the text never contradicts it.


def _check_schedule(step: int, trial: FrozenTrial, warmup: int, interval: int) -> str | None:
    if step < warmup:
        return f"kept: chunk {step + 1} is in warmup (n_warmup_steps={warmup})"
    if not percentile_helpers()[2](step, trial.intermediate_values.keys(), warmup, interval):
        return (
            f"kept: chunk {step + 1} is not a check step "
            f"(n_warmup_steps={warmup}, interval_steps={interval})"
        )
    return None


def _explain_percentile(
    pruner: PercentilePruner, view: StepView, trial: FrozenTrial, prune: bool
) -> str | None:
    settings = pruner_settings(pruner)
    step = trial.last_step
    assert step is not None
    peers = view.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    n = len(peers)
    if n == 0 or n < settings['n_startup_trials']:
        implied, text = False, (
            f"kept: {_count(n, 'peer')} reached chunk {step + 1}; "
            f"n_startup_trials={settings['n_startup_trials']} needs that many"
        )
    elif (schedule := _check_schedule(
        step, trial, settings['n_warmup_steps'], settings['interval_steps']
    )) is not None:
        implied, text = False, schedule
    else:
        direction = view.direction
        best_over_steps, percentile_over_trials, _ = percentile_helpers()
        best = best_over_steps(trial, direction)
        cut = percentile_over_trials(
            peers, direction, step, settings['percentile'], settings['n_min_trials']
        )
        pct = settings['percentile']
        name = "the median" if pct == 50.0 else f"the top-{pct:g}% cut"
        worse = "below" if direction == StudyDirection.MAXIMIZE else "above"
        if math.isnan(best):
            implied, text = True, f"every value up to chunk {step + 1} is NaN"
        elif math.isnan(cut):
            implied, text = False, (
                f"kept: too few peer values at chunk {step + 1} to compare with "
                f"(n_min_trials={settings['n_min_trials']}; NaN values are ignored)"
            )
        else:
            implied = best < cut if direction == StudyDirection.MAXIMIZE else best > cut
            comparison = f"is {worse}" if implied else f"is not {worse}"
            text = (
                f"{'' if implied else 'kept: '}best value {best:.4g} up to chunk {step + 1} "
                f"{comparison} {name} {cut:.4g} of {_count(n, 'peer')} at chunk {step + 1}"
            )
    return text if implied == prune else None


def _explain_threshold(
    pruner: ThresholdPruner, view: StepView, trial: FrozenTrial, prune: bool
) -> str | None:
    settings = pruner_settings(pruner)
    step = trial.last_step
    assert step is not None
    schedule = _check_schedule(step, trial, settings['n_warmup_steps'], settings['interval_steps'])
    value = trial.intermediate_values[step]
    if schedule is not None:
        implied, text = False, schedule
    elif math.isnan(value):
        implied, text = True, f"value at chunk {step + 1} is NaN"
    elif value < settings['lower']:
        implied, text = True, f"value {value:.4g} at chunk {step + 1} is below lower={settings['lower']:g}"
    elif value > settings['upper']:
        implied, text = True, f"value {value:.4g} at chunk {step + 1} is above upper={settings['upper']:g}"
    else:
        implied, text = False, (
            f"kept: value {value:.4g} at chunk {step + 1} is within "
            f"[{settings['lower']:g}, {settings['upper']:g}]"
        )
    return text if implied == prune else None


def _explain_nop(pruner: NopPruner, view: StepView, trial: FrozenTrial, prune: bool) -> str | None:
    return None if prune else "kept: NopPruner never prunes"


def _explain_wilcoxon(
    pruner: WilcoxonPruner, view: StepView, trial: FrozenTrial, prune: bool
) -> str | None:
    settings = pruner_settings(pruner)
    step = trial.last_step
    try:
        best = view.best_trial.number
    except ValueError:
        return None if prune else f"kept: no peer reached chunk {step + 1}"
    against = f"chunks 1..{step + 1} of trial {best}, the best peer at chunk {step + 1}"
    if prune:
        return f"worse than {against} (Wilcoxon p < {settings['p_threshold']:g})"
    return (
        f"kept: not shown worse than {against} (p_threshold={settings['p_threshold']:g}, "
        f"n_startup_steps={settings['n_startup_steps']})"
    )


_EXPLAIN: dict[type, Callable[..., str | None]] = {
    MedianPruner: _explain_percentile,
    PercentilePruner: _explain_percentile,
    ThresholdPruner: _explain_threshold,
    NopPruner: _explain_nop,
    WilcoxonPruner: _explain_wilcoxon,
}
