"""Symbolic answer checking with math_verify (fractions, roots, intervals, LaTeX)."""

import threading
from collections.abc import Sequence
from typing import Any

from math_verify import parse, verify

from rfopt.errors import Refusal
from .extract import (
    completion_texts,
    extract_answer,
    extract_gsm8k_answer,
    find_gold_column,
    gold_text,
    normalize_number,
)
from .spec import FactoryReward

GOLD_COLUMNS = ("final_answer", "solution", "answer")
"""Where the gold is looked for, in order: DeepMath's bare ``final_answer``, NuminaMath-TIR's
worked ``solution`` (its ``\\boxed{}`` counts), then ``answer`` (GSM8K: the part after ``####``)."""

# math_verify's own limits, in seconds, per parse and per comparison.
TIMEOUT_SECONDS = 5


def math_accuracy(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's answer is mathematically equal to the gold, 0.0 if not, None if the gold is unusable.

    The gold is the first column of :data:`GOLD_COLUMNS` passed (``final_answer``, then
    ``solution``, then ``answer``); use :func:`math_accuracy_for` for another order. The
    prediction is the last ``<answer>`` block when there is one, else the whole completion
    (math_verify then finds a ``\\boxed{}`` or final answer in it). Gold that is None, not text or
    in which math_verify finds no expression gives None: TRL skips it instead of rewarding
    anything. A bare gold or answer block ("\\sqrt{2}", "(1, 2)") is read as LaTeX, as if inside
    ``$...$``; a number with commas, currency or a unit as that number.

    math_verify limits each parse and comparison with ``signal.alarm``, which only works in the
    main thread (and replaces any alarm the caller set). Off the main thread, where TRL or a
    server may call rewards, this runs without those limits instead of failing.

    >>> math_accuracy(["Q"], [r"<answer>\\frac{1}{2}</answer>", "<answer>0.6</answer>"], final_answer=["0.5", "0.5"])
    [1.0, 0.0]
    """
    return _score(completion_texts(completions, "math_accuracy"), kwargs, GOLD_COLUMNS, "math_accuracy")


def math_accuracy_for(gold_columns: Sequence[str]) -> "MathAccuracy":
    """Return :func:`math_accuracy` reading the gold from the first of ``gold_columns`` passed.

    >>> math_accuracy_for(["solution"]).rfopt_factory
    ('rfopt.rewards.math_answers:math_accuracy_for', {'gold_columns': ['solution']})
    """
    return MathAccuracy(gold_columns)


class MathAccuracy(FactoryReward):
    """:func:`math_accuracy` with its own gold-column search order; made by :func:`math_accuracy_for`."""

    def __init__(self, gold_columns: Sequence[str]) -> None:
        is_list = isinstance(gold_columns, Sequence) and not isinstance(gold_columns, str)
        if not is_list or not gold_columns or not all(isinstance(c, str) and c for c in gold_columns):
            raise Refusal(
                f"math_accuracy_for: gold_columns must be a non-empty list of column names, got {gold_columns!r}"
            )
        self.gold_columns = tuple(gold_columns)
        factory_kwargs = {"gold_columns": list(gold_columns)}
        super().__init__("math_accuracy", "rfopt.rewards.math_answers:math_accuracy_for", factory_kwargs)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return _score(completion_texts(completions, self.__name__), kwargs, self.gold_columns, self.__name__)


def _score(texts: list[str], columns: dict[str, Any], gold_columns: Sequence[str], reward: str) -> list[float | None]:
    golds = find_gold_column(columns, gold_columns, len(texts), reward)
    timeout = TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    parsed_golds: dict[str, list] = {}  # TRL repeats each gold num_generations times
    rewards: list[float | None] = []
    for text, gold in zip(texts, golds):
        gold_str = gold_text(gold)
        if gold_str is None:
            rewards.append(None)
            continue
        if gold_str not in parsed_golds:
            parsed_golds[gold_str] = _parse_gold(gold_str, timeout)
        gold_parsed = parsed_golds[gold_str]
        if not gold_parsed:
            rewards.append(None)
            continue
        rewards.append(1.0 if _verify(gold_parsed, _parse_prediction(text, timeout), timeout) else 0.0)
    return rewards


def _parse_gold(gold: str, timeout: int | None) -> list:
    gsm8k = extract_gsm8k_answer(gold)
    parsed = _parse_answer(gold if gsm8k is None else gsm8k, timeout)
    # Only raw strings back means math_verify found no expression, just fell back to the text
    # ("}{"): a gold nothing can be verified against.
    return parsed if any(not isinstance(p, str) for p in parsed) else []


def _parse_prediction(text: str, timeout: int | None) -> list:
    answer = extract_answer(text)
    return _parse(text, timeout) if answer is None else _parse_answer(answer, timeout)


def _parse_answer(text: str, timeout: int | None) -> list:
    """Parse a final answer (a gold column, an ``<answer>`` block) rather than a whole text.

    math_verify, given a bare answer, picks out a number in it: "(1, 2)" and "2^{1/2}" both read
    as 2. Inside ``$...$`` it parses the whole as LaTeX, which is right for those but turns
    "72 dollars" into a product of symbols. So a decorated number goes in as its canonical
    form, text that already has a ``$`` or ``\\boxed`` anchor (a worked solution) as it is, and
    anything else inside ``$...$``, falling back to the bare text if that finds nothing.
    """
    number = normalize_number(text)
    if number is not None:
        return _parse(number, timeout)
    if "$" in text or "\\boxed" in text:
        return _parse(text, timeout)
    return _parse(f"${text}$", timeout) or _parse(text, timeout)


def _parse(text: str, timeout: int | None) -> list:
    if not text.strip():
        return []
    try:
        return parse(text, parsing_timeout=timeout)
    except Exception:  # parse already swallows its own errors; anything left is a bug in it, not ours to raise
        return []


def _verify(gold: list, prediction: list, timeout: int | None) -> bool:
    if not prediction:
        return False
    try:
        return bool(verify(gold, prediction, timeout_seconds=timeout))
    except Exception:
        return False
