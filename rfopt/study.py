"""The study API: `create_study`, `load_study`, and `Study.optimize` / `Study.work`, which run trials round-robin.

    >>> study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db", num_chunks=4)  # doctest: +SKIP
    >>> study.optimize(space, train_dataset, eval_dataset, n_trials=8, timeout=3600)  # doctest: +SKIP
    >>> study.best_trial, study.trials_dataframe()                                    # doctest: +SKIP
    >>> study.optuna   # the real optuna.Study: visualization, optuna-dashboard and Optuna's CLI all work

A `Study` is an `optuna.Study` to its user (Optuna's attributes are read from `study.optuna`; trial
ops are `pause_trial`, `resume_trial`, `stop_trial`, `clone_trial`, so that `stop()` is Optuna's)
plus what rfopt keeps on it (`rfopt.storage.schema`): its identity and checkpoint location, its chunk plan
and the settings every trial shares, fixed once. `optimize` (one process)
and `work` (one of several workers) check their arguments against the study, plan it once, then hand
the run to the driver loop (`rfopt.engine.driver`), with a coordinator that says whether other processes
share the study (`rfopt.engine.coordinator`). Each unit of work goes through the unit pipeline
(`rfopt.engine.unit`); storage is reconciled by `rfopt.engine.roster`.

Checkpoints belong to exactly one study: the study gets an identity (``rfopt:id``) when it first runs,
its default checkpoint location carries it (``rfopt-checkpoints/<name>-<id>`` beside a SQLite file),
and the location is marked as the study's (`CheckpointStore.claim`). Deleting a database and running
the same study again starts a new study with new checkpoints; two databases in one folder with
studies of the same name keep apart.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.config.rewardfuncs import reward_columns, reward_name
from rfopt.config.settings import EvalSettings
from rfopt.config.spaces import ListSpace, as_space
from rfopt.config.trial import TrialConfig
from rfopt.config.usercode import importing_user_file, study_on_import
from rfopt.engine import ops
from rfopt.engine.artifacts import publish_unit
from rfopt.engine.cluster import RayCluster
from rfopt.engine.coordinator import ASK_LEASE, LeasedCoordinator, LocalCoordinator
from rfopt.engine.driver import drive
from rfopt.engine.roster import Roster, explorable
from rfopt.engine.unit import Context, UnitCommitted
from rfopt.pruning import PopulationBasedTraining
from rfopt.reports.display import ProgressBar
from rfopt.storage import schema
from rfopt.storage.checkpoints import (
    CheckpointError,
    CheckpointStore,
    Location,
    download,
    is_url,
    location_exists,
    normalize_location,
)
from rfopt.storage.database import describe, engine_of, open_storage
from rfopt.storage.schema import TrialRecord, study_record
from rfopt.training.gang import DEFAULT_GANG_SIZE
from rfopt.training.models import ModelPool
from rfopt.training.parallel import DataParallel, DataParallelRunner, follow, lead_done
from rfopt.training.trackers import Tracking
from rfopt.training.trackers import normalize as trackers_of

from . import compat
from .chunks import ChunkPlan, PlanError, dataset_fingerprint, rows_left_out, trial_schedule
from .compat import storage_of
from .errors import ConfigError, Refusal, RfoptError

logger = logging.getLogger("rfopt")


@dataclass
class LeaderboardRow:
    number: int
    state: str
    value: float | None
    chunks_done: int
    params: dict[str, Any]
    adapter: str | None = None
    reason: str | None = None
    held_as: dict[str, str] = field(default_factory=dict)
    """A clone's fields whose values its Optuna params hold under an alternate name (`rfopt.engine.ops.held_as`)."""


@dataclass(frozen=True)
class _Plan:
    """What `optimize` / `work` checked before anything is written, and write once the arguments are good."""

    space: Any
    plan: ChunkPlan
    objective: str
    settings: EvalSettings
    settings_record: dict[str, Any]
    n_trials: int | None
    n_trials_total: int | None
    max_concurrent: int | None
    deadline: float | None
    """`time.monotonic()` after which no unit starts (`timeout`)."""
    callbacks: tuple[Callable[[optuna.Study, FrozenTrial], None], ...]
    catch: tuple[type[Exception], ...]
    configs: list[TrialConfig]
    """The configs checked: a list's, or one sampled from a function space."""
    report_to: list[str]
    """The trackers the trials report to (`rfopt.training.trackers`): the one given, else the study's stored one."""
    report_to_given: bool

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


PRESENCE_SECONDS = 5.0
"""How often a process running a study stamps its presence (`rfopt.storage.leases.Presence`): a process that died reads as
gone within twice this."""

OPTUNA_ATTRIBUTES = frozenset({
    "best_trial", "best_trials", "best_value", "best_params", "trials", "get_trials", "trials_dataframe",
    "user_attrs", "system_attrs", "set_user_attr", "set_system_attr", "study_name", "direction", "directions",
    "sampler", "pruner", "metric_names", "set_metric_names",
})
"""What an rfopt `Study` reads from its `optuna.Study`: to its user, it is an Optuna study."""


