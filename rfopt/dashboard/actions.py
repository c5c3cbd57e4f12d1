"""What the dashboard's buttons do: each action calls `rfopt.engine.trials.ops`, as the Python API and the command line do, and
returns the JSON reply.

Pause, resume and stop are requests stored on the trial, applied by the process running the study at the trial's next
chunk boundary; halt asks every such process to stop; cancel and withdraw take effect at once, or are refused when
the engine got there first; a clone is checked before anything is written. An action that cannot apply raises a
`rfopt.errors.Refusal` (an `rfopt.errors.OpError`, an `rfopt.errors.ConfigError`, or a malformed body) and writes
nothing: the route answers 400 with its message.

    >>> control(study, 2, "pause", by="dashboard (127.0.0.1)")["message"]           # doctest: +SKIP
    "trial 2: pause requested; it applies at the trial's next chunk boundary"
"""

from __future__ import annotations

import threading
from typing import Any

import optuna

from rfopt.config.form import form_fields
from rfopt.engine.trials import clones, ops
from rfopt.errors import Refusal
from rfopt.storage.schema import TrialRecord, study_record

CLONE_FIELDS = {"overrides", "set", "warm_start", "check_only"}


def halt(study: optuna.Study, by: str) -> dict[str, Any]:
    """Every process running the study stops at its trials' next chunk boundary (`rfopt.engine.trials.ops.halt`)."""
    ops.halt(study, by=by)
    return {"op": "halt", "message": f"study {study.study_name}: stop requested; every process running it stops "
            "at its trials' next chunk boundary, and the trials stay resumable (run the study again to continue)"}


def confirm(study: optuna.Study, body: dict[str, Any], by: str) -> dict[str, Any]:
    """Replicates of the study's best configs with new seeds (`rfopt.engine.trials.replicates.confirm`): the body's ``top``
    and ``seeds`` (whole numbers, at least 1), and ``prune`` (optional, a boolean)."""
    from rfopt.engine.trials.replicates import confirm as enqueue

    if not {"top", "seeds"} <= set(body) <= {"top", "seeds", "prune"} or not isinstance(body.get("prune", False), bool):
        raise Refusal("send {\"top\": 3, \"seeds\": 2} (and \"prune\": true to let the run's pruner judge them): "
                      "how many of the best configs to train again, and with how many new seeds each")
    made = enqueue(study, body["top"], body["seeds"], prune=body.get("prune", False), by=by)
    said = "; ".join(m.describe() for m in made) or "nothing to enqueue: each finalist has its replicates already"
    return {"op": "confirm", "trials": [m.number for m in made],
            "message": f"{said}. A process running the study trains them when a slot frees; otherwise run the study "
            "again"}


def control(study: optuna.Study, number: int, op: str, by: str) -> dict[str, Any]:
    """A pause, resume or stop request on trial `number` (`rfopt.engine.trials.ops.request`)."""
    ops.request(study, number, op, by=by)
    return {"trial": number, "op": op,
            "message": f"trial {number}: {op} requested; it applies at the trial's next chunk boundary"}


def cancel(study: optuna.Study, number: int, by: str) -> dict[str, Any]:
    """A WAITING clone no process has started leaves the queue (`rfopt.engine.trials.ops.cancel`)."""
    cancelled = ops.cancel(study, number, by=by)
    return {"trial": number, "op": "cancel", "message": f"trial {number}: {cancelled.reason}; it left the queue"}


def withdraw(study: optuna.Study, number: int, body: dict[str, Any], by: str) -> dict[str, Any]:
    """The pending request ``{"op": "pause"}`` (or resume, stop) of trial `number` will not apply
    (`rfopt.engine.trials.ops.withdraw`)."""
    op = body.get("op")
    if set(body) != {"op"} or not isinstance(op, str):
        raise Refusal("send {\"op\": \"pause\"} (or resume, stop): the pending request to withdraw")
    ops.withdraw(study, number, op, by=by)
    return {"trial": number, "op": "withdraw", "message": f"trial {number}: {op} request withdrawn; it will not apply"}


