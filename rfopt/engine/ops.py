"""Control operations on trials: pause, resume, stop, clone.

Ops travel through the study's storage, so any process can steer a study that another process is
running (the Python API, the ``rfopt`` command line, the dashboard):

- pause, resume, stop are *requests*: each is written once, under a key of its own, on the running
  trial (`schema.Request`), and never rewritten, so two requests made at the same moment are both
  kept. The process running the trial applies every pending request, oldest first, at the trial's
  next chunk boundary (`apply_requests`), and records each one applied, by its id, in the trial's
  ``rfopt:ops`` history; a request is pending until its id is there. So none is lost (a stop that
  arrives while a pause is being applied is applied next) and none is applied twice.
  pause: the trial stays RUNNING in Optuna but is not scheduled; its device memory is freed (it
  continues from its checkpoint on resume, exactly). resume: it is scheduled again. stop: it ends
  PRUNED with its last value, reason ``stopped by user``.
- withdraw: take back a pending pause, resume or stop before it applies (`withdraw`). The process applying a trial's
  requests and a withdrawal take the same short lock on the trial's requests (a lease in the study's SQL database,
  `rfopt.storage.leases`), so a withdrawal either comes first (the request never applies) or finds the request applied and
  is refused: never both.
- cancel: end a WAITING clone before any process starts it (`cancel`). Optuna cannot delete a trial; the clone is
  claimed from the queue exactly as a process starting it would claim it (WAITING -> RUNNING, a compare-and-set in
  the storage), then ends FAIL with its reason ``cancelled by ... at ...``. If a process started it first, the
  cancel is refused and nothing is written.
- clone: a new trial with the parent's config changed by overrides (validated before anything is
  written), optionally warm-started from the parent's latest checkpoint (its weights; a fresh LR
  schedule over the remaining steps; it reports at the parent's step numbers onward). Lineage is
  stored on the clone.

    >>> study.pause_trial(3); study.resume_trial(3); study.stop_trial(4)      # doctest: +SKIP
    >>> study.withdraw_request(4, "stop"); study.cancel_clone(7)              # doctest: +SKIP
    >>> study.clone_trial(3, {"learning_rate": 2e-6}, warm_start=True)        # doctest: +SKIP
    7
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.compat import storage_of, trial_id_of
from rfopt.config.overrides import override_dict
from rfopt.config.params import admits, field_path, param_holding, param_name, param_value
from rfopt.config.trial import TrialConfig, check_model
from rfopt.errors import ConfigError, Refusal
from rfopt.storage import crashpoints, schema
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.leases import requests_lock, seen_on
from rfopt.storage.schema import AppliedOp, Cancel, Lineage, Request, Stop, TrialRecord, TrialRef, Withdrawal

logger = logging.getLogger("rfopt")

# LoRA fields a warm-started clone may change: they do not change the adapter's weight shapes.
_WARM_SAFE_PEFT_FIELDS = {"lora_alpha", "lora_dropout"}


class OpError(Refusal):
    """An op that cannot apply: unknown or finished trial, conflicting op, bad overrides."""


# ---------------------------------------------------------------------- who is running the study
@dataclass(frozen=True)
class Liveness:
    """Whether any process is running a study now (from the heartbeats of `rfopt.storage.leases.Presence`), and what waits for
    one.

        >>> rfopt.engine.ops.liveness(study.optuna).message                          # doctest: +SKIP
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


def liveness(study: optuna.Study, trials: list[optuna.trial.FrozenTrial] | None = None) -> Liveness:
    """Whether a process (`Study.optimize`, or workers) is running `study`: one whose heartbeat is younger than two
    intervals (a process that died reads as gone within that; one that exited cleanly at once). `trials`: the
    study's trials where the caller has read them already (the dashboard's page)."""
    seen = seen_on(study)
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    waiting = [t.number for t in trials if t.state == TrialState.WAITING]
    if seen is None:
        return Liveness(False, [], None, [], "this storage keeps no heartbeats (no SQL database): whether a process "
                        "runs the study cannot be told")
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


