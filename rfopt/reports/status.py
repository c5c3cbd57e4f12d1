"""Who is running a study now (from the presence heartbeats of `rfopt.storage.leases.Presence`), and each study of a
storage at a glance: what ``rfopt status``, the dashboard's index and the study page say about it.

    >>> [s.line() for s in summaries(storage)]                                  # doctest: +SKIP
    ['demo: 2 running, 5 pruned, 1 complete; best 0.8123 (trial 4); running: host:12 (run)']
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from rfopt.storage import schema
from rfopt.storage.leases import seen_on
from rfopt.storage.schema import TrialRecord

from .lead import lead
from .outcome import outcome
from .timeline import now_training


@dataclass(frozen=True)
class Liveness:
    """Whether any process is running a study now (from the heartbeats of `rfopt.storage.leases.Presence`), and what waits for
    one.

        >>> rfopt.reports.status.liveness(study.optuna).message                          # doctest: +SKIP
        'nobody is running this study (last seen 12:03:05); 2 WAITING trials (clones 7, 8) will start when you run
        `rfopt run ...` or `rfopt worker ...`'
    """

    running: bool
    holders: list[str]
    """The processes running it now: ``host:pid (run)`` or ``host:pid (worker)``."""
    last_seen: datetime.datetime | None
    """The last beat of any process that ran it (UTC); None if none ever did (or the storage keeps no heartbeats)."""
    waiting_unattended: list[int]
    """WAITING trials (clones, a list's configs) that nobody will start because nobody is running the study."""
    message: str
    """One line for a person."""
    known: bool = True
    """Whether the storage keeps heartbeats at all (an SQL one): without them, whether a process runs the study cannot
    be told, and no trial is called interrupted."""


def liveness(study: optuna.Study, trials: list[optuna.trial.FrozenTrial] | None = None) -> Liveness:
    """Whether a process (`Study.optimize`, or workers) is running `study`: one whose heartbeat is younger than two
    intervals (a process that died reads as gone within that; one that exited cleanly at once). `trials`: the
    study's trials where the caller has read them already (the dashboard's page)."""
    seen = seen_on(study)
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    waiting = [t.number for t in trials if t.state == TrialState.WAITING]
    if seen is None:
        return Liveness(False, [], None, [], "this storage keeps no heartbeats (no SQL database): whether a process "
                        "runs the study cannot be told", known=False)
    now = time.time()
    alive = [s for s in seen if s.alive(now)]
    last = max((s.ended or s.seen for s in seen), default=None)
    last_seen = None if last is None else datetime.datetime.fromtimestamp(last, datetime.UTC)
    if alive:
        holders = [f"{s.holder} ({s.kind})" for s in alive]
        return Liveness(True, holders, last_seen, [], f"running: {', '.join(holders)}")
    when = "it never ran under this rfopt" if last_seen is None else f"last seen {_local_time(last_seen)}"
    message = f"nobody is running this study ({when})"
    if waiting:
        by_number = {t.number: t for t in trials}
        clones = [n for n in waiting if TrialRecord(by_number[n]).lineage is not None]
        what = f"{len(waiting)} WAITING trial{'s' if len(waiting) > 1 else ''}"
        if clones:
            what += f" (clone{'s' if len(clones) > 1 else ''} {', '.join(map(str, clones))})"
        message += f"; {what} will start when you run `rfopt run ...` or `rfopt worker ...` (or study.optimize)"
    return Liveness(False, [], last_seen, waiting, message)


SITUATIONS = ("training", "queued", "paused", "interrupted", "complete", "pruned", "stopped", "failed", "cancelled")
"""What a trial is doing, in the words every view uses (the page, the index, ``rfopt status``, the trial's
optuna-dashboard note), live ones first (`situation`)."""
LIVE_SITUATIONS = frozenset(SITUATIONS[:4])
"""A trial in one of these has chunks left to train."""


def situation(record: TrialRecord, live: Liveness | None = None) -> str:
    """What `record`'s trial is doing, in one word (`SITUATIONS`):

    - ``queued``: not trained yet (WAITING, or RUNNING in a run that has not started a chunk of it);
    - ``training``: in a run, a chunk in flight or its next one to come (with whom: its gang, `ProgressRecord.gang`);
    - ``paused``: a pause applied (it keeps its slot free until resumed);
    - ``interrupted``: RUNNING, but no process runs the study (a crash, Ctrl-C, a halt or a timeout): the next run
      continues it;
    - ``complete``, ``pruned``, ``stopped`` (by a person), ``failed``, ``cancelled`` (a clone that never started).

    `live`: who runs the study (`liveness`); None or one that cannot tell counts as running."""
    state = record.state
    if record.cancelled is not None:
        return "cancelled"
    if state == TrialState.WAITING:
        return "queued"
    if state == TrialState.COMPLETE:
        return "complete"
    if state == TrialState.PRUNED:
        return "stopped" if record.stop is not None else "pruned"
    if state == TrialState.FAIL:
        return "failed"
    if record.paused:
        return "paused"
    if live is not None and live.known and not live.running:
        return "interrupted"
    if record.in_flight is None and record.committed <= record.start_unit:
        return "queued"
    return "training"


@dataclass(frozen=True)
class StudySummary:
    """One study of a storage at a glance: its trials by state, its best value, whether a process runs it."""

    name: str
    study_id: int
    planned: bool
    """Whether rfopt planned it (a study rfopt never ran is a plain Optuna study)."""
    counts: dict[str, int]
    """Trials by what they are doing (`situation`)."""
    best: tuple[int, float] | None
    """(trial, value) of Optuna's best trial; None before one completes (or for several objectives)."""
    live: Liveness
    stuck: tuple[str, ...] = ()
    """Its units in flight that read as stuck (`rfopt.reports.timeline.Silence`), a gang as one: ``trial 3: no step
    for 1m40s (a step takes ~8.1 s)``, ``trials 3, 4, 5 (one gang): no step for ...``."""
    baseline: float | None = None
    """The base model's value with no adapter (the first baseline, `rfopt.storage.schema.Baseline`); None before."""
    recommended: tuple[int, int, float] | None = None
    """(trial, chunk counted from 1, value) of the adapter the study recommends (`rfopt.reports.outcome`)."""
    tie: int | None = None
    """The runner-up the best trial is within noise of (`rfopt.reports.lead.Lead.tie`); None when it leads by more
    than noise, or it cannot be told."""

    @property
    def finished(self) -> bool:
        """Nothing left to train or start: no trial queued, training, paused or interrupted."""
        return not any(self.counts.get(s) for s in LIVE_SITUATIONS)

    @property
    def status(self) -> str:
        """``running``, ``idle`` (nobody runs it, and it has trials left) or ``finished``."""
        return "running" if self.live.running else "finished" if self.finished else "idle"

    def line(self) -> str:
        """``demo: 2 training, 5 pruned, 1 complete; best 0.8123 (trial 4); base 0.41; take trial 2 after chunk 3
        (0.9001); running: host:12 (run)``; ``best 0.8123 (trial 4; a tie: within noise of trial 2)`` where its lead
        over the runner-up is within noise."""
        best = "-" if self.best is None else f"{self.best[1]:.4f} (trial {self.best[0]}" + (
            ")" if self.tie is None else f"; a tie: within noise of trial {self.tie})")
        status = self.live.message if self.live.running else self.status
        parts = [f"{self.name}: {tally(self.counts)}", f"best {best}"]
        if self.baseline is not None:
            parts.append(f"base {self.baseline:.4f}")
        if self.recommended is not None:
            trial, chunk, value = self.recommended
            parts.append(f"take trial {trial} after chunk {chunk} ({value:.4f})")
        stuck = "".join(f"; STUCK? {line}" for line in self.stuck)
        return "; ".join([*parts, status]) + stuck


def state_counts(trials: Iterable[optuna.trial.FrozenTrial], live: Liveness | None = None, *,
                 shown: bool = True) -> dict[str, int]:
    """Trials by what they are doing (`situation`: the word a person is shown), in the order first met; with `shown`
    False, by Optuna's own state (a cancelled clone is FAIL there)."""
    counts: dict[str, int] = {}
    for t in trials:
        state = situation(TrialRecord(t), live) if shown else t.state.name
        counts[state] = counts.get(state, 0) + 1
    return counts


def tally(counts: Mapping[str, int]) -> str:
    """``2 training, 5 pruned, 1 complete`` (``no trials`` for none), live ones first (`SITUATIONS`)."""
    rank = {state: i for i, state in enumerate(SITUATIONS)}
    ordered = sorted(counts.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    return ", ".join(f"{n} {state.lower()}" for state, n in ordered) or "no trials"


def summaries(storage: optuna.storages.BaseStorage) -> list[StudySummary]:
    """Every study in `storage`, by id (``rfopt status`` and the dashboard's index list them)."""
    from rfopt.compat import study_id_of

    out = []
    for frozen in sorted(storage.get_all_studies(), key=study_id_of):
        study = optuna.load_study(study_name=frozen.study_name, storage=storage,
                                  sampler=optuna.samplers.RandomSampler())
        trials = study.get_trials(deepcopy=False)
        live = liveness(study, trials)
        counts = state_counts(trials, live)
        best = None
        if len(study.directions) == 1 and any(t.state == TrialState.COMPLETE for t in trials):
            best = (study.best_trial.number, study.best_value)
        stuck = []
        if live.running:
            now = time.time()
            for flight in now_training([TrialRecord(t) for t in trials]):  # a gang is one: one verdict
                if flight.stuck(now):
                    assert flight.silence is not None
                    stuck.append(f"{flight.who()}: {flight.silence.text(now)}")
        found = outcome(study, trials)
        ahead = lead(trials, study.directions[0], found.objective) if best is not None else None
        tie = ahead.runner_up if ahead is not None and ahead.best == best[0] and ahead.tie else None
        baseline = next(iter(found.baselines.values()), None)
        recommended = found.recommendation
        out.append(StudySummary(frozen.study_name, study_id_of(frozen), schema.study_record(frozen).planned, counts,
                                best, live, tuple(stuck), baseline=None if baseline is None else baseline.value,
                                recommended=None if recommended is None else
                                (recommended.trial, recommended.unit + 1, recommended.value), tie=tie))
    return out


def _local_time(when: datetime.datetime) -> str:
    local = when.astimezone()
    today = datetime.datetime.now().astimezone().date()
    return local.strftime("%H:%M:%S" if local.date() == today else "%Y-%m-%d %H:%M:%S")