def clone(study: optuna.Study, number: int, body: dict[str, Any], by: str) -> dict[str, Any]:
    """A clone of trial `number` with the body's ``overrides`` (an object) and ``set`` (FIELD=VALUE strings), warm
    started or not; with ``check_only``, checked and not made (`rfopt.engine.trials.clones.clone_in_study`)."""
    from rfopt.config.overrides import parse_assignments

    overrides, assignments, warm_start, check_only = _clone_request(body)
    overrides = {**overrides, **parse_assignments([a for a in assignments if a.strip()])}
    with FIRST_IMPORT:
        made = clones.clone_in_study(study, number, overrides, warm_start=warm_start, by=by, check_only=check_only)
    if check_only:
        return {"trial": None, "parent": number, "overrides": dict(made.overrides), "warm_start": warm_start,
                "notes": list(made.notes), "message": made.describe_check(number, warm_start)}
    return {
        "trial": made.number,
        "parent": number,
        "overrides": dict(made.overrides),
        "warm_start": warm_start,
        "notes": list(made.notes),
        "message": made.describe(number, warm_start),
    }


def _clone_request(body: dict[str, Any]) -> tuple[dict[str, Any], list[str], bool, bool]:
    """A clone request's overrides, FIELD=VALUE assignments, warm_start and check_only, each checked for its type."""
    unknown = sorted(set(body) - CLONE_FIELDS)
    if unknown:
        raise Refusal(f"unknown fields {unknown}; send overrides (an object) or set (FIELD=VALUE strings), "
                      "warm_start and check_only")
    overrides = body.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise Refusal("overrides must be a JSON object, e.g. {\"learning_rate\": 2e-6}")
    assignments = body.get("set") or []
    if not isinstance(assignments, list) or not all(isinstance(a, str) for a in assignments):
        raise Refusal("set must be a list of FIELD=VALUE strings, e.g. [\"learning_rate=2e-6\"]")
    warm_start, check_only = body.get("warm_start", False), body.get("check_only", False)
    if not isinstance(warm_start, bool):
        raise Refusal("warm_start must be true or false")
    if not isinstance(check_only, bool):
        raise Refusal("check_only must be true or false")
    return overrides, assignments, warm_start, check_only


# ---------------------------------------------------------------------- the clone form
def warm_up() -> None:
    """Import TRL and work out GRPOConfig's fields once, so that the first clone form opened is served at once (both
    take seconds the first time). The server starts it in a thread."""
    with FIRST_IMPORT:
        from rfopt.config.form import prepare

        prepare()


def clone_form(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """The clone form of a trial that has an rfopt config: its fields (`rfopt.config.form`), pre-filled with the
    trial's config, and whether a warm start is possible."""
    record = TrialRecord(trial)
    with FIRST_IMPORT:
        fields = form_fields(record.config_json, trial.params)
    return {"trial": trial.number, "fields": [f.to_json() for f in fields],
            "warm_start": warm_start_offer(study, record)}


def warm_start_offer(study: optuna.Study, record: TrialRecord) -> dict[str, Any]:
    """Whether a clone of the trial can start from its latest checkpoint, and why not."""
    from rfopt.storage.checkpoints import CheckpointStore

    where = study_record(study).checkpoint_dir
    if record.committed == 0 or where is None:
        return {"available": False, "why": "it has no checkpoint yet (no chunk committed)"}
    if record.num_units is not None and record.committed >= record.num_units:
        return {"available": False, "why": f"it trained all {record.num_units} chunks: a warm clone would have "
                "nothing left to train"}
    try:
        units = CheckpointStore(where).latest_units(record.number)
    except Exception as exc:  # noqa: BLE001 - a store this process cannot reach: say so, offer no warm start
        return {"available": False, "why": f"its checkpoint store {where} cannot be read here ({exc})"}
    if units is None:
        return {"available": False, "why": f"its checkpoint is not in {where} (kept only while it trains)"}
    if record.num_units is not None and units >= record.num_units:
        return {"available": False, "why": f"its checkpoint is after its last chunk ({units}): a warm clone would have "
                "nothing left to train"}
    # The checkpoint a clone made now starts from (a chunk may be checkpointed before its value is committed).
    return {"available": True, "why": f"from its checkpoint after chunk {units}", "after_chunk": units}


class _FirstImport:
    """Held while a request imports TRL and transformers the first time: their lazy modules are not safe to import
    from two threads at once (a request could fail with "cannot import name 'GRPOConfig' from 'trl'"). Once TRL is
    imported, it is not held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def __enter__(self) -> None:
        if not self._done:
            with self._lock:
                from trl import GRPOConfig  # noqa: F401 - imported once, under the lock

                self._done = True

    def __exit__(self, *exc: object) -> None:
        pass


FIRST_IMPORT = _FirstImport()
