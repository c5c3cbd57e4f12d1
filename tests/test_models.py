"""The model pool: shared base models, and the GC freeze that keeps per-chunk trainer construction cheap."""

import gc
import weakref

import pytest

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

    import accelerate
    import transformers.trainer

    import trl.trainer.grpo_trainer as grpo_trainer

    pings = []
    monkeypatch.setattr(GRPOTrainer, "_send_telemetry", lambda self: pings.append(self.state.global_step))
    seeds = []

    def counted(set_seed):
        def seeding(*args, **kwargs):
            seeds.append(args)
            return set_seed(*args, **kwargs)

        return seeding

    for module in (transformers.trainer, grpo_trainer):
        monkeypatch.setattr(module, "set_seed", counted(module.set_seed))
    checks = (other.has_compiled_regions, modeling.is_peft_available, accelerate.Accelerator.verify_device_map,
              transformers.trainer.get_model_param_count, transformers.trainer.set_seed, grpo_trainer.set_seed)
    config = trial_config(tiny_model)
    plan = ChunkPlan.build(4, 2, seed=0)
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.grpo), prompts_dataset(4), ModelPool("cpu"), tmp_path)
    runner.train_chunk()
    assert seeds and all(args[0] == config.grpo.seed for args in seeds)  # the first chunk seeds as TRL does
    seeded = len(seeds)
    runner.train_chunk()
    assert len(seeds) == seeded  # a later chunk restores the trial's own RNG instead
    assert runner.global_step == 4
    assert len(pings) == 1  # one training run for TRL's usage counts, not one per chunk
    # Answered from the pool's record during a chunk, then put back.
    assert (other.has_compiled_regions, modeling.is_peft_available, accelerate.Accelerator.verify_device_map,
            transformers.trainer.get_model_param_count, transformers.trainer.set_seed, grpo_trainer.set_seed) == checks


def test_the_trials_of_a_study_share_each_chunk_selection_of_their_dataset():
    from rfopt.runner import _rows_of
    from rfopt_testkit import prompts_dataset

    train, other = prompts_dataset(6), prompts_dataset(6, prefix="R")
    chunk = _rows_of(train, [4, 1, 3])
    assert _rows_of(train, [4, 1, 3]) is chunk  # selected once, whichever trial asks
    assert chunk["prompt"] == [train[4]["prompt"], train[1]["prompt"], train[3]["prompt"]]
    assert _rows_of(other, [4, 1, 3])["prompt"][0].startswith("R4")  # per dataset, not per rows
    assert _rows_of(train, [4, 1])["prompt"] == chunk["prompt"][:2]
    held = weakref.ref(chunk)
    del train, chunk
    gc.collect()
    assert held() is None  # the selections go with their dataset


def test_a_finished_full_fine_tuning_trial_frees_its_model_copy(tiny_model, tmp_path):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    config = trial_config(tiny_model)
    config.peft = None
    plan = ChunkPlan.build(4, 2, seed=0)
    pool = ModelPool("cpu")
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.grpo), prompts_dataset(4), pool, tmp_path)
    runner.train_chunk()
    copy = weakref.ref(runner.model)
    assert pool.answers(runner.model)  # answers about the copy were recorded during the chunk
    runner.cleanup()
    gc.collect()
    assert copy() is None  # the pool's record of answers does not keep the copy alive


