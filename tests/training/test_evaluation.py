"""Evaluation (`rfopt.training.evaluation`): the prompts a trial is evaluated on are the prompts it trained on."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.config.settings import EvalSettings
from rfopt.training.evaluation import EvalMember, evaluate_members
from rfopt.training.models import ModelPool
from rfopt.training.rollouts import ExactBackend
from rfopt.training.runner import TrialRunner
from rfopt_testkit import prompts_dataset, reward_len, trial_config

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_model(tiny_model, tmp_path_factory):
    """The tiny model with a chat template that reads ``enable_thinking`` (as Qwen3's does)."""
    path = tmp_path_factory.mktemp("thinking")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = THINKING_TEMPLATE
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _prompts_sent(model, tokenizer, members, dataset):
    """The prompt token ids each member's request carried to the backend."""
    backend = ExactBackend(model)
    sent = []
    generate = backend.generate
    backend.generate = lambda requests, **kw: sent.extend(r.prompt_ids for r in requests) or generate(requests, **kw)
    results = evaluate_members(backend, model, tokenizer, members, dataset, EvalSettings(max_new_tokens=2))
    assert not any(isinstance(r, Exception) for r in results), results
    return sent


def test_each_member_is_evaluated_on_prompts_rendered_with_its_own_chat_template_kwargs(thinking_model):
    model = AutoModelForCausalLM.from_pretrained(thinking_model)
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    dataset = prompts_dataset(3, conversational=True)
    members = [EvalMember(None, [reward_len], None, 2, chat_template_kwargs={"enable_thinking": False}),
               EvalMember(None, [reward_len], None, 2)]
    without, plain = _prompts_sent(model, tokenizer, members, dataset)
    think = tokenizer.encode("<think></think>", add_special_tokens=False)
    assert all(ids[-len(think):] == think for ids in without)
    assert all(ids[-len(think):] != think for ids in plain)
    assert [ids[:-len(think)] for ids in without] == plain


def test_a_trials_eval_prompts_are_the_ones_trl_trains_it_on(thinking_model):
    """The runner's eval member carries ``args.chat_template_kwargs``: its eval prompts are TRL's own tokenization
    of the same conversations (a GRPOTrainer's with the trial's args)."""
    from trl import GRPOTrainer

    from rfopt import compat

    dataset = prompts_dataset(4, conversational=True)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    config = trial_config(thinking_model, chat_template_kwargs={"enable_thinking": False})
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), dataset, ModelPool("cpu"),
                         "/tmp/rfopt-test-eval")
    (sent,) = _prompts_sent(runner.model, runner.tokenizer, [runner.eval_member()], dataset)
    trainer = GRPOTrainer(model=runner.model, reward_funcs=[reward_len], args=config.args, train_dataset=dataset,
                          processing_class=runner.tokenizer)
    assert sent == compat.tokenized_prompts(trainer, list(dataset["prompt"]))
    assert "<think></think>" in runner.tokenizer.decode(sent[0])


def test_a_baseline_is_evaluated_on_the_prompts_its_trials_are_and_keyed_by_them(thinking_model, monkeypatch):
    from rfopt.training import baseline, evaluation

    plain, thinking = trial_config(thinking_model), trial_config(thinking_model,
                                                                 chat_template_kwargs={"enable_thinking": False})
    assert baseline.baseline_key(plain, EvalSettings()) == baseline.baseline_key(
        trial_config(thinking_model, chat_template_kwargs={}), EvalSettings())  # the keys stored before stay
    assert baseline.baseline_key(plain, EvalSettings()) != baseline.baseline_key(thinking, EvalSettings())
    seen = []
    members = evaluation.evaluate_members
    monkeypatch.setattr(evaluation, "evaluate_members",
                        lambda backend, model, tokenizer, ms, *a: seen.extend(ms) or members(backend, model,
                                                                                             tokenizer, ms, *a))
    baseline.evaluate_baseline(ModelPool("cpu"), thinking, prompts_dataset(2, conversational=True),
                               EvalSettings(max_new_tokens=2))
    assert [m.chat_template_kwargs for m in seen] == [{"enable_thinking": False}]


def test_a_gangs_evaluation_completes_on_a_model_whose_generation_config_the_sampler_lacks(tiny_model, tmp_path):
    """The model's ``no_repeat_ngram_size`` (merged into evaluation's settings as ``generate`` merges them): each
    member is evaluated through ``generate`` with it, as alone, instead of failing."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rfopt.training.rollouts import BatchedBackend
    from rfopt_testkit import tiny_model_with_generation_config

    path = tiny_model_with_generation_config(tiny_model, tmp_path / "ngram", no_repeat_ngram_size=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), adapter_name="m")
    model.add_adapter("n", LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    members = [EvalMember(name, [reward_len], None, 12) for name in "mn"]
    dataset = prompts_dataset(3, conversational=True)
    together = evaluate_members(BatchedBackend(model, mode="eager"), model, tokenizer, members, dataset,
                                EvalSettings(num_samples=3))
    for name, result in zip("mn", together):
        assert not isinstance(result, Exception), result
        model.set_adapter(name)
        alone = evaluate_members(ExactBackend(model), model, tokenizer, [EvalMember(name, [reward_len], None, 12)],
                                 dataset, EvalSettings(num_samples=3))[0]
        assert result.metrics == alone.metrics and result.samples == alone.samples
        for sample in result.samples:  # no character twice in a completion (the tokenizer is character level)
            assert len(set(sample["completion"])) == len(sample["completion"]) > 1


def test_the_kept_samples_include_the_best_scoring_prompt_beside_the_first_ones():
    from rfopt.training.evaluation import _sample_indices

    nan = float("nan")
    # The first four score 0 and 0.5; prompt 6 scores best: it replaces the fourth, so a right answer is shown.
    assert _sample_indices([0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 2.5, 0.0], 4) == [0, 1, 2, 6]
    assert _sample_indices([0.0, 2.5, 0.0, 0.5, 2.5], 4) == [0, 1, 2, 3]  # one of the first scores best already
    assert _sample_indices([nan, nan], 4) == [0, 1] and _sample_indices([1.0, 2.0], 0) == []
