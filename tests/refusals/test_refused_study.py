"""The study API's refusals about a study as a whole, each before anything is stored, with a message that names the
input and the fix: a study name that would choose a location; a tracker or a pruner whose package is not installed;
inputs its results depend on that differ from the ones it ran with (its datasets, a list's configs: results never
mix); run arguments (n_trials, objective, eval settings, device). A study deleted while it runs stops the run, saying
so. Every refused input is an `rfopt.errors.Refusal` (an `rfopt.RfoptError`, and the builtin error callers caught it
by before)."""

import re

import optuna
import pytest

import rfopt
from refusalkit import EVAL, TRAIN, optimize, paths_under, snapshot, stored, study_at, untouched
from rfopt.errors import ConfigError, MissingPackage, Refusal, StudyDeletedError, StudyNameError
from rfopt.storage.schema import TrialRecord, study_attrs
from rfopt_testkit import prompts_dataset, trial_config
from stored_study import stored_study


# ---------------------------------------------------------------------- a refusal is an RfoptError
def test_a_refusal_is_an_rfopt_error_and_the_builtin_error_callers_catch_it_by():
    from rfopt.engine.planning.request import RunRequest
    from rfopt.errors import TypeRefusal

    for kind, builtin in ((Refusal, ValueError), (TypeRefusal, TypeError), (MissingPackage, ImportError)):
        assert issubclass(kind, rfopt.RfoptError) and issubclass(kind, builtin) and issubclass(kind, ValueError)
    with pytest.raises(TypeError, match=r"callbacks: 1 is not callable") as refused:
        RunRequest([], TRAIN, EVAL, callbacks=[1])
    assert isinstance(refused.value, rfopt.RfoptError)


def _public_api_refusals(tmp_path):
    """(what, call, the builtin error it raised before it was an RfoptError): what the public API refuses on purpose,
    outside a run, from an empty study to an argument out of range."""
    from rfopt.config.studyfile import find_study_file
    from rfopt.rewards import length_reward
    from rfopt.rewards.math_answers import math_accuracy_for
    from rfopt.studies.data import load_arithmetic

    storage = f"sqlite:///{tmp_path / 'empty.db'}"
    empty = rfopt.create_study(study_name="empty", storage=storage)
    return [
        ("load_study of a missing study", lambda: rfopt.load_study(study_name="nope", storage=storage), LookupError),
        ("export_best before a checkpoint", lambda: empty.export_best(tmp_path / "out"), LookupError),
        ("best_adapter before a checkpoint", lambda: empty.best_adapter(), LookupError),
        ("best_adapter(best_trial=True) before a trial", lambda: empty.best_adapter(best_trial=True), LookupError),
        ("best_config before a trial", lambda: empty.best_config, LookupError),
        ("trial_config of a missing trial", lambda: empty.trial_config(0), IndexError),
        ("chunk_metrics of a missing trial", lambda: empty.chunk_metrics(3), IndexError),
        ("checkpoints before a run", lambda: empty.checkpoints, LookupError),
        ("Study.stop(trial)", lambda: empty.stop(3), TypeError),
        ("PopulationBasedTraining(interval=0)", lambda: rfopt.PopulationBasedTraining(interval=0), ValueError),
        ("RayCluster(num_workers=0)", lambda: rfopt.RayCluster(num_workers=0), ValueError),
        ("length_reward(-1)", lambda: length_reward(-1), ValueError),
        ("math_accuracy_for([])", lambda: math_accuracy_for([]), ValueError),
        ("load_arithmetic(difficulty='x')", lambda: load_arithmetic(n_train=2, n_test=2, difficulty="x"), ValueError),
        ("a missing study file", lambda: find_study_file(tmp_path / "none.py"), FileNotFoundError),
    ]


def test_every_refusal_of_the_public_api_is_an_rfopt_error_of_its_old_builtin_kind(tmp_path):
    """Issue 41 item 17: ``except rfopt.RfoptError`` missed what rfopt raised on purpose (LookupError, IndexError,
    ValueError); each is an RfoptError now, and still the builtin error a caller caught it by."""
    from rfopt.errors import NoSuchTrial, NothingToAnswer

    for what, call, builtin in _public_api_refusals(tmp_path):
        with pytest.raises(builtin) as raised:
            call()
        assert isinstance(raised.value, rfopt.RfoptError), f"{what}: {type(raised.value).__name__}: {raised.value}"
        if builtin is LookupError:
            assert isinstance(raised.value, NothingToAnswer), what
    with pytest.raises(NoSuchTrial, match=r"study 'empty' has no trial 0: it holds no trial yet"):
        rfopt.load_study(study_name="empty", storage=f"sqlite:///{tmp_path / 'empty.db'}").trial_config(0)


@pytest.mark.parametrize("value, refused", [("bogus", "give one of eager, graph, compiled"),
                                             ("graph", "needs a CUDA device, and this study trains on 'cpu'"),
                                             (" Compiled ", "needs a CUDA device")])
