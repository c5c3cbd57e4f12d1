"""What training needs in memory, estimated on the meta device without loading weights (a base model's size, a gang's
parts), and what a device has free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rfopt.config.trial import TrialConfig

from .batched_step import MIN_SHARED
from .loading import meta_model
from .quantization import adapter_bytes, base_bytes
from .rollouts.batched import decode_shape

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
    activations of the members' optimizer steps (members that take their steps one after another hold one step's at
    once, the largest; a batched gang, ``gang_training="batched"``, holds every member's at once: one forward of all
    their rows, one backward); the batched decoder's own copies (its LoRA bank and, under mixed precision, its bf16 copy
    of the base model); and each member's share of the batched decoder's buffers (the key/value caches of its rollout
    and evaluation buckets, and its rows' sampling scratch)."""

    base: int
    members: tuple[int, ...]
    """Each member's adapter with its gradients and optimizer moments."""
    step: int
    """The activations of the largest member's optimizer step: what a gang whose members take their steps one after
    another holds at once."""
    decode: tuple[int, ...]
    """Each member's share of the batched decoder's buffers: its rows in the rollout and evaluation buckets' key/value
    caches and token buffers, and the sampler's scratch for them."""
    decoder: int = 0
    """The batched decoder's own copies, whatever the gang's size: its LoRA bank (every adapter of the model at the
    largest rank) and, when it computes in another dtype than the model's (bf16 under mixed precision), its copy of
    the base model's weights."""
    steps: tuple[int, ...] = ()
    """Each member's step activations in a batched gang's forward (its rows padded to the gang's longest sequence, and
    no gradient checkpointing: the batched view keeps its activations): such a gang holds the sum of its members'."""
    kept: int = 0
    """What the CPU's heap keeps of the steps before, where members take their steps one after another: the largest
    step again (`GangMemory.step`) among members whose activations glibc's malloc moves to its heap (`HEAP_KEEPS`);
    0 off the CPU."""

    @property
    def total(self) -> int:
        return self.need(len(self.members))

    def need(self, n: int, with_base: bool = True, batched: bool = False) -> int:
        """Bytes for the first `n` members (a smaller gang), with the base model's weights or without them (a base
        model that is resident already); `batched`: the members take one batched training step
        (``gang_training="batched"``), so every member's step activations are held at once (one member alone takes
        its own steps); otherwise one step's and, on the CPU, what its heap keeps of the steps before
        (`GangMemory.kept`)."""
        padding = (1 << max(0, (n - 1).bit_length())) - n  # the decoder pads the groups to a power of two
        step = sum(self.steps[:n]) if batched and n > 1 and self.steps else self.step + self.kept
        return ((self.base if with_base else 0) + sum(self.members[:n]) + step + self.decoder
                + sum(self.decode[:n]) + padding * max(self.decode[:n], default=0))


HEAP_KEEPS = (128 * 1024, 32 * 1024 * 1024)
"""Sizes of one tensor (bytes) that glibc's malloc serves from its heap on the CPU once a like one has been freed: it
maps a block of 128 KiB or more on its own (and unmaps it when freed) until the first such block is freed, then raises
this threshold to that block's size, up to 32 MiB (its dynamic mmap threshold). From then on a step's activations of
these sizes come from the heap, which keeps them when they are freed and reuses them for the next step only in part:
on SmolLM2 (hidden states of 1.4 MiB a layer) the resident set stood 1.27, 1.50, 1.92, 2.34 GiB over the loaded model
after 1, 2, 3, 4 members' steps that each peak at 0.87 GiB, and a sequential gang of 4 held 3.67 GiB against a plan of
2.68 without this, 3.78 with it (BENCHMARKS.md, "The sequential gang's memory plan")."""

SAMPLER_SCRATCH = 40
"""Bytes per row and vocabulary entry that one decode step holds at once beyond the model's own outputs: the float32
logits, their sorted copy with int64 indices and a float64 cumulative sum (top-p), and a mask."""


