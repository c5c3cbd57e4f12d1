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

This module holds the config and its validation; how it is stored is `rfopt.config.codec`'s (JSON, and the first rfopt's
layout), how a stored one is changed by name `rfopt.config.overrides`' (FIELD=VALUE), and how its functions are found again
`rfopt.config.usercode`'s (import paths). Their public names are importable from `rfopt.config`, as before the split.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rfopt import compat
from rfopt.errors import ConfigError
from rfopt.values import shown

from .codec import (
    TokenizerSpec,
    callback_from_json,
    callback_to_json,
    current_layout,
    grpo_default,
    grpo_to_dict,
    jsonable,
    peft_from_dict,
    peft_to_dict,
    reward_from_json,
    reward_to_json,
)
from .overrides import UNSUPPORTED_FIELDS, override_dict
from .rewardfuncs import reward_name
from .usercode import import_path, resolve_import

__all__ = ["UNSUPPORTED_TRAINER_ARGUMENTS", "TrialConfig", "check_model", "check_training_values"]

RewardFunc = Callable[..., list]

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

_REWARD_MODELS = ("reward models are not supported yet; wrap the model in a reward function (a top-level function "
                  "f(prompts, completions, **kwargs) -> list[float] that scores the completions with it)")


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
        if not (isinstance(model, str) or callable(model) or isinstance(model, Mapping)):  # a Mapping: `from_dict`'s
            raise ConfigError(f"model: got {shown(model)}; give a Hub id or a local directory (a string), 'smollm2', "
                              "or a top-level function returning (model, tokenizer)")
        self.model = model
        if reward_funcs is None or isinstance(reward_funcs, Mapping):
            raise ConfigError(f"reward_funcs: got {shown(reward_funcs)}; give a reward function, a 'module:function' "
                              "path, or a list of them (as TRL's reward_funcs)")
        self.reward_funcs = [_reward_func(r, i) for i, r in enumerate(_as_list(reward_funcs))]
        if args is not None and not _is_grpo_config(args):
            hint = " (GRPOConfig(**your_dict) makes one of a dict)" if isinstance(args, Mapping) else ""
            raise ConfigError(f"args: got {shown(args)}; give a trl.GRPOConfig, as GRPOTrainer takes it{hint}, or None "
                              "for TRL's default")
        self.args, self.quantization_config = _args_and_quantization(args, quantization_config)
        self.processing_class = _processing_class(processing_class)
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            raise ConfigError(f"callbacks: got {shown(callbacks)}; give a list of transformers.TrainerCallback classes "
                              "or instances (as the Trainer's callbacks), e.g. callbacks=[MyCallback]")
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            callback_to_json(cb)  # refused now, not when the trial is stored
        if peft_config is not None and not _is_peft_config(peft_config):
            raise ConfigError(f"peft_config: got {shown(peft_config)}; give a peft.LoraConfig (or another PEFT config), "
                              "or None for full fine-tuning")
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
                elif isinstance(value, float) and not math.isfinite(value):
                    problems.append(f"args.{f.name}: {value}; give a finite number (a stored config keeps JSON numbers)")
            problems += _first_chunk_problems(args)
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
        loading = {name: jsonable(getattr(self.args, name, None)) for name in _LOADING_FIELDS}
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
            "quantization_config": None if self.quantization_config is None else jsonable(self.quantization_config.to_dict()),
        }

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            **self._model_dict(),
            "reward_funcs": [reward_to_json(f) for f in self.reward_funcs],
            "args": grpo_to_dict(self.args),
            "callbacks": [callback_to_json(cb) for cb in self.callbacks],
            "peft_config": None if self.peft_config is None else peft_to_dict(self.peft_config),
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
            peft_config=None if data.get("peft_config") is None else peft_from_dict(data["peft_config"]),
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
    if not callable(func):
        raise ConfigError(f"reward_funcs[{i}]: got {shown(func)}; give a reward function with TRL's signature "
                          "(f(prompts, completions, **kwargs) -> list of floats), a 'module:function' path, or a "
                          "callable instance")
    return func


def _first_chunk_problems(args: Any) -> list[str]:
    """What a `GRPOConfig` accepts and the first chunk refuses (or rfopt does not support): a loss TRL does not
    compute, nothing to generate, DeepSpeed or FSDP."""
    problems = []
    if args.loss_type not in compat.GRPO_LOSS_TYPES:
        problems.append(f"args.loss_type: {args.loss_type!r} is not a loss GRPOTrainer computes; use one of "
                        f"{', '.join(map(repr, compat.GRPO_LOSS_TYPES))}")
    if args.max_completion_length is not None and args.max_completion_length < 1:
        problems.append(f"args.max_completion_length: {args.max_completion_length}; a completion needs at least one "
                        "token")
    for name in ("deepspeed", "fsdp"):
        if getattr(args, name, None):
            problems.append(f"args.{name}: {UNSUPPORTED_FIELDS[name]}")
    return problems


def _is_grpo_config(args: Any) -> bool:
    from trl import GRPOConfig

    return isinstance(args, GRPOConfig)


def _is_peft_config(value: Any) -> bool:
    from peft import PeftConfig

    return isinstance(value, PeftConfig)


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
        raise ConfigError(f"quantization_config: got {shown(value)}; give a transformers.BitsAndBytesConfig (e.g. "
                          "BitsAndBytesConfig(load_in_4bit=True)), its dict, or None")
    return value


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


def check_training_values(grpo: Any) -> None:
    """What a `GRPOConfig` accepts but training refuses when it starts: build, on one dummy parameter, the optimizer
    and LR scheduler a trainer with `grpo` builds, and the sampling warpers its generation uses; `ConfigError` with
    their own message if one refuses a value (``learning_rate=-1``, ``lr_scheduler_type``, ``temperature=0``)."""
    import torch
    from transformers import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        Trainer,
        get_scheduler,
    )

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
        from rfopt.smollm2 import ModelUnavailableError, check_smollm2

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