@dataclass(frozen=True)
class StudySummary:
    """One study of a storage at a glance: its trials by state, its best value, whether a process runs it."""

    name: str
    study_id: int
    planned: bool
    """Whether rfopt planned it (a study rfopt never ran is a plain Optuna study)."""
    counts: dict[str, int]
    """Trials by the state a person is shown (`TrialRecord.shown_state`)."""
    best: tuple[int, float] | None
    """(trial, value) of Optuna's best trial; None before one completes (or for several objectives)."""
    live: Liveness

    @property
    def finished(self) -> bool:
        """Nothing left to train or start: no RUNNING or WAITING trial."""
        return not self.counts.get("RUNNING") and not self.counts.get("WAITING")

    @property
    def status(self) -> str:
        """``running``, ``idle`` (nobody runs it, and it has trials left) or ``finished``."""
        return "running" if self.live.running else "finished" if self.finished else "idle"

    def line(self) -> str:
        """``demo: 2 running, 5 pruned, 1 complete; best 0.8123 (trial 4); running: host:12 (run)``."""
        best = "-" if self.best is None else f"{self.best[1]:.4f} (trial {self.best[0]})"
        status = self.live.message if self.live.running else self.status
        return f"{self.name}: {tally(self.counts)}; best {best}; {status}"


STATE_ORDER = ("RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL", "CANCELLED")
"""The order trial states are listed in for people: live first."""


def state_counts(trials: Iterable[optuna.trial.FrozenTrial]) -> dict[str, int]:
    """Trials by the state a person is shown (`TrialRecord.shown_state`)."""
    counts: dict[str, int] = {}
    for t in trials:
        state = TrialRecord(t).shown_state
        counts[state] = counts.get(state, 0) + 1
    return counts


def tally(counts: Mapping[str, int]) -> str:
    """``2 running, 5 pruned, 1 complete`` (``no trials`` for none), live states first."""
    rank = {state: i for i, state in enumerate(STATE_ORDER)}
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
        counts = state_counts(trials)
        best = None
        if len(study.directions) == 1 and any(t.state == TrialState.COMPLETE for t in trials):
            best = (study.best_trial.number, study.best_value)
        out.append(StudySummary(frozen.study_name, study_id_of(frozen), schema.study_record(frozen).planned, counts,
                                best, liveness(study, trials)))
    return out


def _local_time(when: datetime.datetime) -> str:
    local = when.astimezone()
    today = datetime.datetime.now().astimezone().date()
    return local.strftime("%H:%M:%S" if local.date() == today else "%Y-%m-%d %H:%M:%S")


def halt(study: optuna.Study, by: str | None = None) -> schema.Halt:
    """Ask every process running `study` to stop at its trials' next chunk boundary (``rfopt halt``, the dashboard's
    "Stop the study"): the chunks in flight commit, and every unfinished trial stays RUNNING, to be continued by the
    next run. A process started after the request runs. Refused when nobody runs the study."""
    seen = liveness(study)
    if not seen.running:
        raise OpError(f"study {study.study_name!r}: {seen.message}; nothing to stop")
    request = schema.Halt(by=by or schema.who(), at=time.time())
    schema.write_halt(study, request)
    return request


# ---------------------------------------------------------------------- requests
def request(study: optuna.Study, trial_number: int, op: str, by: str | None = None) -> Request:
    """Ask for `op` (pause, resume, stop) on a running trial; it applies at the trial's next chunk boundary."""
    if op not in schema.CONTROL_OPS:
        raise OpError(f"unknown op {op!r}; use one of {', '.join(schema.CONTROL_OPS)} (or clone)")
    record = TrialRecord(_running_trial(study, trial_number, op))
    after = outcome(record.paused, record.pending)
    if after.stop:
        raise OpError(f"trial {trial_number} is being stopped; a {op} cannot follow a stop")
    if op == "pause" and after.paused:
        raise OpError(f"trial {trial_number} is already paused")
    if op == "resume" and not after.paused:
        raise OpError(f"trial {trial_number} is not paused; only a paused trial can be resumed")
    req = Request.new(op, by)
    schema.write_request(TrialRef.of(study, record.trial), req)
    return req


@dataclass(frozen=True)
class Outcome:
    """Where a trial's requests leave it: paused or not, stopped (by which request) or not."""

    paused: bool
    stop: Request | None = None
    applied: list[Request] = field(default_factory=list)


def outcome(paused: bool, pending: list[Request]) -> Outcome:
    """Apply `pending` requests, oldest first, to a trial that is `paused` or not (nothing is written)."""
    applied = []
    for req in pending:
        applied.append(req)
        if req.op == "stop":
            return Outcome(paused, req, applied)
        paused = req.op == "pause"
    return Outcome(paused, None, applied)


