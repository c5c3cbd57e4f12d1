"""The model pool: shared base models with one adapter per trial, and where and in what precision they train."""

import gc
import weakref

import pytest

from rfopt.training.models import ModelPool
from rfopt_testkit import trial_config


@pytest.mark.e2e
def test_a_trial_trained_in_chunks_sends_trl_telemetry_once(tiny_model, tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.training.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    pings = []
    monkeypatch.setattr(GRPOTrainer, "_send_telemetry", lambda self: pings.append(self.state.global_step))
    config = trial_config(tiny_model)
    plan = ChunkPlan.build(4, 2, seed=0)
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), prompts_dataset(4), ModelPool("cpu"), tmp_path)
    runner.train_chunk()
    runner.train_chunk()
    assert runner.global_step == 4
    assert len(pings) == 1  # one training run for TRL's usage counts, not one per chunk


def test_the_trials_of_a_study_share_each_chunk_selection_of_their_dataset():
    from rfopt.training.runner import _rows_of
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


@pytest.mark.e2e
def test_a_finished_full_fine_tuning_trial_frees_its_model_copy(tiny_model, tmp_path):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.training.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    config = trial_config(tiny_model)
    config.peft_config = None
    plan = ChunkPlan.build(4, 2, seed=0)
    pool = ModelPool("cpu")
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), prompts_dataset(4), pool, tmp_path)
    runner.train_chunk()
    copy = weakref.ref(runner.model)
    runner.cleanup()
    gc.collect()
    assert copy() is None


def _adapter_state(model):
    """Which parameters train, and which adapter each adapter layer runs."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return (
        {name: p.requires_grad for name, p in model.named_parameters()},
        [tuple(m.active_adapters) for m in model.modules() if isinstance(m, BaseTunerLayer)],
        model.active_adapter,
    )


def test_activating_a_trial_makes_its_adapter_the_only_active_and_trainable_one(tiny_model):
    from rfopt.training.models import adapter_name
    from rfopt_testkit import lora_config

    pool = ModelPool("cpu")
    configs = {
        0: trial_config(tiny_model),
        1: trial_config(tiny_model, peft=lora_config(r=8, target_modules=["q_proj", "k_proj"])),
        2: trial_config(tiny_model, peft=lora_config(target_modules=["o_proj"])),
    }
    for number, config in configs.items():
        pool.acquire(number, config)
    for number in [0, 1, 2, 1, 0]:
        model = pool.activate(number, configs[number])
        assert model.active_adapter == adapter_name(number)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(f".{adapter_name(number)}." in n for n in trainable)


def test_each_trial_on_the_shared_model_keeps_its_own_weights_and_output_through_adds_and_releases(tiny_model):
    """An adapter active on the shared model gives the output it gives alone on the base model, with the same
    weights, whatever other trials' adapters were added or released meanwhile."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from rfopt.training.models import adapter_name
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
        for _name, p in model.named_parameters():
            if p.requires_grad:  # distinct non-zero weights, so every adapter changes the output
                with torch.no_grad():
                    p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape) * (number + 1))
        model.eval()
        alone[number] = get_peft_model_state_dict(model, adapter_name=adapter_name(number))
        outputs[number] = model(inputs).logits
        solo.close()

    pool = ModelPool("cpu")

    def check(numbers):
        for number in numbers:
            model = pool.activate(number, configs[number])
            weights = alone[number]
            ours = get_peft_model_state_dict(model, adapter_name=adapter_name(number))
            assert ours.keys() == weights.keys() and all(torch.equal(ours[k], weights[k]) for k in weights)
            assert torch.equal(model(inputs).logits, outputs[number])

    for number in (0, 1, 2):
        model = pool.acquire(number, configs[number])
        set_peft_model_state_dict(model, alone[number], adapter_name=adapter_name(number))
    model.eval()
    check([0, 0, 1, 2, 2, 1, 0, 2])
    pool.release(1, configs[1])
    pool.acquire(3, configs[3])
    set_peft_model_state_dict(pool.activate(3, configs[3]), alone[3], adapter_name=adapter_name(3))
    check([0, 3, 2, 0])


def test_the_adapter_left_after_a_release_follows_the_model_train_eval_mode(tiny_model):
    from rfopt_testkit import lora_config

    configs = {0: trial_config(tiny_model, peft=lora_config(lora_dropout=0.1)), 1: trial_config(tiny_model)}
    pool = ModelPool("cpu")
    for number, config in configs.items():
        model = pool.acquire(number, config)
    model.train()
    model.eval()
    pool.release(1, configs[1])
    model = pool.activate(0, configs[0])
    assert not model.training
    assert [name for name, m in model.named_modules() if m.training] == []


