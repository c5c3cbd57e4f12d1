"""Canaries for rfopt/compat/_trl.py (TRL): each fails loudly when the library symbol, or the call site, that one of
rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

import inspect

import pytest

from rfopt import compat
from rfopt_testkit import prompts_dataset, trial_config


# ---------------------------------------------------------------------- carried_trainer_state, kl_reference_base_model, telemetry_once
def test_the_training_loop_calls_init_training_state_before_it_reads_the_step_it_logs_from():
    from transformers import Trainer

    loop = inspect.getsource(Trainer._inner_training_loop)
    assert "self._init_training_state(" in loop
    assert loop.index("self._init_training_state(") < loop.index("self._globalstep_last_logged = self.state.global_step")


def test_grpo_reads_its_beta_attribute_when_it_trains_and_pings_telemetry_from_its_constructor():
    from trl import GRPOTrainer

    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "if self.beta != 0.0:" in scoring and "use_adapter(" in scoring  # the base model, adapter disabled
    assert "self.beta" in inspect.getsource(GRPOTrainer._compute_loss)
    constructors = "".join(inspect.getsource(c.__init__) for c in GRPOTrainer.__mro__
                           if "__init__" in vars(c) and inspect.isfunction(c.__init__))
    assert "self._send_telemetry()" in constructors


@pytest.mark.e2e
def test_a_chunk_trainer_continues_at_the_carried_step_with_the_beta_it_is_given(tiny_model, tmp_path, monkeypatch):
    """Behaviour, not source: built with beta=0 and given 0.04, it logs a KL; started at step 3 of 4, its one step
    is step 4; it pings TRL's telemetry only as a trial's first chunk."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rfopt_testkit import lora_config

    pings = []
    monkeypatch.setattr(GRPOTrainer, "_send_telemetry", lambda self: pings.append(1))

    class Logs(TrainerCallback):
        seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append((state.global_step, dict(logs or {})))

    from peft import get_peft_model

    config = trial_config(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    args = dataclasses.replace(config.args, output_dir=str(tmp_path), max_steps=4, beta=0.0, logging_steps=1,
                               report_to=[], generation_batch_size=None)
    trainer_class = compat.chunk_trainer_class()
    with compat.restore_shared_model(model, args):
        trainer = trainer_class(model=model, reward_funcs=list(config.reward_funcs), args=args,
                                train_dataset=prompts_dataset(4), processing_class=tokenizer, callbacks=[Logs()],
                                start_step=3, tokens_seen=100, first_chunk=False, beta=0.04)
        trainer.train()
    assert trainer.state.global_step == 4 and pings == []
    step, logs = next((step, logs) for step, logs in Logs.seen if "loss" in logs)
    assert step == 4 and "kl" in logs
    assert trainer.state.num_input_tokens_seen > 100
    trainer_class(model=model, reward_funcs=list(config.reward_funcs), args=args, train_dataset=prompts_dataset(4),
                  processing_class=tokenizer, start_step=0, tokens_seen=0, first_chunk=True, beta=0.0)
    assert pings == [1]


# ---------------------------------------------------------------------- shared_model_restored
def test_the_input_require_grads_hook_is_where_the_shared_model_restore_removes_it(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.enable_input_require_grads()
    assert getattr(model, "_require_grads_hook", None) is not None
    model.disable_input_require_grads()


def test_a_grpo_trainer_wraps_the_model_forward_on_the_instance_and_the_restore_takes_it_off(tiny_model, tmp_path):
    import dataclasses

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from rfopt_testkit import lora_config

    config = trial_config(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    base = model.get_base_model()
    args = dataclasses.replace(config.args, output_dir=str(tmp_path), report_to=[], generation_batch_size=None)
    with compat.restore_shared_model(model, args):
        GRPOTrainer(model=model, reward_funcs=list(config.reward_funcs), args=args, train_dataset=prompts_dataset(4),
                    processing_class=AutoTokenizer.from_pretrained(tiny_model))
        assert "forward" in vars(model) or "forward" in vars(base)  # what the restore exists for
    assert "forward" not in vars(model) and "forward" not in vars(base)


# ---------------------------------------------------------------------- trl_model_loading
def test_grpo_trainer_loads_a_string_model_and_its_processing_class_the_way_rfopt_copies():
    """rfopt loads a string model as GRPOTrainer.__init__ does: create_model_from_path with args.model_init_kwargs
    (quantization_config and trust_remote_code added), and with no processing_class an AutoProcessor padded and
    truncated on the left (rfopt.training.loading.load_model)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import create_model_from_path

    assert list(inspect.signature(create_model_from_path).parameters) == ["model_id", "architecture", "kwargs"]
    init = inspect.getsource(GRPOTrainer.__init__)
    loading = init[init.index("if isinstance(model, str):"): init.index("# Processing class")]
    assert 'model_init_kwargs["quantization_config"] = quantization_config' in loading
    assert 'model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)' in loading
    assert "create_model_from_path(model, **model_init_kwargs)" in loading
    processing = init[init.index("if processing_class is None:"):]
    processing = processing[: processing.index("\n\n")]
    assert "AutoProcessor.from_pretrained(" in processing
    assert 'truncation_side="left"' in processing and 'padding_side="left"' in processing


def test_trls_model_loader_defaults_to_float32_reads_dtype_names_and_places_on_the_device_map(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16  # transformers: "auto"
    assert compat.create_model(str(tmp_path / "bf16")).dtype == torch.float32  # TRL: float32 unless told
    loaded = compat.create_model(str(tiny_model), dtype="bfloat16", device_map={"": "cpu"})
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    with pytest.raises(ValueError, match="Invalid `dtype`"):
        compat.create_model(str(tiny_model), dtype="int3")


# ---------------------------------------------------------------------- trl_prompt_tokenization
def test_grpo_generates_from_the_prompt_ids_of_the_method_a_gang_member_calls():
    """Canary of ``trl_prompt_tokenization``: TRL's own ``generate`` path starts from ``_tokenize_prompts(prompts)``'s
    ids, the method `compat.tokenized_prompts` calls (tests/training/test_evaluation.py checks the ids it returns)."""
    from trl import GRPOTrainer

    assert list(inspect.signature(GRPOTrainer._tokenize_prompts).parameters) == ["self", "prompts"]
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in inspect.getsource(
        GRPOTrainer._generate)


# ---------------------------------------------------------------------- GRPO_LOSS_TYPES
def test_the_loss_types_rfopt_accepts_are_the_ones_trls_grpo_trainer_computes():
    """Canary for `compat.GRPO_LOSS_TYPES`: GRPOConfig takes any text as loss_type, and GRPOTrainer raises "Unknown
    loss type" at the first step for one it does not compute."""
    import inspect
    import re

    import trl.trainer.grpo_trainer as grpo

    source = inspect.getsource(grpo)
    assert "Unknown loss type" in source
    named = set(re.findall(r'loss_type (?:==|in) \[?"([a-z_]+)"', source)) | set(
        re.findall(r'"([a-z_]+)"', " ".join(re.findall(r"loss_type in \[([^\]]+)\]", source))))
    assert named == set(compat.GRPO_LOSS_TYPES), named ^ set(compat.GRPO_LOSS_TYPES)


# ---------------------------------------------------------------------- gang_backbone_calls
def test_trls_fused_lm_head_computes_log_probs_through_the_backbone_call_a_gang_routes(tiny_model):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer
    from trl import GRPOTrainer
    from trl.trainer import utils

    from rfopt_testkit import lora_config

    head = inspect.getsource(utils.add_fused_lm_head)
    assert 'backbone_attr = "base_model"' in head and "getattr(self, backbone_attr)(*args, **kwargs)" in head
    assert "backbone_outputs.last_hidden_state" in head
    scoring = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert 'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}' in scoring
    assert "self.accelerator.backward(loss" in inspect.getsource(Trainer.training_step)
    # and it does: with the head added, a fused call goes through the routed backbone, which is put back after
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    utils.add_fused_lm_head(model.get_base_model(), outputs=("log_probs",))
    ids = torch.tensor([[5, 6, 7, 8]])
    calls = []
    try:
        with compat.intercept_backbone(model, lambda original, args, kwargs: calls.append(kwargs) or original(
                *args, **kwargs)) as backbone:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
    finally:
        vars(model.get_base_model()).pop("forward", None)
    assert out.log_probs.shape == (1, 3) and len(calls) == 1 and set(calls[0]) >= {"input_ids", "attention_mask"}
    assert "forward" not in vars(backbone)
