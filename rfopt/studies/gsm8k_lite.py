"""GSM8K-lite: the GRPO sweep of the RapidFire AI / TRL integration article, run by rfopt.

The article ("Run 20x More GRPO Experiments: Official RapidFire AI Integration for TRL", tutorial
notebook ``rf-tutorial-grpo-mathreasoning-lite``) compares two configurations on 128 GSM8K
training questions and 24 test questions, 4 chunks:

==============================  =============  ==========================================
model                           learning rate  everything else
==============================  =============  ==========================================
Qwen/Qwen2.5-0.5B-Instruct      5e-6           LoRA r=16, alpha=16, dropout 0.05 on q, k, v,
meta-llama/Llama-3.2-1B-Instr.  1e-6           o, gate, up, down; GRPO as in `GRPO_SETTINGS`
==============================  =============  ==========================================

Five rewards with the article's values, which are the functions' own (so no reward weights):
correctness 2.0, integer answer 0.5, strict format 0.5, soft format 0.5, tag count 0.125 per
tag. rfopt's versions normalize numbers before comparing ("1,200" == "1200") and take the last
``<answer>`` block; tag_count also subtracts 0.001 per character after ``</answer>``.

How the article's settings map onto TRL 1.16 and rfopt:

- Batch: TRL's ``per_device_train_batch_size`` counts completions, not prompts. The article's
  values are kept as they are and TRL accepts them: 4 completions per micro-batch x 2
  accumulation steps = a generation batch of 8 = one prompt x 8 generations per optimizer
  step, so 128 prompts are 128 steps, 32 per chunk.
- ``warmup_ratio=0.1`` is ``warmup_steps=0.1`` (TRL 1.16 reads a float below 1 as a ratio).
- ``max_prompt_length=256`` no longer exists in TRL 1.16; GSM8K prompts are far shorter.
- ``optim="adamw_8bit"`` needs bitsandbytes, which runs it on CUDA and on the CPU (its CPU
  backend). Where it is not installed (``pip install 'rfopt[qlora]'``), or does not serve the
  device, the study falls back to ``adamw_torch`` and prints a warning saying so (see `optimizer`).
- The article loads the models in float16 (``torch_dtype``); rfopt does the same on CUDA and
  uses float32 on the CPU. Its ``use_cache=False`` and tokenizer ``model_max_length=512`` are
  left out: generation needs the KV cache to be fast, and nothing is truncated.
- Data: the article takes the *first* 128/24 rows and then shuffles them with seed 42;
  `studies.data.load_gsm8k` shuffles each whole split with seed 42 and takes the first 128/24,
  so the questions differ (same sizes, same distribution).
- No automatic pruning (the article stops runs by hand with IC Ops): the pruner is Optuna's
  NopPruner; use ``rfopt stop`` / the dashboard, or another pruner, to stop a run early.

Offline, ``rfopt run gsm8k_lite`` stops with the loader's message (the Hub cannot be
reached; pass a local copy). To run it on a local copy or other models, use the builders::

    import rfopt
    from rfopt.studies import gsm8k_lite
    train, test = gsm8k_lite.load_datasets(source="path/to/gsm8k")   # train.jsonl + test.jsonl
    space = gsm8k_lite.build_space(models={"path/to/model": 5e-6})
    rfopt.create_study(study_name="gsm8k").optimize(space, train, test, num_chunks=4)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import optuna
from peft import LoraConfig
from trl import GRPOConfig

import rfopt
from rfopt import rewards

from .data import load_gsm8k

#: Where GSM8K comes from: the Hub id, or a local copy (see `studies.data.load_gsm8k`).
GSM8K_SOURCE = "openai/gsm8k"

#: Base model -> learning rate, one trial each, as in the article.
MODELS: dict[str, float] = {
    "Qwen/Qwen2.5-0.5B-Instruct": 5e-6,
    "meta-llama/Llama-3.2-1B-Instruct": 1e-6,
}

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: The article's GRPO settings (optimizer, precision and learning rate are set per trial).
GRPO_SETTINGS: dict[str, Any] = dict(
    warmup_steps=0.1,
    weight_decay=0.1,
    max_grad_norm=0.1,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_generations=8,
    num_train_epochs=1,
    max_completion_length=256,
    beta=0.0,
    seed=42,
)

REWARDS = [
    rewards.correctness,  # 2.0
    rewards.integer_answer,  # 0.5
    rewards.strict_format,  # 0.5
    rewards.soft_format,  # 0.5
    rewards.tag_count,  # 0.125 per tag
]


def load_datasets(source: Any = GSM8K_SOURCE, n_train: int = 128, n_test: int = 24, seed: int = 42):
    """``(train, test)``: GSM8K's main config, each split shuffled with ``seed`` and cut to size."""
    return load_gsm8k(source, n_train=n_train, n_test=n_test, seed=seed)


