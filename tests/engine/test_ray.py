"""A study on a real local Ray cluster (`rfopt run --ray`, `optimize(executor=rfopt.RayCluster())`) and a real
PostgreSQL server: it ends exactly as `rfopt run` ends, also when an actor is killed in the middle of a chunk; a
storage the actors cannot reach fails the run at once, naming the URL. Ray is the `ray` extra (``make test``
installs it); these tests are marked ``ray`` and skipped without it. Each starts a local Ray (some 5 s)."""

import os
import signal
import time

import optuna
import pytest

from crashkit import (STUDY_FILE, TESTS, assert_same_study, assert_same_study_but_summation_order, commits, env,
                      events, rfopt_command, run, start, trials, worker_command)

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make test does)")
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.subprocess, pytest.mark.e2e]

SWEEP = {"RFOPT_TEST_TRIALS": 4, "RFOPT_TEST_CHUNKS": 2}
"""The 4-trial sweep of tests/tiny_study.py, 2 chunks each."""


def ray_command(storage, checkpoints, *extra):
    return rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--checkpoint-dir", str(checkpoints),
                         "--no-progress", "--ray", *extra)


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """``(storage, checkpoint_dir)`` of the 4-trial sweep run by plain `rfopt run`."""
    where = tmp_path_factory.mktemp("ray-reference")
    storage = f"sqlite:///{where / 'ref.db'}"
    command = rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--checkpoint-dir", str(where / "ck"),
                            "--no-progress")
    assert run(command, where, env(tiny_model, **SWEEP), where / "log") == 0, (where / "log").read_text()[-3000:]
    return storage, where / "ck"


def _committed_once(log):
    assert set(commits(events(log)).values()) == {1}  # no unit committed twice


def test_a_study_on_a_local_ray_cluster_ends_as_rfopt_run_does(postgres, reference, tiny_model, tmp_path):
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    code = run(ray_command(storage, tmp_path / "ck", "--workers", "2"), tmp_path,
               env(tiny_model, RFOPT_EVENT_LOG=log, **SWEEP), tmp_path / "out.log")
    output = (tmp_path / "out.log").read_text()
    assert code == 0, output[-3000:]
    assert_same_study(*reference, storage, tmp_path / "ck")
    _committed_once(log)
    trained_by = {pid for point, _, _, pid, _ in events(log) if point == "unit-committed"}
    assert len(trained_by) == 2  # both actors trained units; neither is the command's own process
    assert "recommended adapter" in output and "complete" in output  # the leaderboard, as after a local run


def _kill_at_second_chunk(command, tmp_path, environ, log):
    """Run `command`; SIGKILL the process that starts the first unit 1 (a chunk's second unit) as it starts it, as a
    lost node or the OOM killer would; return that event once the command has ended (it must succeed)."""
    process = start(command, tmp_path, environ, tmp_path / "out.log")
    try:
        deadline, victim = time.monotonic() + 300, None
        while victim is None and time.monotonic() < deadline and process.poll() is None:
            started = [e for e in (events(log) if log.exists() else []) if e[0] == "unit-started" and e[2] == 1]
            if started:
                victim = started[0]
            else:
                time.sleep(0.05)
        assert victim is not None, (tmp_path / "out.log").read_text()[-3000:]
        os.kill(victim[3], signal.SIGKILL)
        assert process.wait(timeout=600) == 0, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    return victim


def test_an_actor_killed_mid_chunk_is_restarted_and_the_study_still_ends_as_rfopt_run_does(
    postgres, reference, tiny_model, tmp_path
):
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    _, trial, unit, pid, _ = _kill_at_second_chunk(
        ray_command(storage, tmp_path / "ck", "--workers", "2", "--lease-seconds", "3"), tmp_path,
        env(tiny_model, RFOPT_EVENT_LOG=log, **SWEEP), log)
    rows = events(log)
    assert not any(e[0] == "unit-committed" and e[3] == pid for e in rows if e[1:3] == (trial, unit))
    assert any(e[0] == "unit-committed" and e[3] != pid for e in rows if e[1:3] == (trial, unit))
    assert_same_study(*reference, storage, tmp_path / "ck")
    _committed_once(log)


