"""The study API: `create_study`, `load_study`, and `Study.optimize` / `Study.work`, which run trials round-robin.

    >>> study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db", num_chunks=4)  # doctest: +SKIP
    >>> study.optimize(space, train_dataset, eval_dataset, n_trials=8, timeout=3600)  # doctest: +SKIP
    >>> study.best_trial, study.trials_dataframe()                                    # doctest: +SKIP
    >>> study.optuna   # the real optuna.Study: visualization, optuna-dashboard and Optuna's CLI all work

A `Study` is an `optuna.Study` to its user (Optuna's attributes are read from `study.optuna`; trial
ops are `pause_trial`, `resume_trial`, `stop_trial`, `clone_trial`, so that `stop()` is Optuna's)
plus what rfopt keeps on it (`rfopt.storage.schema`): its identity and checkpoint location, its chunk plan
and the settings every trial shares (`rfopt.config.settings.StudySettings`), fixed once.

This module keeps Optuna's signatures and docstrings and delegates at once, as ``optuna/study/study.py`` hands
``optimize`` to ``optuna/study/_optimize.py``: `optimize` and `work` build one `rfopt.engine.planning.request.RunRequest`
and hand it to the engine's one entry point, `rfopt.engine.running.run.run` (its checks: `rfopt.engine.planning.checks`); the trial
ops go to `rfopt.engine.trials.ops`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from rfopt.compat import storage_of
from rfopt.config.settings import EvalSettings, StudySettings
from rfopt.config.trial import TrialConfig
from rfopt.engine.trials import clones, ops
from rfopt.errors import NoSuchTrial, NothingToAnswer, StudyDeletedError, StudyNameError, TypeRefusal
from rfopt.engine.planning.checks import check_pruner, check_study_name
from rfopt.engine.cluster.ray_cluster import RayCluster
from rfopt.engine.planning.request import RunRequest, Worker
from rfopt.engine.running.run import follow_moved_checkpoints, run
from rfopt.engine.running.unit import UnitCommitted
from rfopt.reports.leaderboard import leaderboard as build_leaderboard
from rfopt.reports.outcome import outcome
from rfopt.reports.replicates import ReplicateGroup
from rfopt.reports.results import LeaderboardRow, Recommendation, StudyOutcome
from rfopt.reports.status import Liveness, liveness
from rfopt.pruning import PopulationBasedTraining, optuna_pruner
from rfopt.storage import schema
from rfopt.storage.checkpoints import CheckpointStore, Location, export, location_exists
from rfopt.storage.database import open_storage, sqlalchemy_engine_of
from rfopt.storage.files import is_url, normalize_location
from rfopt.storage.schema import Baseline, TrialRecord, study_record
from rfopt.training.parallel import DataParallel
from rfopt.training.trackers import normalize as trackers_of

logger = logging.getLogger("rfopt")


OPTUNA_ATTRIBUTES = frozenset({
    "best_trial", "best_trials", "best_value", "best_params", "trials", "get_trials", "trials_dataframe",
    "user_attrs", "system_attrs", "set_user_attr", "set_system_attr", "study_name", "direction", "directions",
    "sampler", "metric_names", "set_metric_names",
})
"""What an rfopt `Study` reads from its `optuna.Study`: to its user, it is an Optuna study (its `pruner` is rfopt's:
the same object, unless it is population-based training, which Optuna's study does not hold)."""


class Study:
    """An rfopt study: an `optuna.Study` plus rfopt's chunk plan, objective and checkpoint store.

    `checkpoint_dir` (a directory or an fsspec URL) is where the study's checkpoints go when it first runs; once
    it has run, the study records its location, and a different one is refused unless it holds this study's
    checkpoints (moved there). `pruner` judges the study's rungs (`rfopt.pruning`): an Optuna pruner, or
    `rfopt.PopulationBasedTraining`; None: the Optuna study's own pruner.
    """

    def __init__(self, optuna_study: optuna.Study, checkpoint_dir: str | os.PathLike | None = None, *,
                 pruner: Any = None) -> None:
        self.optuna = optuna_study
        self._requested = None if checkpoint_dir is None else normalize_location(checkpoint_dir)
        self._pruner = pruner if pruner is not None else optuna_study.pruner
        if isinstance(optuna_study.pruner, PopulationBasedTraining):  # made with optuna.create_study(pruner=pbt)
            optuna_study.pruner = optuna_pruner(optuna_study.pruner)  # a NopPruner, as rfopt.create_study gives it
        follow_moved_checkpoints(optuna_study, self._requested)

    @property
    def pruner(self) -> Any:
        """What judges the study's rungs in this process: the pruner it was created or loaded with (an Optuna
        pruner, or `rfopt.PopulationBasedTraining`, whose Optuna study holds a ``NopPruner``)."""
        return self._pruner

    @property
    def checkpoints(self) -> CheckpointStore:
        """The study's checkpoint store (`LookupError` before the study has run and none was given)."""
        location = study_record(self.optuna).checkpoint_dir or self._requested
        if location is None:
            raise NothingToAnswer(f"study {self.study_name!r} has not run yet: it has no checkpoint location")
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
            raise TypeRefusal(f"Study.stop() stops the optimization loop, as in Optuna; to stop trial {args[0]} at its "
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
        gang_training: str | None = None,
        prune_collapsed: bool = False,
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
            report_to: the experiment trackers each trial is logged to, by TRL's ``report_to`` names (``"tensorboard"``,
                ``"wandb"``, ``"mlflow"``, ``"trackio"``, a list, ``"none"``): one run per trial (in gangs too), named
                ``<study>-trial-<n>``, grouped by study, with the trial's params, TRL's step logs, each chunk's value and
                eval metrics and how it ended (`rfopt.training.trackers`). Stored on the study: None takes the stored
                value (none for a new study); a value given replaces it for this and later runs.
            executor: None (train here), or `rfopt.RayCluster(...)`: one worker per device of a Ray cluster trains the
                study (`rfopt.engine.cluster.ray_cluster`), each device its own (`device` is left out); this process shows the progress
                and calls `on_unit` and `callbacks` as units and trials commit and end.
            gang_size: live trials of one base model trained at once, in lockstep, their rollouts decoded in one
                batch (`rfopt.training.gang`; see the README, "Gangs"). 1 trains one trial at a time, exactly as plain TRL;
                None: `rfopt.training.gang.DEFAULT_GANG_SIZE`.
            gang_training: how a gang's members take their training steps (README, "Gangs"): ``"batched"`` (None: the
                default, `rfopt.training.gang.DEFAULT_GANG_TRAINING`: one forward of the shared base for every member's
                rows, each through its own adapter, and one backward; each member keeps its own loss, clipping,
                optimizer and schedule; equal to the sequential mode up to floating-point rounding; it holds every
                member's step activations at once, and a gang that fits in memory only taking its steps one after
                another trains so, said once) or ``"sequential"`` (each member its own forwards and backward, one after
                another, bit for bit as alone).
            prune_collapsed: prune a trial as soon as an evaluation finds its completions collapsed (one text answering
                at least half the eval prompts: `rfopt.training.diversity`), with that reason. Off by default: a
                collapsed checkpoint is never kept as a trial's best nor recommended either way, and the leaderboard
                marks the trial.
        """
        run(self.optuna, RunRequest(
            space, train_dataset, eval_dataset, n_trials=n_trials, n_trials_total=n_trials_total, timeout=timeout,
            callbacks=callbacks, catch=catch, max_concurrent=max_concurrent,
            settings=StudySettings(num_chunks, chunk_seed, objective, eval_settings), device=device,
            precision=precision, on_unit=on_unit, report_to=report_to, gang_size=gang_size,
            gang_training=gang_training, pruner=self._pruner, show_progress_bar=show_progress_bar, executor=executor,
            prune_collapsed=prune_collapsed), self._requested)

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
        gang_training: str | None = None,
        prune_collapsed: bool = False,
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
        run(self.optuna, RunRequest(
            space, train_dataset, eval_dataset, n_trials=n_trials, n_trials_total=n_trials_total, timeout=timeout,
            callbacks=callbacks, catch=catch, max_concurrent=max_concurrent,
            settings=StudySettings(num_chunks, chunk_seed, objective, eval_settings), device=device,
            precision=precision, on_unit=on_unit, report_to=report_to, gang_size=gang_size,
            gang_training=gang_training, pruner=self._pruner, worker=Worker(lease_seconds, poll_seconds, data_parallel),
            prune_collapsed=prune_collapsed), self._requested)

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

    def liveness(self) -> Liveness:
        """Whether a process is running the study now, and which WAITING trials wait for one
        (`rfopt.reports.status.liveness`)."""
        return liveness(self.optuna)

    def withdraw_request(self, trial_number: int, op: str) -> None:
        """Take back a pending ``"pause"``, ``"resume"`` or ``"stop"`` on a running trial before it applies; refused
        (`rfopt.engine.trials.ops.OpError`) if none is pending or it applied already."""
        ops.withdraw(self.optuna, trial_number, op)

    def cancel_clone(self, trial_number: int) -> None:
        """Cancel a WAITING clone before any process starts it: it leaves the queue and ends FAIL, ``cancelled by ...``.
        Refused (`rfopt.engine.trials.ops.OpError`) for any other trial, or if a process started it first (stop it instead)."""
        ops.cancel(self.optuna, trial_number)

    def clone_trial(self, trial_number: int, overrides: dict[str, Any] | None = None, *,
                    warm_start: bool = False) -> int:
        """Enqueue a copy of a trial with `overrides` (validated first); returns the clone's trial number.

        With `warm_start` the clone starts from the parent's latest checkpoint (weights; a fresh LR schedule over
        the remaining steps) and reports at the parent's step numbers onward. A running `optimize` picks it up
        when a slot frees; otherwise the next `optimize` call does.
        """
        made = clones.clone_in_study(self.optuna, trial_number, overrides or {}, warm_start=warm_start)
        for note in made.notes:
            logger.warning("clone of trial %d: %s", trial_number, note)
        return made.number

    def confirm(self, top: int = 3, seeds: int = 2, *, prune: bool = False) -> list[int]:
        """Enqueue replicates of the `top` best configs: each trained again with `seeds` new seeds, as new Optuna
        trials linked to their original (`rfopt.engine.trials.replicates`); returns the new trials' numbers.

        A replicate's Optuna params are its original's (to Optuna, the same config); its seed is its config's
        ``args.seed``, and ``study.replicates()`` says whose replicate it is. A running `optimize` / `work` picks
        them up when a slot frees; otherwise the next call does (``rfopt run`` again, for a study file). They run to
        their end, never pruned, unless `prune` (then the run's pruner judges them at rungs as any trial). Asked
        again, it makes only the replicates missing (after a crash, or to add seeds: ``seeds=4`` tops each config up
        to four). The answer then reads across seeds (`replicates`, `outcome`).

            >>> study.confirm(top=2, seeds=2)                                          # doctest: +SKIP
            [8, 9, 10, 11]
            >>> study.optimize(configs, train, test)  # trains them                    # doctest: +SKIP
        """
        from rfopt.engine.trials.replicates import confirm

        return [made.number for made in confirm(self.optuna, top, seeds, prune=prune)]

    def replicates(self) -> list[ReplicateGroup]:
        """The configs run with several seeds (`confirm`), best mean first: each with its runs (its original trial
        first), their best values, the mean and its between-seed standard error (`rfopt.reports.replicates`)."""
        from rfopt.reports.replicates import groups

        return groups(self.optuna.get_trials(deepcopy=False),
                      self.optuna.direction == optuna.study.StudyDirection.MAXIMIZE)

    # ------------------------------------------------------------------ results
    def leaderboard(self) -> list[LeaderboardRow]:
        """Every trial, best first: finished trials by value, then the rest by progress; each with what it is doing, its
        value's noise, its difference from its baseline, its best checkpoint and what went wrong
        (`rfopt.reports.leaderboard`; each row a `rfopt.reports.results.LeaderboardRow`)."""
        return build_leaderboard(self.optuna)

    def leaderboard_text(self) -> str:
        """The leaderboard as text (`leaderboard`), the baselines first, a tie marked where the best trial's lead over
        the runner-up is within noise, and the recommendation under it."""
        from rfopt.reports.display import format_leaderboard

        from rfopt.reports.lead import lead

        trials = self.optuna.get_trials(deepcopy=False)
        found = outcome(self.optuna, trials)
        ahead = lead(trials, self.optuna.directions[0], found.objective) if len(self.optuna.directions) == 1 else None
        return format_leaderboard(build_leaderboard(self.optuna, trials, found), found.objective,
                                  list(found.baselines.values()), found.lines(), found.baseline_purposes(), ahead)

    def outcome(self) -> StudyOutcome:
        """What the study produced (`rfopt.reports.results.StudyOutcome`, computed by `rfopt.reports.outcome`): its baselines, each trial's best
        checkpoint, collapse and degradation, the recommendation, and Optuna's best trial."""
        return outcome(self.optuna)

    def baselines(self) -> list[Baseline]:
        """The study's base models evaluated with no adapter on its eval set, before any trial on them trained: the
        reference its values compare with (one per base model, reward functions and completion budget)."""
        return list(study_record(self.optuna).baselines.values())

    def recommendation(self) -> Recommendation | None:
        """The adapter the study recommends: the best checkpoint over all its trials (pruned ones included), with its
        trial, chunk and value, never one whose completions had collapsed (`rfopt.reports.outcome`); None before a trial
        has one. What `export_best` writes. Optuna's ``best_trial`` is the best *last* value among COMPLETE trials: the
        two differ when a trial degraded after its best chunk, or a pruned trial's checkpoint is the best.

            >>> rec = study.recommendation()                                     # doctest: +SKIP
            >>> rec.trial, rec.unit + 1, rec.value, rec.location                 # doctest: +SKIP
            (1, 2, 1.890625, '.../trial-00001/best')
        """
        return self.outcome().recommendation

    def best_adapter(self, *, best_trial: bool = False) -> Location:
        """Directory of the recommended adapter (PEFT format, `recommendation`): a `Path`, or a URL in an object store.
        With `best_trial`, Optuna's best trial's final adapter instead."""
        if best_trial:
            if not self.optuna.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
                raise NothingToAnswer(f"study {self.study_name!r} has no finished trial yet")
            best = self.optuna.best_trial
            record = TrialRecord(best)
            number, path, what = best.number, record.adapter, "its adapter"
            if path is None and record.told_outside is not None:
                raise NothingToAnswer(f"trial {best.number}, the best, was {record.told_outside}: nothing to export")
        else:
            recommended = self.recommendation()
            if recommended is None:
                raise NothingToAnswer(f"study {self.study_name!r} has no checkpoint to recommend yet (none of its trials has "
                                  "committed a chunk whose completions had not collapsed); export_best(path, "
                                  "best_trial=True) exports Optuna's best trial's final adapter")
            number, path, what = recommended.trial, recommended.location, "its best checkpoint"
        if path is None or not location_exists(path):
            raise NothingToAnswer(f"trial {number}: {what} is not in the checkpoint store ({path})")
        return path if is_url(path) else Path(path)

    def export_best(self, path: str | os.PathLike, *, best_trial: bool = False, overwrite: bool = False) -> Path:
        """Copy the recommended adapter (`recommendation`: the best checkpoint over all trials; PEFT format, with its
        tokenizer) to the local directory `path`, downloading it from an object store if the study's checkpoints are
        there. With `best_trial`, Optuna's best trial's final adapter (the last chunk of the best COMPLETE trial).

        `path` must be a new or empty folder: a file, the working directory and a folder that is not empty are refused
        (`rfopt.Refusal`), the last unless ``overwrite=True``, which still never removes a folder holding the study's
        SQLite file, its checkpoint store or the adapter itself. The copy is checked, then renamed into place: a
        damaged adapter or a failed copy leaves `path` as it was (`rfopt.storage.checkpoints.export`)."""
        source = self.best_adapter(best_trial=best_trial)
        return export(source, path, overwrite=overwrite, keep=self._own_files())

    def _own_files(self) -> dict[str, Path]:
        """The study's files on this machine that an export never removes: its SQLite file and its checkpoint store."""
        own: dict[str, Path] = {}
        engine = sqlalchemy_engine_of(storage_of(self.optuna))
        if engine is not None and engine.url.get_backend_name() == "sqlite" \
                and engine.url.database not in (None, "", ":memory:"):
            own["the study's SQLite file"] = Path(os.path.abspath(engine.url.database))
        store = study_record(self.optuna).checkpoint_dir or self._requested
        if store is not None and not is_url(store):
            own["the study's checkpoint store"] = Path(os.path.abspath(normalize_location(store)))
        return own

    @property
    def best_config(self) -> TrialConfig:
        """Optuna's best trial's config as it was trained (its stored ``rfopt:config``, what ``export_best(path,
        best_trial=True)``'s adapter was trained with; the recommended adapter's is
        ``study.trial_config(study.recommendation().trial)``). Where Optuna's params cannot say it (a clone's model, or
        another categorical value the study's param had no choice for: `best_params` then names an alternate param,
        ``model#2``), this does.

            >>> study.best_config.model, study.best_config.args.learning_rate           # doctest: +SKIP
        """
        if not self.optuna.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
            raise NothingToAnswer(f"study {self.study_name!r} has no finished trial yet")
        return self.trial_config(self.optuna.best_trial.number)

    def trial_config(self, number: int) -> TrialConfig:
        """Trial `number`'s config as it was trained (its stored ``rfopt:config``); `rfopt.errors.NoSuchTrial` (an
        ``IndexError``) if the study has no trial `number`."""
        stored = TrialRecord(self._trial(number)).config_json
        if stored is None:
            raise NothingToAnswer(f"trial {number} has no rfopt config")
        return TrialConfig.from_json(stored)

    def chunk_metrics(self, number: int) -> list[dict[str, Any]]:
        """Per-chunk training and eval metrics stored on trial `number`, in chunk order."""
        record = TrialRecord(self._trial(number))
        return [record.raw_metrics(m.unit) for m in record.unit_metrics()]

    def _trial(self, number: int) -> FrozenTrial:
        """Trial `number`, or `NoSuchTrial` naming the numbers the study has."""
        trials = self.optuna.get_trials(deepcopy=False)
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < len(trials):
            held = f"trials 0..{len(trials) - 1}" if trials else "no trial yet"
            raise NoSuchTrial(f"study {self.study_name!r} has no trial {number!r}: it holds {held}")
        return trials[number]


# ---------------------------------------------------------------------- module API
def create_study(
    study_name: str | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | PopulationBasedTraining | None = None,
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
    pruner, which rfopt applies at rung boundaries (see `rfopt.pruning`), or `rfopt.PopulationBasedTraining` (the
    Optuna study then holds a ``NopPruner``; `Study.pruner` is the one given). Checkpoints go to `checkpoint_dir`
    (default: ``rfopt-checkpoints/<study name>-<study id>`` beside a SQLite file; a study in a server database
    such as PostgreSQL needs one that every host can reach).
    """
    check_study_name(study_name)
    check_pruner(pruner)
    given = StudySettings(num_chunks, chunk_seed, objective, eval_settings)
    trackers = None if report_to is None else trackers_of(report_to)
    storage = open_storage("sqlite:///rfopt.db" if storage is None else storage)  # "" is refused, not the default
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=sampler,
        pruner=optuna_pruner(pruner),
        direction=direction,
        load_if_exists=load_if_exists,
    )
    made = Study(study, checkpoint_dir, pruner=pruner)
    record = study_record(study)
    given.resolved(StudySettings.from_attrs(record.settings, record.plan), study.study_name)  # refuses another value
    schema.write_settings(study, {name: value for name, value in given.to_attrs().items()
                                  if name not in record.settings})
    if trackers is not None and record.settings.get("report_to") != trackers:
        schema.write_settings(study, {"report_to": trackers})
    return made


def load_study(
    study_name: str | None,
    storage: str | optuna.storages.BaseStorage,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | PopulationBasedTraining | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
) -> Study:
    """Load an existing study (its checkpoint location is read from the study)."""
    storage = open_storage(storage, create=False)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=optuna_pruner(pruner))
    except KeyError as exc:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise NothingToAnswer(f"no study named {study_name!r} in this storage; it holds {names or 'no studies'}") from exc
    return Study(study, checkpoint_dir, pruner=pruner)


__all__ = ["Study", "StudyDeletedError", "StudyNameError", "UnitCommitted", "check_study_name",
           "create_study", "load_study"]
