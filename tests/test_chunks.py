"""The chunk plan and per-trial schedules."""

import pytest

from rfopt.errors import PlanError
from rfopt.chunks import ChunkPlan, dataset_fingerprint, trial_schedule
from rfopt_testkit import grpo_config, prompts_dataset


def test_plan_is_seeded_disjoint_and_covers_equal_chunks():
    plan = ChunkPlan.build(num_rows=103, num_chunks=4, seed=1)
    assert [len(c) for c in plan.chunks] == [25, 25, 25, 25]
    rows = [r for c in plan.chunks for r in c]
    assert len(set(rows)) == len(rows) == 100
    assert ChunkPlan.build(num_rows=103, num_chunks=4, seed=1) == plan
    assert ChunkPlan.build(num_rows=103, num_chunks=4, seed=2).chunks != plan.chunks
    assert ChunkPlan.from_dict(plan.to_dict()) == plan


def test_schedule_counts_steps_from_the_batch_shape():
    plan = ChunkPlan.build(num_rows=32, num_chunks=4, seed=0)  # 8 prompts per chunk
    one = trial_schedule(plan, grpo_config())  # 1 prompt per step
    assert (one.prompts_per_chunk, one.steps_per_chunk, one.total_steps) == (8, 8, 32)
    accum = trial_schedule(plan, grpo_config(gradient_accumulation_steps=2, num_train_epochs=2))
    assert (accum.steps_per_chunk, accum.num_units, accum.total_steps) == (4, 8, 32)
    assert [accum.chunk_of_unit(u) for u in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    iterations = trial_schedule(plan, grpo_config(num_iterations=2))
    assert iterations.steps_per_chunk == 16


def test_rows_that_do_not_fill_a_generation_cycle_are_left_out():
    plan = ChunkPlan.build(num_rows=40, num_chunks=4, seed=0)  # 10 prompts per chunk
    schedule = trial_schedule(plan, grpo_config(per_device_train_batch_size=12, num_generations=4))
    assert schedule.prompts_per_chunk == 9  # 3 prompts per step: the 10th row of each chunk is left out
    assert schedule.steps_per_chunk == 3


def test_more_chunks_than_rows_or_steps_is_refused_with_what_to_change():
    with pytest.raises(PlanError, match="more than the 3 training rows"):
        ChunkPlan.build(num_rows=3, num_chunks=4)
    plan = ChunkPlan.build(num_rows=8, num_chunks=4, seed=0)  # 2 prompts per chunk
    with pytest.raises(PlanError, match="fewer than the 4 one training step needs.*use at most 2 chunks"):
        trial_schedule(plan, grpo_config(gradient_accumulation_steps=4))


def test_a_fixed_step_budget_or_fractional_epochs_are_refused():
    plan = ChunkPlan.build(num_rows=16, num_chunks=2)
    with pytest.raises(PlanError, match="max_steps=10"):
        trial_schedule(plan, grpo_config(max_steps=10))
    with pytest.raises(PlanError, match="num_train_epochs=1.5"):
        trial_schedule(plan, grpo_config(num_train_epochs=1.5))


def test_dataset_fingerprint_follows_content():
    assert dataset_fingerprint(prompts_dataset(8)) == dataset_fingerprint(prompts_dataset(8))
    assert dataset_fingerprint(prompts_dataset(8)) != dataset_fingerprint(prompts_dataset(8, prefix="X"))
