"""How the command line refuses: an argument out of range is a usage error (exit code 2, argparse's message); any other
refusal is one line, ``rfopt: error: ...``, with exit code 1, where the refusal applies, and no traceback unless -v
asks for one; an unexpected error is named by its type; workers on several devices refuse once, before any starts.
(What each refusal says, whichever front end meets it: the other files in tests/refusals.)"""

import os
import subprocess
import sys

import optuna
import pytest

from refusalkit import contents, made_study
from rfopt.cli import main
from rfopt.errors import PlanError, StorageLocationError


# ---------------------------------------------------------------------- arguments out of range
def test_a_port_out_of_range_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["dashboard", "--port", "99999"])
    assert exit_.value.code == 2
    assert "argument --port: must be a port from 1 to 65535, got 99999" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "message"), [
    (["run", "study.py", "--num-chunks", "0"], "argument --num-chunks: must be 1 or more, got 0"),
    (["run", "study.py", "--max-concurrent", "0"], "argument --max-concurrent: must be 1 or more, got 0"),
    (["run", "study.py", "--n-trials", "-1"], "argument --n-trials: must be 0 or more, got -1"),
    (["run", "study.py", "--num-chunks", "two"], "argument --num-chunks: must be a whole number (1 or more), got 'two'"),
    (["worker", "study.py", "--num-chunks", "0"], "argument --num-chunks: must be 1 or more, got 0"),
    (["worker", "study.py", "--lease-seconds", "0"], "argument --lease-seconds: must be more than 0 seconds, got 0"),
])
def test_a_count_out_of_range_is_refused_by_the_parser_not_ignored(command, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- one line, exit code 1, the traceback under -v
def test_the_command_line_shows_where_a_refusal_applies_on_its_one_line():
    from rfopt.cli.program import _error_text

    refused = PlanError("each of the 8 chunks holds 2 prompts, fewer than the 4 one training step needs")
    refused.add_note("in configs[1]")
    assert _error_text(refused) == ("each of the 8 chunks holds 2 prompts, fewer than the 4 one training step needs "
                                    "(in configs[1])")


def test_unknown_study_in_status_is_a_clear_error(tmp_path, capsys):
    optuna.create_study(study_name="other", storage=f"sqlite:///{tmp_path / 'e.db'}")
    code = main(["status", "--storage", f"sqlite:///{tmp_path / 'e.db'}", "--study", "nope"])
    assert code == 1
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-v", "status"], ["status", "-v"], ["status", "--verbose"]])
def test_verbose_before_or_after_the_command_shows_the_traceback(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageLocationError, match="no SQLite file"):  # re-raised: Python prints its traceback
        main(argv)


@pytest.mark.subprocess
def test_a_user_error_prints_one_line_without_a_traceback_and_with_one_under_verbose(tmp_path):
    command = [sys.executable, "-m", "rfopt.cli", "status", "--storage", "sqlite:///missing.db"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    quiet = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)
    assert quiet.returncode == 1
    assert quiet.stderr == (f"rfopt: error: no SQLite file {tmp_path / 'missing.db'}; check --storage (in "
                            "sqlite:///path.db the path is relative to the working directory, "
                            f"{tmp_path}; sqlite:////abs/path.db is absolute)\n(run with -v for the traceback)\n")
    loud = subprocess.run([*command, "-v"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
                          check=False)
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr and "StorageLocationError: no SQLite file" in loud.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_error_is_named_by_its_type(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    made_study(tmp_path)
    monkeypatch.setattr(optuna, "load_study", lambda **kwargs: 1 / 0)
    assert main(["status", "--storage", "sqlite:///s.db"]) == 1
    assert "rfopt: error: ZeroDivisionError: division by zero\n(run with -v for the traceback)" in capsys.readouterr().err


# ---------------------------------------------------------------------- workers refuse once
def test_workers_on_several_devices_refuse_bad_input_once_before_starting_any(tmp_path, monkeypatch, capsys,
                                                                                study_file):
    monkeypatch.chdir(tmp_path)
    before = contents(tmp_path)
    assert main(["worker", str(study_file), "--devices", "cpu,cpu", "--storage", "sqllite:///x.db"]) == 1
    err = capsys.readouterr().err
    assert err.count("rfopt: error: storage 'sqllite:///x.db': unknown database kind") == 1
    assert "workers on" not in err  # no worker process was started
    assert contents(tmp_path) == before
