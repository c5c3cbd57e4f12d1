"""One chunk unit of one trial, from start to commit: load -> train chunk -> evaluate -> checkpoint -> commit.

This is the only code that trains a trial, evaluates it, writes its checkpoint or commits its report:

1. **load** (`prepare`): bring the runner to the trial's committed progress when it is not there
   (after a pause, a crash, another worker's units, a warm start): from the latest checkpoint, the
   clone's warm-start weights, or a fresh adapter. A unit whose checkpoint is durable but whose
   report never reached storage is committed now, from the report inside the checkpoint.
2. **train** one chunk with TRL's `GRPOTrainer` (`TrialRunner.train_chunk`); it stops between two
   steps if the claim on the trial is lost (a worker whose lease another took over). While it trains, its progress
   (step s of S, TRL's logs so far) is published, throttled (`rfopt.training.progress`).
3. **evaluate** on the eval set with the study's fixed settings, through the plan's rollout backend (the one the
   members trained on) with rfopt's evaluation (`rfopt.training.evaluation.evaluate_runners`, from each runner's
   `eval_member`): the unit's value.
4. **checkpoint**: the trial's whole state and the unit's report, durably. The state is taken right after training
   and its files are written by a thread while the unit is evaluated (`CheckpointStore.stage`); the report is added
   once the evaluation returns, and only then is the checkpoint published and named (`CheckpointStore.save_staged`,
   a gang's `save_gang`).
5. **commit**: the claim's fence, then the unit's metrics and samples and ``trial.report(value,
   step=unit)``; the unit counts as done once its report is in storage. Then the run's subscribers
   hear of it (`UnitCommitted`): the progress bar, the dashboard's artifacts, `on_unit`.

A finished trial (`finish`) saves its adapter and is told COMPLETE with its last value.

The claim (`rfopt.engine.running.coordinator`) says whether this process may write for the trial. What its fences
cover, and why the writes after them are safe to repeat, is in the README ("Workers").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import optuna

from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.config.settings import EvalSettings
from rfopt.config.trial import TrialConfig
from rfopt.errors import CheckpointError, RfoptError
from rfopt.storage import schema
from rfopt.storage.checkpoints import CheckpointStore, Staged
from rfopt.storage.crashpoints import reach
from rfopt.storage.schema import TrialRecord, TrialRef
from rfopt.storage.state import TrialSnapshot, UnitReport, on_cpu
from rfopt.training.evaluation import EvalResult, evaluate_runners
from rfopt.training.gang import Gang, GangMember
from rfopt.training.models import ModelPool, adapter_name
from rfopt.training.progress import (INTERVAL_SECONDS, ProgressPublisher, UnitProgress, evaluation_progress,
                                     gang_progress)
from rfopt.training.rollouts import RolloutBackend
from rfopt.training.runner import Runner, TrialRunner
from rfopt.training.trackers import Tracking

from rfopt.engine.outputs.best import keep_if_best
from rfopt.engine.planning.plan import EXACT, UnitPlan, alone
from rfopt.engine.planning.scheduler import LiveTrial

logger = logging.getLogger("rfopt")


class Claim(Protocol):
    """This process's right to write for one trial (see `rfopt.engine.running.coordinator`)."""

    def lost(self) -> bool:
        """Whether the right was lost while the unit trained (asked after every optimizer step)."""

    def fence_checkpoint(self, trial: int) -> None:
        """Raise `LeaseLost` unless the right still holds; called before the checkpoint is written."""

    def fence_commit(self, trial: int, unit: int) -> None:
        """Record the unit as committed by this process, in the same transaction that checks the right."""

    def fence_finish(self, trial: int) -> None:
        """Raise `LeaseLost` unless the right still holds; called before the trial is told COMPLETE."""


class CallbackFailed(RfoptError):
    """A user callback raised after a unit was committed: not the trial's failure; its cause is re-raised to the
    caller."""


@dataclass(frozen=True)
class UnitCommitted:
    """What subscribers hear after each commit."""

    trial: optuna.Trial
    unit: int
    value: float


