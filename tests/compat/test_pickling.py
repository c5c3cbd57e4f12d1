"""Canaries for rfopt/compat/_pickling.py (instances stored as pickle stores them): each fails loudly when what it
relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

from rfopt import compat


# ---------------------------------------------------------------------- plain_object_state
def test_trls_factory_rewards_are_plain_objects_whose_state_is_their_arguments():
    import functools

    import trl.rewards
    from rfopt_callbacks import RecordingCallback
    from rfopt_testkit import reward_len

    for reward, arguments in ((trl.rewards.get_soft_overlong_punishment(8, 4), {"max_completion_len": 8,
                                                                                "soft_punish_cache": 4}),
                              (trl.rewards.get_repetition_penalty_reward(2, -0.5), {"ngram_size": 2,
                                                                                    "max_penalty": -0.5})):
        assert compat.object_state(reward) == arguments
        again = compat.object_from_state(type(reward), compat.object_state(reward))
        assert again(completion_ids=[[1, 2, 1, 2, 1], [3]]) == reward(completion_ids=[[1, 2, 1, 2, 1], [3]])
    callback = RecordingCallback()
    callback.tag = "x"
    assert compat.object_state(callback) == {"tag": "x"}
    for not_plain in (reward_len, RecordingCallback, functools.partial(reward_len), print, 3, "text"):
        assert compat.object_state(not_plain) is None
