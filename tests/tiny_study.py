"""A study file on the tiny test model, for tests and benchmarks that run `rfopt run` / `rfopt worker` in
subprocesses. The model's directory comes from ``RFOPT_TEST_TINY_MODEL``; ``RFOPT_TEST_TRIALS`` (default 3)
and ``RFOPT_TEST_CHUNKS`` (default 3) size it. The space is an explicit grid, so every run of it trains the
same configs under the same trial numbers."""

import os

from rfopt_testkit import prompts_dataset, trial_config

import rfopt

TRIALS = int(os.environ.get("RFOPT_TEST_TRIALS", "3"))
CHUNKS = int(os.environ.get("RFOPT_TEST_CHUNKS", "3"))
RATES = [1e-3, 5e-3, 1e-2, 2e-3, 3e-3, 7e-3, 4e-3, 6e-3][:TRIALS]


def space():
    base = trial_config(os.environ["RFOPT_TEST_TINY_MODEL"], gradient_accumulation_steps=2)
    return rfopt.grid(base, learning_rate=RATES)


def datasets():
    return prompts_dataset(4 * CHUNKS), prompts_dataset(2, "E")


STUDY = rfopt.StudySpec(
    name="tiny",
    configs=space,
    datasets=datasets,
    num_chunks=CHUNKS,
    max_concurrent=TRIALS,
    # One trial at a time, as plain TRL: crashed, resumed and multi-worker runs reproduce the one-process reference
    # bit for bit (workers' gangs depend on timing). The gang variants of those tests give --gang-size.
    gang_size=1,
)