class Study:
    """An rfopt study: an `optuna.Study` plus rfopt's chunk plan, objective and checkpoint store.

    `checkpoint_dir` (a directory or an fsspec URL) is where the study's checkpoints go when it first runs; once
    it has run, the study records its location, and a different one is refused unless it holds this study's
    checkpoints (moved there).
    """

    def __init__(self, optuna_study: optuna.Study, checkpoint_dir: str | os.PathLike | None = None) -> None:
        self.optuna = optuna_study
        self._requested = None if checkpoint_dir is None else normalize_location(checkpoint_dir)
        record = study_record(optuna_study)
        if self._requested is not None and record.checkpoint_dir not in (None, self._requested):
            self._follow_moved_checkpoints(record)

    def _follow_moved_checkpoints(self, record: schema.StudyRecord) -> None:
        owner = CheckpointStore(self._requested).owner() if location_exists(self._requested) else None
        if owner is None or owner.get("id") != record.uid:
            raise CheckpointError(
                f"study {self.study_name!r} keeps its checkpoints in {record.checkpoint_dir}; this call gives "
                f"{self._requested}. Leave checkpoint_dir (--checkpoint-dir) out to use the recorded location; to "
                f"move the checkpoints, copy {record.checkpoint_dir} to {self._requested} first (its "
                f"rfopt-study.json names this study, so the study then follows it)"
            )
        logger.info("study %r: its checkpoints moved to %s", self.study_name, self._requested)
        schema.write_checkpoint_dir(self.optuna, self._requested)

    @property
    def checkpoints(self) -> CheckpointStore:
        """The study's checkpoint store (`LookupError` before the study has run and none was given)."""
        location = study_record(self.optuna).checkpoint_dir or self._requested
        if location is None:
            raise LookupError(f"study {self.study_name!r} has not run yet: it has no checkpoint location")
        return CheckpointStore(location)

    # ------------------------------------------------------------------ an Optuna study to its user
    def __getattr__(self, name: str) -> Any:
        """Optuna's study attributes (`OPTUNA_ATTRIBUTES`), read from the real study: ``study.best_trial``,
        ``study.trials_dataframe()``, ``study.user_attrs``, ..."""
        if name in OPTUNA_ATTRIBUTES:
            return getattr(self.optuna, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | OPTUNA_ATTRIBUTES)

    def stop(self, *args: Any) -> None:
        """Stop the running `optimize` / `work` of this process, as `optuna.Study.stop` does (call it from a callback):
        no new trial is started; the live ones go on to their end. To stop one trial, use `stop_trial`."""
        if args:
            raise TypeError(f"Study.stop() stops the optimization loop, as in Optuna; to stop trial {args[0]} at its "
                            f"next chunk boundary use study.stop_trial({args[0]})")
        self.optuna.stop()

    # ------------------------------------------------------------------ running
    def optimize(
        self,
        space: Any,
        train_dataset: Any,
        eval_dataset: Any,
        *,
        n_trials: int | None = None,
        timeout: float | None = None,
        callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
        catch: tuple[type[Exception], ...] | type[Exception] = (Exception,),
        show_progress_bar: bool = True,
        n_trials_total: int | None = None,
        max_concurrent: int | None = None,
        num_chunks: int | None = None,
        objective: str | None = None,
        eval_settings: EvalSettings | None = None,
        chunk_seed: int | None = None,
        device: str = "cpu",
        precision: str = "auto",
        on_unit: Callable[[int, int, float], None] | None = None,
        report_to: str | Sequence[str] | None = None,
        executor: RayCluster | None = None,
        gang_size: int | None = None,
    ) -> None:
        """Train the space's trials round-robin, chunk by chunk, reporting each chunk's evaluation to Optuna.

        `n_trials`, `timeout`, `callbacks` and `show_progress_bar` mean what they mean to `optuna.Study.optimize`; a
        rerun continues the trials a stopped run left (they are not counted in `n_trials`).

        Args:
            space: a function ``trial -> TrialConfig``, a list of `TrialConfig`, or `rfopt.grid(...)`. Before anything
                is stored, a function is called once on a scratch trial of an in-memory study, and its config is
                checked against the chunk plan, the objective and the datasets' columns; a list's configs are all
                checked, and against what the study ran (a config that ran cannot change; new ones are appended).
            train_dataset, eval_dataset: `datasets.Dataset` with a ``prompt`` column (plus any columns the
                reward functions read, e.g. ``answer``).
            n_trials: new trials this call starts. None: a list's configs not run yet; for a function, trials until
                `timeout`, `n_trials_total`, `study.stop()` or Ctrl-C (as Optuna).
            timeout: seconds after which no new unit (a chunk of a trial) starts; the units running finish and commit,
                and every trial not finished stays resumable: the next call continues it.
            callbacks: called as ``callback(optuna_study, frozen_trial)`` after each trial this process ends
                (COMPLETE, PRUNED or FAIL), as Optuna calls them; ``optuna_study.stop()`` in one stops the run.
            catch: exceptions that fail a trial alone. Another exception fails its trial (with the reason stored)
                and then ends the run, the other trials staying resumable. Optuna's default is ``()``: every error
                ends the run; rfopt's is ``(Exception,)``, since a study time-slices many trials and one trial's
                failure must not stop the others. KeyboardInterrupt never fails a trial, nor does SystemExit from
                `on_unit`; a reward function calling ``sys.exit()`` fails its trial alone, as any error in it does.
            n_trials_total: the study's total: no new trial is started once the study has this many (clones not
                counted), whichever process started them (a study file's ``n_trials_total``).
            max_concurrent: live trials time-sliced at once (default: ``min(n_trials, 8)``).
            num_chunks, objective, eval_settings, chunk_seed: the study's settings, fixed when it is first planned
                (`create_study` or the first `optimize`) and read back afterwards; None takes the stored value (the
                default, 4 chunks, ``"reward"``, greedy `EvalSettings()`, seed 0, for a new study); a different value
                is refused. `objective` is ``"reward"`` (mean weighted total reward on the eval set) or a reward
                function's name.
            device: ``"cpu"`` or ``"cuda"`` / ``"cuda:1"``: where every trial's chunks train, whatever the trial
                configs say (their ``use_cpu``, ``bf16`` and ``fp16`` are not used).
            precision: ``"auto"`` (fp32 on the CPU, bf16 on a GPU that has it), ``"fp32"``, ``"bf16"`` or ``"fp16"``.
            on_unit: called after each committed unit with ``(trial_number, step, value)``.
            report_to: the experiment trackers each trial's TRL logs go to, as TRL's ``report_to`` (``"tensorboard"``,
                ``"wandb"``, ``"mlflow"``, ``"trackio"``, a list, ``"none"``): one run per trial, named
                ``<study>-trial-<n>``, grouped by study (`rfopt.training.trackers`). Stored on the study: None takes the stored
                value (none for a new study); a value given replaces it for this and later runs.
            executor: None (train here), or `rfopt.RayCluster(...)`: one worker per device of a Ray cluster trains the
                study (`rfopt.engine.cluster`), each device its own (`device` is left out); this process shows the progress
                and calls `on_unit` and `callbacks` as units and trials commit and end.
            gang_size: live trials of one base model trained at once, in lockstep, their rollouts decoded in one
                batch (`rfopt.training.gang`; see the README, "Gangs"). 1 trains one trial at a time, exactly as plain TRL;
                None: `rfopt.training.gang.DEFAULT_GANG_SIZE`.
        """
        if executor is not None:  # each worker resolves a None gang_size (a data-parallel one trains alone)
            if gang_size is not None:
                _gang_size(gang_size)
            return self._run_on(executor, space, train_dataset, eval_dataset, device=device, n_trials=n_trials,
                                n_trials_total=n_trials_total, timeout=timeout, callbacks=callbacks, catch=catch,
                                max_concurrent=max_concurrent, given={"num_chunks": num_chunks, "objective": objective,
                                                                      "eval_settings": eval_settings,
                                                                      "chunk_seed": chunk_seed},
                                precision=precision, report_to=report_to, on_unit=on_unit,
                                show_progress_bar=show_progress_bar, gang_size=gang_size)
        gang_size = _gang_size(gang_size)
        pool = ModelPool(device, precision)  # checks the device before anything is written
        checked = self._check(space, train_dataset, eval_dataset, n_trials, n_trials_total, timeout, callbacks, catch,
                              max_concurrent, {"num_chunks": num_chunks, "objective": objective,
                                               "eval_settings": eval_settings, "chunk_seed": chunk_seed}, report_to)
        pool.check_room(checked.configs)
        _say_placement(pool.placement, checked)
        with self._presence("run"):  # refuses to start beside another process on the study: it takes no leases
            store = self._claim()
            space, n_trials = self._record(checked)
            max_concurrent = checked.max_concurrent or max(1, min(n_trials or 8, 8))
            with ProgressBar(self.study_name, enabled=show_progress_bar) as progress:
                trained = self._run(space, checked, store, pool, train_dataset, eval_dataset, on_unit,
                                    LocalCoordinator(), max_concurrent, progress=progress,
                                    more_to_ask=self._more_to_ask(space, checked, n_trials),
                                    gang_size=gang_size)
        if not trained and not checked.timed_out():
            logger.warning("%s", self._nothing_done(space))

    def work(
        self,
        space: Any,
        train_dataset: Any,
        eval_dataset: Any,
        *,
        n_trials: int | None = None,
        timeout: float | None = None,
        callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
        catch: tuple[type[Exception], ...] | type[Exception] = (Exception,),
        n_trials_total: int | None = None,
        max_concurrent: int | None = None,
        num_chunks: int | None = None,
        objective: str | None = None,
        eval_settings: EvalSettings | None = None,
        chunk_seed: int | None = None,
        device: str = "cpu",
        precision: str = "auto",
        lease_seconds: float = 30.0,
        poll_seconds: float = 1.0,
        on_unit: Callable[[int, int, float], None] | None = None,
        report_to: str | Sequence[str] | None = None,
        data_parallel: DataParallel | None = None,
        gang_size: int | None = None,
    ) -> None:
        """Join the study as one worker beside others (processes, devices or hosts sharing its storage).

        Takes the arguments of `optimize`, meaning the same: `n_trials` counts the new trials this worker starts,
        `n_trials_total` the study's trials whichever worker started them (what several workers share). Every unit
        is trained under a lease on its trial (`rfopt.storage.leases`): renewed while it trains, and checked in the
        transaction that commits the unit, so a worker whose lease expired cannot commit; one whose heartbeat finds
        its lease taken stops the chunk at the next step. A unit whose worker died is trained by another once the
        lease expires (`lease_seconds`). Returns when no trial is left to train (paused trials wait for a resume).

        `data_parallel`: this process's place in a group of processes that train each trial together, one device
        each (`rfopt.training.parallel`; the group joined with `DataParallel.start` before anything else). Rank 0 is the
        worker; the other ranks follow its chunks and return when it does.

            >>> study.work(space, train, test, n_trials_total=16, device="cuda:1")   # doctest: +SKIP
        """
        from rfopt.storage.leases import Leases

        if lease_seconds <= 0 or poll_seconds <= 0:
            raise ValueError(f"lease_seconds and poll_seconds must be > 0, got {lease_seconds} and {poll_seconds}")
        gang_size = _gang_size(gang_size, data_parallel)
        if data_parallel is not None and gang_size > 1:
            raise ValueError(f"gang_size={gang_size} with devices per trial ({data_parallel.world_size}): a gang trains "
                             "several trials in lockstep in one process, a data-parallel trial one trial over "
                             "processes, each with its own rollouts; give gang_size=1 (--gang-size 1), or leave "
                             "--devices-per-trial out")
        pool = ModelPool(device, precision)  # checks the device before anything is written
        if max_concurrent is None and isinstance(as_space(space), ListSpace):  # the same for every worker
            max_concurrent = max(1, min(len(as_space(space).configs), 8))
        checked = self._check(space, train_dataset, eval_dataset, n_trials, n_trials_total, timeout, callbacks, catch,
                              max_concurrent, {"num_chunks": num_chunks, "objective": objective,
                                               "eval_settings": eval_settings, "chunk_seed": chunk_seed}, report_to)
        pool.check_room(checked.configs)
        _say_placement(pool.placement, checked)
        if data_parallel is not None and not data_parallel.lead:
            workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
            try:
                follow(data_parallel, pool, train_dataset, workdir)
            finally:
                pool.close()
                shutil.rmtree(workdir, ignore_errors=True)
            return
        try:  # a data-parallel lead tells its group when it is done, however it ends
            leases = Leases(self.optuna)
            with self._presence("worker"):  # refuses to start beside an `optimize` (rfopt run), which takes no leases
                with leases.holding(ASK_LEASE, lease_seconds):  # one worker at a time gives the study its identity, plan
                    store = self._claim()
                    space, n_trials = self._record(checked)
                max_concurrent = checked.max_concurrent or max(1, min(n_trials_total or n_trials or 8, 8))
                trained = self._run(space, checked, store, pool, train_dataset, eval_dataset, on_unit,
                                    LeasedCoordinator(leases, lease_seconds), max_concurrent,
                                    more_to_ask=self._more_to_ask(space, checked, n_trials), poll_seconds=poll_seconds,
                                    data_parallel=data_parallel, gang_size=gang_size)
        finally:
            if data_parallel is not None:
                lead_done(data_parallel)
        if not trained and not checked.timed_out():
            logger.warning("%s", self._nothing_done(space))

    def _run_on(self, executor: RayCluster, space: Any, train_dataset: Any, eval_dataset: Any, *, device: str,
                n_trials: int | None, n_trials_total: int | None, timeout: float | None, callbacks: Any, catch: Any,
                max_concurrent: int | None, given: dict[str, Any], precision: str, report_to: Any, on_unit: Any,
                show_progress_bar: bool, gang_size: int | None) -> None:
        """`optimize` on a cluster: the same checks here, then one `work` per device there (`rfopt.engine.cluster`)."""
        from rfopt.engine.cluster import WorkerJob

        if device != "cpu":
            raise ValueError(f"device={device!r}: on a cluster each worker trains on the device Ray gives it (a GPU "
                             "each where the cluster has GPUs: RayCluster(gpus=...)); leave device out")
        checked = self._check(space, train_dataset, eval_dataset, n_trials, n_trials_total, timeout, callbacks, catch,
                              max_concurrent, given, report_to)
        space = checked.space
        if isinstance(space, ListSpace):
            if n_trials is not None:
                raise ValueError("n_trials with a list of configs: on a cluster the workers run every config not run "
                                 "yet; leave n_trials out")
            concurrent = checked.max_concurrent or max(1, min(len(space), 8))
        else:  # n_trials counts this call's new trials: the workers share them as a study total
            started = sum(t.state != TrialState.WAITING and TrialRecord(t).lineage is None
                          for t in self.optuna.get_trials(deepcopy=False))
            total = n_trials_total if n_trials is None else started + n_trials
            if n_trials is not None and n_trials_total is not None:
                total = min(total, n_trials_total)
            n_trials_total = total
            concurrent = checked.max_concurrent or max(1, min(n_trials or n_trials_total or 8, 8))
        settings = {name: value for name, value in given.items() if value is not None}
        job = WorkerJob.of(self, self._requested, space, (train_dataset, eval_dataset), dict(
            n_trials_total=n_trials_total, timeout=timeout, catch=checked.catch, max_concurrent=concurrent,
            precision=precision, report_to=report_to, lease_seconds=executor.lease_seconds,
            poll_seconds=executor.poll_seconds, gang_size=gang_size, **settings))
        executor.run(self, job, callbacks=checked.callbacks, on_unit=on_unit, show_progress_bar=show_progress_bar)

    def _more_to_ask(self, space: Any, checked: _Plan, n_trials: int | None) -> Callable[[Roster], bool]:
        """Whether this run starts another new trial: `n_trials` counts this run's, `n_trials_total` the study's; a
        list space runs its enqueued configs."""
        total = checked.n_trials_total

        def more(roster: Roster) -> bool:
            if n_trials is not None and roster.asked >= n_trials:
                return False
            if isinstance(space, ListSpace):
                return _waiting_listed(self.optuna) > 0
            if total is not None:
                started = sum(t.state != TrialState.WAITING and TrialRecord(t).lineage is None
                              for t in self.optuna.get_trials(deepcopy=False))
                return started < total
            return True

        return more

    def _run(self, space, checked, store, pool, train_dataset, eval_dataset, on_unit, coordinator, max_concurrent, *,
             more_to_ask, progress=None, poll_seconds: float = 1.0, data_parallel: DataParallel | None = None,
             gang_size: int = 1) -> int:
        """Drive the study until nothing is left to do here; return how many units this call committed."""
        workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
        ctx = Context(study=self.optuna, store=store, plan=checked.plan, train_dataset=train_dataset,
                      eval_dataset=eval_dataset, objective=checked.objective, settings=checked.settings, pool=pool,
                      workdir=workdir, tracking=Tracking(checked.report_to, self.study_name) if checked.report_to
                      else None, subscribers=[publish_unit])
        if data_parallel is not None:
            ctx.runner_class = functools.partial(DataParallelRunner, group=data_parallel)
        if gang_size > 1 and ctx.tracking is not None and (single := ctx.tracking.single_run_trackers()):
            logger.warning("report_to %s: one trial at a time (gang_size 1 instead of %d): %s keep%s one active run "
                           "per process, so gang members would write into each other's runs", ", ".join(single),
                           gang_size, " and ".join(single), "s" if len(single) == 1 else "")
            gang_size = 1
        if on_unit is not None:
            ctx.callbacks.append(lambda event: on_unit(event.trial.number, event.unit, event.value))
        if progress is not None:
            ctx.step_listeners.append(progress.step)
        committed = []
        ctx.subscribers.append(committed.append)
        roster = Roster(ctx, space, callbacks=checked.callbacks, catch=checked.catch)
        if progress is not None:  # one line per committed unit, a gang's several commits of one round included
            ctx.subscribers.append(lambda event: progress(roster.progress()))
        try:
            drive(roster, coordinator, max_concurrent=max_concurrent, more_to_ask=lambda: more_to_ask(roster),
                  poll_seconds=poll_seconds, on_progress=progress, deadline=checked.deadline,
                  gang_size=gang_size)
            if checked.timed_out() and roster.live:
                logger.warning("study %r: timeout reached; trials %s continue from their last committed chunk when "
                               "the study runs again", self.study_name, sorted(roster.live))
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C, or the caller's on_unit calling sys.exit
            logger.warning("study %r: stopped by %s; no trial failed, and each continues from its last committed "
                           "chunk when the study runs again", self.study_name, type(exc).__name__)
            raise
        except Exception as exc:
            if self._exists():
                raise
            raise StudyDeletedError(
                f"study {self.study_name!r} was deleted from its storage ({describe(storage_of(self.optuna))}) while "
                "this process ran it (optuna-dashboard's delete button, or optuna.delete_study): its trials and "
                f"results are gone from the database, and this run stopped. Its checkpoints are still in {store.root} "
                "(delete them if the study is not wanted). Running the study again starts a new one, with a new "
                "identity and new checkpoints"
            ) from exc
        finally:
            for number in list(roster.live):
                roster.live.pop(number).runner.cleanup()
            pool.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return len(committed)

    def _exists(self) -> bool:
        """Whether the study is still in its storage (a person may delete it while it runs)."""
        try:
            storage_of(self.optuna).get_study_id_from_name(self.study_name)
        except KeyError:
            return False
        return True

    def _presence(self, kind: str) -> Any:
        """This process's heartbeat on the study while it runs it (`rfopt.storage.leases.Presence`; `rfopt.engine.ops.liveness` reads
        it): in an SQL storage, where other processes can look. Entered before anything is written, it refuses
        (`rfopt.storage.leases.StudyBusyError`) to run beside a process it cannot share the study with: an `optimize` beside
        anyone, a worker beside an `optimize`."""
        from contextlib import nullcontext

        from rfopt.storage.leases import Presence

        if engine_of(storage_of(self.optuna)) is None:
            return nullcontext()
        return Presence(self.optuna, kind, interval=PRESENCE_SECONDS, exclusive=True)

    def _nothing_done(self, space: Any) -> str:
        counts: dict[str, int] = {}
        for t in self.optuna.get_trials(deepcopy=False):
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
        has = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no trials"
        paused = sum(TrialRecord(t).paused for t in self.optuna.get_trials(deepcopy=False, states=[TrialState.RUNNING]))
        if paused:
            more = f"{paused} paused trial(s) wait for a resume (rfopt resume N --study {self.study_name})"
        elif isinstance(space, ListSpace):
            more = (f"every one of the list's {len(space)} configs has run; append configs to the list to add "
                    "trials, or clone a trial")
        else:
            more = "no trial is left to continue; give n_trials to add trials"
        return f"study {self.study_name!r}: nothing to do ({has}): {more}"

    # ------------------------------------------------------------------ checking and planning the study
    def _check(self, space, train_dataset, eval_dataset, n_trials, n_trials_total, timeout, callbacks, catch,
               max_concurrent, given: dict[str, Any], report_to: Any = None) -> _Plan:
        """Check the arguments of `optimize`/`work` against each other and the study; nothing is written."""
        started = time.monotonic()
        script = importing_user_file()
        if script is not None:  # what the check of the file's top level (`config.study_on_import`) could not see
            raise study_on_import(script, "a study run reached while importing it")
        check_study_name(self.study_name)  # a study made by Optuna itself, with any name, becomes folders here
        space = as_space(space)
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        for name, value in (("n_trials", n_trials), ("n_trials_total", n_trials_total)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if n_trials_total is not None and isinstance(space, ListSpace):
            raise ValueError("n_trials_total is for a search space function; a study driven by a list of configs "
                             "runs its configs (n_trials limits how many of them this call starts)")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
            raise ValueError(f"max_concurrent must be a whole number >= 1, got {max_concurrent!r}")
        callbacks = tuple(callbacks or ())
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"callbacks: {callback!r} is not callable; a callback is called as "
                                "callback(optuna_study, frozen_trial) after each trial ends")
        catch = catch if isinstance(catch, tuple) else (catch,)
        if not all(isinstance(c, type) and issubclass(c, Exception) for c in catch):
            raise TypeError(f"catch must be a tuple of exception classes, got {catch!r}")
        _check_pruner(self.optuna.pruner)
        fixed = _fixed_settings(self.optuna, given)
        objective, settings = fixed["objective"], fixed["eval_settings"]
        record = study_record(self.optuna)
        plan = record.plan
        if plan is not None:
            if plan.num_rows != len(train_dataset):
                raise PlanError(
                    f"study {self.study_name!r} was planned with a train_dataset of {plan.num_rows} rows; this call "
                    f"gives {len(train_dataset)}. Use the same dataset to continue it, or a new study name"
                )
        else:
            plan = ChunkPlan.build(len(train_dataset), fixed["num_chunks"], fixed["chunk_seed"])
        wanted = {"train_fingerprint": dataset_fingerprint(train_dataset),
                  "eval_fingerprint": dataset_fingerprint(eval_dataset)}
        for name, value in wanted.items():
            if name in record.settings and record.settings[name] != value:
                raise ValueError(f"study {self.study_name!r}: {_SETTING_CHANGED[name](record.settings[name], value)}; "
                                 "trials would not be comparable. Use the same one to continue the study, or a new "
                                 "study name")
        wanted.update(_settings_record(fixed))
        if isinstance(space, ListSpace):
            configs = list(enumerate(space.configs))
            left = space.check_study(self.optuna)
            if n_trials is not None and n_trials > left:
                raise ValueError(
                    f"n_trials={n_trials}, but {left} of the list's {len(space)} configs are left to run; a study "
                    "driven by a list of configs runs its configs: leave n_trials out to run them all, or append "
                    "configs to the list"
                )
        else:
            sample = _sample_config(space, self.optuna.direction)
            # The study's own inputs (plan, objective, datasets) are checked against one sampled config.
            configs = [] if sample is None else [("the search space function's config", sample.config)]
        for where, config in configs:  # refuse what would fail every trial before training anything
            label = f"configs[{where}]" if isinstance(where, int) else where
            try:
                if isinstance(where, int):  # a function's configs vary: each is validated as its trial starts
                    config.validate()
                config.to_json()  # what cannot be stored (a function no other process can import) fails every trial
                trial_schedule(plan, config.args)
                _check_objective(objective, config)
                _check_columns(config, train_dataset, "train_dataset")
                _check_columns(config, eval_dataset, "eval_dataset")
            except (ConfigError, PlanError, ValueError) as exc:
                raise type(exc)(f"{label}: {exc}") from exc
        _check_population(self.optuna.pruner, space, plan, [config for _, config in configs],
                          None if isinstance(space, ListSpace) else sample)
        self._say_rows_left_out(plan, configs)
        deadline = None if timeout is None else started + timeout
        # The stored trackers are checked too: one uninstalled since would fail every trial.
        trackers = trackers_of(report_to if report_to is not None else record.settings.get("report_to", []))
        return _Plan(space, plan, objective, settings, wanted, n_trials, n_trials_total, max_concurrent, deadline,
                     callbacks, catch, [config for _, config in configs], trackers, report_to is not None)

    def _say_rows_left_out(self, plan: ChunkPlan, configs: list[tuple[Any, TrialConfig]]) -> None:
        """Warn, naming how many, when the chunk plan leaves training rows out of a config's training (a chunk holds
        whole steps; the rows do not divide into chunks): the config that leaves the most out."""
        notes = []
        for where, config in configs:
            left = rows_left_out(plan, config.args)
            if left is not None:
                notes.append((-left[0], f"configs[{where}]" if isinstance(where, int) else where, left[1]))
        if notes:
            _, label, note = min(notes)
            logger.warning("study %r: %s: %s", self.study_name, label, note)

    def _claim(self) -> CheckpointStore:
        """Give the study its identity and checkpoint location if it has none, and make the location this study's
        (`CheckpointStore.claim`); check that it takes writes. Workers call it under the study's ask lease."""
        record = study_record(self.optuna)
        uid = record.uid or uuid.uuid4().hex
        location = record.checkpoint_dir or self._requested or _default_location(self.optuna, uid)
        store = CheckpointStore(location)
        store.check_writable()
        store.claim(uid, self.study_name, describe(storage_of(self.optuna)), recorded=record.checkpoint_dir is not None)
        if record.uid is None or record.checkpoint_dir is None:
            schema.write_identity(self.optuna, uid, normalize_location(location))
        return store

    def _record(self, checked: _Plan) -> tuple[Any, int | None]:
        """Store the plan and settings the study does not have yet; enqueue a list's configs not run yet."""
        record = study_record(self.optuna)
        if record.plan is None:
            schema.write_plan(self.optuna, checked.plan)
        schema.write_settings(self.optuna, {k: v for k, v in checked.settings_record.items() if k not in record.settings})
        if checked.report_to_given and record.settings.get("report_to") != checked.report_to:
            schema.write_settings(self.optuna, {"report_to": checked.report_to})
        schema.name_metric(self.optuna, checked.objective)  # a study planned by an earlier rfopt has no metric name
        n_trials = checked.n_trials
        if isinstance(checked.space, ListSpace):
            checked.space.enqueue_missing(self.optuna)
            if n_trials is None:  # the configs not run yet (all of them, the first time)
                n_trials = _waiting_listed(self.optuna)
        return checked.space, n_trials

    # ------------------------------------------------------------------ trial ops (`rfopt pause|resume|stop|clone`)
    def pause_trial(self, trial_number: int) -> None:
        """Pause a running trial at its next chunk boundary (it stays RUNNING in Optuna, unscheduled)."""
        ops.request(self.optuna, trial_number, "pause")

    def resume_trial(self, trial_number: int) -> None:
        """Resume a paused trial; it continues exactly where it was."""
        ops.request(self.optuna, trial_number, "resume")

    def stop_trial(self, trial_number: int) -> None:
        """Stop a running trial at its next chunk boundary: it ends PRUNED with its last value. (`stop()` is Optuna's:
        it stops the optimization loop.)"""
        ops.request(self.optuna, trial_number, "stop")

    def liveness(self) -> ops.Liveness:
        """Whether a process is running the study now, and which WAITING trials wait for one (`rfopt.engine.ops.liveness`)."""
        return ops.liveness(self.optuna)

    def withdraw_request(self, trial_number: int, op: str) -> None:
        """Take back a pending ``"pause"``, ``"resume"`` or ``"stop"`` on a running trial before it applies; refused
        (`rfopt.engine.ops.OpError`) if none is pending or it applied already."""
        ops.withdraw(self.optuna, trial_number, op)

    def cancel_clone(self, trial_number: int) -> None:
        """Cancel a WAITING clone before any process starts it: it leaves the queue and ends FAIL, ``cancelled by ...``.
        Refused (`rfopt.engine.ops.OpError`) for any other trial, or if a process started it first (stop it instead)."""
        ops.cancel(self.optuna, trial_number)

    def clone_trial(self, trial_number: int, overrides: dict[str, Any] | None = None, *,
                    warm_start: bool = False) -> int:
        """Enqueue a copy of a trial with `overrides` (validated first); returns the clone's trial number.

        With `warm_start` the clone starts from the parent's latest checkpoint (weights; a fresh LR schedule over
        the remaining steps) and reports at the parent's step numbers onward. A running `optimize` picks it up
        when a slot frees; otherwise the next `optimize` call does.
        """
        made = ops.clone_in_study(self.optuna, trial_number, overrides or {}, warm_start=warm_start)
        for note in made.notes:
            logger.warning("clone of trial %d: %s", trial_number, note)
        return made.number

    # ------------------------------------------------------------------ results
    def leaderboard(self) -> list[LeaderboardRow]:
        """Every trial, best first: finished trials by value, then the rest by progress."""
        sign = 1 if self.optuna.direction == optuna.study.StudyDirection.MAXIMIZE else -1
        rows = []
        for t in self.optuna.get_trials(deepcopy=False):
            if t.state == TrialState.WAITING:
                continue
            record = TrialRecord(t)
            rows.append(
                LeaderboardRow(
                    number=t.number,
                    state=record.shown_state,
                    value=record.value,
                    chunks_done=record.committed,  # a warm clone's count includes the units it inherited
                    params=dict(t.params),
                    adapter=record.adapter,
                    reason=record.end_reason,
                    held_as=ops.held_as(t),
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
        from rfopt.reports.display import format_leaderboard

        return format_leaderboard(self.leaderboard(), study_record(self.optuna).objective)

    def best_adapter(self) -> Location:
        """Directory of the best finished trial's adapter (PEFT format): a `Path`, or a URL in an object store."""
        if not self.optuna.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
            raise LookupError(f"study {self.study_name!r} has no finished trial yet")
        best = self.optuna.best_trial
        path = TrialRecord(best).adapter
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

    @property
    def best_config(self) -> TrialConfig:
        """The best trial's config as it was trained (its stored ``rfopt:config``, what `export_best`'s adapter was
        trained with). Where Optuna's params cannot say it (a clone's model, or another categorical value the study's
        param had no choice for: `best_params` then names an alternate param, ``model#2``), this does.

            >>> study.best_config.model, study.best_config.args.learning_rate           # doctest: +SKIP
        """
        if not self.optuna.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
            raise LookupError(f"study {self.study_name!r} has no finished trial yet")
        return self.trial_config(self.optuna.best_trial.number)

    def trial_config(self, number: int) -> TrialConfig:
        """Trial `number`'s config as it was trained (its stored ``rfopt:config``)."""
        stored = TrialRecord(self.optuna.trials[number]).config_json
        if stored is None:
            raise LookupError(f"trial {number} has no rfopt config")
        return TrialConfig.from_json(stored)

    def chunk_metrics(self, number: int) -> list[dict[str, Any]]:
        """Per-chunk training and eval metrics stored on trial `number`, in chunk order."""
        record = TrialRecord(self.optuna.trials[number])
        return [record.raw_metrics(m.unit) for m in record.unit_metrics()]


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
    num_chunks: int | None = None,
    objective: str | None = None,
    eval_settings: EvalSettings | None = None,
    chunk_seed: int | None = None,
    report_to: str | Sequence[str] | None = None,
) -> Study:
    """Create (or, with `load_if_exists`, load) a study, exactly as `optuna.create_study` would.

    `report_to` stores the trackers the study's trials report to (as `Study.optimize`'s `report_to`: one run per
    trial, ``<study>-trial-<n>``, grouped by study); None leaves the stored value.

    `num_chunks`, `objective`, `eval_settings` and `chunk_seed` fix the study's settings now (`Study.optimize` says
    what they mean); those left out are fixed by the first `optimize`. Loading a study that has them stored, a
    different value is refused.

    `storage` defaults to a SQLite file ``rfopt.db`` in the working directory. `pruner` is any Optuna
    pruner; rfopt applies it at rung boundaries (see `rfopt.pruning`). Checkpoints go to `checkpoint_dir`
    (default: ``rfopt-checkpoints/<study name>-<study id>`` beside a SQLite file; a study in a server database
    such as PostgreSQL needs one that every host can reach).
    """
    check_study_name(study_name)
    _check_pruner(pruner)
    given = {"num_chunks": num_chunks, "objective": objective, "eval_settings": eval_settings, "chunk_seed": chunk_seed}
    _check_settings(given)
    trackers = None if report_to is None else trackers_of(report_to)
    storage = open_storage(storage or "sqlite:///rfopt.db")
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction=direction,
        load_if_exists=load_if_exists,
    )
    made = Study(study, checkpoint_dir)
    fixed = _fixed_settings(study, given)  # refuses a value that differs from the stored one
    stored = study_record(study).settings
    schema.write_settings(study, {name: value for name, value in _settings_record(fixed).items()
                                  if given[name] is not None and name not in stored})
    if trackers is not None and stored.get("report_to") != trackers:
        schema.write_settings(study, {"report_to": trackers})
    return made


