"""bitsandbytes in a trial: a base model loaded in 4 or 8 bits (QLoRA, ``quantization_config``) and bitsandbytes'
optimizers (``args.optim``: ``adamw_bnb_8bit``, ``paged_adamw_8bit``, ``paged_adamw_32bit``, ...): what they need (the
package, a device its backends serve, its CPU backend included) and what they hold in memory.

A quantized base is loaded as ``GRPOTrainer`` loads a string model with a ``quantization_config`` (TRL 1.16 applies no
``prepare_model_for_kbit_training``; its trainer casts the trainable adapter weights of a quantized model to bf16, and
so do the chunks' trainers here). rfopt imports bitsandbytes only for a trial that uses it (PEFT imports it wherever it
is installed: `rfopt.compat.quiet_bitsandbytes` keeps its start-up warning quiet).

    >>> bitsandbytes_refusal(config, "cpu")          # doctest: +SKIP
    "quantization_config needs bitsandbytes, which is not installed here: pip install 'rfopt[qlora]'"
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rfopt.config.trial import TrialConfig

BITSANDBYTES_OPTIMIZERS = frozenset({
    "adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
    "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
})
"""The ``args.optim`` values transformers makes with bitsandbytes (``transformers.trainer_optimizer``)."""

EIGHT_BIT_MIN_SIZE = 4096
"""bitsandbytes keeps a tensor's optimizer state in 8 bits only from this many elements on (``min_8bit_size``); a
smaller one's state stays 32-bit."""

INSTALL = "pip install 'rfopt[qlora]'"


def optim_name(config: TrialConfig) -> str:
    optim = config.args.optim
    return str(getattr(optim, "value", optim))


def uses_bitsandbytes(config: TrialConfig) -> bool:
    """Whether `config` loads its base quantized or steps with a bitsandbytes optimizer."""
    return config.quantization_config is not None or optim_name(config) in BITSANDBYTES_OPTIMIZERS


def eight_bit_optimizer(config: TrialConfig) -> bool:
    """Whether `config`'s optimizer keeps its moments in 8 bits (bitsandbytes' ``*_8bit`` optimizers)."""
    return optim_name(config) in BITSANDBYTES_OPTIMIZERS and optim_name(config).endswith("8bit")


def bitsandbytes_refusal(config: TrialConfig, device: str) -> str | None:
    """Why `config` cannot train on `device` for want of bitsandbytes (not installed; a device its backends do not
    serve), or None (also when it does not use bitsandbytes). Imports bitsandbytes only for a trial that uses it."""
    uses = (["quantization_config"] if config.quantization_config is not None else []) + (
        [f"args.optim={optim_name(config)!r}"] if optim_name(config) in BITSANDBYTES_OPTIMIZERS else [])
    if not uses:
        return None
    what = " and ".join(uses)
    served = bitsandbytes_devices()
    if served is None:
        return f"{what} {'needs' if len(uses) == 1 else 'need'} bitsandbytes, which is not installed here: {INSTALL}"
    if str(device).split(":")[0].strip() not in served:
        import bitsandbytes

        return (f"{what}: bitsandbytes {bitsandbytes.__version__} serves {', '.join(served)} devices, not {device!r}; "
                "train this trial on one of those, or drop it")
    return None


def bitsandbytes_devices() -> tuple[str, ...] | None:
    """The kinds of device bitsandbytes' backends serve here (``("cpu", "cuda", ...)``: its CPU backend included), or
    None where it is not installed. Imports bitsandbytes (quietly) where it is."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    from rfopt import compat

    compat.quiet_bitsandbytes()
    import bitsandbytes

    return tuple(sorted(getattr(bitsandbytes, "supported_torch_devices", {"cpu", "cuda"})))


def base_bytes(model: Any, quantization_config: Any, width: int) -> int:
    """The weights of `model` (on the meta device) as loaded with `quantization_config` (None: none) and ``dtype`` of
    `width` bytes: what transformers quantizes (every ``nn.Linear`` but the output embeddings and
    ``llm_int8_skip_modules``) at half a byte per weight (4-bit) plus one absmax per 64-weight block (fp32, or with
    double quantization a byte plus an fp32 per 256 blocks), or a byte per weight plus an fp32 scale per row (8-bit);
    every other weight at `width` bytes. A tied weight counts once."""
    import torch.nn as nn

    counted: set[int] = set()
    total = 0.0
    quantized: set[int] = set()
    if quantization_config is not None and (quantization_config.load_in_4bit or quantization_config.load_in_8bit):
        output = model.get_output_embeddings()
        skip = set(getattr(quantization_config, "llm_int8_skip_modules", None) or ())
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or module is output or name.rsplit(".", 1)[-1] in skip:
                continue
            weight = module.weight
            if id(weight) in counted:
                continue
            counted.add(id(weight))
            quantized.add(id(weight))
            n = weight.numel()
            if quantization_config.load_in_4bit:
                block = getattr(quantization_config, "bnb_4bit_blocksize", None) or 64
                blocks = n / block
                constants = blocks + blocks / 256 * 4 if quantization_config.bnb_4bit_use_double_quant else blocks * 4
                total += n / 2 + constants
            else:
                total += n + module.out_features * 4
    for parameter in model.parameters():
        if id(parameter) not in counted:
            counted.add(id(parameter))
            total += parameter.numel() * width
    return int(total)


def adapter_bytes(sizes: list[int], config: TrialConfig) -> int:
    """An adapter of tensors of `sizes` elements with its gradients and optimizer moments, as `config` trains it: in
    fp32, or in bf16 on a quantized base (TRL casts a quantized model's adapter to bf16); two moments per weight in
    the weight's dtype (torch's AdamW), fp32 (bitsandbytes' 32-bit optimizers, and its 8-bit ones for a tensor under
    `EIGHT_BIT_MIN_SIZE`), or one byte each (its 8-bit ones)."""
    weight = 2 if config.quantization_config is not None else 4
    bitsandbytes_optim = optim_name(config) in BITSANDBYTES_OPTIMIZERS
    total = 0
    for n in sizes:
        if eight_bit_optimizer(config) and n >= EIGHT_BIT_MIN_SIZE:
            moments = 2
        elif bitsandbytes_optim:
            moments = 8
        else:
            moments = 2 * weight
        total += n * (2 * weight + moments)
    return total


__all__ = ["BITSANDBYTES_OPTIMIZERS", "EIGHT_BIT_MIN_SIZE", "adapter_bytes", "base_bytes", "bitsandbytes_devices",
           "bitsandbytes_refusal", "eight_bit_optimizer", "uses_bitsandbytes"]
