"""A TRL script becomes an rfopt study by renaming its call: `rfopt.TrialConfig` takes `trl.GRPOTrainer`'s arguments,
by the same names and with TRL's meaning, and refuses, with the fix, the ones a trial cannot take."""

import json

import pytest
import rfopt_callbacks
import rfopt_testkit
import torch
import trl.rewards
from peft import LoraConfig, get_peft_model_state_dict
from rfopt_callbacks import RecordingCallback
from rfopt_testkit import (
    grpo_config,
    prompts_dataset,
    reward_len,
    reward_vowels,
    trial_config,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import GRPOConfig, GRPOTrainer

import rfopt
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.config.trial import ConfigError, TokenizerSpec


def _plain_args(tmp_path, **overrides):
    """A GRPOConfig as a user writes it for a CPU run; ``shuffle_dataset=False`` so that plain TRL can be given its
    rows in the chunk plan's order."""
    settings = {"output_dir": str(tmp_path / "plain"), "report_to": [], "save_strategy": "no", "learning_rate": 5e-3,
                "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
                "num_train_epochs": 1, "use_cpu": True, "bf16": False, "gradient_checkpointing": False, "seed": 7,
                "shuffle_dataset": False}
    return GRPOConfig(**{**settings, **overrides})


def _study(tmp_path):
    return rfopt.create_study(study_name="idioms", storage=f"sqlite:///{tmp_path / 'study.db'}",
                              checkpoint_dir=tmp_path / "ck")


# ---------------------------------------------------------------------- the promise
@pytest.mark.slow
@pytest.mark.e2e
def test_a_grpo_trainer_call_renamed_to_trial_config_trains_the_same_adapter_bit_for_bit(tiny_model, tmp_path):
    train, evaluation = prompts_dataset(8), prompts_dataset(2, "E")
    kwargs = {
        "model": str(tiny_model),
        "reward_funcs": [reward_len, reward_vowels],
        "args": _plain_args(tmp_path, gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=0.25),
        "peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }

    # rfopt: the same call, renamed, as a one-trial study trained in 2 chunks, one trial at a time (a gang samples
    # its rollouts through rfopt's engine, not TRL's generate).
    study = _study(tmp_path)
    study.optimize([rfopt.TrialConfig(**kwargs)], train, evaluation, num_chunks=2, show_progress_bar=False,
                   gang_size=1)
    assert study.optuna.trials[0].state.name == "COMPLETE"
    # Its final adapter: Optuna's best trial (the recommended one is its best chunk's, which may be an earlier one).
    chunked = load_file(str(study.export_best(tmp_path / "best", best_trial=True) / "adapter_model.safetensors"))

    # Plain TRL, given the rows in the order rfopt's chunk plan trains them.
    plan = ChunkPlan.build(len(train), num_chunks=2, seed=0)
    schedule = trial_schedule(plan, kwargs["args"])
    rows = [row for unit in range(schedule.num_units)
            for row in plan.chunks[schedule.chunk_of_unit(unit)][: schedule.prompts_per_chunk]]
    trainer = GRPOTrainer(**kwargs, train_dataset=train.select(rows))
    trainer.train()
    straight = get_peft_model_state_dict(trainer.model)

    assert trainer.state.global_step == schedule.total_steps
    assert chunked.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(chunked[key], value), f"{key} differs by {(chunked[key] - value).abs().max()}"
    assert any(v.abs().sum() > 0 for k, v in chunked.items() if "lora_B" in k)  # it trained


# ---------------------------------------------------------------------- reward functions
def test_trl_built_in_rewards_are_stored_by_reference_and_score_the_same_after_loading(tiny_model):
    given = [trl.rewards.accuracy_reward, trl.rewards.think_format_reward,
             trl.rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
             trl.rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)]
    config = rfopt.TrialConfig(model=str(tiny_model), reward_funcs=given, args=grpo_config())
    stored = json.loads(config.to_json())["reward_funcs"]
    assert stored[:2] == ["trl.rewards.accuracy_rewards:accuracy_reward", "trl.rewards.format_rewards:think_format_reward"]
    assert stored[2]["attrs"] == {"max_completion_len": 8, "soft_punish_cache": 4}
    loaded = rfopt.TrialConfig.from_json(config.to_json())
    assert loaded.reward_funcs[:2] == given[:2]
    assert loaded.reward_names == config.reward_names
    ids = [[1, 2, 1, 2, 1, 2, 1], [3, 4, 5]]
    for before, after in zip(given[2:], loaded.reward_funcs[2:]):
        assert after(completion_ids=ids) == before(completion_ids=ids)


@pytest.mark.slow
@pytest.mark.e2e
def test_trl_built_in_rewards_train_a_trial(tiny_model, tmp_path):
    rewards = [trl.rewards.think_format_reward, trl.rewards.get_soft_overlong_punishment(8, 4)]
    study = _study(tmp_path)
    study.optimize([trial_config(tiny_model, rewards=rewards)], prompts_dataset(4, conversational=True),
                   prompts_dataset(2, "E", conversational=True), num_chunks=2, show_progress_bar=False)
    trial = study.optuna.trials[0]
    assert trial.state.name == "COMPLETE"
    metrics = study.chunk_metrics(0)[-1]
    assert "rewards/soft_overlong_punishment_reward/mean" in metrics["train"]
    assert "rewards/think_format_reward/mean" in metrics["eval"]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """What a TRL reward factory that returns a closure makes (TRL 1.16 returns an instance of a class instead)."""

    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        return [0.0 for _ in completion_ids]

    soft_overlong_punishment_reward.__module__ = "trl.rewards.other_rewards"
    return soft_overlong_punishment_reward


def test_a_trl_reward_made_as_a_closure_is_refused_naming_rfopts_equivalent(tiny_model):
    config = trial_config(tiny_model, rewards=[get_soft_overlong_punishment(8, 4)])
    with pytest.raises(ConfigError, match=r"made by trl.rewards.get_soft_overlong_punishment\(...\), cannot be stored "
                                          r".*use rfopt.rewards.soft_overlong_punishment\("):
        config.to_json()


@pytest.mark.parametrize("reward", ["trl-lib/Qwen2-0.5B-Reward", "model"], ids=["hub-id", "local-name"])
def test_a_reward_model_given_by_id_is_refused_with_what_to_do_instead(tiny_model, reward):
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\]: '.*' is a model id, which TRL would load as a reward "
                                          r"model; reward models are not supported yet; wrap the model in a reward "
                                          r"function"):
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len, reward])


