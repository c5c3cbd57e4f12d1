import pytest

from rfopt.rewards import correctness, integer_answer


def test_correctness_gives_two_for_the_right_answer_and_zero_for_a_wrong_one(as_completion):
    completions = [
        as_completion("<reasoning>\n6*7\n</reasoning>\n<answer>\n42\n</answer>"),
        as_completion("<answer>41</answer>"),
    ]
    assert correctness(["Q", "Q"], completions, answer=["42", "42"]) == [2.0, 0.0]


def test_correctness_reads_the_gold_after_the_gsm8k_marker(as_completion):
    gold = "Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72"
    assert correctness(["Q"], [as_completion("<answer>72</answer>")], answer=[gold]) == [2.0]


def test_correctness_ignores_commas_in_gold(as_completion):
    assert correctness(["Q"], [as_completion("<answer>1234</answer>")], answer=["#### 1,234"]) == [2.0]


@pytest.mark.parametrize(
    "predicted", ["1,200", "$1,200", "1200 dollars", "1200.", "1200.0", "\\boxed{1200}", "$\\boxed{1,200}$", "+1200"]
)
def test_correctness_matches_numbers_written_with_commas_units_or_latex(as_completion, predicted):
    assert correctness(["Q"], [as_completion(f"<answer>{predicted}</answer>")], answer=["1200"]) == [2.0]


def test_correctness_scores_the_last_answer_block(as_completion):
    completions = [
        as_completion("<answer>5</answer> no: <answer>6</answer>"),
        as_completion("<answer>6</answer><answer>5</answer>"),
    ]
    assert correctness(["Q", "Q"], completions, answer=["6", "6"]) == [2.0, 0.0]


@pytest.mark.parametrize(
    "text", ["", "42", "The answer is 42.", "<answer>42", "<answer></answer>", "<answer>the answer is 42</answer>"]
)
def test_correctness_gives_zero_without_a_matching_answer_block(as_completion, text):
    assert correctness(["Q"], [as_completion(text)], answer=["42"]) == [0.0]


def test_correctness_leaves_fractions_to_math_accuracy(as_completion):
    completions = [as_completion("<answer>\\frac{1}{2}</answer>"), as_completion("<answer>\\frac{1}{2}</answer>")]
    assert correctness(["Q", "Q"], completions, answer=["0.5", "\\frac{1}{2}"]) == [0.0, 2.0]


def test_correctness_compares_non_numeric_answers_as_exact_text(as_completion):
    completions = [as_completion("<answer> Paris </answer>"), as_completion("<answer>paris</answer>")]
    assert correctness(["Q", "Q"], completions, answer=["Paris", "Paris"]) == [2.0, 0.0]


def test_correctness_compares_unicode_answers(as_completion):
    assert correctness(["Q"], [as_completion("<answer>∞</answer>")], answer=["∞"]) == [2.0]


def test_correctness_accepts_numeric_gold_values(as_completion):
    completions = [as_completion("<answer>72</answer>"), as_completion("<answer>0.5</answer>")]
    assert correctness(["Q", "Q"], completions, answer=[72, 0.50]) == [2.0, 2.0]


@pytest.mark.parametrize("gold", [None, "", "   ", "####", True, ["72"]])
def test_correctness_skips_completions_whose_gold_is_missing(as_completion, gold):
    assert correctness(["Q"], [as_completion("<answer>72</answer>")], answer=[gold]) == [None]


@pytest.mark.parametrize("completion", [None, 7, [], [{"role": "assistant"}], {"content": 3}])
def test_correctness_gives_zero_for_malformed_completions(completion):
    assert correctness(["Q"], [completion], answer=["7"]) == [0.0]


def test_correctness_raises_when_the_answer_column_is_missing():
    with pytest.raises(ValueError, match=r"'correctness': no gold column.*\['solution'\]"):
        correctness(["Q"], ["<answer>1</answer>"], solution=["1"])


def test_correctness_raises_when_the_answer_column_has_the_wrong_length():
    with pytest.raises(ValueError, match="'answer' has 1 values for 2 completions"):
        correctness(["Q", "Q"], ["<answer>1</answer>", "<answer>1</answer>"], answer=["1"])


@pytest.mark.parametrize("answer", ["7", "-7", "+7", " 7 ", "\n0042\n"])
def test_integer_answer_rewards_integers(as_completion, answer):
    assert integer_answer(["Q"], [as_completion(f"<answer>{answer}</answer>")]) == [0.5]


@pytest.mark.parametrize("answer", ["7.0", "1,234", "$7", "7 dollars", "seven", "²", "٣", "- 7", ""])
def test_integer_answer_gives_zero_for_anything_but_bare_digits(as_completion, answer):
    assert integer_answer(["Q"], [as_completion(f"<answer>{answer}</answer>")]) == [0.0]


@pytest.mark.parametrize("completion", ["", "7", "<answer>7", None, 7])
def test_integer_answer_gives_zero_without_an_answer_block(completion):
    assert integer_answer(["Q"], [completion]) == [0.0]


def test_integer_answer_reads_the_last_answer_block(as_completion):
    assert integer_answer(["Q"], [as_completion("<answer>x</answer><answer>3</answer>")]) == [0.5]
