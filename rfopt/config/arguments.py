"""GRPOTrainer's arguments as a `TrialConfig` takes them: each read as TRL reads it, or refused with what to do instead
(`UNSUPPORTED_TRAINER_ARGUMENTS`), and the `GRPOConfig` values the first chunk would refuse, found before it trains
(`check_training_values`)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

from rfopt import compat
from rfopt.errors import ConfigError
from rfopt.values import shown

from .codec import TokenizerSpec
from .overrides import UNSUPPORTED_FIELDS
from .usercode import resolve_import

__all__ = ["UNSUPPORTED_TRAINER_ARGUMENTS", "check_training_values"]

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
    # What generation samples with: the args' settings with `generation_kwargs` over them, as GRPOTrainer merges them
    # (the same check for a trial alone and in a gang: a setting given in either place is refused alike).
    extra = dict(grpo.generation_kwargs or {})
    merged = {"do_sample": True, "temperature": grpo.temperature, "top_p": grpo.top_p, "top_k": grpo.top_k,
              "min_p": grpo.min_p} | extra
    where = "" if not extra.keys() & merged.keys() else " (args with generation_kwargs over them)"
    try:
        if merged["do_sample"]:
            if merged["temperature"] is not None:
                TemperatureLogitsWarper(merged["temperature"])
            if merged["top_p"] is not None:
                TopPLogitsWarper(merged["top_p"])
            if merged["top_k"]:
                TopKLogitsWarper(merged["top_k"])
            if merged["min_p"] is not None:
                MinPLogitsWarper(merged["min_p"])
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"grpo: generation refuses these sampling settings{where}: {exc}") from exc