def test_a_bad_rfopt_decode_is_refused_before_anything_is_stored(tiny_model, tmp_path, monkeypatch, value, refused):
    """Issue 41 item 16: RFOPT_DECODE was read after the trials were stored and the baseline evaluated, ended the call
    with a plain ValueError and left every trial RUNNING."""
    monkeypatch.setenv("RFOPT_DECODE", value)
    study = study_at(tmp_path)
    with pytest.raises(Refusal, match=re.escape(f"RFOPT_DECODE={value!r}") + ".*" + re.escape(refused)):
        optimize(study, [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-3)], gang_size=2)
    untouched(study, tmp_path)


def test_rfopt_decode_is_read_stripped_in_any_case():
    from rfopt.training.rollouts.batched import decode_env, default_mode

    for value, device, mode in [(" EAGER ", "cpu", "eager"), ("Graph", "cuda:1", "graph"), ("", "cpu", "eager"),
                                ("  ", "cuda", "graph")]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RFOPT_DECODE", value)
            assert default_mode(device) == mode
            assert decode_env(None) == (value.strip().lower() or None)


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


@pytest.mark.parametrize(("name", "problem"), _BAD_NAMES)
def test_a_study_name_that_would_choose_a_location_is_refused_before_anything_is_stored(tiny_model, tmp_path,
                                                                                        monkeypatch, name, problem):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    name = name.format(tmp=tmp_path)
    before = paths_under(tmp_path)
    rule = (r"; a study name is also a folder name \(rfopt-checkpoints/<name>-<id>, a tracker's run\): use letters, "
            r"digits, spaces and \. _ - \+ = @, at most 128 characters")
    with pytest.raises(StudyNameError, match=f"study name .*: {problem}{rule}"):
        rfopt.create_study(study_name=name, storage=f"sqlite:///{work / 'study.db'}")
    assert paths_under(tmp_path) == before  # not even the database file

    # A study Optuna itself made under such a name is refused by rfopt before it writes anything.
    url = f"sqlite:///{work / 'optuna.db'}"
    optuna.create_study(study_name=name, storage=url)
    study = rfopt.load_study(name, url)
    before = paths_under(tmp_path)
    with pytest.raises(StudyNameError, match=f"{problem}{rule}"):
        optimize(study, [trial_config(tiny_model)])
    untouched(study, work)
    assert paths_under(tmp_path) == before


def test_a_study_name_of_letters_digits_and_allowed_signs_makes_its_folder_inside_the_checkpoint_root(
        scripted, tiny_model, tmp_path):
    study = study_at(tmp_path, name="gsm8k v2_lr=1e-3+lora@8.b-1")
    optimize(study, [trial_config(tiny_model)], num_chunks=1)
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
    assert paths_under(tmp_path) == ["study.py"]


# ---------------------------------------------------------------------- what a study needs installed
def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_stored(tiny_model, tmp_path, monkeypatch,
                                                                              capsys):
    from transformers.integrations import integration_utils

    from rfopt.cli import main

    monkeypatch.setattr(integration_utils, "is_wandb_available", lambda: False)  # as on a machine without wandb
    says = (r"report_to: wandb is not installed here, so every trial would fail at its first chunk; install it \(pip "
            r"install wandb\) or leave it out of report_to")
    with pytest.raises(MissingPackage, match=says + r" .*; pip install 'rfopt\[trackers\]' installs the four"):
        rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", report_to="wandb")
    assert not (tmp_path / "study.db").exists()
    study = study_at(tmp_path)
    with pytest.raises(Refusal, match=says):
        optimize(study, [trial_config(tiny_model)], report_to=["tensorboard", "wandb"])
    untouched(study, tmp_path)

    monkeypatch.chdir(tmp_path)
    study_file = tmp_path / "study.py"
    study_file.write_text("raise SystemExit('the study file must not even be imported')\n")
    assert main(["run", str(study_file), "--report-to", "wandb", "--storage", "sqlite:///cli.db"]) == 1
    assert capsys.readouterr().err.startswith("rfopt: error: report_to: wandb is not installed here")
    assert not (tmp_path / "cli.db").exists()

    # Installed, the same call runs (nothing was burned by the refusal).
    monkeypatch.setattr(integration_utils, "is_wandb_available", lambda: True)
    assert rfopt.training.trackers.normalize("wandb") == ["wandb"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("scipy") is not None, reason="scipy is installed")
def test_a_wilcoxon_pruner_without_scipy_is_refused_when_the_study_is_created(tmp_path):
    for pruner in (optuna.pruners.WilcoxonPruner(), optuna.pruners.PatientPruner(optuna.pruners.WilcoxonPruner(), 1)):
        with pytest.raises(MissingPackage, match="WilcoxonPruner needs scipy, which is not installed: pip install scipy"):
            study_at(tmp_path, pruner=pruner)
    assert optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'study.db'}") == []


# ---------------------------------------------------------------------- results that must not mix
def test_a_different_eval_set_is_refused_when_a_study_continues(tiny_model, tmp_path):
    study = stored(tmp_path, [trial_config(tiny_model)])
    before = snapshot(study, tmp_path)
    more = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-3)]
    with pytest.raises(Refusal, match=r"this call's eval_dataset is not the one its trials were evaluated on .*"
                       "Use the same one to continue the study, or a new study name"):
        optimize(study, more, evaluation=prompts_dataset(2, "Other"))
    assert snapshot(study, tmp_path) == before


