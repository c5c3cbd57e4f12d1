"""The chunk plan: the training set split into seeded, disjoint chunks shared by every trial of a study.

`ChunkPlan` is study-level: a seeded permutation of the training rows cut into `num_chunks` equal
chunks. `TrialSchedule` is trial-level: how many optimizer steps one chunk is for a trial's batch
shape, and the trial's total, known up front. Epochs cycle through the chunks in the same order;
chunk unit `u` of a trial trains on chunk ``u % num_chunks``.

Every chunk must hold a whole number of generation cycles (TRL generates
``generation_batch_size / num_generations`` prompts at a time and reuses them for
``steps_per_generation * num_iterations`` micro-steps), so a chunk boundary never drops buffered
generations. Rows that do not fill a whole cycle in every chunk are left out, and the plan says so.

    >>> plan = ChunkPlan.build(num_rows=100, num_chunks=4, seed=0)
    >>> [len(c) for c in plan.chunks]
    [25, 25, 25, 25]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from rfopt.errors import PlanError


@dataclass(frozen=True)
class ChunkPlan:
    """Seeded, disjoint row indices of the training set, one tuple per chunk."""

    num_chunks: int
    seed: int
    num_rows: int
    chunks: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, num_rows: int, num_chunks: int, seed: int = 0) -> ChunkPlan:
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise PlanError(f"num_chunks must be a positive integer, got {num_chunks!r}")
        if num_rows < num_chunks:
            raise PlanError(
                f"num_chunks={num_chunks} is more than the {num_rows} training rows; use at most {num_rows} chunks"
            )
        order = list(range(num_rows))
        random.Random(seed).shuffle(order)
        size = num_rows // num_chunks
        chunks = tuple(tuple(order[i * size : (i + 1) * size]) for i in range(num_chunks))
        return cls(num_chunks=num_chunks, seed=seed, num_rows=num_rows, chunks=chunks)

    @property
    def chunk_size(self) -> int:
        return len(self.chunks[0])

    def to_dict(self) -> dict[str, Any]:
        return {"num_chunks": self.num_chunks, "seed": self.seed, "num_rows": self.num_rows}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkPlan:
        return cls.build(num_rows=data["num_rows"], num_chunks=data["num_chunks"], seed=data["seed"])


@dataclass(frozen=True)
class TrialSchedule:
    """How a trial with a given batch shape walks through a chunk plan."""

    prompts_per_chunk: int
    """Rows of each chunk this trial trains on (whole generation cycles; the rest are left out)."""
    steps_per_chunk: int
    """Optimizer steps per chunk."""
    num_epochs: int
    num_chunks: int

    @property
    def num_units(self) -> int:
        """Chunk units the trial runs in all: one report (step) each."""
        return self.num_epochs * self.num_chunks

    @property
    def total_steps(self) -> int:
        return self.num_units * self.steps_per_chunk

    def chunk_of_unit(self, unit: int) -> int:
        return unit % self.num_chunks

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _block(grpo: Any, world_size: int = 1) -> tuple[int, int, int]:
    """``(prompts, cycles, micro-steps a cycle)`` of the smallest whole block a chunk is made of for a trial with
    GRPOConfig `grpo`: whole generation cycles that end on an optimizer step."""
    small = [f"{name}={getattr(grpo, name)!r}" for name in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                             "steps_per_generation", "num_iterations", "num_generations")
             if not isinstance(getattr(grpo, name), int) or getattr(grpo, name) < 1]
    if small:
        raise PlanError(f"{', '.join(small)}: each must be a whole number, 1 or more, for a training step to exist")
    G = grpo.num_generations
    generation_batch = grpo.per_device_train_batch_size * world_size * grpo.steps_per_generation
    if generation_batch % G:
        raise PlanError(
            f"generation batch {generation_batch} (per_device_train_batch_size x steps_per_generation) is not a "
            f"multiple of num_generations={G}; change per_device_train_batch_size or num_generations"
        )
    prompts_per_cycle = generation_batch // G
    micro_steps_per_cycle = grpo.steps_per_generation * grpo.num_iterations
    # A chunk must end on an optimizer step too: the smallest number of cycles whose micro-steps divide evenly.
    cycles_per_block = grpo.gradient_accumulation_steps // math.gcd(micro_steps_per_cycle, grpo.gradient_accumulation_steps)
    return prompts_per_cycle * cycles_per_block, cycles_per_block, micro_steps_per_cycle


def rows_left_out(plan: ChunkPlan, grpo: Any) -> tuple[int, str] | None:
    """How many training rows a trial with GRPOConfig `grpo` leaves out on `plan`, and the same in words with how to
    train every row; None when it trains every row. Rows that do not fill a chunk (``num_rows % num_chunks``), and in
    each chunk those that do not fill a whole block of generation cycles (`_block`), are not trained."""
    block = _block(grpo)[0]
    trained = trial_schedule(plan, grpo).prompts_per_chunk * plan.num_chunks
    if trained == plan.num_rows:
        return None
    whole = plan.num_chunks * block
    more = -(-plan.num_rows // whole) * whole
    less = plan.num_rows // whole * whole
    left = plan.num_rows - trained
    return left, (f"it trains {trained} of the {plan.num_rows} training rows ({left} left out, the same ones every "
                  f"epoch): {plan.num_chunks} chunks of {plan.chunk_size} rows, of which it trains "
                  f"{trained // plan.num_chunks} each, in whole blocks of {block} prompt{'s' if block != 1 else ''} "
                  f"(generation cycles that end on an optimizer step). Every row trains with a multiple of {whole} rows "
                  f"(num_chunks x {block}), e.g. {less or whole} or {more}")


def trial_schedule(plan: ChunkPlan, grpo: Any, world_size: int = 1) -> TrialSchedule:
    """The schedule of a trial with GRPOConfig `grpo` on `plan`; raises `PlanError` saying what to change."""
    G = grpo.num_generations
    prompts_per_block, cycles_per_block, micro_steps_per_cycle = _block(grpo, world_size)
    blocks = plan.chunk_size // prompts_per_block
    if blocks == 0:
        raise PlanError(
            f"each of the {plan.num_chunks} chunks holds {plan.chunk_size} prompts, fewer than the {prompts_per_block} "
            f"one training step needs (per_device_train_batch_size={grpo.per_device_train_batch_size}, "
            f"gradient_accumulation_steps={grpo.gradient_accumulation_steps}, num_generations={G}); "
            f"use at most {max(1, plan.num_rows // prompts_per_block)} chunks, a larger training set, "
            f"or a smaller batch"
        )
    prompts_per_chunk = blocks * prompts_per_block
    micro_steps = blocks * cycles_per_block * micro_steps_per_cycle
    steps_per_chunk = micro_steps // grpo.gradient_accumulation_steps
    num_epochs = _num_epochs(grpo)
    return TrialSchedule(
        prompts_per_chunk=prompts_per_chunk,
        steps_per_chunk=steps_per_chunk,
        num_epochs=num_epochs,
        num_chunks=plan.num_chunks,
    )


def _num_epochs(grpo: Any) -> int:
    if grpo.max_steps is not None and grpo.max_steps > 0:
        raise PlanError(
            f"max_steps={grpo.max_steps}: rfopt derives the step budget from the chunk plan; "
            "set num_train_epochs (a whole number) instead"
        )
    epochs = grpo.num_train_epochs
    if epochs != int(epochs) or epochs < 1:
        raise PlanError(f"num_train_epochs={epochs}: rfopt trains whole epochs over the chunks; use 1, 2, ...")
    return int(epochs)


def dataset_fingerprint(dataset: Any, sample: int = 1000) -> str:
    """A short content hash of a dataset (columns, size and up to `sample` evenly spaced rows).

    Stored on the study, so a resumed study refuses a different training set instead of mixing them.
    """
    n = len(dataset)
    digest = hashlib.sha256(json.dumps({"rows": n, "columns": sorted(dataset.column_names)}).encode())
    stride = max(1, n // sample)
    for i in range(0, n, stride):
        digest.update(json.dumps(dataset[i], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]
