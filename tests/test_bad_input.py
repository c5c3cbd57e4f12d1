"""Bad input: refused before training with a clear message, or failing its own trial alone with the reason stored."""


import optuna
import pytest
from datasets import Dataset

import rfopt
from rfopt.errors import ConfigError, PlanError
from rfopt.errors import Refusal
from rfopt_testkit import (
    grpo_config,
    prompts_dataset,
    reward_len,
    reward_nan,
    reward_raises,
    reward_wrong_length,
    trial_config,
)
from rfopt.storage.schema import study_attrs
from stored_study import stored_study
from rfopt.storage.schema import trial_attrs

FAIL_REASON_ATTR = "rfopt:fail_reason"


@pytest.mark.parametrize(
    ("bad_reward", "reason"),
    [
        (reward_raises, "reward server unreachable"),
        (reward_wrong_length, "reward_wrong_length"),
    ],
)
def test_bad_reward_function_fails_its_trial_alone_with_the_reason_stored(
        scripted, tiny_model, storage, bad_reward, reason):
    configs = [
        trial_config(tiny_model),
        trial_config(tiny_model, rewards=[reward_len, bad_reward]),
        trial_config(tiny_model, learning_rate=1e-3),
    ]
    study = rfopt.create_study(study_name="bad", storage=storage)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)

    trials = optuna.load_study(study_name="bad", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert reason.lower() in trial_attrs(trials[1])[FAIL_REASON_ATTR].lower()
    assert all(len(t.intermediate_values) == 2 for t in (trials[0], trials[2]))


@pytest.mark.slow
@pytest.mark.e2e
def test_nan_rewards_are_skipped_as_trl_does_and_an_all_nan_objective_fails_the_trial(tiny_model, storage):
    configs = [
        trial_config(tiny_model, rewards=[reward_len, reward_nan]),
        trial_config(tiny_model, rewards=[reward_nan]),
        trial_config(tiny_model),
    ]
    study = rfopt.create_study(study_name="nan", storage=storage)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    partly_nan, all_nan, plain = study.optuna.trials
    assert partly_nan.state.name == "COMPLETE"
    eval_metrics = study.chunk_metrics(0)[0]["eval"]
    assert eval_metrics["rewards/reward_nan/mean"] == "nan"
    assert partly_nan.value == eval_metrics["rewards/reward_len/mean"]
    assert all_nan.state.name == "FAIL"
    assert "objective 'reward' is nan" in trial_attrs(all_nan)[FAIL_REASON_ATTR]
    assert plain.state.name == "COMPLETE"


def test_invalid_grpo_config_in_a_space_function_fails_that_trial_and_the_study_goes_on(scripted, tiny_model, storage):
    def space(trial):
        generations = trial.suggest_categorical("num_generations", [3, 4])
        # per_device_train_batch_size=4 is not a multiple of 3: TRL refuses the config.
        return trial_config(tiny_model, num_generations=generations)

    study = rfopt.create_study(study_name="s", storage=storage, sampler=optuna.samplers.GridSampler({"num_generations": [3, 4]}))
    study.optimize(space, prompts_dataset(8), prompts_dataset(2, "E"), n_trials=2, num_chunks=1, show_progress_bar=False)
    by_choice = {t.params["num_generations"]: t for t in study.optuna.trials}
    assert by_choice[4].state.name == "COMPLETE"
    assert by_choice[3].state.name == "FAIL"
    assert "num_generations" in trial_attrs(by_choice[3])[FAIL_REASON_ATTR]


def test_invalid_grpo_config_is_refused_by_trl_with_its_message():
    with pytest.raises(ValueError, match="num_generations"):
        grpo_config(num_generations=3)


def test_dataset_without_prompt_column_is_refused_before_training(tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)
    bad = Dataset.from_list([{"question": "1+1", "answer": "2"}] * 8)
    with pytest.raises(Refusal, match="no 'prompt' column.*rename_column"):
        study.optimize([trial_config(tiny_model)], bad, prompts_dataset(2), num_chunks=1, show_progress_bar=False)
    with pytest.raises(Refusal, match="eval_dataset has no 'prompt' column"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), bad, num_chunks=1, show_progress_bar=False)
    assert study.optuna.trials == []


def test_impossible_chunk_plan_in_a_list_is_refused_before_any_training(tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)
    with pytest.raises(PlanError, match="fewer than the 4 one training step needs") as refused:
        study.optimize(
            [trial_config(tiny_model), trial_config(tiny_model, gradient_accumulation_steps=4)],
            prompts_dataset(8),
            prompts_dataset(2),
            num_chunks=4,
            show_progress_bar=False,
        )
    assert refused.value.__notes__ == ["in configs[1]"]
    assert study.optuna.trials == []


def test_vllm_generation_is_refused_with_a_clear_message(tiny_model):
    config = trial_config(tiny_model)
    config.args.use_vllm = True
    with pytest.raises(ConfigError, match="vLLM is not supported yet"):
        config.validate()


def test_study_refuses_a_different_training_set_on_rerun(tiny_model, storage):
    study = stored_study(storage, "s", [trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), num_chunks=1)
    with pytest.raises(Refusal, match="this call.s train_dataset is not the one it was run with"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8, prefix="X"), prompts_dataset(2),
                       num_chunks=1, show_progress_bar=False)
    with pytest.raises(Refusal, match="was planned with num_chunks=1, and this call gives num_chunks=2"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), num_chunks=2,
                       show_progress_bar=False)


def test_missing_model_gives_a_clear_error_on_its_trial(storage, tiny_model):
    config = trial_config(tiny_model)
    config.model = "/nonexistent/model-dir"
    study = rfopt.create_study(study_name="s", storage=storage)
    study.optimize([config], prompts_dataset(8), prompts_dataset(2), num_chunks=1, show_progress_bar=False)
    reason = trial_attrs(study.optuna.trials[0])[FAIL_REASON_ATTR]
    assert "ModelUnavailableError" in reason and "/nonexistent/model-dir" in reason


@pytest.mark.parametrize("run", ["optimize", "work"])
def test_a_cuda_device_without_cuda_is_refused_before_the_study_changes(tiny_model, storage, monkeypatch, run):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine, and on a GPU one
    study = rfopt.create_study(study_name="no-gpu", storage=storage)
    with pytest.raises(Refusal, match=r"device 'cuda:1': CUDA is not available here"):
        getattr(study, run)([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2,
                            device="cuda:1")
    loaded = optuna.load_study(study_name="no-gpu", storage=storage)
    assert loaded.get_trials() == []  # nothing enqueued, no plan stored: the same command on "cpu" starts clean
    assert "rfopt:plan" not in study_attrs(loaded)
