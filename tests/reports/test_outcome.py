"""The study's answer is the best model it produced: the recommendation (the best checkpoint over all trials, never a
collapsed one), the baseline beside every value, collapse and degradation flagged, on the leaderboard, in
``rfopt status``, the dashboard and the closing summary; Optuna's own best_trial unchanged beside it."""

from pathlib import Path

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial
from safetensors.torch import load_file

import rfopt
from rfopt.reports.display import format_recommendation
from rfopt.reports.outcome import outcome
from rfopt.storage import schema
from rfopt.storage.schema import Baseline, BestCheckpoint, TrialRecord
from rfopt_callbacks import CollapseAtTheEnd
from rfopt_testkit import lora_config, prompts_dataset, reward_agreement, reward_len, trial_config


# ---------------------------------------------------------------------- a trial that collapses, on the tiny model
@pytest.fixture(scope="module")
def collapsed_study(tiny_model, tmp_path_factory):
    """Trial 0 answers every eval prompt with one fixed string after its last chunk (`CollapseAtTheEnd`), which the
    reward (`reward_agreement`) scores highest; trial 1 trains the same way and does not collapse."""
    where = tmp_path_factory.mktemp("collapse")
    study = rfopt.create_study(study_name="collapse", storage=f"sqlite:///{where / 'c.db'}",
                               checkpoint_dir=where / "ck")
    collapsing = trial_config(tiny_model, rewards=(reward_agreement, reward_len),
                              peft=lora_config(modules_to_save=["embed_tokens"]))
    collapsing.callbacks = [CollapseAtTheEnd]
    steady = trial_config(tiny_model, rewards=(reward_agreement, reward_len))
    study.optimize([collapsing, steady], prompts_dataset(8), prompts_dataset(4, prefix="E"), num_chunks=2,
                   show_progress_bar=False)
    return study, where


def test_a_trial_whose_completions_no_longer_depend_on_the_prompt_is_marked_collapsed_and_never_recommended(
        collapsed_study, tmp_path):
    study, _ = collapsed_study
    collapsed, steady = study.trials
    assert collapsed.value == max(v for t in study.trials for v in t.intermediate_values.values())
    assert study.best_trial.number == 0  # Optuna's meaning is Optuna's: the best last value among COMPLETE trials

    (completions,) = {tuple(s["completion"] for s in TrialRecord(collapsed).samples()[1])}
    assert len(set(completions)) == 1 and len(completions) == 4
    found = outcome(study.optuna)
    assert found.trials[0].collapsed == "collapsed at chunk 2: one completion answers 4 of 4 eval prompts"
    assert found.trials[1].collapsed is None
    assert TrialRecord(collapsed).best.unit == 0  # the collapsed chunk, its best value, was not kept
    recommended = study.recommendation()
    assert (recommended.trial, recommended.unit) != (0, 1) and recommended.value < collapsed.value

    row = next(r for r in study.leaderboard() if r.number == 0)
    assert row.flags == [found.trials[0].collapsed]
    text = study.leaderboard_text()
    assert "collapsed at chunk 2: one completion answers 4 of 4 eval prompts" in text
    assert f"take this adapter: trial {recommended.trial} after chunk {recommended.unit + 1}" in text
    assert "Optuna's best_trial (the best last value among complete trials): trial 0" in text

    exported = study.export_best(tmp_path / "take")
    assert load_file(str(exported / "adapter_model.safetensors")).keys()
    assert Path(study.best_adapter()) == Path(recommended.location)
    final = study.export_best(tmp_path / "optuna", best_trial=True)
    assert Path(study.best_adapter(best_trial=True)) == Path(TrialRecord(collapsed).adapter)
    ours, optunas = (load_file(str(p / "adapter_model.safetensors")) for p in (exported, final))
    assert not all(torch.equal(ours[k], optunas[k]) for k in ours)


