"""The study API: `create_study`, `load_study`, and `Study.optimize` / `Study.work`, which run trials round-robin.

    >>> study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db")   # doctest: +SKIP
    >>> study.optimize(space, train_dataset, eval_dataset, n_trials=8, num_chunks=4)  # doctest: +SKIP
    >>> print(study.leaderboard_text())                                               # doctest: +SKIP
    >>> study.optuna   # the real optuna.Study: visualization, optuna-dashboard and Optuna's CLI all work

A `Study` is an `optuna.Study` plus what rfopt keeps on it (`rfopt.schema`): its identity and
checkpoint location, its chunk plan and the settings every trial shares. `optimize` (one process)
and `work` (one of several workers) check their arguments against the study, plan it once, then hand
the run to the driver loop (`rfopt.driver`), with a coordinator that says whether other processes
share the study (`rfopt.coordinator`). Each unit of work goes through the unit pipeline
(`rfopt.unit`); storage is reconciled by `rfopt.roster`.

Checkpoints belong to exactly one study: the study gets an identity (``rfopt:id``) when it first runs,
its default checkpoint location carries it (``rfopt-checkpoints/<name>-<id>`` beside a SQLite file),
and the location is marked as the study's (`CheckpointStore.claim`). Deleting a database and running
the same study again starts a new study with new checkpoints; two databases in one folder with
studies of the same name keep apart.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from . import compat, ops, schema
from .artifacts import publish_unit
from .checkpoints import CheckpointError, CheckpointStore, Location, download, is_url, location_exists, normalize_location
from .chunks import ChunkPlan, PlanError, dataset_fingerprint, trial_schedule
from .compat import storage_of
from .config import ConfigError, TrialConfig, importing_user_file, study_on_import
from .coordinator import ASK_LEASE, LeasedCoordinator, LocalCoordinator
from .display import Progress
from .driver import drive
from .evaluation import EvalSettings, reward_columns, reward_name
from .models import ModelPool
from .roster import Roster
from .schema import TrialRecord, study_record
from .spaces import ListSpace, as_space
from .storage import describe, engine_of, open_storage
from .unit import Context, UnitCommitted

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


@dataclass(frozen=True)
class _Plan:
    """What `optimize` / `work` checked before anything is written, and write once the arguments are good."""

    space: Any
    plan: ChunkPlan
    settings: EvalSettings
    settings_record: dict[str, Any]
    n_trials: int | None
    max_concurrent: int | None


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
    def study_name(self) -> str:
        return self.optuna.study_name

    @property
    def checkpoints(self) -> CheckpointStore:
        """The study's checkpoint store (`LookupError` before the study has run and none was given)."""
        location = study_record(self.optuna).checkpoint_dir or self._requested
        if location is None:
            raise LookupError(f"study {self.study_name!r} has not run yet: it has no checkpoint location")
        return CheckpointStore(location)

    # ------------------------------------------------------------------ running
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
        precision: str = "auto",
        chunk_seed: int = 0,
        show_progress_bar: bool = True,
        on_unit: Callable[[int, int, float], None] | None = None,
    ) -> None:
        """Train the space's trials round-robin, chunk by chunk, reporting each chunk's evaluation to Optuna.

        Args:
            space: a function ``trial -> TrialConfig``, a list of `TrialConfig`, or `rfopt.grid(...)`. Before anything
                is stored, a function is called once on a scratch trial of an in-memory study, and its config is
                checked against the chunk plan, the objective and the datasets' columns; a list's configs are all
                checked, and against what the study ran (a config that ran cannot change; new ones are appended).
            train_dataset, eval_dataset: `datasets.Dataset` with a ``prompt`` column (plus any columns the
                reward functions read, e.g. ``answer``).
            n_trials: trials to run in this call (default: the length of a list space; required for a function).
            num_chunks: chunks the training set is split into (fixed for the study once chosen).
            max_concurrent: live trials time-sliced at once (default: ``min(n_trials, 8)``).
            objective: ``"reward"`` (mean weighted total reward on the eval set) or a reward function's name.
            eval_settings: generation settings of the per-chunk evaluation (greedy by default).
            device: ``"cpu"`` or ``"cuda"`` / ``"cuda:1"``: where every trial's chunks train, whatever the trial
                configs say (their ``use_cpu``, ``bf16`` and ``fp16`` are not used).
            precision: ``"auto"`` (fp32 on the CPU, bf16 on a GPU that has it), ``"fp32"``, ``"bf16"`` or ``"fp16"``.
            on_unit: called after each committed unit with ``(trial_number, step, value)``.
        """
        pool = ModelPool(device, precision)  # checks the device before anything is written
        checked = self._check(space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective,
                              eval_settings, chunk_seed)
        store = self._claim()
        space, n_trials = self._record(checked)
        max_concurrent = checked.max_concurrent or max(1, min(n_trials, 8))
        with Progress(self.study_name, enabled=show_progress_bar) as progress:
            trained = self._run(space, checked, store, pool, train_dataset, eval_dataset, objective, on_unit,
                                LocalCoordinator(), max_concurrent, progress=progress,
                                more_to_ask=lambda roster: roster.asked < n_trials)
        if not trained:
            logger.warning("%s", self._nothing_done(space))

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
        precision: str = "auto",
        chunk_seed: int = 0,
        lease_seconds: float = 30.0,
        poll_seconds: float = 1.0,
        on_unit: Callable[[int, int, float], None] | None = None,
    ) -> None:
        """Join the study as one worker beside others (processes, devices or hosts sharing its storage).

        Takes the same arguments as `optimize`, with two differences: `n_trials` is the study's total (with a
        function space; a list space runs its configs), and every unit is trained under a lease on its trial
        (`rfopt.leases`): renewed while it trains, and checked in the transaction that commits the unit, so a
        worker whose lease expired cannot commit; one whose heartbeat finds its lease taken stops the chunk at the
        next step. A unit whose worker died is trained by another once the lease expires (`lease_seconds`).
        Returns when no trial is left to train (paused trials wait for a resume).

            >>> study.work(space, train, test, n_trials=16, num_chunks=4, device="cuda:1")   # doctest: +SKIP
        """
        from .leases import Leases

        if lease_seconds <= 0 or poll_seconds <= 0:
            raise ValueError(f"lease_seconds and poll_seconds must be > 0, got {lease_seconds} and {poll_seconds}")
        pool = ModelPool(device, precision)  # checks the device before anything is written
        if max_concurrent is None and isinstance(as_space(space), ListSpace):  # the same for every worker
            max_concurrent = max(1, min(len(as_space(space).configs), 8))
        checked = self._check(space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective,
                              eval_settings, chunk_seed)
        leases = Leases(self.optuna)
        with leases.holding(ASK_LEASE, lease_seconds):  # one worker at a time gives the study its identity and plan
            store = self._claim()
            space, _ = self._record(checked)
        if isinstance(space, ListSpace):
            def more_to_ask(roster: Roster) -> bool:
                return _waiting_listed(self.optuna) > 0
        else:
            def more_to_ask(roster: Roster) -> bool:
                started = sum(t.state != TrialState.WAITING and TrialRecord(t).lineage is None
                              for t in self.optuna.get_trials(deepcopy=False))
                return started < n_trials
        max_concurrent = checked.max_concurrent or max(1, min(n_trials or 1, 8))
        trained = self._run(space, checked, store, pool, train_dataset, eval_dataset, objective, on_unit,
                            LeasedCoordinator(leases, lease_seconds), max_concurrent, more_to_ask=more_to_ask,
                            poll_seconds=poll_seconds)
        if not trained:
            logger.warning("%s", self._nothing_done(space))

    def _run(self, space, checked, store, pool, train_dataset, eval_dataset, objective, on_unit, coordinator,
             max_concurrent, *, more_to_ask, progress=None, poll_seconds: float = 1.0) -> int:
        """Drive the study until nothing is left to do here; return how many units this call committed."""
        workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
        ctx = Context(study=self.optuna, store=store, plan=checked.plan, train_dataset=train_dataset,
                      eval_dataset=eval_dataset, objective=objective, settings=checked.settings, pool=pool,
                      workdir=workdir, subscribers=[publish_unit])
        if on_unit is not None:
            ctx.callbacks.append(lambda event: on_unit(event.trial.number, event.unit, event.value))
        committed = []
        ctx.subscribers.append(committed.append)
        roster = Roster(ctx, space)
        try:
            drive(roster, coordinator, max_concurrent=max_concurrent, more_to_ask=lambda: more_to_ask(roster),
                  poll_seconds=poll_seconds, on_progress=progress)
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C, or user code (a reward function) calling sys.exit
            logger.warning("study %r: stopped by %s; no trial failed, and each continues from its last committed "
                           "chunk when the study runs again", self.study_name, type(exc).__name__)
            raise
        finally:
            for number in list(roster.live):
                roster.live.pop(number).runner.cleanup()
            pool.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return len(committed)

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
    def _check(self, space, train_dataset, eval_dataset, n_trials, num_chunks, max_concurrent, objective,
               eval_settings, chunk_seed) -> _Plan:
        """Check the arguments of `optimize`/`work` against each other and the study; nothing is written."""
        script = importing_user_file()
        if script is not None:  # what the check of the file's top level (`config.study_on_import`) could not see
            raise study_on_import(script, "a study run reached while importing it")
        space = as_space(space)
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 0):
            raise ValueError(f"n_trials must be a whole number >= 0, got {n_trials!r}")
        if n_trials is None and not isinstance(space, ListSpace):
            raise ValueError("n_trials is required when the search space is a function")
        if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
            raise ValueError(f"max_concurrent must be a whole number >= 1, got {max_concurrent!r}")
        if not isinstance(objective, str):
            raise TypeError(f"objective must be 'reward' or a reward function's name, got {objective!r}")
        if eval_settings is not None and not isinstance(eval_settings, EvalSettings):
            raise TypeError(f"eval_settings must be an rfopt.EvalSettings, got {type(eval_settings).__name__}")
        _check_pruner(self.optuna.pruner)
        settings = eval_settings or EvalSettings()
        record = study_record(self.optuna)
        plan = record.plan
        if plan is not None:
            if (plan.num_chunks, plan.num_rows, plan.seed) != (num_chunks, len(train_dataset), chunk_seed):
                raise PlanError(
                    f"study {self.study_name!r} was planned with {plan.to_dict()}; this call asks for "
                    f"num_chunks={num_chunks}, {len(train_dataset)} rows, chunk_seed={chunk_seed}. "
                    "Use the same values to continue it, or a new study name"
                )
        else:
            plan = ChunkPlan.build(len(train_dataset), num_chunks, chunk_seed)
        wanted = {"objective": objective, "eval_settings": asdict(settings),
                  "train_fingerprint": dataset_fingerprint(train_dataset),
                  "eval_fingerprint": dataset_fingerprint(eval_dataset)}
        for name, value in wanted.items():
            if name in record.settings and record.settings[name] != value:
                raise ValueError(f"study {self.study_name!r}: {_SETTING_CHANGED[name](record.settings[name], value)}; "
                                 "trials would not be comparable. Use the same one to continue the study, or a new "
                                 "study name")
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
            configs = [] if sample is None else [("the search space function's config", sample)]
        for where, config in configs:  # refuse what would fail every trial before training anything
            label = f"configs[{where}]" if isinstance(where, int) else where
            try:
                if isinstance(where, int):  # a function's configs vary: each is validated as its trial starts
                    config.validate()
                    config.to_json()
                trial_schedule(plan, config.resolved_grpo())
                _check_objective(objective, config)
                _check_columns(config, train_dataset, "train_dataset")
                _check_columns(config, eval_dataset, "eval_dataset")
            except (ConfigError, PlanError, ValueError) as exc:
                raise type(exc)(f"{label}: {exc}") from exc
        return _Plan(space, plan, settings, wanted, n_trials, max_concurrent)

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
        n_trials = checked.n_trials
        if isinstance(checked.space, ListSpace):
            checked.space.enqueue_missing(self.optuna)
            if n_trials is None:  # the configs not run yet (all of them, the first time)
                n_trials = _waiting_listed(self.optuna)
        return checked.space, n_trials

    # ------------------------------------------------------------------ ops
    def pause(self, trial_number: int) -> None:
        """Pause a running trial at its next chunk boundary (it stays RUNNING in Optuna, unscheduled)."""
        ops.request(self.optuna, trial_number, "pause")

    def resume(self, trial_number: int) -> None:
        """Resume a paused trial; it continues exactly where it was."""
        ops.request(self.optuna, trial_number, "resume")

    def stop(self, trial_number: int) -> None:
        """Stop a running trial at its next chunk boundary: it ends PRUNED with its last value."""
        ops.request(self.optuna, trial_number, "stop")

    def clone(self, trial_number: int, overrides: dict[str, Any] | None = None, *, warm_start: bool = False) -> int:
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
                    state=t.state.name,
                    value=record.value,
                    chunks_done=len(t.intermediate_values),
                    params=dict(t.params),
                    adapter=record.adapter,
                    reason=record.end_reason,
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

    def trial_config(self, number: int) -> TrialConfig:
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
) -> Study:
    """Create (or, with `load_if_exists`, load) a study, exactly as `optuna.create_study` would.

    `storage` defaults to a SQLite file ``rfopt.db`` in the working directory. `pruner` is any Optuna
    pruner; rfopt applies it at rung boundaries (see `rfopt.pruning`). Checkpoints go to `checkpoint_dir`
    (default: ``rfopt-checkpoints/<study name>-<study id>`` beside a SQLite file; a study in a server database
    such as PostgreSQL needs one that every host can reach).
    """
    _check_pruner(pruner)
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
    """Load an existing study (its checkpoint location is read from the study)."""
    storage = open_storage(storage, create=False)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError as exc:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise LookupError(f"no study named {study_name!r} in this storage; it holds {names or 'no studies'}") from exc
    return Study(study, checkpoint_dir)


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
    for func in config.rewards:
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


