"""The study the forecast is checked against (`tests/reports/test_forecast.py`, recorded by `bench/record_forecast.py`):
6 trials of the tiny model (its directory from ``RFOPT_TEST_TINY_MODEL``), 4 chunks of 4 optimizer steps, two gangs of
3, and successive halving (``min_resource=1, reduction_factor=2``: 6 -> 3 after chunk 1, 3 -> 2 after chunk 2), as the
issue that asked for the forecast tried it. ``RFOPT_TEST_STEP_SECONDS`` (default 0.5) slows each reward call, so that a
unit's time is mostly its steps, as on a real model."""

import os
import time

import optuna
from rfopt_testkit import prompts_dataset, reward_len, trial_config

import rfopt

LEARNING_RATES = (1e-4, 5e-3, 2e-2, 1e-3, 5e-2, 0.0)
CHUNKS = 4


def reward_slow_len(completions, **kwargs):
    """`reward_len`, after waiting ``RFOPT_TEST_STEP_SECONDS``."""
    time.sleep(float(os.environ.get("RFOPT_TEST_STEP_SECONDS", "0.5")))
    return reward_len(completions, **kwargs)


def configs():
    return [trial_config(os.environ["RFOPT_TEST_TINY_MODEL"], rewards=(reward_slow_len,), learning_rate=lr,
                         lr_scheduler_type="constant") for lr in LEARNING_RATES]


STUDY = rfopt.StudySpec(
    name="forecast",
    configs=configs,
    datasets=lambda: (prompts_dataset(4 * CHUNKS), prompts_dataset(8, "E")),
    num_chunks=CHUNKS,
    max_concurrent=len(LEARNING_RATES),
    pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    gang_size=3,
)
