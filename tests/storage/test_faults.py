"""Storage and infrastructure faults: a corrupt or missing checkpoint fails only its trial, with the reason
stored; a full disk fails the trial cleanly and keeps its previous checkpoint; a locked or unreachable
database is retried with backoff, one budget per outage, then a clear error; a database that refuses for a
reason waiting does not fix (missing, wrong credentials, full, read-only) stops the run at once, naming it."""

import errno
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import fsspec
import optuna
import pytest

import rfopt
from rfopt.errors import CheckpointError, StorageRefusedError, StorageUnavailableError
from crashkit import assert_same_study, env, events, names_in, run_command, start, trials
from crashkit import run as crashkit_run
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.database import open_storage, redact, retry
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import trial_attrs

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")


class _Crash(BaseException):
    """Stands in for the process dying: nothing in rfopt catches it."""


def _run(model, storage, checkpoints, crash_after=None):
    study = rfopt.create_study(study_name="f", storage=storage, checkpoint_dir=checkpoints, load_if_exists=True)
    done = []

    def on_unit(number, step, value):
        done.append((number, step))
        if crash_after is not None and len(done) == crash_after:
            raise _Crash

    configs = rfopt.grid(trial_config(model), learning_rate=[1e-3, 5e-3])
    study.optimize(configs, TRAIN, EVAL, num_chunks=2, show_progress_bar=False, on_unit=on_unit)
    return study, done


def _crashed_study(model, storage, checkpoints):
    """A study killed after each of its two trials committed its first chunk."""
    with pytest.raises(_Crash):
        _run(model, storage, checkpoints, crash_after=2)