def withdraw(study: optuna.Study, trial_number: int, op: str, by: str | None = None) -> Withdrawal:
    """Take back the latest pending `op` request (pause, resume, stop) on a running trial before it applies.

    Refused (`OpError`) when the trial has no such request pending: none was made, or it has applied already (the
    message says when). Under the trial's requests lock, so it never races the process applying them.
    """
    if op not in schema.CONTROL_OPS:
        raise OpError(f"unknown op {op!r}; a pending {' or '.join(schema.CONTROL_OPS)} request can be withdrawn")
    frozen = _trial(study, trial_number)
    ref = TrialRef.of(study, frozen)
    with requests_lock(study, trial_number):
        record = ref.read()
        pending = [r for r in record.pending if r.op == op]
        if not pending:
            applied = [a for a in record.applied if a.op == op]
            if applied:
                last = applied[-1]
                raise OpError(f"trial {trial_number}: its {op} (asked by {last.by} at {last.requested_at}) was already "
                              f"applied at {last.applied_at}; nothing to withdraw")
            state = "" if record.state == TrialState.RUNNING else f" (it is {record.state.name})"
            raise OpError(f"trial {trial_number} has no pending {op} request to withdraw{state}")
        if record.state != TrialState.RUNNING:
            raise OpError(f"trial {trial_number} is {record.state.name}; its requests no longer apply")
        withdrawal = Withdrawal(pending[-1], by=by or schema.who(), at=schema.now())
        schema.write_withdrawal(ref, withdrawal)
    return withdrawal


def cancel(study: optuna.Study, trial_number: int, by: str | None = None) -> Cancel:
    """Cancel a WAITING clone that no process has started: it leaves the queue and ends FAIL, its reason
    ``cancelled by <who> at <time> before it started`` (`TrialRecord.cancelled`).

    Refused (`OpError`) for a trial that is not a WAITING clone, and when a process starts the clone first: the clone
    is taken from the queue by the compare-and-set Optuna's ``ask`` takes it by (WAITING -> RUNNING), so exactly one
    of the two wins.
    """
    frozen = _trial(study, trial_number)
    record = TrialRecord(frozen)
    if frozen.state != TrialState.WAITING or record.lineage is None:
        what = "a clone" if record.lineage is not None else "not a clone"
        hint = "; stop it instead (it ends PRUNED at its next chunk boundary)" if frozen.state == TrialState.RUNNING else ""
        raise OpError(f"trial {trial_number} is {frozen.state.name} and {what}; only a WAITING clone that has not "
                      f"started can be cancelled{hint}")
    storage = storage_of(study)
    trial_id = trial_id_of(frozen)
    if not storage.set_trial_state_values(trial_id, TrialState.RUNNING):
        raise OpError(f"trial {trial_number} was started by a process running the study just now; it was not "
                      "cancelled: stop it instead")
    # Ours now: no process asks a RUNNING trial. One that adopts it before the reason is written (a few ms) finds it
    # FAIL at its next write and drops it; a crash here leaves the reason, which the next reconcile carries out.
    cancelled = Cancel(by=by or schema.who(), at=schema.now())
    schema.write_cancel(TrialRef(storage, trial_id, trial_number), cancelled)
    storage.set_trial_state_values(trial_id, TrialState.FAIL)
    logger.info("trial %d: %s", trial_number, cancelled.reason)
    if record.lineage.warm_start:
        _discard_warm_start(study, trial_number, record.lineage.token)
    return cancelled


def _discard_warm_start(study: optuna.Study, trial_number: int, token: str) -> None:
    """Remove a cancelled clone's starting weights, where this process reaches the study's checkpoint store (a
    dashboard on another host may not: they stay, named by no trial, and cost only disk)."""
    where = schema.study_record(study).checkpoint_dir
    try:
        if where is not None:
            CheckpointStore(where).discard_warm_start(token)
    except Exception as exc:  # noqa: BLE001 - the cancel is done; the weights are only disk
        logger.warning("trial %d: cancelled, but its warm-start weights at %s were not removed: %s", trial_number,
                       where, exc)


def apply_requests(ref: TrialRef, record: TrialRecord, after_chunk: int, study: optuna.Study | None = None) -> Outcome:
    """Apply the trial's pending requests at this chunk boundary and record them; the caller then stops the trial if
    `Outcome.stop` (tell PRUNED) and frees a paused one's memory.

    Only the process that holds the trial calls this (under its lease when workers share the study): it is the one
    writer of ``rfopt:paused``, ``rfopt:stopped`` and ``rfopt:ops``. Every write comes before any ``tell``, because a
    finished trial's attrs are final; a crash in between leaves requests pending that are applied again, to the
    same effect. With `study`, the requests are read again and applied under the trial's requests lock, which
    `withdraw` takes too.
    """
    if study is None:
        return _apply(ref, record, after_chunk)
    with requests_lock(study, ref.number):
        return _apply(ref, ref.read(), after_chunk)