def optimizer(warn: bool = True) -> str:
    """``"adamw_8bit"`` where bitsandbytes can run it on the device the study trains on (CUDA where there is one,
    else the CPU: bitsandbytes' CPU backend steps 8-bit AdamW too), else ``"adamw_torch"``.

    The fallback is printed on stderr, since it changes what the article specified.
    """
    import torch

    from rfopt.training.quantization import INSTALL, bitsandbytes_devices

    device = "cuda" if torch.cuda.is_available() else "cpu"
    served = bitsandbytes_devices()
    if served is None:
        missing = f"bitsandbytes is not installed ({INSTALL})"
    elif device not in served:
        missing = f"the installed bitsandbytes serves {', '.join(served)}, not {device}"
    else:
        return "adamw_8bit"
    if warn:
        print(
            f"gsm8k_lite: warning: optim='adamw_8bit' needs bitsandbytes ({missing}); using optim='adamw_torch' "
            "instead",
            file=sys.stderr,
        )
    return "adamw_torch"


def build_space(
    models: Mapping[str, float] = MODELS, optim: str | None = None, **grpo_overrides: Any
) -> list[rfopt.TrialConfig]:
    """One `rfopt.TrialConfig` per ``model -> learning rate`` entry, with the article's settings.

    ``optim`` defaults to `optimizer()`; ``grpo_overrides`` replace entries of `GRPO_SETTINGS`
    (e.g. ``max_completion_length=32`` for a quick check).
    """
    import torch

    cuda = torch.cuda.is_available()
    optim = optim or optimizer()
    settings = {**GRPO_SETTINGS, **grpo_overrides}
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.05, target_modules=LORA_TARGETS, bias="none")
    configs = []
    # On a GPU, TRL's defaults as in the article (bf16 autocast, gradient checkpointing) and the weights loaded in
    # float16; the CPU needs float32 and is faster without checkpointing.
    device = ({"model_init_kwargs": {"dtype": "float16"}} if cuda
              else {"bf16": False, "use_cpu": True, "gradient_checkpointing": False})
    for model, learning_rate in models.items():
        args = GRPOConfig(learning_rate=learning_rate, optim=optim, **{**device, **settings})
        configs.append(rfopt.TrialConfig(model=model, reward_funcs=list(REWARDS), args=args, peft_config=lora))
    return configs


def space() -> list[rfopt.TrialConfig]:
    """The article's two configurations (what `rfopt run` calls)."""
    return build_space()


STUDY = rfopt.StudySpec(
    name="gsm8k_lite",
    configs=space,
    datasets=load_datasets,
    num_chunks=4,
    pruner=lambda: optuna.pruners.NopPruner(),
    eval_settings=rfopt.EvalSettings(temperature=0.0, batch_size=8, seed=0),  # greedy, up to max_completion_length
    description=(
        "The RapidFire AI / TRL article's GRPO sweep on GSM8K (128 train / 24 test, 4 chunks): "
        "Qwen2.5-0.5B-Instruct at lr 5e-6 and Llama-3.2-1B-Instruct at lr 1e-6, LoRA r=16, five rewards. "
        "Needs the Hugging Face Hub (or local copies) and, for the article's 8-bit AdamW, bitsandbytes (CPU or GPU)."
    ),
    fast={"n_trials": 1},
)
