"""Bad input is refused before anything is stored, with a message that names the field and the fix; inputs the
results depend on are guarded, so results never mix; one trial's bad input fails that trial alone, and user code
that stops the process leaves every trial resumable.

Each refusal test checks the message and that storage and checkpoints are as they were before the call; every refused
input is an `rfopt.errors.Refusal` (an `rfopt.RfoptError`, and the builtin error callers caught it by before)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import trl
from datasets import Dataset

import rfopt
from rfopt.errors import ConfigError, PlanError, StudyDeletedError, StudyNameError
import rfopt_testkit
from rfopt.errors import MissingPackage, Refusal
from rfopt.storage.schema import TrialRecord
from rfopt_testkit import prompts_dataset, reward_len, trial_config
from stored_study import stored_study
from rfopt.storage.schema import trial_attrs

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")


def _study(tmp_path, name="s", **kwargs):
    return rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'study.db'}", load_if_exists=True,
                              **kwargs)


def _optimize(study, space, train=TRAIN, evaluation=EVAL, **kwargs):
    kwargs.setdefault("num_chunks", 2)
    study.optimize(space, train, evaluation, show_progress_bar=False, **kwargs)


def _stored(tmp_path, configs, num_chunks=2):
    """Study "s" as `_optimize(study, configs)` leaves it, written through the schema writers (tests/stored_study.py)."""
    return stored_study(f"sqlite:///{tmp_path / 'study.db'}", "s", configs, TRAIN, EVAL, num_chunks=num_chunks)


def _snapshot(study, tmp_path):
    """What a refused call must leave as it was: the study's attrs, its trials, and every file beside the database."""
    trials = [(t.number, t.state, t.params, t.intermediate_values, t.user_attrs, trial_attrs(t)) for t in study.optuna.get_trials()]
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".db")
    return study.optuna.user_attrs, trials, files


def _untouched(study, tmp_path):
    """A study that was never run: no rfopt attrs, no trials, no checkpoint directory."""
    assert study.optuna.user_attrs == {} and study.optuna.get_trials() == []
    assert not (tmp_path / "rfopt-checkpoints").exists()


# ---------------------------------------------------------------------- results that must not mix
def test_a_different_eval_set_is_refused_when_a_study_continues(tiny_model, tmp_path):
    study = _stored(tmp_path, [trial_config(tiny_model)])
    before = _snapshot(study, tmp_path)
    more = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-3)]
    with pytest.raises(Refusal, match=r"this call's eval_dataset is not the one its trials were evaluated on .*"
                       "Use the same one to continue the study, or a new study name"):
        _optimize(study, more, evaluation=prompts_dataset(2, "Other"))
    assert _snapshot(study, tmp_path) == before


def test_a_list_study_grows_and_its_new_configs_become_new_trials_with_their_params(
        scripted, tiny_model, tmp_path, caplog):
    base = trial_config(tiny_model)
    study = _study(tmp_path)
    _optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3]))
    first = [(t.number, t.params, t.intermediate_values) for t in study.optuna.get_trials()]

    _optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3, 3e-3]))
    trials = study.optuna.get_trials()
    assert [(t.number, t.params, t.intermediate_values) for t in trials[:2]] == first  # kept as they were
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert trials[2].params == {"learning_rate": 3e-3} and TrialRecord(trials[2]).list_index == 2
    assert isinstance(trials[2].distributions["learning_rate"], optuna.distributions.FloatDistribution)

    _optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3, 3e-3]))  # nothing left: says so
    assert len(study.optuna.get_trials()) == 3
    assert "study 's': nothing to do (3 COMPLETE): every one of the list's 3 configs has run" in caplog.text


def test_a_changed_config_of_a_list_study_is_refused_naming_what_changed(tiny_model, tmp_path):
    base = trial_config(tiny_model)
    study = _stored(tmp_path, rfopt.grid(base, learning_rate=[1e-3, 2e-3]))
    before = _snapshot(study, tmp_path)
    with pytest.raises(ConfigError, match=r"configs\[1\] is not the config this study ran .* "
                       r"\(learning_rate 0.002 -> 0.005\); a config that has run cannot change. Keep it as it was and "
                       "append the changed config at the end of the list"):
        _optimize(study, rfopt.grid(base, learning_rate=[1e-3, 5e-3]))
    assert _snapshot(study, tmp_path) == before