def test_a_released_adapter_is_freed(tiny_model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from rfopt_testkit import lora_config

    pool = ModelPool("cpu")
    pool.acquire(0, trial_config(tiny_model))
    second = trial_config(tiny_model, peft=lora_config(target_modules=["o_proj"]))
    model = pool.acquire(1, second)
    layers = [weakref.ref(m.lora_A["trial-1"]) for m in model.modules() if isinstance(m, BaseTunerLayer) and "trial-1" in m.lora_A]
    assert layers
    pool.release(1, second)
    gc.collect()
    assert all(ref() is None for ref in layers)  # nothing of a finished trial's adapter lingers
    pool.close()


@pytest.mark.e2e
def test_a_trial_with_gradient_checkpointing_leaves_the_shared_model_without_it(tiny_model, tmp_path):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.training.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    config = trial_config(tiny_model, gradient_checkpointing=True)
    plan = ChunkPlan.build(4, 2, seed=0)
    pool = ModelPool("cpu")
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), prompts_dataset(4), pool, tmp_path)
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


def _stand_in_cuda(monkeypatch, bf16=True):
    """No GPU here: torch.cuda is stood in for, as on a machine with two GPUs (the calls rfopt makes are checked)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)


def test_the_device_decides_placement_and_precision_whatever_the_config_says(tiny_model, tmp_path, monkeypatch):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.training.models import Placement
    from rfopt.training.runner import TrialRunner
    from rfopt_testkit import prompts_dataset

    plan = ChunkPlan.build(4, 2, seed=0)
    cpu_config = trial_config(tiny_model)  # use_cpu=True, bf16=False, as a study file written for the CPU has it
    assert cpu_config.args.use_cpu and not cpu_config.args.bf16

    def args(pool, config):
        return TrialRunner(0, config, plan, trial_schedule(plan, config.args), prompts_dataset(4), pool,
                           tmp_path).chunk_args()

    on_cpu = args(ModelPool("cpu"), cpu_config)
    assert (on_cpu.use_cpu, on_cpu.bf16, on_cpu.fp16) == (True, False, False)
    _stand_in_cuda(monkeypatch)
    on_gpu = args(ModelPool("cuda:1"), cpu_config)
    assert (on_gpu.use_cpu, on_gpu.bf16, on_gpu.fp16) == (False, True, False)
    assert args(ModelPool("cuda:1", precision="fp32"), cpu_config).bf16 is False
    assert Placement.of("cuda:0", "fp16").fp16 and not Placement.of("cuda:0", "fp16").bf16
    _stand_in_cuda(monkeypatch, bf16=False)
    assert Placement.of("cuda:0") == Placement("cuda:0", use_cpu=False, bf16=False, fp16=False)  # no bf16: fp32
    with pytest.raises(ValueError, match="precision 'fp16' needs a CUDA device"):
        Placement.of("cpu", "fp16")
    with pytest.raises(ValueError, match="precision 'int8': use one of auto, fp32, bf16, fp16"):
        ModelPool("cpu", precision="int8")


def test_a_study_file_written_for_the_cpu_puts_the_shared_model_on_the_cuda_device_it_runs_on(monkeypatch):
    """rfopt/studies/arithmetic.py sets use_cpu=True; run on cuda:1 the shared base model goes to cuda:1 and every chunk
    trains there (no GPU here: the model's move is recorded instead of made)."""
    import torch
    import transformers

    from rfopt import compat
    from rfopt.studies.arithmetic import build_space

    _stand_in_cuda(monkeypatch)
    moved = []

    class Model:
        def to(self, device):
            moved.append(device)
            return self

    class Tokenizer:
        pad_token, eos_token = None, "</s>"

    placed = []

    def create_model(source, **kwargs):
        placed.append(kwargs["device_map"])
        return Model()

    monkeypatch.setattr(compat, "create_model", create_model)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: Tokenizer())
    config = build_space(model="/a/model/dir")[0]
    assert config.args.use_cpu and not config.args.bf16
    pool = ModelPool("cuda:1")
    pool.tokenizer(config)  # loads the base model
    assert placed == [{"": "cuda:1"}] and moved == [torch.device("cuda:1")]
    assert pool.placement.args() == {"use_cpu": False, "bf16": True, "fp16": False}


# ---------------------------------------------------------------------- a full fine-tuning trial beside adapters
def _as_loaded(tiny_model, model):
    """Whether `model` is the tiny model as loaded: its weights, which of them train, its tied LM head, its modules."""
    import torch

    from rfopt.training.loading import load_model

    loaded, _ = load_model(trial_config(tiny_model))
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    changed = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    assert not changed, f"weights changed: {changed}"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in loaded.named_parameters() if p.requires_grad}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as SmolLM2's
    assert [type(m) for m in model.modules()] == [type(m) for m in loaded.modules()]
    assert not hasattr(model, "peft_config")


