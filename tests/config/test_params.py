"""One naming of config fields as Optuna params (`rfopt.config.params`): every name in the table means its field both ways,
and list spaces, clones and overrides agree on it."""

import dataclasses

import optuna
import pytest
import trl
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from rfopt_testkit import lora_config, prompts_dataset, reward_len, reward_vowels, trial_config

import rfopt
from rfopt import TrialConfig
from rfopt.errors import ConfigError
from rfopt.engine.trials import clones
from rfopt.config.overrides import override_dict
from rfopt.config.params import (
    ALIASES,
    OLD_PREFIXES,
    RENAMED,
    admits,
    distribution,
    param_holding,
    field_path,
    fields,
    override_name,
    param_name,
    param_value,
)
from rfopt.storage.schema import TrialRecord
from rfopt.config.spaces import ListSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _grpo_fields():
    from trl import GRPOConfig

    return [f.name for f in dataclasses.fields(GRPOConfig) if f.init]


def test_every_renamed_field_and_its_param_name_each_other():
    for path, name in RENAMED.items():
        assert param_name(path) == name
        assert field_path(name) == path
        assert override_name(path) == name


def test_every_alias_and_old_prefix_names_the_field_whose_param_it_then_gets():
    assert {alias: field_path(alias) for alias in ALIASES} == ALIASES
    for alias, path in ALIASES.items():
        assert field_path(override_name(path)) == path
        assert field_path(param_name(field_path(alias))) == path  # lora_alpha -> peft_config.lora_alpha -> lora_alpha
    for old, new in OLD_PREFIXES.items():
        assert field_path(f"{old}learning_rate") == f"{new}learning_rate"


def test_every_grpo_field_is_its_own_param_and_override_name():
    names = _grpo_fields()
    assert len(names) > 100
    for name in names:
        path = f"args.{name}"
        assert field_path(name) == field_path(path) == field_path(f"grpo.{name}") == path
        assert param_name(path) == override_name(path) == name


def test_a_param_is_the_fields_path_when_two_fields_share_its_last_part():
    paths = ["args.model_init_kwargs.revision", "peft_config.revision", "args.learning_rate"]
    assert param_name("peft_config.revision", paths) == "peft_config.revision"
    assert param_name("args.learning_rate", paths) == "learning_rate"
    assert override_name("peft_config.target_modules") == "peft_config.target_modules"  # no bare override name
    assert field_path("peft_config.target_modules") == "peft_config.target_modules"


def test_overrides_change_the_field_each_name_means():
    data = trial_config("tiny", peft=lora_config()).to_dict()
    for name, value in [("lora_r", 16), ("r", 16), ("lora_alpha", 32), ("lora_dropout", 0.1), ("learning_rate", 0.02),
                        ("grpo.learning_rate", 0.02), ("args.beta", 0.1), ("peft.lora_alpha", 32),
                        ("peft_config.lora_alpha", 32)]:
        changed, typed = override_dict(data, {name: value})
        assert fields(changed)[field_path(name)] == value, name
        assert typed == {name: value}
    # A list or a text for PEFT's target_modules (list[str] | str | None, which transformers' argument parser refuses)
    for text, value in [('["q_proj"]', ["q_proj"]), ("all-linear", "all-linear")]:
        assert override_dict(data, {"peft_config.target_modules": text})[0]["peft_config"]["target_modules"] == value
    rewards = ["rfopt_testkit:reward_len"]
    assert override_dict(data, {"rewards": rewards})[0]["reward_funcs"] == rewards
    with pytest.raises(ConfigError, match="quantization: unknown field"):
        override_dict(data, {"quantization": "{}"})


def test_a_list_space_its_overrides_and_a_clone_agree_on_every_param(tmp_path):
    base = trial_config("tiny", rewards=(reward_len,), peft=lora_config())
    other = trial_config("tiny", rewards=(reward_len, reward_vowels), learning_rate=0.02, beta=0.1,
                         peft=lora_config(r=8, lora_alpha=32, target_modules=["q_proj"]))
    space = ListSpace([base, other])
    assert space.paths == {"beta": "args.beta", "learning_rate": "args.learning_rate", "lora_alpha":
                           "peft_config.lora_alpha", "lora_r": "peft_config.r", "rewards": "reward_funcs",
                           "target_modules": "peft_config.target_modules"}
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", study_name="s")
    space.check_study(study)
    space.enqueue_missing(study)
    for _ in range(2):
        trial = study.ask()
        space.config_for(trial)
    parent, listed = study.get_trials(deepcopy=False)

    overrides = space.overrides_for(parent, listed.params)  # as population-based training asks for them
    assert sorted(overrides) == ["beta", "learning_rate", "lora_alpha", "lora_r", "peft_config.target_modules",
                                 "rewards"]
    child, _ = override_dict(TrialConfig.config_dict(TrialRecord(parent).config_json), overrides)
    assert fields(TrialConfig.from_dict(child).to_dict()) == fields(other.to_dict())

    params, distributions = clones._clone_params(study, parent, overrides)  # the clone records them as the list does
    assert params == listed.params
    assert all(admits(distributions[name], value) for name, value in params.items())


