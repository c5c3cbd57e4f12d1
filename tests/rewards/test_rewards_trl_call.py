"""Every reward called exactly the way TRL's GRPOTrainer calls it, on a batch of awkward completions."""

import math
import pickle

import pytest
from trl.trainer.utils import get_callable_name, is_async_callable

from rfopt import rewards

REWARDS = {
    "correctness": rewards.correctness,
    "integer_answer": rewards.integer_answer,
    "strict_format": rewards.strict_format,
    "soft_format": rewards.soft_format,
    "tag_count": rewards.tag_count,
    "think_format": rewards.think_format,
    "math_accuracy": rewards.math_accuracy,
    "soft_overlong_punishment": rewards.soft_overlong_punishment(max_completion_length=8, soft_punish_cache=4),
    "length_reward": rewards.length_reward(target_length=4),
}

TEXTS = [
    "<reasoning>\n6*7\n</reasoning>\n<answer>\n42\n</answer>",
    "<think>π</think><answer>1,234</answer>",
    "",
    "<answer>1</answer><answer>\\frac{1}{2}</answer> trailing",
    "no tags at all ☃",
    "<answer>$12 dollars</answer>",
]
GOLDS = ["#### 42", "1234", None, "\\frac{1}{2}", "7", "}{"]


@pytest.mark.parametrize("name", list(REWARDS))
def test_reward_takes_trl_keywords_and_returns_one_value_per_completion(name, as_completion):
    reward = REWARDS[name]
    logged_columns, logged_metrics = {}, {}
    values = reward(
        prompts=[[{"role": "user", "content": "What is it?"}]] * len(TEXTS),
        completions=[as_completion(text) for text in TEXTS],
        completion_ids=[list(range(i * 2)) for i in range(len(TEXTS))],
        answer=GOLDS,
        solution=GOLDS,
        question=["What is it?"] * len(TEXTS),
        trainer_state=None,
        log_extra=lambda column, column_values: logged_columns.update({column: column_values}),
        log_metric=lambda metric, value: logged_metrics.update({metric: value}),
    )
    assert len(values) == len(TEXTS)
    assert all(v is None or (type(v) is float and math.isfinite(v)) for v in values)


@pytest.mark.parametrize("name", list(REWARDS))
def test_reward_has_its_metric_name_and_is_synchronous_and_picklable_for_trl(name):
    reward = REWARDS[name]
    assert get_callable_name(reward) == name
    assert not is_async_callable(reward)
    assert get_callable_name(pickle.loads(pickle.dumps(reward))) == name
