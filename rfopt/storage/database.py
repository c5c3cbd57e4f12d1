"""Opening a study's Optuna storage, and riding out a database that is unreachable for a while.

Every call rfopt (or Optuna on its behalf) makes to the storage goes through `RetryingStorage`: a call
that fails because the database cannot be reached (a PostgreSQL server restarting, a network cut, a
SQLite file locked by a dashboard past its busy timeout) is retried with exponential backoff, and
once the database has been unreachable for `retry_seconds` raises `StorageUnavailableError`, which says
what was tried for how long and what to do. The budget is one per outage, not one per call: every call
to the same database shares the outage's clock (`Outages`), so a run whose calls fail one after another,
or a retried call inside another, waits `retry_seconds` in all, not once per call.

A database that refuses for a reason waiting does not fix is not an outage: a PostgreSQL database or role
that does not exist, a wrong password, a full disk, a read-only database or server, a role without a
right it needs. Such a call raises `StorageRefusedError` at once, naming the cause and the fix (`persistent_fault`).
Other errors (a finished trial, a missing study) pass through at once.

    >>> storage = open_storage("postgresql://rfopt@db/rfopt", retry_seconds=300)   # doctest: +SKIP
    >>> optuna.load_study(study_name="demo", storage=storage)                       # doctest: +SKIP

A retried write may run twice if the connection dropped after the database committed it but before
the reply arrived; rfopt's writes are idempotent (user attrs, reports of a step, state changes that
Optuna refuses twice) except creating a trial, which could then leave one extra WAITING trial.

A URL that cannot name a database is refused before anything is connected or created, with
`StorageLocationError`: a malformed URL, a SQLite file whose folder is missing or not writable, and (with
``create=False``, for commands that only read or steer a study) a SQLite file that does not exist. SQLite
failing to open or write its file is not retried either: unlike a lock, waiting does not fix it.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
import tenacity
from optuna.storages import BaseStorage

from rfopt import compat
from rfopt.errors import StorageLocationError, StorageRefusedError, StorageUnavailableError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

logger = logging.getLogger("rfopt")

RETRY_SECONDS = float(os.environ.get("RFOPT_STORAGE_RETRY_SECONDS", "300"))
"""How long a storage call keeps retrying an unreachable database before giving up (default 5 minutes)."""
SQLITE_BUSY_SECONDS = 10.0
"""How long SQLite waits on a lock before the call fails and is retried (a dashboard may hold one)."""

T = TypeVar("T")


STORAGE_ERRORS = (StorageUnavailableError, StorageRefusedError, StorageLocationError)
"""The study's database failing, not a trial: these end the run (every trial resumable), they never fail a trial."""


URL_FORMS = "sqlite:///path.db (relative to the working directory), sqlite:////abs/path.db or postgresql://user@host/db"
"""The storage URLs rfopt documents, for messages."""
# SQLite's words for a file it cannot open: retrying does not help, unlike "database is locked".
_SQLITE_OPEN_REFUSALS = ("unable to open database file",)


def open_storage(
    storage: str | BaseStorage,
    *,
    retry_seconds: float | None = None,
    sqlite_busy_seconds: float = SQLITE_BUSY_SECONDS,
    cache: bool = True,
    create: bool = True,
) -> BaseStorage | str:
    """The storage for `storage` (a URL or a storage object), with retries on an unreachable database.

    SQLite waits `sqlite_busy_seconds` on a lock; PostgreSQL checks pooled connections before use.
    A storage that is not an SQL database (a journal file, in-memory) is returned as it is, and a URL of another
    SQL database (MySQL) as a string, without retries. `cache` puts Optuna's cache of finished trials in front, as
    Optuna does for a URL (a dashboard goes without). The URL is checked first (`check_url`): with
    ``create=False`` a SQLite file that does not exist is refused instead of created.

        >>> open_storage("sqlite:///no/such/dir/x.db")                          # doctest: +SKIP
        StorageLocationError: SQLite file /work/no/such/dir/x.db: its folder /work/no/such/dir does not exist; ...
    """
    if isinstance(storage, RetryingStorage) or not isinstance(storage, str):
        return storage
    budget = RETRY_SECONDS if retry_seconds is None else retry_seconds
    backend = check_url(storage, create=create).get_backend_name()
    if backend == "sqlite":
        kwargs: dict[str, Any] = {"connect_args": {"timeout": sqlite_busy_seconds}}
    elif backend == "postgresql":
        kwargs = {"pool_pre_ping": True}
    else:
        return storage
    rdb = retry(lambda: optuna.storages.RDBStorage(storage, engine_kwargs=kwargs), budget, redact(storage), "connect",
                retry_if=lambda exc: is_unreachable(exc) or is_schema_race(exc))
    return RetryingStorage(compat.cached(rdb) if cache else rdb, rdb, budget, redact(storage))


