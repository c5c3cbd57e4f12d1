"""`TrialConfig`: one GRPO configuration, the unit a study searches over.

A config names the base model, how to load it, the PEFT adapter (or None for full fine-tuning), the
TRL `GRPOConfig` (passed through unmodified, apart from the plumbing rfopt owns: output dir,
saving, logging, step budget, data order) and the reward functions. It round-trips through JSON
(reward functions and model factories by import path) so that the full resolved config is stored
on its Optuna trial and a study can be resumed, cloned or inspected from storage alone.

    >>> from peft import LoraConfig
    >>> from trl import GRPOConfig
    >>> import rewards
    >>> config = TrialConfig(
    ...     model="smollm2",
    ...     peft=LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"),
    ...     grpo=GRPOConfig(learning_rate=5e-6, num_generations=4, per_device_train_batch_size=4, bf16=False),
    ...     rewards=[rewards.correctness, rewards.soft_format],
    ... )
    >>> TrialConfig.from_json(config.to_json()).grpo.learning_rate
    5e-06
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import json
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .evaluation import reward_name

RewardFunc = Callable[..., list]

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
# the config says; not stored, so a config means the same on a CPU and on a GPU.
PLACEMENT_FIELDS = frozenset({"use_cpu", "bf16", "fp16"})
# Derived from other fields in GRPOConfig.__post_init__; storing both would make TRL refuse the config.
_DERIVED_FIELDS = frozenset({"generation_batch_size"})
# Bare override names that mean a PEFT field (the others go to the GRPOConfig or the TrialConfig).
_OVERRIDE_ALIASES = {"lora_r": "peft.r", "r": "peft.r", "lora_alpha": "peft.lora_alpha", "lora_dropout": "peft.lora_dropout"}


class ConfigError(ValueError):
    """A trial configuration that rfopt refuses before any training, with the field and the fix."""


@dataclass
class TrialConfig:
    """One GRPO configuration. Each becomes one Optuna trial."""

    model: str | Callable[[], tuple[Any, Any]]
    """Hub id, local directory, ``"smollm2"`` (the offline default), or a function returning
    ``(model, tokenizer)``; a function is stored by import path, so it must be importable."""
    grpo: Any
    """A ``trl.GRPOConfig``, used as given except for the plumbing fields rfopt owns."""
    rewards: list[RewardFunc | str]
    """Reward functions with TRL's signature, or ``"module:name"`` import paths."""
    peft: Any = None
    """A ``peft.LoraConfig`` (one adapter per trial on a shared base model), or None for full fine-tuning."""
    reward_weights: list[float] | None = None
    """Weights of the reward functions in the total reward (default: all 1.0); sets ``grpo.reward_weights``."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``from_pretrained`` keyword arguments, e.g. ``{"dtype": "bfloat16"}``."""
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``AutoTokenizer.from_pretrained`` keyword arguments."""
    quantization: Any = None
    """A ``transformers.BitsAndBytesConfig`` (e.g. 4-bit QLoRA); needs a CUDA device."""

    def __post_init__(self) -> None:
        self.rewards = [resolve_import(r) if isinstance(r, str) else r for r in self.rewards]
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]

    # ------------------------------------------------------------------ validation
    def validate(self, check_code: bool = True) -> None:
        """Raise `ConfigError` naming the field and the fix for anything rfopt or TRL would refuse.

        `check_code=False` for a config whose reward functions and model factory were left as import paths
        (`from_dict(..., resolve_code=False)`)."""
        from trl import GRPOConfig

        problems = []
        if isinstance(self.model, str):
            if not self.model.strip():
                problems.append("model: empty; give a Hub id, a local directory or 'smollm2'")
        elif check_code and not callable(self.model):
            problems.append(f"model: expected a string or a function returning (model, tokenizer), got {type(self.model).__name__}")
        if not isinstance(self.grpo, GRPOConfig):
            problems.append(f"grpo: expected a trl.GRPOConfig, got {type(self.grpo).__name__}")
        else:
            if self.grpo.use_vllm:
                problems.append(
                    "grpo.use_vllm: generation with vLLM is not supported yet; rfopt generates with transformers. "
                    "Set use_vllm=False"
                )
            for f in dataclasses.fields(self.grpo):
                value = getattr(self.grpo, f.name, None)
                if isinstance(value, float) and math.isnan(value):
                    problems.append(f"grpo.{f.name}: NaN; give a number")
        if not self.rewards:
            problems.append("rewards: empty; give at least one reward function")
        for i, func in enumerate(self.rewards if check_code else []):
            if not callable(func):
                problems.append(f"rewards[{i}]: {func!r} is not callable")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            problems.append(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.rewards)} reward functions"
            )
        if self.peft is not None:
            from peft import PeftConfig

            if not isinstance(self.peft, PeftConfig):
                problems.append(f"peft: expected a peft.LoraConfig or None, got {type(self.peft).__name__}")
        if self.peft is None and isinstance(self.grpo, GRPOConfig) and self.grpo.beta != 0.0:
            problems.append(
                "grpo.beta: a KL penalty (beta > 0) needs a PEFT adapter in rfopt for now (the reference model is the "
                "base with the adapter disabled); set peft=LoraConfig(...) or beta=0.0"
            )
        if self.quantization is not None and self.peft is None:
            problems.append("quantization: a quantized base model can only be trained with a PEFT adapter; set peft")
        if problems:
            raise ConfigError("; ".join(problems))
        if isinstance(self.grpo, GRPOConfig):
            check_training_values(self.grpo)

    def resolved_grpo(self) -> Any:
        """The GRPOConfig with `reward_weights` applied."""
        if self.reward_weights is None:
            return self.grpo
        return dataclasses.replace(self.grpo, reward_weights=list(self.reward_weights), **_derived_free(self.grpo))

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(f) for f in self.rewards]

    @property
    def model_key(self) -> str:
        """Identifies the base model (and how it is loaded) for sharing one resident copy between trials."""
        return json.dumps(self._base_model_dict(), sort_keys=True)

    def _base_model_dict(self) -> dict[str, Any]:
        return {
            "model": self.model if isinstance(self.model, str) else {"factory": import_path(self.model)},
            "model_kwargs": _jsonable(self.model_kwargs),
            "tokenizer_kwargs": _jsonable(self.tokenizer_kwargs),
            "quantization": None if self.quantization is None else _jsonable(self.quantization.to_dict()),
        }

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            **self._base_model_dict(),
            "peft": None if self.peft is None else _peft_to_dict(self.peft),
            "grpo": grpo_to_dict(self.grpo),
            "rewards": [reward_to_json(f) for f in self.rewards],
            "reward_weights": self.reward_weights,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def config_dict(text: str) -> dict[str, Any]:
        """A stored config (``rfopt:config``) as its dict, without importing anything it names."""
        return json.loads(text)

    @staticmethod
    def json_of(data: Mapping[str, Any]) -> str:
        """A config dict (`to_dict`, `config_dict`) as the JSON a trial stores."""
        return json.dumps(data, sort_keys=True)

    @staticmethod
    def base_model_of(data: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a config dict that decide its base model (what `model_key` identifies)."""
        return {k: data.get(k) for k in ("model", "model_kwargs", "tokenizer_kwargs", "quantization")}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], resolve_code: bool = True) -> TrialConfig:
        """The config a dict describes. With `resolve_code=False` its reward functions and model factory stay import
        paths (nothing of the study's own code is imported): such a config can be checked
        (`validate(check_code=False)`, `check_model`), not trained."""
        from trl import GRPOConfig

        model = data["model"]
        if isinstance(model, Mapping) and resolve_code:
            model = resolve_import(model["factory"])
        quantization = None
        if data.get("quantization") is not None:
            from transformers import BitsAndBytesConfig

            quantization = BitsAndBytesConfig.from_dict(dict(data["quantization"]))
        peft = None if data.get("peft") is None else _peft_from_dict(data["peft"])
        config = cls(
            model=model,
            # Placement is the device's (PLACEMENT_FIELDS); bf16 on a machine without a GPU would make TRL refuse it.
            grpo=GRPOConfig(**{**data["grpo"], "bf16": False, "fp16": False}),
            rewards=[reward_from_json(r) for r in data["rewards"]] if resolve_code else [],
            peft=peft,
            reward_weights=data.get("reward_weights"),
            model_kwargs=dict(data.get("model_kwargs") or {}),
            tokenizer_kwargs=dict(data.get("tokenizer_kwargs") or {}),
            quantization=quantization,
        )
        if not resolve_code:
            config.rewards = list(data["rewards"])
        return config

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ overrides
    def with_overrides(self, overrides: Mapping[str, Any]) -> TrialConfig:
        """A copy with fields changed by name, validated; raises `ConfigError` and changes nothing on bad input.

        Names are GRPOConfig fields (``learning_rate``), PEFT fields (``peft.r``, or the aliases ``lora_r``,
        ``lora_alpha``, ``lora_dropout``) or TrialConfig fields (``model``, ``reward_weights``, ``rewards``);
        ``grpo.<field>`` and ``peft.<field>`` are accepted too. A string given for a field of another type is
        read as that type (``"2e-6"`` for ``learning_rate``), as on the command line.
        """
        data, _ = override_dict(self.to_dict(), overrides)
        try:
            config = TrialConfig.from_dict(data)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"overrides {dict(overrides)} make an invalid config: {exc}") from exc
        config.validate()
        return config


