"""Rewards on completion length, built by factories from their length limits."""

from collections.abc import Sequence
from typing import Any

from rfopt.errors import Refusal
from rfopt.values import is_int

from .extract import completion_texts
from .spec import FactoryReward


def completion_lengths(completions: Sequence[Any], completion_ids: Sequence[Any] | None, reward: str) -> list[int]:
    """Length of each completion: its token count from ``completion_ids`` (TRL passes it), else its word count.

    The fallback, for a call without token ids or an entry that is not a sequence, counts
    whitespace-separated words: roughly tokens for English text, far closer than characters.
    """
    texts = completion_texts(completions, reward)
    if completion_ids is None:
        return [len(text.split()) for text in texts]
    if len(completion_ids) != len(texts):
        raise Refusal(
            f"reward function '{reward}': completion_ids has {len(completion_ids)} entries "
            f"for {len(texts)} completions"
        )
    return [
        len(ids) if hasattr(ids, "__len__") and not isinstance(ids, str) else len(text.split())
        for ids, text in zip(completion_ids, texts)
    ]


def soft_overlong_punishment(max_completion_length: int, soft_punish_cache: int) -> "SoftOverlongPunishment":
    """Return DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) for these limits.

    With ``L = max_completion_length`` and ``C = soft_punish_cache``, a completion of length ``n``
    gets 0.0 when ``n <= L - C``, ``(L - C - n) / C`` when ``L - C < n <= L`` (linear from 0 down
    to -1.0), and -1.0 when ``n > L``. ``C = 0`` punishes only ``n > L``. Length is in tokens (see
    :func:`completion_lengths`). The reward's metric name is ``soft_overlong_punishment``.

    >>> punish = soft_overlong_punishment(max_completion_length=100, soft_punish_cache=20)
    >>> punish(None, ["", ""], completion_ids=[[0] * 80, [0] * 90])
    [0.0, -0.5]
    """
    return SoftOverlongPunishment(max_completion_length, soft_punish_cache)


class SoftOverlongPunishment(FactoryReward):
    """Made by :func:`soft_overlong_punishment`; see there."""

    def __init__(self, max_completion_length: int, soft_punish_cache: int) -> None:
        errors = []
        if not is_int(max_completion_length) or max_completion_length < 1:
            errors.append(f"max_completion_length must be an integer >= 1, got {max_completion_length!r}")
        if not is_int(soft_punish_cache) or soft_punish_cache < 0:
            errors.append(f"soft_punish_cache must be an integer >= 0, got {soft_punish_cache!r}")
        elif is_int(max_completion_length) and soft_punish_cache > max_completion_length:
            errors.append(
                f"soft_punish_cache ({soft_punish_cache}) must not exceed "
                f"max_completion_length ({max_completion_length})"
            )
        if errors:
            raise Refusal("soft_overlong_punishment: " + "; ".join(errors))
        self.max_completion_length = max_completion_length
        self.soft_punish_cache = soft_punish_cache
        super().__init__(
            "soft_overlong_punishment",
            "rfopt.rewards.length:soft_overlong_punishment",
            {"max_completion_length": max_completion_length, "soft_punish_cache": soft_punish_cache},
        )

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        start = self.max_completion_length - self.soft_punish_cache
        rewards = []
        for n in completion_lengths(completions, completion_ids, self.__name__):
            if n <= start:
                rewards.append(0.0)
            elif n <= self.max_completion_length:
                rewards.append((start - n) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def length_reward(target_length: int, tolerance: int | None = None) -> "LengthReward":
    """Return a reward peaking at 1.0 for completions of ``target_length`` tokens.

    A completion of length ``n`` gets ``max(0, 1 - |n - target_length| / tolerance)``: 1.0 on
    target, falling linearly to 0.0 at ``tolerance`` tokens away in either direction, never
    negative. ``tolerance`` defaults to ``target_length`` (so 0 and twice the target score 0.0).
    Length is in tokens (see :func:`completion_lengths`). The metric name is ``length_reward``.

    >>> near_100 = length_reward(target_length=100, tolerance=50)
    >>> near_100(None, ["", "", ""], completion_ids=[[0] * 100, [0] * 125, [0] * 200])
    [1.0, 0.5, 0.0]
    """
    return LengthReward(target_length, tolerance)


class LengthReward(FactoryReward):
    """Made by :func:`length_reward`; see there."""

    def __init__(self, target_length: int, tolerance: int | None = None) -> None:
        errors = []
        if not is_int(target_length) or target_length < 0:
            errors.append(f"target_length must be an integer >= 0, got {target_length!r}")
        effective = target_length if tolerance is None else tolerance
        if not is_int(effective) or effective < 1:
            errors.append(f"tolerance must be an integer >= 1 (it defaults to target_length), got {effective!r}")
        if errors:
            raise Refusal("length_reward: " + "; ".join(errors))
        self.target_length = target_length
        self.tolerance = effective
        super().__init__(
            "length_reward",
            "rfopt.rewards.length:length_reward",
            {"target_length": target_length, "tolerance": tolerance},
        )

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        return [
            max(0.0, 1.0 - abs(n - self.target_length) / self.tolerance)
            for n in completion_lengths(completions, completion_ids, self.__name__)
        ]

