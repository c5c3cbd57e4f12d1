"""Leases: how workers that share a study agree on who trains which trial, kept in the study's database; and
presence: which processes are running a study now.

A worker trains a trial's next unit only while it holds that trial's lease. Leases live in a table
``rfopt_leases`` in the same database as the Optuna storage (SQLite for one host, PostgreSQL for
many), created on first use. Every lease operation is one conditional UPDATE or INSERT, so it is a
compare-and-set in any SQL database:

- `acquire`: take the lease if it is free, expired, or already ours; the fencing token grows by one
  each time the lease changes hands.
- `renew`: push the expiry out, only while the lease is still ours under the same token (a
  `Heartbeat` thread does this every third of the lease's duration while the unit trains).
- `commit_unit`: in ONE transaction, check that the lease is ours, under our token and unexpired,
  and record the unit in ``rfopt_units`` (primary key: study, trial, unit), before the unit's report
  goes to Optuna. A worker whose lease expired or was taken over cannot commit (`LeaseLost`).
- `release`: give the lease up at once when the unit is done.

Every process running a study (`Study.optimize` and each worker) also stamps a row of ``rfopt_presence`` every few
seconds (`Presence`), so that anyone can tell whether somebody is running the study (`rfopt.reports.status.liveness`).

Expiry times come from each worker's clock: hosts must keep their clocks in sync (NTP) to well
within the lease's duration.

    >>> leases = Leases(study.optuna, holder="host-1:1234")                    # doctest: +SKIP
    >>> lease = leases.acquire("trial-3", seconds=30)                          # doctest: +SKIP
    >>> with Heartbeat(leases, lease):                                         # doctest: +SKIP
    ...     train(); leases.commit_unit(lease, trial=3, unit=2)
    >>> leases.release(lease)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

import optuna
import sqlalchemy as sa

from rfopt.compat import storage_of
from rfopt.errors import Refusal, RfoptError, StudyBusyError

from .database import is_schema_race, is_unreachable, retry, sqlalchemy_engine_of

logger = logging.getLogger("rfopt")

_metadata = sa.MetaData()
LEASES = sa.Table(
    "rfopt_leases",
    _metadata,
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(256), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("expires", sa.Float, nullable=False),
)
UNITS = sa.Table(
    "rfopt_units",
    _metadata,
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("trial", sa.Integer, primary_key=True),
    sa.Column("unit", sa.Integer, primary_key=True),
    sa.Column("holder", sa.String(256), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
)


PRESENCE = sa.Table(
    "rfopt_presence",
    _metadata,
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("holder", sa.String(256), primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("started", sa.Float, nullable=False),
    sa.Column("seen", sa.Float, nullable=False),
    sa.Column("interval", sa.Float, nullable=False),
    sa.Column("ended", sa.Float, nullable=True),
)


class LeaseLost(RfoptError, RuntimeError):
    """This worker's lease expired or was taken over: it must not commit the unit it worked on."""


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    token: int
    seconds: float


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Leases:
    """The leases of one study, in the study's SQL database."""

    def __init__(self, study: optuna.Study, holder: str | None = None, retry_seconds: float | None = None) -> None:
        storage = storage_of(study)
        engine = sqlalchemy_engine_of(storage)
        if engine is None:
            raise Refusal(
                f"study {study.study_name!r}: workers need an SQL storage (sqlite:///... on one host, "
                f"postgresql://... across hosts), not {type(storage).__name__}"
            )
        self.engine: sa.Engine = engine
        self.study = study.study_name
        self.holder = holder or worker_id()
        self.retry_seconds = getattr(storage, "retry_seconds", 300.0) if retry_seconds is None else retry_seconds
        _create_tables(self.engine, self.retry_seconds)

    # ------------------------------------------------------------------ leases
    def acquire(self, name: str, seconds: float) -> Lease | None:
        """The lease `name` for `seconds`, if it is free, expired or ours; else None."""

        def attempt() -> Lease | None:
            now = time.time()
            with self.engine.begin() as db:
                taken = db.execute(
                    LEASES.update()
                    .where(self._key(name), sa.or_(LEASES.c.expires < now, LEASES.c.holder == self.holder))
                    .values(holder=self.holder, token=LEASES.c.token + 1, expires=now + seconds)
                ).rowcount
                if not taken:
                    exists = db.execute(sa.select(LEASES.c.token).where(self._key(name))).first()
                    if exists is not None:
                        return None
                    db.execute(LEASES.insert().values(study=self.study, name=name, holder=self.holder, token=1,
                                                      expires=now + seconds))
                token = db.execute(sa.select(LEASES.c.token).where(self._key(name))).scalar_one()
            return Lease(name, self.holder, int(token), seconds)

        try:
            return self._retry(attempt, f"acquire lease {name}")
        except sa.exc.IntegrityError:  # another worker inserted the same lease first
            return None

    @contextmanager
    def holding(self, name: str, seconds: float, poll_seconds: float = 0.2) -> Iterator[Lease]:
        """Wait for the lease `name`, hold it for the block, then release it."""
        while (lease := self.acquire(name, seconds)) is None:
            time.sleep(poll_seconds)
        try:
            yield lease
        finally:
            self.release(lease)

    def renew(self, lease: Lease) -> bool:
        """Extend `lease`; False if it is no longer ours."""
        def attempt() -> bool:
            with self.engine.begin() as db:
                return bool(db.execute(
                    LEASES.update().where(*self._ours(lease)).values(expires=time.time() + lease.seconds)
                ).rowcount)

        return self._retry(attempt, f"renew lease {lease.name}")

    def release(self, lease: Lease) -> None:
        def attempt() -> None:
            with self.engine.begin() as db:
                db.execute(LEASES.update().where(*self._ours(lease)).values(expires=0.0))

        self._retry(attempt, f"release lease {lease.name}")

    def check(self, lease: Lease) -> None:
        """Raise `LeaseLost` unless `lease` is still ours and unexpired."""
        def attempt() -> bool:
            with self.engine.begin() as db:
                return db.execute(
                    sa.select(LEASES.c.token).where(*self._ours(lease), LEASES.c.expires >= time.time())
                ).first() is not None

        if not self._retry(attempt, f"check lease {lease.name}"):
            raise LeaseLost(f"{self.holder}: lease {lease.name} (token {lease.token}) expired or was taken over")

    def held_by_others(self) -> set[str]:
        """Names of this study's unexpired leases that other workers hold."""
        def attempt() -> set[str]:
            with self.engine.begin() as db:
                rows = db.execute(sa.select(LEASES.c.name).where(
                    LEASES.c.study == self.study, LEASES.c.expires >= time.time(), LEASES.c.holder != self.holder
                ))
                return {row.name for row in rows}

        return self._retry(attempt, "read leases")

    # ------------------------------------------------------------------ fenced commits
    def commit_unit(self, lease: Lease, trial: int, unit: int) -> None:
        """Record that `unit` of `trial` is committed, in the transaction that checks the lease (fencing)."""
        def attempt() -> None:
            now = time.time()
            with self.engine.begin() as db:
                ours = db.execute(
                    LEASES.update()
                    .where(*self._ours(lease), LEASES.c.expires >= now)
                    .values(expires=now + lease.seconds)
                ).rowcount
                if not ours:
                    raise LeaseLost(f"{self.holder}: lease {lease.name} (token {lease.token}) expired or was taken "
                                    f"over; trial {trial} unit {unit} is not committed by this worker")
                recorded = db.execute(sa.select(UNITS.c.unit).where(
                    UNITS.c.study == self.study, UNITS.c.trial == trial, UNITS.c.unit == unit
                )).first()
                if recorded is None:  # else its worker died before reporting it; the report is committed now
                    db.execute(UNITS.insert().values(study=self.study, trial=trial, unit=unit, holder=self.holder,
                                                     token=lease.token, at=now))

        self._retry(attempt, f"commit trial {trial} unit {unit}")

    def committed_units(self) -> list[tuple[int, int, str]]:
        """``(trial, unit, holder)`` of every committed unit of the study, in commit order."""
        with self.engine.begin() as db:
            rows = db.execute(sa.select(UNITS.c.trial, UNITS.c.unit, UNITS.c.holder)
                              .where(UNITS.c.study == self.study).order_by(UNITS.c.at))
            return [(r.trial, r.unit, r.holder) for r in rows]

    def committed(self, trial: int) -> set[int]:
        with self.engine.begin() as db:
            rows = db.execute(sa.select(UNITS.c.unit).where(UNITS.c.study == self.study, UNITS.c.trial == trial))
            return {r.unit for r in rows}

    # ------------------------------------------------------------------ helpers
    def _key(self, name: str):
        return sa.and_(LEASES.c.study == self.study, LEASES.c.name == name)

    def _ours(self, lease: Lease):
        return (self._key(lease.name), LEASES.c.holder == lease.holder, LEASES.c.token == lease.token)

    def _retry(self, call, what: str):
        return retry(call, self.retry_seconds, _where(self.engine), what)