LONG_SWEEP = {"RFOPT_TEST_TRIALS": 8, "RFOPT_TEST_CHUNKS": 6}
"""The 8-trial sweep of tests/tiny_study.py, 6 chunks each: 47 units left after the first commit, some ten times
what two actors start in the moment a Ctrl-C takes to release them (at most 4 seen)."""


@pytest.fixture(scope="module")
def long_reference(tiny_model, tmp_path_factory):
    """``(storage, checkpoint_dir)`` of `LONG_SWEEP` run by plain `rfopt run`."""
    where = tmp_path_factory.mktemp("ray-long-reference")
    storage = f"sqlite:///{where / 'ref.db'}"
    command = rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--checkpoint-dir", str(where / "ck"),
                            "--no-progress")
    assert run(command, where, env(tiny_model, **LONG_SWEEP), where / "log") == 0, (where / "log").read_text()[-3000:]
    return storage, where / "ck"


def test_ctrl_c_releases_the_actors_and_leaves_every_trial_to_resume_where_it_was(
    postgres, long_reference, tiny_model, tmp_path
):
    """The Ctrl-C reaches the caller alone, which hears it at once; the actors train on until Ray has killed them
    (0.05-1.0 s after the signal, measured at a load of 9-12 on 2 cores) and start new units meanwhile, each committed
    whole or not at all. The 4 x 2 sweep's 7 units left after the first commit took 1.6 s where nothing released the
    actors: a slow release ended that study with no trial to resume. `LONG_SWEEP` leaves far more."""
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    process = start(ray_command(storage, tmp_path / "ck", "--workers", "2"), tmp_path,
                    env(tiny_model, RFOPT_EVENT_LOG=log, **LONG_SWEEP), tmp_path / "out.log")
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and any(e[0] == "unit-committed" for e in events(log))):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "out.log").read_text()[-3000:]
            time.sleep(0.05)
        sent = time.time()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 130, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert "interrupted: rerun the same command" in (tmp_path / "out.log").read_text()
    actors = {e[3] for e in events(log)}
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in actors) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in actors)  # released with the cluster the command started
    states = {t.number: t.state.name for t in trials(storage)}
    after = [(point, trial, unit, round(at - sent, 2)) for point, trial, unit, _, at in events(log) if at >= sent]
    assert "RUNNING" in states.values() and "FAIL" not in states.values(), (states, after)
    rerun = rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--checkpoint-dir", str(tmp_path / "ck"),
                          "--no-progress")
    assert run(rerun, tmp_path, env(tiny_model, **LONG_SWEEP), tmp_path / "rerun.log") == 0
    assert_same_study(*long_reference, storage, tmp_path / "ck")


def _alive(pid):
    """Whether process `pid` still runs (a zombie left for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_data_parallel_group_whose_lead_is_killed_is_restarted_whole_and_ends_as_on_one_device(
    postgres, tiny_model, tmp_path
):
    """Two actors train each trial together (``--devices-per-trial 2``); the group's lead dies in the middle of a
    chunk, its follower fails its next collective; the caller starts a new group, which resumes from the last
    checkpoint once the dead lead's lease expires. The study ends as on one device with the same global batch."""
    sweep = {"RFOPT_TEST_TRIALS": 2, "RFOPT_TEST_CHUNKS": 2}
    reference = f"sqlite:///{tmp_path / 'one.db'}"
    code = run(worker_command(reference, tmp_path / "one-ck", "--devices", "cpu", "--devices-per-trial", "1"),
               tmp_path, env(tiny_model, **sweep), tmp_path / "one.log")
    assert code == 0, (tmp_path / "one.log").read_text()[-3000:]
    storage = postgres.new_database()
    log = tmp_path / "events.log"
    victim = _kill_at_second_chunk(
        ray_command(storage, tmp_path / "ck", "--workers", "2", "--devices-per-trial", "2", "--lease-seconds", "3"),
        tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log, **sweep), log)
    assert any(e[0] == "unit-committed" and e[1:3] == victim[1:3] and e[3] != victim[3] for e in events(log))
    assert "restarting the group" in (tmp_path / "out.log").read_text()
    _committed_once(log)
    assert_same_study_but_summation_order(reference, storage, 1e-5)


