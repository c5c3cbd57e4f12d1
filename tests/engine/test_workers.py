"""Workers sharing a study through leases in its database: on a real PostgreSQL server (and SQLite on one
host), several worker processes finish every trial with no unit trained twice, and end exactly where one
process running the study ends; a worker killed while holding a lease has its unit finished by another once
the lease expires; a database that goes away for a while and comes back is ridden out."""

import os
import signal
import socket

import optuna
import pytest
import sqlalchemy as sa

import rfopt
from crashkit import (STUDY_FILE, assert_same_study, commits, env, events, retrained_after_durable, run, run_command,
                      start, trials, worker_command)
from rfopt.storage.schema import trial_attrs


def unit_holders(storage, study="tiny"):
    engine = sa.create_engine(storage)
    with engine.begin() as db:
        rows = db.execute(sa.text("SELECT trial, unit, holder FROM rfopt_units WHERE study = :study"),
                          {"study": study}).all()
    engine.dispose()
    return {(r.trial, r.unit): r.holder for r in rows}


def _check_finished_once(storage, log):
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials(storage))
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(unit_holders(storage)) == reported
    assert retrained_after_durable(events(log)) == []
    assert set(commits(events(log))) == reported and set(commits(events(log)).values()) == {1}


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_several_workers_on_postgresql_share_the_study_and_end_as_one_process_does(
    postgres, tiny_study_reference, tiny_model, tmp_path
):
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    workers_env = env(tiny_model, RFOPT_EVENT_LOG=log)
    # Two workers from one command (one per listed device), a third from another command, as from another host.
    pair = start(worker_command(storage, tmp_path / "ck", "--devices", "cpu,cpu"), tmp_path, workers_env,
                 tmp_path / "pair.log")
    single = start(worker_command(storage, tmp_path / "ck"), tmp_path, workers_env, tmp_path / "single.log")
    assert pair.wait(timeout=600) == 0, (tmp_path / "pair.log").read_text()[-3000:]
    assert single.wait(timeout=600) == 0, (tmp_path / "single.log").read_text()[-3000:]

    _check_finished_once(storage, log)
    assert len(set(unit_holders(storage).values())) >= 2  # the units really were shared
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_worker_killed_holding_a_lease_has_its_unit_finished_by_another(
    postgres, tiny_study_reference, tiny_model, tmp_path
):
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    lease = ["--lease-seconds", "3"]
    # Two workers; one dies in the middle of its second unit, holding that trial's lease.
    doomed = start(worker_command(storage, tmp_path / "ck", *lease), tmp_path,
                   env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_CRASH_AT="chunk-trained:2"), tmp_path / "doomed.log")
    survivor = start(worker_command(storage, tmp_path / "ck", *lease), tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log),
                     tmp_path / "survivor.log")
    assert doomed.wait(timeout=600) == -signal.SIGKILL
    assert survivor.wait(timeout=600) == 0, (tmp_path / "survivor.log").read_text()[-3000:]

    _, trial, unit, _, died = [e for e in events(log) if e[3] == doomed.pid][-1]
    assert not unit_holders(storage)[(trial, unit)].endswith(f":{doomed.pid}")  # finished by the survivor
    restarted = [e[4] for e in events(log) if e[0] == "unit-started" and e[1:4] == (trial, unit, survivor.pid)]
    # Not before the lease expired: it was renewed at most a third of its 3 s before the worker died.
    assert len(restarted) == 1 and restarted[0] - died >= 1.9, (restarted, died)
    _check_finished_once(storage, log)
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_two_workers_on_one_sqlite_file_share_the_study(tiny_study_reference, tiny_model, tmp_path):
    storage = f"sqlite:///{tmp_path / 'workers.db'}"
    log = tmp_path / "events.log"
    code = run(worker_command(storage, tmp_path / "ck", "--devices", "cpu,cpu"), tmp_path,
               env(tiny_model, RFOPT_EVENT_LOG=log), tmp_path / "workers.log")
    assert code == 0, (tmp_path / "workers.log").read_text()[-3000:]
    _check_finished_once(storage, log)
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_two_hosts_share_the_sweep_through_an_s3_checkpoint_store(s3, tiny_study_reference, tiny_model, tmp_path):
    """Two `rfopt worker` commands, each in a working directory of its own as on two hosts, nothing local shared
    but the study's database: the checkpoints they hand each other trials through are in S3."""
    storage, root = f"sqlite:///{tmp_path / 'workers.db'}", s3.bucket() + "/rfopt"
    log = tmp_path / "events.log"
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    workers = []
    for host in hosts:
        host.mkdir()
        workers.append(start(worker_command(storage, root), host, env(tiny_model, RFOPT_EVENT_LOG=log), host / "log"))
    for host, worker in zip(hosts, workers):
        assert worker.wait(timeout=600) == 0, (host / "log").read_text()[-3000:]

    _check_finished_once(storage, log)
    assert len(set(unit_holders(storage).values())) >= 2  # the units really were shared
    assert all(sorted(p.name for p in host.iterdir()) == ["log"] for host in hosts)  # no checkpoint on either host
    assert_same_study(*tiny_study_reference, storage, root)