def test_a_reward_model_instance_is_refused_before_anything_wraps_it(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]: a model \(LlamaForCausalLM\) as reward function; reward "
                                          r"models are not supported yet; wrap the model in a reward function"):
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=model)


def test_one_reward_function_is_taken_as_trl_takes_it():
    config = rfopt.TrialConfig(model="some/model", reward_funcs=reward_len, args=grpo_config())
    assert config.reward_funcs == [reward_len]
    assert rfopt.TrialConfig(model="some/model", reward_funcs="rfopt_testkit:reward_len").reward_funcs == [reward_len]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_reward_reading_trainer_state_gets_the_trials_step_in_training_and_in_evaluation(tiny_model, tmp_path):
    study = _study(tmp_path)
    study.optimize([trial_config(tiny_model, rewards=[rfopt_testkit.reward_step])], prompts_dataset(8),
                   prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    trial = study.optuna.get_trials()[0]
    assert trial.state.name == "COMPLETE"
    # 4 prompts a chunk, one a step (4 completions, 4 generations): steps 0-3 generate in chunk 0, 4-7 in chunk 1.
    steps = [m["train"]["rewards/reward_step/mean"] for m in study.chunk_metrics(0)]
    assert steps == [1.5, 5.5]
    assert trial.intermediate_values == {0: 4.0, 1: 8.0}  # evaluated after 4 and after 8 steps


@pytest.mark.slow
@pytest.mark.e2e
def test_an_async_reward_function_is_awaited_in_evaluation_as_in_training(tiny_model, tmp_path):
    study = _study(tmp_path)
    study.optimize([trial_config(tiny_model, rewards=[rfopt_testkit.reward_len_async])], prompts_dataset(8),
                   prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    trial = study.optuna.get_trials()[0]
    assert trial.state.name == "COMPLETE"
    assert trial.value == study.chunk_metrics(0)[0]["eval"]["rewards/reward_len_async/mean"]


# ---------------------------------------------------------------------- what a trial cannot take
def test_a_model_instance_is_refused_with_what_to_give_instead(tiny_model):
    from peft import get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    for given in (model, get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))):
        with pytest.raises(ConfigError, match=r"model: a model instance \(\w+\) cannot be given: rfopt loads the model "
                                              r"itself.*Give its Hub id or local directory.*or a top-level function "
                                              r"returning \(model, tokenizer\)"):
            rfopt.TrialConfig(model=given, reward_funcs=[reward_len])


