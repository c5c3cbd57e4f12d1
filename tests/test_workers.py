"""Workers sharing a study through leases in its database: on a real PostgreSQL server (and SQLite on one
host), several worker processes finish every trial with no unit trained twice, and end exactly where one
process running the study ends; a worker killed while holding a lease has its unit finished by another once
the lease expires; a database that goes away for a while and comes back is ridden out."""

import signal

import optuna
import sqlalchemy as sa

from crashkit import (assert_same_study, commits, env, events, retrained_after_durable, run, start, trials,
                      worker_command)
from rfopt.schema import trial_attrs


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


def test_two_workers_on_one_sqlite_file_share_the_study(tiny_study_reference, tiny_model, tmp_path):
    storage = f"sqlite:///{tmp_path / 'workers.db'}"
    log = tmp_path / "events.log"
    code = run(worker_command(storage, tmp_path / "ck", "--devices", "cpu,cpu"), tmp_path,
               env(tiny_model, RFOPT_EVENT_LOG=log), tmp_path / "workers.log")
    assert code == 0, (tmp_path / "workers.log").read_text()[-3000:]
    _check_finished_once(storage, log)
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")


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


def test_a_worker_whose_lease_is_taken_over_mid_chunk_stops_and_commits_nothing_and_the_unit_is_trained_once(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """In the middle of a trial's second chunk another holder takes its lease. The worker's heartbeat finds it gone,
    the chunk stops at the next step, nothing of it is checkpointed or committed; once the lease is free again the
    unit is trained from the last checkpoint, once, and the trial ends exactly as an uninterrupted run ends."""
    import threading
    import time

    import rfopt
    import rfopt_testkit
    from crashkit import adapter, same_tensors
    from rfopt.leases import Leases
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
        # A unit's chunk scores 8 completion groups, then evaluates once: the 10th call is chunk 2's first step.
        calls["n"] += 1
        if calls["n"] != 10:
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


def test_a_worker_applies_a_pause_and_then_a_resume_to_a_paused_trial_it_does_not_schedule(tiny_model, tmp_path):
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
