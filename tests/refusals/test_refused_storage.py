"""Where a study is stored: a storage URL that is malformed, a SQLite file or folder that is missing, not a folder,
not writable, or not there for a command that only reads. Refused at once, from the Python API and from the command
line alike, with one line that names the URL or path and what to give instead, before anything is created: no database
file appears and no file changes. (A database that fails while a study runs, retried or not:
tests/storage/test_faults.py.)"""

import os
import time

import optuna
import pytest

import rfopt
from refusalkit import contents, made_study
from rfopt.cli import main
from rfopt.errors import StorageLocationError
from rfopt.storage.database import check_url, open_storage, retry


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
    before = contents(tmp_path)
    assert main(["run", str(study_file), "--storage", "sqlite:///no/x.db"]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: SQLite file {tmp_path / 'no' / 'x.db'}: its folder {tmp_path / 'no'} does not exist" in err
    assert "no data" not in err  # refused before the study file ran
    assert contents(tmp_path) == before


def test_a_sqlite_path_under_a_regular_file_is_refused_as_not_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("not a folder")
    before = contents(tmp_path)
    for url in ("sqlite:///file.txt/x.db", "sqlite:///file.txt/sub/x.db"):
        with pytest.raises(StorageLocationError, match=f"{tmp_path / 'file.txt'} is not a folder"):
            open_storage(url)
    assert contents(tmp_path) == before


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
    made_study(tmp_path)
    assert optuna.get_all_study_summaries(open_storage("sqlite:///s.db", create=False))[0].study_name == "x"


# ---------------------------------------------------------------------- malformed URLs
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
    before = contents(tmp_path)
    assert main([*command, "--storage", url]) == 1
    err = capsys.readouterr().err
    assert f"rfopt: error: {message}" in err
    assert "postgresql://user@host/db" in err and "Traceback" not in err
    assert contents(tmp_path) == before


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
    from rfopt.errors import StorageLocationError

    monkeypatch.chdir(tmp_path)
    for call in (lambda: rfopt.create_study(study_name="x", storage=url), lambda: rfopt.load_study("x", url)):
        with pytest.raises(StorageLocationError) as raised:
            call()
        assert message in str(raised.value) and "postgresql://user@host/db" in str(raised.value)
    assert list(tmp_path.iterdir()) == []