def load_study(
    study_name: str | None,
    storage: str | optuna.storages.BaseStorage,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
) -> Study:
    """Load an existing study (its checkpoint location is read from the study)."""
    storage = open_storage(storage, create=False)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError as exc:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise LookupError(f"no study named {study_name!r} in this storage; it holds {names or 'no studies'}") from exc
    return Study(study, checkpoint_dir)


class StudyDeletedError(RfoptError, RuntimeError):
    """The study was deleted from its storage while this process ran it."""


class StudyNameError(Refusal):
    """A study name that cannot be a folder's name as it is (it would choose where files go)."""


STUDY_NAME_MAX = 128
"""The longest study name, in characters (also at most `STUDY_NAME_MAX_BYTES` in UTF-8): the checkpoint folder
``<name>-<id>`` must fit a file system's 255-byte name."""
STUDY_NAME_MAX_BYTES = 200
STUDY_NAME_PUNCTUATION = "._-+=@ "
"""What a study name may hold besides letters and digits."""
STUDY_NAME_RULE = (f"a study name is also a folder name (rfopt-checkpoints/<name>-<id>, a tracker's run): use "
                   f"letters, digits, spaces and {' '.join(STUDY_NAME_PUNCTUATION.strip())}, at most {STUDY_NAME_MAX} "
                   "characters, not starting with '.', '-' or a space")


