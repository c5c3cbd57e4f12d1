"""Queue control: cancelling a WAITING clone and withdrawing a pending request, from the API and the command line,
and what happens when either loses a race against the process running the study."""

import os
import socket
import subprocess
import sys
import time

import optuna
import pytest
from rfopt_testkit import prompts_dataset, trial_config

import rfopt
from rfopt.engine.trials import ops
from rfopt.reports.status import liveness
from rfopt.cli import main as cli
from rfopt.compat import storage_of, trial_id_of
from rfopt.errors import OpError
from rfopt.storage.schema import TrialRecord, TrialRef

TRAIN, EVAL = prompts_dataset(4), prompts_dataset(2, "E")
WAITING, RUNNING, FAIL, COMPLETE = (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING,
                                    optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE)


@pytest.fixture
def finished_study(scripted, tiny_model, storage):
    """A study that ran one config to the end (2 chunks): it has a plan, checkpoints, and nobody running it. Its
    `seen_running` is what `liveness` said while it ran."""
    study = rfopt.create_study(study_name="q", storage=storage, num_chunks=2)
    seen = []
    study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False,
                   on_unit=lambda *_: seen.append(study.liveness()))
    study.seen_running = seen
    return study


def test_liveness_tells_whether_anybody_runs_the_study_and_what_waits(finished_study, storage, capsys):
    study = finished_study
    during = study.seen_running[0]
    assert during.running and during.holders == [f"{socket.gethostname()}:{os.getpid()} (run)"]
    assert during.message.startswith("running: ")
    after = study.liveness()
    assert not after.running and after.holders == [] and after.last_seen is not None
    assert after.waiting_unattended == [] and after.message.startswith("nobody is running this study (last seen ")
    clone = study.clone_trial(0, {"learning_rate": 1e-3})
    after = study.liveness()
    assert after.waiting_unattended == [clone]
    assert f"1 WAITING trial (clone {clone}) will start when you run `rfopt run ...`" in after.message
    assert cli(["status", "--study", "q", "--storage", storage]) == 0
    assert after.message in capsys.readouterr().out