_OWN_FIELDS = ("model", "model_kwargs", "tokenizer_kwargs", "reward_weights", "rewards")


def override_dict(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`data` (a `TrialConfig.to_dict()`) with fields changed by name, and the overrides as the typed values they
    became; `ConfigError` naming the field if a name or a value's type is wrong. Needs nothing imported that the
    config names: the dashboard clones trials of studies whose code it cannot import."""
    from trl import GRPOConfig

    data = json.loads(json.dumps(data))  # a deep copy
    typed: dict[str, Any] = {}
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    for name, value in overrides.items():
        target = _OVERRIDE_ALIASES.get(name, name)
        if target.startswith("peft."):
            key = target[len("peft."):]
            if data["peft"] is None:
                raise ConfigError(f"{name}: this trial has no PEFT adapter (full fine-tuning); cannot set {key}")
            peft_class = _peft_class(data["peft"])
            if key not in {f.name for f in dataclasses.fields(peft_class) if f.init}:
                raise ConfigError(f"{name}: {peft_class.__name__} has no field {key!r}")
            data["peft"][key] = typed[name] = _jsonable(typed_value(peft_class, key, value, name))
        elif target.startswith("grpo.") or target in grpo_fields:
            key = target.removeprefix("grpo.")
            if key not in grpo_fields:
                raise ConfigError(f"{name}: GRPOConfig has no field {key!r}")
            if key in PLUMBING_FIELDS:
                raise ConfigError(f"{name}: rfopt sets {key} itself; it cannot be overridden")
            if key in PLACEMENT_FIELDS:
                raise ConfigError(f"{name}: the device a study runs on decides use_cpu, bf16 and fp16 "
                                  "(optimize(device=..., precision=...), rfopt run --device ... --precision ...)")
            data["grpo"][key] = typed[name] = _jsonable(typed_value(GRPOConfig, key, value, name))
            if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
                # Let TRL derive the generation batch again from the new batch shape.
                data["grpo"].pop("steps_per_generation", None)
        elif target in _OWN_FIELDS:
            data[target] = typed[name] = _jsonable(_own_value(target, value))
        else:
            raise ConfigError(
                f"{name}: unknown field; use a GRPOConfig field (e.g. learning_rate), a PEFT field "
                f"(peft.r, lora_alpha, lora_dropout) or one of {sorted(_OWN_FIELDS)}"
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
    return value


def _parse_text(config_class: type, field_name: str, hint: Any, text: str, name: str) -> Any:
    import argparse

    from transformers import HfArgumentParser

    fields = {f.name: f for f in dataclasses.fields(config_class)}
    one = dataclasses.make_dataclass(
        "Override", [(field_name, hint, dataclasses.field(default=None, metadata=fields[field_name].metadata))]
    )
    parser = HfArgumentParser(one, exit_on_error=False)
    items = json.loads(text) if text.startswith("[") and _is_json(text) else [text]
    try:
        (parsed,) = parser.parse_args_into_dataclasses(args=[f"--{field_name}", *map(str, items)])
    except (argparse.ArgumentError, ValueError, TypeError, SystemExit):
        raise ConfigError(f"{name}: expected {_type_name(hint)}, got {text!r}") from None
    return getattr(parsed, field_name)


def _own_value(field_name: str, value: Any) -> Any:
    if isinstance(value, str) and field_name != "model" and _is_json(value):
        value = json.loads(value)
    if field_name in ("model_kwargs", "tokenizer_kwargs") and not isinstance(value, Mapping):
        raise ConfigError(f"{field_name}: expected a mapping of keyword arguments, got {value!r}")
    if field_name == "reward_weights" and not (
        isinstance(value, (list, tuple)) and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value)
    ):
        raise ConfigError(f"reward_weights: expected a list of numbers, got {value!r}")
    if field_name == "rewards":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(r, (str, Mapping)) for r in value):
            raise ConfigError(f"rewards: expected import paths ('module:function'), got {value!r}")
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


def check_training_values(grpo: Any) -> None:
    """What a `GRPOConfig` accepts but training refuses when it starts: build, on one dummy parameter, the optimizer
    and LR scheduler a trainer with `grpo` builds, and the sampling warpers its generation uses; `ConfigError` with
    their own message if one refuses a value (``learning_rate=-1``, ``lr_scheduler_type``, ``temperature=0``)."""
    import torch
    from transformers import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, Trainer,
                              get_scheduler)

    try:
        optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(grpo)
        optimizer = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        get_scheduler(grpo.lr_scheduler_type, optimizer, num_warmup_steps=grpo.get_warmup_steps(10),
                      num_training_steps=10, scheduler_specific_kwargs=grpo.lr_scheduler_kwargs or {})
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"grpo: the trainer's optimizer or LR scheduler refuses these settings: {exc}") from exc
    try:
        TemperatureLogitsWarper(grpo.temperature)
        TopPLogitsWarper(grpo.top_p)
        if grpo.top_k:
            TopKLogitsWarper(grpo.top_k)
        if grpo.min_p is not None:
            MinPLogitsWarper(grpo.min_p)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"grpo: generation refuses these sampling settings: {exc}") from exc


def check_model(config: TrialConfig) -> None:
    """`ConfigError` unless the config's model can be found: the offline default is installed, a local directory
    holds a model's config, a Hub id resolves (from the local cache when offline)."""
    if not isinstance(config.model, str):
        return  # a function: resolved by import path (or left as one, where the study's code is not importable)
    if config.model == "smollm2":
        from .smollm2 import ModelUnavailableError, check_smollm2

        try:
            check_smollm2()
        except ModelUnavailableError as exc:
            raise ConfigError(f"model: {exc}") from exc
        return
    from transformers import AutoConfig

    options = {k: config.model_kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in config.model_kwargs}
    try:
        AutoConfig.from_pretrained(config.model, **options)
    except (OSError, ValueError) as exc:
        where = "a local directory with config.json" if Path(config.model).is_absolute() else "a local directory or a Hub model"
        raise ConfigError(f"model {config.model!r} cannot be found: it is not {where} ({exc})") from None


# ---------------------------------------------------------------------- import paths
def import_path(obj: Any) -> str:
    """``"module:qualname"`` for an importable function or class (a file path for ``__main__`` objects)."""
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not qualname or not module or "<" in qualname:
        raise ConfigError(
            f"{obj!r} cannot be stored by import path (a lambda or a nested function); "
            "define it at the top level of a module"
        )
    if module == "__main__" or module not in sys.modules or not _is_importable(module):
        file = getattr(sys.modules.get(module), "__file__", None)
        if file is None:
            raise ConfigError(f"{qualname}: defined in {module!r}, which has no file to import it from again")
        module = str(Path(file).resolve())
    return f"{module}:{qualname}"


def resolve_import(path: str) -> Any:
    """Inverse of `import_path`: ``"pkg.module:name"`` or ``"/path/to/file.py:name"``."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not qualname:
        raise ConfigError(f"{path!r}: expected 'module:name' or '/path/file.py:name'")
    try:
        if module_name.endswith(".py"):
            module = _running_script(Path(module_name)) or _import_user_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"{path!r} cannot be imported: {exc}") from exc
    return obj


def load_file_module(path: Path):
    name = "rfopt_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_IMPORTING: list[Path] = []
"""User files being imported to find a function stored by path (innermost last)."""


def study_on_import(path: Path, where: str) -> ConfigError:
    """The refusal to import a user file that runs a study when imported (`where`: what in it does)."""
    return ConfigError(
        f"{path} cannot be imported: it starts a study when it is imported ({where}), and rfopt imports it to find "
        "a reward function or model factory defined in it, which would run the study again. Put the study's run "
        "under `if __name__ == \"__main__\":`, or define those functions in a module of their own"
    )


def importing_user_file() -> Path | None:
    """The user file rfopt is importing right now to find a reward function or model factory, if any: a study run
    started while it imports is that file running its study again, which `Study.optimize` refuses."""
    return _IMPORTING[-1] if _IMPORTING else None


class _StudyCall(str):
    lineno: int


def _starts_a_study(path: Path) -> _StudyCall | None:
    """The first call at the top level of the file (outside ``if __name__ == "__main__":`` and functions) that creates
    or runs a study, if any: importing such a file would run its study."""
    import ast

    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None  # importing it says what is wrong
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, (ast.Attribute, ast.Name)):
                name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
                if name in ("optimize", "work", "create_study", "load_study"):
                    found = _StudyCall(f"{ast.unparse(call.func)}(...)")
                    found.lineno = call.lineno
                    return found
    return None


def _running_script(path: Path) -> Any | None:
    """The running script's module, if `path` is that script: its functions are taken from it, never imported again
    (which would run the script a second time)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    return main if file is not None and Path(file).resolve() == path.resolve() else None


def _import_user_file(path: Path) -> Any:
    started = _starts_a_study(path)
    if started is not None:
        raise study_on_import(path, f"{started}, line {started.lineno}")
    _IMPORTING.append(path.resolve())
    try:
        return load_file_module(path)
    finally:
        _IMPORTING.pop()


def _is_importable(module: str) -> bool:
    if module.startswith("rfopt_user_"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def reward_to_json(func: Any) -> str | dict[str, Any]:
    factory = getattr(func, "rfopt_factory", None)
    if factory is not None:
        path, kwargs = factory
        return {"factory": path, "kwargs": _jsonable(dict(kwargs))}
    return import_path(func)


def reward_from_json(data: str | Mapping[str, Any]) -> Any:
    if isinstance(data, str):
        return resolve_import(data)
    return resolve_import(data["factory"])(**data.get("kwargs", {}))


# ---------------------------------------------------------------------- GRPOConfig and PEFT as JSON
def grpo_to_dict(grpo: Any) -> dict[str, Any]:
    """The fields of a GRPOConfig that differ from their declared defaults, as JSON-able values.

    Declared defaults, not a default instance: TRL resolves some defaults by machine (``bf16``), and a
    config stored on one machine must mean the same on another.
    """
    from trl import GRPOConfig

    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if not f.init or f.name in PLUMBING_FIELDS or f.name in PLACEMENT_FIELDS or f.name in _DERIVED_FIELDS:
            continue
        default = _declared_default(f)
        value = getattr(grpo, f.name)
        if default is dataclasses.MISSING or _jsonable(value) != _jsonable(default):
            out[f.name] = _jsonable(value)
    return out


def grpo_default(name: str) -> Any:
    """The declared default of GRPOConfig field `name`, as JSON (what a stored config leaves out); None if it has
    none."""
    from trl import GRPOConfig

    for f in dataclasses.fields(GRPOConfig):
        if f.name == name:
            default = _declared_default(f)
            return None if default is dataclasses.MISSING else _jsonable(default)
    return None


def _declared_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _derived_free(grpo: Any) -> dict[str, Any]:
    """Keyword arguments that stop dataclasses.replace from passing both derived batch fields to TRL."""
    return {"generation_batch_size": None}


def _peft_to_dict(config: Any) -> dict[str, Any]:
    init_fields = {f.name for f in dataclasses.fields(type(config)) if f.init}
    data = {k: _jsonable(v) for k, v in config.to_dict().items() if k in init_fields}
    data["peft_type"] = _jsonable(config.peft_type)
    return data


def _peft_class(data: Mapping[str, Any]) -> type:
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING

    return PEFT_TYPE_TO_CONFIG_MAPPING[data["peft_type"]]


def _peft_from_dict(data: Mapping[str, Any]) -> Any:
    config_cls = _peft_class(data)
    data = {k: v for k, v in data.items() if k != "peft_type"}
    init_fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    return config_cls(**{k: v for k, v in data.items() if k in init_fields})


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)


def configs_from(values: Sequence[TrialConfig] | TrialConfig) -> list[TrialConfig]:
    return [values] if isinstance(values, TrialConfig) else list(values)
