"""The command line: `rfopt run` on a study file, `rfopt status`, and help that helps."""

import os
import re
import subprocess
import sys

import optuna
import pytest

from rfopt.cli import main

STUDY_FILE = """
import optuna
import rfopt
from peft import LoraConfig
from trl import GRPOConfig
from datasets import Dataset

MODEL = {model!r}

def longer(completions, **kwargs):
    return [min(len(c), 8) / 8 for c in completions]

def space(trial):
    return rfopt.TrialConfig(
        model=MODEL,
        reward_funcs=[longer],
        args=GRPOConfig(learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                        num_train_epochs=1, bf16=False, use_cpu=True, gradient_checkpointing=False),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )

def datasets():
    rows = lambda n, p: Dataset.from_list([{{"prompt": f"{{p}}{{i}} say", "answer": "1"}} for i in range(n)])
    return rows(8, "Q"), rows(2, "E")

STUDY = rfopt.StudySpec(
    name="cli-demo", space=space, datasets=datasets, num_chunks=2, n_trials_total=3,
    pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    fast={{"n_trials_total": 2}},
)
"""


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_run_trains_a_study_file_then_status_shows_it(tiny_model, tmp_path):
    study_file = tmp_path / "tiny_study.py"
    study_file.write_text(STUDY_FILE.format(model=str(tiny_model)))
    storage = f"sqlite:///{tmp_path / 'cli.db'}"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "-m", "rfopt.cli", "run", str(study_file), "--storage", storage, "--fast"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "complete" in run.stdout
    assert "recommended adapter (PEFT format; trial " in run.stdout and "with no adapter: the baseline" in run.stdout
    # Not a terminal: plain lines, one per committed chunk, no "\r" redraws; no library progress bars or warnings.
    assert "\r" not in run.stderr and "Loading weights" not in run.stderr and "Warning" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("cli-demo: trial ")]
    committed = [line for line in lines if " committed: " in line]
    assert len(committed) == 3 and committed[0].startswith("cli-demo: trial 0 chunk 1 committed: ")  # 2 + 1 pruned
    assert re.search(r"\d+/\d+ steps, \d+/\d+ chunks", committed[0]), committed[0]
    # What the study is doing, one line per trial or gang and phase change: the baseline first, then the gang's phases.
    assert lines[0] == "cli-demo: trial 0 chunk 1/2: evaluating the base model with no adapter (the study's baseline)"
    assert "cli-demo: trials 0, 1 chunk 1/2: training" in run.stderr.splitlines()
    # The closing samples give each reward function's score, not only the total.
    assert re.search(r"reward: +[-\d.e]+ \(longer [-\d.e]+\)", run.stdout), run.stdout
    assert "eval means per reward function, recommended vs base: longer " in run.stdout
    assert f"optuna-dashboard {storage}" in run.stdout
    study = optuna.load_study(study_name="cli-demo", storage=storage)
    assert len(study.trials) == 2
    assert all(sorted(t.intermediate_values) == [0, 1] for t in study.trials if t.state.name == "COMPLETE")

    # The same command again continues the study: it is complete, so nothing new is trained.
    again = subprocess.run(
        [sys.executable, "-m", "rfopt.cli", "run", str(study_file), "--storage", storage, "--fast", "--no-progress"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(optuna.load_study(study_name="cli-demo", storage=storage).trials) == 2

    status = subprocess.run(
        [sys.executable, "-m", "rfopt.cli", "status", "--storage", storage],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert status.returncode == 0 and "cli-demo:" in status.stdout and "best" in status.stdout
    assert "; base " in status.stdout and "; take trial " in status.stdout


def test_run_in_this_process_reports_every_chunk_and_ends_with_the_leaderboard_samples_and_dashboard_command(
        scripted, tiny_model, tmp_path, monkeypatch, capsys):
    """`rfopt run` as the test above runs it, in this process and on scripted runners: what it prints."""
    study_file = tmp_path / "tiny_study.py"
    study_file.write_text(STUDY_FILE.format(model=str(tiny_model)))
    storage = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(study_file), "--storage", storage, "--fast"]) == 0
    out, err = capsys.readouterr()
    assert "complete" in out
    assert "recommended adapter (PEFT format; trial " in out and "with no adapter: the baseline" in out
    lines = [line for line in err.split("\n") if line.startswith("cli-demo: trial ")]
    assert lines and not [line for line in lines if "\r" in line]  # not a terminal: plain lines, no redraws
    committed = [line for line in lines if " committed: " in line]
    assert len(committed) == 3 and committed[0].startswith("cli-demo: trial 0 chunk 1 committed: ")  # 2 + 1 pruned
    assert re.search(r"\d+/\d+ steps, \d+/\d+ chunks", committed[0]), committed[0]
    assert lines[0] == "cli-demo: trial 0 chunk 1/2: evaluating the base model with no adapter (the study's baseline)"
    assert re.search(r"reward: +[-\d.e]+ \(longer [-\d.e]+\)", out), out
    assert "eval means per reward function, recommended vs base: longer " in out
    assert f"optuna-dashboard {storage}" in out
    assert len(optuna.load_study(study_name="cli-demo", storage=storage).trials) == 2

    assert main(["run", str(study_file), "--storage", storage, "--fast", "--no-progress"]) == 0  # nothing left
    assert len(optuna.load_study(study_name="cli-demo", storage=storage).trials) == 2
    capsys.readouterr()
    assert main(["status", "--storage", storage]) == 0
    status = capsys.readouterr().out
    assert "cli-demo:" in status and "best" in status


def test_status_of_one_study_prints_its_leaderboard(tiny_model, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="x", storage=storage, direction="maximize")
    trial = study.ask()
    trial.report(0.5, 0)
    study.tell(trial, 0.5)
    assert main(["status", "--storage", storage, "--study", "x"]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "0.5000" in out


def test_help_describes_every_command(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    for command in ("run", "status"):
        assert command in out
    try:
        main(["run", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--storage" in out and "--fast" in out and "examples:" in out


def test_version_prints_rfopt_and_the_libraries_it_drives(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"rfopt {version('rfopt')}"
    for library in ("optuna", "trl", "transformers", "peft", "torch"):
        assert f"  {library} {version(library)}" in lines


@pytest.mark.parametrize("flag", ["--study", "--study-name"])
def test_run_names_its_study_with_study_or_study_name(flag, tmp_path, monkeypatch, capsys, study_file):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(study_file), flag, "chosen", "--no-progress"]) == 1  # its data cannot be loaded
    err = capsys.readouterr().err
    assert f"rfopt: study 'chosen' from {study_file}" in err and "this test's study has no data" in err


@pytest.mark.parametrize("flag", ["--study", "--study-name"])
def test_status_and_ops_name_the_study_with_study_or_study_name(flag, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(study_name="x", storage=url, direction="maximize").ask()
    assert main(["status", "--storage", url, flag, "x"]) == 0
    assert "interrupted" in capsys.readouterr().out  # RUNNING in Optuna, and nobody runs it
    assert main(["pause", "0", "--storage", url, flag, "x"]) == 0
    assert "trial 0: pause requested" in capsys.readouterr().out
    assert main(["resume", "0", "--storage", url, flag, "x"]) == 0
    assert "trial 0: resume requested" in capsys.readouterr().out


def test_commands_on_a_study_need_no_name_where_the_storage_holds_one(tmp_path, capsys):
    from rfopt.storage.schema import TrialRecord

    storage = f"sqlite:///{tmp_path / 'one.db'}"
    study = optuna.create_study(study_name="only", storage=storage, direction="maximize")
    study.ask()
    assert main(["pause", "0", "--storage", storage]) == 0
    assert [r.op for r in TrialRecord(study.trials[0]).pending] == ["pause"]
    assert main(["withdraw", "pause", "0", "--storage", storage]) == 0
    assert main(["status", "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "only: 1 " in out and "trial  state" in out  # its line, then the study shown whole
    optuna.create_study(study_name="other", storage=storage)
    assert main(["stop", "0", "--storage", storage]) == 1
    err = capsys.readouterr().err
    assert "which study? " in err and "holds 2: only, other; name one with --study NAME" in err
