"""Where a loader's rows come from: a Hub dataset id or local json/jsonl/parquet files."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Union

import datasets

from rfopt.errors import DatasetUnavailableError, Refusal

#: A Hub dataset id (``"openai/gsm8k"``), a local file or directory, or ``{split: path}``.
Source = Union[str, os.PathLike, Mapping[str, Union[str, os.PathLike]]]

# File suffix -> `datasets` builder that reads it.
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class Splits(NamedTuple):
    """What every loader returns: unpack it as ``train, test = load_...()``."""

    train: datasets.Dataset
    test: datasets.Dataset


def load_splits(
    name: str,
    source: Source,
    *,
    splits: Sequence[str],
    columns: Sequence[str],
    local_format: str,
    hub_config: str | None = None,
) -> dict[str, datasets.Dataset]:
    """Load ``splits`` of ``source`` and check that each has ``columns``.

    ``name`` and ``local_format`` (what a local copy must look like) go into error messages.
    A local directory is searched for files named after each split (``train.jsonl``,
    ``test.parquet``, ``data/train-00000-of-00002.parquet`` as in a Hub snapshot); a single
    file is accepted only where ``splits`` is ``("train",)``.
    """
    local = _local_files(name, source, splits, local_format)
    if local is not None:
        builder, data_files = local
        try:
            loaded = datasets.load_dataset(builder, data_files=data_files)
        except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as exc:
            raise DatasetUnavailableError(
                f"{name}: could not read {_describe(source)} ({type(exc).__name__}: {exc}). "
                f"Fix: pass source= {local_format}."
            ) from exc
    else:
        hub_id = os.fspath(source)
        try:
            loaded = datasets.load_dataset(hub_id, hub_config)
        except OSError as exc:  # ConnectionError when offline, DatasetNotFoundError if unknown
            raise DatasetUnavailableError(
                f"{name}: could not load {hub_id!r} from the Hugging Face Hub "
                f"({type(exc).__name__}: {exc}). Fix: connect to the Hub (and unset "
                f"HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), or pass source= {local_format}."
            ) from exc
        missing = [split for split in splits if split not in loaded]
        if missing:
            raise DatasetUnavailableError(
                f"{name}: {hub_id!r} has splits {sorted(loaded)}, not {missing}. "
                f"Fix: pass source= {local_format}."
            )
    result = {split: loaded[split] for split in splits}
    for split, dataset in result.items():
        absent = [column for column in columns if column not in dataset.column_names]
        if absent:
            raise DatasetUnavailableError(
                f"{name}: the {split} split of {_describe(source)} lacks columns {absent} "
                f"(it has {dataset.column_names}). Fix: pass source= {local_format}."
            )
    return result


def take(name: str, dataset: datasets.Dataset, split: str, n: int | None, start: int = 0) -> datasets.Dataset:
    """Rows ``start .. start+n`` of ``dataset`` (all from ``start`` when ``n`` is None)."""
    available = len(dataset) - start
    if n is None:
        n = available
    if n > available:
        raise Refusal(
            f"{name}: asked for {n} {split} rows but only {available} are available; "
            f"pass a smaller n_{split} (or None for all of them)."
        )
    return dataset.select(range(start, start + n))


def check_sizes(name: str, **sizes: int | None) -> None:
    """Raise one ValueError naming every size that is not None or a non-negative int."""
    bad = [
        f"{key}={value!r}"
        for key, value in sizes.items()
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0)
    ]
    if bad:
        raise Refusal(f"{name}: {', '.join(bad)}: sizes must be non-negative integers or None.")


def conversation(system_prompt: str | None, question: str) -> list[dict[str, str]]:
    """The ``prompt`` column's value: the system prompt (if any), then the user question."""
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _local_files(
    name: str, source: Source, splits: Sequence[str], local_format: str
) -> tuple[str, dict[str, list[str]]] | None:
    """``(builder, data_files)`` when ``source`` is local; None when it is a Hub id."""
    if isinstance(source, Mapping):
        paths = {split: pathlib.Path(source[split]) for split in splits if split in source}
        missing_splits = [split for split in splits if split not in paths]
        if missing_splits:
            raise DatasetUnavailableError(
                f"{name}: source dict has keys {sorted(source)}, needs {list(splits)}. "
                f"Fix: pass source= {local_format}."
            )
        for path in paths.values():
            if not path.is_file():
                raise _missing(name, path, local_format)
        return _builder(name, paths.values(), local_format), {s: [str(p)] for s, p in paths.items()}

    path = pathlib.Path(source).expanduser()
    if path.is_file():
        if list(splits) != ["train"]:
            raise DatasetUnavailableError(
                f"{name}: {str(path)!r} is a single file, but {name} needs the splits "
                f"{list(splits)}. Fix: pass source= {local_format}."
            )
        return _builder(name, [path], local_format), {"train": [str(path)]}
    if path.is_dir():
        data_files = {split: _split_files(path, split) for split in splits}
        empty = [split for split, files in data_files.items() if not files]
        if empty:
            raise DatasetUnavailableError(
                f"{name}: directory {str(path)!r} has no file for split(s) {empty} "
                f"(looked for {empty[0]}.jsonl, {empty[0]}.parquet, {empty[0]}-*.parquet, ...). "
                f"Fix: pass source= {local_format}."
            )
        every_file = [pathlib.Path(f) for files in data_files.values() for f in files]
        return _builder(name, every_file, local_format), data_files
    if _looks_like_path(os.fspath(source)):
        raise _missing(name, path, local_format)
    return None


def _split_files(directory: pathlib.Path, split: str) -> list[str]:
    """Data files named ``<split>.<ext>`` or ``<split>-...`` / ``<split>_...`` in ``directory``
    or one folder down (a Hub snapshot keeps them in ``main/`` or ``data/``)."""
    found = []
    for path in sorted([*directory.glob("*"), *directory.glob("*/*")]):
        stem = path.name.split(".", 1)[0]
        if path.is_file() and path.suffix in _BUILDERS and (
            stem == split or stem.startswith((f"{split}-", f"{split}_"))
        ):
            found.append(str(path))
    return found


def _builder(name: str, paths, local_format: str) -> str:
    suffixes = sorted({pathlib.Path(p).suffix for p in paths})
    builders = {_BUILDERS.get(suffix) for suffix in suffixes}
    if None in builders or len(builders) != 1:
        raise DatasetUnavailableError(
            f"{name}: local files must all be .json/.jsonl or all .parquet, found {suffixes}. "
            f"Fix: pass source= {local_format}."
        )
    return builders.pop()


def _looks_like_path(text: str) -> bool:
    # A Hub id is "owner/name"; anything with a data-file suffix, a leading ./ ~ /, or more
    # than one slash is meant as a local path, and a missing one must not be sent to the Hub.
    return (
        pathlib.Path(text).suffix in _BUILDERS
        or text.startswith((".", "/", "~"))
        or text.count("/") > 1
        or "\\" in text
    )


def _missing(name: str, path: pathlib.Path, local_format: str) -> DatasetUnavailableError:
    return DatasetUnavailableError(
        f"{name}: local source {str(path)!r} does not exist. Fix: pass source= {local_format}, "
        f"or the Hub id to download it."
    )


def _describe(source: Source) -> str:
    return repr(dict(source)) if isinstance(source, Mapping) else repr(os.fspath(source))
