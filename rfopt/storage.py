"""Opening a study's Optuna storage, and riding out a database that is unreachable for a while.

Every call rfopt (or Optuna on its behalf) makes to the storage goes through `RetryingStorage`: a call
that fails because the database cannot be reached (a PostgreSQL server restarting, a network cut, a
SQLite file locked by a dashboard past its busy timeout) is retried with exponential backoff, and
after `retry_seconds` of failures raises `StorageUnavailableError`, which says what was tried for
how long and what to do. Other errors (a finished trial, a missing study) pass through at once.

    >>> storage = open_storage("postgresql://rfopt@db/rfopt", retry_seconds=300)   # doctest: +SKIP
    >>> optuna.load_study(study_name="demo", storage=storage)                       # doctest: +SKIP

A retried write may run twice if the connection dropped after the database committed it but before
the reply arrived; rfopt's writes are idempotent (user attrs, reports of a step, state changes that
Optuna refuses twice) except creating a trial, which could then leave one extra WAITING trial.
"""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
import tenacity
from optuna.storages import BaseStorage

from . import compat

logger = logging.getLogger("rfopt")

RETRY_SECONDS = float(os.environ.get("RFOPT_STORAGE_RETRY_SECONDS", "300"))
"""How long a storage call keeps retrying an unreachable database before giving up (default 5 minutes)."""
SQLITE_BUSY_SECONDS = 10.0
"""How long SQLite waits on a lock before the call fails and is retried (a dashboard may hold one)."""

T = TypeVar("T")


class StorageUnavailableError(RuntimeError):
    """The study's database stayed unreachable past the retry budget."""


def open_storage(
    storage: str | BaseStorage,
    *,
    retry_seconds: float | None = None,
    sqlite_busy_seconds: float = SQLITE_BUSY_SECONDS,
    cache: bool = True,
) -> BaseStorage | str:
    """The storage for `storage` (a URL or a storage object), with retries on an unreachable database.

    SQLite waits `sqlite_busy_seconds` on a lock; PostgreSQL checks pooled connections before use.
    A storage that is not an SQL database (a journal file, in-memory) is returned as it is. `cache` puts
    Optuna's cache of finished trials in front, as Optuna does for a URL (a dashboard goes without).
    """
    if isinstance(storage, RetryingStorage) or not isinstance(storage, str):
        return storage
    budget = RETRY_SECONDS if retry_seconds is None else retry_seconds
    if storage.startswith("sqlite:"):
        kwargs: dict[str, Any] = {"connect_args": {"timeout": sqlite_busy_seconds}}
    elif storage.startswith("postgresql"):
        kwargs = {"pool_pre_ping": True}
    else:
        return storage
    rdb = retry(lambda: optuna.storages.RDBStorage(storage, engine_kwargs=kwargs), budget, redact(storage), "connect",
                retry_if=lambda exc: is_unreachable(exc) or is_schema_race(exc))
    return RetryingStorage(compat.cached(rdb) if cache else rdb, rdb, budget, redact(storage))


def retry(call: Callable[[], T], budget: float, where: str, what: str,
          retry_if: Callable[[BaseException], bool] | None = None) -> T:
    """Run `call`, retrying with exponential backoff (0.25 s doubling to 8 s, jittered) while the database is
    unreachable (or `retry_if` says so), for at most `budget` seconds; then `StorageUnavailableError`."""

    def warn(state: tenacity.RetryCallState) -> None:
        logger.warning("storage %s: %s failed (%s); retrying in %.2f s", where, what,
                       _root(state.outcome.exception()), state.next_action.sleep)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retry_if or is_unreachable),
        wait=tenacity.wait_exponential(multiplier=0.25, max=8.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_before_delay(budget),
        before_sleep=warn,
    )
    try:
        return retrying(call)
    except tenacity.RetryError as exc:
        last = exc.last_attempt
        cause = last.exception()
        raise StorageUnavailableError(
            f"storage {where}: {what} failed {last.attempt_number} times over "
            f"{retrying.statistics.get('delay_since_first_attempt', 0.0):.1f} s, the database is unreachable "
            f"({_root(cause)}). Check that the database server is up and reachable, then rerun the same command: "
            "the study continues from its last committed chunks"
        ) from cause


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the database could not be reached or was locked."""
    from sqlalchemy import exc as sa

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (sa.OperationalError, sa.InterfaceError)):
            return True
        if isinstance(seen, sa.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_schema_race(exc: BaseException) -> bool:
    """Whether `exc`, raised while creating the schema, is another process creating it at the same moment (workers
    starting together): a duplicate table, type or version row. Asked only while creating tables."""
    from sqlalchemy import exc as sa

    if isinstance(exc, sa.IntegrityError):  # e.g. both stamp alembic_version: UNIQUE constraint failed
        return True
    return isinstance(exc, sa.ProgrammingError) and ("already exists" in str(exc) or "duplicate" in str(exc))


class RetryingStorage(BaseStorage):
    """An Optuna storage whose every call is retried while the database is unreachable (see `retry`).

    `rdb` is the ``RDBStorage`` underneath (its SQLAlchemy engine holds rfopt's lease tables too)."""

    def __init__(self, backend: BaseStorage, rdb: Any, retry_seconds: float, where: str) -> None:
        self._backend = backend
        self.rdb = rdb
        self.retry_seconds = retry_seconds
        self.where = where

    def __getattr__(self, name: str) -> Any:  # what else the storage underneath offers (optuna-dashboard asks)
        return getattr(self._backend, name)


def _retrying(name: str) -> Callable[..., Any]:
    def method(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        return retry(lambda: getattr(self._backend, name)(*args, **kwargs), self.retry_seconds, self.where, name)

    method.__name__ = name
    method.__doc__ = getattr(BaseStorage, name).__doc__
    return method


for _name in dir(BaseStorage):
    if not _name.startswith("_") and callable(getattr(BaseStorage, _name)):
        setattr(RetryingStorage, _name, _retrying(_name))
abc.update_abstractmethods(RetryingStorage)


def engine_of(storage: Any) -> Any | None:
    """The SQLAlchemy engine of an SQL storage opened by `open_storage` or given as an ``RDBStorage``; else None."""
    rdb = storage.rdb if isinstance(storage, RetryingStorage) else storage
    return getattr(rdb, "engine", None) if isinstance(rdb, optuna.storages.RDBStorage) else None


def describe(storage: Any) -> str:
    """The storage as a person knows it: its URL without password, or its kind."""
    if isinstance(storage, RetryingStorage):
        return storage.where
    engine = engine_of(storage)
    return engine.url.render_as_string(hide_password=True) if engine is not None else type(storage).__name__


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as given
        return url


def _root(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
