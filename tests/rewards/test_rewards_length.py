import pickle

import pytest
import torch

from rfopt.rewards import completion_lengths, length_reward, soft_overlong_punishment


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (192, 0.0), (193, -1 / 64), (224, -0.5), (256, -1.0), (257, -1.0), (10_000, -1.0)],
)
def test_soft_overlong_punishment_is_zero_then_linear_down_to_minus_one(length, expected):
    punish = soft_overlong_punishment(max_completion_length=256, soft_punish_cache=64)
    assert punish(["Q"], ["x"], completion_ids=[[7] * length]) == [pytest.approx(expected)]


def test_soft_overlong_punishment_without_cache_punishes_only_past_the_limit():
    punish = soft_overlong_punishment(max_completion_length=10, soft_punish_cache=0)
    assert punish(["Q"] * 2, ["", ""], completion_ids=[[0] * 10, [0] * 11]) == [0.0, -1.0]


def test_soft_overlong_punishment_counts_words_without_completion_ids(as_completion):
    punish = soft_overlong_punishment(max_completion_length=4, soft_punish_cache=2)
    completions = [as_completion(text) for text in ["one two", "one two three", "a b c d e", ""]]
    assert punish(["Q"] * 4, completions) == [0.0, -0.5, -1.0, 0.0]


def test_soft_overlong_punishment_reads_tensor_token_ids():
    punish = soft_overlong_punishment(max_completion_length=4, soft_punish_cache=2)
    assert punish(["Q"], [""], completion_ids=[torch.zeros(3, dtype=torch.long)]) == [-0.5]


def test_soft_overlong_punishment_validates_all_arguments_at_once():
    with pytest.raises(ValueError, match="max_completion_length must be an integer >= 1.*soft_punish_cache must be"):
        soft_overlong_punishment(max_completion_length=0, soft_punish_cache=-1)
    with pytest.raises(ValueError, match=r"soft_punish_cache \(300\) must not exceed max_completion_length \(256\)"):
        soft_overlong_punishment(max_completion_length=256, soft_punish_cache=300)
    with pytest.raises(ValueError, match="max_completion_length must be an integer"):
        soft_overlong_punishment(max_completion_length=256.0, soft_punish_cache=64)


def test_soft_overlong_punishment_carries_its_name_and_factory_arguments():
    punish = soft_overlong_punishment(max_completion_length=256, soft_punish_cache=64)
    assert punish.__name__ == "soft_overlong_punishment"
    assert punish.rfopt_factory == (
        "rfopt.rewards.length:soft_overlong_punishment",
        {"max_completion_length": 256, "soft_punish_cache": 64},
    )


@pytest.mark.parametrize(("length", "expected"), [(100, 1.0), (75, 0.5), (125, 0.5), (150, 0.0), (0, 0.0), (400, 0.0)])
def test_length_reward_peaks_at_the_target_and_falls_linearly_to_zero(length, expected):
    near_100 = length_reward(target_length=100, tolerance=50)
    assert near_100(["Q"], ["x"], completion_ids=[[1] * length]) == [pytest.approx(expected)]


def test_length_reward_tolerance_defaults_to_the_target_length():
    near_10 = length_reward(target_length=10)
    assert near_10(["Q"] * 3, ["", "", ""], completion_ids=[[0] * 5, [0] * 20, []]) == [0.5, 0.0, 0.0]
    assert near_10.rfopt_factory == ("rfopt.rewards.length:length_reward", {"target_length": 10, "tolerance": None})


def test_length_reward_counts_words_without_completion_ids(as_completion):
    near_2 = length_reward(target_length=2, tolerance=2)
    completions = [as_completion("un deux"), as_completion("ünï"), as_completion("")]
    assert near_2(["Q"] * 3, completions) == [1.0, 0.5, 0.0]


def test_length_reward_validates_all_arguments_at_once():
    with pytest.raises(ValueError, match="target_length must be an integer >= 0.*tolerance must be an integer >= 1"):
        length_reward(target_length=-1, tolerance=0)
    with pytest.raises(ValueError, match="defaults to target_length"):
        length_reward(target_length=0)


def test_length_rewards_survive_pickling_for_trl_rollout_workers():
    for reward in (soft_overlong_punishment(256, 64), length_reward(100, 50)):
        copy = pickle.loads(pickle.dumps(reward))
        assert copy.__name__ == reward.__name__
        assert copy.rfopt_factory == reward.rfopt_factory
        assert copy(["Q"], [""], completion_ids=[[0] * 240]) == reward(["Q"], [""], completion_ids=[[0] * 240])


def test_completion_lengths_falls_back_to_words_for_entries_without_ids():
    assert completion_lengths(["a b c", "d"], [[1, 2], None], "r") == [2, 1]


def test_completion_lengths_rejects_completion_ids_of_the_wrong_length():
    with pytest.raises(ValueError, match="'r': completion_ids has 1 entries for 2 completions"):
        completion_lengths(["a", "b"], [[1]], "r")