@pytest.mark.e2e
def test_the_opt_in_guard_prunes_a_collapsed_trial_with_the_reason(tiny_model, storage, tmp_path):
    collapsing = trial_config(tiny_model, rewards=(reward_agreement, reward_len),
                              peft=lora_config(modules_to_save=["embed_tokens"]))
    collapsing.callbacks = [CollapseAtTheEnd]
    study = rfopt.create_study(study_name="guarded", storage=storage, checkpoint_dir=tmp_path / "ck")
    study.optimize([collapsing], prompts_dataset(8), prompts_dataset(4, prefix="E"), num_chunks=2,
                   show_progress_bar=False, prune_collapsed=True)
    (trial,) = study.trials
    assert trial.state == TrialState.PRUNED and len(trial.intermediate_values) == 2
    row = study.leaderboard()[0]
    assert row.reason == "collapsed: one completion answers 4 of 4 eval prompts after chunk 2"
    assert study.recommendation().unit == 0 and study.best_adapter()


# ---------------------------------------------------------------------- degradation, on recorded values
def _eval(value, std=0.1, count=16):
    return {"reward": value, "reward_std": std, "completions/count": count, "diversity/prompts": count,
            "diversity/top_share": 1 / count, "diversity/top_tokens": 20}


def _add(study, values, state=TrialState.COMPLETE, std=0.1, best=None, key="k"):
    attrs = {schema.metrics_key(u): {"chunk": u, "eval": _eval(v, std)} for u, v in values.items()}
    attrs["rfopt:baseline_key"] = key
    if best is not None:
        attrs["rfopt:best"] = BestCheckpoint(best, best, values[best], f"/ck/trial/{best}").to_attr()
    study.add_trial(create_trial(state=state, value=values[max(values)] if state == TrialState.COMPLETE else None,
                                 params={"lr": 0.1}, distributions={"lr": FloatDistribution(0, 1)},
                                 intermediate_values=values, system_attrs=attrs))


@pytest.fixture
def recorded():
    study = optuna.create_study(direction="maximize")
    schema.write_settings(study, {"objective": "reward"})
    schema.write_baseline(study, Baseline("k", "smollm2", "reward", 1.0, _eval(1.0)))
    return study


def test_a_trial_that_falls_below_its_own_best_beyond_the_noise_says_so_with_the_chunk(recorded):
    _add(recorded, {0: 1.8, 1: 2.2, 2: 2.25, 3: 0.125}, best=2)
    _add(recorded, {0: 1.8, 1: 2.0, 2: 1.95, 3: 1.97}, best=1)  # within noise (±0.07): not degraded
    found = outcome(recorded)
    assert found.trials[0].degraded == ("degraded after chunk 3: reward 2.25 at chunk 3, 0.125 at chunk 4 (-2.125, "
                                        "beyond the noise ±0.071 (unpaired: no per-prompt scores stored))")
    assert found.trials[1].degraded is None
    assert found.trials[0].vs_baseline == pytest.approx(-0.875)
    assert (found.recommendation.trial, found.recommendation.unit, found.recommendation.value) == (0, 2, 2.25)
    assert found.optuna_best == (1, 1.97)


def test_a_survivor_that_ends_below_a_trial_it_outlived_says_so(recorded):
    _add(recorded, {0: 1.8, 1: 0.6, 2: 0.7, 3: 0.8}, best=0)
    _add(recorded, {0: 1.7, 1: 1.89}, state=TrialState.PRUNED, best=1)
    _add(recorded, {0: 0.5}, state=TrialState.PRUNED, best=0)
    degraded = outcome(recorded).trials[0].degraded
    assert degraded.startswith("degraded after chunk 1: reward 1.8 at chunk 1, 0.8 at chunk 4")
    assert degraded.endswith("; ends below trial 1 (1.89 after chunk 2), which it outlived, beyond the noise ±0.071 (unpaired: no per-prompt scores stored)")