def _train_adapter_and_its_modules_to_save(pool, tiny_model):
    """Trial 0: a LoRA adapter with ``modules_to_save=["lm_head"]`` (the tiny model ties it to the embeddings), its
    trainable weights changed as a chunk of training would."""
    import torch

    from rfopt_testkit import lora_config

    config = trial_config(tiny_model, peft=lora_config(modules_to_save=["lm_head"]))
    model = pool.acquire(0, config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    return config


def test_a_full_fine_tuning_trial_copies_the_base_as_loaded_never_another_trials_adapter_or_modules_to_save(
        tiny_model):
    pool = ModelPool("cpu")
    _train_adapter_and_its_modules_to_save(pool, tiny_model)
    full = trial_config(tiny_model)
    full.peft_config = None
    _as_loaded(tiny_model, pool.acquire(1, full))


def test_releasing_the_last_adapter_leaves_the_base_as_loaded_without_its_trained_modules_to_save(tiny_model):
    pool = ModelPool("cpu")
    config = _train_adapter_and_its_modules_to_save(pool, tiny_model)
    pool.release(0, config)
    _as_loaded(tiny_model, pool._resident[config.model_key].base)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_study_mixing_modules_to_save_and_full_fine_tuning_trains_the_full_trial_alike_in_either_order(
        tiny_model, tmp_path):
    """Issue 35: the full trial, run after a LoRA trial with ``modules_to_save=["lm_head"]``, copied the shared base
    with that trial's trained LM head in it: it reported the other trial's values, then failed to save."""
    from safetensors.torch import load_file

    import rfopt
    from rfopt.storage.schema import TrialRecord
    from rfopt_testkit import lora_config, prompts_dataset

    full = trial_config(tiny_model, learning_rate=1e-2)
    full.peft_config = None
    lora = trial_config(tiny_model, peft=lora_config(modules_to_save=["lm_head"]), learning_rate=5e-2)

    def run(name, configs):
        study = rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'mix.db'}", num_chunks=2,
                                   checkpoint_dir=tmp_path / name)
        study.optimize(configs, prompts_dataset(4), prompts_dataset(2, "E"), show_progress_bar=False)
        assert [t.state.name for t in study.trials] == ["COMPLETE"] * len(configs), [
            TrialRecord(t).fail_reason for t in study.trials]
        trial = study.trials[configs.index(full)]
        return trial.intermediate_values, load_file(f"{TrialRecord(trial).adapter}/model.safetensors")

    values, weights = run("full-first", [full, lora])  # its copy is made before the LoRA trial trains: as alone
    mixed_values, mixed_weights = run("lora-first", [lora, full])
    assert mixed_values == values
    assert mixed_weights.keys() == weights.keys() and all((mixed_weights[k] == weights[k]).all() for k in weights)


def test_the_adapter_check_on_the_meta_device_refuses_what_peft_refuses_and_not_what_needs_weights(tiny_model):
    """A clone's Check builds its adapter on the model's shape (`check_adapter`): PEFT's refusals (r=0, target modules
    the model lacks) are refused; an initialization that needs the weights (PiSSA) is not the config's fault."""
    from rfopt.errors import ConfigError
    from rfopt.training.loading import check_adapter
    from rfopt_testkit import lora_config

    assert check_adapter(trial_config(tiny_model, peft=lora_config(init_lora_weights="pissa"))) is None
    assert check_adapter(trial_config(tiny_model, peft=lora_config(target_modules="all-linear", use_dora=True))) is None
    with pytest.raises(ConfigError, match="`r` should be a positive integer"):
        check_adapter(trial_config(tiny_model, peft=lora_config(r=0)))
    with pytest.raises(ConfigError, match="Target modules {'nope'} not found"):
        check_adapter(trial_config(tiny_model, peft=lora_config(target_modules=["nope"])))
    assert "the first chunk builds it" in check_adapter(trial_config("no/such-model-here"))


def test_a_gangs_memory_is_estimated_once_and_its_room_decided_by_the_memory_free_at_each_ask(tiny_model, monkeypatch):
    from rfopt.training import models

    estimated = []

    def counted(configs, *args, **kwargs):
        estimated.append([id(c) for c in configs])
        return models.gang_memory.__wrapped__(configs, *args, **kwargs)

    counted.__wrapped__ = models.gang_memory
    monkeypatch.setattr(models, "gang_memory", counted)
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    need = counted.__wrapped__(configs, 20, eval_rows=4).need(2) * models.ROOM_MARGIN
    pool = models.ModelPool("cpu")
    free = {"bytes": need * 2}
    monkeypatch.setattr(models, "free_bytes", lambda device: int(free["bytes"]))

    assert [pool.gang_room(configs, 20, 4).size for _ in range(3)] == [2, 2, 2]
    free["bytes"] = need * 0.9  # the same gang, less memory free now: one member
    assert pool.gang_room(configs, 20, 4).size == 1
    assert len(estimated) == 1
    pool.gang_room(configs[:1] + [trial_config(tiny_model, learning_rate=1e-2)], 20, 4)  # another gang: its own
    pool.gang_room(configs, 30, 4)  # longer prompts
    assert len(estimated) == 3
