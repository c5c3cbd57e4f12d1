"""Collapse caught: the diversity measures of an evaluation's completions, and the verdict read back from them."""

import math

import pytest

from rfopt.training.diversity import collapse_reason, diversity

END = {2}


def _measures(texts, ids=None, prompts=None):
    prompts = prompts or [f"question {i}" for i in range(len(texts))]
    ids = ids or [[10 + i % 5] * 12 + [2] for i in range(len(texts))]
    return diversity(prompts, texts, ids, END)


def test_one_text_for_every_prompt_is_a_collapse_and_says_how_many_prompts():
    measures = _measures(["The notebooks cost 3 * 4 = 12 dollars."] * 16)
    assert measures["diversity/distinct"] == 1 / 16
    assert measures["diversity/top_share"] == 1.0
    assert collapse_reason(measures) == "one completion answers 16 of 16 eval prompts"


def test_answers_that_depend_on_the_prompt_are_not_a_collapse():
    measures = _measures([f"<answer>{i}</answer> because {i} + 1 is {i + 1}" for i in range(16)])
    assert measures["diversity/distinct"] == 1.0 and measures["diversity/top_share"] == 1 / 16
    assert collapse_reason(measures) is None


def test_a_shared_short_label_is_not_a_collapse_but_a_shared_empty_completion_is():
    labels = _measures(["yes"] * 12 + ["no"] * 4, ids=[[7, 2]] * 16)
    assert labels["diversity/top_share"] == 0.75 and collapse_reason(labels) is None
    empty = _measures([""] * 16, ids=[[2]] * 16)
    assert collapse_reason(empty) == "an empty completion answers 16 of 16 eval prompts"


def test_too_few_prompts_give_no_verdict_and_repeated_prompts_count_once():
    assert collapse_reason(_measures(["same long text here"] * 3)) is None
    # The same prompt twice gets the same greedy completion: not a sign of collapse.
    twice = _measures(["a b c d e f g h i", "a b c d e f g h i", "x", "y", "z"],
                      prompts=["p0", "p0", "p1", "p2", "p3"])
    assert twice["diversity/prompts"] == 4 and twice["diversity/top_share"] == 0.25


def test_loops_and_completions_cut_at_the_length_limit_are_measured():
    looping = [[5, 6, 7, 8] * 4]  # 13 4-grams, 9 of them repeats; no end token: cut at the limit
    ended = [[5, 6, 7, 8, 9, 2]]
    measures = diversity(["p0", "p1"], ["loop", "ok"], looping + ended, END)
    assert measures["completions/clipped_ratio"] == 0.5
    assert measures["diversity/repeated_ngrams"] == pytest.approx((9 / 13 + 0) / 2)


def test_an_evaluation_stored_before_diversity_was_measured_gives_no_verdict():
    assert collapse_reason({"reward": 1.0}) is None


def test_scored_evaluations_store_the_measures_and_each_rewards_spread(tiny_model):
    from transformers import AutoTokenizer

    from rfopt.config.settings import EvalSettings
    from rfopt.training.evaluation import EvalPrompts, scored
    from rfopt_testkit import prompts_dataset, reward_len

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = EvalPrompts.of(prompts_dataset(4), tokenizer)
    same = tokenizer("the same memorised text", add_special_tokens=False)["input_ids"]
    result = scored(prompts, [list(same)] * 4, tokenizer, [reward_len], None, EvalSettings())
    assert result.metrics["diversity/top_share"] == 1.0 and result.metrics["completions/clipped_ratio"] == 1.0
    assert result.metrics["completions/count"] == 4 and result.metrics["reward_std"] == 0.0
    assert collapse_reason(result.metrics) == "one completion answers 4 of 4 eval prompts"
    varied = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in ["a", "bb", "ccc", "dddd"]]
    result = scored(prompts, varied, tokenizer, [reward_len], None, EvalSettings())
    assert result.metrics["completions/clipped_ratio"] == 0.0 and collapse_reason(result.metrics) is None
    assert result.metrics["rewards/reward_len/std"] == pytest.approx(math.sqrt(sum((n / 8 - 2.5 / 8) ** 2 for n in range(1, 5)) / 4))


def test_a_base_model_that_already_answers_every_prompt_alike_makes_no_collapse():
    same = _measures(["the same long answer to everything"] * 8)
    assert collapse_reason(same) is not None
    assert collapse_reason(same, reference=same) is None  # nothing that training brought about
    assert collapse_reason(same, reference=_measures([f"answer {i} is {i} + 1 = {i + 1}" for i in range(8)])) \
        is not None