def check_study_name(name: Any) -> None:
    """Refuse a study name that would choose a location: a path separator, a leading ``.``, ``~`` or ``-``, a
    control character, or more than `STUDY_NAME_MAX` characters (`STUDY_NAME_RULE` says what is allowed). None is
    Optuna's generated name.

        >>> check_study_name("../../x")                                       # doctest: +SKIP
        StudyNameError: study name '../../x': '/' is not allowed; a study name is also a folder name ...
    """
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"study_name must be text, got {type(name).__name__} {name!r}")
    shown = repr(name if len(name) <= 60 else name[:60] + "...")
    problem = None
    if not name.strip():
        problem = "it is empty"
    elif len(name) > STUDY_NAME_MAX or len(name.encode()) > STUDY_NAME_MAX_BYTES:
        problem = f"it is {len(name)} characters long"
    elif bad := sorted({c for c in name if not (c.isalnum() or c in STUDY_NAME_PUNCTUATION)}):
        problem = f"{', '.join(repr(c) for c in bad)} {'is' if len(bad) == 1 else 'are'} not allowed"
    elif name[0] in ".- ":
        problem = f"it starts with {name[0]!r}"
    elif name[-1] == " ":
        problem = "it ends with a space"
    if problem is not None:
        raise StudyNameError(f"study name {shown}: {problem}; {STUDY_NAME_RULE}. Nothing was stored")


