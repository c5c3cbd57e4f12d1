"""The gang a trial's unit trains in (`GangPlan`), stored on each member."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from ._keys import _GANG, unit_key
from ._trial import TrialRef


@dataclass(frozen=True)
class GangPlan:
    """The gang a trial's unit trains in (``rfopt:gang:<unit>``, a trial system attr): its members, in the order
    they run, and the unit each trains. Written on every member before the gang trains, so that a rerun after a crash
    forms the same gang again (its members' rollouts are decoded together: who shares a batch changes its numerics),
    and so that the study page can show which trials run together."""

    id: str
    members: tuple[tuple[int, int], ...]
    """(trial, unit) of each member."""

    @property
    def numbers(self) -> tuple[int, ...]:
        return tuple(n for n, _ in self.members)

    def to_attr(self) -> dict[str, Any]:
        return {"id": self.id, "members": [[n, u] for n, u in self.members]}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> GangPlan:
        return cls(id=str(value["id"]), members=tuple((int(n), int(u)) for n, u in value["members"]))


def gang_plan(trial: FrozenTrial, unit: int) -> GangPlan | None:
    """The gang that trains (or trained) `trial`'s unit `unit`, if it trains in one."""
    value = trial.system_attrs.get(unit_key(_GANG, unit))
    return None if not isinstance(value, Mapping) else GangPlan.from_attr(value)


def write_gang_plan(refs: list[TrialRef], plan: GangPlan) -> None:
    """Store `plan` on each member (before the gang trains)."""
    units = dict(plan.members)
    for ref in refs:
        ref.set(unit_key(_GANG, units[ref.number]), plan.to_attr())