@dataclass(frozen=True)
class Context:
    """What every unit of one run shares, built whole (`rfopt.engine.running.run`) and not changed after."""

    study: optuna.Study
    store: CheckpointStore
    plan: ChunkPlan
    train_dataset: Any
    eval_dataset: Any
    objective: str
    settings: EvalSettings
    pool: ModelPool
    workdir: Path
    tracking: Tracking | None = None
    """The trackers each chunk's trainer reports to (`rfopt.training.trackers`); None: none."""
    subscribers: tuple[Callable[[UnitCommitted], None], ...] = ()
    """rfopt's own listeners of committed units, in order (the roster's first: `Roster.on_commit`): one that raises is
    logged, and the run goes on."""
    callbacks: tuple[Callable[[UnitCommitted], None], ...] = ()
    """The user's: one that raises ends the run with its exception (`CallbackFailed` on the way out of the unit),
    as an Optuna callback does; the unit stays committed and the trial resumable."""
    step_listeners: tuple[Callable[[UnitProgress], None], ...] = ()
    """In-process listeners of each optimizer step of a unit in flight (the progress bar); see `rfopt.training.progress`."""
    progress_seconds: float = INTERVAL_SECONDS
    """At most one write of a trial's in-chunk progress record in this many seconds."""
    runner_class: Callable[..., Runner] = TrialRunner
    """What trains a trial (a `rfopt.training.runner.Runner`): `TrialRunner` on one device, a data-parallel runner over
    several (`rfopt.training.parallel`), the tests' scripted runner."""


@dataclass(frozen=True)
class Live:
    """A trial this process is running: its handle, config, runner, and what it knows of its progress.

    Frozen to the outside: what it knows changes only through its own methods, one a transition (`refresh` from
    storage, `state_loaded`, `state_dropped`, `new_runner`, `committed_unit`, `pause`, `resume`, `rung_decided`), so
    who changes a live trial, and how, is read here; assigning a field from elsewhere raises
    ``dataclasses.FrozenInstanceError``."""

    trial: optuna.Trial
    ref: TrialRef
    config: TrialConfig
    schedule: TrialSchedule
    runner: Runner
    start_unit: int
    """0, or for a warm-started clone its parent's progress when it was made (it reports from there on)."""
    warm_start: bool
    warm_token: str
    """A warm-started clone's lineage token, which names its starting weights in the checkpoint store."""
    committed: int
    """Units committed in storage, as last read or written by this process (`refresh`, `committed_unit`)."""
    loaded: bool
    """Whether the runner holds the trial's state after `committed` units (else `prepare` loads it)."""
    paused: bool = False
    last_value: float | None = None
    decided: frozenset[int] = frozenset()
    """Steps whose rung decision is stored for it."""

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def finished(self) -> bool:
        return self.committed >= self.schedule.num_units

    def candidate(self) -> LiveTrial:
        """What the scheduler needs to know of it (who it may train with is the planner's: `rfopt.engine.planning.plan`)."""
        return LiveTrial(self.number, self.committed, self.schedule.num_units, self.config.model_key, self.paused)

    # ------------------------------------------------------------------ transitions
    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def refresh(self, record: TrialRecord) -> None:
        """Take what storage says of the trial (`record`, read under its claim): its committed units (moved on by
        another process, or by this one before a crash: its state is loaded again), pause, rung decisions, value."""
        if record.committed != self.committed:
            self._set(committed=record.committed, loaded=False)
        self._set(paused=record.paused, decided=self.decided | record.decided_steps)
        if record.last_value is not None:
            self._set(last_value=record.last_value)

    def state_loaded(self) -> None:
        """Its runner now holds its state after `committed` units (loaded, or fresh where nothing was committed)."""
        self._set(loaded=True)

    def state_dropped(self) -> None:
        """What its runner holds is stale or gone (the claim was lost, or its memory freed): `prepare` loads it again."""
        self._set(loaded=False)

    def new_runner(self, make: Callable[[], Runner]) -> None:
        """Train it with a fresh runner, ``make()``, from here on: what was trained here but never committed is dropped
        (the old runner cleaned up first)."""
        self.runner.cleanup()
        self._set(runner=make(), loaded=False)

    def committed_unit(self, unit: int, value: float) -> None:
        """Its unit `unit` is committed in storage with `value`."""
        self._set(committed=unit + 1, last_value=value)

    def pause(self) -> None:
        """A pause applied: it keeps no slot, and its runner frees its memory (it continues from its checkpoint)."""
        self.runner.cleanup()
        self._set(paused=True, loaded=False)

    def resume(self) -> None:
        """A resume applied: it trains again, from its checkpoint."""
        self._set(paused=False)

    def rung_decided(self, step: int) -> None:
        """Its rung decision at `step` is stored."""
        self._set(decided=self.decided | {step})


