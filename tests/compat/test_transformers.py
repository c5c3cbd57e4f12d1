"""Canaries for rfopt/compat/_transformers.py (transformers): each fails loudly when the library symbol, or the call
site, that one of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently
doing nothing."""

import inspect

from rfopt import compat


# ---------------------------------------------------------------------- trainer_generate_call
def test_grpo_generates_on_the_unwrapped_model_with_a_generation_config_and_custom_processors_come_before_warpers():
    from transformers import GenerationMixin
    from trl import GRPOTrainer

    generating = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "unwrapped_model.generate(" in generating and "generation_config=self.generation_config" in generating
    assert "logits_processor" not in generating  # rfopt's processor is the only custom one
    processors = inspect.getsource(GenerationMixin._get_logits_processor)
    assert processors.index("_merge_criteria_processor_list(processors, logits_processor)") < processors.index(
        "TemperatureLogitsWarper(")


def test_an_extra_logits_processor_decides_what_generate_samples_and_comes_off_after(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    inputs = torch.tensor([[1, 2, 3], [1, 2, 4]])

    class Only7:
        def __call__(self, input_ids, scores):
            return torch.full_like(scores, float("-inf")).index_fill_(1, torch.tensor([7]), 0.0)

    seen = []
    with compat.extra_logits_processor(model, lambda config, rows: seen.append(rows) or Only7()):
        out = model.generate(input_ids=inputs, generation_config=GenerationConfig(
            do_sample=True, max_new_tokens=3, temperature=0.5, top_k=5, pad_token_id=0))
    assert seen == [2] and out[:, 3:].eq(7).all()
    assert "generate" not in vars(model)  # the class's method again


# ---------------------------------------------------------------------- attention_implementation
def test_a_models_config_says_which_attention_it_was_loaded_with(tiny_model):
    """Canary of ``attention_implementation``."""
    from transformers import AutoModelForCausalLM

    assert compat.attention_implementation(AutoModelForCausalLM.from_pretrained(tiny_model).config) == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    assert compat.attention_implementation(eager.config) == "eager"


# ---------------------------------------------------------------------- generation_defaults
def test_generation_settings_are_what_generate_decodes_with_the_models_own_config_filling_what_trl_leaves_unset(
        tiny_model, tmp_path):
    """Canary of ``generation_defaults``: `generation_settings` merges a caller's config (or keyword arguments) with the
    model's ``generation_config`` and transformers' defaults exactly as ``generate`` does before it decodes."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rfopt.training.rollouts import generation_settings

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config.min_p = 0.05
    model.generation_config.no_repeat_ngram_size = 3
    model.generation_config.top_k = 20
    # What GRPOTrainer hands generate: top_k=0 set, min_p left None, no_repeat_ngram_size not named.
    trl = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=0, bos_token_id=2, eos_token_id=[3],
                           temperature=0.9, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                           cache_implementation=None, disable_compile=True)
    merged = generation_settings(model.generation_config, trl)
    assert merged.to_dict() == model._prepare_generation_config(trl)[0].to_dict()
    assert (merged.min_p, merged.no_repeat_ngram_size, merged.top_k, merged.num_beams) == (0.05, 3, 0, 1)
    kwargs = dict(max_new_tokens=4, do_sample=False, temperature=None, top_k=None, pad_token_id=0, eos_token_id=[3])
    assert (generation_settings(model.generation_config, **kwargs).to_dict()
            == model._prepare_generation_config(None, **kwargs)[0].to_dict())
    assert {"top_k", "num_beams", "no_repeat_ngram_size", "do_sample"} <= compat.generation_defaults().keys()