PRESENCE_LEASE = "presence"
"""The lease a process holds for a moment while it checks who runs the study and records itself (`Presence`)."""

REQUESTS_LOCK_SECONDS = 30.0
"""How long a requests lock holds if its holder dies holding it (it is held for a few writes)."""


@contextmanager
def requests_lock(study: optuna.Study, trial: int) -> Iterator[None]:
    """Hold the lock on a trial's op requests: the process applying them and a withdrawal (`rfopt.engine.trials.ops`) take it, so
    a request is either withdrawn or applied, never both. A lease of its own per call (a thread of the process running
    the study and its API call exclude each other too). A storage without SQL (in memory) is one process's: no lock.
    """
    if sqlalchemy_engine_of(storage_of(study)) is None:
        yield
        return
    leases = Leases(study, holder=f"{worker_id()}:{uuid.uuid4().hex[:8]}")
    with leases.holding(f"requests-{trial}", REQUESTS_LOCK_SECONDS, poll_seconds=0.05):
        yield


@dataclass(frozen=True)
class Seen:
    """One process's presence on a study (a row of ``rfopt_presence``): alive while it beats."""

    holder: str
    kind: str
    """``run`` (`Study.optimize`) or ``worker`` (`Study.work`)."""
    started: float
    seen: float
    interval: float
    ended: float | None
    """When it exited cleanly; None while it runs, or if it died."""

    def alive(self, now: float) -> bool:
        """Beating: not ended, and seen within two intervals (a process that died is seen so within 2x the interval)."""
        return self.ended is None and now - self.seen <= 2 * self.interval

    def gone_here(self) -> bool:
        """A process of this host that no longer exists (killed: its row has not lapsed yet, but it is gone)."""
        host, _, pid = self.holder.rpartition(":")
        if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process: it exists
            return False
        return False


