"""One trial's input: its config, the datasets it trains and is evaluated on, the chunk plan they make with it, its
reward functions. What can be checked up front is refused before anything is stored, with a message that names the
field, the fix and the config it is in; what shows only when the trial runs (a reward that raises, a model that is
not there) fails that trial alone, with the reason stored, while the others finish. User code that ends the process
(sys.exit) fails its trial alone, or, from a callback, ends the call and leaves every trial resumable."""

import math
import sys

import optuna
import pytest
from datasets import Dataset

import rfopt
import rfopt_testkit
from refusalkit import EVAL, TRAIN, optimize, study_at, untouched
from rfopt.errors import ConfigError, PlanError, Refusal
from rfopt.storage.schema import TrialRecord, trial_attrs
from rfopt_testkit import grpo_config, prompts_dataset, reward_len, reward_nan, trial_config


# ---------------------------------------------------------------------- the chunk plan
@pytest.mark.parametrize(("kind", "note"), [("list", "in configs[1]"),
                                             ("function", "in the search space function's config")])
def test_too_many_chunks_is_refused_before_the_plan_is_stored_naming_the_config_and_the_advice_works(
        scripted, tiny_model, tmp_path, kind, note):
    study = study_at(tmp_path)
    if kind == "list":  # the second config's step takes 4 prompts: 1 per micro-batch, 4 accumulated
        space = [trial_config(tiny_model), trial_config(tiny_model, gradient_accumulation_steps=4)]
    else:
        def space(trial):  # 16 completions a step: 4 prompts x 4 generations
            return trial_config(tiny_model, learning_rate=trial.suggest_float("lr", 1e-4, 1e-2),
                                per_device_train_batch_size=16)
    n_trials = None if kind == "list" else 1

    with pytest.raises(PlanError, match=r"each of the 8 chunks holds 2 prompts, fewer than the 4 one training "
                       r"step needs .* use at most 4 chunks") as refused:
        optimize(study, space, train=prompts_dataset(16), n_trials=n_trials, num_chunks=8)
    assert refused.value.__notes__ == [note]
    untouched(study, tmp_path)
    optimize(study, space, train=prompts_dataset(16), n_trials=n_trials, num_chunks=4)
    assert {t.state.name for t in study.optuna.get_trials()} == {"COMPLETE"}
    assert len(study.optuna.get_trials()) == (2 if kind == "list" else 1)


def test_training_rows_the_chunk_plan_leaves_out_are_counted_in_a_warning(scripted, tiny_model, tmp_path, caplog):
    study = study_at(tmp_path)
    # 10 rows in 2 chunks of 5; a step takes 2 prompts (8 completions, 4 generations): 4 of each chunk train.
    configs = [trial_config(tiny_model), trial_config(tiny_model, per_device_train_batch_size=8)]
    optimize(study, configs, train=prompts_dataset(10), num_chunks=2)
    assert ("study 's': configs[1]: it trains 8 of the 10 training rows (2 left out, the same ones every epoch): 2 "
            "chunks of 5 rows, of which it trains 4 each, in whole blocks of 2 prompts (generation cycles that end "
            "on an optimizer step). Every row trains with a multiple of 4 rows (num_chunks x 2), e.g. 8 or 12"
            ) in caplog.text
    caplog.clear()
    optimize(study_at(tmp_path, name="even"), configs, train=prompts_dataset(8), num_chunks=2)
    assert "left out" not in caplog.text


# ---------------------------------------------------------------------- datasets
@pytest.mark.parametrize(("make", "message"), [
    (lambda: Dataset.from_list([{"prompt": i} for i in range(8)]),
     r"train_dataset row 0: the prompt is int 0; a prompt is text, or a list of chat messages"),
    (lambda: Dataset.from_list([{"prompt": "a"}, {"prompt": None}] * 4),
     r"train_dataset row 1: the prompt is NoneType None"),
    (lambda: TRAIN.select([]), "train_dataset is empty; training splits it into chunks: give at least one row"),
])
def test_prompts_that_are_not_text_or_chat_and_an_empty_train_set_are_refused(tiny_model, tmp_path, make, message):
    study = study_at(tmp_path)
    with pytest.raises(Refusal, match=message):
        optimize(study, [trial_config(tiny_model)], train=make())
    untouched(study, tmp_path)


