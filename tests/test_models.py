"""The model pool: shared base models, and the GC freeze that keeps per-chunk trainer construction cheap."""

import gc
import weakref

from rfopt.models import ModelPool
from rfopt_testkit import trial_config


class _Node:
    pass


def test_pool_freezes_what_is_loaded_and_close_gives_it_back(tiny_model):
    gc.unfreeze()
    pool = ModelPool("cpu")
    pool.acquire(0, trial_config(tiny_model))
    assert gc.get_freeze_count() > 0  # the libraries and the base model: skipped by later full collections

    # Objects made after the freeze are still collected, cycles included.
    node = _Node()
    node.self = node
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None

    pool.close()
    assert gc.get_freeze_count() == 0
    assert not pool.has_base(trial_config(tiny_model))


def test_a_trial_trained_in_chunks_sends_trl_telemetry_once_and_leaves_accelerate_as_it_was(tiny_model, tmp_path, monkeypatch):
    from accelerate.utils import modeling, other
    from trl import GRPOTrainer

    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    pings = []
    monkeypatch.setattr(GRPOTrainer, "_send_telemetry", lambda self: pings.append(self.state.global_step))
    checks = (other.has_compiled_regions, modeling.is_peft_available)
    config = trial_config(tiny_model)
    plan = ChunkPlan.build(4, 2, seed=0)
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.grpo), prompts_dataset(4), ModelPool("cpu"), tmp_path)
    runner.train_chunk()
    runner.train_chunk()
    assert runner.global_step == 4
    assert len(pings) == 1  # one training run for TRL's usage counts, not one per chunk
    assert (other.has_compiled_regions, modeling.is_peft_available) == checks  # answered once per chunk, then put back
