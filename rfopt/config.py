"""`TrialConfig`: one GRPO configuration, the unit a study searches over.

A `TrialConfig` is a `trl.GRPOTrainer(...)` call, renamed: it takes GRPOTrainer's arguments, by the same names and
with TRL's meaning (``model``, ``reward_funcs``, ``args``, ``processing_class``, ``callbacks``,
``quantization_config``, ``peft_config``). The `GRPOConfig` in ``args`` is passed through unmodified, apart from the
plumbing rfopt owns (output dir, saving, logging, step budget, data order) and where it trains (the device's). A
config round-trips through JSON (reward functions, callbacks and model factories by import path, a tokenizer by
what rebuilds it), so that the full config is stored on its Optuna trial and a study can be resumed, cloned or
inspected from storage alone.

    >>> from peft import LoraConfig
    >>> from trl import GRPOConfig
    >>> from rfopt import rewards
    >>> config = TrialConfig(                            # was: GRPOTrainer(
    ...     model="smollm2",
    ...     reward_funcs=[rewards.correctness, rewards.soft_format],
    ...     args=GRPOConfig(learning_rate=5e-6, num_generations=4, per_device_train_batch_size=4, bf16=False),
    ...     peft_config=LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"),
    ... )
    >>> TrialConfig.from_json(config.to_json()).args.learning_rate
    5e-06

What GRPOTrainer takes and a trial cannot: the datasets (a study's, the same for every trial), ``optimizers`` (rfopt
builds them from ``args``), reward models and ``reward_processing_classes``, ``tools``, ``rollout_func`` and
``environment_factory``; each is refused with what to do instead (`UNSUPPORTED_TRAINER_ARGUMENTS`).
"""

from __future__ import annotations

import copy
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

from . import compat
from .errors import ConfigError
from .params import field_path
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

_DATASETS = ("the datasets are the study's, the same for every trial: give them to "
             "study.optimize(space, train_dataset, eval_dataset)")
UNSUPPORTED_TRAINER_ARGUMENTS: dict[str, str] = {
    "train_dataset": _DATASETS,
    "eval_dataset": _DATASETS,
    "reward_processing_classes": "reward models are not supported yet, so there is nothing to tokenize for one; "
                                 "score completions with a reward function instead",
    "optimizers": "rfopt builds the optimizer and LR scheduler from args, once per trial over its total steps, so "
                  "that training in chunks is exact; choose them with args.optim, args.optim_args, "
                  "args.lr_scheduler_type and args.lr_scheduler_kwargs",
    "tools": "tool calling is not supported yet",
    "rollout_func": "custom rollout functions are not supported yet",
    "environment_factory": "environments are not supported yet",
}
"""GRPOTrainer's arguments that a `TrialConfig` refuses (when not None), with why and what to do instead."""

_TOKENIZER_SETTINGS = ("pad_token", "padding_side", "truncation_side", "chat_template")
"""The settings of a tokenizer instance that a stored `processing_class` keeps (those a user typically changes)."""

_REWARD_MODELS = ("reward models are not supported yet; wrap the model in a reward function (a top-level function "
                  "f(prompts, completions, **kwargs) -> list[float] that scores the completions with it)")

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

        from .smollm2 import SMOLLM2, smollm2_path

        source = str(smollm2_path()) if self.name_or_path == SMOLLM2 else self.name_or_path
        tokenizer = AutoTokenizer.from_pretrained(source, **self.kwargs)
        for name, value in self.settings.items():
            setattr(tokenizer, name, value)
        return tokenizer

    def to_dict(self) -> dict[str, Any]:
        data = {"name_or_path": self.name_or_path, **_jsonable(dict(self.settings))}
        if self.kwargs:
            data["from_pretrained"] = _jsonable(dict(self.kwargs))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenizerSpec:
        settings = {k: v for k, v in data.items() if k in _TOKENIZER_SETTINGS}
        return cls(data["name_or_path"], settings, dict(data.get("from_pretrained") or {}))


