"""FIELD=VALUE overrides of a config: the command line's ``--set``, the dashboard's clone form, `TrialConfig.with_overrides`,
`rfopt.grid` and clones.

A name means the field `rfopt.config.params.field_path` says (``learning_rate``, ``lora_r``, ``peft_config.lora_alpha``,
``args.beta``, the first rfopt's ``grpo.<field>``). A value must be of the field's declared type (GRPOConfig's and
PEFT's annotations); a text is read as that type, as a command line of the config would be (``"2e-6"`` for
``learning_rate``). Nothing the config names is imported: the dashboard clones trials of studies whose code it
cannot import.

    >>> override_dict(config.to_dict(), {"learning_rate": "2e-6", "lora_r": 8})[1]   # doctest: +SKIP
    {'learning_rate': 2e-06, 'lora_r': 8}
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from rfopt.errors import ConfigError

from .codec import PLACEMENT_FIELDS, PLUMBING_FIELDS, current_layout, jsonable, peft_config_class
from .params import field_path

_OWN_FIELDS = ("model", "reward_funcs")
UNSUPPORTED_FIELDS = {
    "deepspeed": "DeepSpeed is not supported yet; a trial over several devices is data parallel (--devices-per-trial)",
    "fsdp": "FSDP is not supported yet; a trial over several devices is data parallel (--devices-per-trial)",
    "fsdp_config": "FSDP is not supported yet; a trial over several devices is data parallel (--devices-per-trial)",
}
"""GRPOConfig fields rfopt refuses (README, "not yet"), with why."""


def override_dict(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`data` (a `TrialConfig.to_dict()`) with fields changed by name (`rfopt.config.params.field_path` says which field a
    name means), and the overrides as the typed values they became; `ConfigError` naming the field if a name or a
    value's type is wrong. Needs nothing imported that the config names: the dashboard clones trials of studies whose
    code it cannot import."""
    from trl import GRPOConfig

    data = current_layout(json.loads(json.dumps(data)))  # a deep copy
    typed: dict[str, Any] = {}
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    for name, value in overrides.items():
        target = field_path(name)
        if target.startswith("peft_config."):
            key = target[len("peft_config."):]
            if data["peft_config"] is None:
                raise ConfigError(f"{name}: this trial has no PEFT adapter (full fine-tuning); cannot set {key}")
            peft_class = peft_config_class(data["peft_config"])
            if key not in {f.name for f in dataclasses.fields(peft_class) if f.init}:
                raise ConfigError(f"{name}: {peft_class.__name__} has no field {key!r}")
            data["peft_config"][key] = typed[name] = jsonable(typed_value(peft_class, key, value, name))
        elif target.startswith("args."):
            key = target.removeprefix("args.")
            if key not in grpo_fields:
                raise ConfigError(f"{name}: GRPOConfig has no field {key!r}")
            if key in PLUMBING_FIELDS:
                raise ConfigError(f"{name}: rfopt sets {key} itself; it cannot be overridden")
            if key in UNSUPPORTED_FIELDS:
                raise ConfigError(f"{name}: {UNSUPPORTED_FIELDS[key]}")
            if key in PLACEMENT_FIELDS:
                raise ConfigError(f"{name}: the device a study runs on decides use_cpu, bf16 and fp16 (and "
                                  "dataloader_pin_memory, which transformers derives from use_cpu) "
                                  "(optimize(device=..., precision=...), rfopt run --device ... --precision ...)")
            data["args"][key] = typed[name] = jsonable(typed_value(GRPOConfig, key, value, name))
            if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
                # Let TRL derive the generation batch again from the new batch shape.
                data["args"].pop("steps_per_generation", None)
        elif target in _OWN_FIELDS:
            data[target] = typed[name] = jsonable(_own_value(target, value))
        else:
            raise ConfigError(
                f"{name}: unknown field; use a GRPOConfig field (e.g. learning_rate, reward_weights, or "
                f"args.<field>), a PEFT field (peft_config.<field>, lora_r, lora_alpha, lora_dropout), model or "
                "reward_funcs"
            )
    return data, typed