def gang_memory(configs: list[TrialConfig], prompt_tokens: int, *, eval_rows: int = 0,
                eval_new_tokens: int | None = None, compute_width: int | None = None,
                shared_prompts: bool = False, on_cpu: bool = False) -> GangMemory | None:
    """Estimate what a gang of `configs` (one base model) needs, with prompts of `prompt_tokens` tokens; None where
    the base model's shape cannot be told without loading it. `eval_rows`: prompts each member evaluates in one batched
    decode (`EvalSettings.batch_size`), `eval_new_tokens` their completions' length (default: each member's
    ``max_completion_length``); `compute_width`: bytes per value the batched decoder computes in when it is not the
    model's own (2 under bf16 mixed precision: the decoder reads a bf16 copy of the base model); `shared_prompts`: the
    batched forward computes a prompt its rows share once (`rfopt.training.batched_step.shares_prompts`, on the CPU);
    `on_cpu`: the gang trains on the CPU, whose heap keeps what a step freed (`GangMemory.kept`, `HEAP_KEEPS`).

    The base model: `model_bytes`. Per member: its LoRA weights (``r x in`` and ``out x r`` per adapted Linear) with
    their gradients and optimizer moments (`rfopt.training.quantization.adapter_bytes`: 16 bytes a weight in fp32 with
    AdamW; 8 in bf16 on a quantized base; 2 bytes of moments with an 8-bit optimizer). One optimizer step's
    activations, for the largest member (`GangMemory.step`): ``batch x tokens x layers x (34 x hidden + 5 x heads x
    tokens)`` bytes at 16 bits (Korthikanti et al.'s count for a transformer layer without recomputation), scaled to
    the model's width, and the LM head's logits with their gradient (``batch x tokens x vocab`` twice); with
    ``args.gradient_checkpointing`` (TRL's default), each layer's input and one layer's activations instead of every
    layer's. On the CPU, that step once more where its hidden states (``rows x tokens x hidden``) are a size glibc's
    heap serves and keeps (`HEAP_KEEPS`, `GangMemory.kept`): what the heap keeps of the steps before. And each
    member's in a batched step (`GangMemory.steps`, summed by ``GangMemory.need(n, batched=True)``):
    its rows at the gang's longest ``tokens``, every layer's activations (the batched view runs without gradient
    checkpointing), and what the batched view keeps beyond that where rows are padded: the keys and values repeated to
    every head, and the attention mask; and what its forward allocates beyond the graph's saved tensors at every Linear
    some member adapts (the base output for every row and the members' pieces before they are concatenated: twice the
    outputs, ``rows x tokens x out_features``), which the CPU's heap keeps through the step. The decoder: a bank of ``capacity x max rank x (in + out)`` per adapted Linear (capacity: the members rounded up to a power of two), and the bf16 copy
    of an unquantized base. Per member in the decoder: a key/value cache of ``2 x layers x kv_heads x head_dim`` values
    per token for its rollout rows (``per_device_train_batch_size``) and its evaluation rows, each rounded up to a
    power of two (a bucket's rows per group), over the prompt and completion rounded up as the decoder rounds them
    (`rfopt.training.rollouts.batched.decode_shape`; a gang whose size is no power of two decodes padding groups as
    large as its largest member's, counted by `GangMemory.need`); the buckets'
    token buffers (13 bytes per row and position); the sampler's scratch (`SAMPLER_SCRATCH` bytes per row and
    vocabulary entry)."""
    meta = meta_model(configs[0])
    if meta is None:
        return None
    model, model_config, width = meta
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    vocab = text.vocab_size
    decode_width = compute_width or width
    base = base_bytes(model, configs[0].quantization_config, width)

    # Every Linear some member adapts is a `GangLinear` in the batched view: the base layer's output for every row,
    # then each member's delta (added in place by `GroupedLoRA`, or through PEFT's modules and concatenated with
    # dropout, lora_bias or autocast; tests/training/test_memory.py).
    served: dict[int, int] = {}
    for config in configs:
        if config.peft_config is not None:
            served.update((id(module), module.out_features) for module, _ in _adapted(model, config.peft_config))
    served_out = sum(served.values())

    def batched_extra(rows: int, tokens: int) -> int:
        # What the batched view keeps beyond a member's own step where its rows are padded (measured on the tiny model,
        # tests/training/test_memory.py, test_batched_step.py): keys and values repeated to every head (attention
        # with an explicit mask) and the mask itself, per layer. And what its forward allocates beyond the tensors the
        # graph saves, per adapted Linear: the base layer's output for every row and the members' pieces before their
        # concatenation (twice the outputs' size). Freed as the forward goes, but the CPU's heap does not give them
        # back: on SmolLM2 (4 members x 4 rows x 149 tokens) the resident set grew by 5.41 GiB over the forward where
        # the graph saves 2.70 GiB, 2.71 GiB beyond against 2.76 GiB counted here (BENCHMARKS.md). Measured before
        # `GroupedLoRA` added the deltas in place; with it this over-counts the common case, and a whole batched gang
        # of those 4 configs held 7.42 GiB against 8.97 planned (1.21x, BENCHMARKS.md): kept, not re-derived.
        padded = rows * tokens * layers * (2 * (heads - kv_heads) * head_dim + tokens) * width
        return padded + 2 * rows * tokens * served_out * width

    def step_bytes(rows: int, tokens: int, own: int, checkpointed: bool = False) -> int:
        # Korthikanti et al. count bytes at 16 bits: scaled to the model's width; the logits over the member's own
        # tokens (a batched forward pads its rows to the longest member's `tokens`, its head reads its own). With
        # gradient checkpointing, each layer keeps its input, and one layer's activations are recomputed at a time.
        layer = rows * tokens * (34 * hidden + 5 * heads * tokens) * width // 2
        kept = rows * tokens * layers * hidden * width + layer if checkpointed else layers * layer
        return kept + 2 * rows * own * vocab * 4

    def shared_step(rows: int, prompts: int, prefix: int, tokens: int, own: int) -> int:
        # A batched step whose rows share their prompts (`rfopt.training.batched_step.shared_prompts`): the `prefix`
        # columns computed once per prompt, every row's rest attending to its prompt's keys and values (copied per row
        # and concatenated with its own, per layer), and the outputs of every adapted Linear for those tokens.
        rest = tokens - prefix
        layer = (prompts * prefix * (34 * hidden + 5 * heads * prefix) + rows * rest * (34 * hidden + 5 * heads * tokens)
                 ) * width // 2
        copies = rows * tokens * 2 * kv_heads * head_dim * width
        padded = (prompts * prefix * (2 * (heads - kv_heads) * head_dim + prefix)
                  + rows * (tokens * 2 * (heads - kv_heads) * head_dim + rest * tokens)) * width
        outputs = 2 * (prompts * prefix + rows * rest) * served_out * width
        return layers * (layer + copies + padded) + outputs + 2 * rows * own * vocab * 4

    longest = prompt_tokens + max(config.args.max_completion_length for config in configs)
    # Rows of one prompt: a micro-batch of `per_device_train_batch_size` rows holds its `num_generations`' prompts.
    prompts_of = [-(-c.args.per_device_train_batch_size // max(1, c.args.num_generations or 1)) for c in configs]
    shared = shared_prompts and (
        sum((c.args.per_device_train_batch_size - p) * (longest - c.args.max_completion_length)
            for c, p in zip(configs, prompts_of))
        >= MIN_SHARED * longest * sum(c.args.per_device_train_batch_size for c in configs))
    members, step, kept, steps, decode = [], 0, 0, [], []
    for config, prompts in zip(configs, prompts_of):
        tokens = prompt_tokens + config.args.max_completion_length
        rows = config.args.per_device_train_batch_size
        members.append(adapter_bytes(_lora_tensors(model, config.peft_config), config))
        own = step_bytes(rows, tokens, tokens, bool(config.args.gradient_checkpointing))
        step = max(step, own)
        if on_cpu and HEAP_KEEPS[0] <= rows * tokens * hidden * width <= HEAP_KEEPS[1]:  # a layer's hidden states
            kept = max(kept, own)
        # the batched view keeps its activations (no gradient checkpointing), and a little more
        if shared:  # its prompt, left-padded to the gang's longest sequence, once per prompt
            steps.append(shared_step(rows, prompts, longest - config.args.max_completion_length, longest, tokens))
        else:
            steps.append(step_bytes(rows, longest, tokens) + batched_extra(rows, longest))
        share = 0
        for rows_of, new in ((rows, config.args.max_completion_length),
                             (eval_rows, eval_new_tokens or config.args.max_completion_length)):
            if rows_of <= 0:
                continue
            _, bucket_rows, length = decode_shape(1, rows_of, prompt_tokens + new)
            share += bucket_rows * length * (2 * layers * kv_heads * head_dim * decode_width + 13)
            share += bucket_rows * vocab * SAMPLER_SCRATCH
        decode.append(share)
    peft_configs = [c.peft_config for c in configs if c.peft_config is not None]
    decoder = 0
    if peft_configs:
        capacity = 1 << max(0, (len(peft_configs) - 1).bit_length())
        decoder = capacity * max(sum(_lora_tensors(model, c)) for c in peft_configs) * decode_width
        if decode_width != width and configs[0].quantization_config is None:
            decoder += sum(p.numel() for p in model.parameters()) * decode_width
    return GangMemory(base=base, members=tuple(members), step=step, decode=tuple(decode), decoder=decoder,
                      steps=tuple(steps), kept=kept)


def _lora_tensors(model: Any, peft_config: Any) -> list[int]:
    """The sizes of a LoRA adapter's weights of `peft_config` on `model` (meta device): ``r x in`` and ``out x r`` per
    adapted Linear."""
    if peft_config is None:
        return [p.numel() for p in model.parameters()]  # full fine-tuning: a copy of every weight
    return [size for module, rank in _adapted(model, peft_config)
            for size in (rank * module.in_features, module.out_features * rank)]


def _adapted(model: Any, peft_config: Any) -> list[tuple[Any, int]]:
    """The Linear modules of `model` a LoRA adapter of `peft_config` adapts, each with its rank."""
    import torch.nn as nn

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
            sizes.append((module, (peft_config.rank_pattern or {}).get(leaf, peft_config.r)))
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