@dataclass(init=False)
class TrialConfig:
    """One GRPO configuration: the arguments of a `trl.GRPOTrainer` call, by the same names. Each becomes one Optuna
    trial.

    ``TrialConfig(**kwargs)`` takes what ``GRPOTrainer(**kwargs)`` takes. GRPOTrainer's other arguments are refused
    when given (not None), with why and what to do instead (`UNSUPPORTED_TRAINER_ARGUMENTS`); so are a model or a
    reward model given as an instance. Every chunk of the trial is one ``trainer.train()`` call of a new trainer built
    from these fields (see rfopt/runner.py).
    """

    model: str | Callable[[], tuple[Any, Any]]
    """Hub id, local directory, ``"smollm2"`` (the offline default), or a function returning ``(model, tokenizer)``
    (rfopt's own; stored by import path, so it must be importable). Loaded as TRL loads a string ``model``: with
    ``args.model_init_kwargs`` (``dtype`` defaults to float32) and, if given, `quantization_config`; on the device
    the study runs on. A model instance is refused: rfopt loads the model itself, on any worker."""
    reward_funcs: list[RewardFunc | str]
    """One reward function or a list, as TRL takes them: functions with TRL's signature, ``"module:function"`` import
    paths (rfopt's own), TRL's built-in rewards (``trl.rewards.accuracy_reward``,
    ``get_soft_overlong_punishment(...)``, ...) and instances of callable classes whose attributes are JSON values.
    Reward models (a Hub id, a model instance) are refused: not supported yet."""
    args: Any = None
    """A ``trl.GRPOConfig`` (None: TRL's default), used as given except for the plumbing fields rfopt owns and the
    placement fields the device decides. Reward weights are ``args.reward_weights``; model loading keyword arguments
    are ``args.model_init_kwargs``."""
    processing_class: str | TokenizerSpec | None = None
    """None: loaded from the model as TRL loads it (``AutoProcessor``, padding and truncation on the left). A tokenizer
    id or directory, or a tokenizer instance: an instance is stored as its ``name_or_path`` plus the settings a user
    typically changes (pad_token, padding_side, truncation_side, chat_template), and held as that `TokenizerSpec`.
    Part of `model_key`: trials sharing a resident base model share its tokenizer."""
    callbacks: list[Any] = field(default_factory=list)
    """``transformers.TrainerCallback`` classes or instances, given to the trainer of every chunk (besides rfopt's
    own). A chunk is one ``trainer.train()`` call, so ``on_train_begin``/``on_train_end`` fire once per chunk and a
    class is instantiated once per chunk. Stored by class import path; an instance's attributes as JSON, restored
    as pickle restores a plain object: a trial may train with such a copy of the instance, rebuilt from its stored
    config (by another worker, after a restart, from a list of configs)."""
    quantization_config: Any = None
    """A ``transformers.BitsAndBytesConfig`` (e.g. 4-bit QLoRA; also taken from
    ``args.model_init_kwargs["quantization_config"]``, as TRL takes it); needs a PEFT adapter and a CUDA device."""
    peft_config: Any = None
    """A ``peft.LoraConfig`` (one adapter per trial on a shared base model), or None for full fine-tuning."""

    def __init__(
        self,
        model: str | Callable[[], tuple[Any, Any]],
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        given = {"train_dataset": train_dataset, "eval_dataset": eval_dataset,
                 "reward_processing_classes": reward_processing_classes,
                 "optimizers": None if optimizers is None or all(o is None for o in optimizers) else optimizers,
                 "tools": tools, "rollout_func": rollout_func, "environment_factory": environment_factory}
        refused = [f"{name}: {UNSUPPORTED_TRAINER_ARGUMENTS[name]}" for name, value in given.items() if value is not None]
        if refused:
            raise ConfigError("; ".join(refused))
        if _is_module(model):
            raise ConfigError(
                f"model: a model instance ({type(model).__name__}) cannot be given: rfopt loads the model itself, on "
                "any worker and after any restart. Give its Hub id or local directory (model.save_pretrained(directory) "
                "for one you changed), or a top-level function returning (model, tokenizer)"
            )
        self.model = model
        if reward_funcs is None or isinstance(reward_funcs, Mapping):
            raise ConfigError(f"reward_funcs: got {_kind(reward_funcs)}; give a reward function, a 'module:function' "
                              "path, or a list of them (as TRL's reward_funcs)")
        self.reward_funcs = [_reward_func(r, i) for i, r in enumerate(_as_list(reward_funcs))]
        self.args, self.quantization_config = _args_and_quantization(args, quantization_config)
        self.processing_class = _processing_class(processing_class)
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            raise ConfigError(f"callbacks: got {_kind(callbacks)}; give a list of transformers.TrainerCallback classes "
                              "or instances (as the Trainer's callbacks), e.g. callbacks=[MyCallback]")
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            callback_to_json(cb)  # refused now, not when the trial is stored
        self.peft_config = peft_config

    # ------------------------------------------------------------------ validation
    def validate(self, check_code: bool = True) -> None:
        """Raise `ConfigError` naming the field and the fix for anything rfopt or TRL would refuse.

        `check_code=False` for a config whose reward functions, callbacks and model factory were left as import paths
        (`from_dict(..., resolve_code=False)`)."""
        from trl import GRPOConfig

        problems = []
        if isinstance(self.model, str):
            if not self.model.strip():
                problems.append("model: empty; give a Hub id, a local directory or 'smollm2'")
        elif check_code and not callable(self.model):
            problems.append(f"model: expected a string or a function returning (model, tokenizer), got {type(self.model).__name__}")
        args = self.args if isinstance(self.args, GRPOConfig) else None
        if args is None:
            problems.append(f"args: expected a trl.GRPOConfig, got {type(self.args).__name__}")
        else:
            if args.use_vllm:
                problems.append(
                    "args.use_vllm: generation with vLLM is not supported yet; rfopt generates with transformers. "
                    "Set use_vllm=False"
                )
            for f in dataclasses.fields(args):
                value = getattr(args, f.name, None)
                if isinstance(value, float) and math.isnan(value):
                    problems.append(f"args.{f.name}: NaN; give a number")
        if not self.reward_funcs:
            problems.append("reward_funcs: empty; give at least one reward function")
        for i, func in enumerate(self.reward_funcs if check_code else []):
            if not callable(func):
                problems.append(f"reward_funcs[{i}]: {func!r} is not callable")
        if args is not None and args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            problems.append(
                f"args.reward_weights: {len(args.reward_weights)} weights for {len(self.reward_funcs)} reward functions"
            )
        if self.peft_config is not None:
            from peft import PeftConfig

            if not isinstance(self.peft_config, PeftConfig):
                problems.append(f"peft_config: expected a peft.LoraConfig or None, got {type(self.peft_config).__name__}")
        if self.peft_config is None and args is not None and args.beta != 0.0:
            problems.append(
                "args.beta: a KL penalty (beta > 0) needs a PEFT adapter in rfopt for now (the reference model is the "
                "base with the adapter disabled); set peft_config=LoraConfig(...) or beta=0.0"
            )
        if self.quantization_config is not None and self.peft_config is None:
            problems.append("quantization_config: a quantized base model can only be trained with a PEFT adapter; "
                            "set peft_config")
        if problems:
            raise ConfigError("; ".join(problems))
        if args is not None:
            check_training_values(args)

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(f) for f in self.reward_funcs]

    @property
    def model_key(self) -> str:
        """Identifies the base model, how it is loaded and its tokenizer, for sharing one resident copy between
        trials."""
        # The fields `base_model_of` picks, read from the config itself: called at every swap, so kept cheap.
        loading = {name: _jsonable(getattr(self.args, name, None)) for name in _LOADING_FIELDS}
        return json.dumps({**self._model_dict(), **loading}, sort_keys=True)

    def model_init_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a string `model` is loaded with, as GRPOTrainer gives them to TRL's
        ``create_model_from_path``: ``args.model_init_kwargs``, `quantization_config`, ``trust_remote_code``."""
        kwargs = dict(self.args.model_init_kwargs or {})
        if self.quantization_config is not None:
            kwargs["quantization_config"] = self.quantization_config
        kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
        return kwargs

    def _model_dict(self) -> dict[str, Any]:
        processing_class = self.processing_class
        return {
            "model": self.model if isinstance(self.model, str) else {"factory": import_path(self.model)},
            "processing_class": processing_class.to_dict() if isinstance(processing_class, TokenizerSpec) else processing_class,
            "quantization_config": None if self.quantization_config is None else _jsonable(self.quantization_config.to_dict()),
        }

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            **self._model_dict(),
            "reward_funcs": [reward_to_json(f) for f in self.reward_funcs],
            "args": grpo_to_dict(self.args),
            "callbacks": [callback_to_json(cb) for cb in self.callbacks],
            "peft_config": None if self.peft_config is None else _peft_to_dict(self.peft_config),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def config_dict(text: str) -> dict[str, Any]:
        """A stored config (``rfopt:config``) as its dict in the current layout (one stored by an earlier rfopt is
        read as `from_dict` reads it), without importing anything it names."""
        return current_layout(json.loads(text))

    @staticmethod
    def json_of(data: Mapping[str, Any]) -> str:
        """A config dict (`to_dict`, `config_dict`) as the JSON a trial stores."""
        return json.dumps(data, sort_keys=True)

    @staticmethod
    def base_model_of(data: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a config dict that decide its base model and tokenizer (what `model_key` identifies)."""
        args = data.get("args") or {}
        return {
            "model": data.get("model"),
            "processing_class": data.get("processing_class"),
            "quantization_config": data.get("quantization_config"),
            **{name: args.get(name, grpo_default(name)) for name in _LOADING_FIELDS},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], resolve_code: bool = True) -> TrialConfig:
        """The config a dict describes (in the current layout or an earlier rfopt's, see `current_layout`). With
        `resolve_code=False` its reward functions, callbacks and model factory stay import paths (nothing of the
        study's own code is imported): such a config can be checked (`validate(check_code=False)`, `check_model`), not
        trained."""
        from trl import GRPOConfig

        data = current_layout(data)
        model = data["model"]
        if isinstance(model, Mapping) and resolve_code:
            model = resolve_import(model["factory"])
        quantization_config = None
        if data.get("quantization_config") is not None:
            from transformers import BitsAndBytesConfig

            quantization_config = BitsAndBytesConfig.from_dict(dict(data["quantization_config"]))
        processing_class = data.get("processing_class")
        config = cls(
            model=model,
            reward_funcs=[reward_from_json(r) for r in data["reward_funcs"]] if resolve_code else [],
            # Placement is the device's (PLACEMENT_FIELDS); bf16 on a machine without a GPU would make TRL refuse it.
            args=GRPOConfig(**{**data["args"], "bf16": False, "fp16": False}),
            processing_class=TokenizerSpec.from_dict(processing_class) if isinstance(processing_class, Mapping) else processing_class,
            callbacks=[callback_from_json(c) for c in data.get("callbacks") or []] if resolve_code else [],
            quantization_config=quantization_config,
            peft_config=None if data.get("peft_config") is None else _peft_from_dict(data["peft_config"]),
        )
        if not resolve_code:
            config.reward_funcs = list(data["reward_funcs"])
            config.callbacks = list(data.get("callbacks") or [])
        return config

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ overrides
    def with_overrides(self, overrides: Mapping[str, Any]) -> TrialConfig:
        """A copy with fields changed by name, validated; raises `ConfigError` and changes nothing on bad input.

        Names are GRPOConfig fields (``learning_rate``, ``reward_weights``, or ``args.<field>``), PEFT fields
        (``peft_config.<field>``, or the aliases ``lora_r``/``r``, ``lora_alpha``, ``lora_dropout``), ``model`` and
        ``reward_funcs``; the names of an earlier rfopt (``grpo.<field>``, ``peft.<field>``, ``rewards``) are accepted
        too. A string given for a field of another type is read as that type (``"2e-6"`` for ``learning_rate``), as on
        the command line.
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


_LOADING_FIELDS = ("model_init_kwargs", "trust_remote_code")
"""The GRPOConfig fields that decide how a string model is loaded (part of `TrialConfig.model_key`)."""


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_module(obj: Any) -> bool:
    """Whether `obj` is a torch module (a model); torch not imported yet means it cannot be one."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _reward_func(func: Any, i: int) -> Any:
    """A reward function as a config holds it: import paths resolved; reward models refused."""
    if isinstance(func, str):
        if ":" not in func:
            raise ConfigError(f"reward_funcs[{i}]: {func!r} is a model id, which TRL would load as a reward model; "
                              f"{_REWARD_MODELS}. A reward function given by import path is 'module:function'")
        return resolve_import(func)
    if _is_module(func):
        raise ConfigError(f"reward_funcs[{i}]: a model ({type(func).__name__}) as reward function; {_REWARD_MODELS}")
    return func