def _adapter_state(model):
    """Which parameters train, and which adapter each adapter layer runs."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return (
        {name: p.requires_grad for name, p in model.named_parameters()},
        [tuple(m.active_adapters) for m in model.modules() if isinstance(m, BaseTunerLayer)],
        model.active_adapter,
    )


def test_activating_a_trial_sets_the_same_adapter_state_as_peft_set_adapter(tiny_model):
    from rfopt.models import adapter_name
    from rfopt_testkit import lora_config

    pool = ModelPool("cpu")
    configs = {
        0: trial_config(tiny_model),
        1: trial_config(tiny_model, peft=lora_config(r=8, target_modules=["q_proj", "k_proj"])),
        2: trial_config(tiny_model, peft=lora_config(target_modules=["o_proj"])),
    }
    for number, config in configs.items():
        pool.acquire(number, config)

    def check_each(numbers):
        states = []
        for number in numbers:
            model = pool.activate(number, configs[number])
            ModelPool._show_all(pool._resident[configs[number].model_key])  # compare every adapter, hidden ones too
            ours = _adapter_state(model)
            model.set_adapter(adapter_name(number))  # PEFT's own walk over every module
            assert ours == _adapter_state(model)
            states.append(ours)
        assert len({str(s) for s in states}) == len(set(numbers))  # each trial really has its own adapter switched on

    check_each([0, 1, 2, 1, 0])
    pool.release(1, configs[1])  # the adapter layers change: the listed walk is made again
    check_each([2, 0])


def _seen(model):
    """What a trainer's walks over `model` see: its parameters (name, shape, trainable), and the adapters its modules
    hold. A layer that another trial's adapter targets is wrapped on the shared model (its weight is then named
    ``...base_layer.weight``), so names are compared without the wrapper."""
    import re

    parameters = [(n.replace(".base_layer", ""), tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    return parameters, {m.group(0) for n, _ in model.named_modules() if (m := re.search(r"trial-\d+", n))}


def test_the_trial_in_training_sees_the_shared_model_as_if_its_adapter_were_the_only_one(tiny_model):
    """The other trials' adapters are hidden from the model's walks (zero_grad, gradient clipping, ...) while one
    trains, and come back untouched: same weights, same output, whatever was added or released meanwhile."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from rfopt.models import adapter_name
    from rfopt_testkit import lora_config

    configs = {
        0: trial_config(tiny_model),
        # An embedding adapter (PEFT keeps it in a ParameterDict) and dropout modules.
        1: trial_config(tiny_model, peft=lora_config(r=8, target_modules=["q_proj", "k_proj", "embed_tokens"], lora_dropout=0.1)),
        2: trial_config(tiny_model, peft=lora_config(target_modules=["o_proj"])),
        3: trial_config(tiny_model, peft=lora_config(r=2)),
    }
    inputs = torch.tensor([[1, 5, 9, 2, 7]])
    alone, outputs = {}, {}
    for number, config in configs.items():
        solo = ModelPool("cpu")
        model = solo.acquire(number, config)
        for name, p in model.named_parameters():
            if p.requires_grad:  # distinct non-zero weights, so every adapter changes the output
                with torch.no_grad():
                    p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape) * (number + 1))
        model.eval()
        alone[number] = (_seen(model), get_peft_model_state_dict(model, adapter_name=adapter_name(number)))
        outputs[number] = model(inputs).logits
        solo.close()

    pool = ModelPool("cpu")

    def check(numbers):
        for number in numbers:
            model = pool.activate(number, configs[number])
            seen, weights = alone[number]
            assert _seen(model) == seen
            ours = get_peft_model_state_dict(model, adapter_name=adapter_name(number))
            assert ours.keys() == weights.keys() and all(torch.equal(ours[k], weights[k]) for k in weights)
            assert torch.equal(model(inputs).logits, outputs[number])

    for number in (0, 1, 2):
        model = pool.acquire(number, configs[number])
        set_peft_model_state_dict(model, alone[number][1], adapter_name=adapter_name(number))
    model.eval()
    check([0, 0, 1, 2, 2, 1, 0, 2])  # activating the trial in view again is a no-op that keeps it right
    pool.release(1, configs[1])
    pool.acquire(3, configs[3])  # added while trial 3's neighbours were hidden from view
    set_peft_model_state_dict(pool.activate(3, configs[3]), alone[3][1], adapter_name=adapter_name(3))
    check([0, 3, 2, 0])


def test_the_adapter_left_after_a_release_follows_the_model_train_eval_mode(tiny_model):
    """A hidden adapter misses train()/eval(); once it is the only one left it is never hidden again, so the release
    that leaves it alone must bring its modules into the model's mode."""
    from rfopt_testkit import lora_config

    configs = {0: trial_config(tiny_model, peft=lora_config(lora_dropout=0.1)), 1: trial_config(tiny_model)}
    pool = ModelPool("cpu")
    for number, config in configs.items():
        model = pool.acquire(number, config)
    model.train()
    model.eval()  # trial 1 in view: trial 0's dropout modules stay in training mode
    pool.release(1, configs[1])
    model = pool.activate(0, configs[0])
    assert not model.training
    assert [name for name, m in model.named_modules() if m.training] == []


def test_a_released_adapter_is_freed_although_adapters_are_frozen_out_of_the_gc(tiny_model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from rfopt_testkit import lora_config

    gc.unfreeze()
    pool = ModelPool("cpu")
    pool.acquire(0, trial_config(tiny_model))
    frozen = gc.get_freeze_count()
    second = trial_config(tiny_model, peft=lora_config(target_modules=["o_proj"]))
    model = pool.acquire(1, second)
    assert gc.get_freeze_count() > frozen  # the new adapter's modules are skipped by per-chunk collections
    layers = [weakref.ref(m.lora_A["trial-1"]) for m in model.modules() if isinstance(m, BaseTunerLayer) and "trial-1" in m.lora_A]
    assert layers
    pool.release(1, second)
    gc.collect()
    assert all(ref() is None for ref in layers)  # frozen, yet freed: nothing of a finished trial's adapter lingers
    pool.close()


def test_a_trial_with_gradient_checkpointing_leaves_the_shared_model_without_it(tiny_model, tmp_path):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    config = trial_config(tiny_model, gradient_checkpointing=True)
    plan = ChunkPlan.build(4, 2, seed=0)
    pool = ModelPool("cpu")
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.grpo), prompts_dataset(4), pool, tmp_path)
    runner.train_chunk()
    base = runner.model.get_base_model()
    assert not base.is_gradient_checkpointing
    assert getattr(base, "_require_grads_hook", None) is None


def test_a_pool_on_a_cuda_device_makes_it_the_process_current_device(monkeypatch):
    """accelerate puts a single process's work on the current CUDA device; a pool on cuda:1 must make that cuda:1.
    (No GPU here: torch.cuda is stood in for; the call rfopt makes is what is checked.)"""
    import torch

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.append(index))
    assert ModelPool("cuda:1").device == "cuda:1"
    assert current == [1]
    ModelPool("cuda")  # the current device, whichever it is: nothing to change
    assert current == [1]
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        ModelPool("cuda:2")


def test_a_cuda_worker_on_a_machine_without_cuda_stops_with_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda:0': CUDA is not available here .*; train on 'cpu' instead"):
        ModelPool("cuda:0")
    with pytest.raises(ValueError, match=r"device 'tpu:0': not a device torch knows"):
        ModelPool("tpu:0")