def test_a_list_that_adds_a_choice_to_a_categorical_param_is_refused(tiny_model, tmp_path):
    base = trial_config(tiny_model)
    study = _stored(tmp_path, rfopt.grid(base, lr_scheduler_type=["linear", "constant"]), num_chunks=1)
    before = _snapshot(study, tmp_path)
    with pytest.raises(ConfigError, match=r"lr_scheduler_type: the list now gives \['cosine'\], which the "
                       "study's trials did not have as choices"):
        _optimize(study, rfopt.grid(base, lr_scheduler_type=["linear", "constant", "cosine"]), num_chunks=1)
    assert _snapshot(study, tmp_path) == before


def test_n_trials_beyond_a_lists_configs_is_refused(tiny_model, tmp_path):
    study = _study(tmp_path)
    with pytest.raises(Refusal, match=r"n_trials=3, but 1 of the list's 1 configs are left to run; .*leave "
                       "n_trials out"):
        _optimize(study, [trial_config(tiny_model)], n_trials=3)
    _untouched(study, tmp_path)


_SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
import rfopt
from rfopt_testkit import prompts_dataset, trial_config


def reward_here(completions, **kwargs):
    return [len(c) / 8 for c in completions]


study = rfopt.create_study(study_name="script", storage="sqlite:///script.db")
study.optimize([trial_config({model!r}, rewards=[reward_here])], prompts_dataset(8), prompts_dataset(2, "E"),
               num_chunks=2, show_progress_bar=False)
print("trials:", [t.state.name for t in study.optuna.get_trials()])
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.e2e
def test_a_reward_function_of_a_script_without_a_main_guard_is_taken_from_the_running_script(tiny_model, tmp_path,
                                                                                             monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent), model=str(tiny_model)))
    env = dict(os.environ, RFOPT_STORAGE_RETRY_SECONDS="5")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trials:") == 1  # the script ran once, not again inside optimize
    assert "trials: ['COMPLETE']" in done.stdout
    stored = optuna.load_study(study_name="script", storage=f"sqlite:///{tmp_path / 'script.db'}").trials[0]
    assert json.loads(trial_attrs(stored)["rfopt:config"])["reward_funcs"] == [f"{script.resolve()}:reward_here"]

    # Another process (a worker, the dashboard) that would import the script to find the function gets a clear
    # refusal instead of a second run of the study, and nothing of the script runs.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"starts a study when it is imported \(rfopt.create_study\(...\), "
                       r"line 11\).*Put the study's run under `if __name__ == \"__main__\":`"):
        rfopt.TrialConfig.from_json(trial_attrs(stored)["rfopt:config"])
    assert len(optuna.load_study(study_name="script", storage=f"sqlite:///{tmp_path / 'script.db'}").trials) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rfopt-checkpoints", "script.db", "train.py"]