@pytest.mark.subprocess
def test_a_killed_process_reads_as_gone_within_two_heartbeats(storage, tmp_path):
    study = rfopt.create_study(study_name="k", storage=storage)
    script = ("import sys, time, optuna; from rfopt.storage.leases import Presence; from rfopt.storage import open_storage\n"
              f"study = optuna.load_study(study_name='k', storage=open_storage({storage!r}))\n"
              "with Presence(study, 'worker', interval=0.2):\n"
              "    print('beating', flush=True); time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "beating"
        live = liveness(study.optuna)
        assert live.running and live.holders == [f"{socket.gethostname()}:{process.pid} (worker)"]
    finally:
        process.kill()
        process.wait()
    killed = time.monotonic()
    while liveness(study.optuna).running:
        time.sleep(0.05)
    assert time.monotonic() - killed <= 2 * 0.2 + 0.3
    assert liveness(study.optuna).last_seen is not None


def test_cancelled_clone_leaves_the_queue_and_never_starts(finished_study, storage, capsys):
    study = finished_study
    clone = study.clone_trial(0, {"learning_rate": 1e-3})
    assert study.optuna.trials[clone].state == WAITING
    assert cli(["cancel", str(clone), "--study", "q", "--storage", storage]) == 0
    assert "cancelled" in capsys.readouterr().out
    trial = study.optuna.trials[clone]
    record = TrialRecord(trial)
    assert trial.state == FAIL and record.cancelled is not None
    assert record.end_reason.startswith("cancelled by ") and "before it started" in record.end_reason
    assert not study.optuna.get_trials(states=[WAITING])
    row = next(r for r in study.leaderboard() if r.number == clone)
    assert row.state == "CANCELLED" and row.reason.startswith("cancelled by")
    # A later run of the study does not start it.
    study.optimize([trial_config(study.trial_config(0).model)], TRAIN, EVAL, show_progress_bar=False)
    assert study.optuna.trials[clone].state == FAIL and not study.optuna.trials[clone].intermediate_values


def test_cancel_refuses_what_is_not_a_waiting_clone(finished_study):
    study = finished_study
    with pytest.raises(OpError, match="trial 0 is COMPLETE and not a clone; only a WAITING clone"):
        study.cancel_clone(0)
    study.optuna.enqueue_trial({})
    with pytest.raises(OpError, match="trial 1 is WAITING and not a clone"):
        study.cancel_clone(1)
    with pytest.raises(OpError, match="has no trial 9"):
        study.cancel_clone(9)


def test_cancel_that_loses_to_a_starting_process_is_refused_and_writes_nothing(finished_study, monkeypatch):
    study = finished_study
    clone = study.clone_trial(0, {"learning_rate": 1e-3})
    seen_waiting = study.optuna.trials[clone]
    started = study.optuna.ask()  # a process running the study takes the clone from the queue first
    assert started.number == clone
    monkeypatch.setattr(ops, "find_trial", lambda s, n: seen_waiting)  # the cancel read the queue before that
    with pytest.raises(OpError, match="was started by a process running the study just now; it was not cancelled"):
        study.cancel_clone(clone)
    trial = study.optuna.trials[clone]
    assert trial.state == RUNNING and TrialRecord(trial).cancelled is None and TrialRecord(trial).fail_reason is None


def _running_trial(storage):
    study = rfopt.create_study(study_name="w", storage=storage)
    trial = study.optuna.ask()
    return study, TrialRef(storage_of(study.optuna), trial_id_of(trial), trial.number)


def test_withdrawn_request_never_applies(storage, capsys):
    study, ref = _running_trial(storage)
    study.stop_trial(0)
    stale = ref.read()  # what a process about to apply requests had read
    assert cli(["withdraw", "stop", "0", "--study", "w", "--storage", storage]) == 0
    assert "withdrawn" in capsys.readouterr().out
    record = ref.read()
    assert record.pending == [] and [w.request.op for w in record.withdrawn] == ["stop"]
    result = ops.apply_requests(ref, stale, after_chunk=0, study=study.optuna)  # reads again under the lock
    assert result.applied == [] and result.stop is None
    assert ref.read().stop is None and ref.read().applied == []
    with pytest.raises(OpError, match="trial 0 has no pending stop request to withdraw"):
        study.withdraw_request(0, "stop")
    study.pause_trial(0)  # a request after a withdrawal is judged without the withdrawn one
    assert [r.op for r in ref.read().pending] == ["pause"]


def test_withdraw_after_the_request_applied_is_refused(storage):
    study, ref = _running_trial(storage)
    study.pause_trial(0)
    ops.apply_requests(ref, ref.read(), after_chunk=1, study=study.optuna)
    with pytest.raises(OpError, match=r"trial 0: its pause \(asked by .*\) was already applied at .*; nothing to "
                                      "withdraw"):
        study.withdraw_request(0, "pause")
    assert ref.read().paused
    with pytest.raises(OpError, match="unknown op 'clone'"):
        study.withdraw_request(0, "clone")


def test_a_stop_withdrawn_while_the_study_runs_lets_the_trial_finish(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="live", storage=storage, num_chunks=2)

    def on_unit(number, step, value):
        if (number, step) == (0, 0):
            study.stop_trial(0)
            study.withdraw_request(0, "stop")

    study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False, on_unit=on_unit)
    trial = study.optuna.trials[0]
    assert trial.state == COMPLETE and sorted(trial.intermediate_values) == [0, 1]
    assert TrialRecord(trial).applied == [] and len(TrialRecord(trial).withdrawn) == 1


@pytest.mark.slow
def test_presence_withdraw_and_cancel_work_on_postgresql(postgres, tmp_path):
    from rfopt.storage.leases import Presence
    from rfopt.storage.database import open_storage

    storage = open_storage(postgres.new_database())
    study = rfopt.create_study(study_name="pg", storage=storage)
    assert not study.liveness().running and study.liveness().last_seen is None
    with Presence(study.optuna, "worker", interval=0.2, holder="host-b:42"):
        assert study.liveness().holders == ["host-b:42 (worker)"]
    assert not study.liveness().running and study.liveness().last_seen is not None
    trial = study.optuna.ask()
    study.stop_trial(trial.number)
    study.withdraw_request(trial.number, "stop")
    ref = TrialRef(storage_of(study.optuna), trial_id_of(trial), trial.number)
    assert ref.read().pending == []
    # A WAITING clone, as `clone_trial` writes one (lineage in its attrs), cancelled through the storage's own CAS.
    study.optuna.add_trial(optuna.trial.create_trial(state=WAITING, user_attrs={"rfopt:clone": {"parent": 0}}))
    study.cancel_clone(1)
    assert study.optuna.trials[1].state == FAIL and TrialRecord(study.optuna.trials[1]).cancelled is not None
