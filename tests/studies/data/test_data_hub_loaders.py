"""The Hub loaders, fed small local files in each dataset's real format (built here, never committed)."""

import json

import datasets
import huggingface_hub.constants
import pytest

from rfopt_testkit import deepmath_rows
from rfopt.errors import DatasetUnavailableError
from rfopt.studies.data import (
    BOXED_SYSTEM_PROMPT,
    REASONING_SYSTEM_PROMPT,
    THINK_SYSTEM_PROMPT,
    last_boxed,
    load_deepmath,
    load_gsm8k,
    load_numina_tir,
)


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    # load_dataset caches what it reads; keep that out of the user's ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _gsm8k_rows(split, n):
    # GSM8K's real shape: the answer is a worked solution with calculator marks, then "#### n".
    return [
        {
            "question": f"{split} question {i}: a shop sells {i + 1} boxes of 1,000 pins. How many pins?",
            "answer": f"{i + 1} * 1000 = <<{i + 1}*1000={(i + 1) * 1000}>>{(i + 1) * 1000} pins\n"
            f"#### {(i + 1) * 1000:,}",
        }
        for i in range(n)
    ]


@pytest.fixture
def gsm8k_dir(tmp_path):
    _write_jsonl(tmp_path / "gsm8k" / "train.jsonl", _gsm8k_rows("train", 20))
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", _gsm8k_rows("test", 10))
    return tmp_path / "gsm8k"


def test_gsm8k_rows_hold_a_conversation_the_bare_gold_number_and_the_solution(gsm8k_dir):
    train, test = load_gsm8k(gsm8k_dir, n_train=8, n_test=4)
    assert (len(train), len(test)) == (8, 4)
    assert set(train.column_names) == {"prompt", "question", "answer", "solution"}
    row = train[0]
    assert row["prompt"] == [
        {"role": "system", "content": REASONING_SYSTEM_PROMPT},
        {"role": "user", "content": row["question"]},
    ]
    n = int(row["question"].split("sells ")[1].split(" ")[0])
    assert row["answer"] == str(n * 1000)  # "#### 3,000" -> "3000"
    assert row["solution"].endswith(f"#### {n * 1000:,}")
    assert all(q.startswith("test question") for q in test["question"])


def test_gsm8k_takes_the_first_rows_after_a_seeded_shuffle(gsm8k_dir):
    train, _ = load_gsm8k(gsm8k_dir, n_train=8, n_test=4, seed=42)
    expected = datasets.Dataset.from_list(_gsm8k_rows("train", 20)).shuffle(seed=42).select(range(8))
    assert train["question"] == expected["question"]
    again, _ = load_gsm8k(gsm8k_dir, n_train=8, n_test=4, seed=42)
    other, _ = load_gsm8k(gsm8k_dir, n_train=20, n_test=4, seed=7)
    assert again.to_list() == train.to_list()
    assert other["question"][:8] != train["question"]
    assert sorted(other["question"]) == sorted(r["question"] for r in _gsm8k_rows("train", 20))


def test_gsm8k_reads_a_split_dict_and_a_hub_snapshot_layout(tmp_path):
    paths = {
        "train": _write_parquet(tmp_path / "a" / "gsm8k_train.parquet", _gsm8k_rows("train", 6)),
        "test": _write_parquet(tmp_path / "a" / "gsm8k_test.parquet", _gsm8k_rows("test", 3)),
    }
    train, test = load_gsm8k(paths, n_train=None, n_test=None)
    assert (len(train), len(test)) == (6, 3)

    snapshot = tmp_path / "snapshot"
    _write_parquet(snapshot / "main" / "train-00000-of-00001.parquet", _gsm8k_rows("train", 5))
    _write_parquet(snapshot / "main" / "test-00000-of-00001.parquet", _gsm8k_rows("test", 2))
    train, test = load_gsm8k(str(snapshot), n_train=5, n_test=2)
    assert sorted(train["answer"], key=int) == ["1000", "2000", "3000", "4000", "5000"]


def test_gsm8k_asking_for_more_rows_than_exist_names_the_split(gsm8k_dir):
    with pytest.raises(ValueError, match="asked for 50 test rows but only 10"):
        load_gsm8k(gsm8k_dir, n_train=4, n_test=50)


