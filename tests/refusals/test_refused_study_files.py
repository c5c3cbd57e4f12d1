"""The code rfopt must import: a study file that is missing, fails to import, exits while it is imported, or whose
datasets function fails is named with the file, the error and its line, in one line, before anything is stored; a
script's reward function is stored by import path, and a script no other process can import (read from standard input,
or one that starts a study when it is imported) is refused with what to do instead."""

import json
import os
import subprocess
import sys

import optuna
import pytest

import rfopt
from crashkit import TESTS
from refusalkit import contents
from rfopt.cli import main
from rfopt.errors import ConfigError
from rfopt.storage.schema import trial_attrs


# ---------------------------------------------------------------------- a study file that cannot be read
def test_a_missing_study_file_is_a_clear_error(capsys):
    assert main(["run", "no/such/study.py"]) == 1
    assert "study file no/such/study.py does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("source", "message"), [
    ("import rfopt\n\nSTUDY = rfopt.StudySpec(name='x',\n", "SyntaxError: '(' was never closed (line 3)"),
    ("import rfopt\nimport no_such_module_anywhere\n",
     "ModuleNotFoundError: No module named 'no_such_module_anywhere' (line 2)"),
    ("x = 1\nraise RuntimeError('boom')\n", "RuntimeError: boom (line 2)"),
])
def test_a_study_file_that_fails_to_import_is_named_with_the_error_and_its_line(source, message, tmp_path,
                                                                               monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "broken.py"
    path.write_text(source)
    before = contents(tmp_path)
    assert main(["run", "broken.py"]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: study file broken.py: {message}\n(run with -v for the traceback)\n" in err
    assert "Traceback" not in err
    assert contents(tmp_path) == before  # not even the default rfopt.db


@pytest.mark.parametrize("value", ["'no'", "1", "None"])
def test_a_study_files_prune_collapsed_that_is_not_a_bool_is_refused(value, tmp_path, monkeypatch, capsys):
    """Issue 41 item 12: ``prune_collapsed="no"`` was accepted, and turned the guard on."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("import rfopt\n\nSTUDY = rfopt.StudySpec(name='x', space=lambda trial: None, "
                                   f"datasets=lambda: None, prune_collapsed={value})\n")
    assert main(["run", "s.py"]) == 1
    assert f"StudySpec 'x': prune_collapsed={value}: give True (prune a trial" in capsys.readouterr().err
    assert list(p.name for p in tmp_path.iterdir()) == ["s.py"]


def test_a_study_file_that_calls_sys_exit_when_imported_is_named_not_a_silent_exit(tmp_path, monkeypatch, capsys):
    """Issue 35: ``sys.exit(3)`` at import exited with code 3 and no message."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    assert main(["run", "exits.py"]) == 1
    err = capsys.readouterr().err
    assert "rfopt: error: study file exits.py: it called sys.exit(3) (line 2) while it was imported" in err
    assert list(p.name for p in tmp_path.iterdir()) == ["exits.py"]


DATASETS_RAISE = """
import rfopt
from rfopt_testkit import trial_config

def load_data():
    return 1 / 0

STUDY = rfopt.StudySpec(name="x", space=[trial_config("m")], datasets=load_data)
"""


def test_a_study_files_datasets_function_that_raises_is_named_with_the_file_and_line(tmp_path, monkeypatch, capsys):
    """Issue 35: a ``datasets`` callable that raised gave a bare ``ZeroDivisionError``: which file, which function?"""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data_study.py").write_text(DATASETS_RAISE)
    assert main(["run", "data_study.py"]) == 1
    err = capsys.readouterr().err
    assert ("rfopt: error: study file data_study.py: its datasets function load_data failed: ZeroDivisionError: "
            "division by zero (line 6)") in err
    assert list(p.name for p in tmp_path.iterdir()) == ["data_study.py"]


# ---------------------------------------------------------------------- a script's reward functions
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
    script.write_text(_SCRIPT.format(tests=str(TESTS), model=str(tiny_model)))
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
    script.write_text(_SCRIPT_WITH_MAIN.format(tests=str(TESTS), model=str(tiny_model)))
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
    script = body.format(tests=str(TESTS), model=str(tiny_model))
    done = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1
    assert ("reward_here: defined in a script read from standard input (python - < script.py); rfopt stores it by "
            "import path, for the other processes that need it (a worker, a resumed run, the dashboard's clone), and "
            "none can import it from there. Save the script as a file and run it (python script.py)") in done.stderr
    study = optuna.load_study(study_name="script", storage=f"sqlite:///{tmp_path / 'script.db'}")
    assert study.user_attrs == {} and study.trials == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.db"]