def check_url(storage: str, *, create: bool = True) -> URL:
    """The parsed SQLAlchemy URL of `storage`, once it is known to name a database; else `StorageLocationError`.

    Nothing is connected or created. A SQLite file (relative paths are relative to the working directory) needs an
    existing folder; with `create` that folder must be writable and so must the file if it exists; without, the
    file must exist and be readable. In-memory SQLite and server databases are only parsed.

        >>> check_url("sqlite:///rfopt.db", create=False)                        # doctest: +SKIP
        StorageLocationError: no SQLite file /work/rfopt.db; check --storage ...
    """
    from sqlalchemy import exc as sa
    from sqlalchemy.engine import make_url

    try:
        url = make_url(storage)
    except sa.ArgumentError:
        raise StorageLocationError(f"storage {storage!r} is not a database URL; give {URL_FORMS}") from None
    except ValueError as exc:  # a port that is not a number: SQLAlchemy's int() says only "invalid literal"
        raise StorageLocationError(f"storage {redact_text(storage)!r}: its port is not a number ({exc}); give "
                                   f"{URL_FORMS}, with :PORT after the host (5432 by default)") from None
    if url.port is not None and not 0 < url.port < 65536:
        raise StorageLocationError(f"storage {redact(storage)!r}: port {url.port} is not a port (1 to 65535); give "
                                   f"{URL_FORMS}")
    try:
        dialect = url.get_dialect()
    except sa.NoSuchModuleError:
        spelling = " (SQLAlchemy spells it postgresql://)" if url.drivername.startswith("postgres") else ""
        raise StorageLocationError(
            f"storage {redact(storage)!r}: unknown database kind {url.drivername!r}{spelling}; give {URL_FORMS}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        extra = " (pip install 'rfopt[postgres]')" if url.get_backend_name() == "postgresql" else ""
        raise StorageLocationError(
            f"storage {redact(storage)!r}: the Python driver for {url.drivername!r} is not installed ({exc}){extra}; "
            f"install it, or give {URL_FORMS}"
        ) from None
    if url.get_backend_name() == "sqlite" and (url.host or url.port or url.username or url.password):
        # "sqlite://s.db": two slashes make "s.db" a host, which SQLite does not have (SQLAlchemy refuses it later).
        raise StorageLocationError(
            f"storage {redact(storage)!r} is not a SQLite URL: {url.host!r} stands where a host would, and a SQLite "
            f"file is named after three slashes: sqlite:///{url.host or 'path.db'}; give {URL_FORMS}")
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
            and not url.query.get("uri"):  # a file: URI (mode=ro, ...) is SQLite's own business
        _check_sqlite_file(url.database, create=create)
    return url


def check_lasting_url(storage: str, *, create: bool = True) -> URL:
    """`check_url`, refusing an in-memory SQLite database too: a command's study would end with the command (and one
    that reads a study finds none there)."""
    url = check_url(storage, create=create)
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        raise StorageLocationError(
            f"storage {storage!r} is an in-memory SQLite database, which ends with this command and holds no study "
            f"before it; give a file: {URL_FORMS}"
        )
    return url


def read_only_sqlite(storage: str) -> str | None:
    """For the URL of an existing SQLite file that this user cannot write (the file, or its folder, where SQLite
    writes its journal), the URL that opens it read-only (SQLite's ``mode=ro``); None for any other storage. A
    dashboard opens a shared, finished study that way: reading needs no write."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(storage)
    except Exception:  # noqa: BLE001 - not a URL: `check_url` says so
        return None
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:") or url.query.get("uri"):
        return None
    path = Path(os.path.abspath(url.database))
    if not path.is_file() or (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        return None
    return f"sqlite:///file:{path}?mode=ro&uri=true"


def _check_sqlite_file(database: str, *, create: bool) -> None:
    path = Path(os.path.abspath(database))
    folder = path.parent
    where = f"SQLite file {path}"
    if not path.exists():
        if not create:
            relative = "" if os.path.isabs(database) else (
                f" (in sqlite:///path.db the path is relative to the working directory, {Path.cwd()}; "
                "sqlite:////abs/path.db is absolute)")
            raise StorageLocationError(f"no SQLite file {path}; check --storage{relative}")
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise StorageLocationError(f"{where}: {existing} is not a folder; give another --storage")
        if existing != folder:
            raise StorageLocationError(
                f"{where}: its folder {folder} does not exist; create it (mkdir -p {folder}) or give another --storage"
            )
    elif path.is_dir():
        raise StorageLocationError(f"{where} is a folder, not a database file; give another --storage")
    elif not os.access(path, os.R_OK):
        raise StorageLocationError(f"{where} is not readable by this user; fix its permissions or give another --storage")
    if create:
        # SQLite writes a journal beside the file, so the folder must be writable as well as the file.
        for target, what in ((folder, f"its folder {folder}"), (path, "the file")):
            if target.exists() and not os.access(target, os.W_OK):
                raise StorageLocationError(
                    f"{where}: {what} is not writable by this user; fix its permissions or give another --storage"
                )


class Outages:
    """When each database became unreachable, shared by every call to it in this process: the retry budget is one
    per outage. A call that fails because the database cannot be reached starts the outage's clock (if it is not
    running); any call that succeeds ends the outage. A call retries only while the outage is younger than its
    budget, and once a call gave up, the outage is spent: the next call to the same database tries once and gives up
    too (until one succeeds), and a retried call inside another retried call does not multiply the wait."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}
        self._spent: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, where: str) -> None:
        with self._lock:
            self._since.setdefault(where, time.monotonic())

    def succeeded(self, where: str) -> None:
        with self._lock:
            self._since.pop(where, None)
            self._spent.discard(where)

    def gave_up(self, where: str) -> None:
        with self._lock:
            self._spent.add(where)

    def spent(self, where: str, budget: float, upcoming: float = 0.0) -> bool:
        """Whether a call to `where` must not wait `upcoming` more seconds: the outage is past `budget`, or spent."""
        with self._lock:
            if where in self._spent:
                return True
            since = self._since.get(where)
        return since is not None and time.monotonic() - since + upcoming >= budget

    def age(self, where: str) -> float:
        """Seconds since the outage of `where` began (0 when there is none)."""
        with self._lock:
            since = self._since.get(where)
        return 0.0 if since is None else time.monotonic() - since


