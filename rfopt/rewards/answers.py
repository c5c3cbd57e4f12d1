"""Rewards on the answer inside the last ``<answer>...</answer>`` block (GSM8K style)."""

import re
from collections.abc import Sequence
from typing import Any

from .extract import (
    completion_texts,
    extract_answer,
    extract_gsm8k_answer,
    find_gold_column,
    gold_text,
    normalize_answer,
)

CORRECT_REWARD = 2.0
INTEGER_REWARD = 0.5
_INTEGER = re.compile(r"[+-]?[0-9]+")


def correctness(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """2.0 when the last ``<answer>`` block equals the gold ``answer`` column after normalization, else 0.0.

    The gold may be a full GSM8K solution (the part after the last ``####`` counts) or a bare
    answer; numbers compare by value in canonical form ("1,234" == "1234", "$12" == "12 dollars"
    == "12.0"), anything else as exact text (see ``rfopt.rewards.extract.normalize_answer``). No
    ``<answer>`` block, or a wrong one, gives 0.0. A gold that is None, empty or not text gives
    None, which TRL skips: nothing can be judged against it.

    >>> correctness(["Q"], ["<answer>1,200</answer>"], answer=["#### 1200"])
    [2.0]
    """
    texts = completion_texts(completions, "correctness")
    golds = find_gold_column({**kwargs, "answer": answer}, ("answer",), len(texts), "correctness")
    rewards: list[float | None] = []
    for text, gold in zip(texts, golds):
        gold_str = gold_text(gold)
        if gold_str is not None:
            gsm8k = extract_gsm8k_answer(gold_str)
            gold_str = normalize_answer(gold_str if gsm8k is None else gsm8k)
        if not gold_str:
            rewards.append(None)
            continue
        predicted = extract_answer(text)
        correct = predicted is not None and normalize_answer(predicted) == gold_str
        rewards.append(CORRECT_REWARD if correct else 0.0)
    return rewards


def integer_answer(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.5 when the last ``<answer>`` block is an integer (ASCII digits, optional sign), else 0.0.

    Strict on purpose, to teach a bare-number answer: "1,234", "12.0" and "12 dollars" get 0.0.

    >>> integer_answer(["Q"], ["<answer> -7 </answer>", "<answer>7.5</answer>"])
    [0.5, 0.0]
    """
    texts = completion_texts(completions, "integer_answer")
    answers = [extract_answer(text) for text in texts]
    return [INTEGER_REWARD if a is not None and _INTEGER.fullmatch(a) else 0.0 for a in answers]
