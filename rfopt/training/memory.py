"""What training needs in memory, estimated on the meta device without loading weights (a base model's size, a gang's
parts), and what a device has free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rfopt.config.trial import TrialConfig

from .loading import meta_model
from .quantization import adapter_bytes, base_bytes

GIB = 1024**3


def model_bytes(config: TrialConfig) -> int | None:
    """The size of `config`'s base model weights as rfopt loads them (parameters counted on the meta device, times
    the bytes of the loading ``dtype``: float32 unless ``args.model_init_kwargs`` says otherwise, as TRL loads it; a
    quantized base's Linear weights at 4 or 8 bits with their constants, `rfopt.training.quantization.base_bytes`);
    None where it cannot be told without loading (a model factory, a config that cannot be read)."""
    meta = meta_model(config)
    if meta is None:
        return None
    model, _, width = meta
    return base_bytes(model, config.quantization_config, width)  # a tied embedding counts once


@dataclass(frozen=True)
class GangMemory:
    """What training a gang of trials on one base model holds in memory, by part (bytes), as `gang_memory` estimates
    it: the base model's weights once (4 or 8 bits a weight where quantized); each member's adapter with its gradients
    and optimizer moments (fp32, bf16 on a quantized base, 8-bit moments with bitsandbytes' 8-bit optimizers); the
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

    The base model: `model_bytes`. Per member: its LoRA weights (``r x in`` and ``out x r`` per adapted Linear) with
    their gradients and optimizer moments (`rfopt.training.quantization.adapter_bytes`: 16 bytes a weight in fp32 with
    AdamW; 8 in bf16 on a quantized base; 2 bytes of moments with an 8-bit optimizer). One optimizer step's
    activations, for the largest member: ``batch x tokens x layers x (34 x hidden + 5 x heads x tokens)`` bytes at 16 bits (Korthikanti et al.'s count for a transformer layer without
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
    base = base_bytes(model, configs[0].quantization_config, width)
    members, step, decode = [], 0, []
    for config in configs:
        tokens = prompt_tokens + config.args.max_completion_length
        rows = config.args.per_device_train_batch_size
        members.append(adapter_bytes(_lora_tensors(model, config.peft_config), config))
        # Korthikanti et al. count bytes at 16 bits: scaled to the model's width.
        step = max(step, rows * tokens * layers * (34 * hidden + 5 * heads * tokens) * width // 2)
        decode.append(rows * tokens * 2 * layers * kv_heads * head_dim * width)
    return GangMemory(base=base, members=tuple(members), step=step, decode=tuple(decode))


def _lora_tensors(model: Any, peft_config: Any) -> list[int]:
    """The sizes of a LoRA adapter's weights of `peft_config` on `model` (meta device): ``r x in`` and ``out x r`` per
    adapted Linear."""
    import torch.nn as nn

    if peft_config is None:
        return [p.numel() for p in model.parameters()]  # full fine-tuning: a copy of every weight
    targets = peft_config.target_modules
    output = model.get_output_embeddings()
    sizes = []
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
            sizes += [rank * module.in_features, module.out_features * rank]
    return sizes


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
