"""A trial config as JSON, and back: what a `TrialConfig` stores on its Optuna trial (``rfopt:config``).

- Reward functions, callbacks and model factories by import path (`rfopt.config.usercode`); a reward factory's product by
  its factory and arguments; an instance of a plain class (TRL's ``get_soft_overlong_punishment(...)``, a callback
  instance) by its class and attributes (`instance_to_json`).
- A tokenizer by what rebuilds it (`TokenizerSpec`).
- A ``GRPOConfig`` as the fields that differ from their declared defaults (`grpo_to_dict`), leaving out the plumbing
  rfopt sets itself (`PLUMBING_FIELDS`) and where it trains (`PLACEMENT_FIELDS`); a PEFT config by its fields.
- A config stored by the first rfopt (``grpo``, ``rewards``, ``peft``, ...) is read in the current layout
  (`current_layout`), so that its study keeps loading.

    >>> grpo_to_dict(GRPOConfig(learning_rate=5e-6, bf16=False))                   # doctest: +SKIP
    {'learning_rate': 5e-06}
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rfopt import compat
from rfopt.errors import ConfigError

from .rewardfuncs import reward_name
from .usercode import import_path, resolve_import

# Fields of GRPOConfig that rfopt sets itself for every chunk; a user's value is ignored (see runner.py).
PLUMBING_FIELDS = frozenset(
    {
        "output_dir",
        "logging_dir",
        "overwrite_output_dir",
        "report_to",
        "run_name",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "logging_steps",
        "logging_strategy",
        "eval_strategy",
        "do_eval",
        "disable_tqdm",
        "push_to_hub",
        "hub_model_id",
        "resume_from_checkpoint",
    }
)
# Where and in what precision a chunk trains: decided by the device the study runs on (models.Placement), whatever
# the config says; not stored, so a config means the same on a CPU and on a GPU. transformers derives
# dataloader_pin_memory from use_cpu (False on the CPU): stored, it made a CPU config and a GPU one differ in it.
PLACEMENT_FIELDS = frozenset({"use_cpu", "bf16", "fp16", "dataloader_pin_memory"})
# Derived from other fields in GRPOConfig.__post_init__; storing both would make TRL refuse the config.
_DERIVED_FIELDS = frozenset({"generation_batch_size"})

_TOKENIZER_SETTINGS = ("pad_token", "padding_side", "truncation_side", "chat_template")
"""The settings of a tokenizer instance that a stored `processing_class` keeps (those a user typically changes)."""

# rfopt's own reward functions that do what a TRL reward factory's product does (named when TRL's cannot be stored).
_RFOPT_EQUIVALENTS = {
    "get_soft_overlong_punishment": "rfopt.rewards.soft_overlong_punishment(max_completion_length, soft_punish_cache)",
}


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer given as `TrialConfig.processing_class`, as rfopt stores and rebuilds it on any worker:
    ``AutoTokenizer.from_pretrained(name_or_path, **kwargs)`` with `settings` (pad_token, padding_side,
    truncation_side, chat_template, where the given tokenizer's differ from the loaded one's) set on it."""

    name_or_path: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """``from_pretrained`` keyword arguments (only configs stored with ``tokenizer_kwargs`` have them)."""

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerSpec:
        """What rebuilds `tokenizer`; `ConfigError` if nothing can (it cannot be loaded again by its name_or_path, or
        it has tokens added since it was loaded)."""
        name = getattr(tokenizer, "name_or_path", "")
        save = "save it with tokenizer.save_pretrained(directory) and give that directory as processing_class"
        if not name:
            raise ConfigError(f"processing_class: this tokenizer has no name_or_path (it was built in memory); {save}")
        try:
            loaded = cls(name).load()
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"processing_class: rfopt loads the tokenizer again on every worker from its name_or_path {name!r}, "
                f"which cannot be loaded ({exc}); {save}"
            ) from None
        if len(loaded) != len(tokenizer):
            raise ConfigError(
                f"processing_class: this tokenizer has {len(tokenizer)} tokens, the one loaded from {name!r} has "
                f"{len(loaded)} (tokens were added); {save}"
            )
        settings = {k: getattr(tokenizer, k) for k in _TOKENIZER_SETTINGS if getattr(tokenizer, k) != getattr(loaded, k)}
        return cls(name, settings)

    def load(self) -> Any:
        from transformers import AutoTokenizer

        from rfopt.smollm2 import SMOLLM2, smollm2_path

        source = str(smollm2_path()) if self.name_or_path == SMOLLM2 else self.name_or_path
        tokenizer = AutoTokenizer.from_pretrained(source, **self.kwargs)
        for name, value in self.settings.items():
            setattr(tokenizer, name, value)
        return tokenizer

    def to_dict(self) -> dict[str, Any]:
        data = {"name_or_path": self.name_or_path, **jsonable(dict(self.settings))}
        if self.kwargs:
            data["from_pretrained"] = jsonable(dict(self.kwargs))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenizerSpec:
        settings = {k: v for k, v in data.items() if k in _TOKENIZER_SETTINGS}
        return cls(data["name_or_path"], settings, dict(data.get("from_pretrained") or {}))