def _unsupported(name, tiny_model):
    def reward(**kwargs):
        return []

    values = {
        "train_dataset": prompts_dataset(4),
        "eval_dataset": prompts_dataset(4),
        "optimizers": (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None),
        "reward_processing_classes": [AutoTokenizer.from_pretrained(tiny_model)],
        "tools": [reward],
        "rollout_func": reward,
        "environment_factory": reward,
    }
    return values[name]


@pytest.mark.parametrize("name, fix", [
    ("train_dataset", (r"the datasets are the study's, the same for every trial: give them to "
                       r"study.optimize\(space, train_dataset, eval_dataset\)")),
    ("eval_dataset", r"study.optimize\(space, train_dataset, eval_dataset\)"),
    ("optimizers", r"rfopt builds the optimizer and LR scheduler from args.*exact; choose them with args.optim"),
    ("reward_processing_classes", r"reward models are not supported yet"),
    ("tools", r"tool calling is not supported yet"),
    ("rollout_func", r"custom rollout functions are not supported yet"),
    ("environment_factory", r"environments are not supported yet"),
])
def test_grpo_trainer_arguments_a_trial_cannot_take_are_refused_with_why(tiny_model, name, fix):
    with pytest.raises(ConfigError, match=rf"^{name}: .*{fix}"):
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], **{name: _unsupported(name, tiny_model)})
    # Left at GRPOTrainer's defaults they are accepted, as in a call that passes them explicitly.
    rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], args=grpo_config(), train_dataset=None,
                      optimizers=(None, None))


def test_no_args_means_trls_default_grpo_config():
    config = rfopt.TrialConfig(model="some/model", reward_funcs=[reward_len])
    default = GRPOConfig(bf16=False)
    assert (config.args.learning_rate, config.args.num_generations, config.args.beta) == (
        default.learning_rate, default.num_generations, default.beta)
    stored = json.loads(config.to_json())["args"]
    assert not {"learning_rate", "num_generations", "beta", "output_dir"} & set(stored)  # defaults are not stored
    assert rfopt.TrialConfig.from_json(config.to_json()).args.learning_rate == default.learning_rate


# ---------------------------------------------------------------------- callbacks
@pytest.mark.slow
@pytest.mark.e2e
def test_callbacks_given_as_class_and_instance_are_called_in_every_chunk_and_survive_json(tiny_model, tmp_path):
    tagged = RecordingCallback()
    tagged.tag = "instance"
    config = rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], args=grpo_config(),
                               peft_config=rfopt_testkit.lora_config(), callbacks=[RecordingCallback, tagged])
    stored = json.loads(config.to_json())["callbacks"]
    assert stored == ["rfopt_callbacks:RecordingCallback",
                      {"class": "rfopt_callbacks:RecordingCallback", "attrs": {"tag": "instance"}}]
    loaded = rfopt.TrialConfig.from_json(config.to_json())
    assert loaded.callbacks[0] is RecordingCallback
    assert type(loaded.callbacks[1]) is RecordingCallback and loaded.callbacks[1].tag == "instance"

    rfopt_callbacks.CALLBACK_EVENTS.clear()
    study = _study(tmp_path)
    study.optimize([config], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    assert study.optuna.trials[0].state.name == "COMPLETE"
    for tag in ("class", "instance"):
        seen = [(event, step) for t, event, step in rfopt_callbacks.CALLBACK_EVENTS if t == tag]
        # A chunk is one trainer.train(): train_begin/train_end once per chunk; steps continue across chunks.
        assert [e for e in seen if e[0] == "train_begin"] == [("train_begin", 0), ("train_begin", 4)]
        assert [step for event, step in seen if event == "step_end"] == list(range(1, 9))


class _Unstorable(RecordingCallback):
    pass


def test_callbacks_that_cannot_be_stored_are_refused_when_the_config_is_made():
    def local():
        class Local(RecordingCallback):
            pass

        return Local

    with pytest.raises(ConfigError, match="cannot be stored by import path"):
        rfopt.TrialConfig(model="m", reward_funcs=[reward_len], callbacks=[local()])
    holding = _Unstorable()
    holding.model = torch.zeros(1)
    with pytest.raises(ConfigError, match="callback _Unstorable: its attributes must be JSON values"):
        rfopt.TrialConfig(model="m", reward_funcs=[reward_len], callbacks=[holding])
    with pytest.raises(ConfigError, match="is not a transformers.TrainerCallback"):
        rfopt.TrialConfig(model="m", reward_funcs=[reward_len], callbacks=[object()])


# ---------------------------------------------------------------------- processing_class
def test_a_tokenizer_instance_is_stored_by_what_rebuilds_it_and_round_trips(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"
    config = rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], processing_class=tokenizer)
    assert json.loads(config.to_json())["processing_class"] == {
        "name_or_path": str(tiny_model), "pad_token": "<|im_end|>", "truncation_side": "left"}  # right: as loaded
    loaded = rfopt.TrialConfig.from_json(config.to_json())
    assert loaded.processing_class == config.processing_class
    rebuilt = loaded.processing_class.load()
    for name in ("pad_token", "padding_side", "truncation_side", "chat_template"):
        assert getattr(rebuilt, name) == getattr(tokenizer, name), name
    # Trials sharing a resident base model share its tokenizer: the tokenizer is part of the model key.
    assert config.model_key != trial_config(tiny_model).model_key
    assert rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len],
                             processing_class=str(tiny_model)).processing_class == str(tiny_model)


