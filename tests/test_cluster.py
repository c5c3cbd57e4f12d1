"""What `rfopt.engine.cluster` decides before a Ray cluster is involved (tests/test_ray.py runs it on one): how many actors,
with what resources; SQLite refused across nodes with what to use instead; a storage a worker cannot reach named."""

import optuna
import pytest

import rfopt
from rfopt.engine.cluster import ClusterStorageError, RayCluster, StorageUnreachableError, WorkerJob, check_reachable


def test_one_worker_per_gpu_where_the_cluster_has_gpus_else_per_cpu_share():
    assert RayCluster().placement({"CPU": 16.0, "GPU": 4.0}) == (4, {"num_gpus": 1, "num_cpus": 1})
    assert RayCluster().placement({"CPU": 8.0}) == (8, {"num_cpus": 1.0})
    assert RayCluster(cpus_per_worker=3).placement({"CPU": 8.0}) == (2, {"num_cpus": 3})
    assert RayCluster(gpus=False).placement({"CPU": 2.0, "GPU": 4.0}) == (2, {"num_cpus": 1.0})
    assert RayCluster(num_workers=3).placement({"CPU": 8.0, "GPU": 8.0})[0] == 3
    with pytest.raises(ValueError, match="the cluster has no GPU"):
        RayCluster(gpus=True).placement({"CPU": 8.0})


def test_bad_cluster_settings_are_refused_all_at_once():
    with pytest.raises(ValueError) as raised:
        RayCluster(num_workers=0, cpus_per_worker=0, lease_seconds=-1)
    assert all(word in str(raised.value) for word in ("num_workers", "cpus_per_worker", "lease_seconds"))


def _job(storage, checkpoint_dir=None):
    return WorkerJob("s", storage, checkpoint_dir, [], {})


def test_sqlite_is_refused_on_a_cluster_of_several_nodes_saying_what_to_use():
    _job("sqlite:////tmp/study.db").on_cluster(1)  # one machine: its file is shared by its processes
    with pytest.raises(ClusterStorageError) as raised:
        _job("sqlite:////tmp/study.db").on_cluster(2)
    message = str(raised.value)
    assert "sqlite:////tmp/study.db" in message and "postgresql://" in message
    assert "--checkpoint-dir" in message and "s3://" in message
    _job("postgresql://rfopt@db/rfopt", "s3://bucket/rfopt").on_cluster(3)


def test_an_in_memory_study_cannot_be_shared_with_workers(tiny_model):
    from rfopt.config.spaces import as_space
    from rfopt_testkit import trial_config

    study = rfopt.create_study(study_name="m", storage=optuna.storages.InMemoryStorage())
    with pytest.raises(ClusterStorageError, match="PostgreSQL URL"):
        WorkerJob.of(study.optuna, None, as_space([trial_config(tiny_model)]), (None, None), {})


def test_a_relative_sqlite_path_reaches_the_workers_as_an_absolute_one(tmp_path, monkeypatch, tiny_model):
    from rfopt.config.spaces import as_space
    from rfopt_testkit import trial_config

    monkeypatch.chdir(tmp_path)
    study = rfopt.create_study(study_name="rel", storage="sqlite:///rel.db")
    job = WorkerJob.of(study.optuna, None, as_space([trial_config(tiny_model)]), (None, None), {})
    assert job.storage == f"sqlite:///{tmp_path / 'rel.db'}"
    assert [c.to_json() for c in job.space()] == job.space_ref  # a list travels as its configs' JSON


def test_a_storage_a_worker_cannot_reach_is_named_at_once(tmp_path):
    with pytest.raises(StorageUnreachableError, match=r"sqlite:////nowhere/x\.db is not reachable"):
        check_reachable("sqlite:////nowhere/x.db")
    (tmp_path / "x.db").touch()
    check_reachable(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(StorageUnreachableError) as raised:  # nothing listens on port 1
        check_reachable("postgresql://rfopt:secret@127.0.0.1:1/rfopt", timeout=5)
    assert "postgresql://rfopt:***@127.0.0.1:1/rfopt" in str(raised.value) and "secret" not in str(raised.value)


def test_workers_option_without_ray_is_refused(capsys):
    from crashkit import STUDY_FILE
    from rfopt.cli import main

    assert main(["run", str(STUDY_FILE), "--workers", "2"]) == 1
    assert "--workers and --devices-per-trial are for --ray" in capsys.readouterr().err
    assert main(["run", str(STUDY_FILE), "--ray", "--device", "cuda"]) == 1
    assert "leave --device out" in capsys.readouterr().err


def test_the_callers_view_reports_each_unit_and_trial_end_once_from_storage(tmp_path):
    """What `RayCluster` shows and calls while actors train elsewhere: `Watcher.poll` reads the study and hears of each
    unit reported and each trial ended since it started watching, once."""
    from rfopt.engine.cluster import Watcher

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'w.db'}", direction="maximize")
    before = study.ask()
    before.report(0.1, step=0)  # reported before the run: not this run's
    watcher = Watcher(study)
    units, ended = [], []
    trial = study.ask()
    trial.report(0.5, step=0)
    trial.report(0.7, step=1)
    progress = watcher.poll(lambda *unit: units.append(unit), [lambda s, t: ended.append(t.number)])
    assert units == [(1, 0, 0.5), (1, 1, 0.7)] and ended == []
    assert (progress.done, progress.best, progress.last) == (2, 0.7, (1, 1, 0.7))
    assert progress.counts == {"RUNNING": 2}
    study.tell(trial, 0.7)
    study.tell(before, state=optuna.trial.TrialState.PRUNED)
    progress = watcher.poll(lambda *unit: units.append(unit), [lambda s, t: ended.append(t.number)])
    watcher.poll(lambda *unit: units.append(unit), [lambda s, t: ended.append(t.number)])
    assert len(units) == 2 and sorted(ended) == [0, 1]
    assert progress.counts == {"COMPLETE": 1, "PRUNED": 1}