def test_worker_refuses_an_unknown_device_before_starting_anything(capsys):
    from crashkit import STUDY_FILE
    from rfopt.cli import main

    assert main(["worker", str(STUDY_FILE), "--devices", "gpu0,cpu"]) == 1
    assert "--devices 'gpu0,cpu': give auto, cpu, cuda:N, or a comma-separated list of them" in capsys.readouterr().err


def test_each_worker_process_runs_the_users_own_arguments_on_its_one_device(tmp_path, monkeypatch):
    """`rfopt worker --devices a,b` hands its workers the command line as the user gave it (any flag, even one the
    launcher has never heard of), less --devices, plus each one's device and its rank in its data-parallel group."""
    import subprocess

    from rfopt.cli import main

    started = []

    class Process:
        def __init__(self, argv, env):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Process)
    given = ["-v", "worker", str(STUDY_FILE), "--storage", f"sqlite:///{tmp_path / 'w.db'}", "--n-trials-total", "4",
             "--devices=cpu,cpu", "--gang-size", "1", "--report-to", "none", "--devices-per-trial", "2", "--fast"]
    assert main(given) == 0
    kept = [a for a in given if not a.startswith("--devices=")]
    assert len(started) == 2
    for rank, argv in enumerate(started):
        assert argv[:3] == [argv[0], "-m", "rfopt.cli"] and argv[3:3 + len(kept)] == kept
        assert argv[3 + len(kept):-1] == ["--devices", "cpu", "--data-parallel-rank"]
        assert argv[-1].startswith(f"{rank}/2@127.0.0.1:")


def test_a_worker_whose_lease_is_taken_over_mid_chunk_stops_and_commits_nothing_and_the_unit_is_trained_once(
        scripted, tiny_model, tmp_path, monkeypatch, caplog):
    """In the middle of a trial's second chunk another holder takes its lease. The worker's heartbeat finds it gone,
    the chunk stops at the next step, nothing of it is checkpointed or committed; once the lease is free again the
    unit is trained from the last checkpoint, once, and the trial ends exactly as an uninterrupted run ends."""
    import threading
    import time

    import rfopt
    import rfopt_testkit
    from crashkit import adapter, same_tensors
    from rfopt.storage.leases import Leases
    from rfopt_testkit import prompts_dataset, reward_len_hooked, trial_config

    train, evaluation = prompts_dataset(16), prompts_dataset(2, "E")
    config = trial_config(tiny_model, rewards=[reward_len_hooked])  # 8 steps per chunk of 2
    reference = rfopt.create_study(study_name="lease", storage=f"sqlite:///{tmp_path / 'reference.db'}")
    reference.optimize([config], train, evaluation, num_chunks=2, show_progress_bar=False)

    storage = f"sqlite:///{tmp_path / 'worker.db'}"
    study = rfopt.create_study(study_name="lease", storage=storage)
    log = tmp_path / "events.log"
    monkeypatch.setenv("RFOPT_EVENT_LOG", str(log))
    noticed = threading.Event()
    renew = Leases.renew

    def renew_and_tell(self, lease):
        ours = renew(self, lease)
        if not ours:
            noticed.set()
        return ours

    monkeypatch.setattr(Leases, "renew", renew_and_tell)
    calls = {"n": 0}

    def take_over_once():
        # The baseline (the base model's evaluation) scores once; then a unit's chunk scores 8 completion groups and
        # evaluates once: the 11th call is chunk 2's first step.
        calls["n"] += 1
        if calls["n"] != 11:
            return
        engine = sa.create_engine(storage)
        with engine.begin() as db:
            db.execute(sa.text("UPDATE rfopt_leases SET holder = 'thief', token = token + 1, expires = :until "
                               "WHERE study = 'lease' AND name = 'trial-0'"), {"until": time.time() + 2.0})
        engine.dispose()
        assert noticed.wait(10), "the heartbeat never noticed the lease was taken"

    monkeypatch.setattr(rfopt_testkit, "REWARD_HOOK", take_over_once)
    study.work([config], train, evaluation, num_chunks=2, lease_seconds=1.5, poll_seconds=0.1)

    assert "trial 0: chunk 2 stopped at step 9" in caplog.text  # at the step after the heartbeat's finding, of 16
    units = unit_holders(storage, "lease")
    assert sorted(units) == [(0, 0), (0, 1)]
    seen = events(log)
    for point in ("chunk-trained", "checkpoint-saved", "unit-committed"):
        assert [e[2] for e in seen if e[0] == point] == [0, 1], point  # unit 1 trained to its end and committed once
    assert [e[2] for e in seen if e[0] == "unit-started"] == [0, 1, 1]  # started again after the lease came back
    got, ref = study.optuna.trials[0], reference.optuna.trials[0]
    assert got.state == ref.state == optuna.trial.TrialState.COMPLETE
    assert got.intermediate_values == ref.intermediate_values
    assert same_tensors(adapter(got), adapter(ref))


