"""A trial's small records: who asked for what and when (clone lineage, op requests, withdrawals, cancels, applied
ops, stops), its rung decisions, a unit's metrics, and the progress of the unit in flight."""

from __future__ import annotations

import datetime
import getpass
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._keys import _REQUEST
from ._values import StepColumns, _finite, json_safe

STOP_REASON = "stopped by user"
CONTROL_OPS = ("pause", "resume", "stop")


def who() -> str:
    """``user@host``: who asked for an op or a clone."""
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class Lineage:
    """Where a clone comes from (``rfopt:clone``)."""

    parent: int
    overrides: dict[str, Any]
    warm_start: bool
    start_unit: int
    """The parent's committed units when a warm clone was made: the clone reports from this step on."""
    by: str
    at: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_attr(self) -> dict[str, Any]:
        return {"parent": self.parent, "overrides": dict(self.overrides), "warm_start": self.warm_start,
                "start_unit": self.start_unit, "by": self.by, "at": self.at, "token": self.token}

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Lineage:
        return cls(parent=int(value["parent"]), overrides=dict(value.get("overrides") or {}),
                   warm_start=bool(value.get("warm_start")), start_unit=int(value.get("start_unit", 0)),
                   by=str(value.get("by", "unknown")), at=str(value.get("at", "")), token=str(value.get("token", "")))


