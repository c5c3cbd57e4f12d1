"""Whether a trial's eval completions still depend on the prompt: the diversity measures of one evaluation, and the
collapse verdict read back from them.

GRPO can collapse: with a learning rate too large, or a reward that one memorised text satisfies, a policy ends up
answering every prompt with the same text, and a greedy evaluation of it may still score well. The value alone does
not show it; the completions do. Every evaluation stores these measures beside its reward means (in the unit's eval
metrics, ``rfopt:metrics:<unit>``; the trial's charts draw them):

``diversity/distinct``
    distinct completions over distinct prompts (whitespace normalized): 1.0 when every prompt got its own answer,
    ``1/n`` when all `n` got the same text.
``diversity/top_share``
    the share of distinct prompts whose completion is the most common one.
``diversity/top_tokens``
    the length, in tokens, of that most common completion.
``diversity/repeated_ngrams``
    the mean, over completions, of the share of a completion's token 4-grams that repeat an earlier one of the same
    completion: a text that loops ("the cost is the cost is the cost ...") is near 1.
``completions/clipped_ratio``
    the share of completions cut at the length limit (not ended by an end-of-sequence token), as TRL names it.
``diversity/prompts``
    the distinct prompts evaluated.

`collapse_reason` reads the verdict from them: a trial has **collapsed** when one completion answers at least half of
(at least `MIN_PROMPTS`) distinct eval prompts, and that completion is empty or at least `MIN_TOKENS` tokens long.
Shorter shared answers are left alone: a task whose right answers are short labels ("yes", "B") legitimately gives
many prompts the same completion. Given the base model's evaluation (its baseline, `reference`), a collapse is one
that training brought about: a base model whose completions already do not depend on the prompt (a random test
model) makes none of its trials' evaluations a collapse.

    >>> measures = diversity(["q1", "q2", "q3", "q4"], ["same text"] * 4, [[5] * 9] * 4, end_ids={2})
    >>> measures["diversity/top_share"], collapse_reason(measures)
    (1.0, 'one completion answers 4 of 4 eval prompts')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

MIN_PROMPTS = 4
"""Fewer distinct eval prompts than this give no verdict: two prompts with one answer say little."""
SHARE = 0.5
"""A completion shared by at least this share of the distinct prompts is a collapse."""
MIN_TOKENS = 8
"""A shared completion shorter than this (an empty one excepted) is taken for a short label, not a collapse."""
NGRAM = 4


def diversity(prompts: Sequence[str], texts: Sequence[str], ids: Sequence[Sequence[int]],
              end_ids: Collection[int]) -> dict[str, float]:
    """The diversity measures (see the module docstring) of one completion per prompt: `texts` decoded, `ids` their
    tokens (an end-of-sequence token, where generation stopped at one, included), `end_ids` the tokens that end a
    completion (a completion whose last token is none of them was cut at the length limit)."""
    answers: dict[str, str] = {}
    tokens: dict[str, int] = {}
    for prompt, text, row in zip(prompts, texts, ids):
        answer = " ".join(text.split())
        answers.setdefault(prompt, answer)
        tokens.setdefault(answer, sum(token not in end_ids for token in row))
    n = len(answers)
    if n == 0:
        return {}
    counts = Counter(answers.values())
    top, top_count = max(counts.items(), key=lambda kv: (kv[1], kv[0] == ""))
    clipped = [bool(row) and row[-1] not in end_ids for row in ids]
    return {
        "diversity/prompts": float(n),
        "diversity/distinct": len(counts) / n,
        "diversity/top_share": top_count / n,
        "diversity/top_tokens": float(tokens[top]),
        "diversity/repeated_ngrams": sum(map(_repeated, ids)) / max(1, len(ids)),
        "completions/clipped_ratio": sum(clipped) / max(1, len(ids)),
    }


def collapse_reason(metrics: Mapping[str, float], reference: Mapping[str, float] | None = None) -> str | None:
    """Why an evaluation's completions no longer depend on the prompt (``one completion answers 16 of 16 eval
    prompts``), read from its stored measures; None when they still do, when the measures cannot say (too few
    prompts, or an evaluation stored before rfopt measured diversity), or when the `reference` evaluation (the base
    model's, with no adapter) had collapsed already."""
    if reference is not None and collapse_reason(reference) is not None:
        return None
    prompts = metrics.get("diversity/prompts")
    share = metrics.get("diversity/top_share")
    length = metrics.get("diversity/top_tokens")
    if prompts is None or share is None or length is None or prompts < MIN_PROMPTS or share < SHARE:
        return None
    if 0 < length < MIN_TOKENS:
        return None
    shared = round(share * prompts)
    what = "an empty completion" if length == 0 else "one completion"
    return f"{what} answers {shared} of {int(prompts)} eval prompts"


def _repeated(row: Sequence[int]) -> float:
    """The share of `row`'s token n-grams that repeat an earlier one of the row (0 for a row shorter than one)."""
    grams = [tuple(row[i:i + NGRAM]) for i in range(len(row) - NGRAM + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0