def _default_location(study: optuna.Study, uid: str) -> Path:
    """``rfopt-checkpoints/<name>-<id>`` beside a SQLite file (in the working directory for other file-less
    storages); a server database has none, since hosts do not share a working directory."""
    directory = f"{study.study_name}-{uid[:12]}"
    engine = engine_of(storage_of(study))
    if engine is None:
        return Path.cwd() / "rfopt-checkpoints" / directory
    url = engine.url
    if url.drivername.startswith("sqlite"):
        base = Path(url.database).resolve().parent if url.database and url.database != ":memory:" else Path.cwd()
        return base / "rfopt-checkpoints" / directory
    raise CheckpointError(
        f"study {study.study_name!r} is in a server database ({describe(storage_of(study))}) that several hosts may "
        "share, so its checkpoints need a location every worker can reach: give checkpoint_dir=... "
        f"(--checkpoint-dir): a directory all hosts mount, or an object store such as s3://bucket/rfopt/"
        f"{study.study_name} (on one host, any local directory)"
    )


def _say_placement(placement: Any, checked: _Plan) -> None:
    """Warn when configs ask for a precision (``bf16``, ``fp16``) the device does not train in: placement is the
    device's (`rfopt.training.models.Placement`), and a config's own fields are not used."""
    precision = "bf16" if placement.bf16 else "fp16" if placement.fp16 else "fp32"
    asked = {}
    for index, config in enumerate(checked.configs):
        fields = [f"{name}=True" for name in ("bf16", "fp16") if getattr(config.args, name) and not getattr(placement, name)]
        if fields:
            label = f"configs[{index}]" if isinstance(checked.space, ListSpace) else "the search space function's config"
            asked[label] = ", ".join(fields)
    if asked:
        which = "; ".join(f"{label} sets {fields}" for label, fields in asked.items())
        logger.warning("%s, which rfopt does not use: where a chunk trains, and in what precision, is the device's "
                       "choice, and this study trains in %s on %s. Give the precision to the run instead: "
                       "optimize(device=..., precision=...), rfopt run --device cuda --precision bf16", which,
                       precision, placement.device)