def test_a_survivor_is_not_flagged_degraded_against_a_collapsed_trials_value(recorded):
    """Issue 41 item 12: the value a collapsed trial scored (one completion answering every prompt) is no bar a
    survivor fell below."""
    _add(recorded, {0: 1.8, 1: 1.85, 2: 1.9, 3: 1.9}, best=2)
    _add(recorded, {0: 1.7, 1: 2.6}, state=TrialState.PRUNED, best=0)
    collapsed = recorded.trials[1]
    attrs = {schema.metrics_key(1): {"chunk": 1, "eval": {**_eval(2.6), "diversity/top_share": 1.0}}}
    recorded.add_trial(create_trial(state=TrialState.PRUNED, params={"lr": 0.1},
                                    distributions={"lr": FloatDistribution(0, 1)},
                                    intermediate_values=collapsed.intermediate_values,
                                    system_attrs={**collapsed.system_attrs, **attrs}))
    found = outcome(recorded)
    assert found.trials[2].collapsed == "collapsed at chunk 2: one completion answers 16 of 16 eval prompts"
    # trial 1 scored 2.6 without collapsing
    assert found.trials[0].degraded == ("degraded after chunk 3: ends below trial 1 (2.6 after chunk 2), which it "
                                        "outlived, beyond the noise ±0.071 (unpaired: no per-prompt scores stored)")
    # The same study without trial 1: only the collapsed 2.6 is above trial 0.
    study = optuna.create_study(direction="maximize")
    schema.write_settings(study, {"objective": "reward"})
    schema.write_baseline(study, Baseline("k", "smollm2", "reward", 1.0, _eval(1.0)))
    study.add_trial(recorded.trials[0])
    study.add_trial(recorded.trials[2])
    found = outcome(study)
    assert found.trials[1].collapsed is not None and found.trials[0].degraded is None


def test_a_zero_spread_shows_as_zero():
    """Issue 41 item 12: eight scores of 0.1 have no spread; their mean's rounding printed as ``± 8.4e-17``."""
    from rfopt.noise import estimate

    assert estimate([0.1] * 8).stderr == 0.0
    assert estimate([0.1] * 8).text() == "0.1 ± 0 (8 prompts)"


def test_the_leaderboard_shows_the_baseline_row_each_difference_and_best_checkpoint(recorded):
    from rfopt.reports.display import format_leaderboard

    _add(recorded, {0: 1.8, 1: 2.25, 2: 0.125}, best=1)
    found = outcome(recorded)
    rows = [rfopt.LeaderboardRow(0, "COMPLETE", 0.125, 3, {"lr": 0.1}, vs_base=-0.875, best_value=2.25, best_chunk=2,
                                 flags=found.trials[0].flags)]
    lines = format_leaderboard(rows, "reward", list(found.baselines.values()), found.lines()).splitlines()
    assert lines[0].split() == ["#", "trial", "state", "reward", "vs", "base", "best", "(chunk)", "chunks", "params",
                                "note"]
    assert lines[2].split()[:4] == ["-", "base", "-", "1.0000"] and lines[2].endswith("smollm2 with no adapter: the "
                                                                                       "baseline")
    assert lines[3].split()[:7] == ["1", "0", "COMPLETE", "0.1250", "-0.8750", "2.2500", "(2)"]
    assert lines[-2] == "take this adapter: trial 0 after chunk 2, reward 2.2500 (+1.2500 over the base model, 1.0000): " \
                        "/ck/trial/1"