def test_a_tokenizer_that_cannot_be_rebuilt_is_refused(tiny_model, tmp_path):
    moved = AutoTokenizer.from_pretrained(tiny_model)
    moved.name_or_path = str(tmp_path / "gone")
    with pytest.raises(ConfigError, match="processing_class: rfopt loads the tokenizer again on every worker from its "
                                          "name_or_path .*gone.*save it with tokenizer.save_pretrained"):
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], processing_class=moved)
    grown = AutoTokenizer.from_pretrained(tiny_model)
    grown.add_tokens(["<tool>"])
    with pytest.raises(ConfigError, match="tokens were added"):
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], processing_class=grown)


def test_the_tokenizer_a_trial_trains_with_is_the_one_its_config_names(tiny_model):
    from rfopt.training.loading import load_model

    _, default = load_model(trial_config(tiny_model))  # as GRPOTrainer loads it: padding and truncation left
    assert (default.padding_side, default.truncation_side) == ("left", "left")
    spec = TokenizerSpec(str(tiny_model), {"truncation_side": "right", "pad_token": "<|im_start|>"})
    config = rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len], processing_class=spec)
    _, given = load_model(config)
    assert (given.truncation_side, given.pad_token) == ("right", "<|im_start|>")


# ---------------------------------------------------------------------- model loading
def test_model_init_kwargs_load_the_model_as_trl_does(tiny_model):
    from rfopt.training.loading import load_model

    model, _ = load_model(trial_config(tiny_model, model_init_kwargs={"dtype": "bfloat16"}))
    assert model.dtype == torch.bfloat16
    model, _ = load_model(trial_config(tiny_model))
    assert model.dtype == torch.float32  # TRL's default, whatever the checkpoint holds
    config = trial_config(tiny_model, model_init_kwargs={"dtype": torch.bfloat16})
    assert json.loads(config.to_json())["args"]["model_init_kwargs"] == {"dtype": "bfloat16"}
    assert config.model_key != trial_config(tiny_model).model_key


def test_quantization_given_as_argument_or_in_model_init_kwargs_is_stored_the_same():
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    lora = rfopt_testkit.lora_config()
    as_argument = rfopt.TrialConfig(model="m", reward_funcs=[reward_len], args=grpo_config(),
                                    quantization_config=bnb, peft_config=lora)
    in_kwargs = rfopt.TrialConfig(model="m", reward_funcs=[reward_len], peft_config=lora,
                                  args=grpo_config(model_init_kwargs={"quantization_config": bnb, "dtype": "float16"}))
    assert json.loads(as_argument.to_json())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert in_kwargs.quantization_config is bnb
    assert in_kwargs.to_dict() == {**as_argument.to_dict(), "args": {**as_argument.to_dict()["args"],
                                                                      "model_init_kwargs": {"dtype": "float16"}}}
    assert in_kwargs.model_init_kwargs()["quantization_config"] is bnb
    with pytest.raises(ConfigError, match="quantization_config: given both as an argument and in "
                                          "args.model_init_kwargs; set it in only one place"):
        rfopt.TrialConfig(model="m", reward_funcs=[reward_len], quantization_config=bnb,
                          args=grpo_config(model_init_kwargs={"quantization_config": bnb}))