def reward_to_json(func: Any) -> str | dict[str, Any]:
    """A reward function as stored: ``"module:function"``; a factory's product as the factory's path and arguments
    (``rfopt_factory``); an instance of a callable class (TRL's ``get_soft_overlong_punishment(...)``) as its class
    and attributes (`instance_to_json`)."""
    if isinstance(func, (str, Mapping)):
        return func if isinstance(func, str) else dict(func)  # left unresolved (`from_dict(resolve_code=False)`)
    factory = getattr(func, "rfopt_factory", None)
    if factory is not None:
        path, kwargs = factory
        return {"factory": path, "kwargs": jsonable(dict(kwargs))}
    if compat.object_state(func) is not None:
        return instance_to_json(func, f"reward function {reward_name(func)!r}")
    qualname = getattr(func, "__qualname__", "")
    module = getattr(func, "__module__", None) or ""
    if "<locals>" in qualname and module.split(".")[0] == "trl":
        made_by = qualname.split(".<locals>")[0]
        equivalent = _RFOPT_EQUIVALENTS.get(made_by)
        instead = (f"use {equivalent}, which rfopt stores with its arguments" if equivalent else
                   "call it from a reward function defined at the top level of a module")
        raise ConfigError(f"reward function {reward_name(func)!r}, made by trl.rewards.{made_by}(...), cannot be "
                          f"stored by import path (TRL made it as a closure); {instead}")
    return import_path(func)


def reward_from_json(data: str | Mapping[str, Any]) -> Any:
    if isinstance(data, str):
        return resolve_import(data)
    if "class" in data:
        return instance_from_json(data)
    return resolve_import(data["factory"])(**data.get("kwargs", {}))


def callback_to_json(callback: Any) -> str | dict[str, Any]:
    """A per-trial ``TrainerCallback`` as stored: a class by its import path, an instance by its class and attributes
    (`instance_to_json`); `ConfigError` for anything else."""
    from transformers import TrainerCallback

    if isinstance(callback, (str, Mapping)):
        return callback if isinstance(callback, str) else dict(callback)  # left unresolved
    if isinstance(callback, type):
        if not issubclass(callback, TrainerCallback):
            raise ConfigError(f"callbacks: {callback.__name__} is not a transformers.TrainerCallback")
        return import_path(callback)
    if not isinstance(callback, TrainerCallback):
        raise ConfigError(f"callbacks: {callback!r} is not a transformers.TrainerCallback class or instance")
    return instance_to_json(callback, f"callback {type(callback).__name__}")


def callback_from_json(data: str | Mapping[str, Any]) -> Any:
    return resolve_import(data) if isinstance(data, str) else instance_from_json(data)


def instance_to_json(obj: Any, what: str) -> dict[str, Any]:
    """``{"class": "module:Class", "attrs": {...}}``: an instance stored as pickle stores a plain object (its class,
    then its attributes), with the attributes as JSON; `ConfigError` naming `what` if it cannot be."""
    state = compat.object_state(obj)
    if state is None:
        raise ConfigError(f"{what}: {type(obj).__name__} instances cannot be stored (only instances of a plain class, "
                          "whose state is its attributes); give the class, or a top-level function")
    path = import_path(type(obj))
    try:
        attrs = json.loads(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: its attributes must be JSON values (numbers, strings, lists, dicts) to be stored "
                          f"with the trial ({exc}); set the others in its class, or give the class") from None
    return {"class": path, "attrs": attrs}


def instance_from_json(data: Mapping[str, Any]) -> Any:
    """Inverse of `instance_to_json`: ``cls.__new__(cls)`` with the attributes put back, as pickle restores it."""
    return compat.object_from_state(resolve_import(data["class"]), dict(data.get("attrs") or {}))