def _apply(ref: TrialRef, record: TrialRecord, after_chunk: int) -> Outcome:
    result = outcome(record.paused, record.pending)
    if not result.applied:
        return result
    if result.paused != record.paused:
        schema.write_paused(ref, result.paused)
    if result.stop is not None:
        schema.write_stop(ref, Stop(by=result.stop.by, at=result.stop.at, after_chunk=after_chunk))
    applied_at = schema.now()
    history = record.applied + [AppliedOp(op=r.op, by=r.by, requested_at=r.at, applied_at=applied_at, id=r.id)
                                for r in result.applied]
    schema.write_applied(ref, history)
    for r in result.applied:
        logger.info("trial %d: %s by %s applied", record.number, r.op, r.by)
    return result


# ---------------------------------------------------------------------- clones
@dataclass(frozen=True)
class Clone:
    """A clone that was enqueued: its number, what the person cloning must know (what could not be checked where
    it was made; a value Optuna's params hold under another name), and the overrides as the clone's config holds
    them (typed: ``{"learning_rate": 2e-06}`` for the text ``"2e-6"``)."""

    number: int
    notes: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def describe(self, parent: int, warm_start: bool) -> str:
        """``trial 7: clone of trial 3 with learning_rate=2e-06 enqueued from its parent's latest checkpoint``."""
        changes = ", ".join(f"{name}={value!r}" for name, value in self.overrides.items()) or "no changes"
        start = " from its parent's latest checkpoint" if warm_start else ""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return f"trial {self.number}: clone of trial {parent} with {changes} enqueued{start}{notes}"

    def describe_check(self, parent: int, warm_start: bool) -> str:
        """What a check-only clone found: ``a clone of trial 3 with learning_rate=2e-06 would be accepted ...``."""
        changes = ", ".join(f"{name}={value!r}" for name, value in self.overrides.items()) or "no changes"
        start = ", from its parent's latest checkpoint" if warm_start else ""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return f"checked: a clone of trial {parent} with {changes}{start} would be accepted (nothing written){notes}"


def clone(
    study: optuna.Study,
    parent_number: int,
    overrides: Mapping[str, Any],
    *,
    warm_start: bool,
    plan: ChunkPlan,
    checkpoints: Any,
    by: str | None = None,
    token: str | None = None,
    params: Mapping[str, Any] | None = None,
    check_only: bool = False,
) -> Clone:
    """Enqueue a clone of trial `parent_number`. Nothing is written if anything is invalid.

    Checked first: every override (name, type, the values TRL, its optimizer and scheduler would refuse), the
    model if it changes, reward functions that the overrides name, the chunk plan for the new batch shape, and for
    a warm start the parent's checkpoint and an unchanged adapter shape. The parent's own reward functions are
    imported if they can be; where they cannot (a dashboard that does not have the study's code), the clone is
    still made, checked in every other way, and `Clone.notes` says so: the process running the study imports them.

    `token` names the clone's lineage (default: a new one), so that a caller can find it again (`clone_with_token`);
    `params` gives the clone's Optuna params where the caller knows them (population-based training explores params
    and derives the overrides from them). `check_only`: check everything, write nothing (the returned clone has no
    number: -1).
    """
    parent = TrialRecord(_trial(study, parent_number))
    if parent.config_json is None:
        raise OpError(f"trial {parent_number} has no rfopt config to clone")
    data = TrialConfig.config_dict(parent.config_json)
    notes: list[str] = []
    try:
        child_data, overrides = override_dict(data, overrides)
        child = _checked(child_data, data, notes)
        schedule = trial_schedule(plan, child.args)
        # The config as stored: normalized by its own round trip where its code imports here, else as overridden.
        config_json = TrialConfig.json_of(child_data) if notes else child.to_json()
    except (ConfigError, ValueError) as exc:
        raise OpError(f"clone of trial {parent_number}: {exc}") from exc
    start_unit = 0
    state = None
    if warm_start:
        state = checkpoints.load(parent_number)
        if state is None:
            raise OpError(f"trial {parent_number} has no checkpoint yet; clone it without warm start, or after its first chunk")
        refusal = warm_start_refusal(data, child_data)
        if refusal is not None:
            raise OpError(f"clone of trial {parent_number}: {refusal}")
        start_unit = state.units_done
        if start_unit >= schedule.num_units:
            raise OpError(
                f"trial {parent_number} has trained all {schedule.num_units} chunks; a warm-started clone would have "
                "nothing left to train"
            )
    if check_only:
        return Clone(-1, tuple(notes), dict(overrides))
    lineage = Lineage(parent=parent_number, overrides=dict(overrides), warm_start=warm_start, start_unit=start_unit,
                      by=by or schema.who(), at=schema.now(), **({"token": token} if token else {}))
    explored = dict(params or {})
    params, distributions = _clone_params(study, parent.trial, overrides, notes)
    params.update({name: value for name, value in explored.items()
                   if name in distributions and admits(distributions[name], value)})
    if state is not None:  # before the clone exists: whoever starts it, the moment it is enqueued, finds them
        checkpoints.save_warm_start(lineage.token, state.weights, parent_number, start_unit)
        crashpoints.reach("clone-weights-saved", trial=parent_number, unit=start_unit)
    try:
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                params=params,
                distributions=distributions,
                system_attrs={**schema.new_trial_attrs(config_json, lineage=lineage),
                              **(schema.inherited_steps(parent.trial, start_unit) if warm_start else {})},
            )
        )
    except BaseException:
        if state is not None and clone_with_token(study, lineage.token) is None:
            checkpoints.discard_warm_start(lineage.token)
        raise
    # Found by its token in any state: a process running the study may have started it already.
    number = clone_with_token(study, lineage.token)
    return Clone(number, tuple(notes), dict(overrides))


