"""What `rfopt.engine.cluster.ray_cluster` decides before a Ray cluster is involved (tests/engine/test_ray.py runs it on one): how
many actors, with what resources; SQLite refused across nodes with what to use instead; a storage a worker cannot reach
named."""

import optuna
import pytest

import rfopt
from rfopt.errors import ClusterStorageError, ClusterTooSmallError, StorageUnreachableError
from rfopt.engine.cluster.ray_cluster import RayCluster
from rfopt.engine.cluster.ray_worker import WorkerJob, check_reachable


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
    from rfopt.engine.cluster.ray_cluster import Watcher

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


@pytest.mark.parametrize("arguments, message", [
    (dict(num_workers=True), "num_workers must be a whole number, 1 or more, got True"),
    (dict(num_workers=2.5), "num_workers must be a whole number"),
    (dict(gpus="yes"), "gpus must be True, False or None (if the cluster has GPUs), got 'yes'"),
    (dict(address=42), "address must be None, 'auto' or a cluster's address as text, got 42"),
    (dict(cpus_per_worker="1"), "cpus_per_worker must be a finite number more than 0, got '1'"),
    (dict(cpus_per_worker=float("inf")), "cpus_per_worker must be a finite number more than 0, got inf"),
    (dict(cpus_per_worker=float("nan")), "cpus_per_worker must be a finite number more than 0, got nan"),
    (dict(lease_seconds=float("inf")), "lease_seconds must be a finite number of seconds more than 0"),
    (dict(devices_per_trial=True), "devices_per_trial must be a whole number, 1 or more, got True"),
    (dict(max_restarts="always"), "max_restarts must be a whole number, -1 (always) or more"),
    (dict(node_wait_seconds=-1), "node_wait_seconds must be a finite number of seconds, 0 or more"),
    (dict(runtime_env="env"), "runtime_env must be a dict, got str 'env'"),
])
def test_a_cluster_setting_of_the_wrong_type_or_not_finite_is_refused_where_it_is_made(arguments, message):
    """Issue 35: ``num_workers=True``, ``gpus="yes"``, ``address=42`` were accepted, ``cpus_per_worker="1"`` raised a raw
    TypeError and ``inf`` started a cluster before an OverflowError."""
    with pytest.raises(ValueError) as raised:
        RayCluster(**arguments)
    assert message in str(raised.value)


def test_cpus_per_worker_inf_is_refused_by_the_command_line_before_anything_starts(capsys):
    from crashkit import STUDY_FILE
    from rfopt.cli import main

    with pytest.raises(SystemExit):
        main(["run", str(STUDY_FILE), "--ray", "--cpus-per-worker", "inf"])
    assert "--cpus-per-worker: must be a finite number more than 0, got inf" in capsys.readouterr().err


TWO_CPU_NODES = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 2.0, "memory": 1e9}]


def test_a_worker_no_node_can_hold_is_refused_naming_the_largest_node_and_the_flag():
    """Issue 35: on nodes of 2 CPUs, ``--cpus-per-worker 4`` waited forever for a node Ray could not find."""
    with pytest.raises(ClusterTooSmallError) as raised:
        RayCluster(cpus_per_worker=4).placement({"CPU": 4.0}, TWO_CPU_NODES)
    message = str(raised.value)
    assert "each asks for 4 CPUs (--cpus-per-worker 4" in message and "the largest of its 2 node(s) has 2 CPU(s)" in message
    assert "--cpus-per-worker 2 or less" in message
    with pytest.raises(ClusterTooSmallError, match="each takes a GPU and a CPU, and the largest node has 0 CPU"):
        RayCluster().placement({"CPU": 0.0, "GPU": 2.0}, [{"GPU": 2.0}])
    # A worker fits on one node or not at all: two nodes of 3 CPUs hold two workers of 2 CPUs, not three.
    assert RayCluster(cpus_per_worker=2).placement({"CPU": 6.0}, [{"CPU": 3.0}, {"CPU": 3.0}]) == (2, {"num_cpus": 2})
    assert RayCluster().placement({"CPU": 8.0, "GPU": 2.0}, [{"CPU": 4.0, "GPU": 1.0}] * 2) == (
        2, {"num_gpus": 1, "num_cpus": 1})


