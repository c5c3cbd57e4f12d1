"""Bad input on the command line and in storage URLs is refused at once, with one clear line, before anything is
stored: no database file appears, no file changes, no traceback unless -v asks for one."""

import os
import subprocess
import sys
import time

import optuna
import pytest

import rfopt
from rfopt.cli import main
from rfopt.storage.database import StorageLocationError, check_url, open_storage, retry

# A valid study file whose data cannot be loaded: `rfopt run` on it gets as far as reading its data and no further,
# so a test sees what run does before training (the banner, the storage check) without training anything.
STUDY_FILE = """
import rfopt

def datasets():
    raise ValueError("this test's study has no data")

STUDY = rfopt.StudySpec(name="file-name", space=lambda trial: None, datasets=datasets)
"""


@pytest.fixture
def study_file(tmp_path):
    path = tmp_path / "study.py"
    path.write_text(STUDY_FILE)
    return path


def _files(folder):
    """Every file under `folder` with its contents: what a refused command must leave as it was."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _made_study(tmp_path, name="x"):
    """A study with one RUNNING trial in tmp/s.db, made with Optuna directly (nothing is trained)."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    study.ask()
    return url


# ---------------------------------------------------------------------- SQLite location
def test_a_missing_sqlite_folder_fails_at_once_naming_the_folder_not_a_server(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(StorageLocationError) as error:
        open_storage("sqlite:///no/such/dir/x.db")
    with pytest.raises(StorageLocationError):
        rfopt.create_study("s", "sqlite:///no/such/dir/x.db")
    assert main(["status", "--storage", "sqlite:///no/such/dir/x.db"]) == 1
    assert time.monotonic() - started < 5  # not the 300 s of retries an unreachable server gets
    folder = tmp_path / "no" / "such" / "dir"
    assert str(error.value) == (f"SQLite file {folder / 'x.db'}: its folder {folder} does not exist; "
                                f"create it (mkdir -p {folder}) or give another --storage")
    assert "server" not in str(error.value)
    assert not (tmp_path / "no").exists()


def test_run_on_a_missing_sqlite_folder_fails_before_the_study_file_is_loaded(tmp_path, monkeypatch, capsys,
                                                                               study_file):
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert main(["run", str(study_file), "--storage", "sqlite:///no/x.db"]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: SQLite file {tmp_path / 'no' / 'x.db'}: its folder {tmp_path / 'no'} does not exist" in err
    assert "no data" not in err  # refused before the study file ran
    assert _files(tmp_path) == before


def test_a_sqlite_path_under_a_regular_file_is_refused_as_not_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("not a folder")
    before = _files(tmp_path)
    for url in ("sqlite:///file.txt/x.db", "sqlite:///file.txt/sub/x.db"):
        with pytest.raises(StorageLocationError, match=f"{tmp_path / 'file.txt'} is not a folder"):
            open_storage(url)
    assert _files(tmp_path) == before


def test_a_sqlite_path_that_is_a_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "db").mkdir()
    with pytest.raises(StorageLocationError, match=f"SQLite file {tmp_path / 'db'} is a folder, not a database file"):
        open_storage("sqlite:///db")


def test_an_unwritable_sqlite_folder_or_file_is_refused_as_the_check_sees_it(tmp_path, monkeypatch):
    """Root writes anywhere, so this test makes `os.access` deny writing (to the folder, then to the file) and checks
    the refusal the check builds from it; the next test shows a real read-only folder when not run as root."""
    real_access = os.access
    url = f"sqlite:///{tmp_path / 'x.db'}"
    (tmp_path / "x.db").write_bytes(b"")
    for denied, what in ((tmp_path, f"its folder {tmp_path}"), (tmp_path / "x.db", "the file")):

        def access(path, mode, denied=denied):
            return not (mode & os.W_OK and str(path) == str(denied)) and real_access(path, mode)

        monkeypatch.setattr(os, "access", access)
        with pytest.raises(StorageLocationError) as error:
            open_storage(url)
        assert str(error.value) == (f"SQLite file {tmp_path / 'x.db'}: {what} is not writable by this user; "
                                    "fix its permissions or give another --storage")
        assert check_url(url, create=False)  # reading needs no write access
        monkeypatch.setattr(os, "access", real_access)
    assert (tmp_path / "x.db").read_bytes() == b""


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only folder")
def test_a_read_only_sqlite_folder_is_refused_before_connecting(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(StorageLocationError, match="is not writable by this user"):
            open_storage(f"sqlite:///{folder / 'x.db'}")
        assert not (folder / "x.db").exists()
    finally:
        folder.chmod(0o755)


def test_sqlite_failing_to_open_its_file_is_not_retried_for_minutes(tmp_path):
    """The folder vanishing between the check and the connection: SQLite's "unable to open database file" is not a
    lock, so it is refused at once (a locked database is still retried: tests/storage/test_faults.py)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'gone' / 'x.db'}")
    started = time.monotonic()
    with pytest.raises(StorageLocationError, match="unable to open database file"):
        retry(lambda: engine.connect(), 300, "sqlite:///gone/x.db", "connect")
    assert time.monotonic() - started < 5


# ---------------------------------------------------------------------- read-only commands create nothing
@pytest.mark.parametrize("command", [
    ["status"],
    ["status", "--study", "x"],
    ["pause", "0", "--study", "x"],
    ["resume", "0", "--study", "x"],
    ["stop", "0", "--study", "x"],
    ["clone", "0", "--study", "x", "--set", "learning_rate=1e-3"],
    ["dashboard", "--port", "8089"],
])
def test_a_command_that_reads_a_study_creates_no_database_where_there_is_none(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--storage", "sqlite:///mistyped.db"]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: no SQLite file {tmp_path / 'mistyped.db'}; check --storage" in err
    assert f"relative to the working directory, {tmp_path}" in err
    assert list(tmp_path.iterdir()) == []


def test_open_storage_without_create_refuses_a_missing_file_and_opens_an_existing_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageLocationError, match=f"no SQLite file {tmp_path / 'x.db'}"):
        open_storage("sqlite:///x.db", create=False)
    with pytest.raises(StorageLocationError) as error:  # an absolute path needs no word on the working directory
        open_storage(f"sqlite:///{tmp_path / 'y.db'}", create=False)
    assert str(error.value) == f"no SQLite file {tmp_path / 'y.db'}; check --storage"
    assert list(tmp_path.iterdir()) == []
    _made_study(tmp_path)
    assert optuna.get_all_study_summaries(open_storage("sqlite:///s.db", create=False))[0].study_name == "x"


# ---------------------------------------------------------------------- malformed input
@pytest.mark.parametrize(("url", "message"), [
    ("sqllite:///x.db", "storage 'sqllite:///x.db': unknown database kind 'sqllite'; give sqlite:///path.db"),
    ("postgres//x", "storage 'postgres//x' is not a database URL; give sqlite:///path.db"),
    ("postgres://rfopt:secret@db/rfopt",
     "storage 'postgres://rfopt:***@db/rfopt': unknown database kind 'postgres' (SQLAlchemy spells it postgresql://)"),
    ("rfopt.db", "storage 'rfopt.db' is not a database URL"),
    ("postgresql://rfopt:secret@db:notaport/rfopt",
     "storage 'postgresql://rfopt:***@db:notaport/rfopt': its port is not a number (invalid literal for int() with base "
     "10: 'notaport'); give sqlite:///path.db"),
    ("postgresql://rfopt@db:99999/rfopt", "storage 'postgresql://rfopt@db:99999/rfopt': port 99999 is not a port (1 to "
                                          "65535); give sqlite:///path.db"),
    ("mssql+pymssql://rfopt@db/rfopt", "storage 'mssql+pymssql://rfopt@db/rfopt': the Python driver for "
                                       "'mssql+pymssql' is not installed (No module named 'pymssql'); install it, or "
                                       "give sqlite:///path.db"),
    ("sqlite://", "storage 'sqlite://' is an in-memory SQLite database, which ends with this command and holds no study "
                  "before it; give a file: sqlite:///path.db"),
    ("sqlite://s.db", "storage 'sqlite://s.db' is not a SQLite URL: 's.db' stands where a host would, and a SQLite file "
                      "is named after three slashes: sqlite:///s.db; give sqlite:///path.db"),
])
@pytest.mark.parametrize("command", [["status"], ["run", "study.py"]])
def test_a_malformed_storage_url_is_one_line_naming_the_url_and_the_accepted_forms(url, message, command, tmp_path,
                                                                                    monkeypatch, capsys, study_file):
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert main([*command, "--storage", url]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: {message}" in err
    assert "postgresql://user@host/db" in err and "Traceback" not in err
    assert _files(tmp_path) == before


@pytest.mark.parametrize(("url", "message"), [
    ("", "storage '' is not a database URL; give sqlite:///path.db"),
    ("sqlite://s.db", "storage 'sqlite://s.db' is not a SQLite URL: 's.db' stands where a host would"),
    ("sqllite:///x.db", "storage 'sqllite:///x.db': unknown database kind 'sqllite'"),
])
def test_the_python_api_refuses_a_malformed_storage_as_the_command_line_does_creating_nothing(url, message, tmp_path,
                                                                                             monkeypatch):
    """Issue 35: ``create_study(storage="")`` silently made rfopt.db; ``"sqlite://s.db"`` gave SQLAlchemy's raw
    error."""
    import rfopt
    from rfopt.storage.database import StorageLocationError

    monkeypatch.chdir(tmp_path)
    for call in (lambda: rfopt.create_study(study_name="x", storage=url), lambda: rfopt.load_study("x", url)):
        with pytest.raises(StorageLocationError) as raised:
            call()
        assert message in str(raised.value) and "postgresql://user@host/db" in str(raised.value)
    assert list(tmp_path.iterdir()) == []


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
    before = _files(tmp_path)
    assert main(["run", "broken.py"]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: study file broken.py: {message}\n(run with -v for the traceback)\n" in err
    assert "Traceback" not in err
    assert _files(tmp_path) == before  # not even the default rfopt.db


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


# ---------------------------------------------------------------------- one flag per thing, anywhere
@pytest.mark.parametrize("flag", ["--study", "--study-name"])
def test_run_names_its_study_with_study_or_study_name(flag, tmp_path, monkeypatch, capsys, study_file):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(study_file), flag, "chosen", "--no-progress"]) == 1  # its data cannot be loaded
    err = capsys.readouterr().err
    assert f"rfopt: study 'chosen' from {study_file}" in err and "this test's study has no data" in err


@pytest.mark.parametrize("flag", ["--study", "--study-name"])
def test_status_and_ops_name_the_study_with_study_or_study_name(flag, tmp_path, capsys):
    url = _made_study(tmp_path)
    assert main(["status", "--storage", url, flag, "x"]) == 0
    assert "interrupted" in capsys.readouterr().out  # RUNNING in Optuna, and nobody runs it
    assert main(["pause", "0", "--storage", url, flag, "x"]) == 0
    assert "trial 0: pause requested" in capsys.readouterr().out
    assert main(["resume", "0", "--storage", url, flag, "x"]) == 0
    assert "trial 0: resume requested" in capsys.readouterr().out


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
    _made_study(tmp_path)
    monkeypatch.setattr(optuna, "load_study", lambda **kwargs: 1 / 0)
    assert main(["status", "--storage", "sqlite:///s.db"]) == 1
    assert "rfopt: error: ZeroDivisionError: division by zero\n(run with -v for the traceback)" in capsys.readouterr().err


def test_version_prints_rfopt_and_the_libraries_it_drives(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"rfopt {version('rfopt')}"
    for library in ("optuna", "trl", "transformers", "peft", "torch"):
        assert f"  {library} {version(library)}" in lines


def test_workers_on_several_devices_refuse_bad_input_once_before_starting_any(tmp_path, monkeypatch, capsys,
                                                                                study_file):
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert main(["worker", str(study_file), "--devices", "cpu,cpu", "--storage", "sqllite:///x.db"]) == 1
    err = capsys.readouterr().err
    assert err.count("rfopt: error: storage 'sqllite:///x.db': unknown database kind") == 1
    assert "workers on" not in err  # no worker process was started
    assert _files(tmp_path) == before