def test_the_leaderboard_shows_a_default_as_its_value_not_none(scripted, tiny_model, tmp_path):
    study = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.optimize([trial_config(tiny_model), trial_config(tiny_model, optim="sgd")], prompts_dataset(8),
                   prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    default = trl.GRPOConfig.__dataclass_fields__["optim"].default
    assert sorted(t.params["optim"] for t in study.optuna.get_trials()) == sorted([str(default), "sgd"])
    assert "optim=None" not in study.leaderboard_text()


def test_the_distribution_keeps_or_widens_the_studys_own_and_refuses_what_optuna_cannot_hold():
    def build(values, existing=None):
        return distribution(values, existing, name="p", given="the list now gives")

    assert build([1, 4]) == IntDistribution(1, 4)
    assert build([1, 0.5]) == FloatDistribution(0.5, 1.0)
    assert build(["b", "a"]) == CategoricalDistribution(["a", "b"])
    log = FloatDistribution(1e-4, 1e-2, log=True)
    assert build([1e-3], log) is log
    assert build([0.1], log) == FloatDistribution(1e-4, 0.1, log=True)  # widened on the same scale
    stepped = IntDistribution(2, 8, step=2)
    assert build([10], stepped) == IntDistribution(2, 10, step=2)
    assert build([3], stepped) == IntDistribution(2, 8, step=1)
    with pytest.raises(ConfigError, match=r"p: the list now gives \['c'\], which the study's trials did not have"):
        build(["a", "c"], CategoricalDistribution(["a", "b"]))
    with pytest.raises(ConfigError, match="as a number range"):
        build(["x"], log)
    with pytest.raises(ConfigError, match="as whole numbers"):
        build([2.5], stepped)
    with pytest.raises(ConfigError, match="on a log scale"):
        build([0.0], log)


def test_a_param_holds_a_value_json_cannot_leave_as_it_is_as_its_json_text():
    assert param_value(["b", "a"]) == '["b", "a"]' and param_value({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'
    assert [param_value(v) for v in (None, True, 3, 0.5, "x")] == [None, True, 3, 0.5, "x"]


def test_a_value_a_categorical_param_cannot_hold_goes_to_the_first_alternate_param_that_can():
    model = CategoricalDistribution(["m1"])
    assert param_holding("model", "m1", {"model": model}) == ("model", model)
    assert param_holding("model", "m2", {"model": model}) == ("model#2", CategoricalDistribution(["m2"]))
    taken = {"model": model, "model#2": CategoricalDistribution(["m2"])}
    assert param_holding("model", "m3", taken) == ("model#3", CategoricalDistribution(["m3"]))
    assert param_holding("lr", 0.5, {"lr": FloatDistribution(0.1, 0.2)}) == ("lr", FloatDistribution(0.1, 0.5))


def test_what_transformers_derives_from_use_cpu_is_no_difference_between_configs():
    """Issue 35: the leaderboard named ``dataloader_pin_memory=True/False`` (transformers sets it False where
    ``use_cpu``) as the difference between a config written for the CPU and one written for a GPU. The device decides
    it, as it decides use_cpu: not stored, not a param, not an override."""
    import json

    cpu = trial_config("m", learning_rate=1e-3)
    gpu = trial_config("m", learning_rate=5e-3, use_cpu=False)
    assert cpu.args.dataloader_pin_memory is False and gpu.args.dataloader_pin_memory is True
    space = ListSpace([cpu, gpu])
    assert list(space.params) == ["learning_rate"]
    assert "dataloader_pin_memory" not in cpu.to_dict()["args"]
    # A config an earlier rfopt stored with it reads as the same config (a rerun of its list is not refused).
    stored = cpu.to_dict()
    stored["args"]["dataloader_pin_memory"] = False
    assert TrialConfig.config_dict(json.dumps(stored)) == TrialConfig.config_dict(cpu.to_json())
    with pytest.raises(ConfigError, match="dataloader_pin_memory: the device a study runs on decides"):
        override_dict(cpu.to_dict(), {"dataloader_pin_memory": "true"})