# Each of these runs with a local checkpoint directory and with checkpoints in a bucket on the test S3 server.
def test_corrupt_checkpoint_fails_its_trial_with_the_reason_and_the_others_finish(
        scripted, tiny_model, storage, checkpoint_root):
    _crashed_study(tiny_model, storage, checkpoint_root)
    tensors = f"{checkpoint_root}/trial-00000/unit-0001/tensors.safetensors"
    fs, path = fsspec.core.url_to_fs(tensors)
    data = fs.cat_file(path)
    fs.pipe_file(path, data[: len(data) // 2])  # cut short

    study, done = _run(tiny_model, storage, checkpoint_root)
    broken, healthy = study.optuna.trials
    assert broken.state == optuna.trial.TrialState.FAIL
    reason = trial_attrs(broken)["rfopt:fail_reason"]
    assert "trial 0" in reason and "unreadable" in reason and tensors in reason
    assert healthy.state == optuna.trial.TrialState.COMPLETE
    assert done == [(1, 1)]


def test_missing_checkpoint_fails_its_trial_with_the_reason_and_the_others_finish(
        scripted, tiny_model, storage, checkpoint_root):
    _crashed_study(tiny_model, storage, checkpoint_root)
    fs, path = fsspec.core.url_to_fs(f"{checkpoint_root}/trial-00001")
    fs.rm(path, recursive=True)

    study, done = _run(tiny_model, storage, checkpoint_root)
    healthy, lost = study.optuna.trials
    assert lost.state == optuna.trial.TrialState.FAIL
    assert "1 chunks were committed" in trial_attrs(lost)["rfopt:fail_reason"]
    assert "holds no checkpoint" in trial_attrs(lost)["rfopt:fail_reason"]
    assert healthy.state == optuna.trial.TrialState.COMPLETE
    assert done == [(0, 1)]


def test_disk_full_while_checkpointing_fails_the_trial_and_keeps_its_previous_checkpoint(
        scripted, tiny_model, storage, tmp_path, monkeypatch):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save_file(tensors, path, *args, **kwargs):
        if "trial-00001" in str(path) and ".unit-0002." in str(path):  # trial 1's second checkpoint
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    study, done = _run(tiny_model, storage, tmp_path / "ck")

    full = study.optuna.trials[1]
    assert full.state == optuna.trial.TrialState.FAIL
    reason = trial_attrs(full)["rfopt:fail_reason"]
    assert "No space left on device" in reason and "previous checkpoint unit-0001 is kept" in reason
    trial_dir = tmp_path / "ck" / "trial-00001"
    # Nothing half-written left; its best checkpoint (unit 1's, issue 34) is kept.
    assert sorted(p.name for p in trial_dir.iterdir()) == ["LATEST", "best", "unit-0001"]
    assert study.checkpoints.load(1).units_done == 1
    assert list(full.intermediate_values) == [0]  # the failed chunk was never reported
    assert study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE
    # Retention: a finished trial keeps its latest checkpoint, its adapter and its best checkpoint, nothing older.
    assert sorted(p.name for p in (tmp_path / "ck" / "trial-00000").iterdir()) == ["LATEST", "adapter", "best",
                                                                                    "unit-0002"]


def _hold_lock(path, seconds):
    """Lock the SQLite file for writing, as a long read/write transaction of another process would."""
    connection = sqlite3.connect(path, check_same_thread=False)
    connection.execute("BEGIN EXCLUSIVE")
    locked = threading.Event()

    def release():
        locked.set()
        time.sleep(seconds)
        connection.rollback()
        connection.close()

    thread = threading.Thread(target=release)
    thread.start()
    locked.wait()
    return thread


def test_writes_are_retried_while_the_sqlite_file_is_locked(tmp_path):
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    study = optuna.create_study(study_name="l", storage=open_storage(url, sqlite_busy_seconds=0.2))
    thread = _hold_lock(tmp_path / "locked.db", 2.0)
    started = time.monotonic()
    study.set_user_attr("written", "after the lock")  # fails on the lock at first, then retried
    waited = time.monotonic() - started
    thread.join()
    assert waited >= 1.5
    assert optuna.load_study(study_name="l", storage=url).user_attrs["written"] == "after the lock"


def test_a_database_unreachable_past_the_retry_budget_gives_a_clear_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    study = optuna.create_study(study_name="l",
                                storage=open_storage(url, sqlite_busy_seconds=0.1, retry_seconds=1.5))
    thread = _hold_lock(tmp_path / "locked.db", 4.0)
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError) as error:
        study.set_user_attr("written", "never")
    assert 1.0 <= time.monotonic() - started < 3.5
    thread.join()
    message = str(error.value)
    assert "set_study_user_attr failed" in message and "database is locked" in message
    assert "rerun the same command" in message


def _wait_for(log, condition, process):
    while process.poll() is None and not condition(events(log)):
        time.sleep(0.05)


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_postgresql_server_down_for_a_while_is_ridden_out_and_the_study_ends_as_if_it_never_was(
    postgres, tiny_study_reference, tiny_model, tmp_path
):
    storage, log, output = postgres.new_database(), tmp_path / "events.log", tmp_path / "run.log"
    process = start(run_command(storage, "--checkpoint-dir", str(tmp_path / "ck")), tmp_path,
                    env(tiny_model, RFOPT_EVENT_LOG=log), output)
    _wait_for(log, lambda e: any(point == "unit-committed" for point, *_ in e), process)
    postgres.stop()
    time.sleep(4)
    postgres.start()
    assert process.wait(timeout=600) == 0, output.read_text()[-3000:]
    assert "retrying in" in output.read_text()  # the outage was felt, and ridden out
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_postgresql_server_down_past_the_retry_budget_stops_the_run_with_a_clear_error(
    postgres, tiny_model, tmp_path
):
    storage, log, output = postgres.new_database(), tmp_path / "events.log", tmp_path / "run.log"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"))
    process = start(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_STORAGE_RETRY_SECONDS=3), output)
    _wait_for(log, lambda e: any(point == "unit-committed" for point, *_ in e), process)
    postgres.stop()
    try:
        assert process.wait(timeout=120) == 1
    finally:
        postgres.start()
    message = output.read_text()
    assert "rfopt: error: storage postgresql://rfopt@127.0.0.1" in message
    assert "the database is unreachable" in message and "rerun the same command" in message
    assert any(t.state == optuna.trial.TrialState.RUNNING for t in trials(storage))  # left to resume, not failed


def test_a_late_writer_cannot_replace_a_newer_checkpoint(checkpoint_root):
    import torch

    from rfopt.storage.state import TrialSnapshot

    store = CheckpointStore(checkpoint_root)

    def state(units):
        return TrialSnapshot(units_done=units, global_step=units, tokens_seen=0, weights={"w": torch.full((2,), units)},
                          optimizer=None, scheduler=None, rng=None)

    store.save(0, state(2))
    # A worker whose lease expired, still writing the unit another worker has already gone past.
    with pytest.raises(CheckpointError, match="already has unit-0002"):
        store.save(0, state(1))
    assert str(store.latest(0)) == f"{store.trial_dir(0)}/unit-0002" and store.load(0).units_done == 2
    assert names_in(store.trial_dir(0)) == ["LATEST", "unit-0002"]


