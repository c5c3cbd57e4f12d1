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

This module holds the config and its validation; how each of GRPOTrainer's arguments is taken (or refused) is
`rfopt.config.arguments`'; how it is stored is `rfopt.config.codec`'s (JSON, and the first rfopt's layout), how a
stored one is changed by name `rfopt.config.overrides`' (FIELD=VALUE), and how its functions are found again
`rfopt.config.usercode`'s (import paths). Their public names are importable from `rfopt.config`, as before the split.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rfopt.errors import ConfigError
from rfopt.values import shown

from .arguments import (
    UNSUPPORTED_TRAINER_ARGUMENTS,
    _args_and_quantization,
    _as_list,
    _first_chunk_problems,
    _is_grpo_config,
    _is_module,
    _is_peft_config,
    _processing_class,
    _reward_func,
    check_training_values,
)
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
from .overrides import override_dict
from .rewardfuncs import reward_name
from .usercode import import_path, resolve_import

__all__ = ["TrialConfig", "check_model"]

RewardFunc = Callable[..., list]


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
    ``args.model_init_kwargs["quantization_config"]``, as TRL takes it); needs a PEFT adapter and bitsandbytes
    (``pip install 'rfopt[qlora]'``), on any device bitsandbytes serves (the CPU included). Part of `model_key`: a
    quantized base and a full-precision one of the same model are two resident copies."""
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


def check_model(config: TrialConfig) -> None:
    """`ConfigError` unless the config's model can be found: the offline default is installed, a local directory
    holds a model's config, a Hub id resolves (from the local cache when offline)."""
    if not isinstance(config.model, str):
        return  # a function: resolved by import path (or left as one, where the study's code is not importable)
    if config.model == "smollm2":
        from rfopt.errors import ModelUnavailableError
        from rfopt.smollm2 import check_smollm2

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
