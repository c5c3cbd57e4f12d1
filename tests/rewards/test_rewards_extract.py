import pytest

from rfopt.rewards import completion_text, extract_answer, extract_gsm8k_answer, normalize_answer, normalize_number
from rfopt.rewards.extract import completion_texts, find_gold_column


def test_completion_text_reads_plain_and_conversational_completions(as_completion):
    assert completion_text(as_completion("héllo <answer>4</answer>")) == "héllo <answer>4</answer>"


def test_completion_text_reads_the_last_assistant_message_after_tool_calls():
    completion = [
        {"role": "assistant", "content": "calling a tool"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "<answer>42</answer>"},
    ]
    assert completion_text(completion) == "<answer>42</answer>"


def test_completion_text_joins_text_parts_of_multimodal_content():
    completion = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, "b"]}]
    assert completion_text(completion) == "ab"


@pytest.mark.parametrize(
    "completion",
    [
        None,
        5,
        3.5,
        [],
        [None],
        [{"role": "assistant"}],
        [{"role": "assistant", "content": None}],
        [{"role": "tool", "content": "x"}],
    ],
)
def test_completion_text_gives_empty_text_for_malformed_completions(completion):
    assert completion_text(completion) == ""


def test_completion_texts_rejects_a_single_string_instead_of_a_list():
    with pytest.raises(TypeError, match="reward function 'correctness': completions must be a list"):
        completion_texts("<answer>4</answer>", "correctness")


def test_extract_answer_takes_the_last_closed_block():
    assert extract_answer("<answer>1</answer> wait, <answer>\n 2 \n</answer> done") == "2"


def test_extract_answer_ignores_a_trailing_unclosed_block():
    assert extract_answer("<answer>1</answer> <answer>2") == "1"


def test_extract_answer_takes_the_innermost_of_nested_openers():
    assert extract_answer("<answer>1<answer>2</answer>") == "2"


@pytest.mark.parametrize(
    "text", ["", "no tags", "<answer>open only", "</answer><answer>", "<ANSWER>4</ANSWER>", None, 4]
)
def test_extract_answer_returns_none_without_a_closed_block(text):
    assert extract_answer(text) is None


def test_extract_answer_returns_empty_text_for_an_empty_block():
    assert extract_answer("<answer>\n</answer>") == ""


def test_extract_answer_keeps_unicode():
    assert extract_answer("<answer>π ≈ 3,14 — ok</answer>") == "π ≈ 3,14 — ok"


def test_extract_gsm8k_answer_removes_commas_and_whitespace():
    assert extract_gsm8k_answer("3 * 400 = 1,200 dollars.\n#### 1,200 \n") == "1200"


@pytest.mark.parametrize("text", ["1200", "", None, 1200])
def test_extract_gsm8k_answer_returns_none_without_marker(text):
    assert extract_gsm8k_answer(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", "12"),
        ("1,234", "1234"),
        ("1,234,567.50", "1234567.5"),
        ("$12", "12"),
        ("\\$12", "12"),
        ("-$3", "-3"),
        ("€5", "5"),
        ("12 dollars", "12"),
        ("12 dollars per hour", "12"),
        ("5 km/h", "5"),
        ("40%", "40"),
        ("12.", "12"),
        ("12.0", "12"),
        ("012", "12"),
        ("+12", "12"),
        ("-0", "0"),
        ("−7", "-7"),
        (".5", "0.5"),
        ("0.50", "0.5"),
        ("\\boxed{12}", "12"),
        ("$\\boxed{1,234}$", "1234"),
        ("\\boxed{\\text{12}}", "12"),
        ("12\\text{ dollars}", "12"),
        ("1\\,234", "1234"),
        ("1{,}234", "1234"),
        ("  7\n", "7"),
        ("99999999999999999999999999999999.5000", "99999999999999999999999999999999.5"),
    ],
)
def test_normalize_number_gives_canonical_form(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text", ["\\frac{1}{2}", "1/2", "the answer is 12", "12 x 3", "12 + y", "1e3", "+-7", "", ".", "twelve", None, 12]
)
def test_normalize_number_returns_none_for_non_numbers(text):
    assert normalize_number(text) is None


def test_normalize_answer_keeps_non_numbers_as_text_with_whitespace_collapsed():
    assert normalize_answer("  \\frac{1}{2}\n.") == "\\frac{1}{2}"
    assert normalize_answer("New  York") == "New York"


def test_find_gold_column_takes_the_first_column_present():
    columns = {"solution": None, "answer": ["a", "b"], "final_answer": ["c", "d"]}
    assert find_gold_column(columns, ("solution", "answer", "final_answer"), 2, "r") == ["a", "b"]


def test_find_gold_column_names_the_reward_and_columns_when_none_is_present():
    with pytest.raises(ValueError, match=r"'math_accuracy': no gold column.*\['question'\]"):
        find_gold_column({"question": ["q"], "trainer_state": None}, ("solution",), 1, "math_accuracy")


def test_find_gold_column_rejects_a_single_string_or_wrong_length():
    with pytest.raises(ValueError, match="single str"):
        find_gold_column({"answer": "12"}, ("answer",), 2, "correctness")
    with pytest.raises(ValueError, match="'answer' has 1 values for 2 completions"):
        find_gold_column({"answer": ["12"]}, ("answer",), 2, "correctness")