def test_workers_starting_together_all_pass_the_checkpoint_store_write_check(tmp_path):
    """`rfopt worker --devices cpu,cpu` starts its processes at once; each checks the shared store takes writes."""
    import threading

    store = CheckpointStore(tmp_path / "ck")
    errors = []

    def check_many():
        for _ in range(200):
            try:
                store.check_writable()
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                errors.append(exc)

    threads = [threading.Thread(target=check_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == []  # no probe left behind


def test_warm_start_weights_are_found_by_token_or_where_older_studies_put_them(checkpoint_root):
    import torch
    from safetensors.torch import save as save_bytes

    store = CheckpointStore(checkpoint_root)
    store.save_warm_start("t1", {"w": torch.ones(2)}, parent=0, from_unit=1)
    assert store.has_warm_start("t1") and torch.equal(store.load_warm_start(5, "t1")["w"], torch.ones(2))
    # A clone made before tokens named the weights: they are in its own trial directory.
    fs, root = fsspec.core.url_to_fs(str(checkpoint_root))
    fs.makedirs(f"{root}/trial-00006/warm-start", exist_ok=True)
    fs.pipe_file(f"{root}/trial-00006/warm-start/weights.safetensors", save_bytes({"w": torch.zeros(2)}))
    assert torch.equal(store.load_warm_start(6, "t-older")["w"], torch.zeros(2))
    # Missing: the error says where the clone's weights should be.
    with pytest.raises(CheckpointError, match="warm-starts/t2/weights.safetensors"):
        store.load_warm_start(7, "t2")
    store.discard_warm_start("t1")
    assert not store.has_warm_start("t1")


def test_one_outage_is_one_retry_budget_however_many_calls_fail_in_it(tmp_path):
    """The budget is the outage's, not each call's: once a call gave up, the next one to the same database tries once
    and gives up too, and a retried call inside another retried call does not wait twice."""
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    study = optuna.create_study(study_name="l", storage=open_storage(url, sqlite_busy_seconds=0.1, retry_seconds=1.5))
    thread = _hold_lock(tmp_path / "locked.db", 8.0)
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"the database is unreachable \(OperationalError: database is "
                       r"locked\); it has been for 1\.\d s, and rfopt waits 1\.5 s for an outage"):
        study.set_user_attr("a", 1)
    first = time.monotonic() - started
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"set_study_user_attr failed \(1 attempt\)"):
        study.set_user_attr("b", 2)
    with pytest.raises(StorageUnavailableError):
        retry(lambda: study.set_user_attr("c", 3), 1.5, redact(url), "an operation retrying its calls")
    again = time.monotonic() - started
    thread.join()
    assert 1.0 <= first < 3.5 and again < 1.0  # before: 1.5 s more for each call, 1.5 s x 2 for the nested one
    study.set_user_attr("d", 4)  # the outage is over: a success closes it, and the next one gets a budget again
    assert optuna.load_study(study_name="l", storage=url).user_attrs == {"d": 4}


# ---------------------------------------------------------------------- refusals that waiting does not fix
@pytest.fixture
def small_disk():
    """A 32 MiB file system of its own (tmpfs) in a folder anyone may enter (the PostgreSQL server's user keeps a
    tablespace there), or None where this process may not mount one (not root)."""
    folder = Path(tempfile.mkdtemp(prefix="rfopt-small-disk-", dir="/tmp"))
    folder.chmod(0o755)
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _fill(folder):
    """Fill the file system of `folder` to the last byte; return the file that holds the space."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


class _PageLimit:
    """SQLite's own "database or disk is full" (SQLITE_FULL) without a full disk, where no small file system can be
    mounted: every new connection of the study's engine may not grow the file past its current size
    (``PRAGMA max_page_count``). The error is SQLite's, raised where a full disk raises it."""

    def __init__(self, engine):
        import sqlalchemy

        self.engine, self.event = engine, sqlalchemy.event

    def _limit(self, connection, record):
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        connection.execute(f"PRAGMA max_page_count = {pages}")

    def fill(self):
        self.event.listen(self.engine, "connect", self._limit)
        self.engine.dispose()  # pooled connections close; the next ones are limited

    def free(self):
        self.event.remove(self.engine, "connect", self._limit)
        self.engine.dispose()


