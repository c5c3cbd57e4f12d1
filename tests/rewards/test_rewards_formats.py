import pytest

from rfopt.rewards import soft_format, strict_format, tag_count, think_format

STRICT = "<reasoning>\nFirst 6*7.\nThat is 42.\n</reasoning>\n<answer>\n42\n</answer>"


def test_strict_format_rewards_the_exact_layout_with_multiline_reasoning(as_completion):
    assert strict_format(["Q"], [as_completion(STRICT)]) == [0.5]


def test_strict_format_allows_whitespace_around_the_whole(as_completion):
    assert strict_format(["Q"], [as_completion("\n  " + STRICT + "\n\n")]) == [0.5]


def test_strict_format_accepts_unicode_content(as_completion):
    text = "<reasoning>\nπ ≈ 3.14 — 円\n</reasoning>\n<answer>\n🙂\n</answer>"
    assert strict_format(["Q"], [as_completion(text)]) == [0.5]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<reasoning>x</reasoning>\n<answer>\n42\n</answer>",  # tags not on their own lines
        "<reasoning>\nx\n</reasoning>\n\n<answer>\n42\n</answer>",  # blank line between blocks
        "<reasoning>\nx\n</reasoning>\n<answer>\n42</answer>",
        "Sure!\n" + STRICT,
        STRICT + "\nHope that helps.",
        STRICT + "\n<answer>\n43\n</answer>",  # a second answer block
        "<answer>\n42\n</answer>\n<reasoning>\nx\n</reasoning>",
        "<reasoning>\nx\n</reasoning>",
        "<reasoning>\nx\n</answer>\n</reasoning>\n<answer>\n42\n</answer>",  # a tag inside a block
    ],
)
def test_strict_format_gives_zero_for_anything_else(as_completion, text):
    assert strict_format(["Q"], [as_completion(text)]) == [0.0]


@pytest.mark.parametrize(
    "text",
    [
        STRICT,
        "<reasoning>x</reasoning><answer>42</answer>",
        "Sure. <reasoning>\nx\ny\n</reasoning> so <answer>42</answer> done",
        "<answer>0</answer><reasoning>x</reasoning>\n<answer>42</answer>",
    ],
)
def test_soft_format_rewards_reasoning_then_answer_anywhere(as_completion, text):
    assert soft_format(["Q"], [as_completion(text)]) == [0.5]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<answer>42</answer><reasoning>x</reasoning>",
        "<reasoning>x</reasoning>",
        "<answer>42</answer>",
        "<reasoning>x<answer>42</answer>",
    ],
)
def test_soft_format_gives_zero_without_both_blocks_in_order(as_completion, text):
    assert soft_format(["Q"], [as_completion(text)]) == [0.0]


def test_tag_count_gives_half_for_all_four_tags_once(as_completion):
    assert tag_count(["Q"], [as_completion(STRICT)]) == [0.5]


def test_tag_count_gives_partial_credit_per_tag(as_completion):
    texts = ["<reasoning>\nx", "<reasoning>\nx\n</reasoning>\nmore", ""]
    completions = [as_completion(text) for text in texts]
    assert tag_count(["Q"] * 3, completions) == [0.125, 0.25, 0.0]


def test_tag_count_gives_no_credit_for_a_repeated_tag(as_completion):
    text = "<reasoning>\na\n</reasoning>\n<reasoning>\nb\n</reasoning>\n<answer>\n4\n</answer>"
    assert tag_count(["Q"], [as_completion(text)]) == [0.25]


def test_tag_count_takes_a_thousandth_per_character_after_the_answer(as_completion):
    assert tag_count(["Q"], [as_completion(STRICT + "\n Bye! \n")]) == [pytest.approx(0.496)]


def test_tag_count_counts_trailing_unicode_by_characters(as_completion):
    assert tag_count(["Q"], [as_completion(STRICT + "日本語")]) == [pytest.approx(0.497)]


def test_tag_count_caps_the_trailing_penalty_at_one_tag(as_completion):
    assert tag_count(["Q"], [as_completion(STRICT + "x" * 10_000)]) == [pytest.approx(0.375)]


@pytest.mark.parametrize(
    "text",
    [
        "<think>6*7</think><answer>42</answer>",
        "<think>\nfirst\nsecond\n</think>\n\n<answer>\n42\n</answer>\n",
        "  <think></think> <answer></answer>",
        "<think>π ≈ 3.14</think><answer>円</answer>",
    ],
)
def test_think_format_rewards_think_then_answer_as_the_whole_completion(as_completion, text):
    assert think_format(["Q"], [as_completion(text)]) == [1.0]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<answer>42</answer>",
        "6*7</think><answer>42</answer>",  # think opened by the chat template
        "Sure. <think>x</think><answer>42</answer>",
        "<think>x</think><answer>42</answer> Bye",
        "<think>x</think> so <answer>42</answer>",
        "<think>x</think><answer>41</answer><answer>42</answer>",
        "<think>x<think>y</think><answer>42</answer>",
        "<answer>42</answer><think>x</think>",
    ],
)
def test_think_format_gives_zero_for_anything_else(as_completion, text):
    assert think_format(["Q"], [as_completion(text)]) == [0.0]


@pytest.mark.parametrize("reward", [strict_format, soft_format, tag_count, think_format])
@pytest.mark.parametrize(
    "completion", [None, 3, [], [{"role": "assistant"}], [{"role": "assistant", "content": None}]]
)
def test_format_rewards_give_zero_for_malformed_completions(reward, completion):
    assert reward(["Q"], [completion]) == [0.0]
