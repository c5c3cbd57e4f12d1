"""Reward functions for GRPO with TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``.

Each accepts plain (``str``) or conversational (``[{"role": "assistant", "content": ...}]``)
completions, returns one value per completion, and never raises for a malformed completion
(it scores 0.0, or None where the example cannot be judged; TRL skips None).

=============================  =========================================================  ==============
reward                         gives                                                      needs column
=============================  =========================================================  ==============
``correctness``                2.0 if the last ``<answer>`` equals the gold, else 0.0     ``answer``
``integer_answer``             0.5 if the last ``<answer>`` is an integer                 -
``strict_format``              0.5 for exactly reasoning block + answer block, own lines  -
``soft_format``                0.5 for a reasoning block, later an answer block           -
``tag_count``                  0.125 per tag present once, minus trailing-text penalty    -
``think_format``               1.0 for exactly ``<think>`` block + ``<answer>`` block     -
``math_accuracy``              1.0/0.0 by math_verify; None if the gold won't parse       ``final_answer``,
                                                                                          ``solution`` or
                                                                                          ``answer``
``soft_overlong_punishment()`` factory: 0 to -1.0 past ``max - cache`` tokens             (``completion_ids``)
``length_reward()``            factory: 1.0 at a target length, 0.0 at ``tolerance`` off  (``completion_ids``)
``math_accuracy_for()``        factory: ``math_accuracy`` with another gold-column order  chosen column
=============================  =========================================================  ==============

Factory products carry ``rfopt_factory = (import path, kwargs)``, from which rfopt stores a
trial's rewards by import path and rebuilds them (``rfopt.config.codec``).

>>> from rfopt import rewards
>>> rewards.correctness(["Q"], [[{"role": "assistant", "content": "<answer>$1,200</answer>"}]], answer=["#### 1200"])
[2.0]
"""

from .answers import correctness, integer_answer
from .extract import completion_text, extract_answer, extract_gsm8k_answer, normalize_answer, normalize_number
from .formats import soft_format, strict_format, tag_count, think_format
from .length import completion_lengths, length_reward, soft_overlong_punishment
from .math_answers import math_accuracy, math_accuracy_for
from .spec import FactoryReward, RewardFunc

__all__ = [
    "FactoryReward",
    "RewardFunc",
    "completion_lengths",
    "completion_text",
    "correctness",
    "extract_answer",
    "extract_gsm8k_answer",
    "integer_answer",
    "length_reward",
    "math_accuracy",
    "math_accuracy_for",
    "normalize_answer",
    "normalize_number",
    "soft_format",
    "soft_overlong_punishment",
    "strict_format",
    "tag_count",
    "think_format",
]
