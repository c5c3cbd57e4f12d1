"""Noise made visible: every value with its eval count and standard error, from the per-prompt scores each unit stores;
a leader within noise of the runner-up marked as a tie; a pruning decision within noise saying so."""

from __future__ import annotations

import math

import optuna
import pytest

from rfopt import noise
from rfopt.config.settings import EvalSettings
from rfopt.pruning import decide
from rfopt.reports.lead import lead
from rfopt.storage import schema
from rfopt.storage.database import open_storage
from rfopt.storage.schema import TrialRecord
from rfopt.training.evaluation import EvalPrompts, scored


class _Tokenizer:
    all_special_ids: list[int] = []  # read by the eval's diversity measures (`rfopt.training.diversity`)

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def _length(completions, **kwargs):
    return [len(c) / 4 for c in completions]


def _none_for_long(completions, **kwargs):
    return [None if len(c) > 3 else 1.0 for c in completions]


def test_the_eval_keeps_each_prompts_score_and_the_value_is_their_mean():
    prompts = EvalPrompts(["a", "b", "c", "d"], ["a", "b", "c", "d"], {})
    result = scored(prompts, [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]], _Tokenizer(), [_length, _none_for_long], [1.0, 2.0],
                    EvalSettings())
    assert result.scores["_length"] == [0.25, 0.5, 0.75, 1.0]
    assert result.scores["_none_for_long"][:3] == [1.0, 1.0, 1.0] and math.isnan(result.scores["_none_for_long"][3])
    assert result.scores["reward"] == [2.25, 2.5, 2.75, 1.0]  # the weighted total, per prompt
    assert noise.estimate(result.scores["reward"]).mean == pytest.approx(result.metrics["reward"])
    assert noise.estimate(result.scores["_length"]).mean == pytest.approx(result.metrics["rewards/_length/mean"])


def test_a_values_standard_error_and_eval_count():
    found = noise.estimate([0.0, 1.0, 1.0, 0.0, float("nan")])
    assert (found.mean, found.n) == (0.5, 4) and found.stderr == pytest.approx(math.sqrt(1 / 3 / 4))
    assert found.text() == "0.5 ± 0.29 (4 prompts)"
    assert noise.estimate([0.3]).stderr is None and noise.estimate([]) is None


def test_trials_that_score_alike_on_every_prompt_tie_and_a_consistent_gap_does_not():
    same = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    tie = noise.gap(same, list(same))
    assert tie.difference == 0 and tie.paired and tie.within_noise  # the "winner" and its twin
    better = [s + 0.2 for s in same]
    assert not noise.gap(better, same).within_noise  # 0.2 higher on every prompt: more than noise
    assert noise.gap([1, 0, 1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0]).within_noise  # one prompt of eight


def _study(storage, scores_by_trial, step=0):
    """A study whose trials reported `step` with values the means of their per-prompt scores."""
    study = optuna.create_study(study_name="n", storage=open_storage(storage), direction="maximize")
    for scores in scores_by_trial:
        trial = study.ask()
        ref = schema.TrialRef.of(study, trial)
        schema.write_unit(ref, step, {"chunk": step, "eval": {"reward": sum(scores) / len(scores)},
                                      "scores": {"reward": scores}}, [])
        trial.report(sum(scores) / len(scores), step=step)
    return study


def test_a_pruning_decision_within_noise_says_so_in_its_reason(storage):
    base = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    study = _study(storage, [[s + 0.5 for s in base], [s + 0.5 for s in base], base[:7] + [0.04], base])
    decisions = decide(study, [0, 1, 2, 3], 0, optuna.pruners.SuccessiveHalvingPruner(min_resource=1,
                                                                                     reduction_factor=2), n_steps=4)
    kept, pruned = [d for d in decisions if not d.prune], [d for d in decisions if d.prune]
    assert [d.trial_number for d in kept] == [0, 1] and [d.trial_number for d in pruned] == [2, 3]
    # Trials 2 and 3 are 0.5 below the kept ones on every prompt: pruned on more than noise, and said plainly.
    assert all("within noise" not in d.reason for d in decisions)


def test_a_pruning_decision_on_a_gap_within_noise_names_the_kept_trial_it_could_swap_with(storage):
    base = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    # Trial 1 edges out trial 2 by one prompt's 0.04 (0.005 in the mean), as the issue saw trials pruned.
    study = _study(storage, [[s + 0.5 for s in base], base[:7] + [0.04], base, [s - 0.3 for s in base]])
    decisions = decide(study, [0, 1, 2, 3], 0, optuna.pruners.SuccessiveHalvingPruner(min_resource=1,
                                                                                     reduction_factor=2), n_steps=4)
    by_trial = {d.trial_number: d for d in decisions}
    assert by_trial[2].prune and by_trial[2].reason.startswith("rank 3 of 4")
    assert "(within noise of trial 1, the weakest kept: paired gap 0.005 ± 0.005 over 8 eval prompts)" in by_trial[2].reason
    assert by_trial[3].prune and "within noise" not in by_trial[3].reason


def test_a_leader_within_noise_of_the_runner_up_is_a_tie(storage):
    base = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    study = _study(storage, [base, list(base), [s - 0.3 for s in base]])
    trials = study.get_trials()
    found = lead(trials, study.direction, "reward")
    assert (found.best, found.runner_up, found.tie) == (0, 1, True)
    assert found.text() == "tie: within noise of trial 1 (paired gap 0 ± 0 over 8 eval prompts)"
    clear = lead(_study(storage.replace("study.db", "b.db"), [[s + 0.5 for s in base], base]).get_trials(),
                 study.direction, "reward")
    assert not clear.tie and clear.text().startswith("ahead of trial 1 by more than noise")


