"""The study API: `create_study`, `load_study`, and `Study.optimize`, which runs trials round-robin.

    >>> study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db")   # doctest: +SKIP
    >>> study.optimize(space, train_dataset, eval_dataset, n_trials=8, num_chunks=4)  # doctest: +SKIP
    >>> print(study.leaderboard_text())                                               # doctest: +SKIP
    >>> study.optuna   # the real optuna.Study: visualization, optuna-dashboard and Optuna's CLI all work

Each trial is an Optuna trial. `optimize` keeps up to `max_concurrent` trials live on the device and
trains them one chunk unit at a time, least progress first (scheduler.py). After each unit the
trial is evaluated, its checkpoint is written durably, then its metrics and its value are committed
to storage (``trial.report(value, step=unit)``). When every live trial has reported a step, the
study's pruner decides at that rung (pruning/). A finished trial saves its adapter in PEFT format
and is told its last value; a pruned one ends PRUNED; a trial whose config, reward function or
training fails ends FAIL with the reason in its ``rfopt:fail_reason`` user attr, and the study goes
on. Rerunning `optimize` on the same study continues its RUNNING trials from their checkpoints.

`Study.work` runs the same units as one of several workers (processes, devices, hosts) sharing the
study: each unit under a lease on its trial kept in the study's database (`rfopt.leases`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState as OptunaState

from .checkpoints import (CheckpointError, CheckpointStore, Location, UnitReport, download, is_url, location_exists,
                          normalize_location)
from .chunks import ChunkPlan, PlanError, TrialSchedule, dataset_fingerprint, trial_schedule
from .config import ConfigError, TrialConfig
from .crashpoints import reach
from .evaluation import EvalSettings
from .models import ModelPool, adapter_name
from .ops import CLONE_ATTR, PAUSED_ATTR, STOP_REASON, Request, read_request, record_applied
from .pruning import decide, decision_key, load_decision
from .runner import TrialRunner
from .scheduler import LiveTrial, completed_rungs, next_trial
from .spaces import CONFIG_ATTR, LIST_INDEX_ATTR, ListSpace, as_space
from .storage import backend, open_storage

logger = logging.getLogger("rfopt")

PLAN_ATTR = "rfopt:plan"
OBJECTIVE_ATTR = "rfopt:objective"
TRAIN_FINGERPRINT_ATTR = "rfopt:train_fingerprint"
EVAL_ATTR = "rfopt:eval"
CHECKPOINT_DIR_ATTR = "rfopt:checkpoint_dir"
SCHEDULE_ATTR = "rfopt:schedule"
FAIL_REASON_ATTR = "rfopt:fail_reason"
ADAPTER_ATTR = "rfopt:adapter"
METRICS_ATTR = "rfopt:metrics"
SAMPLES_ATTR = "rfopt:samples"
STOPPED_ATTR = "rfopt:stopped"
ASK_LEASE = "ask"
"""The lease a worker holds while it plans the study, enqueues configs or asks trials: one at a time."""


def chunk_attr(prefix: str, unit: int) -> str:
    return f"{prefix}:{unit:04d}"


@dataclass
class LeaderboardRow:
    number: int
    state: str
    value: float | None
    chunks_done: int
    params: dict[str, Any]
    adapter: str | None = None
    reason: str | None = None


@dataclass
class _Live:
    trial: optuna.Trial
    config: TrialConfig
    runner: TrialRunner
    schedule: TrialSchedule
    info: LiveTrial
    last_value: float | None = None
    decided: set[int] = field(default_factory=set)
    needs_load: bool = False
    """Its state must be loaded before its next chunk: from its checkpoint, or a clone's warm-start weights."""


