"""One rfopt worker on a Ray actor: the job every actor is given (`WorkerJob`), the actor that joins the study with it,
and its check that the study's storage can be reached from its node."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from rfopt.config.spaces import ListSpace
from rfopt.errors import ClusterStorageError, StorageUnreachableError
from rfopt.pruning import optuna_pruner
from rfopt.storage.database import redact

from rfopt.engine.planning.request import RunRequest, Worker
from rfopt.engine.running.run import follow_moved_checkpoints, run

logger = logging.getLogger("rfopt")


@dataclass
class WorkerJob:
    """What every actor needs to join the study: a `RunRequest`'s fields, by value or by reference."""

    study_name: str
    storage: str
    """The storage URL, password included (the actors connect with it)."""
    checkpoint_dir: str | None
    space_ref: str | list[str]
    """A search space function's import path, or a list's configs as JSON."""
    run_kwargs: dict[str, Any]
    """`RunRequest` fields every worker shares (not the space, datasets, device or worker); its ``pruner`` is the
    caller's (an Optuna pruner, or population-based training): every worker judges rungs as the caller would."""
    lease_seconds: float = 30.0
    poll_seconds: float = 1.0
    sampler: Any = None
    """The caller's study's sampler: every worker samples as the caller's process would."""
    datasets: tuple[Any, Any] | None = None

    @classmethod
    def of(cls, study: optuna.Study, checkpoint_dir: str | None, space: Any, datasets: tuple[Any, Any],
           run_kwargs: dict[str, Any], *, lease_seconds: float = 30.0, poll_seconds: float = 1.0) -> WorkerJob:
        """The job for `study`'s `space` (a `FunctionSpace` or `ListSpace`), with the checkpoint location the caller
        gave (None: the study's); `ClusterStorageError` if its storage is not a database other processes can open."""
        from rfopt.compat import storage_of
        from rfopt.config.usercode import import_path
        from rfopt.storage.database import sqlalchemy_engine_of

        engine = sqlalchemy_engine_of(storage_of(study))
        if engine is None or engine.url.database in (None, "", ":memory:"):
            raise ClusterStorageError(
                f"study {study.study_name!r}: its storage is not a database that the cluster's workers can open; give "
                "a PostgreSQL URL (postgresql://user@host/db), or on one machine a SQLite file"
            )
        url = engine.url
        if url.get_backend_name() == "sqlite":
            url = url.set(database=os.path.abspath(url.database))  # the actors run in other working directories
        space_ref = ([config.to_json() for config in space.configs] if isinstance(space, ListSpace)
                     else import_path(space.function))
        return cls(study.study_name, url.render_as_string(hide_password=False), checkpoint_dir, space_ref,
                   dict(run_kwargs), lease_seconds, poll_seconds, study.sampler, datasets)

    def on_cluster(self, nodes: int) -> WorkerJob:
        """This job, checked against a cluster of `nodes` nodes: SQLite is one machine's file."""
        if nodes > 1 and self.storage.startswith("sqlite"):
            raise ClusterStorageError(
                f"study {self.study_name!r} is in a SQLite file ({redact(self.storage)}), which the other "
                f"{nodes - 1} node(s) of the Ray cluster cannot share; give a PostgreSQL URL "
                "(--storage postgresql://user@host/db) and a checkpoint location every node reaches (--checkpoint-dir "
                "on shared storage, or s3://bucket/prefix)"
            )
        if nodes > 1 and (self.checkpoint_dir is None or "://" not in self.checkpoint_dir):
            logger.warning("study %r: checkpoints in the local directory %s; every node of the cluster must mount it "
                           "at that path (else give --checkpoint-dir s3://bucket/prefix)", self.study_name,
                           self.checkpoint_dir)
        return self

    def without_data(self) -> WorkerJob:
        return dataclasses.replace(self, datasets=None)

    def space(self) -> Any:
        from rfopt.config.trial import TrialConfig
        from rfopt.config.usercode import resolve_import

        if isinstance(self.space_ref, str):
            return resolve_import(self.space_ref)
        return [TrialConfig.from_json(text) for text in self.space_ref]


class _Worker:
    """A Ray actor: one rfopt worker on one device (made a Ray actor class by `RayCluster.run`)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def ping(self) -> bool:
        return True

    def address(self) -> tuple[str, int]:
        """Where a data-parallel group led by this actor meets: its node's address and a free port."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def work(self, job: WorkerJob, datasets: tuple[Any, Any], group: Any = None) -> str:
        """Join the study as a worker until no trial is left (in data-parallel `group`, if given: rank 0 works, the
        others follow its chunks); returns this worker's name."""
        from rfopt.storage.database import open_storage
        from rfopt.storage.leases import worker_id

        if group is not None:
            group.start(self.device)  # before any config is built: Accelerate reads the group once per process
        check_reachable(job.storage)
        pruner = job.run_kwargs.get("pruner")
        study = optuna.load_study(study_name=job.study_name, storage=open_storage(job.storage, create=False),
                                  sampler=job.sampler, pruner=optuna_pruner(pruner))
        follow_moved_checkpoints(study, job.checkpoint_dir)
        train, evaluation = datasets
        run(study, RunRequest(job.space(), train, evaluation, device=self.device,
                              worker=Worker(job.lease_seconds, job.poll_seconds, group), **job.run_kwargs),
            job.checkpoint_dir)
        if group is not None:
            group.stop()
        return worker_id()


def check_reachable(storage: str, timeout: float = 10.0) -> None:
    """Connect to `storage` once, at once: `StorageUnreachableError` naming the URL if this process cannot (where
    rfopt would otherwise retry for minutes, as for a database that went away while a study ran)."""
    import socket

    import sqlalchemy as sa

    url = sa.engine.make_url(storage)
    where = f"on node {socket.gethostname()}"
    if url.get_backend_name() == "sqlite":
        if not Path(url.database or "").is_file():
            raise StorageUnreachableError(
                f"the study's storage {redact(storage)} is not reachable from the cluster's workers: no such SQLite "
                f"file {where}; on several machines give a PostgreSQL URL (postgresql://user@host/db)"
            )
        return
    args = {"connect_timeout": int(timeout)} if url.get_backend_name() == "postgresql" else {}
    engine = sa.create_engine(url, connect_args=args, poolclass=sa.pool.NullPool)
    try:
        with engine.connect():
            pass
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageUnreachableError(
            f"the study's storage {redact(storage)} is not reachable from the cluster's workers ({where}: {reason}); "
            "give a URL every node of the cluster reaches (a database server's address, not localhost)"
        ) from None
    finally:
        engine.dispose()


__all__ = ["ClusterStorageError", "StorageUnreachableError", "WorkerJob", "check_reachable"]
