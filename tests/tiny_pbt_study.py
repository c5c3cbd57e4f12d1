"""tests/tiny_study.py's grid of learning rates under population-based training: the study file the PBT crash and
worker tests run with `rfopt run` / `rfopt worker` in subprocesses (4 configs, 3 chunks; one member replaced after
each of the first two chunks)."""

import os

from tiny_study import datasets, space

import rfopt

STUDY = rfopt.StudySpec(
    name="tiny",
    configs=space,
    datasets=datasets,
    num_chunks=int(os.environ.get("RFOPT_TEST_CHUNKS", "3")),
    max_concurrent=int(os.environ.get("RFOPT_TEST_TRIALS", "3")),
    pruner=lambda: rfopt.PopulationBasedTraining(interval=1, quantile=0.25, seed=0),
)
