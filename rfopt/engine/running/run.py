"""The engine's one entry point: `run` carries out a `RunRequest` on a study, here (alone or as one worker beside
others) or on a Ray cluster. `Study.optimize`, `Study.work` and a Ray worker all come here.

A run checks the request against the study before anything is written (`rfopt.engine.planning.checks`), marks its presence
on the study (refusing to run beside a process it cannot share the study with), gives the study its identity and
checkpoint location the first time (`claim_store`), stores its plan and settings once (`record`), then hands the
trials to the driver loop (`rfopt.engine.running.driver`) with a coordinator that says whether other processes share the
study (`rfopt.engine.running.coordinator`).

Checkpoints belong to exactly one study: the study gets an identity (``rfopt:id``) when it first runs, its default
checkpoint location carries it (``rfopt-checkpoints/<name>-<id>`` beside a SQLite file), and the location is marked
as the study's (`CheckpointStore.claim`). Deleting a database and running the same study again starts a new study
with new checkpoints; two databases in one folder with studies of the same name keep apart.

    >>> run(study.optuna, RunRequest(space, train, test, n_trials=8))   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from rfopt.compat import storage_of
from rfopt.config.spaces import ListSpace, as_space
from rfopt.errors import CheckpointError, StudyDeletedError
from rfopt.pruning import describe as pruning_outlook
from rfopt.reports.display import ProgressBar
from rfopt.reports.outcome import outcome
from rfopt.reports.status import state_counts
from rfopt.storage import schema
from rfopt.storage.checkpoints import CheckpointStore, location_exists
from rfopt.storage.database import describe, sqlalchemy_engine_of
from rfopt.storage.files import normalize_location
from rfopt.storage.leases import Leases, Presence
from rfopt.storage.schema import TrialRecord, study_record
from rfopt.training.gang import DEFAULT_GANG_TRAINING
from rfopt.training.models import ModelPool
from rfopt.training.parallel import DataParallelRunner, follow, lead_done
from rfopt.training.trackers import Tracking

from rfopt.engine.outputs.artifacts import publish_unit
from rfopt.engine.planning.checks import CheckedRun, check_run, say_placement
from rfopt.engine.planning.plan import planned_gang_size
from rfopt.engine.planning.request import RunRequest

from .coordinator import ASK_LEASE, LeasedCoordinator, LocalCoordinator
from .driver import drive
from .roster import Roster
from .unit import Context, UnitCommitted

logger = logging.getLogger("rfopt")

PRESENCE_SECONDS = 5.0
"""How often a process running a study stamps its presence (`rfopt.storage.leases.Presence`): a process that died
reads as gone within twice this."""


def run(study: optuna.Study, request: RunRequest, checkpoint_dir: str | None = None) -> None:
    """Carry out `request` on `study` until nothing is left to do here (`Study.optimize` and `Study.work` say what each
    argument means). `checkpoint_dir`: where the study's checkpoints go when it first runs (None: the recorded
    location, else the default one)."""
    if request.executor is not None:  # `rfopt.RayCluster`: the same checks there, then one worker per device
        request.executor.run(study, request, checkpoint_dir)
        return
    pool = ModelPool(request.device, request.precision)  # checks the device before anything is written
    worker = request.worker
    if worker is not None and request.max_concurrent is None:
        space = as_space(request.space)
        if isinstance(space, ListSpace):  # the same for every worker
            request = dataclasses.replace(request, max_concurrent=max(1, min(len(space.configs), 8)))
    checked = check_run(study, request)
    pool.check_room(checked.configs)
    say_placement(pool.placement, checked)
    _say_missing_best(study)
    data_parallel = worker.data_parallel if worker is not None else None
    if data_parallel is not None and not data_parallel.lead:  # follows its group's lead, chunk by chunk
        workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
        try:
            follow(data_parallel, pool, request.train_dataset, workdir)
        finally:
            pool.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:  # a data-parallel lead tells its group when it is done, however it ends
        if worker is None:
            trained = _run_alone(study, checked, pool, checkpoint_dir)
        else:
            trained = _run_as_worker(study, checked, pool, checkpoint_dir)
    finally:
        if data_parallel is not None:
            lead_done(data_parallel)
    if not trained and not checked.timed_out():
        logger.warning("%s", _nothing_done(study, checked.space))


def _say_missing_best(study: optuna.Study) -> None:
    """Warn when a kept best checkpoint better than the recommendation was deleted (`StudyOutcome.missing`)."""
    found = outcome(study)
    if not found.missing:
        return
    now = found.recommendation
    logger.warning("study %r: %s; the recommendation is now %s", study.study_name,
                   "; ".join(m.line(found.objective) for m in found.missing),
                   "none (no kept best checkpoint exists)" if now is None else
                   f"trial {now.trial} after chunk {now.unit + 1} ({now.location})")


def _run_alone(study: optuna.Study, checked: CheckedRun, pool: ModelPool, checkpoint_dir: str | None) -> int:
    request = checked.request
    with _presence(study, "run"):  # refuses to start beside another process on the study: it takes no leases
        store = claim_store(study, checkpoint_dir)
        n_trials = record(study, checked)
        max_concurrent = request.max_concurrent or max(1, min(n_trials or 8, 8))
        with ProgressBar(study.study_name, enabled=request.show_progress_bar, study=study) as progress:
            return _drive(study, checked, store, pool, LocalCoordinator(), max_concurrent, n_trials,
                          progress=progress)


def _run_as_worker(study: optuna.Study, checked: CheckedRun, pool: ModelPool, checkpoint_dir: str | None) -> int:
    request, worker = checked.request, checked.request.worker
    leases = Leases(study)
    with _presence(study, "worker"):  # refuses to start beside an `optimize` (rfopt run), which takes no leases
        with leases.holding(ASK_LEASE, worker.lease_seconds):  # one worker at a time gives the study its identity, plan
            store = claim_store(study, checkpoint_dir)
            n_trials = record(study, checked)
        max_concurrent = request.max_concurrent or max(1, min(request.n_trials_total or n_trials or 8, 8))
        return _drive(study, checked, store, pool, LeasedCoordinator(leases, worker.lease_seconds), max_concurrent,
                      n_trials, poll_seconds=worker.poll_seconds)


def _drive(study: optuna.Study, checked: CheckedRun, store: CheckpointStore, pool: ModelPool, coordinator: Any,
           max_concurrent: int, n_trials: int | None, *, progress: ProgressBar | None = None,
           poll_seconds: float = 1.0) -> int:
    """Drive the study until nothing is left to do here; return how many units this call committed."""
    request = checked.request
    workdir = Path(tempfile.mkdtemp(prefix="rfopt-trainer-"))
    tracking = Tracking(checked.report_to, study) if checked.report_to else None
    committed: list[UnitCommitted] = []
    # What hears each committed unit, in order: the roster first (made below, from the context: the lambda reads it
    # when a unit commits), the unit's record, each tracker's run, the count, the progress bar's line (one per
    # committed unit, a gang's several commits of one round included).
    subscribers = [lambda event: roster.on_commit(event), publish_unit]
    if tracking is not None:  # each committed unit's value and eval metrics in the trial's runs
        subscribers.append(lambda event: tracking.committed(event.trial.number, event.unit, event.value))
    subscribers.append(committed.append)
    if progress is not None:
        subscribers.append(lambda event: progress(roster.progress()))
    data_parallel = request.worker.data_parallel if request.worker is not None else None
    ctx = Context(study=study, store=store, plan=checked.plan, train_dataset=request.train_dataset,
                  eval_dataset=request.eval_dataset, objective=checked.settings.objective,
                  settings=checked.settings.eval_settings, pool=pool, workdir=workdir, tracking=tracking,
                  subscribers=tuple(subscribers),
                  callbacks=(() if request.on_unit is None else
                             (lambda event: request.on_unit(event.trial.number, event.unit, event.value),)),
                  step_listeners=() if progress is None else (progress.step,),
                  **({} if data_parallel is None else
                     {"runner_class": functools.partial(DataParallelRunner, group=data_parallel)}))
    gang_size = planned_gang_size(request.gang, single_run_trackers=tracking.passed_on if tracking is not None else ())
    # The trackers hear of a trial's end first: a user's callback that raises ends the run.
    ended = [tracking.ended] if tracking is not None else []
    roster = Roster(ctx, checked.space, pruner=checked.pruner, callbacks=[*ended, *request.callbacks],
                    catch=request.catch, prune_collapsed=request.prune_collapsed)
    more_to_ask = _more_to_ask(study, checked, n_trials)
    try:
        drive(roster, coordinator, max_concurrent=max_concurrent, more_to_ask=lambda: more_to_ask(roster),
              poll_seconds=poll_seconds, on_progress=progress, deadline=checked.deadline, gang_size=gang_size,
              gang_training=request.gang_training or DEFAULT_GANG_TRAINING)
        if checked.timed_out() and roster.live:
            logger.warning("study %r: timeout reached; trials %s continue from their last committed chunk when "
                           "the study runs again", study.study_name, sorted(roster.live))
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C, or the caller's on_unit calling sys.exit
        logger.warning("study %r: stopped by %s; no trial failed, and each continues from its last committed "
                       "chunk when the study runs again", study.study_name, type(exc).__name__)
        raise
    except Exception as exc:
        if _exists(study):
            raise
        raise StudyDeletedError(
            f"study {study.study_name!r} was deleted from its storage ({describe(storage_of(study))}) while "
            "this process ran it (optuna-dashboard's delete button, or optuna.delete_study): its trials and "
            f"results are gone from the database, and this run stopped. Its checkpoints are still in {store.root} "
            "(delete them if the study is not wanted). Running the study again starts a new one, with a new "
            "identity and new checkpoints"
        ) from exc
    finally:
        for number in list(roster.live):
            roster.live.pop(number).runner.cleanup()
        if tracking is not None:
            tracking.close()
        pool.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return len(committed)


def _more_to_ask(study: optuna.Study, checked: CheckedRun, n_trials: int | None) -> Callable[[Roster], bool]:
    """Whether this run starts another new trial: `n_trials` counts this run's, `n_trials_total` the study's; a
    list space runs its enqueued configs."""
    total = checked.request.n_trials_total

    def more(roster: Roster) -> bool:
        if n_trials is not None and roster.asked >= n_trials:
            return False
        if isinstance(checked.space, ListSpace):
            return _waiting_listed(study) > 0
        if total is not None:
            return started(study) < total
        return True

    return more


def started(study: optuna.Study) -> int:
    """Trials the study started from its space (clones not counted)."""
    return sum(t.state != TrialState.WAITING and TrialRecord(t).lineage is None
               for t in study.get_trials(deepcopy=False))


def _waiting_listed(study: optuna.Study) -> int:
    """Enqueued trials of a list space not started yet."""
    return sum(t.state == TrialState.WAITING and TrialRecord(t).list_index is not None
               for t in study.get_trials(deepcopy=False))


def _exists(study: optuna.Study) -> bool:
    """Whether the study is still in its storage (a person may delete it while it runs)."""
    try:
        storage_of(study).get_study_id_from_name(study.study_name)
    except KeyError:
        return False
    return True


def _presence(study: optuna.Study, kind: str) -> Any:
    """This process's heartbeat on the study while it runs it (`rfopt.storage.leases.Presence`;
    `rfopt.reports.status.liveness` reads it): in an SQL storage, where other processes can look. Entered before anything
    is written, it refuses (`rfopt.storage.leases.StudyBusyError`) to run beside a process it cannot share the study
    with: an `optimize` beside anyone, a worker beside an `optimize`."""
    if sqlalchemy_engine_of(storage_of(study)) is None:
        return nullcontext()
    return Presence(study, kind, interval=PRESENCE_SECONDS, exclusive=True)


def _nothing_done(study: optuna.Study, space: Any) -> str:
    counts = state_counts(study.get_trials(deepcopy=False), shown=False)
    has = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no trials"
    paused = sum(TrialRecord(t).paused for t in study.get_trials(deepcopy=False, states=[TrialState.RUNNING]))
    if paused:
        more = f"{paused} paused trial(s) wait for a resume (rfopt resume N --study {study.study_name})"
    elif isinstance(space, ListSpace):
        more = (f"every one of the list's {len(space)} configs has run; append configs to the list to add "
                "trials, or clone a trial")
    else:
        more = "no trial is left to continue; give n_trials to add trials"
    return f"study {study.study_name!r}: nothing to do ({has}): {more}"


# ---------------------------------------------------------------------- the study's identity, plan and settings
def claim_store(study: optuna.Study, checkpoint_dir: str | None) -> CheckpointStore:
    """Give the study its identity and checkpoint location if it has none, and make the location this study's
    (`CheckpointStore.claim`); check that it takes writes. Workers call it under the study's ask lease."""
    record_ = study_record(study)
    uid = record_.uid or uuid.uuid4().hex
    location = record_.checkpoint_dir or checkpoint_dir or _default_location(study, uid)
    store = CheckpointStore(location)
    store.check_writable()
    store.claim(uid, study.study_name, describe(storage_of(study)), recorded=record_.checkpoint_dir is not None)
    if record_.uid is None or record_.checkpoint_dir is None:
        schema.write_identity(study, uid, normalize_location(location))
    return store


