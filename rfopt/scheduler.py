"""Round-robin scheduling of chunk units: which live trial trains next, and when a rung is complete.

The policy is least progress first: a free device takes the live trial with the fewest completed
chunk units; among equals it prefers a trial whose base model is already resident there, then the
lowest trial number. So no trial starts unit k+1 while another live trial still lacks unit k, and
pruning can be decided at step k once every live trial has reported it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass
class LiveTrial:
    """What the scheduler knows of a trial that is still training."""

    number: int
    units_done: int
    num_units: int
    model_key: str
    paused: bool = False

    @property
    def finished(self) -> bool:
        return self.units_done >= self.num_units


def next_trial(live: Iterable[LiveTrial], resident: set[str] = frozenset()) -> LiveTrial | None:
    """The trial to run next: least progress first; then resident base model; then lowest number."""
    candidates = [t for t in live if not t.paused and not t.finished]
    if not candidates:
        return None
    return min(candidates, key=lambda t: (t.units_done, t.model_key not in resident, t.number))


def completed_rungs(live: Sequence[LiveTrial]) -> int:
    """How many steps every live (unpaused) trial has reported: steps below this are complete rungs."""
    active = [t for t in live if not t.paused]
    if not active:
        return 0
    return min(t.units_done for t in active)
