"""What rfopt tells each tracker about a trial, and what a tracker's per-trial run does with it (`TrialRun`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class TrialInfo:
    """Who a trial is and what it trains: what its run is opened with."""

    study: str
    """The study's name."""
    study_id: str
    """The study's identity (``rfopt:id``): two studies of one name (in two databases) are kept apart by it."""
    number: int
    name: str
    """The run's name, ``<study>-trial-<n>``."""
    params: dict[str, Any]
    """The trial's Optuna params, by their names."""
    config: dict[str, Any]
    """The trial's whole config, as stored (`TrialConfig.to_json`)."""
    clone_of: int | None = None
    warm_start: bool = False
    start_unit: int = 0
    """A warm clone's first chunk: it continues its parent's step axis from there."""

    @property
    def description(self) -> str:
        text = f"trial {self.number} of rfopt study {self.study!r}"
        if self.clone_of is not None:
            text += f", a clone of trial {self.clone_of}"
            if self.warm_start:
                text += f" warm-started from its weights after chunk {self.start_unit}"
        return text

    def run_config(self) -> dict[str, Any]:
        """A run's config where the tracker keeps one: the Optuna params under their names (what a sweep compares),
        the whole config under ``config``, rfopt's lineage under ``rfopt``."""
        rfopt = {"study": self.study, "study_id": self.study_id, "trial": self.number}
        if self.clone_of is not None:
            rfopt |= {"clone_of": self.clone_of, "warm_start": self.warm_start, "start_unit": self.start_unit}
        return {**self.params, "config": self.config, "rfopt": rfopt}


@dataclass(frozen=True)
class ChunkLog:
    """A committed chunk of a trial: the value reported to Optuna and the eval metrics, at the trial's global step
    when the chunk ended."""

    unit: int
    """Optuna's step (the trial's chunks done, minus one)."""
    step: int
    value: float
    eval: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """By name: ``value`` (what Optuna was told), ``eval/<metric>``, ``chunk`` (Optuna's step)."""
        return {"value": self.value, **{f"eval/{k}": v for k, v in self.eval.items()}, "chunk": float(self.unit)}


END_STATES = ("complete", "pruned", "stopped", "failed", "cancelled")


@dataclass(frozen=True)
class TrialEnd:
    """How a trial ended."""

    state: str
    """One of `END_STATES`: ``stopped`` is Optuna's PRUNED by a person's stop, ``cancelled`` a clone cancelled
    before it started (Optuna's FAIL)."""
    reason: str | None = None
    value: float | None = None

    @property
    def failed(self) -> bool:
        return self.state in ("failed", "cancelled")


@dataclass(frozen=True)
class Leaderboard:
    """The study's trials as a table, best first (what each tracker shows at the end of a run)."""

    columns: list[str]
    rows: list[list[Any]]
    finished: bool
    """Whether every trial of the study has ended (none RUNNING or WAITING)."""
    best: tuple[int, float] | None = None
    """(trial, value) of the best COMPLETE trial."""

    def markdown(self) -> str:
        def cell(value: Any) -> str:
            text = "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\n", " ")

        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)


class TrialRun(Protocol):
    """One trial's run in one tracker, held by the process that trains or ends the trial."""

    def steps(self, rows: list[dict[str, float]]) -> None:
        """TRL's logs of optimizer steps, each with ``step`` (the trial's global step) and TRL's names."""

    def chunk(self, log: ChunkLog) -> None:
        """A committed chunk's value and eval metrics."""

    def flush(self) -> None:
        """Make what was logged durable: a committed unit must survive a crash right after it."""

    def end(self, end: TrialEnd) -> None:
        """The trial ended: record how, and close the run for good."""

    def release(self) -> None:
        """This process is done with the trial, which goes on (later, or in another process): close the run here,
        resumable."""


class Tracker(Protocol):
    """One tracker's side of a study in one process: the trials' runs, and the study's own place."""

    name: str

    def open(self, info: TrialInfo) -> TrialRun:
        """The trial's run: created the first time, continued (the same run) after that, in any process."""

    def leaderboard(self, board: Leaderboard) -> None:
        """Show the study's leaderboard where the tracker groups the study."""

    # Optional: ``location(info) -> str``, where the trial's run is written when that depends on the process (its
    # environment, its working directory), as TensorBoard's folder does; `Tracking` stores it and tells a change.

    def close(self) -> None:
        """Nothing more is logged from this process."""