def follow_moved_checkpoints(study: optuna.Study, checkpoint_dir: str | None) -> None:
    """Where a caller gives a checkpoint location other than the one the study recorded: follow it if it holds this
    study's checkpoints (moved there), else refuse (`CheckpointError`) before anything is written."""
    record_ = study_record(study)
    if checkpoint_dir is None or record_.checkpoint_dir in (None, checkpoint_dir):
        return
    owner = CheckpointStore(checkpoint_dir).owner() if location_exists(checkpoint_dir) else None
    if owner is None or owner.get("id") != record_.uid:
        raise CheckpointError(
            f"study {study.study_name!r} keeps its checkpoints in {record_.checkpoint_dir}; this call gives "
            f"{checkpoint_dir}. Leave checkpoint_dir (--checkpoint-dir) out to use the recorded location; to "
            f"move the checkpoints, copy {record_.checkpoint_dir} to {checkpoint_dir} first (its "
            f"rfopt-study.json names this study, so the study then follows it)"
        )
    logger.info("study %r: its checkpoints moved to %s", study.study_name, checkpoint_dir)
    schema.write_checkpoint_dir(study, checkpoint_dir)


def record(study: optuna.Study, checked: CheckedRun) -> int | None:
    """Store the plan and settings the study does not have yet; enqueue a list's configs not run yet. Returns the new
    trials this run starts (for a list given no `n_trials`: the configs not run yet, all of them the first time)."""
    record_ = study_record(study)
    if record_.plan is None:
        schema.write_plan(study, checked.plan)
    schema.write_settings(study, {k: v for k, v in checked.attrs.items() if k not in record_.settings})
    report_to = checked.request.report_to
    if report_to is not None and record_.settings.get("report_to") != checked.report_to:
        schema.write_settings(study, {"report_to": checked.report_to})
    schema.name_metric(study, checked.settings.objective)  # a study planned by an earlier rfopt has no metric name
    n_trials = checked.request.n_trials
    if isinstance(checked.space, ListSpace):
        checked.space.enqueue_missing(study)
        if n_trials is None:
            n_trials = _waiting_listed(study)
    schema.write_run_shape(study, run_shape(study, checked))
    return n_trials


def run_shape(study: optuna.Study, checked: CheckedRun) -> schema.RunShape:
    """How this run trains the study, for anyone who forecasts its time left (`rfopt.reports.forecast`): the pruner's
    schedule over the longest trial's units, the gang size, and the trials the study will have started."""
    epochs = [math.ceil(getattr(c.args, "num_train_epochs", 1) or 1) for c in checked.configs]
    n_steps = checked.plan.num_chunks * max(epochs, default=1)
    request = checked.request
    target = request.n_trials_total
    if target is None and request.n_trials is not None and not isinstance(checked.space, ListSpace):
        target = started(study) + request.n_trials
    return schema.RunShape(pruning_outlook(checked.pruner, n_steps, study.study_name).to_attr(), request.gang, target)


def _default_location(study: optuna.Study, uid: str) -> Path:
    """``rfopt-checkpoints/<name>-<id>`` beside a SQLite file (in the working directory for other file-less
    storages); a server database has none, since hosts do not share a working directory."""
    directory = f"{study.study_name}-{uid[:12]}"
    engine = sqlalchemy_engine_of(storage_of(study))
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
