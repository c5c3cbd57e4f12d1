"""TrialConfig: validation, JSON round-trip (rewards by import path), overrides."""

import json

import pytest
from transformers import BitsAndBytesConfig

from rfopt import rewards
import rfopt
from rfopt.config.trial import ConfigError, import_path, resolve_import
from rfopt_testkit import grpo_config, lora_config, reward_len


def _config(**kwargs):
    settings = dict(
        model="some/model",
        reward_funcs=[reward_len, rewards.correctness, rewards.soft_overlong_punishment(64, 16)],
        args=grpo_config(gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=0.1, beta=0.04,
                         reward_weights=[1.0, 2.0, 0.5], model_init_kwargs={"dtype": "float32"}),
        peft_config=lora_config(r=16, target_modules=["q_proj", "k_proj", "v_proj"]),
    )
    settings.update(kwargs)
    return rfopt.TrialConfig(**settings)


def test_config_round_trips_through_json_with_rewards_by_import_path():
    config = _config()
    data = json.loads(config.to_json())
    assert data["reward_funcs"][0] == "rfopt_testkit:reward_len"
    assert data["reward_funcs"][1] == "rfopt.rewards.answers:correctness"
    assert data["reward_funcs"][2]["kwargs"] == {"max_completion_length": 64, "soft_punish_cache": 16}
    again = rfopt.TrialConfig.from_json(config.to_json())
    assert again.to_json() == config.to_json()
    assert again.reward_funcs[0] is reward_len
    assert again.args.learning_rate == config.args.learning_rate
    assert again.args.gradient_accumulation_steps == 2
    assert again.args.steps_per_generation == config.args.steps_per_generation
    assert again.args.beta == 0.04
    assert sorted(again.peft_config.target_modules) == ["k_proj", "q_proj", "v_proj"]
    assert again.args.reward_weights == [1.0, 2.0, 0.5]
    assert again.args.model_init_kwargs == {"dtype": "float32"}