def test_a_worker_applies_a_pause_and_then_a_resume_to_a_paused_trial_it_does_not_schedule(
        scripted, tiny_model, tmp_path):
    """Under leases as alone: requests are applied by the worker that claims the trial, a paused trial included
    (it is never picked to train, but its resume must still be applied), and it ends as an unpaused run ends."""
    import rfopt
    from crashkit import adapter, same_tensors
    from rfopt_testkit import prompts_dataset, trial_config

    train, evaluation = prompts_dataset(16), prompts_dataset(2, "E")
    configs = rfopt.grid(trial_config(tiny_model, gradient_accumulation_steps=2), learning_rate=[1e-3, 5e-3])
    reference = rfopt.create_study(study_name="w", storage=f"sqlite:///{tmp_path / 'reference.db'}")
    reference.optimize(configs, train, evaluation, num_chunks=4, show_progress_bar=False)

    study = rfopt.create_study(study_name="w", storage=f"sqlite:///{tmp_path / 'worker.db'}")
    order = []

    def on_unit(number, step, value):
        order.append((number, step))
        if (number, step) == (1, 0):
            study.pause_trial(1)
        if (number, step) == (0, 2):
            study.resume_trial(1)

    study.work(configs, train, evaluation, num_chunks=4, lease_seconds=5, poll_seconds=0.05, on_unit=on_unit)
    assert order[:4] == [(0, 0), (1, 0), (0, 1), (0, 2)]  # trial 1 sat out while paused, then caught up
    paused, ref = study.optuna.trials[1], reference.optuna.trials[1]
    assert paused.state == ref.state == optuna.trial.TrialState.COMPLETE
    assert [op["op"] for op in trial_attrs(paused)["rfopt:ops"]] == ["pause", "resume"]
    assert paused.intermediate_values == ref.intermediate_values
    assert same_tensors(adapter(paused), adapter(ref))


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_two_workers_train_their_own_gangs_and_finish_every_unit_once(tiny_model, tmp_path):
    """Each worker forms gangs of the trials it holds leases on (a gang lives in one process); together they finish
    the study, no unit trained twice or committed by two."""
    storage = f"sqlite:///{tmp_path / 'workers.db'}"
    log = tmp_path / "events.log"
    code = run(worker_command(storage, tmp_path / "ck", "--devices", "cpu,cpu", "--gang-size", "2"), tmp_path,
               env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_TEST_TRIALS=4), tmp_path / "workers.log")
    assert code == 0, (tmp_path / "workers.log").read_text()[-3000:]
    _check_finished_once(storage, log)
    assert {t.state for t in trials(storage)} == {optuna.trial.TrialState.COMPLETE}
    gangs = {tuple(t.system_attrs[k]["members"][0]) for t in trials(storage) for k in t.system_attrs
             if k.startswith("rfopt:gang:")}
    assert gangs  # the units were trained in gangs


# ---------------------------------------------------------------------- who may share a study
def _snapshot(storage):
    study = optuna.load_study(study_name="tiny", storage=storage)
    return study.user_attrs, [(t.number, t.state, t.intermediate_values, t.user_attrs) for t in study.get_trials()]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("first", ["run", "worker"])
