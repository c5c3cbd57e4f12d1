"""The ``rfopt:*`` keys, spelled here only, and where the records they name are kept: system attrs of the study and
its trials, over the user attrs an earlier rfopt wrote (see `rfopt.storage.schema`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from optuna.trial import FrozenTrial

from rfopt.compat import storage_of, study_id_of, trial_id_of

logger = logging.getLogger("rfopt")

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
_REPLICATE = "rfopt:replicate_of"
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
_TRACKED = "rfopt:tracked"
_TRACKED_AT = "rfopt:tracked_at"
_BEST = "rfopt:best"
_BASELINE = "rfopt:baseline:"
_BASELINE_KEY = "rfopt:baseline_key"
_PBT_STEP = "rfopt:pbt:"
_PROGRESS = "rfopt:progress"
_HALT = "rfopt:halt"
_RUN_SHAPE = "rfopt:run_shape"
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
    """rfopt's records on a stored trial: its ``rfopt:*`` system attrs, over the user attrs an earlier rfopt wrote.

    User attrs are the user's: they are read as an earlier rfopt's records only on a trial whose config is not a
    system attr (one an earlier rfopt configured), and only those with the shape that rfopt wrote (`_legacy`)."""
    system = _ours(trial.system_attrs)
    current = _CONFIG in system  # configured by this rfopt: its records are all system attrs
    legacy = _legacy(trial.user_attrs, system, () if current else _TRIAL_SHAPES, f"trial {trial.number}",
                     trial_id_of(trial))
    return {**legacy, **system}


def study_attrs(study: Any) -> dict[str, Any]:
    """rfopt's records on a study (an `optuna.Study` or a `FrozenStudy`): its ``rfopt:*`` system attrs, over the
    user attrs an earlier rfopt wrote (read as `trial_attrs` reads a trial's: only on a study this rfopt did not plan,
    and only with the shape rfopt wrote)."""
    system = getattr(study, "system_attrs", None)  # a FrozenStudy's; an optuna.Study (5.0) has none: ask its storage
    if system is None:
        system = storage_of(study).get_study_system_attrs(study_id_of(study))
    system = _ours(system)
    current = _PLAN in system  # planned by this rfopt (the plan is written once): its records are all system attrs
    legacy = _legacy(study.user_attrs, system, () if current else _STUDY_SHAPES, f"study {study.study_name!r}",
                     study.study_name)
    return {**legacy, **system}


# ---------------------------------------------------------------------- an earlier rfopt's records, checked
def _is(*types: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _mapping(*keys: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, Mapping) and all(k in value for k in keys)


def _each(shape: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(shape(v) for v in value)


def _digits(suffix: str) -> bool:
    return suffix.isascii() and suffix.isdigit()


_Shape = tuple[str, bool, Callable[[Any], bool]]
"""A key (or a key prefix, when the flag says so: then the rest of the key must be a number, or for requests any
text) and the shape an earlier rfopt wrote under it."""

_TRIAL_SHAPES: tuple[_Shape, ...] = (
    (_CONFIG, False, _is(str)), (_LIST_INDEX, False, _is(int)),
    (_SCHEDULE, False, _mapping("prompts_per_chunk", "steps_per_chunk", "num_epochs", "num_chunks")),
    (_CLONE, False, _mapping("parent")), (_METRICS, True, _is(Mapping)), (_STEPS, True, _is(Mapping)),
    (_SAMPLES, True, _is(list)), (_DECISION, True, _mapping("prune", "reason", "peers", "pruner")),
    (_REQUEST, True, _mapping("op", "id")), (_WITHDRAWN, True, _is(Mapping)), (_OPS, False, _each(_mapping("op"))),
    (_CANCELLED, False, _is(Mapping)), (_PAUSED, False, _is(bool)),
    (_STOPPED, False, lambda v: _mapping("after_chunk")(v) and _is(int)(v["after_chunk"])),
    (_FAIL_REASON, False, _is(str)), (_ADAPTER, False, _is(str)), (_PROGRESS, False, _is(Mapping)),
)
_STUDY_SHAPES: tuple[_Shape, ...] = (
    (_STUDY_ID, False, _is(str)), (_CHECKPOINT_DIR, False, _is(str)),
    (_PLAN, False, _mapping("num_rows", "num_chunks", "seed")),
    (_SETTINGS["num_chunks"], False, _is(int)), (_SETTINGS["chunk_seed"], False, _is(int)),
    (_SETTINGS["objective"], False, _is(str)), (_SETTINGS["eval_settings"], False, _is(Mapping)),
    (_SETTINGS["train_fingerprint"], False, _is(str)), (_SETTINGS["eval_fingerprint"], False, _is(str)),
    (_SETTINGS["report_to"], False, _is(str, list)), (_PBT_STEP, True, _mapping("ranking", "replacements")),
    (_HALT, False, _is(Mapping)),
)
_REQUEST_IDS = (_REQUEST, _WITHDRAWN)  # keyed by a time and an id, not a number
_warned: set[tuple[Any, str]] = set()


def _legacy(user_attrs: Mapping[str, Any], system: Mapping[str, Any], shapes: tuple[_Shape, ...], owner: str,
            identity: Any) -> dict[str, Any]:
    """The user attrs that are an earlier rfopt's records: ``rfopt:*`` keys with the shape rfopt wrote under them
    (`shapes`; none where the owner is this rfopt's). A system attr of the same key wins, as a continued earlier study
    writes its new records there. Any other ``rfopt:*`` user attr is the user's: it is skipped, with a warning (once a
    process) naming `owner` and the key, so that one odd attr never makes the study unreadable."""
    records = {}
    for key, value in _ours(user_attrs).items():
        if key in system and shapes:
            continue
        if _shaped(key, value, shapes):
            records[key] = value
        elif (identity, key) not in _warned:
            _warned.add((identity, key))
            logger.warning("%s: its user attr %r is not a record rfopt wrote (rfopt keeps its records as system "
                           "attrs, and reads an rfopt:* user attr only as an earlier rfopt wrote it); it is left "
                           "alone. Name your own attrs without the 'rfopt:' prefix", owner, key)
    return records


def _shaped(key: str, value: Any, shapes: tuple[_Shape, ...]) -> bool:
    for name, prefix, shape in shapes:
        if key == name and not prefix:
            return shape(value)
        if prefix and key.startswith(name) and len(key) > len(name):
            rest = key[len(name):]
            return (name in _REQUEST_IDS or _digits(rest)) and shape(value)
    return False


def _set_study(study: Any, key: str, value: Any) -> None:
    storage_of(study).set_study_system_attr(study_id_of(study), key, value)
