"""The offline default study: GRPO on SmolLM2-135M-Instruct + LoRA, synthetic arithmetic word problems.

``rfopt run arithmetic`` needs no network and takes about 12 to 15 minutes on two idle CPU cores (measured on
two cores shared with other engineers' test suites: 23 min 27 s with one torch thread at load average 2.4 to 3.6,
18 min of CPU; before the baseline and the 32 eval questions, 10 min 17 s on 2 mostly idle cores). It evaluates the
base model once (its baseline), searches learning rate and LoRA rank over `CONFIGS` (4 trials), lets successive
halving stop the worse half after chunks 1 and 2 of 4, and ends with the adapter it recommends (the best checkpoint
of any trial) against the base model, and that adapter's completions.

Choices, and why:

- Data: `load_arithmetic` (difficulty 1, seed 0) with the REASONING system prompt, plus ONE worked
  example in the conversation (`DEMONSTRATION`: a user question and an assistant answer in the
  ``<reasoning>``/``<answer>`` format) before each question. With the system prompt alone,
  SmolLM2-135M-Instruct never writes the tags (0 of 16 greedy answers, 1 of 32 samples had any
  tag), so every completion of a group gets the same reward and GRPO has nothing to learn from.
  With the example, about 20% of greedy answers and of samples at temperature 0.7 follow the
  format: enough signal to learn from in a few steps, and room to improve.
- Rewards: correctness 2.0, integer answer 0.5, strict format 0.5, soft format 0.5, tag count
  0.125 per tag (the GSM8K GRPO recipe's five rewards, at their own values).
- Objective: the total reward of greedy answers on `N_EVAL` held-out questions, after every
  chunk. Most of what a 135M model can gain in a few minutes is format (up to 2.0 of it), and
  correctness rides on the format (no answer block, no correct answer), so the total shows
  learning best; the per-reward means are stored too (``rfopt.load_study(...).chunk_metrics(n)``).
- Eval size, 32: the base model answers none of the first 32 questions right (reward 0.715, std 0.80 over the
  prompts: a standard error of 0.14), and an adapter trained 8 steps at 5e-4 (rank 8) 4 of them (reward 2.08), 3 of
  the first 16: on 16 questions a trained adapter's lead on correctness is one to three answers.
- Budget: one prompt x 4 generations per step (TRL counts completions in
  ``per_device_train_batch_size``), at most 64 new tokens, sampling temperature 0.7 (the 135M model
  rambles at 1.0), a constant learning rate (the runs are short; every chunk trains at the
  searched rate). 4 chunks of 4 steps: a trial that runs to the end trains 16 steps on 16
  questions (at 5e-4 the greedy answers have the format after 4-8 steps and change little
  after). Chunks of 2 steps were too short: after 2 steps on 2 questions that happened to give
  almost no reward signal, the 5e-4 trials scored below the untrained model and the first rung
  pruned them. A step takes ~8 s on 2 idle CPU cores (~20 s on one), an evaluation of the 16
  eval questions ~13 s (~20 s).
- Search: learning rate x LoRA rank (alpha = 2 x rank, all linear layers), including a learning
  rate far too small to learn anything in 16 steps (1e-7: it scores exactly what the base model does), so that
  pruning has a loser to find. Successive halving with ``min_resource=1, reduction_factor=2`` keeps the best half of
  the trials after chunks 1 and 2 (4 -> 2 -> 1; rfopt decides at each rung with every trial's value
  at that chunk, so the order trials ran in does not matter; ties go to the lower trial number):
  8 chunk units in all instead of 16 for the four trials run to the end.
- Why 2e-4 and not 2e-3 (measured, `BENCHMARKS.md`, "The demo's answer"): at 2e-3 (rank 16) the model memorises
  the worked example. After chunk 2 its stored sample answers all end with the example's last line and its answer,
  8; after chunk 3 every one of the 32 eval answers is the example's text (reward 2.25: the format's full 2.0, and 8
  happens to be right for 4 questions), after chunk 4 a loop cut at the limit (0.125). Its format reward won the
  second rung against 5e-4, whose answers were the study's most often right (3 of 32 after chunk 1), so the demo's
  answer was a near-memorised text. With 2e-4 instead, every trial's answers depend on the question, and the recommended adapter
  beats the base model on reward (2.195 vs 0.715) and on correctness (4 of 32 vs 0 of 32).

``--fast`` runs two trials, 2 chunks of 4 steps, on 8 training questions and 4 eval questions (a
smoke run of a few minutes). `build_space` and `load_datasets` take the model, the configs and
the sizes as arguments, so the same study runs elsewhere: ``build_space(model="path/to/model")``.
"""

from __future__ import annotations

from typing import Any

import optuna
from peft import LoraConfig
from trl import GRPOConfig

import rfopt
from rfopt import rewards

