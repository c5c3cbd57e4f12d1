"""The ``rfopt:*`` keys, spelled here only, and where the records they name are kept: system attrs of the study and
its trials, over the user attrs an earlier rfopt wrote (see `rfopt.storage.schema`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optuna.trial import FrozenTrial

from rfopt.compat import storage_of, study_id_of

# ---------------------------------------------------------------------- keys (spelled here only)
_STUDY_ID = "rfopt:id"
_CHECKPOINT_DIR = "rfopt:checkpoint_dir"
_PLAN = "rfopt:plan"
_SETTINGS = {"objective": "rfopt:objective", "eval_settings": "rfopt:eval", "train_fingerprint": "rfopt:train_fingerprint",
             "eval_fingerprint": "rfopt:eval_fingerprint", "num_chunks": "rfopt:num_chunks",
             "chunk_seed": "rfopt:chunk_seed", "report_to": "rfopt:report_to"}

_CONFIG = "rfopt:config"
_LIST_INDEX = "rfopt:list_index"
_SCHEDULE = "rfopt:schedule"
_CLONE = "rfopt:clone"
_METRICS = "rfopt:metrics:"
_STEPS = "rfopt:steps:"
_SAMPLES = "rfopt:samples:"
_DECISION = "rfopt:pruning:"
_REQUEST = "rfopt:request:"
_WITHDRAWN = "rfopt:withdrawn:"
_OPS = "rfopt:ops"
_CANCELLED = "rfopt:cancelled"
_PAUSED = "rfopt:paused"
_STOPPED = "rfopt:stopped"
_FAIL_REASON = "rfopt:fail_reason"
_ADAPTER = "rfopt:adapter"
_BEST = "rfopt:best"
_BASELINE = "rfopt:baseline:"
_BASELINE_KEY = "rfopt:baseline_key"
_PBT_STEP = "rfopt:pbt:"
_PROGRESS = "rfopt:progress"
_HALT = "rfopt:halt"
_PREFIX = "rfopt:"
_GANG = "rfopt:gang:"


def unit_key(prefix: str, unit: int) -> str:
    return f"{prefix}{unit:04d}"


def metrics_key(unit: int) -> str:
    """``rfopt:metrics:0002``: the training and eval metrics of a trial's unit 2."""
    return unit_key(_METRICS, unit)


def samples_key(unit: int) -> str:
    return unit_key(_SAMPLES, unit)


def steps_key(unit: int) -> str:
    """``rfopt:steps:0002``: the trial system attr that holds TRL's per-step logs of its unit 2."""
    return unit_key(_STEPS, unit)


def decision_key(step: int) -> str:
    """The key that holds a trial's pruning decision at ``step``."""
    return f"{_DECISION}{step}"


DECISION_ATTR_PREFIX = _DECISION


# ---------------------------------------------------------------------- where records are kept
def _ours(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k.startswith(_PREFIX)}


def trial_attrs(trial: FrozenTrial) -> dict[str, Any]:
    """rfopt's records on a stored trial: its ``rfopt:*`` system attrs, over the user attrs an earlier rfopt wrote."""
    return {**_ours(trial.user_attrs), **_ours(trial.system_attrs)}


def study_attrs(study: Any) -> dict[str, Any]:
    """rfopt's records on a study (an `optuna.Study` or a `FrozenStudy`): its ``rfopt:*`` system attrs, over the
    user attrs an earlier rfopt wrote."""
    system = getattr(study, "system_attrs", None)  # a FrozenStudy's; an optuna.Study (5.0) has none: ask its storage
    if system is None:
        system = storage_of(study).get_study_system_attrs(study_id_of(study))
    return {**_ours(study.user_attrs), **_ours(system)}


def _set_study(study: Any, key: str, value: Any) -> None:
    storage_of(study).set_study_system_attr(study_id_of(study), key, value)
