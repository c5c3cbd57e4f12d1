"""A base-model baseline: the study evaluates its base model once, with no adapter, on the same eval set and settings,
before any trial trains; every trial names the baseline it compares with; a crash and a rerun keep it."""

import optuna
import pytest

import rfopt
from crashkit import env, run, run_command, trials
from rfopt.config.settings import EvalSettings
from rfopt.engine.outputs import baselines
from rfopt.storage.schema import TrialRecord, study_record
from rfopt_testkit import prompts_dataset, reward_len, reward_vowels, trial_config


@pytest.fixture
def counted(monkeypatch):
    """How many times this process evaluated a baseline."""
    calls = []
    original = baselines.evaluate_baseline

    def evaluate(*args, **kwargs):
        calls.append(args[1].model)
        return original(*args, **kwargs)

    monkeypatch.setattr(baselines, "evaluate_baseline", evaluate)
    return calls


@pytest.mark.e2e
def test_the_base_model_is_evaluated_once_before_any_trial_trains_and_scores_as_the_untrained_model(
        tiny_model, storage, counted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rfopt.training.evaluation import evaluate

    study = rfopt.create_study(study_name="base", storage=storage)
    evaluation = prompts_dataset(4, prefix="E")
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    study.optimize(configs, prompts_dataset(8), evaluation, num_chunks=2, show_progress_bar=False)
    (baseline,) = study_record(study.optuna).baselines.values()
    assert len(counted) == 1 and baseline.model == str(tiny_model) and baseline.objective == "reward"

    # The model as it was loaded, with no adapter, evaluated as a trial is: the same value.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    untrained = evaluate(model, tokenizer, evaluation, [reward_len, reward_vowels], None, EvalSettings(), 8)
    assert baseline.value == untrained.metrics["reward"]
    assert baseline.metrics["diversity/prompts"] == 4 and len(baseline.samples) == 4

    started = [m.train["started_at"] for t in study.trials for m in TrialRecord(t).unit_metrics()]
    assert baseline.at <= min(started)
    assert {TrialRecord(t).baseline_key for t in study.trials} == {baseline.key}

    # A later run of the study (a config appended) compares with the same baseline: not evaluated again.
    study.optimize([*configs, trial_config(tiny_model, learning_rate=2e-3)], prompts_dataset(8), evaluation,
                   show_progress_bar=False)
    assert len(counted) == 1 and study_record(study.optuna).baselines == {baseline.key: baseline}
    assert TrialRecord(study.trials[2]).baseline_key == baseline.key


@pytest.mark.e2e
def test_trials_with_other_reward_functions_get_a_baseline_of_their_own(tiny_model, storage, counted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rfopt.training.evaluation import evaluate

    study = rfopt.create_study(study_name="two", storage=storage)
    evaluation = prompts_dataset(4, prefix="E")
    configs = [trial_config(tiny_model), trial_config(tiny_model, rewards=(reward_len,))]
    # One at a time: the second baseline is evaluated with the first trial's trained adapter on the shared model.
    study.optimize(configs, prompts_dataset(4), evaluation, num_chunks=1, show_progress_bar=False, gang_size=1)
    found = study_record(study.optuna).baselines
    keys = [TrialRecord(t).baseline_key for t in study.trials]
    assert len(found) == 2 == len(set(keys)) == len(counted) and set(keys) == set(found)
    assert found[keys[1]].value == found[keys[1]].metrics["rewards/reward_len/mean"]
    # ... with that adapter disabled: what the model with no adapter scores.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    untrained = evaluate(model, tokenizer, evaluation, [reward_len], None, EvalSettings(), 8)
    assert found[keys[1]].metrics == untrained.metrics


@pytest.mark.e2e
def test_a_baseline_that_cannot_be_evaluated_is_skipped_and_the_study_goes_on(tiny_model, storage, monkeypatch,
                                                                               caplog):
    def fails(*args, **kwargs):
        raise RuntimeError("no room for the base model")

    monkeypatch.setattr(baselines, "evaluate_baseline", fails)
    study = rfopt.create_study(study_name="nobase", storage=storage)
    study.optimize([trial_config(tiny_model)], prompts_dataset(4), prompts_dataset(4, prefix="E"), num_chunks=1,
                   show_progress_bar=False)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert study_record(study.optuna).baselines == {} and TrialRecord(study.trials[0]).baseline_key is None
    assert "could not be evaluated as a baseline (RuntimeError: no room for the base model)" in caplog.text


@pytest.mark.e2e
@pytest.mark.subprocess
def test_the_baseline_survives_a_crash_and_a_rerun_evaluates_it_no_more(tiny_model, tiny_study_reference, tmp_path):
    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"))
    assert run(command, tmp_path, env(tiny_model, RFOPT_CRASH_AT="unit-started:2"), tmp_path / "log") != 0
    study = optuna.load_study(study_name="tiny", storage=storage)
    (stored,) = study_record(study).baselines.values()
    assert run(command, tmp_path, env(tiny_model), tmp_path / "log") == 0, (tmp_path / "log").read_text()[-3000:]
    assert study_record(study).baselines == {stored.key: stored}  # the same record: not evaluated again
    reference = optuna.load_study(study_name="tiny", storage=tiny_study_reference[0])
    (expected,) = study_record(reference).baselines.values()
    assert (stored.key, stored.value, stored.metrics) == (expected.key, expected.value, expected.metrics)
    assert {TrialRecord(t).baseline_key for t in trials(storage)} == {stored.key}