def _args_and_quantization(args: Any, quantization_config: Any) -> tuple[Any, Any]:
    """`args` (None: TRL's default GRPOConfig) with a quantization config in ``model_init_kwargs`` moved out to the
    trainer argument, as TRL takes either (both: refused, as TRL refuses it), and a ``dtype`` given as a torch dtype
    by its name (as JSON keeps it). The caller's GRPOConfig is never changed: a changed one is a copy."""
    from trl import GRPOConfig

    if args is None:
        # TRL's default GRPOConfig. Placement fields are the device's; bf16 (the default) would be refused on a CPU.
        args = GRPOConfig(bf16=False, fp16=False)
    if not isinstance(args, GRPOConfig) or not isinstance(args.model_init_kwargs, Mapping):
        return args, _bnb_config(quantization_config)
    kwargs = dict(args.model_init_kwargs)
    if "quantization_config" in kwargs:
        if quantization_config is not None:
            raise ConfigError(
                "quantization_config: given both as an argument and in args.model_init_kwargs; set it in only one "
                "place, preferably as the argument (TRL refuses both too)"
            )
        quantization_config = kwargs.pop("quantization_config")
    dtype = kwargs.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    if kwargs != args.model_init_kwargs:
        args = copy.copy(args)
        args.model_init_kwargs = kwargs or None
    return args, _bnb_config(quantization_config)