def test_dataset_without_prompt_column_is_refused_before_training(tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)
    bad = Dataset.from_list([{"question": "1+1", "answer": "2"}] * 8)
    with pytest.raises(Refusal, match="no 'prompt' column.*rename_column"):
        study.optimize([trial_config(tiny_model)], bad, prompts_dataset(2), num_chunks=1, show_progress_bar=False)
    with pytest.raises(Refusal, match="eval_dataset has no 'prompt' column"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), bad, num_chunks=1, show_progress_bar=False)
    assert study.optuna.trials == []


def test_an_eval_set_missing_a_column_a_reward_function_takes_is_refused_before_training(tiny_model, tmp_path):
    study = study_at(tmp_path)
    config = trial_config(tiny_model, rewards=[reward_len, rfopt_testkit.reward_answer])
    with pytest.raises(Refusal, match=r"reward function 'reward_answer' takes 'answer', which eval_dataset has no "
                       r"column for \(its columns: \['prompt'\]\); add the column") as refused:
        optimize(study, [config], evaluation=EVAL.remove_columns("answer"))
    assert refused.value.__notes__ == ["in configs[0]"]
    untouched(study, tmp_path)


# ---------------------------------------------------------------------- configs
def test_a_nan_learning_rate_is_refused_naming_the_field(scripted, tiny_model, tmp_path):
    study = study_at(tmp_path)
    with pytest.raises(ConfigError, match=r"args.learning_rate: NaN; give a number") as refused:
        optimize(study, [trial_config(tiny_model, learning_rate=math.nan)])
    assert refused.value.__notes__ == ["in configs[0]"]
    untouched(study, tmp_path)
    # From a function, the trial fails alone at once, before it trains, with the same message.
    space = lambda trial: trial_config(tiny_model, learning_rate=trial.suggest_categorical("lr", [1e-3, math.nan]))  # noqa: E731
    optimize(study, space, n_trials=4)
    trials = study.optuna.get_trials()
    for trial in trials:
        if math.isnan(trial.params["lr"]):
            assert trial.state.name == "FAIL" and not trial.intermediate_values
            assert "args.learning_rate: NaN; give a number" in trial_attrs(trial)["rfopt:fail_reason"]
        else:
            assert trial.state.name == "COMPLETE"


def test_invalid_grpo_config_in_a_space_function_fails_that_trial_and_the_study_goes_on(scripted, tiny_model, storage):
    with pytest.raises(ValueError, match="num_generations"):  # TRL refuses the config itself, naming the field
        grpo_config(num_generations=3)

    def space(trial):
        generations = trial.suggest_categorical("num_generations", [3, 4])
        # per_device_train_batch_size=4 is not a multiple of 3: TRL refuses the config.
        return trial_config(tiny_model, num_generations=generations)

    study = rfopt.create_study(study_name="s", storage=storage, sampler=optuna.samplers.GridSampler({"num_generations": [3, 4]}))
    study.optimize(space, prompts_dataset(8), prompts_dataset(2, "E"), n_trials=2, num_chunks=1, show_progress_bar=False)
    by_choice = {t.params["num_generations"]: t for t in study.optuna.trials}
    assert by_choice[4].state.name == "COMPLETE"
    assert by_choice[3].state.name == "FAIL"
    assert "num_generations" in trial_attrs(by_choice[3])["rfopt:fail_reason"]


def test_vllm_generation_is_refused_with_a_clear_message(tiny_model):
    config = trial_config(tiny_model)
    config.args.use_vllm = True
    with pytest.raises(ConfigError, match="vLLM is not supported yet"):
        config.validate()


@pytest.mark.slow
@pytest.mark.e2e
def test_bf16_with_use_cpu_in_a_config_trains_on_the_cpu_as_the_device_says_and_a_warning_says_so(tiny_model,
                                                                                                  tmp_path, caplog):
    study = study_at(tmp_path)
    optimize(study, [trial_config(tiny_model), trial_config(tiny_model, bf16=True, use_cpu=True)], num_chunks=1)
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE", "COMPLETE"]
    assert ("configs[1] sets bf16=True, which rfopt does not use: where a chunk trains, and in what precision, is the "
            "device's choice, and this study trains in fp32 on cpu. Give the precision to the run instead: "
            "optimize(device=..., precision=...), rfopt run --device cuda --precision bf16") in caplog.text
    assert "configs[0]" not in caplog.text