def _check_dataset(dataset: Any, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None or not hasattr(dataset, "select"):
        raise TypeError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}")
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}); rename the column holding the prompts to 'prompt', "
            "e.g. dataset.rename_column('question', 'prompt')"
        )
    if len(dataset) == 0:
        use = "training splits it into chunks" if name == "train_dataset" else "evaluation after each chunk needs it"
        raise ValueError(f"{name} is empty; {use}: give at least one row")
    for i, prompt in enumerate(dataset["prompt"]):
        if not _is_prompt(prompt):
            shown = repr(prompt)
            raise ValueError(
                f"{name} row {i}: the prompt is {type(prompt).__name__} {shown[:80]}; a prompt is text, or a list of chat "
                "messages such as [{'role': 'user', 'content': '...'}]. Fix or drop such rows, e.g. "
                f"{name}.filter(lambda row: isinstance(row['prompt'], str))"
            )


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def _check_objective(objective: str, config: TrialConfig) -> None:
    names = config.reward_names
    if objective != "reward" and objective not in names:
        raise ValueError(f"objective={objective!r} is neither 'reward' (the weighted total of the rewards) nor the "
                         f"name of one of the reward functions {names}")


def _check_columns(config: TrialConfig, dataset: Any, name: str) -> None:
    """Refuse a dataset that lacks a column a reward function declares as a parameter (TRL passes every column)."""
    for func in config.reward_funcs:
        missing = [c for c in reward_columns(func) if c not in dataset.column_names]
        if missing:
            raise ValueError(
                f"reward function {reward_name(func)!r} takes {', '.join(map(repr, missing))}, which {name} has no "
                f"column for (its columns: {dataset.column_names}); add the column, or give the parameter a default"
            )