OUTAGES = Outages()
"""This process's outages, by database (the URL without its password)."""


def retry(call: Callable[[], T], budget: float, where: str, what: str,
          retry_if: Callable[[BaseException], bool] | None = None) -> T:
    """Run `call`, retrying with exponential backoff (0.25 s doubling to 8 s, jittered) while the database is
    unreachable (or `retry_if` says so), until the database has been unreachable for `budget` seconds (`OUTAGES`:
    one budget per outage, shared by every call); then `StorageUnavailableError`. A refusal that waiting does not fix
    (`persistent_fault`) raises `StorageRefusedError` at once; SQLite failing to open its file, `StorageLocationError`."""
    retry_if = retry_if or is_unreachable

    def attempt() -> T:
        try:
            result = call()
        except Exception as exc:
            if is_unreachable(exc):
                OUTAGES.failed(where)
            raise
        OUTAGES.succeeded(where)
        return result

    def warn(state: tenacity.RetryCallState) -> None:
        logger.warning("storage %s: %s failed (%s); retrying in %.2f s", where, what,
                       _root(state.outcome.exception()), state.next_action.sleep)

    def out_of_budget(state: tenacity.RetryCallState) -> bool:
        return OUTAGES.spent(where, budget, state.upcoming_sleep or 0.0)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retry_if),
        wait=tenacity.wait_exponential(multiplier=0.25, max=8.0) + tenacity.wait_random(0, 0.05),
        stop=out_of_budget,
        before_sleep=warn,
    )
    try:
        return retrying(attempt)
    except tenacity.RetryError as exc:
        last = exc.last_attempt
        cause = last.exception()
        OUTAGES.gave_up(where)
        raise StorageUnavailableError(
            f"storage {where}: {what} failed ({last.attempt_number} attempt{'s' if last.attempt_number > 1 else ''}"
            f"): the database is unreachable ({_root(cause)}); it has been for {OUTAGES.age(where):.1f} s, and "
            f"rfopt waits {budget:g} s for an outage (RFOPT_STORAGE_RETRY_SECONDS). Check that the database server is up and reachable, then rerun the same "
            "command: the study continues from its last committed chunks"
        ) from cause
    except Exception as exc:
        if _is_sqlite_open_refusal(exc):
            raise StorageLocationError(
                f"storage {where}: {what} failed, SQLite cannot open or write its file ({_root(exc)}); check that the "
                "file and its folder exist and are writable by this user"
            ) from exc
        refused = persistent_fault(exc)
        if refused is None:
            raise
        raise StorageRefusedError(
            f"storage {where}: {what} failed at once, not retried: {refused.cause} ({_root(exc)}). {refused.fix}; "
            "then repeat what failed (nothing of it was written; a run continues from its last committed chunks)",
            refused,
        ) from exc


