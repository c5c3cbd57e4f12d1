"""GSM8K grade-school math word problems (``openai/gsm8k``, config ``main``)."""

from __future__ import annotations

from ._answers import gsm8k_final_answer
from ._prompts import REASONING_SYSTEM_PROMPT
from rfopt.errors import DatasetUnavailableError
from ._source import Source, Splits, check_sizes, conversation, load_splits, take

_LOCAL_FORMAT = (
    "a directory holding train.jsonl and test.jsonl (or .parquet, or a Hub snapshot's "
    "main/train-*.parquet), or {'train': path, 'test': path}, with columns question, answer"
)


def load_gsm8k(
    source: Source = "openai/gsm8k",
    n_train: int | None = 128,
    n_test: int | None = 24,
    seed: int = 42,
    system_prompt: str | None = REASONING_SYSTEM_PROMPT,
) -> Splits:
    """GSM8K's train and test splits, each shuffled with ``seed`` and cut to its first n rows.

    Rows: ``prompt`` (system prompt, then the question), ``question``, ``answer`` (the gold
    number after ``####``, commas removed: ``"1200"``) and ``solution`` (the worked solution
    as GSM8K gives it, ending ``#### 1,200``). ``n_train``/``n_test`` None keeps every row.

    ``source`` is the Hub id, or a local copy: a directory holding ``train.jsonl`` and
    ``test.jsonl`` (or ``.parquet`` files, or the Hub's ``main/train-00000-of-00001.parquet``
    layout), or a dict ``{"train": path, "test": path}``.

    >>> train, test = load_gsm8k("path/to/gsm8k_dir", n_train=8, n_test=4)  # doctest: +SKIP
    >>> train[0]["answer"]  # doctest: +SKIP
    '72'
    """
    check_sizes("gsm8k", n_train=n_train, n_test=n_test)
    loaded = load_splits(
        "gsm8k",
        source,
        splits=("train", "test"),
        columns=("question", "answer"),
        local_format=_LOCAL_FORMAT,
        hub_config="main",
    )
    sizes = {"train": n_train, "test": n_test}
    out = {}
    for split, dataset in loaded.items():
        rows = take("gsm8k", dataset.shuffle(seed=seed), split, sizes[split])
        out[split] = rows.map(
            _to_row,
            with_indices=True,
            fn_kwargs={"system_prompt": system_prompt, "split": split},
        )
    return Splits(out["train"], out["test"])


def _to_row(example: dict, index: int, system_prompt: str | None, split: str) -> dict:
    gold = gsm8k_final_answer(example["answer"])
    if gold is None:
        raise DatasetUnavailableError(
            f"gsm8k: {split} row {index} (after shuffling) has no '#### <number>' line in its "
            f"answer column: {example['answer'][-80:]!r}. Fix: end each answer with '#### 42'."
        )
    return {
        "prompt": conversation(system_prompt, example["question"]),
        "answer": gold,
        "solution": example["answer"],
    }
