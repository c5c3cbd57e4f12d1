"""A live study for the dashboard's browser tests and screenshots (`rfopt run tests/dashboard_study.py`): 4 trials of
the tiny model (its directory from ``RFOPT_TEST_TINY_MODEL``), 2 chunks of 4 optimizer steps, two reward functions, and
a MedianPruner that stops the two trials that cannot learn (learning rate 0) after their first chunk, as in
tests/pruning/test_pruning_e2e.py. ``RFOPT_TEST_STEP_SECONDS`` slows each optimizer step by that much (the reward
function waits), so that a page can watch a chunk train step by step; ``RFOPT_TEST_HANG_CALL=N`` and
``RFOPT_TEST_HANG_SECONDS=S`` make the reward function's N-th call in the process hang for S seconds (a stuck reward
server). Trials 1 and 3 have the same config: they learn the same, and tie. ``RFOPT_TEST_LORA=1`` trains LoRA adapters
on one shared base model instead of the whole model, so that the trials train in gangs (the README's screenshots:
a gang's phases, whose turn it is)."""

import os
import time

import optuna
from rfopt_testkit import grpo_config, lora_config, prompts_dataset, reward_len

import rfopt

LEARNING_RATES = (0.0, 0.05, 0.0, 0.05)
CHUNKS = int(os.environ.get("RFOPT_TEST_CHUNKS", "2"))
_CALLS = 0


def reward_lowercase(completions, **kwargs):
    """Fraction of lowercase letters in the completion: what the learners learn within a chunk."""
    global _CALLS
    _CALLS += 1
    if _CALLS == int(os.environ.get("RFOPT_TEST_HANG_CALL", "0")):
        time.sleep(float(os.environ.get("RFOPT_TEST_HANG_SECONDS", "0")))
    time.sleep(float(os.environ.get("RFOPT_TEST_STEP_SECONDS", "0")))
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.islower() for ch in t) / max(1, len(t)) for t in texts]


def configs():
    return [
        rfopt.TrialConfig(
            model=os.environ["RFOPT_TEST_TINY_MODEL"],
            reward_funcs=[reward_lowercase, reward_len],
            args=grpo_config(learning_rate=lr, lr_scheduler_type="constant", per_device_train_batch_size=16),
            peft_config=lora_config() if os.environ.get("RFOPT_TEST_LORA") else None,
        )
        for lr in LEARNING_RATES
    ]


STUDY = rfopt.StudySpec(
    name="live",
    configs=configs,
    datasets=lambda: (prompts_dataset(16 * CHUNKS), prompts_dataset(8, "E")),
    num_chunks=CHUNKS,
    max_concurrent=len(LEARNING_RATES),
    pruner=lambda: optuna.pruners.MedianPruner(n_startup_trials=3),
    eval_settings=rfopt.EvalSettings(temperature=1.0),
)