def clone_with_token(study: optuna.Study, token: str) -> int | None:
    """The number of the clone whose lineage has `token`, or None if no such clone was made."""
    for t in study.get_trials(deepcopy=False):
        lineage = TrialRecord(t).lineage
        if lineage is not None and lineage.token == token:
            return t.number
    return None


def warm_start_refusal(parent: Mapping[str, Any], child: Mapping[str, Any]) -> str | None:
    """Why a warm start from config dict `parent` to `child` is refused (a model or adapter shape change), or None."""
    if TrialConfig.base_model_of(parent) != TrialConfig.base_model_of(child):
        return "a warm start needs the parent's base model; the overrides change it"
    if (parent["peft_config"] is None) != (child["peft_config"] is None):
        return "a warm start cannot switch between an adapter and full fine-tuning"
    if parent["peft_config"] is not None:
        before, after = parent["peft_config"], child["peft_config"]
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        shape_changes = [k for k in changed if k not in _WARM_SAFE_PEFT_FIELDS]
        if shape_changes:
            return (f"a warm start loads the parent's adapter weights, so the adapter's shape must stay; the "
                    f"overrides change {shape_changes}. Clone without warm start to change them")
    return None


def clone_in_study(study: optuna.Study, parent_number: int, overrides: Mapping[str, Any], *, warm_start: bool,
                   by: str | None = None, check_only: bool = False) -> Clone:
    """`clone` with the study's own chunk plan and checkpoint store (as the API, the CLI and the dashboard clone)."""
    record = schema.study_record(study)
    if record.plan is None or record.checkpoint_dir is None:
        raise OpError(f"study {study.study_name!r} has not run yet (it has no chunk plan); run it before cloning trials")
    return clone(study, parent_number, overrides, warm_start=warm_start, plan=record.plan,
                 checkpoints=CheckpointStore(record.checkpoint_dir), by=by, check_only=check_only)


def _checked(child_data: dict[str, Any], parent_data: dict[str, Any], notes: list[str]) -> TrialConfig:
    """The clone's config, checked as far as this process can. Where the study's code (reward functions, callbacks,
    model factory) does not import here, its import paths are left unresolved, everything else is checked, and a note
    says so."""
    try:
        config = TrialConfig.from_dict(child_data)
    except ConfigError as exc:
        own_code = (child_data["reward_funcs"] == parent_data["reward_funcs"] and child_data["model"] == parent_data["model"]
                    and child_data.get("callbacks") == parent_data.get("callbacks"))
        if not own_code or "cannot be imported" not in str(exc):
            raise  # a reward or model factory the overrides name must import here
        notes.append(f"the study's code cannot be imported here ({exc}); the process running the study imports it, "
                     "so its reward functions were not checked here")
        config = TrialConfig.from_dict(child_data, resolve_code=False)
        config.validate(check_code=False)
        _check_model_if_changed(config, child_data, parent_data)
        return config
    config.validate()
    _check_model_if_changed(config, child_data, parent_data)
    return config


