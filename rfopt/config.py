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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    def validate(self) -> None:
        """Raise `ConfigError` naming the field and the fix for anything rfopt or TRL would refuse."""
        from trl import GRPOConfig

        problems = []
        if isinstance(self.model, str):
            if not self.model.strip():
                problems.append("model: empty; give a Hub id, a local directory or 'smollm2'")
        elif not callable(self.model):
            problems.append(f"model: expected a string or a function returning (model, tokenizer), got {type(self.model).__name__}")
        if not isinstance(self.grpo, GRPOConfig):
            problems.append(f"grpo: expected a trl.GRPOConfig, got {type(self.grpo).__name__}")
        else:
            if self.grpo.use_vllm:
                problems.append(
                    "grpo.use_vllm: generation with vLLM is not supported yet; rfopt generates with transformers. "
                    "Set use_vllm=False"
                )
            if self.grpo.bf16 and not _cuda_available():
                problems.append("grpo.bf16: bf16 needs a GPU here; set bf16=False (or use_cpu=True) to train on the CPU")
        if not self.rewards:
            problems.append("rewards: empty; give at least one reward function")
        for i, func in enumerate(self.rewards):
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

    def resolved_grpo(self) -> Any:
        """The GRPOConfig with `reward_weights` applied."""
        if self.reward_weights is None:
            return self.grpo
        return dataclasses.replace(self.grpo, reward_weights=list(self.reward_weights), **_derived_free(self.grpo))

    @property
    def reward_names(self) -> list[str]:
        return [getattr(f, "__name__", type(f).__name__) for f in self.rewards]

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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialConfig:
        from trl import GRPOConfig

        model = data["model"]
        if isinstance(model, Mapping):
            model = resolve_import(model["factory"])
        quantization = None
        if data.get("quantization") is not None:
            from transformers import BitsAndBytesConfig

            quantization = BitsAndBytesConfig.from_dict(dict(data["quantization"]))
        peft = None if data.get("peft") is None else _peft_from_dict(data["peft"])
        return cls(
            model=model,
            grpo=GRPOConfig(**data["grpo"]),
            rewards=[reward_from_json(r) for r in data["rewards"]],
            peft=peft,
            reward_weights=data.get("reward_weights"),
            model_kwargs=dict(data.get("model_kwargs") or {}),
            tokenizer_kwargs=dict(data.get("tokenizer_kwargs") or {}),
            quantization=quantization,
        )

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ overrides
    def with_overrides(self, overrides: Mapping[str, Any]) -> TrialConfig:
        """A copy with fields changed by name, validated; raises `ConfigError` and changes nothing on bad input.

        Names are GRPOConfig fields (``learning_rate``), PEFT fields (``peft.r``, or the aliases ``lora_r``,
        ``lora_alpha``, ``lora_dropout``) or TrialConfig fields (``model``, ``reward_weights``);
        ``grpo.<field>`` and ``peft.<field>`` are accepted too.
        """
        from trl import GRPOConfig

        data = self.to_dict()
        grpo_fields = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}
        own_fields = {"model", "model_kwargs", "tokenizer_kwargs", "reward_weights", "rewards"}
        for name, value in overrides.items():
            target = _OVERRIDE_ALIASES.get(name, name)
            if target.startswith("peft."):
                key = target[len("peft.") :]
                if data["peft"] is None:
                    raise ConfigError(f"{name}: this trial has no PEFT adapter (full fine-tuning); cannot set {key}")
                lora_fields = {f.name for f in dataclasses.fields(type(self.peft)) if f.init}
                if key not in lora_fields:
                    raise ConfigError(f"{name}: {type(self.peft).__name__} has no field {key!r}")
                data["peft"][key] = _coerce(name, value, getattr(self.peft, key))
            elif target.startswith("grpo.") or target in grpo_fields:
                key = target.removeprefix("grpo.")
                if key not in grpo_fields:
                    raise ConfigError(f"{name}: GRPOConfig has no field {key!r}")
                if key in PLUMBING_FIELDS:
                    raise ConfigError(f"{name}: rfopt sets {key} itself; it cannot be overridden")
                data["grpo"][key] = _jsonable(_coerce(name, value, getattr(self.grpo, key)))
                if key in ("per_device_train_batch_size", "gradient_accumulation_steps") and "steps_per_generation" in data["grpo"]:
                    # Let TRL derive the generation batch again from the new batch shape.
                    if self.grpo.steps_per_generation == self.grpo.gradient_accumulation_steps:
                        data["grpo"].pop("steps_per_generation")
            elif target in own_fields:
                data[target] = _jsonable(value)
            else:
                raise ConfigError(
                    f"{name}: unknown field; use a GRPOConfig field (e.g. learning_rate), a PEFT field "
                    f"(peft.r, lora_alpha, lora_dropout) or one of {sorted(own_fields)}"
                )
        try:
            config = TrialConfig.from_dict(data)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"overrides {dict(overrides)} make an invalid config: {exc}") from exc
        config.validate()
        return config


def parse_override(item: str) -> tuple[str, Any]:
    """``"learning_rate=2e-6"`` -> ``("learning_rate", 2e-6)``: the value read as JSON, else as text.

    How the command line and the dashboard read ``FIELD=VALUE`` overrides for `TrialConfig.with_overrides`.
    """
    name, sep, text = item.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. learning_rate=2e-6")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = {"True": True, "False": False, "None": None}.get(text, text)
    return name.strip(), value


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
            module = _load_file_module(Path(module_name))
        else:
            module = importlib.import_module(module_name)
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"{path!r} cannot be imported: {exc}") from exc
    return obj


def _load_file_module(path: Path):
    name = "rfopt_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
        if not f.init or f.name in PLUMBING_FIELDS or f.name in _DERIVED_FIELDS:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(grpo, f.name)
        if default is dataclasses.MISSING or _jsonable(value) != _jsonable(default):
            out[f.name] = _jsonable(value)
    return out


def _derived_free(grpo: Any) -> dict[str, Any]:
    """Keyword arguments that stop dataclasses.replace from passing both derived batch fields to TRL."""
    return {"generation_batch_size": None}


def _peft_to_dict(config: Any) -> dict[str, Any]:
    init_fields = {f.name for f in dataclasses.fields(type(config)) if f.init}
    data = {k: _jsonable(v) for k, v in config.to_dict().items() if k in init_fields}
    data["peft_type"] = _jsonable(config.peft_type)
    return data


def _peft_from_dict(data: Mapping[str, Any]) -> Any:
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING

    data = dict(data)
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING[data.pop("peft_type")]
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


def _coerce(name: str, value: Any, current: Any) -> Any:
    """Check an override's type against the field's current value; ints become floats where floats live."""
    if current is None or value is None:
        return value
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if isinstance(current, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, int) and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(current, enum.Enum):
        return value
    if isinstance(current, (int, float)) and not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if isinstance(current, str) and not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def configs_from(values: Sequence[TrialConfig] | TrialConfig) -> list[TrialConfig]:
    return [values] if isinstance(values, TrialConfig) else list(values)
