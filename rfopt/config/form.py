"""A stored trial config as a form (the dashboard's clone form), and how its objective weighs its rewards.

`form_fields` lists every field a clone may change, typed, with the trial's value, its default and TRL's (or PEFT's)
help: each `GRPOConfig` field but the ones rfopt sets itself or the device decides (`rfopt.config.codec.PLUMBING_FIELDS`,
``use_cpu``, ``bf16``, ``fp16``), each field of the trial's PEFT config (``peft_config.<field>``), ``model`` and
``reward_funcs``. A field's name is the override name `rfopt.config.overrides.override_dict` takes, so the page sends back the
fields a person changed, typed, as overrides; the server checks them as the command line's are checked.

Nothing the config names is imported: the dashboard shows trials of studies whose code it cannot import.

    >>> [f.name for f in form_fields(TrialRecord(trial).config_json)][:3]           # doctest: +SKIP
    ['learning_rate', 'lora_r', ...]
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .codec import PLACEMENT_FIELDS, PLUMBING_FIELDS, grpo_default, jsonable
from .params import field_path
from .trial import TrialConfig

_DERIVED = {"generation_batch_size", "steps_per_generation"}
_PEFT_MAIN = ("r", "lora_alpha", "lora_dropout", "target_modules")
"""The adapter's fields always shown with it; the others only when not at PEFT's default."""
_PEFT_INTERNAL = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
                  "auto_mapping"}
"""Derived by TRL from the batch shape when not given: shown, but a clone that changes the batch derives them again."""


@dataclass(frozen=True)
class FormField:
    """One editable field of a trial's config."""

    name: str
    """The override name: a GRPOConfig field (``learning_rate``), ``peft_config.<field>``, ``model`` or
    ``reward_funcs``."""
    group: str
    """``searched`` (the study's params, first), ``set`` (not at the value a GRPOConfig made with no arguments
    holds), ``peft_config`` (the adapter's main fields and any not at PEFT's default), ``trial`` (model, reward
    functions) or ``more`` (every other field: folded)."""
    kind: str
    """``float``, ``int``, ``bool``, ``choice``, ``text`` or ``json`` (lists, dicts, anything else: JSON text)."""
    value: Any
    default: Any
    nullable: bool
    choices: list[Any] | None = None
    help: str = ""
    label: str = ""
    """What the form calls it: the Optuna param's name where the study searches it (``lora_r``, as the leaderboard's
    column), else the field's name."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def form_fields(config_json: str, params: Mapping[str, Any] | None = None) -> list[FormField]:
    """The fields of a stored config, in the order the form shows them: the searched params first (under their param
    names, as the leaderboard's columns), then the fields the trial sets (not at their default), the PEFT config's,
    the trial's model and reward functions, then every other GRPOConfig and PEFT field."""
    from trl import GRPOConfig

    data = TrialConfig.config_dict(config_json)
    searched = {_form_name(field_path(p)): p for p in params or {}}
    args = data.get("args") or {}
    hints = _grpo_hints()
    made = made_defaults()
    fields: list[FormField] = []
    for f in dataclasses.fields(GRPOConfig):
        if not f.init or f.name in PLUMBING_FIELDS or f.name in PLACEMENT_FIELDS:
            continue
        value = args.get(f.name, grpo_default(f.name))
        changed = f.name in args and _plain(value) != made.get(f.name, _plain(grpo_default(f.name)))
        group = "searched" if f.name in searched else "set" if changed and f.name not in _DERIVED else "more"
        fields.append(_field(f.name, group, hints[f.name], value, grpo_default(f.name), f.metadata.get("help", "")))
    peft = data.get("peft_config")
    if peft is not None:
        from peft import PEFT_TYPE_TO_CONFIG_MAPPING

        peft_class = PEFT_TYPE_TO_CONFIG_MAPPING[peft["peft_type"]]
        peft_hints = typing.get_type_hints(peft_class)
        for f in dataclasses.fields(peft_class):
            if not f.init or f.name not in peft or f.name in _PEFT_INTERNAL:
                continue
            default = _jsonable_default(f)
            name = f"peft_config.{f.name}"
            main = f.name in _PEFT_MAIN or _plain(peft[f.name]) != default
            group = "searched" if name in searched else "peft_config" if main else "more"
            fields.append(_field(name, group, peft_hints.get(f.name, Any), peft[f.name], default,
                                 f.metadata.get("help", "")))
    fields.append(FormField("model", "trial", "json" if isinstance(data.get("model"), Mapping) else "text",
                            data.get("model"), None, False, None, "a Hub id or a local directory (or a factory)"))
    fields.append(FormField("reward_funcs", "trial", "json", data.get("reward_funcs"), None, False, None,
                            "import paths ('module:function'); each must import where the study runs"))
    fields = [dataclasses.replace(f, label=searched.get(f.name, f.name),
                                  group="searched" if f.name in searched else f.group) for f in fields]
    order = {"searched": 0, "set": 1, "peft_config": 2, "trial": 3, "more": 4}
    names = list(searched)
    return sorted(fields, key=lambda f: (order[f.group], names.index(f.name) if f.name in names else len(names)))


def prepare() -> None:
    """Work out what `form_fields` needs of TRL once (its import, GRPOConfig's type hints and made defaults): seconds
    the first time, so the dashboard does it when it starts."""
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING  # noqa: F401 - imported once, now

    _grpo_hints()
    made_defaults()


@functools.cache
def _grpo_hints() -> dict[str, Any]:
    from trl import GRPOConfig

    return typing.get_type_hints(GRPOConfig)


@functools.cache
def made_defaults() -> dict[str, Any]:
    """Each GRPOConfig field's value, as JSON, in a GRPOConfig made with no arguments (after its ``__post_init__``,
    which fills some fields in: ``accelerator_config``, ``debug``): a trial "sets" a field whose value differs."""
    import tempfile
    import warnings

    from trl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = GRPOConfig(output_dir=tempfile.gettempdir(), use_cpu=True, bf16=False, report_to=[])
    return {f.name: _plain(jsonable(getattr(made, f.name))) for f in dataclasses.fields(GRPOConfig)
            if f.init and hasattr(made, f.name)}


def _form_name(path: str) -> str:
    """A config field's path as the form names it: ``args.learning_rate`` -> ``learning_rate``."""
    return path[len("args."):] if path.startswith("args.") else path


def reward_weighting(config_json: str) -> tuple[tuple[str, float], ...]:
    """``(("correctness", 1.0), ("soft_format", 0.5))``: a stored config's reward functions by name, with the weight
    its objective (the weighted total reward) gives each (``args.reward_weights``; 1 each when not set)."""
    data = TrialConfig.config_dict(config_json)
    names = [_reward_name(r) for r in data.get("reward_funcs") or []]
    weights = (data.get("args") or {}).get("reward_weights") or [1.0] * len(names)
    return tuple((name, float(w)) for name, w in zip(names, weights))


def _reward_name(stored: Any) -> str:
    if isinstance(stored, str):
        return stored.rpartition(":")[2].rpartition(".")[2]
    if isinstance(stored, Mapping):
        path = stored.get("class") or stored.get("factory") or "?"
        return str(path).rpartition(":")[2].rpartition(".")[2]
    return str(stored)


def _field(name: str, group: str, hint: Any, value: Any, default: Any, help_text: str) -> FormField:
    members = _members(hint)
    nullable = type(None) in members
    members = [m for m in members if m is not type(None)]
    kind, choices = "json", None
    if len(members) == 1:
        member = members[0]
        origin = typing.get_origin(member)
        if member is bool:
            kind = "bool"
        elif member is int:
            kind = "int"
        elif member is float:
            kind = "float"
        elif member is str:
            kind = "text"
        elif origin is typing.Literal:
            kind, choices = "choice", list(typing.get_args(member))
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            kind, choices = "choice", [m.value for m in member]
    elif set(members) <= {int, float}:
        kind = "float"
    elif str in members and all(m is str or typing.get_origin(m) is typing.Literal or
                                (isinstance(m, type) and issubclass(m, enum.Enum)) for m in members):
        choices = [c for m in members if m is not str for c in (typing.get_args(m) if typing.get_origin(m) is typing.Literal
                                                                else [e.value for e in m])]
        kind = "choice" if choices and value in choices else "text"
    if kind == "bool" and nullable:  # a checkbox cannot say None
        kind, choices = "choice", [True, False]
    if kind == "choice" and isinstance(value, str) and value not in (choices or []):
        kind, choices = "text", None
    return FormField(name, group, kind, _plain(value), _plain(default), nullable, choices, _first_sentence(help_text))


def _members(hint: Any) -> list[Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return [m for a in typing.get_args(hint) for m in _members(a)]
    return [hint]


def _jsonable_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return _plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _plain(f.default_factory())
    return None


def _plain(value: Any) -> Any:
    """A value as JSON can hold it (enums by value, sets as sorted lists)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def _first_sentence(text: str) -> str:
    text = " ".join(str(text).split())
    end = text.find(". ")
    return text if end < 0 or end > 300 else text[: end + 1]