def fresh_runner(ctx: Context, number: int, config: TrialConfig, schedule: TrialSchedule, start_unit: int
                 ) -> Runner:
    return ctx.runner_class(number, config, ctx.plan, schedule, ctx.train_dataset, ctx.pool, ctx.workdir, start_unit,
                            tracking=ctx.tracking)


# ---------------------------------------------------------------------- 1. load
def prepare(ctx: Context, live: Live, claim: Claim, backend: str = EXACT) -> None:
    """Bring the runner to the trial's committed progress; commit a durable unit whose report is missing (evaluated
    again through the rollout backend of kind `backend`, the unit's plan's, as its unit would have been).

    Raises `CheckpointError` if the trial's state is lost (committed units, but no checkpoint that holds them).
    """
    if live.loaded:
        return
    number = live.number
    state = ctx.store.load(number)
    if state is None or state.units_done < live.committed:
        if live.committed > live.start_unit:
            held = "no checkpoint" if state is None else f"a checkpoint of {state.units_done} chunks"
            raise CheckpointError(
                f"trial {number}: {live.committed} chunks were committed but {ctx.store.trial_dir(number)} holds "
                f"{held}; its state is lost, clone it to train the config again"
            )
        if live.runner.units_done != live.start_unit:  # trained here but never committed: start afresh
            live.new_runner(lambda: fresh_runner(ctx, number, live.config, live.schedule, live.start_unit))
        if live.warm_start:
            live.runner.load_weights(ctx.store.load_warm_start(number, live.warm_token))
        live.state_loaded()
        return
    if state.units_done > live.committed + 1:
        raise CheckpointError(f"trial {number}: its checkpoint holds {state.units_done} chunks but only "
                              f"{live.committed} were committed; the store does not belong to this study's storage")
    live.runner.load_state(state)
    live.state_loaded()
    if state.units_done == live.committed + 1:  # its last unit's checkpoint is durable, its report is not stored
        report = ctx.store.load_report(number)
        if report is None or report.unit != live.committed:  # written without its report: evaluate again
            report = _report(ctx, live, live.committed, train=None, backend=backend)
        commit(ctx, live, report, claim)


def _report(ctx: Context, live: Live, unit: int, train: dict[str, float] | None,
            steps: list[dict[str, float]] | None = None, backend: str = EXACT) -> UnitReport:
    started = time.perf_counter()
    (result,) = evaluate_runners(live.runner.rollout_backend(backend), [live.runner], ctx.eval_dataset, ctx.settings)
    if isinstance(result, Exception):
        raise result
    return _report_of(ctx, live, unit, result, train, steps, eval_seconds=time.perf_counter() - started)


def _report_of(ctx: Context, live: Live, unit: int, result: EvalResult, train: dict[str, float] | None,
               steps: list[dict[str, float]] | None = None, eval_seconds: float = 0.0) -> UnitReport:
    value = result.objective(ctx.objective)
    if not math.isfinite(value):
        raise ValueError(
            f"objective {ctx.objective!r} is {value} on the eval set (every reward was None/NaN?); "
            "check the reward functions"
        )
    metrics: dict[str, Any] = {"chunk": live.schedule.chunk_of_unit(unit), "eval": result.metrics,
                               "scores": result.scores}  # each eval prompt's score: the value's standard error
    if train is not None:  # with the unit's times: training (from the swap-in on), evaluation, and its start
        metrics["train"] = train | {"eval_seconds": eval_seconds}
    return UnitReport(unit=unit, value=value, metrics=schema.json_safe(metrics), samples=schema.json_safe(result.samples),
                      steps=list(steps or []))