def test_two_baselines_of_one_model_say_what_each_is_for(recorded):
    """Issue 41 item 13: two baselines of one model (different reward lists) looked identical on the leaderboard."""
    from rfopt.reports.display import format_leaderboard

    both = {"rewards/correctness/mean": 0.5, "rewards/format/mean": 0.5}
    schema.write_baseline(recorded, Baseline("k2", "smollm2", "reward", 0.5, {**_eval(0.5), **both}))
    schema.write_baseline(recorded, Baseline("k", "smollm2", "reward", 1.0,
                                             {**_eval(1.0), "rewards/correctness/mean": 1.0}))
    _add(recorded, {0: 1.8}, best=0)
    _add(recorded, {0: 1.2}, best=0, key="k2")
    _add(recorded, {0: 1.1}, best=0, key="k2")
    found = outcome(recorded)
    assert found.baseline_purposes() == {"k": "for trial 0; rewards: correctness",
                                         "k2": "for trials 1, 2; rewards: correctness, format"}
    rows = [rfopt.LeaderboardRow(n, "COMPLETE", v, 1, {"lr": 0.1}) for n, v in ((0, 1.8), (1, 1.2), (2, 1.1))]
    text = format_leaderboard(rows, "reward", list(found.baselines.values()), found.lines(), found.baseline_purposes())
    assert "smollm2 with no adapter: the baseline (for trial 0; rewards: correctness)" in text
    assert "smollm2 with no adapter: the baseline (for trials 1, 2; rewards: correctness, format)" in text
    # One baseline per model needs no more words.
    alone = optuna.create_study(direction="maximize")
    schema.write_baseline(alone, Baseline("k", "smollm2", "reward", 1.0, _eval(1.0)))
    assert outcome(alone).baseline_purposes() == {}


def test_the_closing_summary_compares_with_the_baseline_and_prints_multi_line_completions_readably(recorded):
    _add(recorded, {0: 1.8, 1: 2.25}, best=1)
    found = outcome(recorded)
    sample = {"prompt": "How many?", "completion": "<reasoning>\n3 * 4 = 12\n</reasoning>\n<answer>\n12\n</answer>",
              "reward": 3.0, "correctness": 2.0}
    text = "\n".join(format_recommendation(found, [sample]))
    assert "it beats the base model with no adapter on reward: 2.2500 vs 1.0000 (+1.2500)" in text
    assert ("  completion: <reasoning>\n              3 * 4 = 12\n              </reasoning>\n              <answer>\n"
            "              12\n              </answer>\n  reward:     3 (correctness 2)") in text
    assert text.count("completion:") == 1


def test_the_closing_summary_counts_right_answers_beside_the_base_model_and_marks_a_right_and_a_typical_sample():
    import math

    from rfopt.reports.results import Recommendation, StudyOutcome

    def correctness(right, count=32, full=2.0):
        p = right / count
        return {"rewards/correctness/mean": p * full, "rewards/correctness/std": full * math.sqrt(p * (1 - p)),
                "rewards/soft_format/mean": 0.4, "rewards/soft_format/std": 0.2, "completions/count": float(count)}

    base = Baseline("k", "smollm2", "reward", 0.7, correctness(0))
    found = StudyOutcome("reward", True, {"k": base}, {}, Recommendation(3, 3, 2.2, "/ck/best", correctness(9), base),
                         None)
    wrong = [{"prompt": f"Q{i}", "completion": f"<answer>{i}</answer>", "reward": 0.5, "correctness": 0.0,
              "soft_format": 0.5} for i in range(3)]
    right = {"prompt": "Q9", "completion": "<answer>12</answer>", "reward": 2.5, "correctness": 2.0, "soft_format": 0.5}
    lines = format_recommendation(found, [*wrong, right])
    assert lines[1] == "it answers 9 of 32 eval questions right (the base model: 0), as the correctness reward judges them"
    text = "\n".join(lines)
    assert "(a right answer and a typical one; reward:" in text
    # The right answer first, then a typical one (most answers are wrong): each marked.
    assert [line for line in lines if line.startswith("  prompt:")] == ["  prompt:     Q9", "  prompt:     Q0"]
    assert "  reward:     2.5 (correctness 2, soft_format 0.5)  [RIGHT]" in lines
    assert "  reward:     0.5 (correctness 0, soft_format 0.5)  [WRONG]" in lines
    # No correctness reward (or one that is not 0-or-full): the plain samples, no count.
    plain = StudyOutcome("reward", True, {}, {}, Recommendation(3, 3, 2.2, "/ck/best", {"completions/count": 32.0,
                         "rewards/correctness/mean": 0.3, "rewards/correctness/std": 0.1}), None)
    said = format_recommendation(plain, wrong)
    assert not any("questions right" in line for line in said) and "[WRONG]" not in "\n".join(said)


