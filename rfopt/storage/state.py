"""What a trial carries from one chunk unit to the next: the records a checkpoint holds.

`TrialSnapshot` is everything a trial needs to continue exactly (weights, optimizer, scheduler, RNG,
counters); `UnitReport` is what one unit commits to storage (its value, metrics and samples). The
runner produces both, the checkpoint store writes and reads them, the engine commits the report.
They live here, below all three, so that none of them imports another for its types.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RngState:
    """The Python, NumPy, torch and CUDA random states at a chunk boundary."""

    python: Any
    numpy: Any
    torch: Any
    cuda: list[Any] = field(default_factory=list)

    @classmethod
    def capture(cls) -> RngState:
        import numpy as np
        import torch

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(), cuda=cuda)

    def restore(self) -> None:
        import numpy as np
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class TrialSnapshot:
    """Everything a trial needs to continue exactly (what a checkpoint holds). Not Optuna's `TrialState` (a trial's
    RUNNING/COMPLETE/... state), whose name it had."""

    units_done: int
    global_step: int
    tokens_seen: int
    weights: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: RngState | None


@dataclass
class UnitReport:
    """What a unit commits to storage: its value (``trial.report(value, step=unit)``), metrics and samples.

    It rides in the unit's checkpoint, so that a unit whose checkpoint is durable but whose report never reached
    storage (a crash, a worker that lost its lease) is committed later with exactly these values.
    """

    unit: int
    value: float
    metrics: dict[str, Any]
    samples: list[Any]
    steps: list[dict[str, float]] = field(default_factory=list)
    """TRL's logs of each optimizer step of the unit (`ChunkMetrics.steps`); empty for a unit evaluated again after a
    crash without its training logs, and in reports written before rfopt kept them."""