class Presence:
    """A process running a study says so: its row in ``rfopt_presence`` (study, host:pid) is stamped every `interval`
    seconds from a thread while the block runs, and marked ended on the way out (even on an exception; a killed
    process just stops beating). `seen_on` reads the rows back (`rfopt.reports.status.liveness`).

    Only timestamps are written, from a thread: no training state, RNG or Optuna record is touched, so results are
    the same with it. A beat that fails (the database busy) is retried at the next one.

        >>> with Presence(study, "run"):                                       # doctest: +SKIP
        ...     drive(...)
    """

    def __init__(self, study: optuna.Study, kind: str, interval: float = 5.0, holder: str | None = None,
                 exclusive: bool = False) -> None:
        engine = sqlalchemy_engine_of(storage_of(study))
        if engine is None:
            raise Refusal(f"study {study.study_name!r}: presence needs an SQL storage")
        self.engine: sa.Engine = engine
        self._optuna_study = study
        self.study = study.study_name
        self.kind = kind
        self.exclusive = exclusive
        """Refuse (`StudyBusyError`) to start beside a process this kind cannot share the study with: a ``run`` beside
        anyone, a ``worker`` beside a ``run``. Checked and recorded under one lease, so two processes starting at
        the same moment cannot both pass."""
        self.interval = interval
        self.holder = holder or worker_id()
        self.retry_seconds = getattr(storage_of(study), "retry_seconds", 300.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="rfopt-presence", daemon=True)

    def __enter__(self) -> Self:
        _create_tables(self.engine, self.retry_seconds)

        def start() -> None:
            now = time.time()
            with self.engine.begin() as db:
                key = (PRESENCE.c.study == self.study, PRESENCE.c.holder == self.holder)
                values = {"kind": self.kind, "started": now, "seen": now, "interval": self.interval, "ended": None}
                if not db.execute(PRESENCE.update().where(*key).values(**values)).rowcount:
                    db.execute(PRESENCE.insert().values(study=self.study, holder=self.holder, **values))

        if self.exclusive:
            with Leases(self._optuna_study, holder=self.holder).holding(PRESENCE_LEASE, 30.0, poll_seconds=0.05):
                self._refuse_beside(seen_on(self._optuna_study) or [])
                retry(start, self.retry_seconds, _where(self.engine), "record this process's presence")
        else:
            retry(start, self.retry_seconds, _where(self.engine), "record this process's presence")
        self._thread.start()
        return self

    def _refuse_beside(self, seen: list[Seen]) -> None:
        """`StudyBusyError` if a live process runs the study in a way this one cannot share."""
        now = time.time()
        others = [s for s in seen if s.holder != self.holder and s.alive(now) and not s.gone_here()]
        clash = others if self.kind == "run" else [s for s in others if s.kind == "run"]
        if not clash:
            return
        who = ", ".join(f"{s.holder} ({'rfopt run' if s.kind == 'run' else 'rfopt worker'}, seen "
                        f"{max(0.0, now - s.seen):.0f} s ago)" for s in clash)
        lapse = max(2 * s.interval for s in clash)
        if self.kind == "run":
            what = (f"study {self.study!r} is being run by {who}. rfopt run (study.optimize) takes no leases, so "
                    "beside it this process would train the same trials again: wait for it to end, or run the study "
                    "with rfopt worker (study.work) only, any number of them")
        else:
            what = (f"study {self.study!r} is being run by {who}, which takes no leases, so a worker beside it "
                    "would train the same trials again: wait for it to end, then start workers (rfopt worker, "
                    "study.work) as many as you like")
        raise StudyBusyError(f"{what}. Nothing was written. (A process that was killed reads as gone {lapse:g} s "
                             "after its last beat.)")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._stamp(ended=time.time())
        except Exception as error:  # noqa: BLE001 - unrecorded, the row stops beating and reads as gone in 2 intervals
            logger.debug("study %s: could not record this process's exit: %s", self.study, error)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._stamp()
            except Exception as exc:  # noqa: BLE001 - a missed beat; the next one tries again
                logger.debug("study %s: a presence beat failed: %s", self.study, exc)

    def _stamp(self, ended: float | None = None) -> None:
        values: dict[str, float] = {"seen": time.time()}
        if ended is not None:
            values["ended"] = ended
        with self.engine.begin() as db:
            db.execute(PRESENCE.update().where(PRESENCE.c.study == self.study, PRESENCE.c.holder == self.holder)
                       .values(**values))


