"""The trials one run is working on, kept in step with storage: the one `reconcile`, and each trial's lifecycle.

Storage is the source of truth. `Roster.reconcile` answers one question, "what has this trial
committed, and how does it stand?", from the stored trial alone, the same way at start-up, after a
crash, and when a worker takes over a trial another worker trained:

- an end that was stored but not told to Optuna (a failure, a stop, a rung decision to prune; a
  crash came in between) is told now;
- a trial asked but not configured yet is left for `configure` (under the coordinator's asking lock);
- otherwise the trial is live here, at its committed progress (`TrialRecord.committed`): when that
  is not what the runner holds, the unit pipeline loads it before training (`unit.prepare`); its
  paused flag and stored rung decisions come from storage too.

The rest is the lifecycle: `ask` (new trials from the search space), `apply_requests` (pause, resume,
stop, applied at a chunk boundary by the process that holds the trial), `decide_rungs` (pruning once
every live trial reported a step), `work_on` (one unit, then finish), `fail` and `prune`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.chunks import trial_schedule
from rfopt.compat import trial_id_of
from rfopt.config.trial import TrialConfig
from rfopt.errors import PrunerFailed, StaleRead
from rfopt.pruning import PopulationBasedTraining, PrunerRungs, RungPolicy
from rfopt.reports.status import state_counts
from rfopt.storage import schema
from rfopt.storage.database import STORAGE_ERRORS
from rfopt.storage.leases import LeaseLost
from rfopt.storage.schema import TrialRecord, TrialRef, study_record
from rfopt.training.diversity import collapse_reason
from rfopt.training.evaluation import EvalPrompts
from rfopt.training.progress import ProgressPublisher, evaluation_progress
from rfopt.training.rollouts import Progress
from rfopt.training.runner import ChunkAborted

from rfopt.engine.outputs.artifacts import publish_note
from rfopt.engine.outputs.baselines import Baselines
from rfopt.engine.planning.plan import BATCHED, SEQUENTIAL, UnitPlan
from rfopt.engine.planning.scheduler import completed_rungs
from rfopt.engine.trials import ops
from rfopt.engine.trials.population import PopulationRungs

from . import interrupts, unit
from .unit import Claim, Context, Live

logger = logging.getLogger("rfopt")

COLLAPSE_GUARD = "rfopt's collapse guard (prune_collapsed)"
"""Who stops a trial whose completions collapsed, as its stop record names it."""


@dataclass(frozen=True)
class RunProgress:
    """Where a run stands, for a progress display: units and optimizer steps done and in all, trial states, the best
    value so far."""

    done: int
    total: int
    counts: dict[str, int]
    best: float | None
    last: tuple[int, int, float] | None
    """(trial, unit, value) of the last unit committed by this run."""
    steps_done: int = 0
    """Optimizer steps of the committed units (this run's and the live trials' earlier ones)."""
    steps_total: int = 0
    committed: dict[int, int] = field(default_factory=dict)
    """Units committed by each live trial (a unit in flight is the one after)."""


class Roster:
    """The live trials of one run (`live`, by trial number)."""

    def __init__(self, ctx: Context, space: Any, *, pruner: Any,
                 callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = (),
                 catch: tuple[type[Exception], ...] = (Exception,), prune_collapsed: bool = False) -> None:
        self.ctx = ctx
        self.callbacks = tuple(callbacks)
        """Called as ``callback(study, frozen_trial)`` after each trial this run ends, as Optuna calls them."""
        self.catch = catch
        """A trial's exceptions that fail it alone; another fails it and is raised on (`optuna.Study.optimize`)."""
        self.prune_collapsed = prune_collapsed
        """Whether a trial whose evaluated completions collapsed is pruned after that unit (`optimize`'s guard)."""
        self.study = ctx.study
        self.space = space
        self.rungs = _rung_policy(pruner, space, ctx)
        """How rungs are judged (`pruner`: the run's, `CheckedRun.pruner`): an Optuna pruner at rung boundaries, or
        population-based training."""
        self.baselines = Baselines(ctx.study, ctx.pool, ctx.eval_dataset, ctx.settings, ctx.objective)
        """The study's base models evaluated with no adapter, each once per study, before a trial on it trains."""
        self.live: dict[int, Live] = {}
        self.asked = 0
        """Trials this run asked Optuna for (clones not counted: they come on top)."""
        self._counts: dict[str, int] = {}
        self._ended_units: dict[int, int] = {}
        self._ended_steps: dict[int, int] = {}
        self._best: float | None = None
        self._last: tuple[int, int, float] | None = None
        self._maximize = self.study.direction == optuna.study.StudyDirection.MAXIMIZE
        self._prompt_tokens: int | None = None
        self._cloned = False
        self._said: set[str] = set()

    # ------------------------------------------------------------------ reconcile with storage
    def reconcile_all(self) -> list[TrialRecord]:
        """Read the study once and reconcile every RUNNING trial; drop live trials that ended elsewhere."""
        records = [TrialRecord(t) for t in self.study.get_trials(deepcopy=False)]
        self._counts = state_counts((r.trial for r in records), shown=False)
        running = {r.number: r for r in records if r.state == TrialState.RUNNING}
        for number in [n for n in self.live if n not in running]:
            # Another worker finished it (a normal hand-over), or a person failed it (optuna-dashboard's button).
            state = records[number].state if number < len(records) else None
            told = records[number].told_outside if state is not None else None
            log = logger.warning if state in (TrialState.FAIL, None) or told else logger.info
            log("trial %d %s; it trains no further here", number,
                told or f"became {state.name if state is not None else 'deleted'} outside this process")
            self._drop(number)
        for record in running.values():
            self.reconcile(record)
        return records

    def reconcile(self, record: TrialRecord) -> Live | None:
        """What has this trial committed, and how does it stand? Returns it live here, or None if it is not (ended,
        or not configured yet). A trial that cannot be resumed (its config no longer loads) fails, with the reason."""
        number = record.number
        if record.state != TrialState.RUNNING:
            self._drop(number)
            return None
        if self._settle(record):
            return None
        if record.config_json is None:
            return None
        live = self.live.get(number)
        try:
            if live is None:
                live = self._start(self._handle(record), TrialConfig.from_json(record.config_json), record, fresh=False)
        except STORAGE_ERRORS:  # the database failing is not the trial's failure: the run ends, the trial resumable
            raise
        except Exception as exc:  # noqa: BLE001 - a trial that cannot resume fails alone
            self.fail(number, f"could not resume: {type(exc).__name__}: {exc}")
            self._raise_uncaught(exc)
            return None
        live.refresh(record)  # another process may have moved it on, or this one crashed: then it loads again
        return live

    def _settle(self, record: TrialRecord) -> bool:
        """Tell Optuna an end that was stored on the trial but not told before a crash; True if the trial ended."""
        if record.fail_reason is not None:
            self.fail(record.number, record.fail_reason)
            return True
        if record.stop is not None or record.pruned_by_rung is not None:
            self._tell_pruned(record.number, "decided before the last crash")
            return True
        return False

    # ------------------------------------------------------------------ new trials
    def wants_to_ask(self, records: list[TrialRecord], max_concurrent: int, more_to_ask: Callable[[], bool]) -> bool:
        """Whether `configure` or `top_up` has anything to do, judged from the round's read of the study (so a worker
        takes the study's asking lock only when it will ask: not at every round while its slots are full)."""
        if any(r.state == TrialState.RUNNING and r.config_json is None for r in records):
            return True
        if self.active() >= max_concurrent:
            return False
        if self._cloned:  # population-based training enqueued clones after `records` were read: start them now
            return True
        return more_to_ask() or any(r.state == TrialState.WAITING and r.lineage is not None for r in records)

    def configure(self) -> None:
        """Give a config to trials a crash left asked but unconfigured (call while asking is allowed)."""
        for trial in self.study.get_trials(deepcopy=False, states=[TrialState.RUNNING]):
            record = TrialRecord(trial)
            if record.config_json is None:
                self._configure(self._handle(record))

    def top_up(self, max_concurrent: int, more_to_ask: Callable[[], bool]) -> None:
        """Ask new trials while fewer than `max_concurrent` are active (call while asking is allowed). A waiting clone
        is always asked; new trials from the space while `more_to_ask()`."""
        self._cloned = False
        while self.active() < max_concurrent and (more_to_ask() or self._waiting_clone()):
            trial = self.study.ask()
            if TrialRecord(trial).lineage is None:
                self.asked += 1
            self._configure(trial)

    def _configure(self, trial: optuna.Trial) -> None:
        try:
            config = self.space.config_for(trial)
            config.validate()
            schema.write_config(self._ref(trial), config.to_json())
            self._start(trial, config, None, fresh=True)
        except STORAGE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad config fails its trial, not the study
            self.fail(trial.number, f"{type(exc).__name__}: {exc}")
            self._raise_uncaught(exc)

    def _start(self, trial: optuna.Trial, config: TrialConfig, record: TrialRecord | None, *, fresh: bool) -> Live:
        """Make the trial live here. `fresh`: this process just configured it, so nothing of it can be in the
        checkpoint store yet; any other trial is checked against its checkpoint before it trains (`unit.prepare`)."""
        ref = self._ref(trial)
        record = record or ref.read()
        schedule = trial_schedule(self.ctx.plan, config.args)
        if record.schedule is None:
            schema.write_schedule(ref, schedule)
        lineage = record.lineage
        warm = lineage is not None and lineage.warm_start
        start_unit = record.start_unit
        live = Live(
            trial=trial, ref=ref, config=config, schedule=schedule,
            runner=unit.fresh_runner(self.ctx, trial.number, config, schedule, start_unit),
            start_unit=start_unit, warm_start=warm, warm_token=lineage.token if warm else "",
            committed=record.committed,
            # A new trial's fresh runner is its state; a resumed one, or a warm clone, is loaded before training.
            loaded=fresh and not warm,
            paused=record.paused, last_value=record.last_value,
            decided=frozenset(range(start_unit)) | record.decided_steps,  # a warm clone reports from its parent's step on
        )
        self.live[trial.number] = live
        return live

    def _waiting_clone(self) -> bool:
        return any(TrialRecord(t).lineage is not None
                   for t in self.study.get_trials(deepcopy=False, states=[TrialState.WAITING]))

    # ------------------------------------------------------------------ ops
    def apply_requests(self, live: Live, record: TrialRecord) -> None:
        """Apply the trial's pending pause/resume/stop requests (the caller holds the trial's claim)."""
        result = ops.apply_requests(live.ref, record, after_chunk=live.committed - 1, study=self.study)
        if result.stop is not None:
            self._tell_pruned(live.number, f"{schema.STOP_REASON} ({result.stop.by})")
        elif result.paused != live.paused:
            if result.paused:
                live.pause()  # its memory freed; it continues from its checkpoint
            else:
                live.resume()
            publish_note(live.trial)  # its optuna-dashboard note says paused (or no longer)

    # ------------------------------------------------------------------ rungs
    def _pending(self, step: int) -> list[Live]:
        # A trial that trained all its units is finished, not judged (another worker may be telling it so).
        return [live for live in self.live.values()
                if step not in live.decided and live.committed > step and not live.finished]

    def rungs_to_decide(self) -> bool:
        """Whether `decide_rungs` has anything to decide now."""
        complete = completed_rungs([live.candidate() for live in self.live.values()])
        return any(self._pending(step) for step in range(complete))

    def held_at_rungs(self) -> set[int]:
        """Live trials that reported a step whose rung decision they wait for (population-based training's exploit
        steps: a parent's latest checkpoint is the one its clones start from)."""
        n_steps = self._n_steps()
        return {live.number for live in self.live.values()
                if not live.finished and live.committed - 1 not in live.decided
                and self.rungs.holds(live.committed - 1, n_steps)}

    def decide_rungs(self) -> None:
        """Judge every rung that every live trial has reached (`rfopt.pruning.RungPolicy`); prune the trials it drops,
        and start the clones it made at once. Under a policy that makes clones, call it while asking is allowed."""
        complete = completed_rungs([live.candidate() for live in self.live.values()])
        if not complete:
            return
        n_steps = self._n_steps()
        for step in range(complete):
            pending = self._pending(step)
            if not pending:
                continue
            try:
                outcome = self.rungs.judge(self.study, step, [live.number for live in pending], n_steps)
            except StaleRead as exc:  # a peer ended elsewhere since the last read; the next round reads again
                logger.info("rung decision at step %d deferred: %s", step, exc)
                return
            except PrunerFailed as exc:  # the judged trial fails with the pruner's exception, as in Optuna
                self.fail(exc.trial_number, str(exc))
                self._raise_uncaught(exc.__cause__)
                return
            self._cloned = self._cloned or bool(outcome.clones)
            for decision in outcome.decisions:
                live = self.live.get(decision.trial_number)
                if live is None:
                    continue
                live.rung_decided(step)
                if decision.prune:
                    self._tell_pruned(live.number, decision.reason)

    def _n_steps(self) -> int:
        """Chunk units of the study's longest trial: the budget "auto" pruner settings are derived from."""
        units = [TrialRecord(t).num_units for t in self.study.get_trials(deepcopy=False)]
        return max((u for u in units if u is not None), default=self.ctx.plan.num_chunks)

    # ------------------------------------------------------------------ one unit
    def work_on(self, members: list[tuple[Live, Claim]], plan: UnitPlan | None = None) -> None:
        """Under each trial's claim (one, or a gang's): read them again, apply their requests, train the next unit of
        those still to train, together, as `plan` says (`unit.run_units`; None: a trial alone), and finish the ones
        that are done."""
        ready = [(live, claim) for live, claim in members if self._still_to_train(live)]
        if not ready:
            return
        if plan is not None:
            plan = plan.keeping(live.number for live, _ in ready)
        try:
            outcomes = unit.run_units(self.ctx, ready, plan)
        except unit.CallbackFailed as exc:  # every unit is committed; the members finish at the next round
            raise exc.__cause__ from None
        for live, claim in ready:
            self._after_unit(live, claim, outcomes.get(live.number))

    def _still_to_train(self, live: Live) -> bool:
        """Read the trial again and apply its requests: whether it is still live here, unpaused, to train a unit."""
        record = live.ref.read()
        if self.reconcile(record) is not live:
            return False
        if record.pending:
            self.apply_requests(live, record)
            if live.number not in self.live or live.paused:
                return False
        try:
            self.baselines.ensure(live.ref, live.config, record.baseline_key, announce=lambda: self._announce(live))
        except optuna.exceptions.UpdateFinishedTrialError:  # told finished outside rfopt while its baseline was evaluated
            told = TrialRecord(self.study.get_trials(deepcopy=False)[live.number]).told_outside
            logger.warning("trial %d %s; it trains no further here", live.number, told or "ended outside this process")
            self._drop(live.number)
            return False
        return True

    def _announce(self, live: Live) -> Progress:
        """Trial `live` waits for its base model's evaluation (the study's baseline): its progress says so, with the
        prompts done (the returned callback hears the decoding)."""
        publisher = ProgressPublisher(live.ref, unit=live.committed, num_units=live.schedule.num_units,
                                      steps=live.schedule.steps_per_chunk, listeners=self.ctx.step_listeners,
                                      interval=self.ctx.progress_seconds)
        publisher.baseline()
        return evaluation_progress([publisher])

    def _after_unit(self, live: Live, claim: Claim, error: BaseException | None) -> None:
        """After a unit: finish the trial if it trained its last one; if the unit failed, the trial is stale here
        (another process has it now) or fails alone, with the reason."""
        if isinstance(error, STORAGE_ERRORS):  # the database failing, not the trial: the run ends, every trial resumable
            raise error
        if error is None and self.prune_collapsed and self._guard(live):
            return
        finished = False
        if error is None and live.finished:
            try:
                unit.finish(self.ctx, live, claim)
                self._drop(live.number)
                finished = True
            except STORAGE_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - saving the adapter failed, or the claim was lost
                error = exc
        if error is None:
            if finished:
                self._ended(live.number)
            return
        if isinstance(error, (LeaseLost, ChunkAborted)):  # another worker has the trial now; what this one holds is stale
            logger.warning("%s", error)
            live.state_dropped()
            return
        if isinstance(error, optuna.exceptions.UpdateFinishedTrialError):  # told finished outside rfopt meanwhile
            told = TrialRecord(self.study.get_trials(deepcopy=False)[live.number]).told_outside
            logger.warning("trial %d was %s while it trained its chunk %d, which is not recorded; it trains no "
                           "further here", live.number, told or "ended outside this process", live.committed + 1)
            self._drop(live.number)
            return
        if interrupts.heard():  # a Ctrl-C came meanwhile, and may be what failed: the run stops, the trial resumable
            raise KeyboardInterrupt from error
        try:
            claim.fence_finish(live.number)
        except LeaseLost:
            live.state_dropped()
        else:
            self.fail(live.number, f"{type(error).__name__}: {error}")
            self._raise_uncaught(error)

    def _guard(self, live: Live) -> bool:
        """The opt-in collapse guard: prune the trial, with the reason stored as its stop (so that a crash before the
        tell is told at the next reconcile), if its last committed evaluation collapsed; whether it did."""
        record = live.ref.read()
        units = record.unit_metrics()
        baseline = study_record(self.study).baselines.get(record.baseline_key or "")
        reason = collapse_reason(units[-1].eval, None if baseline is None else baseline.metrics) if units else None
        if reason is None or units[-1].unit != live.committed - 1:
            return False
        schema.write_stop(live.ref, schema.Stop(by=COLLAPSE_GUARD, at=schema.now(), after_chunk=live.committed - 1,
                                                reason=f"collapsed: {reason}"))
        self._tell_pruned(live.number, f"collapsed: {reason}")
        return True

    # ------------------------------------------------------------------ ends
    def fail(self, number: int, reason: str) -> None:
        """End the trial FAIL with `reason` stored on it (before the tell: a finished trial's attrs are final)."""
        logger.warning("trial %d failed: %s", number, reason)
        live = self.live.get(number)
        try:
            schema.write_fail_reason(live.ref if live is not None else self._ref_by_number(number), reason)
            self.study.tell(live.trial if live is not None else number, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # it ended elsewhere meanwhile
            self._drop(number)
        else:
            self._drop(number)
            self._ended(number)

    def _raise_uncaught(self, exc: Exception) -> None:
        """Raise a trial's exception on (out of the run) unless `catch` says it fails the trial alone; call it in the
        `except` block, after the trial failed."""
        if not isinstance(exc, self.catch):
            raise exc

    def _tell_pruned(self, number: int, reason: str) -> None:
        try:
            self.study.tell(self.live[number].trial if number in self.live else number, state=TrialState.PRUNED)
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker carried out the same decision
            self._drop(number)
        else:
            logger.info("trial %d pruned: %s", number, reason)
            self._drop(number)
            self._ended(number)

    def _ended(self, number: int) -> None:
        """Its optuna-dashboard note says how it ended (written last while it still trained); then call the run's
        callbacks with the trial this process just ended, as Optuna calls them after a trial."""
        publish_note(optuna.trial.Trial(self.study, trial_id_of(self.study.get_trials(deepcopy=False)[number])))
        if self.callbacks:
            frozen = copy.deepcopy(self.study.get_trials(deepcopy=False)[number])
            for callback in self.callbacks:
                callback(self.study, frozen)

    def _drop(self, number: int) -> None:
        """It trains no further here: free what it holds; its units stay counted in this run's progress."""
        live = self.live.pop(number, None)
        if live is not None:
            self._ended_units[number] = live.committed - live.start_unit
            self._ended_steps[number] = (live.committed - live.start_unit) * live.schedule.steps_per_chunk
            live.runner.cleanup()

    # ------------------------------------------------------------------ what the driver asks
    def active(self) -> int:
        """Live trials that hold a slot: paused ones free theirs."""
        return sum(not live.paused for live in self.live.values())

    def fit_gang(self, picks: list[int], training: str) -> tuple[list[int], str]:
        """The first of `picks` (a gang's trial numbers) that fit in the device's memory, and how they train
        (`ModelPool.gang_room`): a gang planned to take a batched step (`training`, `UnitPlan.training`) that does not
        fit in memory but fits taking its members' steps one after another trains so, rather than smaller. Says once
        when a gang is made smaller, and once per run when it trains sequentially to fit."""
        if len(picks) <= 1:
            return picks, training
        configs = [self.live[n].config for n in picks]
        if self._prompt_tokens is None:
            tokenizer = self.ctx.pool.tokenizer(configs[0])
            sample = self.ctx.train_dataset.select(range(min(256, len(self.ctx.train_dataset))))
            self._prompt_tokens = max(map(len, EvalPrompts.of(sample, tokenizer).token_ids(tokenizer)), default=0)
        eval_rows = min(self.ctx.settings.batch_size, len(self.ctx.eval_dataset or ()))  # one evaluation decode's
        room = self.ctx.pool.gang_room(configs, self._prompt_tokens, eval_rows=eval_rows,
                                       batched=training != SEQUENTIAL)
        said = "sequentially to fit" if room.fallback else room.message  # the fallback's figures vary: said once
        if room.message is not None and said not in self._said:
            self._said.add(said)
            logger.warning("%s", room.message)
        return picks[:room.size], training if room.batched or training == SEQUENTIAL else SEQUENTIAL

    def rollout_refusal(self, live: Live) -> str | None:
        """Why the batched backend of `live`'s base model refuses it (`RolloutBackend.refusal`): the planner's gate
        (`rfopt.engine.planning.plan.Planner`)."""
        return live.runner.rollout_backend(BATCHED).refusal(live.config)

    def resident_models(self) -> set[str]:
        return {live.config.model_key for live in self.live.values() if self.ctx.pool.has_base(live.config)}

    def progress(self) -> RunProgress:
        live_done = sum(live.committed - live.start_unit for live in self.live.values())
        remaining = sum(max(0, live.schedule.num_units - live.committed) for live in self.live.values())
        done = live_done + sum(self._ended_units.values())
        steps_done = sum(self._ended_steps.values()) + sum(
            (live.committed - live.start_unit) * live.schedule.steps_per_chunk for live in self.live.values())
        steps_left = sum(max(0, live.schedule.num_units - live.committed) * live.schedule.steps_per_chunk
                         for live in self.live.values())
        return RunProgress(done=done, total=done + remaining, counts=dict(self._counts), best=self._best, last=self._last,
                        steps_done=steps_done, steps_total=steps_done + steps_left,
                        committed={n: live.committed for n, live in self.live.items()})

    def on_commit(self, event: unit.UnitCommitted) -> None:
        self._last = (event.trial.number, event.unit, event.value)
        if self._best is None or (event.value > self._best if self._maximize else event.value < self._best):
            self._best = event.value

    # ------------------------------------------------------------------ handles
    def _handle(self, record: TrialRecord) -> optuna.Trial:
        """An `optuna.Trial` for a RUNNING trial this process did not ask (resumed, or trained by another worker)."""
        return optuna.trial.Trial(self.study, trial_id_of(record.trial))

    def _ref(self, trial: optuna.Trial) -> TrialRef:
        return TrialRef.of(self.study, trial)

    def _ref_by_number(self, number: int) -> TrialRef:
        frozen = self.study.get_trials(deepcopy=False)[number]
        return TrialRef.of(self.study, frozen)


def _rung_policy(pruner: Any, space: Any, ctx: Context) -> RungPolicy:
    """The rung policy of a study whose pruner is `pruner`: population-based training carried out on the study
    (`rfopt.engine.trials.population`), or an Optuna pruner at rung boundaries."""
    if isinstance(pruner, PopulationBasedTraining):
        return PopulationRungs(pruner, space, ctx.plan, ctx.store)
    return PrunerRungs(pruner)
