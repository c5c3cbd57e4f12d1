"""Every reward round-trips through the form rfopt stores it in (a trial's config JSON)."""

import json

import pytest

from rfopt import rewards
from rfopt.config.trial import reward_from_json, reward_to_json


@pytest.mark.parametrize(
    ("reward", "path"),
    [
        (rewards.correctness, "rfopt.rewards.answers:correctness"),
        (rewards.integer_answer, "rfopt.rewards.answers:integer_answer"),
        (rewards.strict_format, "rfopt.rewards.formats:strict_format"),
        (rewards.soft_format, "rfopt.rewards.formats:soft_format"),
        (rewards.tag_count, "rfopt.rewards.formats:tag_count"),
        (rewards.think_format, "rfopt.rewards.formats:think_format"),
        (rewards.math_accuracy, "rfopt.rewards.math_answers:math_accuracy"),
    ],
)
def test_plain_rewards_round_trip_through_their_import_path(reward, path):
    assert reward_to_json(reward) == path
    assert reward_from_json(path) is reward


@pytest.mark.parametrize(
    "reward",
    [
        rewards.soft_overlong_punishment(max_completion_length=256, soft_punish_cache=64),
        rewards.length_reward(target_length=100, tolerance=50),
        rewards.math_accuracy_for(["solution", "answer"]),
    ],
)
def test_factory_rewards_round_trip_through_json(reward):
    rebuilt = reward_from_json(json.loads(json.dumps(reward_to_json(reward))))
    assert type(rebuilt) is type(reward)
    assert rebuilt.rfopt_factory == reward.rfopt_factory
    assert rebuilt.__name__ == reward.__name__


def test_every_public_name_is_importable():
    assert all(hasattr(rewards, name) for name in rewards.__all__)
