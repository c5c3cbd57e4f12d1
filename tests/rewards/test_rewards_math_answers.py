import threading

import pytest

from rfopt.rewards import math_accuracy, math_accuracy_for


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\dfrac{1}{2}"),
        ("\\sqrt{2}", "\\sqrt{2}"),
        ("2^{1/2}", "\\sqrt{2}"),
        ("$1,234$", "1234"),
        ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
        ("72 dollars", "72"),
        ("$72", "#### 72"),
        ("(1, 2)", "(1,2)"),
        ("x^2 + 1", "1 + x^2"),
    ],
)
def test_math_accuracy_rewards_mathematically_equal_answers(as_completion, predicted, gold):
    assert math_accuracy(["Q"], [as_completion(f"<answer>{predicted}</answer>")], final_answer=[gold]) == [1.0]


def test_math_accuracy_gives_zero_for_a_different_value(as_completion):
    completions = [as_completion("<answer>\\frac{1}{3}</answer>"), as_completion("<answer>0.6</answer>")]
    assert math_accuracy(["Q", "Q"], completions, final_answer=["0.5", "0.5"]) == [0.0, 0.0]


@pytest.mark.parametrize(("predicted", "gold"), [("(1, 2)", "2"), ("2^{1/2}", "2"), ("2", "2^{1/2}"), ("x^2", "x^3")])
def test_math_accuracy_reads_a_bare_answer_as_a_whole_expression_not_its_last_number(as_completion, predicted, gold):
    assert math_accuracy(["Q"], [as_completion(f"<answer>{predicted}</answer>")], final_answer=[gold]) == [0.0]


def test_math_accuracy_finds_a_boxed_answer_in_a_completion_without_answer_tags(as_completion):
    completion = as_completion("Adding up, 3 + 4 = 7, so the result is $\\boxed{7}$.")
    assert math_accuracy(["Q"], [completion], solution=["Hence the answer is $\\boxed{7}$."]) == [1.0]


def test_math_accuracy_scores_the_last_answer_block(as_completion):
    completion = as_completion("<answer>3</answer> Let me fix that. <answer>4</answer>")
    assert math_accuracy(["Q"], [completion], final_answer=["4"]) == [1.0]


def test_math_accuracy_reads_gsm8k_gold_after_the_marker(as_completion):
    gold = "She has 3 + 4 = 7 apples, then 7 * 10 = 70.\n#### 70"
    assert math_accuracy(["Q"], [as_completion("<answer>70</answer>")], answer=[gold]) == [1.0]


def test_math_accuracy_prefers_final_answer_then_solution_then_answer(as_completion):
    completion = [as_completion("<answer>1</answer>")]
    assert math_accuracy(["Q"], completion, final_answer=["1"], solution=["$2$"], answer=["3"]) == [1.0]
    assert math_accuracy(["Q"], completion, solution=["$1$"], answer=["3"]) == [1.0]
    assert math_accuracy(["Q"], completion, final_answer=None, answer=["1"]) == [1.0]


def test_math_accuracy_for_reads_the_columns_it_was_given(as_completion):
    reward = math_accuracy_for(["solution"])
    completion = [as_completion("<answer>2</answer>")]
    assert reward(["Q"], completion, final_answer=["1"], solution=["$\\boxed{2}$"]) == [1.0]
    assert reward.__name__ == "math_accuracy"


@pytest.mark.parametrize("gold", [None, "", "   ", "}{", "\\", True, ["1"]])
def test_math_accuracy_skips_gold_that_does_not_parse(as_completion, gold):
    assert math_accuracy(["Q"], [as_completion("<answer>1</answer>")], final_answer=[gold]) == [None]


@pytest.mark.parametrize("completion", ["", "no answer here", "<answer></answer>", "<answer>}{</answer>", None, 5, []])
def test_math_accuracy_gives_zero_for_empty_or_malformed_completions(completion):
    assert math_accuracy(["Q"], [completion], final_answer=["1"]) == [0.0]


def test_math_accuracy_works_off_the_main_thread(as_completion):
    # math_verify's signal-based timeouts raise ValueError outside the main thread.
    results = []
    completions = [as_completion("<answer>\\frac{1}{2}</answer>"), as_completion("<answer>3</answer>")]
    thread = threading.Thread(
        target=lambda: results.append(math_accuracy(["Q"] * 2, completions, final_answer=["0.5"] * 2))
    )
    thread.start()
    thread.join()
    assert results == [[1.0, 0.0]]


def test_math_accuracy_raises_when_no_gold_column_is_passed():
    with pytest.raises(ValueError, match=r"'math_accuracy': no gold column.*\['final_answer', 'solution', 'answer'\]"):
        math_accuracy(["Q"], ["<answer>1</answer>"], question=["Q"])


@pytest.mark.parametrize("columns", [[], "solution", [""], [3], None])
def test_math_accuracy_for_rejects_columns_that_are_not_a_list_of_names(columns):
    with pytest.raises(ValueError, match="gold_columns must be a non-empty list of column names"):
        math_accuracy_for(columns)