def test_a_process_that_cannot_share_a_running_study_is_refused_at_once_and_the_study_ends_as_one_process_does(
    tiny_study_reference, tiny_model, tmp_path, monkeypatch, first
):
    """`rfopt run` takes no leases: beside it no other process may run the study (a second run, a worker), and it
    may not start beside workers. The refused process names the one running and writes nothing."""
    from rfopt.config.studyfile import load_spec

    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    storage, checkpoints = f"sqlite:///{tmp_path / 'busy.db'}", tmp_path / "ck"
    spec = load_spec(STUDY_FILE)
    study = rfopt.create_study(study_name="tiny", storage=storage, checkpoint_dir=checkpoints)
    refused = {}

    def second_processes(number, step, value):
        if refused:
            return
        before = _snapshot(storage)
        others = {"run": run_command(storage, "--checkpoint-dir", str(checkpoints))}
        if first == "run":
            others["worker"] = worker_command(storage, checkpoints)
        for name, command in others.items():
            log = tmp_path / f"{name}.log"
            refused[name] = (run(command, tmp_path, env(tiny_model), log, timeout=300), log.read_text())
        assert _snapshot(storage) == before  # the refused processes wrote nothing

    train, evaluation = spec.datasets()
    call = study.optimize if first == "run" else study.work
    call(spec.search_space(), train, evaluation, num_chunks=spec.num_chunks, max_concurrent=spec.max_concurrent,
         gang_size=spec.gang_size, on_unit=second_processes, **({"show_progress_bar": False} if first == "run" else {}))
    me = f"{socket.gethostname()}:{os.getpid()}"
    for code, output in refused.values():
        assert code == 1, output[-3000:]
        line = next(line for line in output.splitlines() if line.startswith("rfopt: error:"))
        assert line.startswith(f"rfopt: error: study 'tiny' is being run by {me} (rfopt {first}, seen ")
        assert "takes no leases" in line and "Nothing was written" in line
    assert set(refused) == ({"run", "worker"} if first == "run" else {"run"})
    assert_same_study(*tiny_study_reference, storage, checkpoints)


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_two_rfopt_runs_started_at_once_on_one_study_one_runs_it_the_other_is_refused(tiny_study_reference, tiny_model,
                                                                                     tmp_path):
    storage, checkpoints = f"sqlite:///{tmp_path / 'twice.db'}", tmp_path / "ck"
    command = run_command(storage, "--checkpoint-dir", str(checkpoints))
    processes = [start(command, tmp_path, env(tiny_model), tmp_path / f"run{i}.log") for i in range(2)]
    codes = sorted(p.wait(timeout=600) for p in processes)
    outputs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
    assert codes == [0, 1], outputs
    refusal = next(o for o in outputs if "rfopt: error:" in o)
    assert "rfopt: error: study 'tiny' is being run by " in refusal and "(rfopt run, seen " in refusal
    assert_same_study(*tiny_study_reference, storage, checkpoints)


def _children(pid):
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(c) for c in open(path).read().split()] if os.path.exists(path) else []


def _running(pid):
    """Whether `pid` is a live process (not gone, not a zombie left to a parent that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("signal_to_parent", [signal.SIGKILL, signal.SIGINT])
def test_worker_processes_end_with_the_rfopt_worker_process_that_started_them(tiny_model, tmp_path, signal_to_parent):
    import time

    storage, log = f"sqlite:///{tmp_path / 'w.db'}", tmp_path / "events.log"
    # 8 trials x 6 chunks (~13 s in all on the tiny model): workers that missed the signal would finish it within
    # the 20 s they are given, every trial COMPLETE, which the last assertion catches.
    parent = start(worker_command(storage, tmp_path / "ck", "--devices", "cpu,cpu"), tmp_path,
                   env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_TEST_TRIALS=8, RFOPT_TEST_CHUNKS=6),
                   tmp_path / "parent.log")
    children = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(p == "unit-started" for p, *_ in events(log)):
            assert parent.poll() is None, (tmp_path / "parent.log").read_text()[-3000:]
            time.sleep(0.1)
        children = _children(parent.pid)
        assert len(children) == 2 and all(map(_running, children))
        parent.send_signal(signal_to_parent)  # to the parent alone, not to its process group
        parent.wait(timeout=120)
        deadline = time.monotonic() + 20
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, children)), (tmp_path / "parent.log").read_text()[-3000:]
    finally:  # whatever the outcome, no process of this test outlives it
        for pid in [parent.pid, *children]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    if signal_to_parent == signal.SIGINT:  # the parent says so only once its workers have stopped
        assert "interrupted: rerun the same command" in (tmp_path / "parent.log").read_text()
    states = [t.state.name for t in trials(storage)]
    assert "RUNNING" in states and "FAIL" not in states  # stopped mid-study, every trial resumable


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_command_the_tests_start_hears_ctrl_c_also_where_the_suite_runs_with_it_ignored(tmp_path):
    """A suite run as a background job of a non-interactive shell (``make test-all &``) has SIGINT ignored, and its
    processes inherit that: `rfopt worker --devices` then never heard the test's Ctrl-C above, and its workers ran the
    8 x 6 study to its end (every trial COMPLETE, no "interrupted" line: the [SIGINT] case failed every time). The
    tests' commands start with SIGINT at its default, as from a terminal, under their own pid."""
    import sys

    script = ("import os, signal; print(os.getpid(), "
              "signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)")
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = start([sys.executable, "-c", script], tmp_path, dict(os.environ), tmp_path / "out.log")
        assert process.wait(timeout=60) == 0
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert (tmp_path / "out.log").read_text().split() == [str(process.pid), "True"]