def _bnb_config(value: Any) -> Any:
    from transformers import BitsAndBytesConfig

    if isinstance(value, Mapping):
        return BitsAndBytesConfig.from_dict(dict(value))
    if value is not None and not isinstance(value, BitsAndBytesConfig):
        raise ConfigError(f"quantization_config: got {_kind(value)}; give a transformers.BitsAndBytesConfig (e.g. "
                          "BitsAndBytesConfig(load_in_4bit=True)), its dict, or None")
    return value


def _kind(value: Any) -> str:
    """A wrong value as a message shows it: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _processing_class(value: Any) -> str | TokenizerSpec | None:
    if value is None or isinstance(value, (str, TokenizerSpec)):
        return value
    if isinstance(value, Mapping):
        return TokenizerSpec.from_dict(value)
    from transformers import PreTrainedTokenizerBase

    if not isinstance(value, PreTrainedTokenizerBase):
        raise ConfigError(f"processing_class: expected a tokenizer, its Hub id or directory, or None (the model's), "
                          f"got {type(value).__name__}; processors of multimodal models are not supported yet")
    return TokenizerSpec.of(value)


# ---------------------------------------------------------------------- configs of an earlier rfopt
_OLD_PACKAGES = ("rewards", "studies")
"""Top-level packages of the first rfopt, now ``rfopt.rewards`` and ``rfopt.studies``."""


def current_layout(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict in the current layout. One stored by the first rfopt (keys ``grpo``, ``rewards``, ``peft``,
    ``reward_weights``, ``model_kwargs``, ``tokenizer_kwargs``, ``quantization``; import paths into the top-level
    packages ``rewards`` and ``studies``) is translated, so that its study keeps loading; nothing is imported."""
    if "grpo" not in data:
        return dict(data)
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
    return {"model": model, "reward_funcs": rewards, "args": args, "processing_class": processing_class,
            "callbacks": [], "quantization_config": old.get("quantization"), "peft_config": old.get("peft")}


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