@dataclass(frozen=True)
class PersistentFault:
    """Why a database refuses a call, where waiting does not help (unlike an outage: `is_unreachable`), and what to do.
    Not the exception `rfopt.errors.Refusal` (rfopt refusing an input): the database's answer to a call."""

    kind: str
    """``missing database``, ``missing role``, ``authentication``, ``disk full``, ``read-only`` or ``permission``."""
    cause: str
    fix: str


# (kind, SQLSTATEs, a pattern of the English message, cause, fix). A server's
# refusal at connection carries no SQLSTATE in psycopg 3, so its message is read too.
_REFUSALS = (
    ("missing database", ("3D000",), r'database "[^"]*" does not exist',
     "the database named in the storage URL does not exist on the server",
     "Create it (createdb NAME, or CREATE DATABASE NAME as a superuser) or fix its name in --storage"),
    ("missing role", (), r'role "[^"]*" does not exist',
     "the user (role) named in the storage URL does not exist on the server",
     "Create it (CREATE ROLE NAME LOGIN PASSWORD '...') or fix the user in --storage"),
    ("authentication", ("28P01", "28000"),
     r"password authentication failed|authentication failed|no pg_hba\.conf entry|no password supplied",
     "the server refused the user's credentials",
     "Check the user and password in --storage (or PGPASSWORD, ~/.pgpass) and the server's pg_hba.conf"),
    ("disk full", ("53100",), r"no space left on device|database or disk is full|could not extend file",
     "the disk that holds the database is full",
     "Free space on that disk (or move the database: --storage)"),
    ("read-only", ("25006",), r"read-only transaction|attempt to write a readonly database",
     "the database is read-only (a standby server, default_transaction_read_only, or a read-only file)",
     "Point --storage at a writable database (the primary server; a file this user may write)"),
    ("permission", ("42501",), r"permission denied",
     "the user lacks a right on the database (creating rfopt's and Optuna's tables, or writing them)",
     "Grant it (GRANT ALL ON SCHEMA public TO NAME; GRANT ALL ON DATABASE ... TO NAME) or use the database's owner"),
)


def persistent_fault(exc: BaseException) -> PersistentFault | None:
    """Why the database refuses, when `exc` (or what caused it) is a refusal that waiting does not fix; else None.

        >>> persistent_fault(error_connecting_to("postgresql://rfopt@db/nosuch")).kind     # doctest: +SKIP
        'missing database'
    """
    seen: BaseException | None = exc
    while seen is not None:
        state = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        text = str(seen)
        for kind, states, pattern, cause, fix in _REFUSALS:
            if state in states or re.search(pattern, text, re.IGNORECASE):
                return PersistentFault(kind, cause, fix)
        seen = seen.__cause__ or seen.__context__
    return None


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the database could not be reached or was locked: an outage, worth
    waiting for. Not a fault that waiting does not fix (`persistent_fault`), nor SQLite failing to open its file."""
    from sqlalchemy import exc as sa

    if _is_sqlite_open_refusal(exc) or persistent_fault(exc) is not None:
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (sa.OperationalError, sa.InterfaceError)):
            return True
        if isinstance(seen, sa.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_sqlite_open_refusal(exc: BaseException) -> bool:
    import sqlite3

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sqlite3.OperationalError) and str(seen) in _SQLITE_OPEN_REFUSALS:
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


def sqlalchemy_engine_of(storage: Any) -> Any | None:
    """The SQLAlchemy engine of an SQL storage opened by `open_storage` or given as an ``RDBStorage``; else None."""
    rdb = storage.rdb if isinstance(storage, RetryingStorage) else storage
    return getattr(rdb, "engine", None) if isinstance(rdb, optuna.storages.RDBStorage) else None


def describe(storage: Any) -> str:
    """The storage as a person knows it: its URL without password, or its kind."""
    if isinstance(storage, RetryingStorage):
        return storage.where
    engine = sqlalchemy_engine_of(storage)
    return engine.url.render_as_string(hide_password=True) if engine is not None else type(storage).__name__


def redact_text(url: str) -> str:
    """A URL that does not parse, without what looks like its password (``user:secret@`` -> ``user:***@``)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


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
