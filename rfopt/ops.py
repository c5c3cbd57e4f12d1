"""Control operations on trials: pause, resume, stop, clone.

Ops travel through the study's storage, so any process can steer a study that another process is
running (the Python API, the ``rfopt`` command line, the dashboard). A request is the trial's user
attr ``rfopt:control`` (``"pause"``, ``"resume"`` or ``"stop"``, or a dict with who and when); the
process running the trial applies it at the trial's next chunk boundary, appends it to the trial's
``rfopt:ops`` history (what, who, when requested, when applied) and clears the request.

- pause: the trial stays RUNNING in Optuna but is not scheduled; its device memory is freed (it
  continues from its checkpoint on resume, exactly). ``rfopt:paused`` says so, across restarts.
- resume: the trial is scheduled again.
- stop: the trial ends PRUNED with its last value, reason ``stopped by user``.
- clone: a new trial with the parent's config changed by overrides (validated before anything is
  written), optionally warm-started from the parent's latest checkpoint (its weights; a fresh LR
  schedule over the remaining steps; it reports at the parent's step numbers onward). Lineage is
  stored on the clone as ``rfopt:clone``.

    >>> study.pause(3); study.resume(3); study.stop(4)                        # doctest: +SKIP
    >>> study.clone(3, {"learning_rate": 2e-6}, warm_start=True)              # doctest: +SKIP
    7
"""

from __future__ import annotations

import datetime
import getpass
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from .chunks import ChunkPlan, trial_schedule
from .config import ConfigError, TrialConfig

CONTROL_ATTR = "rfopt:control"
OPS_LOG_ATTR = "rfopt:ops"
PAUSED_ATTR = "rfopt:paused"
CLONE_ATTR = "rfopt:clone"
STOP_REASON = "stopped by user"
CONTROL_OPS = ("pause", "resume", "stop")
# LoRA fields a warm-started clone may change: they do not change the adapter's weight shapes.
_WARM_SAFE_PEFT_FIELDS = {"lora_alpha", "lora_dropout"}


class OpError(ValueError):
    """An op that cannot apply: unknown or finished trial, conflicting op, bad overrides."""


@dataclass(frozen=True)
class Request:
    """A pending control request read from a trial."""

    op: str
    by: str
    at: str


def who() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def request(study: optuna.Study, trial_number: int, op: str, by: str | None = None) -> None:
    """Ask for `op` on a running trial; it applies at the trial's next chunk boundary."""
    if op not in CONTROL_OPS:
        raise OpError(f"unknown op {op!r}; use one of {', '.join(CONTROL_OPS)} (or clone)")
    trial = _running_trial(study, trial_number, op)
    paused = bool(trial.user_attrs.get(PAUSED_ATTR))
    pending = read_request(trial)
    if op == "pause" and paused and pending is None:
        raise OpError(f"trial {trial_number} is already paused")
    if op == "resume" and not paused and (pending is None or pending.op != "pause"):
        raise OpError(f"trial {trial_number} is not paused; only a paused trial can be resumed")
    if pending is not None and pending.op == "stop":
        raise OpError(f"trial {trial_number} is being stopped; a {op} cannot follow a stop")
    study._storage.set_trial_user_attr(
        trial._trial_id, CONTROL_ATTR, {"op": op, "by": by or who(), "at": now(), "id": uuid.uuid4().hex}
    )


def read_request(trial: optuna.trial.FrozenTrial) -> Request | None:
    """The trial's pending control request; a plain string is what the dashboard's form writes."""
    value = trial.user_attrs.get(CONTROL_ATTR)
    if not value:
        return None
    if isinstance(value, str):
        op = value.strip().lower()
        return Request(op=op, by="dashboard", at=now()) if op in CONTROL_OPS else None
    if isinstance(value, Mapping) and value.get("op") in CONTROL_OPS:
        return Request(op=value["op"], by=str(value.get("by", "unknown")), at=str(value.get("at", now())))
    return None