def _check_pruner(pruner: Any) -> None:
    """Refuse a pruner that cannot run here (before the study trains anything that it would then fail to judge)."""
    import importlib.util

    while isinstance(pruner, optuna.pruners.PatientPruner):
        pruner = compat.pruner_settings(pruner)["wrapped_pruner"]
    if isinstance(pruner, optuna.pruners.WilcoxonPruner) and importlib.util.find_spec("scipy") is None:
        raise ImportError("WilcoxonPruner needs scipy, which is not installed: pip install scipy (or choose "
                          "another pruner)")


def _check_population(pruner: Any, space: Any, plan: ChunkPlan, configs: list[TrialConfig],
                      sample: _Sample | None) -> None:
    """Refuse population-based training that would never act, or whose clones would copy their parents: a list that
    varies no param, `params` naming a param the space does not search (a typo) or one no warm-started clone can
    change (the model, the adapter's shape), no explorable param at all, or an `interval` the trials never reach.
    `sample`: a function space's config drawn on scratch trials (None for a list, or where the function raised)."""
    if not isinstance(pruner, PopulationBasedTraining):
        return
    named = list(pruner.params) if pruner.params is not None else None
    if isinstance(space, ListSpace):
        searched = sorted(space.distributions)
        if not searched:
            raise ValueError("PopulationBasedTraining explores the trials' searched params (their Optuna params), and "
                             "this list of configs varies none: its clones would copy their parents unchanged. List "
                             "configs that differ in what to explore (e.g. learning_rate), or search with a function "
                             "space")
        missing = sorted(set(named or ()) - set(searched))
        if missing:
            raise ValueError(f"PopulationBasedTraining(params={named}): the list of configs does not vary "
                             f"{missing}, so they are not searched params and have no range to explore in; its "
                             f"searched params are {searched}")
        parent = _scratch_member(space.configs[0], {name: values[0] for name, values in space.params.items()},
                                 space.distributions)
    elif sample is None:
        return  # the function raised on a scratch trial: each trial is checked as it runs, and the plan warns
    else:
        if set(named or ()) - set(sample.distributions):  # one draw may miss a param suggested only sometimes
            searched = _searched_params(space, SAMPLE_DRAWS) | set(sample.distributions)
            missing = sorted(set(named or ()) - searched)
            if missing:
                raise ValueError(f"PopulationBasedTraining(params={named}): the search space function suggests no "
                                 f"param {missing} (in {SAMPLE_DRAWS} calls on scratch trials it suggested "
                                 f"{sorted(searched)}); a param is named as the function suggests it "
                                 "(trial.suggest_float('learning_rate', ...) is 'learning_rate')")
        parent = _scratch_member(sample.config, sample.params, sample.distributions)
    changeable = explorable(pruner, space, parent)
    fixed = [name for name in (named or ()) if name in parent.distributions and name not in changeable]
    if fixed:
        raise ValueError(f"PopulationBasedTraining(params={named}): a warm-started clone cannot change {fixed} (it "
                         "loads its parent's weights, so the model and the adapter's shape stay; a param with one "
                         "value has nothing to change to): its clones would copy their parents in them. Leave them "
                         "out of params")
    if not changeable:
        raise ValueError(f"PopulationBasedTraining: no searched param ({sorted(parent.distributions)}) can change in a "
                         "warm-started clone (it loads its parent's weights, so the model and the adapter's shape "
                         "stay), so every clone would copy its parent. Search a param it can explore, such as "
                         "learning_rate or lora_alpha")
    units = max((trial_schedule(plan, config.args).num_units for config in configs), default=None)
    if units is not None and pruner.interval >= units:
        raise ValueError(f"PopulationBasedTraining(interval={pruner.interval}): the trials train {units} chunks "
                         f"({plan.num_chunks} chunks a pass over the train set), and it acts every {pruner.interval} "
                         f"chunks but never after a trial's last, so it would never act. Give interval <= "
                         f"{units - 1}, or more chunks (num_chunks)")