class Study:
    """An rfopt study: an `optuna.Study` plus rfopt's chunk plan, objective and checkpoint store."""

    def __init__(self, optuna_study: optuna.Study, checkpoint_dir: str | os.PathLike | None = None) -> None:
        self.optuna = optuna_study
        stored = optuna_study.user_attrs.get(CHECKPOINT_DIR_ATTR)
        if checkpoint_dir is None:
            checkpoint_dir = stored or _default_checkpoint_dir(optuna_study)
        checkpoint_dir = normalize_location(checkpoint_dir)  # an absolute path, or a URL as given
        if stored != checkpoint_dir:
            optuna_study.set_user_attr(CHECKPOINT_DIR_ATTR, checkpoint_dir)
        self.checkpoints = CheckpointStore(checkpoint_dir)

    @property
    def study_name(self) -> str:
        return self.optuna.study_name

    # ------------------------------------------------------------------ the main loop
    def optimize(
        self,
        space: Any,
        train_dataset: Any,
        eval_dataset: Any,
        *,
        n_trials: int | None = None,
        num_chunks: int = 4,
        max_concurrent: int | None = None,
        objective: str = "reward",
        eval_settings: EvalSettings | None = None,
        device: str = "cpu",
        chunk_seed: int = 0,
        show_progress_bar: bool = True,
        on_unit: Callable[[int, int, float], None] | None = None,
    ) -> None:
        """Train the space's trials round-robin, chunk by chunk, reporting each chunk's evaluation to Optuna.

        Args:
            space: a function ``trial -> TrialConfig``, a list of `TrialConfig`, or `rfopt.grid(...)`.
            train_dataset, eval_dataset: `datasets.Dataset` with a ``prompt`` column (plus any columns the
                reward functions read, e.g. ``answer``).
            n_trials: trials to run in this call (default: the length of a list space; required for a function).
            num_chunks: chunks the training set is split into (fixed for the study once chosen).
            max_concurrent: live trials time-sliced at once (default: ``min(n_trials, 8)``).
            objective: ``"reward"`` (mean weighted total reward on the eval set) or a reward function's name.
            eval_settings: generation settings of the per-chunk evaluation (greedy by default).
            device: ``"cpu"`` or ``"cuda"`` / ``"cuda:1"``.
            on_unit: called after each committed unit with ``(trial_number, step, value)``.
        """
        pool = ModelPool(device)  # checks the device before anything is written
        self.checkpoints.check_writable()
        space, plan, settings, n_trials, max_concurrent = self._prepare(
            space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective, eval_settings,
            chunk_seed,
        )
        run = _Run(self, space, plan, train_dataset, eval_dataset, objective, settings, pool, on_unit)
        try:
            run.resume_running()
            run.loop(n_trials, max_concurrent, show_progress_bar)
        finally:
            run.pool.close()

    def work(
        self,
        space: Any,
        train_dataset: Any,
        eval_dataset: Any,
        *,
        n_trials: int | None = None,
        num_chunks: int = 4,
        max_concurrent: int | None = None,
        objective: str = "reward",
        eval_settings: EvalSettings | None = None,
        device: str = "cpu",
        chunk_seed: int = 0,
        lease_seconds: float = 30.0,
        poll_seconds: float = 1.0,
        on_unit: Callable[[int, int, float], None] | None = None,
    ) -> None:
        """Join the study as one worker beside others (processes, devices or hosts sharing its storage).

        Takes the same arguments as `optimize`, with two differences: `n_trials` is the study's total (with a
        function space; a list space runs its configs), and every unit is trained under a lease on its trial
        (`rfopt.leases`): renewed while it trains, and checked in the transaction that commits the unit, so a
        worker whose lease expired cannot commit. A unit whose worker died is trained by another once the lease
        expires (`lease_seconds`). Returns when no trial is left to train (paused trials wait for a resume).

            >>> study.work(space, train, test, n_trials=16, num_chunks=4, device="cuda:1")   # doctest: +SKIP
        """
        from .leases import Leases

        if lease_seconds <= 0 or poll_seconds <= 0:
            raise ValueError(f"lease_seconds and poll_seconds must be > 0, got {lease_seconds} and {poll_seconds}")
        space = as_space(space)
        pool = ModelPool(device)  # checks the device before anything is written
        self.checkpoints.check_writable()
        if max_concurrent is None and isinstance(space, ListSpace):  # the same for every worker, however late
            max_concurrent = max(1, min(len(space.configs), 8))
        leases = Leases(self.optuna)
        with leases.holding(ASK_LEASE, lease_seconds):  # one worker at a time plans the study and enqueues configs
            space, plan, settings, n_trials, max_concurrent = self._prepare(
                space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective, eval_settings,
                chunk_seed,
            )
        run = _Run(self, space, plan, train_dataset, eval_dataset, objective, settings, pool, on_unit)
        try:
            run.work_loop(n_trials, max_concurrent, leases, lease_seconds, poll_seconds)
        finally:
            run.pool.close()

    def _prepare(self, space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective,
                 eval_settings, chunk_seed):
        """Check the arguments of `optimize`/`work` against each other and the study; plan it; enqueue a list."""
        space = as_space(space)
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        if len(eval_dataset) == 0:
            raise ValueError("eval_dataset is empty; evaluation after each chunk needs at least one prompt")
        settings = eval_settings or EvalSettings()
        plan = self._plan(train_dataset, num_chunks, chunk_seed)
        self._check_study_attrs(objective, settings, train_dataset)
        if isinstance(space, ListSpace):
            for i, config in enumerate(space.configs):  # refuse a bad list before training anything
                try:
                    config.validate()
                    trial_schedule(plan, config.resolved_grpo())
                    config.to_json()
                except (ConfigError, PlanError) as exc:
                    raise type(exc)(f"configs[{i}]: {exc}") from exc
            space.enqueue_missing(self.optuna)
            if n_trials is None:  # the configs not run yet (all of them, the first time)
                n_trials = _waiting_listed(self.optuna)
        elif n_trials is None:
            raise ValueError("n_trials is required when the search space is a function")
        if n_trials < 0:
            raise ValueError(f"n_trials must be >= 0, got {n_trials}")
        if max_concurrent is None:
            max_concurrent = max(1, min(n_trials, 8))
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        return space, plan, settings, n_trials, max_concurrent

    # ------------------------------------------------------------------ ops
    def pause(self, trial_number: int) -> None:
        """Pause a running trial at its next chunk boundary (it stays RUNNING in Optuna, unscheduled)."""
        from .ops import request

        request(self.optuna, trial_number, "pause")

    def resume(self, trial_number: int) -> None:
        """Resume a paused trial; it continues exactly where it was."""
        from .ops import request

        request(self.optuna, trial_number, "resume")

    def stop(self, trial_number: int) -> None:
        """Stop a running trial at its next chunk boundary: it ends PRUNED with its last value."""
        from .ops import request

        request(self.optuna, trial_number, "stop")

    def clone(self, trial_number: int, overrides: dict[str, Any] | None = None, *, warm_start: bool = False) -> int:
        """Enqueue a copy of a trial with `overrides` (validated first); returns the clone's trial number.

        With `warm_start` the clone starts from the parent's latest checkpoint (weights; a fresh LR schedule over
        the remaining steps) and reports at the parent's step numbers onward. A running `optimize` picks it up
        when a slot frees; otherwise the next `optimize` call does.
        """
        from .ops import OpError, clone

        stored = self.optuna.user_attrs.get(PLAN_ATTR)
        if stored is None:
            raise OpError(f"study {self.study_name!r} has no chunk plan yet; run it before cloning trials")
        return clone(
            self.optuna,
            trial_number,
            overrides or {},
            warm_start=warm_start,
            plan=ChunkPlan.from_dict(stored),
            checkpoints=self.checkpoints,
        )

    # ------------------------------------------------------------------ results
    def leaderboard(self) -> list[LeaderboardRow]:
        """Every trial, best first: finished trials by value, then the rest by progress."""
        sign = 1 if self.optuna.direction == optuna.study.StudyDirection.MAXIMIZE else -1
        rows = []
        for t in self.optuna.get_trials(deepcopy=False):
            if t.state == OptunaState.WAITING:
                continue
            value = t.value if t.state == OptunaState.COMPLETE else _last_value(t)
            reason = t.user_attrs.get(FAIL_REASON_ATTR) or _prune_reason(t)
            rows.append(
                LeaderboardRow(
                    number=t.number,
                    state=t.state.name,
                    value=value,
                    chunks_done=len(t.intermediate_values),
                    params=dict(t.params),
                    adapter=t.user_attrs.get(ADAPTER_ATTR),
                    reason=reason,
                )
            )
        order = {"COMPLETE": 0, "RUNNING": 1, "PRUNED": 2, "FAIL": 3}
        rows.sort(
            key=lambda r: (
                order.get(r.state, 4),
                -sign * r.value if r.value is not None and math.isfinite(r.value) else math.inf,
                -r.chunks_done,
                r.number,
            )
        )
        return rows

    def leaderboard_text(self) -> str:
        from .display import format_leaderboard

        return format_leaderboard(self.leaderboard(), self.optuna.user_attrs.get(OBJECTIVE_ATTR, "reward"))

    def best_adapter(self) -> Location:
        """Directory of the best finished trial's adapter (PEFT format): a `Path`, or a URL in an object store."""
        complete = [t for t in self.optuna.get_trials(deepcopy=False, states=[OptunaState.COMPLETE])]
        if not complete:
            raise LookupError(f"study {self.study_name!r} has no finished trial yet")
        best = self.optuna.best_trial
        path = best.user_attrs.get(ADAPTER_ATTR)
        if path is None or not location_exists(path):
            raise LookupError(f"trial {best.number}: its adapter is not in the checkpoint store ({path})")
        return path if is_url(path) else Path(path)

    def export_best(self, path: str | os.PathLike) -> Path:
        """Copy the best trial's adapter (PEFT format, with its tokenizer) to the local directory `path`, downloading
        it from an object store if the study's checkpoints are there."""
        source = self.best_adapter()
        target = Path(path)
        if target.exists():
            shutil.rmtree(target)
        return download(source, target)

    def trial_config(self, number: int) -> TrialConfig:
        trial = self.optuna.trials[number]
        if CONFIG_ATTR not in trial.user_attrs:
            raise LookupError(f"trial {number} has no rfopt config")
        return TrialConfig.from_json(trial.user_attrs[CONFIG_ATTR])

    def chunk_metrics(self, number: int) -> list[dict[str, Any]]:
        """Per-chunk training and eval metrics stored on trial `number`, in chunk order."""
        attrs = self.optuna.trials[number].user_attrs
        keys = sorted(k for k in attrs if k.startswith(METRICS_ATTR + ":"))
        return [attrs[k] for k in keys]

    # ------------------------------------------------------------------ study attrs
    def _plan(self, train_dataset: Any, num_chunks: int, seed: int) -> ChunkPlan:
        stored = self.optuna.user_attrs.get(PLAN_ATTR)
        if stored is not None:
            if stored["num_chunks"] != num_chunks or stored["num_rows"] != len(train_dataset) or stored["seed"] != seed:
                raise PlanError(
                    f"study {self.study_name!r} was planned with {stored}; this call asks for "
                    f"num_chunks={num_chunks}, {len(train_dataset)} rows, chunk_seed={seed}. "
                    "Use the same values to continue it, or a new study name"
                )
            return ChunkPlan.from_dict(stored)
        plan = ChunkPlan.build(len(train_dataset), num_chunks, seed)
        self.optuna.set_user_attr(PLAN_ATTR, plan.to_dict())
        return plan

    def _check_study_attrs(self, objective: str, settings: EvalSettings, train_dataset: Any) -> None:
        wanted = {
            OBJECTIVE_ATTR: objective,
            EVAL_ATTR: asdict(settings),
            TRAIN_FINGERPRINT_ATTR: dataset_fingerprint(train_dataset),
        }
        attrs = self.optuna.user_attrs
        for key, value in wanted.items():
            if key in attrs and attrs[key] != value:
                raise ValueError(
                    f"study {self.study_name!r} was run with {key}={attrs[key]!r}, this call gives {value!r}; "
                    "trials would not be comparable. Use the same value, or a new study name"
                )
        for key, value in wanted.items():
            if key not in attrs:
                self.optuna.set_user_attr(key, value)