@pytest.mark.parametrize("full", ["tmpfs", "max_page_count"])
def test_a_full_disk_under_the_sqlite_file_stops_the_run_at_once_naming_it_and_the_study_resumes_once_freed(
        scripted, tiny_model, tmp_path, small_disk, full):
    from rfopt.compat import storage_of
    from rfopt.storage.database import sqlalchemy_engine_of

    if full == "tmpfs" and small_disk is None:
        pytest.skip("mounting a small file system needs root; the max_page_count case raises the same SQLite error")
    (tmp_path / "ref").mkdir()
    reference, _ = _run(tiny_model, f"sqlite:///{tmp_path / 'ref' / 'f.db'}", tmp_path / "ref" / "ck")
    storage = f"sqlite:///{(small_disk if full == 'tmpfs' else tmp_path) / 'f.db'}"
    study = rfopt.create_study(study_name="f", storage=storage, checkpoint_dir=tmp_path / "ck")
    limit = _PageLimit(sqlalchemy_engine_of(storage_of(study.optuna)))
    filled = []

    def fill_after_the_first_unit(number, step, value):
        if not filled:
            filled.append(time.monotonic())
            filled.append(_fill(small_disk) if full == "tmpfs" else limit.fill())

    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    with pytest.raises(StorageRefusedError) as error:
        study.optimize(configs, TRAIN, EVAL, num_chunks=2, show_progress_bar=False, on_unit=fill_after_the_first_unit)
    assert time.monotonic() - filled[0] < 60  # not the 300 s of an outage, nor 300 s for each call
    message = str(error.value)
    assert f"storage {storage}: " in message and "failed at once, not retried: the disk that holds the database is "\
        "full" in message and "database or disk is full" in message and "Free space on that disk" in message
    assert all(t.state.name in ("RUNNING", "WAITING") for t in study.optuna.get_trials())  # no trial failed
    filled[1].unlink() if full == "tmpfs" else limit.free()

    study, _ = _run(tiny_model, storage, tmp_path / "ck")
    assert ([(t.state, t.intermediate_values) for t in study.optuna.get_trials()]
            == [(t.state, t.intermediate_values) for t in reference.optuna.get_trials()])


def _refused_run(storage, tiny_model, tmp_path):
    """`rfopt run` on `storage`: its exit code, output and seconds."""
    output = tmp_path / "run.log"
    started = time.monotonic()
    code = crashkit_run(run_command(storage, "--checkpoint-dir", str(tmp_path / "ck")), tmp_path, env(tiny_model),
                        output, timeout=120)
    return code, output.read_text(), time.monotonic() - started


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing database", "missing role", "wrong password", "read-only database"])
def test_a_postgresql_database_that_refuses_stops_the_run_at_once_naming_the_cause(postgres, tiny_model, tmp_path,
                                                                                    case):
    import uuid

    if case == "missing database":
        storage = postgres.url(f"no_such_{uuid.uuid4().hex[:8]}")
        cause, fix = "the database named in the storage URL does not exist on the server", "Create it (createdb NAME"
    elif case == "missing role":
        storage = postgres.new_database().replace("rfopt@", "nobody_here@")
        cause, fix = "the user (role) named in the storage URL does not exist", "Create it (CREATE ROLE NAME LOGIN"
    elif case == "wrong password":
        role = f"pw_{uuid.uuid4().hex[:8]}"
        postgres.password_role(role, "right")
        storage = postgres.new_database().replace("rfopt@", f"{role}:wrong@")
        cause, fix = "the server refused the user's credentials", "Check the user and password in --storage"
    else:
        storage = postgres.new_database()
        postgres.execute(f"ALTER DATABASE {storage.rsplit('/', 1)[1]} SET default_transaction_read_only = on")
        cause, fix = "the database is read-only", "Point --storage at a writable database"
    code, output, seconds = _refused_run(storage, tiny_model, tmp_path)
    assert code == 1, output[-3000:]
    assert seconds < 60  # before: 300 s of retries, then "the database is unreachable"
    line = next(line for line in output.splitlines() if line.startswith("rfopt: error:"))
    assert line.startswith(f"rfopt: error: storage {redact(storage)}: ") and "failed at once, not retried: " in line
    assert cause in line and fix in line and "unreachable" not in line and "wrong" not in line  # no password shown
    assert "retrying in" not in output
    assert not (tmp_path / "ck").exists()


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_full_disk_under_a_postgresql_database_stops_the_run_at_once_and_the_study_resumes_once_freed(
    postgres, tiny_study_reference, tiny_model, tmp_path, small_disk
):
    if small_disk is None:
        pytest.skip("mounting a small file system needs root (the classification of PostgreSQL's DiskFull is also "
                    "tested without a disk: test_a_refusal_is_told_from_an_outage_by_its_sqlstate_or_message)")
    storage, log, output = postgres.database_in(small_disk), tmp_path / "events.log", tmp_path / "run.log"
    try:
        process = start(run_command(storage, "--checkpoint-dir", str(tmp_path / "ck")), tmp_path,
                        env(tiny_model, RFOPT_EVENT_LOG=log), output)
        _wait_for(log, lambda e: any(point == "unit-committed" for point, *_ in e), process)
        filler = _fill(small_disk)
        filled = time.monotonic()
        assert process.wait(timeout=120) == 1
        assert time.monotonic() - filled < 60
        text = output.read_text()
        assert "failed at once, not retried: the disk that holds the database is full" in text
        assert "DiskFull" in text and "retrying in" not in text
        filler.unlink()  # first: a new connection to a database on a full disk may fail ("could not write init file")
        assert any(t.state == optuna.trial.TrialState.RUNNING for t in trials(storage))  # left to resume, not failed
        code = crashkit_run(run_command(storage, "--checkpoint-dir", str(tmp_path / "ck")), tmp_path, env(tiny_model),
                            output)
        assert code == 0, output.read_text()[-3000:]
        assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")
    finally:
        postgres.drop(storage)