def test_rfopt_status_and_the_dashboard_index_show_the_baseline_and_the_adapter_to_take(recorded):
    from rfopt.dashboard.pages import render_index
    from rfopt.reports.status import summaries

    _add(recorded, {0: 1.8, 1: 2.25, 2: 0.5}, best=1)
    (summary,) = summaries(recorded._storage)
    assert "; best 0.5000 (trial 0); base 1.0000; take trial 0 after chunk 2 (2.2500); " in summary.line()
    assert "<td>2.25 (trial 0 after chunk 2)</td><td>1</td>" in render_index([summary])


def test_the_study_page_shows_the_baseline_row_the_recommendation_and_each_trials_warnings(recorded):
    from rfopt.dashboard.pages import study_page
    from rfopt.reports.status import liveness

    _add(recorded, {0: 1.8, 1: 2.25, 2: 0.125}, best=1)
    trials = recorded.get_trials()
    page = study_page(recorded, trials, liveness(recorded, trials), "v1")
    board = page.parts["leaderboard"]
    assert "<p class='recommendation'>take this adapter: trial 0 after chunk 2, reward 2.2500" in board
    assert "<tfoot><tr class='baseline' data-baseline='k'><td><b>base model</b></td><td>no adapter</td><td>1</td>" in board
    assert "<span class='warn'>degraded after chunk 2: reward 2.25 at chunk 2, 0.125 at chunk 3" in board
    assert "2.25 <span class='hint'>after chunk 2</span>" in board and ">-0.875<" in board
    objective = next(f for f in page.figures if f["key"] == "objective")
    assert [t["y"] for t in objective["data"] if t["meta"].get("role") == "baseline"] == [[1.0, 1.0]]


# ---------------------------------------------------------------------- a recommended best/ deleted by hand
def test_a_deleted_recommended_best_is_marked_missing_and_the_next_that_exists_is_named(tiny_model, tmp_path,
                                                                                         caplog):
    """Issue 41 item 15: a deleted recommended ``best/`` was still recommended everywhere (leaderboard, outcome,
    status), and export_best then failed."""
    import shutil

    from rfopt.compat import storage_of
    from rfopt.reports.status import summaries
    from stored_study import stored_study

    storage = f"sqlite:///{tmp_path / 's.db'}"
    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-3)]
    train, test = prompts_dataset(8), prompts_dataset(2, "E")
    study = stored_study(storage, "s", configs, train, test, values={0: [0.9, 0.4], 1: [0.5, 0.7]})
    gone = study.recommendation()
    assert (gone.trial, gone.unit) == (0, 0)
    shutil.rmtree(gone.location)

    found = study.outcome()
    assert (found.recommendation.trial, found.recommendation.unit) == (1, 1)
    missing = f"missing: trial 0's best checkpoint (after chunk 1, reward 0.9000) is gone from {gone.location}"
    assert found.lines()[:3] == [missing, "its folder was deleted; the best checkpoint that exists is recommended "
                                          "instead", found.recommendation.line("reward")]
    assert missing in study.leaderboard_text()  # the page shows the same lines under its leaderboard
    (summary,) = summaries(storage_of(study.optuna))
    assert summary.recommended == (1, 2, 0.7)
    assert Path(study.export_best(tmp_path / "take")).is_dir()
    with caplog.at_level("WARNING", logger="rfopt"):
        study.optimize(configs, train, test, num_chunks=2, show_progress_bar=False)
    assert any(r.getMessage().startswith(f"study 's': {missing}; the recommendation is now trial 1 after chunk 2")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
