"""Control operations on trials and studies: pause, resume, stop, withdraw, cancel, halt.

Ops travel through the study's storage, so any process can steer a study that another process is
running (the Python API, the ``rfopt`` command line, the dashboard):

- pause, resume, stop are *requests*: each is written once, under a key of its own, on the running
  trial (`schema.TrialRequest`), and never rewritten, so two requests made at the same moment are both
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
- clone: a new trial with the parent's config changed by overrides (`rfopt.engine.trials.clones`).
- halt: ask every process running the study to stop at its trials' next chunk boundary (`halt`).

Who runs a study, and each study at a glance, are read by `rfopt.reports.status`.

    >>> study.pause_trial(3); study.resume_trial(3); study.stop_trial(4)      # doctest: +SKIP
    >>> study.withdraw_request(4, "stop"); study.cancel_clone(7)              # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from rfopt.compat import storage_of, trial_id_of
from rfopt.errors import OpError
from rfopt.reports.status import liveness
from rfopt.storage import schema
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.leases import requests_lock
from rfopt.storage.schema import AppliedOp, Cancel, Stop, TrialRecord, TrialRef, TrialRequest, Withdrawal

logger = logging.getLogger("rfopt")


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
def request(study: optuna.Study, trial_number: int, op: str, by: str | None = None) -> TrialRequest:
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
    req = TrialRequest.new(op, by)
    schema.write_request(TrialRef.of(study, record.trial), req)
    return req


@dataclass(frozen=True)
class Outcome:
    """Where a trial's requests leave it: paused or not, stopped (by which request) or not."""

    paused: bool
    stop: TrialRequest | None = None
    applied: list[TrialRequest] = field(default_factory=list)


def outcome(paused: bool, pending: list[TrialRequest]) -> Outcome:
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
    frozen = find_trial(study, trial_number)
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
    frozen = find_trial(study, trial_number)
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


def find_trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    trials = study.get_trials(deepcopy=False)
    if not isinstance(number, int) or number < 0 or number >= len(trials):
        raise OpError(f"study {study.study_name!r} has no trial {number} (trials 0..{len(trials) - 1})")
    return trials[number]


def _running_trial(study: optuna.Study, number: int, op: str) -> optuna.trial.FrozenTrial:
    trial = find_trial(study, number)
    if trial.state != TrialState.RUNNING:
        raise OpError(f"trial {number} is {trial.state.name}; only a RUNNING trial can be {_past(op)}")
    return trial


def _past(op: str) -> str:
    return {"pause": "paused", "resume": "resumed", "stop": "stopped"}[op]

