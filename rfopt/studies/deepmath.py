"""DeepMath-103K: GRPO on hard, verifiable math problems, answers checked by math_verify.

``zwhe99/DeepMath-103K`` ships one split; `studies.data.load_deepmath` shuffles it with seed 42
and holds out the last 24 rows as the eval set (128 training rows by default). The prompt asks
for the final answer in ``\\boxed{}`` (the dataset authors' prompt), and the reward is
`rewards.math_accuracy` (1.0 when the last ``\\boxed{}``, or ``<answer>`` block, equals the gold
``final_answer`` by math_verify) plus DAPO's soft overlong punishment (0 to -1.0 over the last
quarter of the token budget), so that answers that run out of tokens, and so never
box anything, are told apart from wrong ones.

The search is a learning-rate x LoRA-rank grid on Qwen2.5-0.5B-Instruct (`build_space` takes
other models); the objective is the eval accuracy alone (``"math_accuracy"``), pruned by
successive halving after chunks 1 and 2. One prompt x 8 generations per step, 512 new tokens:
meant for a GPU (``rfopt run deepmath --device cuda``). Offline, the run stops with
the loader's message: pass a local copy to `load_datasets` (a ``.jsonl``/``.parquet`` file or a
Hub snapshot directory with ``question`` and ``final_answer`` columns).

    from rfopt.studies import deepmath
    train, test = deepmath.load_datasets(source="path/to/deepmath.parquet")
    space = deepmath.build_space(models=["path/to/model"])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from peft import LoraConfig
from trl import GRPOConfig

import rfopt
from rfopt import rewards

from .data import load_deepmath

DEEPMATH_SOURCE = "zwhe99/DeepMath-103K"
MODELS = ["Qwen/Qwen2.5-0.5B-Instruct"]
LEARNING_RATES = [1e-6, 5e-6, 2e-5]
LORA_RANKS = [16, 64]
MAX_COMPLETION_LENGTH = 512
#: The soft overlong punishment starts this fraction of the budget before its end (DAPO: 4096 of 20480).
OVERLONG_FRACTION = 0.25


def load_datasets(source: Any = DEEPMATH_SOURCE, n_train: int = 128, n_test: int = 24, seed: int = 42):
    """``(train, test)``: disjoint seeded slices of DeepMath-103K's only split."""
    return load_deepmath(source, n_train=n_train, n_test=n_test, seed=seed)


def build_space(
    models: Sequence[str] = MODELS,
    learning_rates: Sequence[float] = LEARNING_RATES,
    lora_ranks: Sequence[int] = LORA_RANKS,
    **grpo_overrides: Any,
) -> list[rfopt.TrialConfig]:
    """One `rfopt.TrialConfig` per (model, learning rate, LoRA rank); ``grpo_overrides`` change the GRPO settings."""
    import torch

    settings: dict[str, Any] = dict(
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=1.0,
        warmup_steps=0.1,
        max_grad_norm=0.2,
        num_train_epochs=1,
        beta=0.0,
        seed=42,
    )
    if not torch.cuda.is_available():  # TRL's defaults (bf16 autocast, gradient checkpointing) are for GPUs
        settings.update(bf16=False, use_cpu=True, gradient_checkpointing=False)
    settings.update(grpo_overrides)
    budget = settings["max_completion_length"]
    punish = rewards.soft_overlong_punishment(budget, int(budget * OVERLONG_FRACTION))
    return [
        rfopt.TrialConfig(
            model=model,
            reward_funcs=[rewards.math_accuracy, punish],
            args=GRPOConfig(learning_rate=learning_rate, **settings),
            peft_config=LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.05, target_modules="all-linear"),
        )
        for model in models
        for learning_rate in learning_rates
        for rank in lora_ranks
    ]


def space() -> list[rfopt.TrialConfig]:
    """The study's trials (what `rfopt run` calls)."""
    return build_space()


STUDY = rfopt.StudySpec(
    name="deepmath",
    configs=space,
    datasets=load_datasets,
    num_chunks=4,
    pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    objective="math_accuracy",
    eval_settings=rfopt.EvalSettings(temperature=0.0, batch_size=8, seed=0),
    description=(
        "GRPO on DeepMath-103K (128 train / 24 held out), math_verify accuracy on \\boxed{} answers: "
        "learning rate x LoRA rank on Qwen2.5-0.5B-Instruct, successive halving. Needs the Hub (or a local copy)."
    ),
    fast={"configs": lambda: build_space(learning_rates=[5e-6], lora_ranks=[16])},
)