class _Run:
    """One call of `Study.optimize`: live trials, the model pool, and the round-robin loop."""

    def __init__(self, study, space, plan, train_dataset, eval_dataset, objective, settings, pool, on_unit):
        self.study = study
        self.optuna: optuna.Study = study.optuna
        self.space = space
        self.plan = plan
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.objective = objective
        self.settings = settings
        self.pool = pool
        self.workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
        self.live: dict[int, _Live] = {}
        self.on_unit = on_unit
        self.started = 0
        self.progress = None
        self.fence: Callable[[int, int | None], None] | None = None
        """Called with ``(trial_number, unit)`` before a unit's checkpoint is written (``unit`` None) and before its
        report is written; raises if this worker may not (its lease expired or was taken over)."""

    # ------------------------------------------------------------------ trial lifecycle
    def resume_running(self) -> None:
        """Take over RUNNING trials of this study (left by a stopped or crashed process) from their checkpoints.

        A trial continues from its last committed unit. What a crash left half-done is finished first: a unit
        whose checkpoint is durable but whose report is not in storage is committed from the checkpoint; a
        trial whose failure, stop or pruning was stored but not yet told to Optuna is told now.
        """
        for frozen in self.optuna.get_trials(deepcopy=False, states=[OptunaState.RUNNING]):
            trial = optuna.trial.Trial(self.optuna, frozen._trial_id)
            try:
                if self._settle(trial, frozen):
                    continue
                config = self._config_of(trial, frozen)
                live = self._start(trial, config)
                state = self.study.checkpoints.load(trial.number)
                reported = len(frozen.intermediate_values)
                if state is not None:
                    live.runner.load_state(state)
                    live.info.units_done = state.units_done
                    live.needs_load = False
                live.info.paused = bool(frozen.user_attrs.get(PAUSED_ATTR))
                if live.info.units_done < reported and not live.runner.start_unit:
                    where = self.study.checkpoints.trial_dir(trial.number)
                    held = "no checkpoint" if state is None else f"a checkpoint of {live.info.units_done} chunks"
                    raise CheckpointError(
                        f"trial {trial.number}: {reported} chunks were committed but {where} holds {held}; "
                        "its state is lost, clone it to train the config again"
                    )
                if reported:
                    live.last_value = frozen.intermediate_values[max(frozen.intermediate_values)]
                live.decided |= {s for s in frozen.intermediate_values if decision_key(s) in frozen.user_attrs}
                if live.info.units_done > reported:  # checkpoint durable, report not committed
                    self._commit_from_checkpoint(live)
                logger.info("trial %d: resumed at chunk %d", trial.number, live.info.units_done)
                if live.info.finished:  # stopped between its last report and being told
                    self._finish(live)
            except Exception as exc:  # noqa: BLE001 - a trial that cannot resume fails alone
                self._fail(trial, f"could not resume: {type(exc).__name__}: {exc}")

    def _settle(self, trial: optuna.Trial, frozen: optuna.trial.FrozenTrial) -> bool:
        """Tell Optuna an end that was stored on the trial but not told before a crash; True if the trial ended."""
        if FAIL_REASON_ATTR in frozen.user_attrs:
            self._fail(trial, frozen.user_attrs[FAIL_REASON_ATTR])
            return True
        pruned = STOPPED_ATTR in frozen.user_attrs or any(
            (d := load_decision(frozen, step)) is not None and d.prune for step in frozen.intermediate_values
        )
        if pruned:
            self.optuna.tell(trial, state=OptunaState.PRUNED)
            logger.info("trial %d: pruned (decided before the last crash)", trial.number)
            return True
        return False

    def _config_of(self, trial: optuna.Trial, frozen: optuna.trial.FrozenTrial) -> TrialConfig:
        """The trial's stored config; a trial asked just before a crash gets it from the space, as `_ask` would."""
        if CONFIG_ATTR in frozen.user_attrs:
            return TrialConfig.from_json(frozen.user_attrs[CONFIG_ATTR])
        config = self.space.config_for(trial)
        config.validate()
        trial.set_user_attr(CONFIG_ATTR, config.to_json())
        return config

    def _ask(self) -> _Live | None:
        trial = self.optuna.ask()
        if CLONE_ATTR not in trial.user_attrs:  # clones come on top of n_trials
            self.started += 1
        try:
            config = self.space.config_for(trial)
            config.validate()
            trial.set_user_attr(CONFIG_ATTR, config.to_json())
            return self._start(trial, config)
        except Exception as exc:  # noqa: BLE001 - a bad config fails its trial, not the study
            self._fail(trial, f"{type(exc).__name__}: {exc}")
            return None

    def _start(self, trial: optuna.Trial, config: TrialConfig) -> _Live:
        schedule = trial_schedule(self.plan, config.resolved_grpo())
        if SCHEDULE_ATTR not in trial.user_attrs:
            trial.set_user_attr(SCHEDULE_ATTR, schedule.to_dict())
        lineage = trial.user_attrs.get(CLONE_ATTR) or {}
        start_unit = int(lineage.get("start_unit", 0))
        runner = self._runner(trial.number, config, schedule, start_unit)
        info = LiveTrial(trial.number, start_unit, schedule.num_units, config.model_key)
        live = _Live(
            trial=trial, config=config, runner=runner, schedule=schedule, info=info,
            needs_load=bool(lineage.get("warm_start")),
            decided=set(range(start_unit)),  # a warm clone reports from its parent's step onward
        )
        self.live[trial.number] = live
        return live

    def _runner(self, number: int, config: TrialConfig, schedule: TrialSchedule, start_unit: int) -> TrialRunner:
        return TrialRunner(number, config, self.plan, schedule, self.train_dataset, self.pool, self.workdir, start_unit)

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        logger.warning("trial %d failed: %s", trial.number, reason)
        live = self.live.pop(trial.number, None)
        try:
            trial.set_user_attr(FAIL_REASON_ATTR, reason[:2000])
            self.optuna.tell(trial, state=OptunaState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass
        if live is not None:
            live.runner.cleanup()

    def _finish(self, live: _Live) -> None:
        number = live.trial.number
        runner = live.runner
        if live.config.peft is not None:
            path = self.study.checkpoints.save_adapter(number, runner.model, adapter_name(number), runner.tokenizer)
        else:
            path = self.study.checkpoints.save_model(number, runner.model, runner.tokenizer)
        live.trial.set_user_attr(ADAPTER_ATTR, str(path))
        reach("trial-finishing", trial=number, unit=live.info.units_done - 1)
        self.optuna.tell(live.trial, live.last_value)
        self.live.pop(number)
        runner.cleanup()

    def _prune(self, live: _Live, reason: str) -> None:
        try:
            self.optuna.tell(live.trial, state=OptunaState.PRUNED)
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker carried out the same decision
            pass
        self.live.pop(live.trial.number, None)
        live.runner.cleanup()
        logger.info("trial %d pruned: %s", live.trial.number, reason)

    # ------------------------------------------------------------------ units
    def _evaluate(self, live: _Live) -> tuple[float, dict[str, Any]]:
        result = live.runner.evaluate(self.eval_dataset, self.settings)
        value = result.objective(self.objective)
        if not math.isfinite(value):
            raise ValueError(
                f"objective {self.objective!r} is {value} on the eval set (every reward was None/NaN?); "
                "check the reward functions"
            )
        return value, {"eval": result.metrics, "samples": result.samples}

    def _commit(self, live: _Live, report: UnitReport) -> None:
        """Put a unit's metrics and value in storage; the unit counts as done once its value is reported."""
        trial = live.trial
        if self.fence is not None:
            self.fence(trial.number, report.unit)
        trial.set_user_attr(chunk_attr(METRICS_ATTR, report.unit), report.metrics)
        trial.set_user_attr(chunk_attr(SAMPLES_ATTR, report.unit), report.samples)
        reach("metrics-stored", trial=trial.number, unit=report.unit)
        trial.report(report.value, step=report.unit)
        reach("unit-committed", trial=trial.number, unit=report.unit)
        live.last_value = report.value
        from .dashboard import publish_chunk  # lazy: rfopt.dashboard imports this module

        publish_chunk(trial)

    def _commit_from_checkpoint(self, live: _Live) -> None:
        """Commit the unit a crash left with a durable checkpoint and no report, as it would have been committed."""
        unit = live.info.units_done - 1
        report = self.study.checkpoints.load_report(live.trial.number)
        if report is None or report.unit != unit:  # a checkpoint written without its report: evaluate again
            value, extra = self._evaluate(live)
            metrics = {"chunk": live.schedule.chunk_of_unit(unit), "eval": extra["eval"]}
            report = UnitReport(unit=unit, value=value, metrics=_finite(metrics), samples=_finite(extra["samples"]))
        self._commit(live, report)

    def _load(self, live: _Live) -> None:
        """Bring a trial's state back after a pause, or give a warm-started clone its parent's weights."""
        state = self.study.checkpoints.load(live.trial.number)
        if state is None and live.runner.units_done != live.runner.start_unit:
            # Trained here but never committed (a worker whose lease was taken over): start the trial afresh.
            live.runner.cleanup()
            live.runner = self._runner(live.trial.number, live.config, live.schedule, live.runner.start_unit)
        if state is not None:
            live.runner.load_state(state)
        elif live.info.units_done > live.runner.start_unit:
            raise CheckpointError(
                f"trial {live.trial.number}: {live.info.units_done} chunks were committed but its checkpoint in "
                f"{self.study.checkpoints.trial_dir(live.trial.number)} is missing; its state is lost"
            )
        elif (live.trial.user_attrs.get(CLONE_ATTR) or {}).get("warm_start"):
            live.runner.load_weights(self.study.checkpoints.load_warm_start(live.trial.number))
        live.needs_load = False

    def _run_unit(self, live: _Live) -> None:
        """Train, evaluate, checkpoint durably (with the unit's report), then commit the report to storage."""
        if live.needs_load:
            self._load(live)
        number, unit = live.trial.number, live.info.units_done
        reach("unit-started", trial=number, unit=unit)
        started = time.perf_counter()
        chunk = live.runner.train_chunk()
        reach("chunk-trained", trial=number, unit=unit)
        value, extra = self._evaluate(live)
        train = dict(chunk.values) | {"seconds": time.perf_counter() - started, "swap_seconds": chunk.swap_seconds}
        metrics = {"chunk": live.schedule.chunk_of_unit(unit), "eval": extra["eval"], "train": train}
        report = UnitReport(unit=unit, value=value, metrics=_finite(metrics), samples=_finite(extra["samples"]))
        if self.fence is not None:
            self.fence(number, None)
        self.study.checkpoints.save(number, live.runner.state(), report)
        reach("checkpoint-saved", trial=number, unit=unit)
        self._commit(live, report)
        live.info.units_done = unit + 1
        if self.on_unit is not None:
            self.on_unit(number, unit, value)

    # ------------------------------------------------------------------ ops
    def _apply_ops(self) -> None:
        """Apply pending pause/resume/stop requests at this chunk boundary; drop trials finished elsewhere."""
        if not self.live:
            return
        frozen = {t.number: t for t in self.optuna.get_trials(deepcopy=False)}
        for number, live in list(self.live.items()):
            trial = frozen[number]
            if trial.state != OptunaState.RUNNING:  # e.g. "Fail trial" in optuna-dashboard
                logger.warning("trial %d became %s outside rfopt; it trains no further", number, trial.state.name)
                self.live.pop(number)
                live.runner.cleanup()
                if self.progress is not None:
                    self.progress.skip_units(live.schedule.num_units - live.info.units_done)
                continue
            req = read_request(trial)
            if req is not None:
                self._apply(live, req)

    def _apply(self, live: _Live, req: Request) -> None:
        number = live.trial.number
        if req.op == "stop":
            last = live.info.units_done - 1
            live.trial.set_user_attr(STOPPED_ATTR, {"reason": STOP_REASON, "by": req.by, "at": req.at, "after_chunk": last})
            record_applied(live.trial, req)
            if self.progress is not None:
                self.progress.skip_units(live.schedule.num_units - live.info.units_done)
            self._prune(live, f"{STOP_REASON} ({req.by})")
            return
        paused = req.op == "pause"
        if paused != live.info.paused:
            live.info.paused = paused
            live.trial.set_user_attr(PAUSED_ATTR, paused)
            if paused:  # free its memory; it continues from its checkpoint
                live.runner.cleanup()
                live.needs_load = True
        record_applied(live.trial, req)
        logger.info("trial %d %s by %s", number, "paused" if paused else "resumed", req.by)

    # ------------------------------------------------------------------ rungs
    def _decide_rungs(self) -> None:
        pruner = self.optuna.pruner
        infos = [l.info for l in self.live.values()]
        complete = completed_rungs(infos)
        n_steps = self._n_steps()
        for step in range(complete):
            # A trial that trained all its units is finished, not judged (another worker may be telling it so).
            pending = [l for l in self.live.values()
                       if step not in l.decided and l.info.units_done > step and not l.info.finished]
            if not pending:
                continue
            decisions = decide(self.optuna, [l.trial.number for l in pending], step, pruner, n_steps=n_steps)
            for decision in decisions:
                live = self.live.get(decision.trial_number)
                if live is None:
                    continue
                live.decided.add(step)
                if decision.prune:
                    self._prune(live, decision.reason)

    # ------------------------------------------------------------------ loop
    def loop(self, n_trials: int, max_concurrent: int, show_progress_bar: bool) -> None:
        from .display import Progress

        total_units = sum(l.schedule.num_units - l.info.units_done for l in self.live.values())
        # Inside this loop `study.stop()` works as in `optuna.Study.optimize` (GridSampler calls it when its grid is
        # done): no new trial is asked, the live ones finish.
        self.optuna._thread_local.in_optimize_loop = True
        self.optuna._stop_flag = False
        with Progress(self.optuna.study_name, enabled=show_progress_bar) as progress:
            self.progress = progress
            progress.add_units(total_units)
            try:
                while True:
                    self._apply_ops()
                    while self._active() < max_concurrent and (
                        (self.started < n_trials and not self.optuna._stop_flag) or self._waiting_clone()
                    ):
                        live = self._ask()
                        if live is not None:
                            progress.add_units(live.schedule.num_units)
                    pick = next_trial([l.info for l in self.live.values()], self.pool_keys())
                    if pick is None:
                        paused = sorted(n for n, l in self.live.items() if l.info.paused)
                        if paused:
                            logger.warning(
                                "nothing left to run but paused trials %s; resume them and run the study again", paused
                            )
                        break
                    live = self.live[pick.number]
                    try:
                        self._run_unit(live)
                    except Exception as exc:  # noqa: BLE001 - the trial fails alone, with its reason stored
                        progress.skip_units(live.schedule.num_units - live.info.units_done)
                        self._fail(live.trial, f"{type(exc).__name__}: {exc}")
                        continue
                    progress.unit_done(live.trial.number, live.info.units_done - 1, live.last_value)
                    if live.info.finished:
                        self._finish(live)
                    before = set(self.live)
                    self._decide_rungs()
                    for number in before - set(self.live):
                        progress.skip_units(self._remaining_of(number))
                    progress.set_counts(self._counts())
            finally:
                self.optuna._thread_local.in_optimize_loop = False
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.progress = None

    # ------------------------------------------------------------------ workers
    def work_loop(self, n_trials: int, max_concurrent: int, leases: Any, lease_seconds: float,
                  poll_seconds: float) -> None:
        """Train units of the study's trials under leases until none is left, beside other workers.

        Each round reads the study from storage (trials other workers asked, moved on or finished), decides
        complete rungs, asks new trials if slots are free, then leases the trial the round-robin policy picks
        among those no other worker holds, and trains its next unit.
        """
        from .leases import Heartbeat, LeaseLost

        try:
            while True:
                self._sync()
                try:
                    self._decide_rungs()
                except ValueError as exc:  # a peer finished or failed since our read; the next round rereads
                    logger.info("rung decision deferred: %s", exc)
                self._top_up(n_trials, max_concurrent, leases, lease_seconds)
                busy = leases.held_by_others()
                free = [l.info for l in self.live.values() if _trial_lease(l.trial.number) not in busy]
                pick = next_trial(free, self.pool_keys())
                if pick is None:
                    if not any(not l.info.paused for l in self.live.values()) and not self._more_to_ask(n_trials):
                        break
                    time.sleep(poll_seconds)  # other workers hold the remaining units
                    continue
                lease = leases.acquire(_trial_lease(pick.number), lease_seconds)
                if lease is None:
                    continue
                live = self.live[pick.number]
                self.fence = lambda number, unit: (leases.check(lease) if unit is None
                                                   else leases.commit_unit(lease, number, unit))
                try:
                    with Heartbeat(leases, lease):
                        self._work_on(live, leases, lease)
                except LeaseLost as exc:  # another worker has the trial now; our in-memory state is stale
                    logger.warning("%s", exc)
                    live.needs_load = True
                except Exception as exc:  # noqa: BLE001 - the trial fails alone, if it is still ours to fail
                    try:
                        leases.check(lease)
                    except LeaseLost:
                        live.needs_load = True
                    else:
                        self._fail(live.trial, f"{type(exc).__name__}: {exc}")
                finally:
                    self.fence = None
                    leases.release(lease)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _sync(self) -> None:
        """Bring `live` up to date with storage: every RUNNING trial with a config, at its committed progress."""
        running = {t.number: t for t in self.optuna.get_trials(deepcopy=False, states=[OptunaState.RUNNING])}
        for number in [n for n in self.live if n not in running]:  # finished, pruned or failed elsewhere
            self.live.pop(number).runner.cleanup()
        for number, frozen in running.items():
            live = self.live.get(number)
            if live is None:
                if CONFIG_ATTR not in frozen.user_attrs:  # being asked by a worker now (or crashed then: _top_up)
                    continue
                trial = optuna.trial.Trial(self.optuna, frozen._trial_id)
                live = self._start(trial, TrialConfig.from_json(frozen.user_attrs[CONFIG_ATTR]))
                live.needs_load = True
            committed = _committed(frozen, live.runner.start_unit)
            if committed != live.info.units_done:  # another worker trained it: continue from the checkpoint
                live.info.units_done = committed
                live.needs_load = True
            live.info.paused = bool(frozen.user_attrs.get(PAUSED_ATTR))
            live.decided |= {s for s in frozen.intermediate_values if decision_key(s) in frozen.user_attrs}
            if frozen.intermediate_values:
                live.last_value = frozen.intermediate_values[max(frozen.intermediate_values)]

    def _top_up(self, n_trials: int, max_concurrent: int, leases: Any, lease_seconds: float) -> None:
        """Ask new trials while slots are free, one worker at a time; configure trials a crash left unconfigured."""
        if self._active() >= max_concurrent and not self._waiting_clone():
            unconfigured = any(CONFIG_ATTR not in t.user_attrs
                               for t in self.optuna.get_trials(deepcopy=False, states=[OptunaState.RUNNING]))
            if not unconfigured:
                return
        lease = leases.acquire(ASK_LEASE, lease_seconds)
        if lease is None:
            return
        try:
            for frozen in self.optuna.get_trials(deepcopy=False, states=[OptunaState.RUNNING]):
                if CONFIG_ATTR not in frozen.user_attrs:  # its asker died between ask and config
                    trial = optuna.trial.Trial(self.optuna, frozen._trial_id)
                    try:
                        self._start(trial, self._config_of(trial, frozen))
                    except Exception as exc:  # noqa: BLE001 - a bad config fails its trial, not the study
                        self._fail(trial, f"{type(exc).__name__}: {exc}")
            while self._active() < max_concurrent and (self._more_to_ask(n_trials) or self._waiting_clone()):
                self._ask()
        finally:
            leases.release(lease)

    def _more_to_ask(self, n_trials: int) -> bool:
        if isinstance(self.space, ListSpace):
            return _waiting_listed(self.optuna) > 0
        started = sum(t.state != OptunaState.WAITING and CLONE_ATTR not in t.user_attrs
                      for t in self.optuna.get_trials(deepcopy=False))
        return started < n_trials

    def _work_on(self, live: _Live, leases: Any, lease: Any) -> None:
        """Under the trial's lease: apply its ops, catch up with what other workers did, train its next unit."""
        frozen = self.optuna._storage.get_trial(live.trial._trial_id)
        if frozen.state != OptunaState.RUNNING:
            self.live.pop(live.trial.number).runner.cleanup()
            return
        if self._settle(live.trial, frozen):
            self.live.pop(live.trial.number, None)
            return
        req = read_request(frozen)
        if req is not None:
            self._apply(live, req)
            if live.trial.number not in self.live or live.info.paused:
                return
        committed = _committed(frozen, live.runner.start_unit)
        if committed != live.info.units_done:
            live.info.units_done, live.needs_load = committed, True
        if live.needs_load:
            self._load(live)
            durable = live.runner.units_done
            if durable < committed:
                raise CheckpointError(
                    f"trial {live.trial.number}: {committed} chunks were committed but its latest checkpoint holds "
                    f"{durable}; its state is lost"
                )
            if durable > committed:  # its last worker died between the checkpoint and the report
                live.info.units_done = durable
                self._commit_from_checkpoint(live)
        if not live.info.finished:
            self._run_unit(live)
        if live.info.finished:
            leases.check(lease)
            self._finish(live)

    def _n_steps(self) -> int:
        """Chunk units of the study's longest trial: the budget "auto" pruner settings are derived from."""
        units = [s["num_epochs"] * s["num_chunks"] for s in self._schedules()]
        return max(units, default=self.plan.num_chunks)

    def _schedules(self) -> list[dict[str, int]]:
        return [t.user_attrs[SCHEDULE_ATTR] for t in self.optuna.get_trials(deepcopy=False) if SCHEDULE_ATTR in t.user_attrs]

    def _waiting_clone(self) -> bool:
        return any(CLONE_ATTR in t.user_attrs for t in self.optuna.get_trials(deepcopy=False, states=[OptunaState.WAITING]))

    def _active(self) -> int:
        """Live trials that hold a slot: paused ones free theirs."""
        return sum(not l.info.paused for l in self.live.values())

    def pool_keys(self) -> set[str]:
        return {l.config.model_key for l in self.live.values() if self.pool.has_base(l.config)}

    def _remaining_of(self, number: int) -> int:
        frozen = self.optuna.trials[number]
        schedule = frozen.user_attrs.get(SCHEDULE_ATTR)
        if schedule is None:
            return 0
        return schedule["num_epochs"] * schedule["num_chunks"] - len(frozen.intermediate_values)

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.optuna.get_trials(deepcopy=False):
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
        return counts


# ---------------------------------------------------------------------- module API
def create_study(
    study_name: str | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    direction: str = "maximize",
    load_if_exists: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
) -> Study:
    """Create (or, with `load_if_exists`, load) a study, exactly as `optuna.create_study` would.

    `storage` defaults to a SQLite file ``rfopt.db`` in the working directory. `pruner` is any Optuna
    pruner; rfopt applies it at rung boundaries (see `rfopt.pruning`). Checkpoints go to
    `checkpoint_dir` (default: ``rfopt-checkpoints/<study name>`` beside a SQLite file, else in the
    working directory).
    """
    storage = open_storage(storage or "sqlite:///rfopt.db")
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction=direction,
        load_if_exists=load_if_exists,
    )
    return Study(study, checkpoint_dir)


