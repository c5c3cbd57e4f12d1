"""A study on a Ray cluster: one rfopt worker per device, each a Ray actor running a worker's `rfopt.engine.running.run`.

    >>> study = rfopt.create_study(study_name="gsm8k", storage="postgresql://rfopt@db/rfopt",
    ...                            checkpoint_dir="s3://bucket/rfopt")                          # doctest: +SKIP
    >>> study.optimize(space, train, test, n_trials=16, executor=rfopt.RayCluster("auto"))   # doctest: +SKIP

Ray places, starts and restarts the workers; the study's storage decides who trains what, exactly as it
does for ``rfopt worker`` processes started by hand: every actor runs the same worker loop with leases
(`rfopt.engine.running.coordinator`), so an actor that dies (a node lost, ``ray.kill``, out of memory) is restarted by
Ray, and the unit it was training is trained again from the trial's last checkpoint once its lease
expires; nothing else is lost. The caller's process trains nothing: it starts the actors, shows the
progress bar from storage, calls ``on_unit`` and the Optuna callbacks as trials commit and end there, and
releases the actors when the study is done, on an error, or on Ctrl-C (the trials stay resumable).

What each actor needs travels by value or by reference, as for a worker process: the datasets by value
(``ray.put``), a list of configs as their JSON, a search space function by its import path (a study
file's path, or ``module:function``), reward functions as the configs store them. On a cluster of several
nodes, the files those paths name must be at the same path on every node (or shipped with
``runtime_env={"working_dir": ...}``).

This module is the caller's side (`RayCluster`: where the workers go, starting and restarting them, the caller's view
from storage); what each actor runs is `rfopt.engine.cluster.ray_worker`'s.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.config.spaces import ListSpace
from rfopt.errors import ClusterTooSmallError, MissingPackage, Refusal
from rfopt.reports.status import state_counts
from rfopt.storage.schema import TrialRecord

from rfopt.engine.planning.checks import check_run
from rfopt.engine.planning.request import RunRequest
from rfopt.engine.running.roster import RunProgress
from rfopt.engine.running.run import started

from .ray_worker import WorkerJob, _Worker

logger = logging.getLogger("rfopt")

LOCAL_CLUSTER = """A local Ray cluster that rfopt starts (no address, no ``RAY_ADDRESS``) starts no Ray dashboard (its web
server, with job submission, would listen on port 8265) unless ``init_kwargs`` asks for one. Ray's own servers (GCS,
raylet, its workers) listen on every interface, and Ray 2.60 has no setting that binds them to the loopback interface
alone (a loopback ``_node_ip_address`` is resolved back to the machine's address): what guards them is Ray's token
authentication, which Ray turns on where a token exists (``ray get-auth-token --generate``, or ``RAY_AUTH_MODE=token``
in the environment before Ray is imported)."""

GRACE_SECONDS = 10.0
"""After one worker returns (nothing is left to train), how long the others get to return before they are
released."""


@dataclass
class RayCluster:
    """Where `Study.optimize(..., executor=RayCluster(...))` runs the study: one worker per device of a Ray cluster.

    Args:
        address: the cluster, as ``ray.init`` takes it: None (a running cluster named by ``RAY_ADDRESS``, else a new
            local one on this machine), ``"auto"`` (the cluster this machine belongs to) or ``"ray://head:10001"``.
            A Ray already initialized in this process is used as it is.
        num_workers: actors to start; default: one per GPU of the cluster, else one per `cpus_per_worker` CPUs.
        cpus_per_worker: each actor's CPU share where it trains on the CPU (Ray's ``num_cpus``).
        gpus: whether each actor takes a GPU (``num_gpus=1``; it trains on ``cuda``); None: if the cluster has GPUs.
        lease_seconds: a dead actor's unit is trained again once its lease expires (`Study.work`).
        poll_seconds: how often the caller reads the study for its progress bar, and idle workers look for work.
        runtime_env: Ray's ``runtime_env`` for the actors (``env_vars``, ``working_dir``, ``pip``, ...).
        max_restarts: how often Ray restarts a dead actor (-1: always).
        devices_per_trial: train each trial over this many actors' devices at once (data parallel).
        node_wait_seconds: where no node of the cluster can hold a worker, how long to wait for an autoscaling cluster
            to add one (its autoscaler is asked for it) before refusing; 0 (the default): refuse at once.
    """

    address: str | None = None
    num_workers: int | None = None
    cpus_per_worker: float = 1.0
    gpus: bool | None = None
    lease_seconds: float = 30.0
    poll_seconds: float = 1.0
    runtime_env: dict[str, Any] | None = None
    max_restarts: int = -1
    devices_per_trial: int = 1
    """Devices each trial trains on at once, as one data-parallel job (`rfopt.training.parallel`): the workers are groups of
    this many actors. A group whose actor dies is restarted whole by the caller."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments for ``ray.init`` when this call starts or connects to the cluster."""
    node_wait_seconds: float = 0.0

    def __post_init__(self) -> None:
        """Every argument checked at once, by type and value, before anything starts."""
        problems = []
        if self.address is not None and not isinstance(self.address, str):
            problems.append(f"address must be None, 'auto' or a cluster's address as text, got {self.address!r}")
        if self.num_workers is not None and (not _whole(self.num_workers) or self.num_workers < 1):
            problems.append(f"num_workers must be a whole number, 1 or more, got {self.num_workers!r}")
        if not _finite(self.cpus_per_worker) or not self.cpus_per_worker > 0:
            problems.append(f"cpus_per_worker must be a finite number more than 0, got {self.cpus_per_worker!r}")
        if self.gpus is not None and not isinstance(self.gpus, bool):
            problems.append(f"gpus must be True, False or None (if the cluster has GPUs), got {self.gpus!r}")
        for name in ("lease_seconds", "poll_seconds"):
            if not _finite(getattr(self, name)) or not getattr(self, name) > 0:
                problems.append(f"{name} must be a finite number of seconds more than 0, got {getattr(self, name)!r}")
        if not _finite(self.node_wait_seconds) or self.node_wait_seconds < 0:
            problems.append(f"node_wait_seconds must be a finite number of seconds, 0 or more, got "
                            f"{self.node_wait_seconds!r}")
        if not _whole(self.max_restarts) or self.max_restarts < -1:
            problems.append(f"max_restarts must be a whole number, -1 (always) or more, got {self.max_restarts!r}")
        if not _whole(self.devices_per_trial) or self.devices_per_trial < 1:
            problems.append(f"devices_per_trial must be a whole number, 1 or more, got {self.devices_per_trial!r}")
        for name in ("runtime_env", "init_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                problems.append(f"{name} must be a dict, got {type(value).__name__} {value!r}")
        if problems:
            raise Refusal("RayCluster: " + "; ".join(problems))

    # ------------------------------------------------------------------ the run
    def run(self, study: optuna.Study, request: RunRequest, checkpoint_dir: str | None = None) -> None:
        """Carry out `request` (`Study.optimize(..., executor=self)`, through `rfopt.engine.running.run.run`) on the cluster:
        the same checks here as a local run's, then one worker per device there, until no trial is left."""
        checked = check_run(study, request)
        space, n_trials, n_trials_total = checked.space, request.n_trials, request.n_trials_total
        if isinstance(space, ListSpace):
            if n_trials is not None:
                raise Refusal("n_trials with a list of configs: on a cluster the workers run every config not run "
                                 "yet; leave n_trials out")
            concurrent = request.max_concurrent or max(1, min(len(space), 8))
        else:  # n_trials counts this call's new trials: the workers share them as a study total
            total = n_trials_total if n_trials is None else started(study) + n_trials
            if n_trials is not None and n_trials_total is not None:
                total = min(total, n_trials_total)
            n_trials_total = total
            concurrent = request.max_concurrent or max(1, min(n_trials or n_trials_total or 8, 8))
        job = WorkerJob.of(study, checkpoint_dir, space, (request.train_dataset, request.eval_dataset), dict(
            pruner=checked.pruner,
            n_trials_total=n_trials_total, timeout=request.timeout, catch=request.catch, max_concurrent=concurrent,
            precision=request.precision, report_to=request.report_to, gang_size=request.gang_size,
            gang_training=request.gang_training, settings=request.settings, prune_collapsed=request.prune_collapsed), lease_seconds=self.lease_seconds,
            poll_seconds=self.poll_seconds)
        self.run_job(study, job, callbacks=request.callbacks, on_unit=request.on_unit,
                     show_progress_bar=request.show_progress_bar)

    def run_job(self, study: optuna.Study, job: WorkerJob, *,
                callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = (),
                on_unit: Callable[[int, int, float], None] | None = None, show_progress_bar: bool = True) -> None:
        """Run `job` on the cluster until no trial is left."""
        ray = _import_ray()
        started_here = not ray.is_initialized()
        if started_here:
            kwargs = dict(self.init_kwargs)
            if self.address is None and not os.environ.get("RAY_ADDRESS"):  # a new local cluster, on this machine
                kwargs.setdefault("include_dashboard", False)  # see LOCAL_CLUSTER
            ray.init(address=self.address, logging_level=logging.WARNING, **kwargs)
        groups: list[_Group] = []
        try:
            nodes = [node for node in ray.nodes() if node.get("Alive")]
            job = job.on_cluster(len(nodes))
            count, resources = self._place(ray, nodes)
            alone = self.devices_per_trial == 1  # Ray restarts a lone worker; a group is restarted whole, here
            # Two threads: `ping` answers while `work` runs (a group asks whether its members are alive).
            worker = ray.remote(_Worker).options(**resources, max_restarts=self.max_restarts if alone else 0,
                                                 max_task_retries=-1 if alone else 0, runtime_env=self.runtime_env,
                                                 max_concurrency=2)
            logger.info("study %r: %d workers on a Ray cluster of %d node(s), each %s", job.study_name, count,
                        len(nodes), resources)
            device = "cuda" if resources.get("num_gpus") else "cpu"
            start = _GroupStarter(ray, worker, device, job.without_data(), ray.put(job.datasets),
                                  self.devices_per_trial)
            groups = [start() for _ in range(count // self.devices_per_trial)]
            self._wait(ray, study, groups, start, job, callbacks, on_unit, show_progress_bar)
        finally:
            for group in groups:
                group.kill(ray)
            if started_here:
                ray.shutdown()

    def placement(self, resources: dict[str, float], nodes: Sequence[dict[str, float]] | None = None
                  ) -> tuple[int, dict[str, float]]:
        """How many actors, and what each asks of Ray, on a cluster with these total resources. With `nodes` (each
        alive node's resources, as ``ray.nodes()`` gives them), a worker must fit on one node: where none can hold one,
        `ClusterTooSmallError` naming the largest node and the flag (Ray would wait for such a node forever), and by
        default one worker per worker a node holds."""
        count, each = self._worker(resources)
        if nodes is not None:
            room = sum(_holds(node, each) for node in nodes)
            if room == 0:
                raise ClusterTooSmallError(self._too_small(nodes, each))
            if self.num_workers is None:
                count = room
            elif self.num_workers > room:
                logger.warning("RayCluster(num_workers=%d): the cluster's nodes hold %d such workers; the others wait "
                               "for room", self.num_workers, room)
        if count < self.devices_per_trial:
            raise Refusal(f"RayCluster(devices_per_trial={self.devices_per_trial}): the cluster gives {count} "
                             f"worker device(s); a trial needs {self.devices_per_trial}")
        return count - count % self.devices_per_trial, each

    def _worker(self, resources: dict[str, float]) -> tuple[int, dict[str, float]]:
        """The default number of workers on a cluster with these total resources, and what each asks of Ray."""
        cluster_gpus = int(resources.get("GPU", 0))
        gpus = cluster_gpus > 0 if self.gpus is None else self.gpus
        if gpus:
            if cluster_gpus < 1:
                raise Refusal("RayCluster(gpus=True): the cluster has no GPU; leave gpus=None to train on its CPUs")
            return self.num_workers or cluster_gpus, {"num_gpus": 1, "num_cpus": 1}
        cpus = resources.get("CPU", 0)
        return self.num_workers or max(1, math.floor(cpus / self.cpus_per_worker)), {"num_cpus": self.cpus_per_worker}

    def _too_small(self, nodes: Sequence[dict[str, float]], each: dict[str, float]) -> str:
        def size(node: dict[str, float]) -> str:
            return f"{_amount(node.get('CPU', 0))} CPU(s)" + (f" and {_amount(node['GPU'])} GPU(s)"
                                                               if node.get("GPU") else "")

        if each.get("num_gpus"):
            largest = max(nodes, key=lambda n: (min(n.get("GPU", 0), n.get("CPU", 0)), n.get("CPU", 0)))
            return (f"no node of the Ray cluster can hold a worker: each takes a GPU and a CPU, and the largest node "
                    f"has {size(largest)}. Give gpus=False (rfopt run --ray trains on the CPUs of a cluster without "
                    "GPUs), or add a node with a GPU")
        largest = max(nodes, key=lambda n: n.get("CPU", 0))
        need = _amount(each["num_cpus"])
        return (f"no node of the Ray cluster can hold a worker: each asks for {need} CPUs (--cpus-per-worker {need}, "
                f"RayCluster(cpus_per_worker={need})), and the largest of its {len(nodes)} node(s) has {size(largest)}. "
                f"Give --cpus-per-worker {_amount(largest.get('CPU', 0))} or less, or add larger nodes")

    def _place(self, ray: Any, nodes: list[dict[str, Any]]) -> tuple[int, dict[str, float]]:
        """`placement` on the cluster `ray` is connected to; where no node can hold a worker and `node_wait_seconds`
        allows, the cluster's autoscaler is asked for one, and its nodes are read again until one can (or refused)."""
        try:
            return self.placement(ray.cluster_resources(), [node.get("Resources", {}) for node in nodes])
        except ClusterTooSmallError as exc:
            if self.node_wait_seconds <= 0:
                raise
            refusal = exc
        from ray.autoscaler.sdk import request_resources

        logger.warning("%s; waiting up to %.0f s for the cluster to add one", refusal, self.node_wait_seconds)
        each = self._worker(ray.cluster_resources())[1]
        request_resources(bundles=[{"CPU": each["num_cpus"], **({"GPU": each["num_gpus"]} if "num_gpus" in each
                                                                 else {})}])
        try:
            deadline = time.monotonic() + self.node_wait_seconds
            while time.monotonic() < deadline:
                time.sleep(min(self.poll_seconds, max(0.0, deadline - time.monotonic())))
                nodes = [node for node in ray.nodes() if node.get("Alive")]
                try:
                    return self.placement(ray.cluster_resources(), [node.get("Resources", {}) for node in nodes])
                except ClusterTooSmallError as exc:
                    refusal = exc
        finally:
            request_resources(bundles=[])  # the actors ask for what they need from here on
        raise ClusterTooSmallError(f"{refusal} (waited {self.node_wait_seconds:g} s for the cluster to add such a "
                                   "node: node_wait_seconds)")

    def _wait(self, ray: Any, study: optuna.Study, groups: list[_Group], start: _GroupStarter, job: WorkerJob,
              callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]],
              on_unit: Callable[[int, int, float], None] | None, show_progress_bar: bool) -> None:
        from rfopt.reports.display import ProgressBar as Bar

        watcher = Watcher(study)
        finished_at: float | None = None
        restarts = 0
        with Bar(job.study_name, enabled=show_progress_bar, study=study) as bar:
            while pending := [ref for group in groups for ref in group.pending]:
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=self.poll_seconds)
                for ref in done:
                    group = next(g for g in groups if ref in g.pending)
                    group.pending.remove(ref)
                    try:
                        ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                        if len(group.actors) > 1 and group.lost_a_member(ray, exc) and (
                                self.max_restarts < 0 or restarts < self.max_restarts):
                            restarts += 1
                            logger.warning("study %r: a worker of a data-parallel group died; restarting the group "
                                           "(its chunk is trained again from the last checkpoint)", job.study_name)
                            group.kill(ray)
                            groups[groups.index(group)] = start()
                            break
                        cause = getattr(exc, "cause", None)  # the actor's own exception, as a local run raises it
                        raise (cause if isinstance(cause, BaseException) else exc) from None
                    finished_at = finished_at or time.monotonic()
                bar(watcher.poll(on_unit, callbacks))
                if finished_at is not None and time.monotonic() - finished_at > GRACE_SECONDS:
                    logger.info("study %r: nothing left to train; releasing the idle workers", job.study_name)
                    break
            bar(watcher.poll(on_unit, callbacks))