def test_gsm8k_single_file_is_refused_with_the_accepted_formats(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", _gsm8k_rows("train", 4))
    with pytest.raises(DatasetUnavailableError, match=r"single file.*train\.jsonl and test\.jsonl"):
        load_gsm8k(path)


def test_gsm8k_answer_without_final_line_is_reported(tmp_path):
    rows = [{"question": "q", "answer": "no marker here"}]
    paths = {
        "train": _write_jsonl(tmp_path / "train.jsonl", rows),
        "test": _write_jsonl(tmp_path / "test.jsonl", rows),
    }
    with pytest.raises(DatasetUnavailableError, match="#### <number>"):
        load_gsm8k(paths, n_train=1, n_test=1)


def test_missing_local_file_raises_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "gsm8k"
    with pytest.raises(DatasetUnavailableError) as caught:
        load_gsm8k({"train": missing / "train.jsonl", "test": missing / "test.jsonl"})
    message = str(caught.value)
    assert message.startswith("gsm8k:") and "does not exist" in message
    assert "columns question, answer" in message
    with pytest.raises(DatasetUnavailableError, match="does not exist"):
        load_deepmath(str(tmp_path / "deepmath.parquet"))


def test_unreachable_hub_id_raises_a_clear_error_chained_to_the_cause(monkeypatch):
    # Offline mode makes the Hub call fail at once instead of retrying for ~25 s.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetUnavailableError) as caught:
        load_gsm8k("rfopt-tests/no-such-dataset")
    message = str(caught.value)
    assert "'rfopt-tests/no-such-dataset'" in message and "Hugging Face Hub" in message
    assert "HF_HUB_OFFLINE" in message and "source=" in message
    assert isinstance(caught.value.__cause__, OSError)


def test_missing_column_is_named(tmp_path):
    rows = [{"problem": "1+1?", "answer": "2"}]
    paths = {
        "train": _write_jsonl(tmp_path / "tr.jsonl", rows),
        "test": _write_jsonl(tmp_path / "te.jsonl", rows),
    }
    with pytest.raises(DatasetUnavailableError, match=r"lacks columns \['question'\]"):
        load_gsm8k(paths)


def test_deepmath_splits_its_single_train_split_disjointly_with_the_seed(tmp_path):
    path = _write_parquet(tmp_path / "deepmath.parquet", deepmath_rows(30))
    train, test = load_deepmath(path, n_train=12, n_test=6, seed=1)
    assert (len(train), len(test)) == (12, 6)
    assert not set(train["question"]) & set(test["question"])
    assert train.to_list() == load_deepmath(path, n_train=12, n_test=6, seed=1).train.to_list()
    assert train["question"] != load_deepmath(path, n_train=12, n_test=6, seed=2).train["question"]
    # The test set does not move when the training size changes.
    assert load_deepmath(path, n_train=24, n_test=6, seed=1).test["question"] == test["question"]
    everything, rest = load_deepmath(path, n_train=None, n_test=6, seed=1)
    assert len(everything) == 24 and rest["question"] == test["question"]


def test_deepmath_rows_keep_the_source_columns_and_copy_final_answer(tmp_path):
    path = _write_jsonl(tmp_path / "deepmath.jsonl", deepmath_rows(10))
    train, _ = load_deepmath(path, n_train=4, n_test=2)
    assert {"prompt", "answer", "question", "final_answer", "difficulty", "topic", "r1_solution_1"} <= set(
        train.column_names
    )
    row = train[0]
    assert row["answer"] == row["final_answer"]
    assert row["prompt"][0] == {"role": "system", "content": BOXED_SYSTEM_PROMPT}
    assert "\\boxed{}" in BOXED_SYSTEM_PROMPT
    with pytest.raises(ValueError, match="only 10 rows"):
        load_deepmath(path, n_train=1, n_test=11)


def _numina_rows(split, n):
    rows = []
    for i in range(n):
        solution = (
            f"Let's compute it with Python.\n```python\nprint({i}/2)\n```\n"
            f"The answer is $\\boxed{{\\frac{{{i}}}{{2}}}}$."
            if i % 3
            else f"We use sympy to get {i}, which has no box."
        )
        problem = f"{split} problem {i}: halve {i}."
        rows.append(
            {
                "problem": problem,
                "solution": solution,
                "messages": [
                    {"role": "user", "content": problem},
                    {"role": "assistant", "content": solution},
                ],
            }
        )
    return rows


def test_numina_tir_answer_is_the_last_boxed_of_the_solution_and_messages_are_dropped(tmp_path):
    root = tmp_path / "numina"
    _write_parquet(root / "data" / "train-00000-of-00001.parquet", _numina_rows("train", 12))
    _write_parquet(root / "data" / "test-00000-of-00001.parquet", _numina_rows("test", 6))
    train, test = load_numina_tir(root, n_train=12, n_test=6)
    assert set(train.column_names) == {"prompt", "problem", "solution", "answer"}
    for row in list(train) + list(test):
        i = int(row["problem"].split("problem ")[1].split(":")[0])
        assert row["answer"] == (f"\\frac{{{i}}}{{2}}" if i % 3 else "")
        assert row["prompt"] == [
            {"role": "system", "content": THINK_SYSTEM_PROMPT},
            {"role": "user", "content": row["problem"]},
        ]
    assert "<think> </think>" in THINK_SYSTEM_PROMPT
    shuffled, _ = load_numina_tir(root, n_train=12, n_test=6, seed=0)
    assert shuffled["problem"] != train["problem"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{3} and finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ {a}+{b} } then \\boxed{", "{a}+{b}"),
        ("no box at all", ""),
    ],
)
def test_last_boxed_returns_the_last_balanced_box(text, expected):
    assert last_boxed(text) == expected