def test_storage_the_actors_cannot_reach_fails_the_run_at_once_naming_the_url(postgres, tiny_model, tmp_path):
    """The caller reaches the database; the actors' environment makes every connection of theirs fail (libpq asked
    for SSL, which the server does not offer), as a database address that only the caller's machine resolves."""
    import rfopt
    from rfopt.errors import StorageUnreachableError
    from rfopt_testkit import prompts_dataset, trial_config

    storage = postgres.new_database()
    study = rfopt.create_study(study_name="unreachable", storage=storage, checkpoint_dir=tmp_path / "ck")
    cluster = rfopt.RayCluster(num_workers=2, runtime_env={"env_vars": {"PGSSLMODE": "require"}},
                               init_kwargs={"num_cpus": 2})
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError) as raised:
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2,
                       show_progress_bar=False, executor=cluster)
    assert time.monotonic() - started < 120
    assert storage in str(raised.value) and "not reachable from the cluster's workers" in str(raised.value)
    assert not ray.is_initialized()  # the cluster this call started is shut down
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials(storage, "unreachable"))


def test_the_workers_judge_rungs_with_the_callers_pruner(tiny_model, tmp_path):
    """The actors load the study with the caller's pruner and sampler. They used to load it with Optuna's defaults
    (a MedianPruner): a study file's population-based training never replaced a member on a cluster, and its halving
    never halved."""
    from rfopt.pruning import load_decision
    from rfopt.storage.schema import TrialRecord

    storage = f"sqlite:///{tmp_path / 'pbt.db'}"
    study_file = TESTS / "tiny_pbt_study.py"
    command = rfopt_command("run", str(study_file), "--storage", storage, "--checkpoint-dir", str(tmp_path / "ck"),
                            "--no-progress", "--ray", "--workers", "1")
    code = run(command, tmp_path, env(tiny_model, RFOPT_TEST_TRIALS=4, RFOPT_TEST_CHUNKS=3), tmp_path / "out.log")
    assert code == 0, (tmp_path / "out.log").read_text()[-3000:]
    ended = trials(storage, "tiny")
    judged = [decision for t in ended if (decision := load_decision(t, 0)) is not None]
    assert judged and {decision.pruner for decision in judged} == {"PopulationBasedTraining"}
    clones = [t for t in ended if TrialRecord(t).lineage is not None]
    assert clones and all(TrialRecord(t).lineage.by == "PopulationBasedTraining" for t in clones)


def test_a_worker_no_node_of_a_real_cluster_can_hold_is_refused_at_once(tiny_model, tmp_path):
    """Issue 35: ``--cpus-per-worker`` larger than any node waited forever, Ray printing "No available node types can
    fulfill resource request" every 35 s. A local cluster's one node is this machine: no machine has 4096 CPUs."""
    storage = f"sqlite:///{tmp_path / 'big.db'}"
    started = time.monotonic()
    code = run(ray_command(storage, tmp_path / "ck", "--cpus-per-worker", "4096"), tmp_path,
               env(tiny_model, **SWEEP), tmp_path / "out.log", timeout=180)
    output = (tmp_path / "out.log").read_text()
    assert code == 1 and time.monotonic() - started < 180, output[-3000:]
    assert "no node of the Ray cluster can hold a worker: each asks for 4096 CPUs (--cpus-per-worker 4096" in output
    assert trials(storage, "tiny") == []  # refused before any trial was asked