# ---------------------------------------------------------------------- GRPOConfig and PEFT as JSON
def grpo_to_dict(grpo: Any, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The fields of a GRPOConfig (those in `names`, default all) that differ from their declared defaults, as
    JSON-able values.

    Declared defaults, not a default instance: TRL resolves some defaults by machine (``bf16``), and a
    config stored on one machine must mean the same on another.
    """
    from trl import GRPOConfig

    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if not f.init or f.name in PLUMBING_FIELDS or f.name in PLACEMENT_FIELDS or f.name in _DERIVED_FIELDS:
            continue
        if names is not None and f.name not in names:
            continue
        default = _declared_default(f)
        value = getattr(grpo, f.name)
        if default is dataclasses.MISSING or jsonable(value) != jsonable(default):
            out[f.name] = jsonable(value)
    return out


def grpo_default(name: str) -> Any:
    """The declared default of GRPOConfig field `name`, as JSON (what a stored config leaves out); None if it has
    none."""
    from trl import GRPOConfig

    for f in dataclasses.fields(GRPOConfig):
        if f.name == name:
            default = _declared_default(f)
            return None if default is dataclasses.MISSING else jsonable(default)
    return None


def _declared_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def peft_to_dict(config: Any) -> dict[str, Any]:
    init_fields = {f.name for f in dataclasses.fields(type(config)) if f.init}
    data = {k: jsonable(v) for k, v in config.to_dict().items() if k in init_fields}
    data["peft_type"] = jsonable(config.peft_type)
    return data


def peft_config_class(data: Mapping[str, Any]) -> type:
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING

    return PEFT_TYPE_TO_CONFIG_MAPPING[data["peft_type"]]


def peft_from_dict(data: Mapping[str, Any]) -> Any:
    config_cls = peft_config_class(data)
    data = {k: v for k, v in data.items() if k != "peft_type"}
    init_fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    return config_cls(**{k: v for k, v in data.items() if k in init_fields})


def jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return str(value)


# ---------------------------------------------------------------------- configs of an earlier rfopt
_OLD_PACKAGES = ("rewards", "studies")
"""Top-level packages of the first rfopt, now ``rfopt.rewards`` and ``rfopt.studies``."""


def current_layout(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict in the current layout. One stored by the first rfopt (keys ``grpo``, ``rewards``, ``peft``,
    ``reward_weights``, ``model_kwargs``, ``tokenizer_kwargs``, ``quantization``; import paths into the top-level
    packages ``rewards`` and ``studies``) is translated, so that its study keeps loading; nothing is imported."""
    if "grpo" not in data:
        return _without_placement(dict(data))
    old = json.loads(json.dumps(data))  # a deep copy
    args = dict(old["grpo"])
    if old.get("reward_weights") is not None:
        args["reward_weights"] = old["reward_weights"]
    if old.get("model_kwargs"):
        args["model_init_kwargs"] = old["model_kwargs"]
    model = old["model"]
    if isinstance(model, Mapping):
        model = {**model, "factory": _moved_path(model["factory"])}
    processing_class = None
    tokenizer_kwargs = dict(old.get("tokenizer_kwargs") or {})
    if tokenizer_kwargs and isinstance(model, str):
        settings = {k: tokenizer_kwargs.pop(k) for k in _TOKENIZER_SETTINGS if k in tokenizer_kwargs}
        processing_class = TokenizerSpec(model, settings, tokenizer_kwargs).to_dict()
    rewards = [_moved_path(r) if isinstance(r, str) else {**r, "factory": _moved_path(r["factory"])}
               for r in old["rewards"]]
    return _without_placement({"model": model, "reward_funcs": rewards, "args": args, "processing_class": processing_class,
                               "callbacks": [], "quantization_config": old.get("quantization"),
                               "peft_config": old.get("peft")})


def _without_placement(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without placement fields in its args: an earlier rfopt stored ``dataloader_pin_memory`` (False for a
    config written for the CPU), which the device decides."""
    args = data.get("args")
    if isinstance(args, Mapping) and PLACEMENT_FIELDS & set(args):
        data["args"] = {k: v for k, v in args.items() if k not in PLACEMENT_FIELDS}
    return data


def _moved_path(path: str) -> str:
    """``rewards.answers:correctness`` -> ``rfopt.rewards.answers:correctness`` (and ``studies.``), where rfopt has
    that module; any other path as it is."""
    module, sep, name = path.partition(":")
    if module.split(".")[0] not in _OLD_PACKAGES:
        return path
    try:
        moved = importlib.util.find_spec(f"rfopt.{module}") is not None
    except (ImportError, ValueError):
        moved = False
    return f"rfopt.{module}{sep}{name}" if moved else path