def record_applied(trial: optuna.Trial, req: Request, extra: Mapping[str, Any] | None = None) -> None:
    """Append the op to the trial's history and clear the request (before any `tell`: finished trials are final)."""
    history = list(trial.study._storage.get_trial(trial._trial_id).user_attrs.get(OPS_LOG_ATTR, []))
    history.append({"op": req.op, "by": req.by, "requested_at": req.at, "applied_at": now(), **(extra or {})})
    trial.set_user_attr(OPS_LOG_ATTR, history)
    trial.set_user_attr(CONTROL_ATTR, None)


def clone(
    study: optuna.Study,
    parent_number: int,
    overrides: Mapping[str, Any],
    *,
    warm_start: bool,
    plan: ChunkPlan,
    checkpoints: Any,
    by: str | None = None,
) -> int:
    """Enqueue a clone of trial `parent_number` and return its number. Nothing is written if anything is invalid."""
    parent = _trial(study, parent_number)
    if "rfopt:config" not in parent.user_attrs:
        raise OpError(f"trial {parent_number} has no rfopt config to clone")
    config = TrialConfig.from_json(parent.user_attrs["rfopt:config"])
    try:
        child = config.with_overrides(dict(overrides))
        schedule = trial_schedule(plan, child.resolved_grpo())
    except (ConfigError, ValueError) as exc:
        raise OpError(f"clone of trial {parent_number}: {exc}") from exc
    start_unit = 0
    if warm_start:
        state = checkpoints.load(parent_number)
        if state is None:
            raise OpError(f"trial {parent_number} has no checkpoint yet; clone it without warm start, or after its first chunk")
        _check_warm_compatible(config, child, parent_number)
        start_unit = state.units_done
        if start_unit >= schedule.num_units:
            raise OpError(
                f"trial {parent_number} has trained all {schedule.num_units} chunks; a warm-started clone would have "
                "nothing left to train"
            )
    lineage = {
        "parent": parent_number,
        "overrides": dict(overrides),
        "warm_start": warm_start,
        "start_unit": start_unit,
        "by": by or who(),
        "at": now(),
        "token": uuid.uuid4().hex,
    }
    params, distributions = _clone_params(parent, child, overrides)
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=params,
            distributions=distributions,
            user_attrs={"rfopt:config": child.to_json(), CLONE_ATTR: lineage},
        )
    )
    number = next(
        t.number
        for t in reversed(study.get_trials(deepcopy=False, states=[TrialState.WAITING]))
        if t.user_attrs.get(CLONE_ATTR, {}).get("token") == lineage["token"]
    )
    if warm_start:
        checkpoints.save_warm_start(number, state.weights, parent_number, start_unit)
    return number


def _check_warm_compatible(parent: TrialConfig, child: TrialConfig, parent_number: int) -> None:
    if parent.model_key != child.model_key:
        raise OpError(f"clone of trial {parent_number}: a warm start needs the parent's base model; the overrides change it")
    if (parent.peft is None) != (child.peft is None):
        raise OpError(f"clone of trial {parent_number}: a warm start cannot switch between an adapter and full fine-tuning")
    if parent.peft is not None:
        before, after = parent.to_dict()["peft"], child.to_dict()["peft"]
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        shape_changes = [k for k in changed if k not in _WARM_SAFE_PEFT_FIELDS]
        if shape_changes:
            raise OpError(
                f"clone of trial {parent_number}: a warm start loads the parent's adapter weights, so the adapter's "
                f"shape must stay; the overrides change {shape_changes}. Clone without warm start to change them"
            )


def _clone_params(parent: optuna.trial.FrozenTrial, child: TrialConfig, overrides: Mapping[str, Any]):
    """The parent's params with the overridden values, where the parent's distributions admit them."""
    params, distributions = {}, {}
    for name, value in parent.params.items():
        new = overrides.get(name, value)
        dist = parent.distributions[name]
        try:
            if dist._contains(dist.to_internal_repr(new)):
                params[name], distributions[name] = new, dist
        except (ValueError, TypeError):
            continue
    return params, distributions


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