def _scratch_member(config: TrialConfig, params: dict[str, Any], distributions: dict[str, Any]) -> FrozenTrial:
    """A trial with `config` and `params`, in no study: what a population's member looks like to its clones."""
    return optuna.trial.create_trial(params=params, distributions=distributions, value=0.0,
                                     user_attrs=schema.new_trial_attrs(config.to_json()))


@dataclass(frozen=True)
class _Sample:
    """A function space's config, drawn on a scratch trial of an in-memory study (nothing is stored)."""

    config: TrialConfig
    params: dict[str, Any]
    distributions: dict[str, Any]


SAMPLE_DRAWS = 8
"""Scratch calls of a function space whose suggested param names are gathered (`_searched_params`)."""


def _sample_config(space: Any, direction: Any) -> _Sample | None:
    """A config of a function space, from one call on a scratch trial of an in-memory study (nothing is stored), to
    check the study before it starts; None if the function raises there (a trial it fails on fails alone, with the
    reason)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(direction=direction, sampler=optuna.samplers.RandomSampler(seed=0))
        trial = scratch.ask()
        config = space.function(trial)
    except Exception as exc:  # noqa: BLE001 - checked again, trial by trial, when the study runs
        logger.debug("the search space function raised on a scratch trial (%s); not checked before the run", exc)
        return None
    finally:
        optuna.logging.set_verbosity(verbosity)
    return _Sample(space.checked(config), dict(trial.params), dict(trial.distributions))


def _searched_params(space: Any, draws: int) -> set[str]:
    """The names of the params a function space suggests in `draws` calls on scratch trials (a param suggested only
    for some configs shows in some); the calls that raise are skipped."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names: set[str] = set()
    try:
        scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
        for _ in range(draws):
            trial = scratch.ask()
            try:
                space.function(trial)
            except Exception:  # noqa: BLE001 - a draw the function fails on adds nothing
                pass
            names |= set(trial.distributions)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return names


_SETTING_CHANGED = {
    "train_fingerprint": lambda old, new: (f"this call's train_dataset is not the one it was run with (fingerprint "
                                           f"{new}, recorded {old})"),
    "eval_fingerprint": lambda old, new: (f"this call's eval_dataset is not the one its trials were evaluated on "
                                          f"(fingerprint {new}, recorded {old})"),
}

STUDY_SETTINGS: dict[str, Any] = {"num_chunks": 4, "chunk_seed": 0, "objective": "reward",
                                  "eval_settings": EvalSettings()}
"""A study's settings, fixed when it is first planned, with their defaults: every trial of the study shares them."""


def _fixed_settings(study: optuna.Study, given: dict[str, Any]) -> dict[str, Any]:
    """The study's settings (`STUDY_SETTINGS`): the stored ones, else those `given`, else the defaults; a given value
    that differs from the stored one is refused, naming it."""
    _check_settings(given)
    stored = _stored_settings(study_record(study))
    for name, value in given.items():
        if value is not None and name in stored and stored[name] != value:
            raise ValueError(
                f"study {study.study_name!r} was planned with {name}={_shown(stored[name])}, and this call gives "
                f"{name}={_shown(value)}; a study's {name} is fixed when it is first planned, so that its trials "
                f"compare. Leave {name} out to use the stored one, or use a new study name"
            )
    return {name: stored.get(name, given[name] if given.get(name) is not None else default)
            for name, default in STUDY_SETTINGS.items()}


def _check_settings(given: dict[str, Any]) -> None:
    num_chunks, chunk_seed = given.get("num_chunks"), given.get("chunk_seed")
    if num_chunks is not None and (not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1):
        raise ValueError(f"num_chunks must be a whole number >= 1, got {num_chunks!r}")
    if chunk_seed is not None and (not isinstance(chunk_seed, int) or isinstance(chunk_seed, bool)):
        raise ValueError(f"chunk_seed must be a whole number, got {chunk_seed!r}")
    if given.get("objective") is not None and not isinstance(given["objective"], str):
        raise TypeError(f"objective must be 'reward' or a reward function's name, got {given['objective']!r}")
    if given.get("eval_settings") is not None and not isinstance(given["eval_settings"], EvalSettings):
        raise TypeError(f"eval_settings must be an rfopt.EvalSettings, got {type(given['eval_settings']).__name__}")


def _stored_settings(record: schema.StudyRecord) -> dict[str, Any]:
    """The settings a study has stored (`STUDY_SETTINGS` names); a study planned before they were stored one by one
    has its chunk count and seed in its plan."""
    stored = {k: v for k, v in record.settings.items() if k in STUDY_SETTINGS}
    if "eval_settings" in stored:
        stored["eval_settings"] = EvalSettings(**stored["eval_settings"])
    if record.plan is not None:
        stored.setdefault("num_chunks", record.plan.num_chunks)
        stored.setdefault("chunk_seed", record.plan.seed)
    return stored


def _settings_record(settings: dict[str, Any]) -> dict[str, Any]:
    """`STUDY_SETTINGS` as the study stores them."""
    return {name: asdict(value) if isinstance(value, EvalSettings) else value for name, value in settings.items()}


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _waiting_listed(study: optuna.Study) -> int:
    """Enqueued trials of a list space not started yet."""
    return sum(t.state == TrialState.WAITING and TrialRecord(t).list_index is not None
               for t in study.get_trials(deepcopy=False))


__all__ = ["LeaderboardRow", "Study", "StudyDeletedError", "StudyNameError", "UnitCommitted", "check_study_name",
           "create_study", "load_study"]


def _gang_size(gang_size: Any, data_parallel: DataParallel | None = None) -> int:
    """The gang size a run trains with: the one given, else rfopt's default (1 for a trial over several devices,
    which trains one trial at a time)."""
    if gang_size is None:
        return 1 if data_parallel is not None else DEFAULT_GANG_SIZE
    if not isinstance(gang_size, int) or isinstance(gang_size, bool) or gang_size < 1:
        raise ValueError(f"gang_size={gang_size!r}: give a whole number >= 1 (1 trains one trial at a time)")
    return gang_size