def parse_assignments(items: Sequence[str]) -> dict[str, str]:
    """``["learning_rate=2e-6", "lora_r=8"]`` -> ``{"learning_rate": "2e-6", "lora_r": "8"}``: the command line's and
    the dashboard's ``FIELD=VALUE`` overrides. The texts are read as their fields' types by `override_dict`."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. learning_rate=2e-6")
        out[name.strip()] = text.strip()
    return out


def typed_value(config_class: type, field_name: str, value: Any, name: str | None = None) -> Any:
    """`value` for `config_class`'s field, by the field's declared type: a string is parsed as that type (with
    ``transformers.HfArgumentParser``, as a command line of the config would be), anything else must be of it."""
    name = name or field_name
    hint = typing.get_type_hints(config_class)[field_name]
    if isinstance(value, str) and (not _accepts(hint, value) or _has_typed_member(hint)):
        return _parse_text(config_class, field_name, hint, value, name)
    if not _accepts(hint, value):
        raise ConfigError(f"{name}: expected {_type_name(hint)}, got {value!r}")
    if float in _members(hint) and int not in _members(hint) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return _finite(value, name)


def _finite(value: Any, name: str) -> Any:
    """`value`, unless it is (or holds) a number that is not finite: a stored config keeps numbers as JSON, and training
    refuses them anyway (``1e400`` reads as inf)."""
    numbers = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        raise ConfigError(f"{name}: {value!r} is not a finite number; give a finite one")
    return value


def _parse_text(config_class: type, field_name: str, hint: Any, text: str, name: str) -> Any:
    import argparse

    from transformers import HfArgumentParser

    if _accepts(hint, text) and not any(m in (bool, int, float) for m in _members(hint)):
        # A union of str with a list or dict (PEFT's target_modules: str | list[str] | None), which transformers'
        # parser narrows to one member, depending on the order Python's typing cache keeps the union in: a list or
        # dict as its JSON text (as a param holds it), anything else the text itself.
        decoded = json.loads(text) if _is_json(text) else None
        return decoded if isinstance(decoded, (list, dict)) and _accepts(hint, decoded) else text
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    one = dataclasses.make_dataclass(
        "Override", [(field_name, hint, dataclasses.field(default=None, metadata=fields[field_name].metadata))]
    )
    items = json.loads(text) if text.startswith("[") and _is_json(text) else [text]
    try:
        parser = HfArgumentParser(one, exit_on_error=False)
        (parsed,) = parser.parse_args_into_dataclasses(args=[f"--{field_name}", *map(str, items)])
    except (argparse.ArgumentError, ValueError, TypeError, SystemExit):
        raise ConfigError(f"{name}: expected {_type_name(hint)}, got {text!r}") from None
    value = getattr(parsed, field_name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: {text!r} is not a finite number (it reads as {value}); give a finite one")
    return value


def _own_value(field_name: str, value: Any) -> Any:
    if isinstance(value, str) and field_name != "model" and _is_json(value):
        value = json.loads(value)
    if field_name == "reward_funcs":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(r, (str, Mapping)) for r in value):
            raise ConfigError(f"reward_funcs: expected import paths ('module:function'), got {value!r}")
    return value


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _members(hint: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return tuple(m for a in typing.get_args(hint) for m in _members(a))
    return (hint,)


def _has_typed_member(hint: Any) -> bool:
    """Whether a union that accepts strings also has a member a text may mean (``true`` for ``bool | str``)."""
    return any(m in (bool, int, float) or typing.get_origin(m) in (list, dict) for m in _members(hint))


def _accepts(hint: Any, value: Any) -> bool:
    if hint is Any:
        return True
    members = _members(hint)
    if len(members) > 1:
        return any(_accepts(m, value) for m in members)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple)) and (not args or all(_accepts(args[0], v) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, Mapping)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {m.value for m in hint}
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    names = []
    for m in _members(hint):
        if m is type(None):
            names.append("None")
        elif typing.get_origin(m) is typing.Literal:
            names.append(" or ".join(repr(a) for a in typing.get_args(m)))
        elif m in (int, float):
            names.append("a number" if m is float else "an integer")
        elif m is bool:
            names.append("true/false")
        else:
            names.append(getattr(m, "__name__", str(m)))
    return " or ".join(dict.fromkeys(names))
