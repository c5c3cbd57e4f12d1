"""NuminaMath-TIR: competition math with tool-integrated solutions (``AI-MO/NuminaMath-TIR``)."""

from __future__ import annotations

from ._answers import last_boxed
from ._prompts import THINK_SYSTEM_PROMPT
from ._source import Source, Splits, check_sizes, conversation, load_splits, take

_LOCAL_FORMAT = (
    "a directory holding train.jsonl and test.jsonl (or .parquet, or a Hub snapshot's "
    "data/train-*.parquet), or {'train': path, 'test': path}, with columns problem, solution"
)


def load_numina_tir(
    source: Source = "AI-MO/NuminaMath-TIR",
    n_train: int | None = 128,
    n_test: int | None = 24,
    seed: int = 42,
    system_prompt: str | None = THINK_SYSTEM_PROMPT,
) -> Splits:
    """NuminaMath-TIR's train and test splits, each shuffled with ``seed`` and cut to n rows.

    Rows: ``prompt`` (the TRL GRPO tutorial's ``<think>``/``<answer>`` system prompt, then the
    problem), ``problem``, ``solution`` (kept: math_verify-based accuracy rewards parse the
    gold answer from it), and ``answer`` (the last ``\\boxed{...}`` of the solution, or ``""``
    when it has none). The source's ``messages`` column (an SFT conversation that contains
    the solution) is dropped, as in the tutorial.

    >>> train, test = load_numina_tir(n_train=64, n_test=16)  # doctest: +SKIP
    """
    check_sizes("numina_tir", n_train=n_train, n_test=n_test)
    loaded = load_splits(
        "numina_tir",
        source,
        splits=("train", "test"),
        columns=("problem", "solution"),
        local_format=_LOCAL_FORMAT,
    )
    sizes = {"train": n_train, "test": n_test}
    out = {}
    for split, dataset in loaded.items():
        rows = take("numina_tir", dataset.shuffle(seed=seed), split, sizes[split])
        if "messages" in rows.column_names:
            rows = rows.remove_columns("messages")
        out[split] = rows.map(_to_row, fn_kwargs={"system_prompt": system_prompt})
    return Splits(out["train"], out["test"])


def _to_row(example: dict, system_prompt: str | None) -> dict:
    return {
        "prompt": conversation(system_prompt, example["problem"]),
        "answer": last_boxed(example["solution"]),
    }