# ---------------------------------------------------------------------- one trial's input, one trial's failure
def test_missing_model_gives_a_clear_error_on_its_trial(storage, tiny_model):
    config = trial_config(tiny_model)
    config.model = "/nonexistent/model-dir"
    study = rfopt.create_study(study_name="s", storage=storage)
    study.optimize([config], prompts_dataset(8), prompts_dataset(2), num_chunks=1, show_progress_bar=False)
    reason = trial_attrs(study.optuna.trials[0])["rfopt:fail_reason"]
    assert "ModelUnavailableError" in reason and "/nonexistent/model-dir" in reason


@pytest.mark.parametrize(("reward", "reason"), [
    ("reward_none", "reward function 'reward_none' returned None; it must return a list of 4 numbers, one per "
                    "completion (None for a completion it does not score)"),
    ("reward_text", "reward function 'reward_text' returned str 'good' for completion 0; it must return a list of 4 "
                    "numbers"),
    ("reward_wrong_length", "reward function 'reward_wrong_length' returned 3 values for 4 completions; it must "
                            "return a list of 4 numbers"),
    ("reward_inf", "reward function 'reward_inf' returned inf for completion 0; rewards must be finite (return "
                   "None, or NaN, for a completion it does not score)"),
    ("reward_raises", "reward function 'reward_raises' raised RuntimeError: reward server unreachable"),
    ("reward_reads_solution", "reward function 'reward_reads_solution' raised KeyError: 'solution' (the dataset "
                              "has no column 'solution'; its columns: ['answer'])"),
])
def test_a_bad_reward_fails_its_trial_alone_with_a_reason_that_names_it(scripted, tiny_model, tmp_path, reward, reason):
    configs = [trial_config(tiny_model), trial_config(tiny_model, rewards=[reward_len, getattr(rfopt_testkit, reward)]),
               trial_config(tiny_model, learning_rate=1e-3)]
    study = study_at(tmp_path)
    optimize(study, configs)
    good, bad, other = study.optuna.get_trials()
    assert (good.state.name, bad.state.name, other.state.name) == ("COMPLETE", "FAIL", "COMPLETE")
    assert reason in trial_attrs(bad)["rfopt:fail_reason"]
    assert sorted(good.intermediate_values) == sorted(other.intermediate_values) == [0, 1]  # the others train on


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
    assert "objective 'reward' is nan" in trial_attrs(all_nan)["rfopt:fail_reason"]
    assert plain.state.name == "COMPLETE"


def test_sys_exit_in_a_reward_fails_its_trial_alone_and_the_others_finish(scripted, tiny_model, tmp_path, caplog):
    configs = [trial_config(tiny_model), trial_config(tiny_model, rewards=[reward_len, rfopt_testkit.reward_exits]),
               trial_config(tiny_model, learning_rate=1e-3)]
    study = study_at(tmp_path)
    optimize(study, configs)  # returns: the call is not ended by one config's bug
    good, bad, other = study.optuna.get_trials()
    assert (good.state.name, bad.state.name, other.state.name) == ("COMPLETE", "FAIL", "COMPLETE")
    assert sorted(good.intermediate_values) == sorted(other.intermediate_values) == [0, 1]
    reason = TrialRecord(bad).fail_reason
    assert "reward function 'reward_exits' called sys.exit(3) (raised SystemExit)" in reason
    assert "raise an exception" in reason
    assert "trial 1 failed: RewardFunctionError: reward function 'reward_exits' called sys.exit(3)" in caplog.text
    optimize(study, configs)  # a rerun has nothing to do: it does not exit again
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE", "FAIL", "COMPLETE"]


def test_sys_exit_in_an_on_unit_callback_ends_the_call_and_every_trial_resumes_to_the_uninterrupted_result(
        scripted, tiny_model, tmp_path):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    (tmp_path / "ref").mkdir()
    reference = study_at(tmp_path / "ref")
    optimize(reference, configs)
    calls = []

    def exit_once(number, step, value):
        calls.append(1)
        if len(calls) == 3:
            sys.exit(3)

    study = study_at(tmp_path, name="exit")
    with pytest.raises(SystemExit):
        optimize(study, configs, on_unit=exit_once)
    assert all(t.state.name in ("RUNNING", "WAITING") for t in study.optuna.get_trials())
    optimize(study, configs)
    assert ([(t.state, t.intermediate_values) for t in study.optuna.get_trials()]
            == [(t.state, t.intermediate_values) for t in reference.optuna.get_trials()])