def test_a_persistent_fault_is_told_from_an_outage_by_its_sqlstate_or_message():
    import psycopg
    import sqlalchemy

    from rfopt.storage.database import is_unreachable, persistent_fault

    def wrapped(orig):
        return sqlalchemy.exc.OperationalError("INSERT ...", {}, orig)

    full = wrapped(psycopg.errors.DiskFull("could not extend file: No space left on device"))
    assert persistent_fault(full).kind == "disk full" and not is_unreachable(full)
    for text, kind in [('FATAL:  database "x" does not exist', "missing database"),
                       ('FATAL:  role "x" does not exist', "missing role"),
                       ('FATAL:  password authentication failed for user "x"', "authentication"),
                       ("FATAL:  no pg_hba.conf entry for host", "authentication"),
                       ("attempt to write a readonly database", "read-only"),
                       ("permission denied for schema public", "permission")]:
        error = wrapped(psycopg.OperationalError(f"connection failed: {text}"))
        assert persistent_fault(error).kind == kind and not is_unreachable(error)
    for outage in ("connection failed: Connection refused", "database is locked",
                   "FATAL:  the database system is starting up", "server closed the connection unexpectedly"):
        error = wrapped(psycopg.OperationalError(outage))
        assert persistent_fault(error) is None and is_unreachable(error)


@pytest.mark.parametrize("cut", [0, 5, 40, -3])
def test_export_best_refuses_a_truncated_adapter_naming_the_file_and_leaves_nothing(tmp_path, cut):
    """Issue 35: `export_best` copied a truncated adapter without a word; it checks every safetensors file it copies
    (header, and a size that is the header's plus the data it describes)."""
    import torch
    from safetensors.torch import save_file

    from rfopt.storage import schema
    from rfopt.errors import CheckpointError

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"lora_A": torch.ones(4, 8), "lora_B": torch.zeros(8, 4)}, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text("{}")
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0, system_attrs={"rfopt:adapter": str(adapter)}))
    assert schema.TrialRecord(study.trials[0]).adapter == str(adapter)
    good = rfopt.Study(study).export_best(tmp_path / "good", best_trial=True)
    assert (good / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    data = (adapter / "adapter_model.safetensors").read_bytes()
    (adapter / "adapter_model.safetensors").write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as raised:
        rfopt.Study(study).export_best(tmp_path / "out", best_trial=True)
    assert f"adapter_model.safetensors in {adapter} is not a whole safetensors file" in str(raised.value)
    assert not (tmp_path / "out").exists()