def seen_on(study: optuna.Study) -> list[Seen] | None:
    """Every process that ran `study` and said so (`Presence`), latest first; None for a storage without SQL."""
    engine = sqlalchemy_engine_of(storage_of(study))
    if engine is None:
        return None
    if not sa.inspect(engine).has_table(PRESENCE.name):
        return []
    with engine.begin() as db:
        rows = db.execute(sa.select(PRESENCE).where(PRESENCE.c.study == study.study_name)
                          .order_by(PRESENCE.c.seen.desc()))
        return [Seen(r.holder, r.kind, r.started, r.seen, r.interval, r.ended) for r in rows]


def _create_tables(engine: sa.Engine, retry_seconds: float) -> None:
    retry(lambda: _metadata.create_all(engine, checkfirst=True), retry_seconds, _where(engine), "create lease tables",
          retry_if=lambda exc: is_unreachable(exc) or is_schema_race(exc))


def _where(engine: sa.Engine) -> str:
    """The database as a person knows it, for retry messages: its URL without the password."""
    return engine.url.render_as_string(hide_password=True)


class Heartbeat:
    """Renews a lease every third of its duration while a unit trains; `lost` is set if it is taken over (the
    unit's training reads it at every step and stops: see `rfopt.engine.running.unit`)."""

    def __init__(self, leases: Leases, lease: Lease) -> None:
        self.leases = leases
        self.lease = lease
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"rfopt-heartbeat-{lease.name}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease.seconds / 3):
            try:
                if not self.leases.renew(self.lease):
                    self.lost.set()
                    return
            except Exception:  # noqa: BLE001 - the fenced commit decides; a missed beat only risks expiry
                continue
