"""Round-robin scheduling of chunk units: which live trial trains next, and when a rung is complete.

The policy is least progress first: a free device takes the live trial with the fewest completed
chunk units; among equals it prefers a trial whose base model is already resident there, then the
lowest trial number. So no trial starts unit k+1 while another live trial still lacks unit k, and
pruning can be decided at step k once every live trial has reported it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class LiveTrial:
    """What the scheduler knows of a trial that is still training."""

    number: int
    units_done: int
    num_units: int
    model_key: str
    paused: bool = False
    gang_key: Hashable | None = None
    """What trials training together must share (`rfopt.training.gang.gang_key`); None: it trains alone."""

    @property
    def finished(self) -> bool:
        return self.units_done >= self.num_units


def next_trial(live: Iterable[LiveTrial], resident: set[str] = frozenset()) -> LiveTrial | None:
    """The trial to run next: least progress first; then resident base model; then lowest number."""
    candidates = [t for t in live if not t.paused and not t.finished]
    if not candidates:
        return None
    return min(candidates, key=lambda t: (t.units_done, t.model_key not in resident, t.number))


def next_gang(live: Iterable[LiveTrial], size: int, resident: set[str] = frozenset(),
              planned: Mapping[int, Sequence[int]] | None = None) -> list[LiveTrial]:
    """The trials to train next, together (a gang, `rfopt.training.gang`), or one trial alone: empty if none can run.

    The first is `next_trial`'s pick. If it can train in a gang, its gang is the trials at the same progress that
    share its gang key, in number order, at most `size` of them, sized so that the trials at that progress split
    into equal gangs (7 trials with ``size=4`` train as 4 and 3, not 4 and 3 or 6 and 1 by luck of order). A gang
    stored for the first trial's next unit (`planned`: its members by trial number, from before a crash) is formed
    again when all its members can run at that progress.
    """
    live = [t for t in live if not t.paused and not t.finished]
    first = next_trial(live, resident)
    if first is None or first.gang_key is None or size <= 1:
        return [] if first is None else [first]
    peers = sorted((t for t in live if t.gang_key == first.gang_key and t.units_done == first.units_done),
                   key=lambda t: t.number)
    stored = (planned or {}).get(first.number)
    if stored:
        by_number = {t.number: t for t in peers}
        if all(n in by_number for n in stored):
            return [by_number[n] for n in stored]
    gangs = math.ceil(len(peers) / size)
    return peers[: math.ceil(len(peers) / gangs)]


def completed_rungs(live: Sequence[LiveTrial]) -> int:
    """How many steps every live (unpaused) trial has reported: steps below this are complete rungs."""
    active = [t for t in live if not t.paused]
    if not active:
        return 0
    return min(t.units_done for t in active)