# ---------------------------------------------------------------------- configs stored by the first rfopt
FIRST_LAYOUT = {
    "model": "/models/tiny-llama",
    "model_kwargs": {"dtype": "bfloat16"},
    "tokenizer_kwargs": {"padding_side": "right"},
    "quantization": None,
    "peft": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
    "grpo": {"learning_rate": 0.005, "per_device_train_batch_size": 4, "num_generations": 4,
             "max_completion_length": 8, "seed": 7},
    "rewards": ["rewards.answers:correctness",
                {"factory": "rewards.length:soft_overlong_punishment",
                 "kwargs": {"max_completion_length": 8, "soft_punish_cache": 4}},
                "rfopt_testkit:reward_len"],
    "reward_weights": [2.0, 1.0, 0.5],
}
"""A config as the first rfopt stored it (``rfopt:config``), its reward functions in the top-level ``rewards``."""


def test_a_config_stored_by_the_first_rfopt_loads():
    from rfopt import rewards

    config = rfopt.TrialConfig.from_dict(FIRST_LAYOUT)
    assert config.reward_funcs[0] is rewards.correctness and config.reward_funcs[2] is reward_len
    assert config.reward_names == ["correctness", "soft_overlong_punishment", "reward_len"]
    assert config.args.reward_weights == [2.0, 1.0, 0.5] and config.args.learning_rate == 0.005
    assert config.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert config.processing_class == TokenizerSpec("/models/tiny-llama", {"padding_side": "right"})
    assert config.peft_config.r == 8 and config.quantization_config is None
    stored = json.dumps(FIRST_LAYOUT)
    assert rfopt.TrialConfig.from_json(stored).to_json() == config.to_json()
    # Read without importing anything (the dashboard, list studies): the same config, in the current layout.
    data = rfopt.TrialConfig.config_dict(stored)
    assert data["reward_funcs"][:2] == ["rfopt.rewards.answers:correctness",
                                        {"factory": "rfopt.rewards.length:soft_overlong_punishment",
                                         "kwargs": {"max_completion_length": 8, "soft_punish_cache": 4}}]
    assert rfopt.TrialConfig.from_dict(data).to_json() == config.to_json()
    factory = rfopt.TrialConfig.config_dict(json.dumps({**FIRST_LAYOUT, "model": {"factory": "studies.arithmetic:x"}}))
    assert factory["model"] == {"factory": "rfopt.studies.arithmetic:x"}


# ---------------------------------------------------------------------- overrides
def test_overrides_take_grpo_config_peft_and_own_field_names_and_the_first_rfopts(tiny_model):
    config = trial_config(tiny_model)
    new = config.with_overrides({"learning_rate": 1e-3, "args.beta": 0.01, "reward_weights": "[2, 1]",
                                 "peft_config.lora_alpha": 32, "lora_r": 8, "lora_dropout": 0.1,
                                 "reward_funcs": ["rfopt_testkit:reward_vowels", "rfopt_testkit:reward_len"]})
    old = config.with_overrides({"grpo.learning_rate": 1e-3, "grpo.beta": 0.01, "reward_weights": [2.0, 1.0],
                                 "peft.lora_alpha": 32, "peft.r": 8, "lora_dropout": 0.1,
                                 "rewards": ["rfopt_testkit:reward_vowels", "rfopt_testkit:reward_len"]})
    assert new.to_json() == old.to_json()
    assert (new.args.learning_rate, new.args.beta, new.args.reward_weights) == (1e-3, 0.01, [2.0, 1.0])
    assert (new.peft_config.r, new.peft_config.lora_alpha, new.peft_config.lora_dropout) == (8, 32, 0.1)
    assert new.reward_funcs == [reward_vowels, reward_len]
    with pytest.raises(ConfigError, match=r"args.reward_weights: 3 weights for 2 reward functions"):
        config.with_overrides({"reward_weights": [1, 1, 1]})
    with pytest.raises(ConfigError, match=r"unknown field; use a GRPOConfig field .* model or reward_funcs"):
        config.with_overrides({"peft_r": 8})
    # A first-rfopt config is overridden in the current layout.
    data, typed = rfopt.config.override_dict(FIRST_LAYOUT, {"lora_r": 4, "learning_rate": "1e-4"})
    assert (data["peft_config"]["r"], data["args"]["learning_rate"], typed) == (4, 1e-4, {"lora_r": 4,
                                                                                          "learning_rate": 1e-4})
