"""DeepMath-103K: hard, verifiable math problems (``zwhe99/DeepMath-103K``, train split only)."""

from __future__ import annotations

from rfopt.errors import Refusal
from ._prompts import BOXED_SYSTEM_PROMPT
from ._source import Source, Splits, check_sizes, conversation, load_splits, take

_LOCAL_FORMAT = (
    "a .jsonl/.parquet file (or a directory of train*.jsonl/.parquet files, as in a Hub "
    "snapshot's data/train-*.parquet) with columns question, final_answer"
)


def load_deepmath(
    source: Source = "zwhe99/DeepMath-103K",
    n_train: int | None = 128,
    n_test: int | None = 24,
    seed: int = 42,
    system_prompt: str | None = BOXED_SYSTEM_PROMPT,
) -> Splits:
    """A seeded train/test split of DeepMath-103K, which ships only a train split.

    The rows are shuffled once with ``seed``; the test set is the *last* ``n_test`` rows of
    that order and the training set the first ``n_train``, so the two never overlap and
    changing one size leaves the other set unchanged. ``n_train=None`` takes every row the
    test set leaves.

    Rows: ``prompt`` (system prompt asking for the final answer in ``\\boxed{}``, then the
    question), ``answer`` (= ``final_answer``, the gold answer as LaTeX, e.g. ``"\\frac{1}{2}"``),
    and the source columns unchanged: ``question``, ``final_answer``, ``difficulty``,
    ``topic``, ``r1_solution_1`` .. ``r1_solution_3``.

    >>> train, test = load_deepmath(n_train=64, n_test=16)  # doctest: +SKIP
    """
    check_sizes("deepmath", n_train=n_train, n_test=n_test)
    dataset = load_splits(
        "deepmath",
        source,
        splits=("train",),
        columns=("question", "final_answer"),
        local_format=_LOCAL_FORMAT,
    )["train"].shuffle(seed=seed)
    n_test = len(dataset) if n_test is None else n_test
    if n_test > len(dataset):
        raise Refusal(
            f"deepmath: asked for {n_test} test rows but the source has only {len(dataset)} rows; "
            f"pass a smaller n_test."
        )
    test = dataset.select(range(len(dataset) - n_test, len(dataset)))
    train = take("deepmath", dataset.select(range(len(dataset) - n_test)), "train", n_train)
    fn_kwargs = {"system_prompt": system_prompt}
    return Splits(train.map(_to_row, fn_kwargs=fn_kwargs), test.map(_to_row, fn_kwargs=fn_kwargs))


def _to_row(example: dict, system_prompt: str | None) -> dict:
    return {
        "prompt": conversation(system_prompt, example["question"]),
        "answer": str(example["final_answer"]).strip(),
    }
