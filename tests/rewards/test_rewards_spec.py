import json

import pytest

import rewards
from rewards import load_reward, reward_spec


@pytest.mark.parametrize(
    ("reward", "path"),
    [
        (rewards.correctness, "rewards.answers:correctness"),
        (rewards.integer_answer, "rewards.answers:integer_answer"),
        (rewards.strict_format, "rewards.formats:strict_format"),
        (rewards.soft_format, "rewards.formats:soft_format"),
        (rewards.tag_count, "rewards.formats:tag_count"),
        (rewards.think_format, "rewards.formats:think_format"),
        (rewards.math_accuracy, "rewards.math_answers:math_accuracy"),
    ],
)
def test_plain_rewards_round_trip_through_their_import_path(reward, path):
    assert reward_spec(reward) == (path, None)
    assert load_reward(path) is reward


@pytest.mark.parametrize(
    "reward",
    [
        rewards.soft_overlong_punishment(max_completion_length=256, soft_punish_cache=64),
        rewards.length_reward(target_length=100, tolerance=50),
        rewards.math_accuracy_for(["solution", "answer"]),
    ],
)
def test_factory_rewards_round_trip_through_json(reward):
    path, kwargs = json.loads(json.dumps(reward_spec(reward)))
    rebuilt = load_reward(path, kwargs)
    assert type(rebuilt) is type(reward)
    assert rebuilt.rfopt_factory == reward.rfopt_factory
    assert rebuilt.__name__ == reward.__name__


def test_reward_spec_refuses_functions_that_cannot_be_imported_back():
    with pytest.raises(ValueError, match="cannot be rebuilt from an import path"):
        reward_spec(lambda prompts, completions, **kwargs: [0.0] * len(completions))


def test_load_reward_rejects_a_path_without_a_colon():
    with pytest.raises(ValueError, match="must look like 'package.module:name'"):
        load_reward("rewards.answers.correctness")


def test_every_public_name_is_importable():
    assert all(hasattr(rewards, name) for name in rewards.__all__)