@dataclass(frozen=True)
class Replicate:
    """A replicate (``rfopt:replicate_of``): a config's run again with a new seed (`rfopt.engine.trials.replicates.confirm`).
    Its config is its original's with ``args.seed`` = `seed`, and its Optuna params are its original's (the same
    config, to Optuna); it is also a clone of it (`Lineage`), which is how a run of the study starts it."""

    of: int
    """The original trial: the one the sweep ran, whose config this one repeats."""
    seed: int
    prune: bool = False
    """Judged at rung boundaries like any trial; False (the default): it runs to its end, never pruned."""

    def to_attr(self) -> dict[str, Any]:
        return {"of": self.of, "seed": self.seed, "prune": self.prune}

    @classmethod
    def from_attr(cls, value: Any) -> Replicate | None:
        if not isinstance(value, Mapping):
            return None
        try:
            return cls(of=int(value["of"]), seed=int(value["seed"]), prune=bool(value.get("prune", False)))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class TrialRequest:
    """An op asked for on a running trial (pause, resume, stop), not necessarily applied yet."""

    op: str
    by: str
    at: str
    id: str

    @property
    def key(self) -> str:
        # Sorts by time, then id: the order in which requests are applied.
        return f"{_REQUEST}{self.at}-{self.id}"

    @classmethod
    def new(cls, op: str, by: str | None = None) -> TrialRequest:
        return cls(op=op, by=by or who(), at=now(), id=uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class Withdrawal:
    """A pending request taken back before it applied (``rfopt:withdrawn:<request id>``)."""

    request: TrialRequest
    by: str
    at: str


@dataclass(frozen=True)
class Cancel:
    """Who cancelled a WAITING clone before it started, and when (``rfopt:cancelled``); it ends FAIL with `reason`."""

    by: str
    at: str

    @property
    def reason(self) -> str:
        return f"cancelled by {self.by} at {self.at} before it started"

    def to_attr(self) -> dict[str, Any]:
        return {"by": self.by, "at": self.at}


@dataclass(frozen=True)
class AppliedOp:
    """One entry of a trial's ``rfopt:ops`` history: a request and when it took effect."""

    op: str
    by: str
    requested_at: str
    applied_at: str
    id: str

    def to_attr(self) -> dict[str, Any]:
        return {"op": self.op, "by": self.by, "requested_at": self.requested_at, "applied_at": self.applied_at,
                "id": self.id}


@dataclass(frozen=True)
class Stop:
    """Why and when a person stopped a trial (``rfopt:stopped``)."""

    by: str
    at: str
    after_chunk: int
    """The unit it stopped after (Optuna's step; shown to people as chunk ``after_chunk + 1``)."""
    reason: str = STOP_REASON

    def to_attr(self) -> dict[str, Any]:
        return {"reason": self.reason, "by": self.by, "at": self.at, "after_chunk": self.after_chunk}


@dataclass(frozen=True)
class PruneDecision:
    """Whether a trial stops after the chunk of ``step``, and why (``rfopt:pruning:<step>``).

    Example::

        PruneDecision(trial_number=5, step=0, prune=True,
                      reason="best value 0.12 up to chunk 0 is below the median 0.8 of 7 peers",
                      peers=(0, 1, 2, 3, 4, 6, 7), pruner="MedianPruner")
    """

    trial_number: int
    step: int
    prune: bool
    #: Human text for logs and the dashboard.
    reason: str
    #: Numbers of the trials this one was compared against (empty when none were).
    peers: tuple[int, ...]
    #: Class name of the pruner that decided.
    pruner: str

    def to_attr(self) -> dict[str, Any]:
        """The JSON value stored under :func:`decision_key` (trial and step are in the key)."""
        return {"prune": self.prune, "reason": self.reason, "peers": list(self.peers), "pruner": self.pruner}

    @classmethod
    def from_attr(cls, trial_number: int, step: int, value: Mapping[str, Any]) -> PruneDecision:
        return cls(trial_number=trial_number, step=step, prune=bool(value["prune"]), reason=str(value["reason"]),
                   peers=tuple(int(n) for n in value["peers"]), pruner=str(value["pruner"]))


@dataclass(frozen=True)
class UnitMetrics:
    """What the engine stored for one chunk unit of a trial (``rfopt:metrics:<unit>``): finite numbers only."""

    unit: int
    chunk: int
    train: dict[str, float]
    eval: dict[str, float]
    scores: dict[str, list[float]] = field(default_factory=dict)
    """Each eval prompt's score, in eval-set order, by objective name (``reward``, each reward function's name): the
    eval means are their means (`rfopt.noise` gives their standard errors); NaN where a reward function gave None.
    Empty for units an earlier rfopt stored."""

    def scores_of(self, objective: str) -> list[float]:
        """The per-prompt scores behind `objective` (``reward`` or a reward function's name); empty if not stored."""
        return self.scores.get(objective, [])


@dataclass(frozen=True)
class BestCheckpoint:
    """A trial's best checkpoint so far (``rfopt:best``): the chunk unit whose evaluation scored best among those whose
    completions had not collapsed, and where its adapter is kept (the checkpoint store's ``best/``). Written when a
    unit commits with a better value than the one recorded (`rfopt.engine.outputs.best`), after its adapter is saved."""

    unit: int
    """The unit (Optuna's step; shown as chunk ``unit + 1``)."""
    chunk: int
    """The data chunk it trained on last."""
    value: float
    location: str
    """Its adapter's directory (PEFT format), or URL in an object store."""

    def to_attr(self) -> dict[str, Any]:
        return {"unit": self.unit, "chunk": self.chunk, "value": self.value, "location": self.location}

    @classmethod
    def from_attr(cls, value: Any) -> BestCheckpoint | None:
        if not isinstance(value, Mapping):
            return None
        try:
            return cls(unit=int(value["unit"]), chunk=int(value.get("chunk", value["unit"])),
                       value=float(value["value"]), location=str(value["location"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Activity:
    """What a unit in flight does now within its phase, finer than the phase (`ProgressRecord.activity`): how far a
    gang's rollouts are decoded, whose turn it is in a gang's step, how many eval prompts are done.

    - ``decoding``: the gang's rollouts decoded in one batch; `done` tokens of at most `total` new tokens, at `rate`
      tokens per second;
    - ``member``: in a gang's training step, member `done` of `total` (trial `trial`) runs its own part: its reward
      functions, its loss, its optimizer step (sequential training: its forwards and backward too);
    - ``batched``: the gang's one batched forward or backward, for all `total` members at once (``gang_training=
      "batched"``);
    - ``prompts``: an evaluation (the unit's, or the base model's); `done` of `total` eval prompts have their
      completion, and the batch decoding now has `tokens` of at most `max_tokens` new tokens, at `rate` tokens per
      second.
    """

    what: str
    done: int = 0
    total: int = 0
    trial: int | None = None
    """``member``: the trial whose turn it is."""
    tokens: int = 0
    max_tokens: int = 0
    rate: float | None = None
    """Tokens per second of the batch decoding now (``decoding``, ``prompts``); None before one is measured."""
    since: float = 0.0
    """When this activity began (seconds since the epoch, the writer's clock): a member's turn, a decode."""

    def to_attr(self) -> dict[str, Any]:
        return json_safe({"what": self.what, "done": self.done, "total": self.total, "trial": self.trial,
                          "tokens": self.tokens, "max_tokens": self.max_tokens, "rate": self.rate,
                          "since": self.since})

    @classmethod
    def from_attr(cls, value: Any) -> Activity | None:
        if not isinstance(value, Mapping):
            return None
        try:
            trial = value.get("trial")
            return cls(what=str(value["what"]), done=int(value.get("done", 0)), total=int(value.get("total", 0)),
                       trial=None if trial is None else int(trial), tokens=int(value.get("tokens", 0)),
                       max_tokens=int(value.get("max_tokens", 0)), rate=_finite(value.get("rate")),
                       since=float(value.get("since") or 0.0))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class ProgressRecord:
    """How far the unit a trial trains now has got (``rfopt:progress``), published by the process training it while
    the chunk runs (`rfopt.training.progress.ProgressPublisher`): a few times a minute at most, not once per token or step, and
    a last time when the chunk's training ends. Anyone reading the storage shows it: the dashboard's "now training"
    line, ``rfopt status``.

    It says nothing of what is committed (the unit counts once its report is stored: `TrialRecord.committed`); a
    record whose unit is committed is history (`TrialRecord.in_flight`).
    """

    unit: int
    """The unit in flight (unit ``u`` is the trial's ``u+1``-th chunk; Optuna's step ``u`` once committed)."""
    num_units: int
    phase: str
    """``baseline`` (the base model evaluated with no adapter, for the study's reference, before the trial's first
    unit), ``loading`` (swapping the trial in: its checkpoint, adapter, trainer), ``training``, ``evaluating``, or
    ``saving`` (its checkpoint and report written)."""
    step: int
    """Optimizer steps of this unit done so far, 0 to `steps`."""
    steps: int
    """Optimizer steps in the unit."""
    global_step: int
    """The trainer's global step after `step` (the per-step charts' x axis)."""
    started: float
    """When the unit started (seconds since the epoch, the writer's clock)."""
    updated: float
    """When this record was written."""
    step_seconds: float | None
    """Median seconds per optimizer step of this unit so far (None before its first step ends; records of an earlier
    rfopt hold the mean)."""
    logs: dict[str, list[float | None]] = field(default_factory=dict)
    """TRL's logs of the unit's steps so far, by column (`StepColumns`): the charts draw them before the commit."""
    holder: str = ""
    """The process training it: ``host:pid``."""
    gang: tuple[int, ...] = ()
    """The trials training together with it in one process, itself included (empty: it trains alone)."""
    stepped: float | None = None
    """When it was last heard to move: its last optimizer step ended, or its phase began (seconds since the epoch);
    None in records an earlier rfopt wrote (then `updated` stands in). A step that does not come is what "stuck"
    means (`rfopt.reports.timeline.Silence`)."""
    activity: Activity | None = None
    """What it does now within its phase (`Activity`: the gang's rollouts decoded so far, whose turn it is, eval prompts
    done); None where nothing finer is known (a trial alone generates inside TRL's own ``generate``)."""

    @property
    def moved(self) -> float:
        """When it was last heard to move (`stepped`, else the record's write)."""
        return self.updated if self.stepped is None else self.stepped

    def step_logs(self) -> list[dict[str, float]]:
        """The logs of the unit's steps so far, one dict per step (`StepColumns.decode`)."""
        return StepColumns.decode(self.logs)

    def to_attr(self) -> dict[str, Any]:
        return json_safe({"unit": self.unit, "num_units": self.num_units, "phase": self.phase, "step": self.step,
                          "steps": self.steps, "global_step": self.global_step, "started": self.started,
                          "updated": self.updated, "step_seconds": self.step_seconds, "logs": self.logs,
                          "holder": self.holder, "gang": list(self.gang), "stepped": self.stepped,
                          "activity": None if self.activity is None else self.activity.to_attr()})

    @classmethod
    def from_attr(cls, value: Any) -> ProgressRecord | None:
        if not isinstance(value, Mapping):
            return None
        try:
            seconds = value.get("step_seconds")
            return cls(unit=int(value["unit"]), num_units=int(value["num_units"]), phase=str(value["phase"]),
                       step=int(value["step"]), steps=int(value["steps"]), global_step=int(value["global_step"]),
                       started=float(value["started"]), updated=float(value["updated"]),
                       step_seconds=None if _finite(seconds) is None else float(seconds),
                       logs=dict(value.get("logs") or {}), holder=str(value.get("holder", "")),
                       gang=tuple(int(n) for n in value.get("gang") or ()),
                       stepped=None if _finite(value.get("stepped")) is None else float(value["stepped"]),
                       activity=Activity.from_attr(value.get("activity")))
        except (KeyError, TypeError, ValueError):
            return None