def commit(ctx: Context, live: Live, report: UnitReport, claim: Claim) -> None:
    """Put a unit's metrics and value in storage; the unit counts as done once its value is reported."""
    number = live.number
    claim.fence_commit(number, report.unit)
    keep_if_best(ctx.store, live.ref, live.runner, live.config, report, ctx.study)  # rfopt.engine.outputs.best
    schema.write_unit(live.ref, report.unit, report.metrics, report.samples, report.steps)
    reach("metrics-stored", trial=number, unit=report.unit)
    live.trial.report(report.value, step=report.unit)
    reach("unit-committed", trial=number, unit=report.unit)
    live.committed_unit(report.unit, report.value)
    event = UnitCommitted(live.trial, report.unit, report.value)
    for subscriber in ctx.subscribers:
        try:
            subscriber(event)
        except Exception as exc:  # noqa: BLE001 - a listener's failure is not the trial's
            logger.warning("trial %d: a listener of committed units failed (%s: %s); the trial goes on",
                           number, type(exc).__name__, exc)
    for callback in ctx.callbacks:
        try:
            callback(event)
        except Exception as exc:
            raise CallbackFailed(f"trial {number}: a callback raised {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------- 2-5. train, evaluate, checkpoint, commit
def run_units(ctx: Context, members: list[tuple[Live, Claim]], plan: UnitPlan | None = None
              ) -> dict[int, BaseException | None]:
    """One unit of each member, carried out as `plan` says (`rfopt.engine.planning.plan`; None: each trial alone): trained in
    lockstep through the plan's rollout backend (`rfopt.training.gang`: a trial alone is a gang of one on the exact
    backend; a gang's members share the base model's batched backend), evaluated together through the same backend,
    checkpointed durably with each unit's report (a gang's all of them or none: `CheckpointStore.save_gang`), then
    committed one by one.

    Returns each member's outcome by trial number: None (its unit is committed, or it had none left to train) or
    the exception that ended its unit (it fails alone, or with `LeaseLost`/`ChunkAborted` another process has it
    now). Raises what a user callback raised (`CallbackFailed`), once every unit is committed, and what stops the
    whole run (Ctrl-C)."""
    plan = plan or alone(members[0][0].number)
    outcomes: dict[int, BaseException | None] = {}
    ready = _ready(ctx, members, outcomes, plan.backend)
    if not ready:
        return outcomes
    backend = ready[0][0].runner.rollout_backend(plan.backend)
    # Their adapters were loaded or made since the backend last saw them (a checkpoint, a warm start, a fresh adapter).
    backend.adapters_changed([adapter_name(live.number) for live, _ in ready if live.config.peft_config is not None])
    record = None
    if plan.in_gang:  # who trained together, so that a rerun forms the same gang
        record = schema.GangPlan(id=plan.gang_id, members=tuple((live.number, live.committed) for live, _ in ready))
        schema.write_gang_plan([live.ref for live, _ in ready], record)
    trained = _train(ctx, backend, ready, record, outcomes, plan.training)
    if not trained:
        return outcomes
    staging = _Staging(ctx.store, trained)  # the checkpoints' files written while the units are evaluated
    try:
        reports = _evaluate(ctx, backend, trained, outcomes)
    except BaseException:  # Ctrl-C, say: nothing staged is published
        staging.drop()
        raise
    saved = _save(ctx, reports, staging.written(), record)
    failed_callback: CallbackFailed | None = None
    for live, claim, report in reports:
        if isinstance(saved[live.number], Exception):  # its own checkpoint could not be written: it fails alone
            outcomes[live.number] = saved[live.number]
            continue
        reach("checkpoint-saved", trial=live.number, unit=report.unit)
        try:
            commit(ctx, live, report, claim)
        except CallbackFailed as exc:  # the unit is committed; the caller hears of it once every unit is
            failed_callback = failed_callback or exc
        except Exception as exc:  # noqa: BLE001 - another process has it now
            outcomes[live.number] = exc
    if failed_callback is not None:
        raise failed_callback
    return outcomes


def _ready(ctx: Context, members: list[tuple[Live, Claim]], outcomes: dict[int, BaseException | None],
           backend: str = EXACT) -> list[tuple[Live, Claim]]:
    """The members with a unit to train now, loaded and set up; the others' outcomes in `outcomes`. None at all when a
    unit a crash left durable was committed now: its rung is decided before the next unit starts, as it would have
    been without the crash."""
    ready: list[tuple[Live, Claim]] = []
    moved = False
    for live, claim in members:
        before = live.committed
        try:
            prepare(ctx, live, claim, backend)
        except Exception as exc:  # noqa: BLE001 - this member's state is lost or unreadable: it fails alone
            outcomes[live.number] = exc
            continue
        outcomes[live.number] = None
        moved |= live.committed != before
        if not live.finished:
            ready.append((live, claim))
    if moved:
        return []
    for live, claim in list(ready):
        try:
            live.runner.setup()  # its adapter on the shared model (a fresh trial's is made at its first unit)
        except Exception as exc:  # noqa: BLE001 - its model cannot be loaded, say: it fails alone
            outcomes[live.number] = exc
            ready.remove((live, claim))
    return ready


@dataclass
class _Trained:
    live: Live
    claim: Claim
    chunk: Any
    publisher: ProgressPublisher
    seconds: float


def _train(ctx: Context, backend: RolloutBackend, ready: list[tuple[Live, Claim]], plan: schema.GangPlan | None,
           outcomes: dict[int, BaseException | None], training: str) -> list[_Trained]:
    """Each member's chunk, in lockstep (`rfopt.training.gang.Gang`); a member that failed gets its outcome."""
    publishers = {}
    for live, _ in ready:
        reach("unit-started", trial=live.number, unit=live.committed)
        publishers[live.number] = ProgressPublisher(
            live.ref, unit=live.committed, num_units=live.schedule.num_units, steps=live.schedule.steps_per_chunk,
            listeners=ctx.step_listeners, interval=ctx.progress_seconds, gang=plan.numbers if plan else ())
        publishers[live.number].loading()
    started = time.perf_counter()
    gang = [GangMember(live.runner, should_stop=claim.lost, on_step=publishers[live.number].step)
            for live, claim in ready]
    Gang(backend, gang, training=training, on_activity=gang_progress(list(publishers.values()))).train()
    seconds = time.perf_counter() - started
    trained: list[_Trained] = []
    for (live, claim), member in zip(ready, gang):
        if member.error is not None:
            if not isinstance(member.error, Exception):  # SystemExit and the like end the run, as they would alone
                raise member.error
            outcomes[live.number] = member.error
        else:
            reach("chunk-trained", trial=live.number, unit=live.committed)
            publishers[live.number].evaluating()
            trained.append(_Trained(live, claim, member.result, publishers[live.number], seconds))
    return trained


def _evaluate(ctx: Context, backend: RolloutBackend, trained: list[_Trained], outcomes: dict[int, BaseException | None]
              ) -> list[tuple[Live, Claim, UnitReport]]:
    """Each trained member's evaluation, through the backend it trained on (the plan's) with rfopt's evaluation
    (`evaluate_runners`), as its unit's report; a member whose evaluation failed (or whose claim was lost) gets its
    outcome."""
    started = time.perf_counter()
    results = evaluate_runners(backend, [t.live.runner for t in trained], ctx.eval_dataset, ctx.settings,
                               progress=evaluation_progress([t.publisher for t in trained]))
    eval_seconds = time.perf_counter() - started
    for t in trained:
        t.publisher.saving()
    reports: list[tuple[Live, Claim, UnitReport]] = []
    for t, result in zip(trained, results):
        live = t.live
        try:
            if isinstance(result, Exception):
                raise result
            train = dict(t.chunk.values) | {"seconds": t.seconds, "swap_seconds": t.chunk.swap_seconds,
                                            "started_at": t.publisher.started}
            report = _report_of(ctx, live, live.committed, result, train, steps=t.chunk.steps,
                                eval_seconds=eval_seconds)
            t.claim.fence_checkpoint(live.number)
        except Exception as exc:  # noqa: BLE001 - its evaluation failed, or another process has it now
            outcomes[live.number] = exc
            continue
        reports.append((live, t.claim, report))
    return reports


class _Staging:
    """The trained members' checkpoint files (`CheckpointStore.stage`: tensors and ``state.json``, flushed to disk),
    written by a thread of their own while the main thread evaluates the units; what the evaluation gives, the report,
    is added afterwards (`_save`), and only then is a checkpoint published, named and its unit committed, as before.

    Each member's state is taken here, on the calling thread, right after its chunk, and copied to the CPU here
    (`on_cpu`: the thread does no device work, which would wait on the evaluation's queue or break its CUDA graph
    capture). The evaluation changes nothing in it (its weights are copies, its RNG states were taken at the chunk's
    last step, no optimizer steps until the next chunk: tests/training/test_gang.py::
    test_an_evaluation_changes_nothing_in_the_state_a_checkpoint_stores), so the files are those a save after the
    evaluation would write."""

    def __init__(self, store: CheckpointStore, trained: list[_Trained]) -> None:
        self._store = store
        self._results: dict[int, Staged | Exception] = {}
        states: list[tuple[int, TrialSnapshot]] = []
        for t in trained:
            try:
                states.append((t.live.number, on_cpu(t.live.runner.state())))  # no device work in the thread
            except Exception as exc:  # noqa: BLE001 - its state cannot be read: it fails alone, at its save
                self._results[t.live.number] = exc
        self._thread = threading.Thread(target=self._write, args=(states,), name="rfopt-checkpoint-staging",
                                        daemon=True)
        self._thread.start()

    def _write(self, states: list[tuple[int, TrialSnapshot]]) -> None:
        while states:
            number, state = states.pop(0)  # the snapshot's tensors are let go once written
            try:
                self._results[number] = self._store.stage(number, state)
            except Exception as exc:  # noqa: BLE001 - a full disk: this member's save fails alone, with the reason
                self._results[number] = exc

    def written(self) -> dict[int, Staged | Exception]:
        """Each member's staged checkpoint, or what kept it from being written; waits for the thread."""
        self._thread.join()
        return self._results

    def drop(self) -> None:
        """Wait for the thread and remove what it wrote (the units will not be saved)."""
        for entry in self.written().values():
            if isinstance(entry, Staged):
                self._store.discard(entry)


def _save(ctx: Context, reports: list[tuple[Live, Claim, UnitReport]], staged: dict[int, Staged | Exception],
          plan: schema.GangPlan | None) -> dict[int, Any]:
    """The units' checkpoints (staged while they were evaluated), each with its report, durably: a trial alone's as
    its latest (`CheckpointStore.save_staged`), a gang's all together or none (`CheckpointStore.save_gang`); a staged
    checkpoint whose unit has no report (its evaluation failed) is dropped. Each trial's location, or the exception
    that kept its checkpoint from being written (every member's, when the gang record could not be written)."""
    reported = {live.number for live, _, _ in reports}
    for number, entry in staged.items():
        if number not in reported and isinstance(entry, Staged):
            ctx.store.discard(entry)
    saved: dict[int, Any] = {live.number: staged[live.number] for live, _, _ in reports
                             if isinstance(staged[live.number], Exception)}
    ready = [(staged[live.number], report) for live, _, report in reports if live.number not in saved]
    if plan is None:
        for entry, report in ready:
            try:
                saved[entry.trial] = ctx.store.save_staged(entry, report)
            except Exception as exc:  # noqa: BLE001 - the disk, an object store: it fails alone
                saved[entry.trial] = exc
        return saved
    if not ready:
        return saved
    try:
        return saved | ctx.store.save_gang(ready, gang=f"{plan.id}-{reports[0][2].unit}")
    except Exception as exc:  # noqa: BLE001 - the gang record could not be written: the members fail, as alone
        return saved | {entry.trial: exc for entry, _ in ready}


# ---------------------------------------------------------------------- the end
def finish(ctx: Context, live: Live, claim: Claim) -> None:
    """Save the finished trial's adapter (or model) and tell Optuna COMPLETE with its last value."""
    number = live.number
    runner = live.runner
    if live.config.peft_config is not None:
        path = ctx.store.save_adapter(number, runner.model, adapter_name(number), runner.tokenizer)
    else:
        path = ctx.store.save_model(number, runner.model, runner.tokenizer)
    claim.fence_finish(number)
    schema.write_adapter(live.ref, str(path))
    reach("trial-finishing", trial=number, unit=live.committed - 1)
    ctx.study.tell(live.trial, live.last_value)