# ---------------------------------------------------------------------- overrides
_OWN_FIELDS = ("model", "reward_funcs")


def override_dict(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`data` (a `TrialConfig.to_dict()`) with fields changed by name (`rfopt.params.field_path` says which field a
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
            peft_class = _peft_class(data["peft_config"])
            if key not in {f.name for f in dataclasses.fields(peft_class) if f.init}:
                raise ConfigError(f"{name}: {peft_class.__name__} has no field {key!r}")
            data["peft_config"][key] = typed[name] = _jsonable(typed_value(peft_class, key, value, name))
        elif target.startswith("args."):
            key = target.removeprefix("args.")
            if key not in grpo_fields:
                raise ConfigError(f"{name}: GRPOConfig has no field {key!r}")
            if key in PLUMBING_FIELDS:
                raise ConfigError(f"{name}: rfopt sets {key} itself; it cannot be overridden")
            if key in PLACEMENT_FIELDS:
                raise ConfigError(f"{name}: the device a study runs on decides use_cpu, bf16 and fp16 "
                                  "(optimize(device=..., precision=...), rfopt run --device ... --precision ...)")
            data["args"][key] = typed[name] = _jsonable(typed_value(GRPOConfig, key, value, name))
            if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
                # Let TRL derive the generation batch again from the new batch shape.
                data["args"].pop("steps_per_generation", None)
        elif target in _OWN_FIELDS:
            data[target] = typed[name] = _jsonable(_own_value(target, value))
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
    return getattr(parsed, field_name)


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

    kwargs = config.model_init_kwargs()
    options = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
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
            f"{obj!r} cannot be stored by import path (a lambda or a nested function or class); "
            "define it at the top level of a module"
        )
    if module == "__main__" or module not in sys.modules or not _is_importable(module):
        file = getattr(sys.modules.get(module), "__file__", None)
        if file is None or file.startswith("<") or not Path(file).is_file():
            source = ("a script read from standard input (python - < script.py)" if file == "<stdin>"
                      else f"{module!r}, which has no file" if file is None or file.startswith("<")
                      else f"{file}, which is not a file")
            raise ConfigError(
                f"{qualname}: defined in {source}; rfopt stores it by import path, for the other processes that "
                "need it (a worker, a resumed run, the dashboard's clone), and none can import it from there. Save "
                "the script as a file and run it (python script.py), or define the function in a module"
            )
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
    """A reward function as stored: ``"module:function"``; a factory's product as the factory's path and arguments
    (``rfopt_factory``); an instance of a callable class (TRL's ``get_soft_overlong_punishment(...)``) as its class
    and attributes (`instance_to_json`)."""
    if isinstance(func, (str, Mapping)):
        return func if isinstance(func, str) else dict(func)  # left unresolved (`from_dict(resolve_code=False)`)
    factory = getattr(func, "rfopt_factory", None)
    if factory is not None:
        path, kwargs = factory
        return {"factory": path, "kwargs": _jsonable(dict(kwargs))}
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