def load_study(
    study_name: str | None,
    storage: str | optuna.storages.BaseStorage,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
) -> Study:
    """Load an existing study (its checkpoint directory is read from the study)."""
    storage = open_storage(storage)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError as exc:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise LookupError(f"no study named {study_name!r} in this storage; it holds {names or 'no studies'}") from exc
    return Study(study, checkpoint_dir)


def _default_checkpoint_dir(study: optuna.Study) -> Path:
    base = Path.cwd()
    url = getattr(getattr(backend(study._storage), "engine", None), "url", None)
    if url is not None and url.drivername.startswith("sqlite") and url.database:
        base = Path(url.database).resolve().parent
    return base / "rfopt-checkpoints" / study.study_name


def _check_dataset(dataset: Any, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None or not hasattr(dataset, "select"):
        raise TypeError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}")
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}); rename the column holding the prompts to 'prompt', "
            "e.g. dataset.rename_column('question', 'prompt')"
        )


def _waiting_listed(study: optuna.Study) -> int:
    """Enqueued trials of a list space not started yet."""
    return sum(
        t.state == OptunaState.WAITING and LIST_INDEX_ATTR in t.user_attrs for t in study.get_trials(deepcopy=False)
    )


def _committed(trial: optuna.trial.FrozenTrial, start_unit: int) -> int:
    """Units of `trial` whose reports are in storage (a warm clone reports from its parent's step onward)."""
    return max(trial.intermediate_values) + 1 if trial.intermediate_values else start_unit


def _trial_lease(number: int) -> str:
    return f"trial-{number}"


def _last_value(trial: optuna.trial.FrozenTrial) -> float | None:
    if not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]


def _prune_reason(trial: optuna.trial.FrozenTrial) -> str | None:
    if trial.state != OptunaState.PRUNED:
        return None
    if STOPPED_ATTR in trial.user_attrs:
        return f"{STOP_REASON} after chunk {trial.user_attrs[STOPPED_ATTR]['after_chunk']}"
    for step in sorted(trial.intermediate_values, reverse=True):
        decision = load_decision(trial, step)
        if decision is not None and decision.prune:
            return decision.reason
    return None


def _finite(data: Any) -> Any:
    """JSON-safe copy: NaN and infinities become strings (SQL storages keep user attrs as JSON)."""
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    return data