@dataclass
class _Group:
    """The actors of one worker (one, or a data-parallel group) and their `work` calls not returned yet."""

    actors: list[Any]
    pending: list[Any]

    def lost_a_member(self, ray: Any, exc: BaseException) -> bool:
        """Whether one of the group's actors died (the others then fail in their next collective)."""
        if isinstance(exc, ray.exceptions.RayActorError):
            return True
        for actor in self.actors:
            try:
                ray.get(actor.ping.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return True
        return False

    def kill(self, ray: Any) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


@dataclass
class _GroupStarter:
    """Starts one worker on the cluster: an actor, or `devices_per_trial` actors meeting at the first one's address."""

    ray: Any
    worker: Any
    device: str
    job: WorkerJob
    data: Any
    devices_per_trial: int

    def __call__(self) -> _Group:
        from rfopt.training.parallel import DataParallel

        size = self.devices_per_trial
        actors = [self.worker.remote(self.device) for _ in range(size)]
        if size == 1:
            return _Group(actors, [actors[0].work.remote(self.job, self.data, None)])
        address, port = self.ray.get(actors[0].address.remote())
        return _Group(actors, [actor.work.remote(self.job, self.data, DataParallel(rank, size, address, port))
                               for rank, actor in enumerate(actors)])


# ---------------------------------------------------------------------- the caller's view, from storage
class Watcher:
    """The caller's view of a study its workers run elsewhere: progress, and the units and trials that ended since
    it started watching (for ``on_unit`` and Optuna's callbacks), read from storage at each `poll`."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self._maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        trials = study.get_trials(deepcopy=False)
        self._units_seen = {(t.number, step) for t in trials for step in t.intermediate_values}
        self._ended_seen = {t.number for t in trials if t.state.is_finished()}
        self._done = 0
        self._best: float | None = None
        self._last: tuple[int, int, float] | None = None

    def poll(self, on_unit: Callable[[int, int, float], None] | None = None,
             callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = ()) -> RunProgress:
        trials = self.study.get_trials(deepcopy=False)
        counts = state_counts(trials, shown=False)
        remaining = 0
        for trial in trials:
            record = TrialRecord(trial)
            for step in sorted(trial.intermediate_values):
                if (trial.number, step) not in self._units_seen:
                    self._units_seen.add((trial.number, step))
                    self._done += 1
                    value = trial.intermediate_values[step]
                    self._last = (trial.number, step, value)
                    if self._best is None or (value > self._best if self._maximize else value < self._best):
                        self._best = value
                    if on_unit is not None:
                        on_unit(trial.number, step, value)
            if trial.state == TrialState.RUNNING and record.num_units is not None:
                remaining += max(0, record.num_units - record.committed)
            if trial.state.is_finished() and trial.number not in self._ended_seen:
                self._ended_seen.add(trial.number)
                for callback in callbacks:
                    callback(self.study, copy.deepcopy(trial))
        return RunProgress(done=self._done, total=self._done + remaining, counts=counts, best=self._best,
                        last=self._last)


def _holds(node: dict[str, float], each: dict[str, float]) -> int:
    """How many workers that each ask `each` (Ray's ``num_cpus``, ``num_gpus``) a node with these resources holds."""
    fits = [math.floor(node.get(resource, 0) / need + 1e-9)
            for resource, need in (("CPU", each.get("num_cpus", 0)), ("GPU", each.get("num_gpus", 0))) if need > 0]
    return min(fits) if fits else 0


def _amount(value: float) -> str:
    return f"{value:g}"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MissingPackage("running a study on a Ray cluster needs Ray: pip install 'rfopt[ray]'") from None
    return ray


__all__ = ["ClusterTooSmallError", "RayCluster", "Watcher"]