def test_the_page_and_the_leaderboard_text_show_each_value_with_its_standard_error(storage):
    from rfopt.dashboard.leaderboard import _render_leaderboard
    from rfopt.dashboard.views import trial_views

    base = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    study = _study(storage, [base, list(base)])
    views = trial_views(study.get_trials(), study)
    assert views[0].value_text() == "0.3 ± 0.12 (8 prompts)"
    html = _render_leaderboard(views, 0, "leading", study.direction, lead(study.get_trials(), study.direction))
    assert "± 0.12 (n=8)" in html and "<span class='tie'" in html and "tie with trial 1" in html
    assert TrialRecord(study.get_trials()[0]).unit_metrics()[0].scores_of("reward") == base


# ---------------------------------------------------------------------- paired comparisons
def test_a_paired_gap_is_the_mean_and_standard_error_of_the_per_prompt_differences():
    import numpy as np

    a = [0.9, 0.1, 0.7, 0.4, 0.0, 1.0, 0.55, 0.3, 0.8, 0.2]
    b = [0.7, 0.2, 0.5, 0.5, 0.1, 0.8, 0.35, 0.3, 0.6, 0.1]
    found = noise.gap(a, b)
    diffs = np.array(a) - np.array(b)
    assert found.paired and found.n == 10
    assert found.difference == pytest.approx(diffs.mean())
    assert found.stderr == pytest.approx(diffs.std(ddof=1) / np.sqrt(len(diffs)))
    assert found.margin == pytest.approx(noise.Z * found.stderr)
    assert found.text() == f"paired gap {diffs.mean():.3g} ± {found.stderr:.2g} over 10 eval prompts"
    # A prompt either trial left unscored (NaN) is left out of the pairs.
    with_gap = noise.gap(a + [float("nan")], b + [0.5])
    assert with_gap.n == 10 and with_gap.difference == pytest.approx(found.difference)


def test_prompts_hard_for_both_trials_make_an_unpaired_tie_that_the_paired_gap_tells_apart():
    # Prompts differ a lot in difficulty, and trial A scores 0.05 above trial B on every one of them.
    b = [0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.05, 0.95, 0.3, 0.6, 0.15, 0.85]
    a = [x + 0.05 for x in b]
    ea, eb = noise.estimate(a), noise.estimate(b)
    unpaired_stderr = math.hypot(ea.stderr, eb.stderr)
    assert abs(ea.mean - eb.mean) <= noise.Z * unpaired_stderr  # two independent means: "within noise", a tie
    found = noise.gap(a, b)
    assert found.paired and not found.within_noise and found.difference == pytest.approx(0.05)


def test_evaluations_of_different_prompts_fall_back_to_an_unpaired_gap_and_say_so():
    found = noise.gap([1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0])
    ea, eb = noise.estimate([1.0, 0.0, 1.0, 1.0]), noise.estimate([0.0, 1.0, 0.0])
    assert not found.paired and found.stderr == pytest.approx(math.hypot(ea.stderr, eb.stderr))
    assert found.text().startswith("unpaired gap") and "different prompts" in found.text()


def test_degradation_is_judged_on_the_paired_gap_of_the_two_evaluations(storage):
    from rfopt.reports.outcome import outcome

    base = [0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.05, 0.95, 0.3, 0.6, 0.15, 0.85]
    study = optuna.create_study(study_name="d", storage=open_storage(storage), direction="maximize")
    schema.write_settings(study, {"objective": "reward"})
    trial = study.ask()
    ref = schema.TrialRef.of(study, trial)
    for unit, scores in enumerate([[x + 0.05 for x in base], base]):  # 0.05 lower on every prompt at chunk 2
        mean = sum(scores) / len(scores)
        std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
        schema.write_unit(ref, unit, {"chunk": unit, "eval": {"reward": mean, "reward_std": std,
                                                               "completions/count": len(scores)},
                                      "scores": {"reward": scores}}, [])
        trial.report(mean, step=unit)
    degraded = outcome(study).trials[0].degraded
    ea, eb = noise.estimate([x + 0.05 for x in base]), noise.estimate(base)
    assert 0.05 <= noise.Z * math.hypot(ea.stderr, eb.stderr)  # unpaired, this drop would be noise
    assert degraded is not None and "beyond the paired noise ±" in degraded and "over 12 eval prompts" in degraded


def test_the_recommendation_says_whether_it_leads_the_next_best_checkpoint_beyond_paired_noise(storage):
    from rfopt.reports.outcome import outcome

    base = [0.3, 0.0, 1.0, 0.2, 0.0, 0.3, 0.6, 0.0]
    study = _study(storage, [base, base[:7] + [0.04], [s - 0.3 for s in base]])
    for trial in study.get_trials():
        scores = TrialRecord(trial).unit_metrics()[0].scores_of("reward")
        schema.TrialRef.of(study, trial).set("rfopt:best", schema.BestCheckpoint(0, 0, sum(scores) / 8,
                                                                                 f"/ck/{trial.number}").to_attr())
    found = outcome(study)
    assert (found.recommendation.trial, found.recommendation.rival.trial) == (1, 0)
    expected = noise.gap(base[:7] + [0.04], base)
    assert found.recommendation.rival.gap == expected and expected.within_noise
    assert found.lines()[1] == ("the adapter to take is within noise of trial 0's best checkpoint (chunk 1, reward "
                                f"0.3): {expected.text()}; either could lead on other eval prompts (what would decide: more eval "
                                "prompts (4x the prompts halve the noise), or a confirmation run, `rfopt confirm` / "
                                "study.confirm(), training the finalists again with new seeds)")