def test_study_refuses_a_different_training_set_on_rerun(tiny_model, storage):
    study = stored_study(storage, "s", [trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), num_chunks=1)
    with pytest.raises(Refusal, match="this call.s train_dataset is not the one it was run with"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8, prefix="X"), prompts_dataset(2),
                       num_chunks=1, show_progress_bar=False)
    with pytest.raises(Refusal, match="was planned with num_chunks=1, and this call gives num_chunks=2"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), num_chunks=2,
                       show_progress_bar=False)


def test_a_list_study_grows_and_its_new_configs_become_new_trials_with_their_params(
        scripted, tiny_model, tmp_path, caplog):
    base = trial_config(tiny_model)
    study = study_at(tmp_path)
    optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3]))
    first = [(t.number, t.params, t.intermediate_values) for t in study.optuna.get_trials()]

    optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3, 3e-3]))
    trials = study.optuna.get_trials()
    assert [(t.number, t.params, t.intermediate_values) for t in trials[:2]] == first  # kept as they were
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert trials[2].params == {"learning_rate": 3e-3} and TrialRecord(trials[2]).list_index == 2
    assert isinstance(trials[2].distributions["learning_rate"], optuna.distributions.FloatDistribution)

    optimize(study, rfopt.grid(base, learning_rate=[1e-3, 2e-3, 3e-3]))  # nothing left: says so
    assert len(study.optuna.get_trials()) == 3
    assert "study 's': nothing to do (3 COMPLETE): every one of the list's 3 configs has run" in caplog.text


def test_a_changed_config_of_a_list_study_is_refused_naming_what_changed(tiny_model, tmp_path):
    base = trial_config(tiny_model)
    study = stored(tmp_path, rfopt.grid(base, learning_rate=[1e-3, 2e-3]))
    before = snapshot(study, tmp_path)
    with pytest.raises(ConfigError, match=r"configs\[1\] is not the config this study ran .* "
                       r"\(learning_rate 0.002 -> 0.005\); a config that has run cannot change. Keep it as it was and "
                       "append the changed config at the end of the list"):
        optimize(study, rfopt.grid(base, learning_rate=[1e-3, 5e-3]))
    assert snapshot(study, tmp_path) == before


def test_a_list_that_adds_a_choice_to_a_categorical_param_is_refused(tiny_model, tmp_path):
    base = trial_config(tiny_model)
    study = stored(tmp_path, rfopt.grid(base, lr_scheduler_type=["linear", "constant"]), num_chunks=1)
    before = snapshot(study, tmp_path)
    with pytest.raises(ConfigError, match=r"lr_scheduler_type: the list now gives \['cosine'\], which the "
                       "study's trials did not have as choices"):
        optimize(study, rfopt.grid(base, lr_scheduler_type=["linear", "constant", "cosine"]), num_chunks=1)
    assert snapshot(study, tmp_path) == before


# ---------------------------------------------------------------------- run arguments
def test_n_trials_beyond_a_lists_configs_is_refused(tiny_model, tmp_path):
    study = study_at(tmp_path)
    with pytest.raises(Refusal, match=r"n_trials=3, but 1 of the list's 1 configs are left to run; .*leave "
                       "n_trials out"):
        optimize(study, [trial_config(tiny_model)], n_trials=3)
    untouched(study, tmp_path)


@pytest.mark.parametrize("kind", ["list", "function"])
def test_a_mistyped_objective_is_refused_before_anything_trains_and_the_fixed_call_runs(
        scripted, tiny_model, tmp_path, kind):
    study = study_at(tmp_path)
    space = [trial_config(tiny_model)] if kind == "list" else (lambda trial: trial_config(tiny_model))
    n_trials = None if kind == "list" else 1
    with pytest.raises(Refusal, match=r"objective='goood' is neither 'reward' .* nor the name of one of the reward "
                       r"functions \['reward_len', 'reward_vowels'\]"):
        optimize(study, space, n_trials=n_trials, objective="goood")
    untouched(study, tmp_path)
    optimize(study, space, n_trials=n_trials, objective="reward_len")
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


# ---------------------------------------------------------------------- a study deleted while it runs
def test_a_study_deleted_while_it_runs_stops_the_run_saying_so(scripted, tiny_model, tmp_path):
    study = study_at(tmp_path, name="gone")
    url = f"sqlite:///{tmp_path / 'study.db'}"

    def delete(number, step, value):  # what optuna-dashboard's delete button does to the storage
        optuna.delete_study(study_name="gone", storage=url)

    with pytest.raises(StudyDeletedError, match=r"study 'gone' was deleted from its storage \(sqlite:///.*\) "
                       r"while this process ran it \(optuna-dashboard's delete button, or optuna.delete_study\): its "
                       r"trials and results are gone from the database, and this run stopped. Its checkpoints are "
                       r"still in .*rfopt-checkpoints/gone-"):
        optimize(study, rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3]), on_unit=delete)
    assert optuna.get_all_study_summaries(url) == []