_SCRIPT_WITH_MAIN = """\
import sys
sys.path.insert(0, {tests!r})
import rfopt
from rfopt_testkit import prompts_dataset, trial_config


def reward_here(completions, **kwargs):
    return [len(c) / 8 for c in completions]


def main():
    study = rfopt.create_study(study_name="script", storage="sqlite:///script.db", load_if_exists=True)
    study.optimize([trial_config({model!r}, rewards=[reward_here])], prompts_dataset(8), prompts_dataset(2, "E"),
                   num_chunks=1, show_progress_bar=False)


main()
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.e2e
def test_a_script_whose_top_level_runs_a_study_through_a_function_is_refused_when_it_is_imported(tiny_model,
                                                                                                 tmp_path,
                                                                                                 monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT_WITH_MAIN.format(tests=str(Path(__file__).parent), model=str(tiny_model)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'script.db'}"
    stored = optuna.load_study(study_name="script", storage=storage).trials[0]
    assert stored.state.name == "COMPLETE"

    # The file's top level shows no study call (main() hides it): the study run it reaches is refused instead.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"train.py cannot be imported: it starts a study when it is imported "
                       r"\(a study run reached while importing it\)"):
        rfopt.TrialConfig.from_json(trial_attrs(stored)["rfopt:config"])
    assert [t.state.name for t in optuna.load_study(study_name="script", storage=storage).trials] == ["COMPLETE"]
    assert not any(name.startswith("rfopt_user_") and "train" in name for name in sys.modules)  # not left half-made


# ---------------------------------------------------------------------- a study name is not burned by a typo
def test_too_many_chunks_for_a_function_space_is_refused_before_the_plan_is_stored_and_the_advice_works(
        scripted, tiny_model, tmp_path):
    study = _study(tmp_path)
    def space(trial):  # 16 completions a step: 4 prompts x 4 generations
        return trial_config(tiny_model, learning_rate=trial.suggest_float("lr", 1e-4, 1e-2),
                            per_device_train_batch_size=16)

    with pytest.raises(PlanError, match=r"each of the 8 chunks holds 2 prompts, fewer than the 4 one training "
                       r"step needs .* use at most 4 chunks") as refused:
        _optimize(study, space, train=prompts_dataset(16), n_trials=1, num_chunks=8)
    assert refused.value.__notes__ == ["in the search space function's config"]
    _untouched(study, tmp_path)
    _optimize(study, space, train=prompts_dataset(16), n_trials=1, num_chunks=4)
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE"]


@pytest.mark.parametrize("kind", ["list", "function"])
def test_a_mistyped_objective_is_refused_before_anything_trains_and_the_fixed_call_runs(
        scripted, tiny_model, tmp_path, kind):
    study = _study(tmp_path)
    space = [trial_config(tiny_model)] if kind == "list" else (lambda trial: trial_config(tiny_model))
    n_trials = None if kind == "list" else 1
    with pytest.raises(Refusal, match=r"objective='goood' is neither 'reward' .* nor the name of one of the reward "
                       r"functions \['reward_len', 'reward_vowels'\]"):
        _optimize(study, space, n_trials=n_trials, objective="goood")
    _untouched(study, tmp_path)
    _optimize(study, space, n_trials=n_trials, objective="reward_len")
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE"]


@pytest.mark.parametrize(("settings", "message"), [
    (dict(batch_size=0), "batch_size=0: give a whole number >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0: give a number >= 0"),
    (dict(top_p=0.0), r"top_p=0.0: give a number in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens=0: give a whole number >= 1, or None"),
    (dict(num_samples=-1), "num_samples=-1: give a whole number >= 0"),
])
def test_bad_eval_settings_are_refused_where_they_are_made(settings, message):
    with pytest.raises(Refusal, match="EvalSettings: " + message):
        rfopt.EvalSettings(**settings)


# ---------------------------------------------------------------------- input checked before the first write
@pytest.mark.parametrize(("make", "message"), [
    (lambda: Dataset.from_list([{"prompt": i} for i in range(8)]),
     r"train_dataset row 0: the prompt is int 0; a prompt is text, or a list of chat messages"),
    (lambda: Dataset.from_list([{"prompt": "a"}, {"prompt": None}] * 4),
     r"train_dataset row 1: the prompt is NoneType None"),
    (lambda: TRAIN.select([]), "train_dataset is empty; training splits it into chunks: give at least one row"),
])
def test_prompts_that_are_not_text_or_chat_and_an_empty_train_set_are_refused(tiny_model, tmp_path, make, message):
    study = _study(tmp_path)
    with pytest.raises(Refusal, match=message):
        _optimize(study, [trial_config(tiny_model)], train=make())
    _untouched(study, tmp_path)


def test_an_eval_set_missing_a_column_a_reward_function_takes_is_refused_before_training(tiny_model, tmp_path):
    study = _study(tmp_path)
    config = trial_config(tiny_model, rewards=[reward_len, rfopt_testkit.reward_answer])
    with pytest.raises(Refusal, match=r"reward function 'reward_answer' takes 'answer', which eval_dataset has no "
                       r"column for \(its columns: \['prompt'\]\); add the column") as refused:
        _optimize(study, [config], evaluation=EVAL.remove_columns("answer"))
    assert refused.value.__notes__ == ["in configs[0]"]
    _untouched(study, tmp_path)


def test_a_nan_learning_rate_is_refused_naming_the_field(scripted, tiny_model, tmp_path):
    study = _study(tmp_path)
    with pytest.raises(ConfigError, match=r"args.learning_rate: NaN; give a number") as refused:
        _optimize(study, [trial_config(tiny_model, learning_rate=math.nan)])
    assert refused.value.__notes__ == ["in configs[0]"]
    _untouched(study, tmp_path)
    # From a function, the trial fails alone at once, before it trains, with the same message.
    space = lambda trial: trial_config(tiny_model, learning_rate=trial.suggest_categorical("lr", [1e-3, math.nan]))  # noqa: E731
    _optimize(study, space, n_trials=4)
    trials = study.optuna.get_trials()
    for trial in trials:
        if math.isnan(trial.params["lr"]):
            assert trial.state.name == "FAIL" and not trial.intermediate_values
            assert "args.learning_rate: NaN; give a number" in trial_attrs(trial)["rfopt:fail_reason"]
        else:
            assert trial.state.name == "COMPLETE"


@pytest.mark.skipif(__import__("importlib").util.find_spec("scipy") is not None, reason="scipy is installed")
def test_a_wilcoxon_pruner_without_scipy_is_refused_when_the_study_is_created(tmp_path):
    for pruner in (optuna.pruners.WilcoxonPruner(), optuna.pruners.PatientPruner(optuna.pruners.WilcoxonPruner(), 1)):
        with pytest.raises(MissingPackage, match="WilcoxonPruner needs scipy, which is not installed: pip install scipy"):
            _study(tmp_path, pruner=pruner)
    assert optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'study.db'}") == []


@pytest.mark.slow
@pytest.mark.e2e
def test_bf16_with_use_cpu_in_a_config_trains_on_the_cpu_as_the_device_says_and_a_warning_says_so(tiny_model,
                                                                                                  tmp_path, caplog):
    study = _study(tmp_path)
    _optimize(study, [trial_config(tiny_model), trial_config(tiny_model, bf16=True, use_cpu=True)], num_chunks=1)
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE", "COMPLETE"]
    assert ("configs[1] sets bf16=True, which rfopt does not use: where a chunk trains, and in what precision, is the "
            "device's choice, and this study trains in fp32 on cpu. Give the precision to the run instead: "
            "optimize(device=..., precision=...), rfopt run --device cuda --precision bf16") in caplog.text
    assert "configs[0]" not in caplog.text


# ---------------------------------------------------------------------- one trial's input, one trial's failure
@pytest.mark.parametrize(("reward", "reason"), [
    ("reward_none", "reward function 'reward_none' returned None; it must return a list of 4 numbers, one per "
                    "completion (None for a completion it does not score)"),
    ("reward_text", "reward function 'reward_text' returned str 'good' for completion 0; it must return a list of 4 "
                    "numbers"),
    ("reward_inf", "reward function 'reward_inf' returned inf for completion 0; rewards must be finite (return "
                   "None, or NaN, for a completion it does not score)"),
    ("reward_raises", "reward function 'reward_raises' raised RuntimeError: reward server unreachable"),
    ("reward_reads_solution", "reward function 'reward_reads_solution' raised KeyError: 'solution' (the dataset "
                              "has no column 'solution'; its columns: ['answer'])"),
])
def test_a_bad_reward_fails_its_trial_alone_with_a_reason_that_names_it(scripted, tiny_model, tmp_path, reward, reason):
    configs = [trial_config(tiny_model, rewards=[reward_len, getattr(rfopt_testkit, reward)]),
               trial_config(tiny_model)]
    study = _study(tmp_path)
    _optimize(study, configs, num_chunks=1)
    bad, good = study.optuna.get_trials()
    assert bad.state.name == "FAIL" and reason in trial_attrs(bad)["rfopt:fail_reason"]
    assert good.state.name == "COMPLETE"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_reward_reading_trainer_state_gets_the_trials_step_in_training_and_in_evaluation(tiny_model, tmp_path):
    study = _study(tmp_path)
    _optimize(study, [trial_config(tiny_model, rewards=[rfopt_testkit.reward_step])], num_chunks=2)
    trial = study.optuna.get_trials()[0]
    assert trial.state.name == "COMPLETE"
    # 4 prompts a chunk, one a step (4 completions, 4 generations): steps 0-3 generate in chunk 0, 4-7 in chunk 1.
    steps = [m["train"]["rewards/reward_step/mean"] for m in study.chunk_metrics(0)]
    assert steps == [1.5, 5.5]
    assert trial.intermediate_values == {0: 4.0, 1: 8.0}  # evaluated after 4 and after 8 steps


def test_sys_exit_in_a_reward_fails_its_trial_alone_and_the_others_finish(scripted, tiny_model, tmp_path, caplog):
    configs = [trial_config(tiny_model), trial_config(tiny_model, rewards=[reward_len, rfopt_testkit.reward_exits]),
               trial_config(tiny_model, learning_rate=1e-3)]
    study = _study(tmp_path)
    _optimize(study, configs)  # returns: the call is not ended by one config's bug
    good, bad, other = study.optuna.get_trials()
    assert (good.state.name, bad.state.name, other.state.name) == ("COMPLETE", "FAIL", "COMPLETE")
    assert sorted(good.intermediate_values) == sorted(other.intermediate_values) == [0, 1]
    reason = TrialRecord(bad).fail_reason
    assert "reward function 'reward_exits' called sys.exit(3) (raised SystemExit)" in reason
    assert "raise an exception" in reason
    assert "trial 1 failed: RewardFunctionError: reward function 'reward_exits' called sys.exit(3)" in caplog.text
    _optimize(study, configs)  # a rerun has nothing to do: it does not exit again
    assert [t.state.name for t in study.optuna.get_trials()] == ["COMPLETE", "FAIL", "COMPLETE"]


def test_sys_exit_in_an_on_unit_callback_ends_the_call_and_every_trial_resumes_to_the_uninterrupted_result(
        scripted, tiny_model, tmp_path):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    (tmp_path / "ref").mkdir()
    reference = _study(tmp_path / "ref")
    _optimize(reference, configs)
    calls = []

    def exit_once(number, step, value):
        calls.append(1)
        if len(calls) == 3:
            sys.exit(3)

    study = _study(tmp_path, name="exit")
    with pytest.raises(SystemExit):
        _optimize(study, configs, on_unit=exit_once)
    assert all(t.state.name in ("RUNNING", "WAITING") for t in study.optuna.get_trials())
    _optimize(study, configs)
    assert ([(t.state, t.intermediate_values) for t in study.optuna.get_trials()]
            == [(t.state, t.intermediate_values) for t in reference.optuna.get_trials()])


def test_the_leaderboard_shows_a_default_as_its_value_not_none(scripted, tiny_model, tmp_path):
    study = _study(tmp_path)
    _optimize(study, [trial_config(tiny_model), trial_config(tiny_model, optim="sgd")], num_chunks=1)
    default = trl.GRPOConfig.__dataclass_fields__["optim"].default
    assert sorted(t.params["optim"] for t in study.optuna.get_trials()) == sorted([str(default), "sgd"])
    assert "optim=None" not in study.leaderboard_text()


@pytest.mark.slow
@pytest.mark.e2e
def test_an_async_reward_function_is_awaited_in_evaluation_as_in_training(tiny_model, tmp_path):
    study = _study(tmp_path)
    _optimize(study, [trial_config(tiny_model, rewards=[rfopt_testkit.reward_len_async])], num_chunks=1)
    trial = study.optuna.get_trials()[0]
    assert trial.state.name == "COMPLETE"
    assert trial.value == study.chunk_metrics(0)[0]["eval"]["rewards/reward_len_async/mean"]


# ---------------------------------------------------------------------- a refusal is an RfoptError
def test_a_refusal_is_an_rfopt_error_and_the_builtin_error_callers_catch_it_by():
    from rfopt.engine.request import RunRequest
    from rfopt.errors import TypeRefusal

    for kind, builtin in ((Refusal, ValueError), (TypeRefusal, TypeError), (MissingPackage, ImportError)):
        assert issubclass(kind, rfopt.RfoptError) and issubclass(kind, builtin) and issubclass(kind, ValueError)
    with pytest.raises(TypeError, match=r"callbacks: 1 is not callable") as refused:
        RunRequest([], TRAIN, EVAL, callbacks=[1])
    assert isinstance(refused.value, rfopt.RfoptError)


def test_the_command_line_shows_where_a_refusal_applies_on_its_one_line():
    from rfopt.cli.program import _error_text

    refused = PlanError("each of the 8 chunks holds 2 prompts, fewer than the 4 one training step needs")
    refused.add_note("in configs[1]")
    assert _error_text(refused) == ("each of the 8 chunks holds 2 prompts, fewer than the 4 one training step needs "
                                    "(in configs[1])")


# ---------------------------------------------------------------------- a name never chooses a location
_BAD_NAMES = [
    ("../../x", "'/' is not allowed"),
    ("{tmp}/absolute", "'/' is not allowed"),
    ("a/b", "'/' is not allowed"),
    ("~/x", "'/', '~' are not allowed"),
    ("a\\b", r"'\\\\' is not allowed"),
    ("x\ny", r"'\\n' is not allowed"),
    (".hidden", "it starts with '.'"),
    ("x" * 240, "it is 240 characters long"),
]


def _files_under(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(("name", "problem"), _BAD_NAMES)
def test_a_study_name_that_would_choose_a_location_is_refused_before_anything_is_stored(tiny_model, tmp_path,
                                                                                        monkeypatch, name, problem):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    name = name.format(tmp=tmp_path)
    before = _files_under(tmp_path)
    rule = (r"; a study name is also a folder name \(rfopt-checkpoints/<name>-<id>, a tracker's run\): use letters, "
            r"digits, spaces and \. _ - \+ = @, at most 128 characters")
    with pytest.raises(StudyNameError, match=f"study name .*: {problem}{rule}"):
        rfopt.create_study(study_name=name, storage=f"sqlite:///{work / 'study.db'}")
    assert _files_under(tmp_path) == before  # not even the database file

    # A study Optuna itself made under such a name is refused by rfopt before it writes anything.
    url = f"sqlite:///{work / 'optuna.db'}"
    optuna.create_study(study_name=name, storage=url)
    study = rfopt.load_study(name, url)
    before = _files_under(tmp_path)
    with pytest.raises(StudyNameError, match=f"{problem}{rule}"):
        _optimize(study, [trial_config(tiny_model)])
    _untouched(study, work)
    assert _files_under(tmp_path) == before


def test_a_study_name_of_letters_digits_and_allowed_signs_makes_its_folder_inside_the_checkpoint_root(
        scripted, tiny_model, tmp_path):
    study = _study(tmp_path, name="gsm8k v2_lr=1e-3+lora@8.b-1")
    _optimize(study, [trial_config(tiny_model)], num_chunks=1)
    assert study.checkpoints.root.parent == tmp_path / "rfopt-checkpoints"
    assert study.checkpoints.root.name.startswith("gsm8k v2_lr=1e-3+lora@8.b-1-")


def test_the_command_line_refuses_such_a_study_name_in_one_line_before_it_loads_the_data(tmp_path, monkeypatch,
                                                                                         capsys):
    from rfopt.cli import main

    monkeypatch.chdir(tmp_path)
    study_file = tmp_path / "study.py"
    study_file.write_text("raise SystemExit('the study file must not even be imported')\n")
    for command in ("run", "worker"):
        assert main([command, str(study_file), "--study", "../../x", "--storage", "sqlite:///s.db"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("rfopt: error: study name '../../x': '/' is not allowed; a study name is also a folder")
    assert main(["worker", str(study_file), "--devices", "cpu,cpu", "--study", "a/b"]) == 1
    assert "rfopt: error: study name 'a/b'" in capsys.readouterr().err
    assert _files_under(tmp_path) == ["study.py"]


# ---------------------------------------------------------------------- a tracker that is not installed
def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_stored(tiny_model, tmp_path, monkeypatch,
                                                                              capsys):
    from transformers.integrations import integration_utils

    from rfopt.cli import main

    monkeypatch.setattr(integration_utils, "is_wandb_available", lambda: False)  # as on a machine without wandb
    says = (r"report_to: wandb is not installed here, so every trial would fail at its first chunk; install it \(pip "
            r"install wandb\) or leave it out of report_to")
    with pytest.raises(Refusal, match=says):
        rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", report_to="wandb")
    assert not (tmp_path / "study.db").exists()
    study = _study(tmp_path)
    with pytest.raises(Refusal, match=says):
        _optimize(study, [trial_config(tiny_model)], report_to=["tensorboard", "wandb"])
    _untouched(study, tmp_path)

    monkeypatch.chdir(tmp_path)
    study_file = tmp_path / "study.py"
    study_file.write_text("raise SystemExit('the study file must not even be imported')\n")
    assert main(["run", str(study_file), "--report-to", "wandb", "--storage", "sqlite:///cli.db"]) == 1
    assert capsys.readouterr().err.startswith("rfopt: error: report_to: wandb is not installed here")
    assert not (tmp_path / "cli.db").exists()

    # Installed, the same call runs (nothing was burned by the refusal).
    monkeypatch.setattr(integration_utils, "is_wandb_available", lambda: True)
    assert rfopt.training.trackers.normalize("wandb") == ["wandb"]


def test_a_study_deleted_while_it_runs_stops_the_run_saying_so(scripted, tiny_model, tmp_path):
    study = _study(tmp_path, name="gone")
    url = f"sqlite:///{tmp_path / 'study.db'}"

    def delete(number, step, value):  # what optuna-dashboard's delete button does to the storage
        optuna.delete_study(study_name="gone", storage=url)

    with pytest.raises(StudyDeletedError, match=r"study 'gone' was deleted from its storage \(sqlite:///.*\) "
                       r"while this process ran it \(optuna-dashboard's delete button, or optuna.delete_study\): its "
                       r"trials and results are gone from the database, and this run stopped. Its checkpoints are "
                       r"still in .*rfopt-checkpoints/gone-"):
        _optimize(study, rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3]), on_unit=delete)
    assert optuna.get_all_study_summaries(url) == []


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("space", ["list", "function"])
def test_a_reward_function_of_a_script_read_from_stdin_is_refused_before_anything_is_stored(tiny_model, tmp_path,
                                                                                            space):
    body = _SCRIPT.replace("print(", "pass  # print(")
    if space == "function":
        body = body.replace("study.optimize([trial_config({model!r}, rewards=[reward_here])]",
                            "study.optimize(lambda trial: trial_config({model!r}, rewards=[reward_here])")
        body = body.replace("num_chunks=2,", "num_chunks=2, n_trials=1,")
    script = body.format(tests=str(Path(__file__).parent), model=str(tiny_model))
    done = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1
    assert ("reward_here: defined in a script read from standard input (python - < script.py); rfopt stores it by "
            "import path, for the other processes that need it (a worker, a resumed run, the dashboard's clone), and "
            "none can import it from there. Save the script as a file and run it (python script.py)") in done.stderr
    study = optuna.load_study(study_name="script", storage=f"sqlite:///{tmp_path / 'script.db'}")
    assert study.user_attrs == {} and study.trials == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.db"]


def test_training_rows_the_chunk_plan_leaves_out_are_counted_in_a_warning(scripted, tiny_model, tmp_path, caplog):
    study = _study(tmp_path)
    # 10 rows in 2 chunks of 5; a step takes 2 prompts (8 completions, 4 generations): 4 of each chunk train.
    configs = [trial_config(tiny_model), trial_config(tiny_model, per_device_train_batch_size=8)]
    _optimize(study, configs, train=prompts_dataset(10), num_chunks=2)
    assert ("study 's': configs[1]: it trains 8 of the 10 training rows (2 left out, the same ones every epoch): 2 "
            "chunks of 5 rows, of which it trains 4 each, in whole blocks of 2 prompts (generation cycles that end "
            "on an optimizer step). Every row trains with a multiple of 4 rows (num_chunks x 2), e.g. 8 or 12"
            ) in caplog.text
    caplog.clear()
    _optimize(_study(tmp_path, name="even"), configs, train=prompts_dataset(8), num_chunks=2)
    assert "left out" not in caplog.text