def test_full_fine_tuning_and_quantization_round_trip():
    config = _config(peft_config=None)
    assert rfopt.TrialConfig.from_json(config.to_json()).peft_config is None
    q = _config(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    again = rfopt.TrialConfig.from_json(q.to_json())
    assert again.quantization_config.load_in_4bit and again.quantization_config.bnb_4bit_quant_type == "nf4"


def test_quantization_without_an_adapter_is_refused():
    with pytest.raises(ConfigError, match="quantization_config.*PEFT adapter"):
        _config(peft_config=None, quantization_config=BitsAndBytesConfig(load_in_4bit=True)).validate()


def test_validation_names_every_problem_at_once():
    config = _config(reward_funcs=[], args=grpo_config(reward_weights=[1.0]))
    config.args.use_vllm = True
    with pytest.raises(ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert "args.use_vllm" in message and "reward_funcs: empty" in message and "args.reward_weights" in message


def test_unimportable_reward_is_refused_with_a_fix():
    with pytest.raises(ConfigError, match="lambda or a nested function"):
        _config(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=grpo_config()).to_json()
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_import("no_such_module_xyz:f")


def test_functions_defined_in_a_file_are_stored_by_path(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def shout(completions, **kw):\n    return [1.0 for _ in completions]\n")
    func = resolve_import(f"{module}:shout")
    assert import_path(func) == f"{module.resolve()}:shout"
    assert resolve_import(import_path(func)) is func


def test_overrides_change_grpo_and_lora_fields_and_are_validated():
    config = _config()
    changed = config.with_overrides({"learning_rate": 2e-6, "lora_r": 8, "peft_config.lora_alpha": 32,
                                     "args.beta": 0.0})
    assert changed.args.learning_rate == 2e-6 and changed.peft_config.r == 8 and changed.peft_config.lora_alpha == 32
    assert changed.args.beta == 0.0
    assert config.args.learning_rate != 2e-6  # the original is untouched
    with pytest.raises(ConfigError, match="unknown field"):
        config.with_overrides({"learning_rat": 1e-5})
    with pytest.raises(ConfigError, match="expected a number"):
        config.with_overrides({"learning_rate": "fast"})
    with pytest.raises(ConfigError, match="invalid config.*num_generations"):
        config.with_overrides({"num_generations": 3})
    with pytest.raises(ConfigError, match="sets output_dir itself"):
        config.with_overrides({"output_dir": "/tmp/x"})
    with pytest.raises(ConfigError, match="no PEFT adapter"):
        _config(peft_config=None).with_overrides({"lora_r": 8})


def test_overriding_the_batch_shape_rederives_the_generation_batch():
    config = _config()
    changed = config.with_overrides({"gradient_accumulation_steps": 4})
    assert changed.args.steps_per_generation == 4
    assert changed.args.generation_batch_size == 16


def test_a_stored_config_says_nothing_of_the_machine_and_loads_on_any(tiny_model):
    """use_cpu, bf16 and fp16 are the device's (rfopt.training.models.Placement): not stored, and a config stored with bf16
    (by an older rfopt, on a GPU) still loads on this CPU-only machine."""
    from rfopt_testkit import trial_config

    config = trial_config(tiny_model)  # use_cpu=True, bf16=False
    stored = json.loads(config.to_json())
    assert not {"use_cpu", "bf16", "fp16"} & set(stored["args"])
    stored["args"]["bf16"] = True
    loaded = rfopt.TrialConfig.from_dict(stored)
    assert loaded.args.learning_rate == config.args.learning_rate and not loaded.args.bf16


def test_the_model_key_picks_what_base_model_of_picks_from_the_stored_config():
    """`model_key` reads the config (it is called at every swap); ops compare stored dicts with `base_model_of`."""
    for config in (_config(), _config(args=grpo_config(model_init_kwargs={"dtype": "bfloat16"}, trust_remote_code=True)),
                   _config(quantization_config=BitsAndBytesConfig(load_in_4bit=True), processing_class="some/tokenizer")):
        assert json.loads(config.model_key) == rfopt.TrialConfig.base_model_of(config.to_dict())


@pytest.mark.parametrize(("field", "value", "says"), [
    ("reward_funcs", None, r"reward_funcs: got NoneType None; give a reward function, a 'module:function' path, or a "
                           r"list of them"),
    ("reward_funcs", {"len": reward_len}, r"reward_funcs: got dict \{'len': <function reward_len"),
    ("callbacks", 5, r"callbacks: got int 5; give a list of transformers.TrainerCallback classes or instances"),
    ("callbacks", "MyCallback", r"callbacks: got str 'MyCallback'; give a list of transformers.TrainerCallback"),
    ("quantization_config", "4bit", r"quantization_config: got str '4bit'; give a transformers.BitsAndBytesConfig "
                                    r"\(e.g. BitsAndBytesConfig\(load_in_4bit=True\)\), its dict, or None"),
    ("args", {"learning_rate": 1e-3}, r"args: got dict .*; give a trl.GRPOConfig"),
    ("peft_config", "lora", r"peft_config: got str 'lora'; give a peft.LoraConfig"),
    ("model", 123, r"model: got int 123; give a Hub id or a local directory"),
])
def test_a_wrong_type_in_a_trial_config_is_refused_naming_the_field_and_what_to_give(field, value, says):
    with pytest.raises(ConfigError, match=says):
        config = _config(**{field: value})
        config.validate()
        config.to_json()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("reward_funcs", [42], r"reward_funcs\[0\]: got int 42; give a reward function with TRL's signature"),
    ("reward_funcs", [reward_len, None], r"reward_funcs\[1\]: got NoneType None; give a reward function"),
    ("model", 123, r"model: got int 123; give a Hub id or a local directory \(a string\), 'smollm2', or a top-level "
                   r"function returning \(model, tokenizer\)"),
    ("args", {"learning_rate": 1e-3}, r"args: got dict \{'learning_rate': 0.001\}; give a trl.GRPOConfig, as "
                                      r"GRPOTrainer takes it \(GRPOConfig\(\*\*your_dict\) makes one of a dict\)"),
    ("peft_config", {"r": 4}, r"peft_config: got dict \{'r': 4\}; give a peft.LoraConfig"),
])
def test_a_wrong_type_is_refused_where_the_config_is_made_naming_the_field_and_the_type(field, value, says):
    """Issue 35: ``reward_funcs=[42]`` and ``model=123`` got "cannot be stored by import path (a lambda or a nested
    function)" when stored; ``args=dict(...)`` a raw AttributeError."""
    with pytest.raises(ConfigError, match=says):
        _config(**{field: value})


def test_names_that_moved_out_of_the_config_module_are_importable_from_it_as_before():
    """rfopt.config was split by tenant (rfopt.config.codec, rfopt.config.overrides, rfopt.config.usercode); what it offered stays."""
    import rfopt.config.codec
    import rfopt.config.trial
    import rfopt.errors
    import rfopt.config.overrides
    import rfopt.config.usercode

    moved = {rfopt.config.codec: ["PLACEMENT_FIELDS", "PLUMBING_FIELDS", "TokenizerSpec", "callback_from_json",
                           "callback_to_json", "current_layout", "grpo_default", "grpo_to_dict", "instance_from_json",
                           "instance_to_json", "reward_from_json", "reward_to_json"],
             rfopt.config.overrides: ["override_dict", "parse_assignments", "typed_value"],
             rfopt.config.usercode: ["import_path", "importing_user_file", "load_file_module", "resolve_import",
                              "study_on_import"],
             rfopt.errors: ["ConfigError"]}
    for module, names in moved.items():
        for name in names:
            assert getattr(rfopt.config, name) is getattr(module, name), name
    assert {"TrialConfig", "UNSUPPORTED_TRAINER_ARGUMENTS", "check_model", "check_training_values"} <= set(
        rfopt.config.__all__)
