"""Rewards on the layout of a completion: ``<reasoning>``/``<answer>`` and ``<think>``/``<answer>`` tags."""

import re
from collections.abc import Sequence
from typing import Any

from .extract import completion_texts

FORMAT_REWARD = 0.5
TAG_REWARD = 0.125
TRAILING_PENALTY_PER_CHAR = 0.001
THINK_FORMAT_REWARD = 1.0

# Block content that holds none of the tags, so a second <answer> block cannot hide inside the
# first one's content and pass as "one block".
_NO_TAGS = r"(?:(?!</?(?:reasoning|answer|think)>).)*"
_STRICT = re.compile(rf"\s*<reasoning>\n{_NO_TAGS}\n</reasoning>\n<answer>\n{_NO_TAGS}\n</answer>\s*", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>.*?<answer>.*?</answer>", re.DOTALL)
_THINK = re.compile(rf"\s*<think>{_NO_TAGS}</think>\s*<answer>{_NO_TAGS}</answer>\s*", re.DOTALL)
_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")


def strict_format(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.5 when the completion is exactly ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>``, else 0.0.

    Each tag sits on its own line; whitespace before and after the whole is allowed, anything else
    is not (no text between the blocks, no trailing text, no second block, no tag inside a
    block). Unlike the GSM8K GRPO notebooks' ``re.match`` without DOTALL, multi-line reasoning
    passes.

    >>> strict_format(["Q"], ["<reasoning>\\n2+2\\n</reasoning>\\n<answer>\\n4\\n</answer>\\n"])
    [0.5]
    """
    texts = completion_texts(completions, "strict_format")
    return [FORMAT_REWARD if _STRICT.fullmatch(text) else 0.0 for text in texts]


def soft_format(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.5 when ``<reasoning>...</reasoning>`` is followed, anywhere later, by ``<answer>...</answer>``, else 0.0.

    Any text may come before, between and after the blocks, and blocks may span lines.

    >>> soft_format(["Q"], ["Sure. <reasoning>2+2</reasoning> so <answer>4</answer>!"])
    [0.5]
    """
    texts = completion_texts(completions, "soft_format")
    return [FORMAT_REWARD if _SOFT.search(text) else 0.0 for text in texts]


def tag_count(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.125 for each tag found exactly once, minus a small penalty for text after ``</answer>``.

    The tags are ``<reasoning>\\n``, ``\\n</reasoning>\\n``, ``\\n<answer>\\n`` and ``\\n</answer>``, so at most 0.5.
    Partial credit gives a gradient toward the strict format before it is ever met. As in the
    GSM8K GRPO notebooks, text after the closing ``</answer>`` costs 0.001 per character
    (surrounding whitespace not counted), capped here at 0.125 so that junk after the answer can
    cancel that tag's credit but not push the reward below what the other tags earned. The
    notebooks also take a second, inconsistent penalty under the ``<answer>`` tag; this one does
    not.

    >>> tag_count(["Q"], ["<reasoning>\\nx\\n</reasoning>\\n<answer>\\n4\\n</answer>\\nbye"])
    [0.497]
    """
    texts = completion_texts(completions, "tag_count")
    return [_tag_score(text) for text in texts]


def _tag_score(text: str) -> float:
    score = sum((TAG_REWARD for tag in _TAGS if text.count(tag) == 1), 0.0)
    if text.count("\n</answer>") == 1:
        trailing = text.split("\n</answer>", 1)[1].strip()
        score -= min(TRAILING_PENALTY_PER_CHAR * len(trailing), TAG_REWARD)
    return score


def think_format(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole completion is ``<think>...</think>`` then ``<answer>...</answer>``, else 0.0.

    Whitespace may surround the whole and separate the two blocks; blocks may span lines but may
    not contain another think or answer tag, and nothing else may appear. A chat template that
    opens ``<think>`` in the prompt (so the completion starts inside it) does not match.

    >>> think_format(["Q"], ["<think>\\n2+2\\n</think>\\n<answer>4</answer>"])
    [1.0]
    """
    texts = completion_texts(completions, "think_format")
    return [THINK_FORMAT_REWARD if _THINK.fullmatch(text) else 0.0 for text in texts]
