"""What training needs in memory, estimated on the meta device without loading weights (a base model's size, a gang's
parts), and what a device has free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rfopt.config.trial import TrialConfig

from .loading import meta_model

GIB = 1024**3


def model_bytes(config: TrialConfig) -> int | None:
    """The size of `config`'s base model weights as rfopt loads them (parameters counted on the meta device, times
    the bytes of the loading ``dtype``: float32 unless ``args.model_init_kwargs`` says otherwise, as TRL loads it);
    None where it cannot be told without loading (a model factory, a config that cannot be read, quantization)."""
    meta = meta_model(config)
    if meta is None:
        return None
    model, _, width = meta
    return sum(p.numel() for p in model.parameters()) * width  # a tied embedding counts once


@dataclass(frozen=True)
class GangMemory:
    """What training a gang of trials on one base model holds in memory, by part (bytes), as `gang_memory` estimates
    it: the base model's weights once; each member's adapter with its gradients and AdamW moments (fp32); the
    activations of one member's optimizer step (members train one at a time, so one step's at once); and the
    KV cache of the gang's batched generation (every member's rows at once)."""

    base: int
    members: tuple[int, ...]
    """Each member's adapter with its gradients and optimizer moments."""
    step: int
    decode: tuple[int, ...]
    """Each member's share of the batched generation's KV cache."""

    @property
    def total(self) -> int:
        return self.base + sum(self.members) + self.step + sum(self.decode)


def gang_memory(configs: list[TrialConfig], prompt_tokens: int) -> GangMemory | None:
    """Estimate what a gang of `configs` (one base model) needs, with prompts of `prompt_tokens` tokens; None where
    the base model's shape cannot be told without loading it.

    Per member: its LoRA weights (``r x (in + out)`` per adapted Linear) x 16 bytes (fp32 weight, gradient and two
    AdamW moments). One optimizer step's activations, for the largest member: ``batch x tokens x layers x (34 x
    hidden + 5 x heads x tokens)`` bytes at 16 bits (Korthikanti et al.'s count for a transformer layer without
    recomputation), scaled to the model's width. Decoding: a KV cache of ``2 x layers x kv_heads x head_dim`` values per token of every
    member's rows (``per_device_train_batch_size`` each)."""
    meta = meta_model(configs[0])
    if meta is None:
        return None
    model, model_config, width = meta
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    base = sum(p.numel() for p in model.parameters()) * width
    members, step, decode = [], 0, []
    for config in configs:
        tokens = prompt_tokens + config.args.max_completion_length
        rows = config.args.per_device_train_batch_size
        members.append(16 * _lora_parameters(model, config.peft_config))
        # Korthikanti et al. count bytes at 16 bits: scaled to the model's width.
        step = max(step, rows * tokens * layers * (34 * hidden + 5 * heads * tokens) * width // 2)
        decode.append(rows * tokens * 2 * layers * kv_heads * head_dim * width)
    return GangMemory(base=base, members=tuple(members), step=step, decode=tuple(decode))


def _lora_parameters(model: Any, peft_config: Any) -> int:
    """Weights of a LoRA adapter of `peft_config` on `model` (meta device): ``r x (in + out)`` per adapted Linear."""
    import torch.nn as nn

    if peft_config is None:
        return sum(p.numel() for p in model.parameters())  # full fine-tuning: a copy of every weight
    targets = peft_config.target_modules
    output = model.get_output_embeddings()
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if targets == "all-linear":
            adapted = module is not output
        elif isinstance(targets, str):
            import re

            adapted = re.fullmatch(targets, name) is not None
        else:
            adapted = leaf in set(targets or ())
        if adapted:
            rank = (peft_config.rank_pattern or {}).get(leaf, peft_config.r)
            count += rank * (module.in_features + module.out_features)
    return count


def free_bytes(device: str) -> int | None:
    """Memory this process can still use on `device`: a CUDA device's free memory, or on the CPU the kernel's
    ``MemAvailable``; None where it cannot be told."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
