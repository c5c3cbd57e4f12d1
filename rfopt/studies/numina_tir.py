"""NuminaMath-TIR: GRPO with a ``<think>``/``<answer>`` format reward and a math_verify accuracy reward.

After TRL's GRPO tutorial on this dataset ("Post training an LLM for reasoning with GRPO in TRL"):
Qwen2-0.5B-Instruct, LoRA r=8, alpha=32, dropout 0.1 on q and v, the DeepSeek-R1-style system
prompt (`studies.data.THINK_SYSTEM_PROMPT`), and two rewards of 1.0 each:

- `rewards.think_format`: the whole completion is ``<think>...</think>`` then ``<answer>...</answer>``;
- `rewards.math_accuracy`: the answer equals the gold by math_verify (the gold is read from the
  ``solution`` column, whose last ``\\boxed{}`` holds it).

`studies.data.load_numina_tir` takes 128 training and 24 test problems (each split shuffled with
seed 42). The study searches the learning rate around the tutorial's 1e-5; the objective is the
total reward on the test problems, with successive halving after chunks 1 and 2. Changes from
the tutorial, to fit rfopt's chunks and a short run: 4 prompts x 4 generations per micro-batch
and 4 accumulation steps (16 prompts per step, 2 steps per chunk) instead of 16 accumulation
steps, and 256 new tokens instead of 64 (64 cuts off most answers before ``</answer>``).

Offline, the run stops with the loader's message; pass a local copy (a directory with
``train.jsonl``/``test.jsonl`` or the Hub's ``data/*.parquet``, columns ``problem`` and
``solution``) to `load_datasets`, and local models to `build_space`:

    from rfopt.studies import numina_tir
    train, test = numina_tir.load_datasets(source="path/to/NuminaMath-TIR")
    space = numina_tir.build_space(models=["path/to/model"])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from peft import LoraConfig
from trl import GRPOConfig

import rfopt
from rfopt import rewards

from .data import load_numina_tir

NUMINA_SOURCE = "AI-MO/NuminaMath-TIR"
MODELS = ["Qwen/Qwen2-0.5B-Instruct"]
LEARNING_RATES = [3e-6, 1e-5, 3e-5, 1e-4]


def load_datasets(source: Any = NUMINA_SOURCE, n_train: int = 128, n_test: int = 24, seed: int = 42):
    """``(train, test)``: NuminaMath-TIR's splits, shuffled with ``seed`` and cut to size."""
    return load_numina_tir(source, n_train=n_train, n_test=n_test, seed=seed)


def build_space(
    models: Sequence[str] = MODELS, learning_rates: Sequence[float] = LEARNING_RATES, **grpo_overrides: Any
) -> list[rfopt.TrialConfig]:
    """One `rfopt.TrialConfig` per (model, learning rate); ``grpo_overrides`` change the GRPO settings."""
    import torch

    settings: dict[str, Any] = dict(
        per_device_train_batch_size=16,
        num_generations=4,
        gradient_accumulation_steps=4,
        max_completion_length=256,
        num_train_epochs=1,
        beta=0.0,
        seed=42,
    )
    if not torch.cuda.is_available():  # TRL's defaults (bf16 autocast, gradient checkpointing) are for GPUs
        settings.update(bf16=False, use_cpu=True, gradient_checkpointing=False)
    settings.update(grpo_overrides)
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return [
        rfopt.TrialConfig(
            model=model,
            reward_funcs=[rewards.think_format, rewards.math_accuracy],
            args=GRPOConfig(learning_rate=learning_rate, **settings),
            peft_config=lora,
        )
        for model in models
        for learning_rate in learning_rates
    ]


def space() -> list[rfopt.TrialConfig]:
    """The study's trials (what `rfopt run` calls)."""
    return build_space()


STUDY = rfopt.StudySpec(
    name="numina_tir",
    configs=space,
    datasets=load_datasets,
    num_chunks=4,
    pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    objective="reward",
    eval_settings=rfopt.EvalSettings(temperature=0.0, batch_size=8, seed=0),
    description=(
        "GRPO on NuminaMath-TIR (128 train / 24 test) with TRL's tutorial rewards (<think>/<answer> format, "
        "math_verify accuracy): learning rate around 1e-5 on Qwen2-0.5B-Instruct, successive halving. "
        "Needs the Hub (or local copies)."
    ),
    fast={"configs": lambda: build_space(learning_rates=[1e-5, 1e-4])},
)