def _check_model_if_changed(config: TrialConfig, child_data: dict[str, Any], parent_data: dict[str, Any]) -> None:
    """A model that cannot be found (asked only when the overrides change the model); what training refuses is
    checked by `TrialConfig.validate`."""
    if TrialConfig.base_model_of(child_data) != TrialConfig.base_model_of(parent_data):
        check_model(config)




def _clone_params(study: optuna.Study, parent: optuna.trial.FrozenTrial, overrides: Mapping[str, Any],
                  notes: list[str] | None = None):
    """The clone's Optuna params: the parent's, with every overridden value recorded, so that Optuna's parameter views
    (optuna-dashboard's, `trials_dataframe`, `best_params`, importance) describe the clone and not its parent.

    Each overridden value goes to the param `rfopt.config.params.param_holding` names for its field's param (named as a list
    study names it, `rfopt.config.params`): that param where it holds the value (a number outside the range widens it); a
    new param for a field the study has none for; and for a categorical param that cannot gain the value as a choice
    (Optuna fixes a categorical's choices once trials have it), an alternate param ``<name>#2`` (``#3``, ...), said in
    `notes` (shown where the clone is made) and on the leaderboard and page (`held_as`). The parent's value of that
    field never stays in the clone's params.
    """
    params = dict(parent.params)
    distributions = dict(parent.distributions)
    known: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        for name, dist in trial.distributions.items():
            known.setdefault(name, dist)
    for given, value in overrides.items():
        path = field_path(given)
        name = path if path in known else param_name(path)  # a list study's param may be the field's path
        value = param_value(value)
        study_dist = distributions.get(name) or known.get(name)
        held = param_holding(name, value, {**known, **distributions})
        params.pop(name, None)
        distributions.pop(name, None)
        if held is None:  # an unbounded name space makes this unreachable in practice
            logger.warning("clone of trial %d: %s=%r cannot be an Optuna param of the study; it is in the clone's "
                           "config", parent.number, name, value)
            continue
        holder, dist = held
        params[holder], distributions[holder] = value, dist
        if holder != name and notes is not None:
            notes.append(f"{name}={value!r} cannot be a value of the study's param {name!r} ({_shown(study_dist)}): "
                         f"Optuna fixes a param's kind, and a categorical's choices, once trials have it. The clone's "
                         f"Optuna params hold it as {holder!r}; its config, study.best_config, the leaderboard and the "
                         "dashboard's page say what it trains")
    return params, distributions


def held_as(trial: optuna.trial.FrozenTrial) -> dict[str, str]:
    """For a clone whose overridden values Optuna's params hold under an alternate name (`param_holding`): the field's
    param name -> the param that holds it (``{"model": "model#2"}``); empty for any other trial."""
    lineage = TrialRecord(trial).lineage
    if lineage is None:
        return {}
    found = {}
    for given in lineage.overrides:
        path = field_path(given)
        name = path if path in trial.params else param_name(path)
        if name in trial.params:
            continue
        holder = next((p for p in trial.params
                       if p.startswith(f"{name}#") and p[len(name) + 1:].isdigit()), None)
        if holder is not None:
            found[name] = holder
    return found


def _shown(dist: Any) -> str:
    """A distribution as a person reads it: ``choices ['a', 'b']``, ``a range 0.001..0.01 (log)``."""
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    return f"a range {dist.low}..{dist.high}{' (log)' if dist.log else ''}"


def _trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    trials = study.get_trials(deepcopy=False)
    if not isinstance(number, int) or number < 0 or number >= len(trials):
        raise OpError(f"study {study.study_name!r} has no trial {number} (trials 0..{len(trials) - 1})")
    return trials[number]


def _running_trial(study: optuna.Study, number: int, op: str) -> optuna.trial.FrozenTrial:
    trial = _trial(study, number)
    if trial.state != TrialState.RUNNING:
        raise OpError(f"trial {number} is {trial.state.name}; only a RUNNING trial can be {_past(op)}")
    return trial


def _past(op: str) -> str:
    return {"pause": "paused", "resume": "resumed", "stop": "stopped"}[op]