class _FakeRay:
    """What `RayCluster.run_job` asks of Ray before it starts an actor: nodes that may grow while it waits."""

    def __init__(self, nodes, grow_after=None):
        self._nodes, self.grow_after, self.calls = nodes, grow_after, 0
        self.inits, self.remote_made = [], False

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def shutdown(self):
        pass

    def nodes(self):
        self.calls += 1
        if self.grow_after is not None and self.calls > self.grow_after:
            return [{"Alive": True, "Resources": node} for node in [*self._nodes, {"CPU": 8.0}]]
        return [{"Alive": True, "Resources": node} for node in self._nodes]

    def cluster_resources(self):
        return {"CPU": sum(node.get("CPU", 0) for node in self._nodes)}

    def remote(self, cls):
        self.remote_made = True
        raise AssertionError("no actor may be made on a cluster that cannot hold one")


def _run_job(cluster, fake, monkeypatch):
    from rfopt.engine.cluster import ray_cluster as module

    monkeypatch.setattr(module, "_import_ray", lambda: fake)
    cluster.run_job(optuna.create_study(), _job("postgresql://rfopt@db/rfopt", "s3://bucket/rfopt"))


def test_a_run_on_a_cluster_too_small_for_a_worker_is_refused_at_once_before_any_actor(monkeypatch):
    fake = _FakeRay(TWO_CPU_NODES)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ClusterTooSmallError, match="--cpus-per-worker 4"):
        _run_job(RayCluster(cpus_per_worker=4), fake, monkeypatch)
    assert not fake.remote_made and fake.calls == 1


def test_an_autoscaling_cluster_gets_a_bounded_wait_for_a_node_that_can_hold_a_worker(monkeypatch):
    import ray.autoscaler.sdk

    asked = []
    monkeypatch.setattr(ray.autoscaler.sdk, "request_resources", lambda bundles: asked.append(bundles))
    grows = RayCluster(cpus_per_worker=4, node_wait_seconds=30, poll_seconds=0.01)
    with pytest.raises(AssertionError, match="no actor may be made"):  # the node came: it goes on to make actors
        _run_job(grows, _FakeRay(TWO_CPU_NODES, grow_after=3), monkeypatch)
    assert asked == [[{"CPU": 4}], []]  # the autoscaler was asked for such a node, and the request cleared
    never = RayCluster(cpus_per_worker=4, node_wait_seconds=0.2, poll_seconds=0.01)
    with pytest.raises(ClusterTooSmallError, match=r"--cpus-per-worker 4.*waited 0.2 s for the cluster to add"):
        _run_job(never, _FakeRay(TWO_CPU_NODES), monkeypatch)


def test_a_local_cluster_rfopt_starts_runs_no_ray_dashboard_unless_asked(monkeypatch):
    """Ray's servers listen on every interface and Ray cannot bind them to the loopback alone (`LOCAL_CLUSTER`): a
    local cluster rfopt starts runs no Ray dashboard (a web server with job submission) unless asked for one."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake = _FakeRay(TWO_CPU_NODES)
    with pytest.raises(ClusterTooSmallError):
        _run_job(RayCluster(cpus_per_worker=4), fake, monkeypatch)
    assert fake.inits == [{"address": None, "logging_level": 30, "include_dashboard": False}]
    fake = _FakeRay(TWO_CPU_NODES)
    with pytest.raises(ClusterTooSmallError):
        _run_job(RayCluster(cpus_per_worker=4, init_kwargs={"include_dashboard": True}), fake, monkeypatch)
    assert fake.inits == [{"address": None, "logging_level": 30, "include_dashboard": True}]
    fake = _FakeRay(TWO_CPU_NODES)
    with pytest.raises(ClusterTooSmallError):
        _run_job(RayCluster(address="ray://head:10001", cpus_per_worker=4), fake, monkeypatch)
    assert fake.inits == [{"address": "ray://head:10001", "logging_level": 30}]  # another's cluster: as it is
