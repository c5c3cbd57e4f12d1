"""The engine's central invariant: training in chunks, with other trials swapped in between, gives
exactly the weights of training straight through with plain TRL (bit-identical on the CPU)."""

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOTrainer

from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.training.models import ModelPool
from rfopt.training.runner import TrialRunner
from rfopt_testkit import lora_config, prompts_dataset, reward_vowels, trial_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _train_straight_through(model_path, config, plan, schedule, dataset):
    """What a user does without rfopt: one GRPOTrainer over the trial's data, in the plan's order."""
    rows = [row for unit in range(plan.num_chunks) for row in plan.chunks[unit][: schedule.prompts_per_chunk]]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    args = config.args
    args.shuffle_dataset = False
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        reward_funcs=list(config.reward_funcs),
        args=args,
        train_dataset=dataset.select(rows),
        processing_class=tokenizer,
        peft_config=config.peft_config,
    )
    trainer.train()
    assert trainer.state.global_step == schedule.total_steps
    return get_peft_model_state_dict(trainer.model)


def _train_interleaved(config, other, plan, dataset, workdir):
    """rfopt's way: chunk by chunk, alternating with another trial on the same resident base model. The pool's
    precision is the one plain TRL trains the config with (rfopt takes it from the device, not from the config)."""
    pool = ModelPool("cpu", precision="bf16" if config.args.bf16 else "fp32")
    runners = [
        TrialRunner(number, cfg, plan, trial_schedule(plan, cfg.args), dataset, pool, workdir)
        for number, cfg in ((0, other), (1, config))
    ]
    while not all(r.finished for r in runners):
        for runner in runners:
            if not runner.finished:
                runner.train_chunk()
    return runners[1].trainable_weights()


@pytest.mark.parametrize(
    "grpo",
    [
        pytest.param(
            dict(gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=0.25, beta=0.0),
            id="grad-accum-2-warmup-cosine",
        ),
        pytest.param(dict(gradient_accumulation_steps=2, beta=0.04, lr_scheduler_type="cosine", warmup_steps=0.25),
                     id="beta-0.04"),
        pytest.param(dict(num_train_epochs=2, lora_dropout=True), id="two-epochs-lora-dropout"),
        pytest.param(dict(num_iterations=2, steps_per_generation=2), id="num-iterations-2"),
        # Mixed precision: accelerate wraps the model's forward in autocast when it prepares it.
        pytest.param(dict(bf16=True, gradient_accumulation_steps=2), id="bf16-autocast"),
        # The trainer turns gradient checkpointing on for this trial only; it is turned off again for the other.
        pytest.param(dict(gradient_checkpointing=True), id="gradient-checkpointing"),
        # The other trial's trainer zeroes every dropout of the shared model; this trial's LoRA dropout comes back.
        pytest.param(dict(lora_dropout=True, other=dict(disable_dropout=True)), id="neighbour-disables-dropout"),
    ],
)
def test_chunked_training_with_swaps_equals_straight_through(tiny_model, tmp_path, grpo):
    grpo = dict(grpo)
    dropout = 0.1 if grpo.pop("lora_dropout", False) else 0.0
    other_grpo = grpo.pop("other", {})
    dataset = prompts_dataset(32)
    config = trial_config(tiny_model, peft=lora_config(lora_dropout=dropout), **grpo)
    other = trial_config(
        tiny_model,
        rewards=[reward_vowels],
        peft=lora_config(r=8, target_modules=["q_proj", "k_proj"]),
        learning_rate=1e-3,
        seed=3,
        **other_grpo,
    )
    plan = ChunkPlan.build(len(dataset), num_chunks=4, seed=0)
    chunked = _train_interleaved(config, other, plan, dataset, tmp_path)
    straight = _train_straight_through(str(tiny_model), config, plan, trial_schedule(plan, config.args), dataset)

    assert chunked.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(chunked[key], value), f"{key} differs by {(chunked[key] - value).abs().max()}"
    # The adapter really trained (LoRA B starts at zero).
    assert any(v.abs().sum() > 0 for k, v in chunked.items() if "lora_B" in k)


def test_restored_checkpoint_continues_exactly(tiny_model, tmp_path):
    """A trial saved to disk after chunk 1 and loaded into a fresh pool ends where the uninterrupted one ends."""
    from rfopt.storage.checkpoints import CheckpointStore

    dataset = prompts_dataset(32)
    config = trial_config(tiny_model, gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=0.25)
    plan = ChunkPlan.build(len(dataset), num_chunks=4, seed=0)
    schedule = trial_schedule(plan, config.args)

    straight = TrialRunner(0, config, plan, schedule, dataset, ModelPool("cpu"), tmp_path)
    while not straight.finished:
        straight.train_chunk()

    first = TrialRunner(0, config, plan, schedule, dataset, ModelPool("cpu"), tmp_path)
    first.train_chunk()
    first.train_chunk()
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(0, first.state())
    resumed = TrialRunner(0, config, plan, schedule, dataset, ModelPool("cpu"), tmp_path)
    resumed.load_state(store.load(0))
    assert resumed.units_done == 2
    while not resumed.finished:
        resumed.train_chunk()

    expected, got = straight.trainable_weights(), resumed.trainable_weights()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_full_fine_tuning_in_chunks_equals_straight_through(tiny_model, tmp_path):
    dataset = prompts_dataset(16)
    config = trial_config(tiny_model, gradient_accumulation_steps=2, learning_rate=1e-3)
    config.peft_config = None
    plan = ChunkPlan.build(len(dataset), num_chunks=2, seed=0)
    schedule = trial_schedule(plan, config.args)
    runner = TrialRunner(0, config, plan, schedule, dataset, ModelPool("cpu"), tmp_path)
    while not runner.finished:
        runner.train_chunk()
    chunked = runner.trainable_weights()

    rows = [row for unit in range(plan.num_chunks) for row in plan.chunks[unit][: schedule.prompts_per_chunk]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    config.args.shuffle_dataset = False
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model),
        reward_funcs=list(config.reward_funcs),
        args=config.args,
        train_dataset=dataset.select(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    straight = trainer.model.state_dict()
    assert chunked.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(chunked[key], value), key
    assert not torch.equal(chunked["model.embed_tokens.weight"], AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()["model.embed_tokens.weight"])
