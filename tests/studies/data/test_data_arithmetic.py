import re

import pytest

from rfopt.studies.data import REASONING_SYSTEM_PROMPT, gsm8k_final_answer, load_arithmetic

# One worked-solution step: "... 7 * 4 = 28 ..."
_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_same_seed_gives_identical_datasets():
    first = load_arithmetic(n_train=64, n_test=16, seed=3)
    again = load_arithmetic(n_train=64, n_test=16, seed=3)
    assert first.train.to_list() == again.train.to_list()
    assert first.test.to_list() == again.test.to_list()


def test_different_seeds_give_different_questions():
    a = load_arithmetic(n_train=32, n_test=8, seed=0)
    b = load_arithmetic(n_train=32, n_test=8, seed=1)
    assert a.train["question"] != b.train["question"]
    assert a.test["question"] != b.test["question"]


def test_sizes_are_respected_and_no_question_is_repeated_or_shared():
    train, test = load_arithmetic(n_train=300, n_test=50, seed=0)
    assert (len(train), len(test)) == (300, 50)
    assert len(set(train["question"])) == 300
    assert len(set(test["question"])) == 50
    assert not set(train["question"]) & set(test["question"])


def test_test_set_does_not_change_with_n_train():
    _, small = load_arithmetic(n_train=8, n_test=16, seed=5)
    _, large = load_arithmetic(n_train=200, n_test=16, seed=5)
    assert small["question"] == large["question"]


def test_rows_are_conversations_with_gsm8k_style_solutions():
    train, _ = load_arithmetic(n_train=40, n_test=4, seed=0)
    assert set(train.column_names) == {"prompt", "question", "answer", "solution", "template"}
    for row in train:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": REASONING_SYSTEM_PROMPT}
        assert user == {"role": "user", "content": row["question"]}
        assert row["answer"].isdigit()
        assert gsm8k_final_answer(row["solution"]) == row["answer"]
    assert len(set(train["template"])) >= 5


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_every_worked_step_is_correct_arithmetic_ending_at_the_answer(difficulty):
    train, test = load_arithmetic(n_train=200, n_test=20, seed=7, difficulty=difficulty)
    for row in list(train) + list(test):
        steps = _STEP.findall(row["solution"])
        assert steps, row["solution"]
        for a, op, b, result in steps:
            a, b, result = int(a), int(b), int(result)
            expected = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
            assert expected == result, row["solution"]
        assert steps[-1][3] == row["answer"]


def test_first_tier_uses_one_or_two_operations_on_numbers_below_100():
    train, _ = load_arithmetic(n_train=300, n_test=10, seed=0, difficulty=1)
    for row in train:
        assert 1 <= len(_STEP.findall(row["solution"])) <= 2, row["solution"]
        numbers = [int(n) for n in re.findall(r"\d+", row["question"] + row["solution"])]
        assert max(numbers) < 100, row["question"]


def test_harder_tiers_use_more_steps_and_larger_numbers():
    easy, _ = load_arithmetic(n_train=200, n_test=1, difficulty=1)
    hard, _ = load_arithmetic(n_train=200, n_test=1, difficulty=3)
    assert all(len(_STEP.findall(s)) == 3 for s in hard["solution"])
    assert max(int(a) for a in hard["answer"]) > max(int(a) for a in easy["answer"])


def test_system_prompt_can_be_replaced_or_left_out():
    custom, _ = load_arithmetic(n_train=2, n_test=1, system_prompt="Be brief.")
    bare, _ = load_arithmetic(n_train=2, n_test=1, system_prompt=None)
    assert custom[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in bare[0]["prompt"]] == ["user"]


def test_bad_arguments_are_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="difficulty=4"):
        load_arithmetic(difficulty=4)
    with pytest.raises(ValueError, match="n_train=-1"):
        load_arithmetic(n_train=-1)