from .data import REASONING_SYSTEM_PROMPT, load_arithmetic

MODEL = "smollm2"
NUM_CHUNKS = 4
STEPS_PER_CHUNK = 4
PROMPTS_PER_STEP = 1
N_TRAIN = NUM_CHUNKS * STEPS_PER_CHUNK * PROMPTS_PER_STEP
N_EVAL = 32
SEED = 0

#: (learning rate, LoRA rank) of each trial; 1e-7 is the deliberately poor choice (it scores what the base model
#: scores). Successive halving breaks ties by trial number, so where two configs tie the earlier one
#: (here rank 16 before rank 8, as rank 16 keeps improving longer) is kept.
CONFIGS: list[tuple[float, int]] = [
    (1e-7, 16),
    (5e-4, 16),
    (5e-4, 8),
    (2e-4, 16),
]

REWARDS = [
    rewards.correctness,  # 2.0 for the right number in the last <answer> block
    rewards.integer_answer,  # 0.5
    rewards.strict_format,  # 0.5
    rewards.soft_format,  # 0.5
    rewards.tag_count,  # 0.125 per tag
]

#: One worked example shown before every question (see the module docstring for why).
DEMONSTRATION = [
    {
        "role": "user",
        "content": "Lena buys 3 notebooks that cost $4 each. Lena pays with a $20 bill. "
        "How many dollars of change does Lena get?",
    },
    {
        "role": "assistant",
        "content": "<reasoning>\nThe notebooks cost 3 * 4 = 12 dollars.\nThe change is 20 - 12 = 8 dollars.\n"
        "</reasoning>\n<answer>\n8\n</answer>",
    },
]


def load_datasets(n_train: int = N_TRAIN, n_eval: int = N_EVAL, seed: int = SEED, demonstration: bool = True):
    """``(train, eval)`` arithmetic problems (difficulty 1); with `DEMONSTRATION` after the system prompt."""
    train, test = load_arithmetic(
        n_train=n_train, n_test=n_eval, seed=seed, system_prompt=REASONING_SYSTEM_PROMPT, difficulty=1
    )
    if demonstration:
        train, test = _with_demonstration(train), _with_demonstration(test)
    return train, test


def _with_demonstration(dataset: Any) -> Any:
    # Insert the example between the system prompt and the question.
    prompts = [[*p[:-1], *DEMONSTRATION, p[-1]] for p in dataset["prompt"]]
    return dataset.remove_columns("prompt").add_column("prompt", prompts)


def base_grpo(**overrides: Any) -> GRPOConfig:
    """The GRPO settings every trial shares (CPU training; see the module docstring)."""
    settings: dict[str, Any] = dict(
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        per_device_train_batch_size=4 * PROMPTS_PER_STEP,
        num_generations=4,
        max_completion_length=64,
        temperature=0.7,
        num_train_epochs=1,
        beta=0.0,
        seed=SEED,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def build_space(
    model: str = MODEL, configs: list[tuple[float, int]] | None = None, **grpo_overrides: Any
) -> list[rfopt.TrialConfig]:
    """One `rfopt.TrialConfig` per (learning rate, LoRA rank) of `configs` (default `CONFIGS`) on `model`."""
    return [
        rfopt.TrialConfig(
            model=model,
            reward_funcs=list(REWARDS),
            args=base_grpo(learning_rate=learning_rate, **grpo_overrides),
            peft_config=LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear"),
        )
        for learning_rate, rank in (CONFIGS if configs is None else configs)
    ]


def space() -> list[rfopt.TrialConfig]:
    """The study's trials (what `rfopt run` calls)."""
    return build_space()


def fast_space() -> list[rfopt.TrialConfig]:
    """``--fast``: a poor and a good learning rate."""
    return build_space(configs=[(1e-7, 8), (5e-4, 8)])


def fast_datasets():
    return load_datasets(n_train=8, n_eval=4)


STUDY = rfopt.StudySpec(
    name="arithmetic",
    configs=space,
    datasets=load_datasets,
    num_chunks=NUM_CHUNKS,
    pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    objective="reward",
    eval_settings=rfopt.EvalSettings(max_new_tokens=64, temperature=0.0, batch_size=16, seed=0, num_samples=4),
    description=(
        "GRPO on SmolLM2-135M-Instruct + LoRA (offline), synthetic arithmetic word problems with the "
        "<reasoning>/<answer> format: learning rate x LoRA rank, successive halving after chunks 1 and 2 of 4."
    ),
    fast={"configs": fast_space, "datasets": fast_datasets, "num_chunks": 2,
          "description": "--fast: a smoke run of GRPO on SmolLM2-135M-Instruct + LoRA (offline), synthetic arithmetic "
                         "word problems: two learning rates (1e-7, 5e-4), 8 training questions in 2 chunks, 4 eval "
                         "questions, successive halving after chunk 1 of 2."},
)
