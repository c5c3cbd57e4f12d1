"""One gate, before training, decides what a trial trains as: what generation refuses is refused up front (alone and
in a gang alike), and what the batched backend cannot serve trains alone (`RolloutBackend.refusal`, asked by the
planner), never failing at its first rollout and never silently trained as something else."""

import copy

import pytest
import rfopt
import torch
from rfopt.errors import ConfigError
from rfopt.storage import schema
from rfopt.training.models import ModelPool, owns_base
from rfopt.training.rollouts import BATCHED, Sampling, model_refusal
from rfopt.training.rollouts.backend import data_dependent_rope
from rfopt_testkit import lora_config, prompts_dataset, trial_config
from transformers import AutoModelForCausalLM, GenerationConfig


@pytest.fixture(scope="module")
def gate(tiny_model):
    """The one gate (`RolloutBackend.refusal`) of the backend a gang of the tiny model would use: its pool's batched
    backend, built on the base model before any adapter is on it, as the planner asks it."""
    pool = ModelPool("cpu")
    config = trial_config(tiny_model)
    return pool.backend(BATCHED, None, config).refusal


def _study(tmp_path, name):
    return rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'gates.db'}", num_chunks=2,
                              checkpoint_dir=tmp_path / name)


@pytest.mark.parametrize("gang_size", [1, 4])
def test_temperature_zero_is_refused_up_front_whether_in_args_or_generation_kwargs(scripted, tiny_model, tmp_path,
                                                                                  gang_size):
    for n, config in enumerate([trial_config(tiny_model, temperature=0.0),
                                trial_config(tiny_model, generation_kwargs={"temperature": 0.0})]):
        study = _study(tmp_path, f"t{gang_size}{n}")
        with pytest.raises(ConfigError, match="temperature.*strictly positive"):
            study.optimize([trial_config(tiny_model), config], prompts_dataset(8), prompts_dataset(2, "E"),
                           gang_size=gang_size, show_progress_bar=False)
        assert study.trials == []  # refused before anything was stored


def test_the_sampler_never_samples_at_a_temperature_it_was_not_given(tiny_model):
    with pytest.raises(ValueError, match="temperature=0.0 with do_sample=True"):
        Sampling(max_new_tokens=4, eos_token_ids=(1,), pad_token_id=0, temperature=0.0)
    # Greedy, asked through generation_kwargs, is what the gang's sampler decodes (and what the config check accepts).
    config = trial_config(tiny_model, generation_kwargs={"temperature": 0.0, "do_sample": False})
    config.validate(check_code=False)
    args = config.args
    merged = {"max_new_tokens": args.max_completion_length, "do_sample": True, "temperature": args.temperature,
              **args.generation_kwargs}  # as GRPOTrainer merges them
    sampling = Sampling.of(GenerationConfig(**merged))
    assert sampling.do_sample is False


def test_trainable_token_indices_train_alone(tiny_model, gate):
    why = gate(trial_config(tiny_model, peft=lora_config(trainable_token_indices=[3, 5])))
    assert "trainable_token_indices" in why


@pytest.mark.parametrize("overrides, named", [
    (dict(alora_invocation_tokens=[5], task_type="CAUSAL_LM"), "alora_invocation_tokens"),
    (dict(init_lora_weights="mica"), "init_lora_weights='mica'"),
    (dict(use_dora=True), "DoRA"),
])
def test_lora_variants_the_bank_cannot_serve_are_refused_by_the_gate_before_training(tiny_model, gate, overrides,
                                                                                      named):
    assert named in gate(trial_config(tiny_model, peft=lora_config(**overrides)))


def test_a_lora_variant_trains_alone_beside_a_gang_and_completes(scripted, tiny_model, tmp_path):
    variant = trial_config(tiny_model, peft=lora_config(alora_invocation_tokens=[5], task_type="CAUSAL_LM"))
    study = _study(tmp_path, "variant")
    study.optimize([trial_config(tiny_model), trial_config(tiny_model, learning_rate=5e-3), variant],
                   prompts_dataset(8), prompts_dataset(2, "E"), gang_size=4, show_progress_bar=False)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert schema.gang_plan(study.trials[0], 0).numbers == (0, 1)
    assert schema.gang_plan(study.trials[2], 0) is None  # alone, on the exact backend


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_that_rewrites_its_base_gets_a_base_of_its_own_and_changes_no_other_trial(tiny_model, gate, init):
    plain = trial_config(tiny_model, peft=lora_config(init_lora_weights=False))
    rewriting = trial_config(tiny_model, peft=lora_config(init_lora_weights=init))
    assert owns_base(rewriting) and not owns_base(plain)
    assert "base model of its own" in gate(rewriting)
    pool = ModelPool("cpu")
    ids = torch.tensor([[1, 5, 7, 9]])
    shared = pool.acquire(0, plain)
    base = {k: v.clone() for k, v in shared.get_base_model().state_dict().items() if "lora" not in k}
    with torch.no_grad():
        before = shared(input_ids=ids).logits
    own = pool.acquire(1, rewriting)
    assert own is not shared
    after_base = {k: v for k, v in pool.activate(0, plain).get_base_model().state_dict().items() if "lora" not in k}
    assert all(torch.equal(base[k], after_base[k]) for k in base)  # the shared base as loaded
    with torch.no_grad():
        assert torch.equal(pool.activate(0, plain)(input_ids=ids).logits, before)
    pool.release(1, rewriting)
    pool.release(0, plain)


def test_a_rope_that_branches_on_the_data_is_refused_for_a_captured_step_and_decoded_eagerly(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert data_dependent_rope(model.config) is None and model_refusal(model, "graph") is None
    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.config = config
    assert data_dependent_rope(config) == "dynamic"
    assert "dynamic" in model_refusal(model, "graph") and "RFOPT_DECODE=eager" in model_refusal(model, "compiled")
    assert model_refusal(model, "eager") is None
