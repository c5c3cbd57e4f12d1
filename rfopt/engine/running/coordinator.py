"""Who may work on which trial: one process alone (`LocalCoordinator`), or workers sharing a study (`LeasedCoordinator`).

The driver loop (`rfopt.engine.running.driver`) is the same for both; it asks its coordinator three things:

- ``claim(trial)``: may this process work on the trial now? A `Claim` says so for one unit and
  carries the fences the unit pipeline (`rfopt.engine.running.unit`) calls before it writes.
- ``asking()``: may this process ask Optuna for new trials (and configure ones a crash left
  unconfigured) now? Asking is serialized, so two workers never fill the same free slot.
- ``busy()``: which trials other processes are working on.

Alone, every answer is yes and nothing is fenced. Shared, each answer is a lease in the study's
database (`rfopt.storage.leases`): a unit is trained under its trial's lease, renewed by a heartbeat while it
trains; the unit's commit is fenced by the lease; a worker whose heartbeat finds the lease gone stops
the chunk at the next step and commits nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from rfopt.storage.leases import Heartbeat, Lease, LeaseLost, Leases

from .unit import Claim

ASK_LEASE = "ask"
"""The lease a worker holds while it plans the study, enqueues configs or asks trials: one at a time."""


def trial_lease(number: int) -> str:
    return f"trial-{number}"


class Coordinator(Protocol):
    """What the driver loop asks (see the module docstring): `LocalCoordinator` and `LeasedCoordinator`."""

    shared: bool
    """Whether other processes share the study (then the loop waits for their units instead of stopping)."""

    def claim(self, number: int) -> AbstractContextManager[Claim | None]:
        """This process's right to work on trial `number` for one unit; None when another process holds it."""

    def asking(self) -> AbstractContextManager[bool]:
        """Whether this process may ask Optuna for new trials now (one process at a time)."""

    def busy(self) -> set[int]:
        """The trials other processes are working on."""


class _Unfenced:
    """A claim in a process that runs the study alone: never lost, nothing to fence."""

    def lost(self) -> bool:
        return False

    def fence_checkpoint(self, trial: int) -> None:
        pass

    def fence_commit(self, trial: int, unit: int) -> None:
        pass

    def fence_finish(self, trial: int) -> None:
        pass


class LocalCoordinator:
    """One process runs the study (`Study.optimize`): every trial is its own."""

    shared = False

    @contextmanager
    def claim(self, number: int) -> Iterator[_Unfenced]:
        yield _Unfenced()

    @contextmanager
    def asking(self) -> Iterator[bool]:
        yield True

    def busy(self) -> set[int]:
        return set()


class LeaseClaim:
    """A trial's lease held for one unit, with the heartbeat that renews it."""

    def __init__(self, leases: Leases, lease: Lease, heartbeat: Heartbeat) -> None:
        self.leases = leases
        self.lease = lease
        self.heartbeat = heartbeat

    def lost(self) -> bool:
        return self.heartbeat.lost.is_set()

    def fence_checkpoint(self, trial: int) -> None:
        self._check()

    def fence_commit(self, trial: int, unit: int) -> None:
        self.leases.commit_unit(self.lease, trial, unit)

    def fence_finish(self, trial: int) -> None:
        self._check()

    def _check(self) -> None:
        if self.lost():
            raise LeaseLost(f"{self.leases.holder}: lease {self.lease.name} was taken over while the unit trained")
        self.leases.check(self.lease)


class LeasedCoordinator:
    """Workers sharing a study (`Study.work`): each unit under its trial's lease, asking under the ask lease."""

    shared = True

    def __init__(self, leases: Leases, lease_seconds: float) -> None:
        self.leases = leases
        self.lease_seconds = lease_seconds

    @contextmanager
    def claim(self, number: int) -> Iterator[LeaseClaim | None]:
        lease = self.leases.acquire(trial_lease(number), self.lease_seconds)
        if lease is None:
            yield None
            return
        try:
            with Heartbeat(self.leases, lease) as heartbeat:
                yield LeaseClaim(self.leases, lease, heartbeat)
        finally:
            self.leases.release(lease)

    @contextmanager
    def asking(self) -> Iterator[bool]:
        lease = self.leases.acquire(ASK_LEASE, self.lease_seconds)
        try:
            yield lease is not None
        finally:
            if lease is not None:
                self.leases.release(lease)

    def busy(self) -> set[int]:
        prefix = trial_lease(0)[:-1]
        return {int(name[len(prefix):]) for name in self.leases.held_by_others() if name.startswith(prefix)}


__all__ = ["ASK_LEASE", "LeaseClaim", "LeaseLost", "LeasedCoordinator", "LocalCoordinator", "trial_lease"]