def _sample_config(space: Any, direction: Any) -> TrialConfig | None:
    """A config of a function space, from one call on a scratch in-memory trial (nothing is stored), to check the
    study before it starts; None if the function raises there (a trial it fails on fails alone, with the reason)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(direction=direction, sampler=optuna.samplers.RandomSampler(seed=0))
        config = space.function(scratch.ask())
    except Exception as exc:  # noqa: BLE001 - checked again, trial by trial, when the study runs
        logger.debug("the search space function raised on a scratch trial (%s); not checked before the run", exc)
        return None
    finally:
        optuna.logging.set_verbosity(verbosity)
    if not isinstance(config, TrialConfig):
        raise ConfigError(
            f"the search space function returned {type(config).__name__}; it must return an rfopt.TrialConfig"
        )
    return config


_SETTING_CHANGED = {
    "objective": lambda old, new: f"it was run with objective={old!r}, this call gives {new!r}",
    "eval_settings": lambda old, new: f"it was run with eval_settings={old}, this call gives {new}",
    "train_fingerprint": lambda old, new: (f"this call's train_dataset is not the one it was run with (fingerprint "
                                           f"{new}, recorded {old})"),
    "eval_fingerprint": lambda old, new: (f"this call's eval_dataset is not the one its trials were evaluated on "
                                          f"(fingerprint {new}, recorded {old})"),
}


def _waiting_listed(study: optuna.Study) -> int:
    """Enqueued trials of a list space not started yet."""
    return sum(t.state == TrialState.WAITING and TrialRecord(t).list_index is not None
               for t in study.get_trials(deepcopy=False))


__all__ = ["LeaderboardRow", "Study", "UnitCommitted", "create_study", "load_study"]
