"""The artifacts rfopt keeps on each running trial for people to look at, and the store they live in.

After each committed unit (`publish_unit`, a subscriber of the run) a trial's two artifacts are brought
up to date in ``<checkpoint dir>/artifacts``: ``rfopt-metrics.svg`` (its per-chunk charts) and
``rfopt-samples.jsonl`` (every chunk's sample completions, a table in optuna-dashboard); and its
optuna-dashboard *note* (`trial_note`: markdown that plain optuna-dashboard renders on the trial's page) shows
its chunks' values and metrics and its latest samples with each reward function's score, in tables.
`StudyArtifacts` is optuna-dashboard's artifact store over every study's artifact directory.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import optuna

from rfopt.errors import NothingToAnswer, Refusal
from rfopt.compat import storage_of, study_id_of, trial_id_of
from rfopt.reports.status import situation
from rfopt.reports.trial_svg import charts_svg
from rfopt.storage.files import is_url
from rfopt.storage.schema import TrialRecord, study_record

logger = logging.getLogger("rfopt")

CHART_ARTIFACT = "rfopt-metrics.svg"
SAMPLES_ARTIFACT = "rfopt-samples.jsonl"


def study_artifact_store(study: optuna.Study) -> Any:
    """The artifact store of an rfopt study: ``artifacts/`` in its checkpoint store (a directory or a URL)."""
    root = study_record(study).checkpoint_dir
    if root is None:
        raise NothingToAnswer(f"study {study.study_name!r} has no checkpoint location; it has not run under rfopt")
    if is_url(root):
        return ObjectArtifactStore(f"{root}/artifacts")
    path = Path(root) / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return optuna.artifacts.FileSystemArtifactStore(path)


class ObjectArtifactStore:
    """Optuna's artifact store protocol over an fsspec URL: the artifacts of a study whose checkpoints are in an
    object store (``s3://bucket/prefix/artifacts``), one object per artifact."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url
        self._fs, self._path = fsspec.core.url_to_fs(url)

    def open_reader(self, artifact_id: str) -> Any:
        from optuna.artifacts.exceptions import ArtifactNotFound

        try:
            return io.BytesIO(self._fs.cat_file(self._object(artifact_id)))
        except FileNotFoundError as exc:
            raise ArtifactNotFound(f"artifact {artifact_id} is not in {self.url}") from exc

    def write(self, artifact_id: str, content_body: Any) -> None:
        self._fs.pipe_file(self._object(artifact_id), content_body.read())

    def remove(self, artifact_id: str) -> None:
        from optuna.artifacts.exceptions import ArtifactNotFound

        try:
            self._fs.rm_file(self._object(artifact_id))
        except FileNotFoundError as exc:
            raise ArtifactNotFound(f"artifact {artifact_id} is not in {self.url}") from exc

    def _object(self, artifact_id: str) -> str:
        """The object of `artifact_id`, always directly under the store's prefix: an id is never a path (as Optuna's
        `FileSystemArtifactStore` refuses one that leaves its folder)."""
        if not artifact_id or "/" in artifact_id or "\\" in artifact_id or artifact_id.startswith("."):
            raise Refusal(f"Invalid artifact_id: {artifact_id!r} (an artifact id is a name, not a path)")
        return f"{self._path}/{artifact_id}"


def publish_chunk(trial: optuna.Trial, artifact_store: Any = None) -> None:
    """Bring the running trial's artifacts up to date with its committed chunks.

    Call it after a chunk's metrics, samples and report are committed, while the trial is still
    RUNNING (optuna adds an artifact to a trial only then). It keeps one ``rfopt-metrics.svg`` (the
    trial's charts) and one ``rfopt-samples.jsonl`` (every chunk's sample completions, with their
    ``step`` and ``chunk``) per trial, rewriting their contents in place, so a trial holds two
    artifacts however many chunks it trains. `artifact_store` defaults to `study_artifact_store`.
    Never raises: artifacts are for people to look at; a failure is logged and training goes on.

        >>> publish_chunk(trial)        # doctest: +SKIP
    """
    try:
        store = artifact_store if artifact_store is not None else study_artifact_store(trial.study)
        storage = storage_of(trial.study)
        record = TrialRecord(storage.get_trial(trial_id_of(trial)))
        files = {
            CHART_ARTIFACT: charts_svg(record.unit_metrics(), f"trial {trial.number}").encode(),
            SAMPLES_ARTIFACT: samples_jsonl(record).encode(),
        }
        existing = {m.filename: m.artifact_id for m in optuna.artifacts.get_all_artifact_meta(trial)}
        for filename, data in files.items():
            if filename in existing:
                store.write(existing[filename], io.BytesIO(data))
                continue
            with tempfile.TemporaryDirectory(prefix="rfopt-artifact-") as tmp:
                path = Path(tmp) / filename
                path.write_bytes(data)
                optuna.artifacts.upload_artifact(
                    artifact_store=store,
                    file_path=str(path),
                    study_or_trial=trial,
                    mimetype="image/svg+xml" if filename.endswith(".svg") else "application/x-ndjson",
                )
    except Exception as exc:  # noqa: BLE001 - artifacts must never fail a trial
        logger.warning("trial %d: could not publish its chunk artifacts: %s: %s", trial.number, type(exc).__name__, exc)


def publish_note(trial: optuna.Trial) -> None:
    """Bring the trial's optuna-dashboard note up to date (`trial_note`), keeping what a person wrote below rfopt's
    part. A few small writes per chunk (optuna-dashboard keeps a note in study system attrs of 2 KB each). Never
    raises: a failure is logged and training goes on."""
    try:
        from optuna_dashboard import get_note, save_note

        record = TrialRecord(storage_of(trial.study).get_trial(trial_id_of(trial)))
        objective = study_record(trial.study).objective
        save_note(trial, trial_note(record, objective, kept=_persons_part(get_note(trial)),
                                    study_id=study_id_of(trial.study)))
    except Exception as exc:  # noqa: BLE001 - a note must never fail a trial
        logger.warning("trial %d: could not update its note: %s: %s", trial.number, type(exc).__name__, exc)


def publish_unit(event: Any) -> None:
    """`publish_chunk` and `publish_note` as a subscriber of a run's committed units (`unit.UnitCommitted`)."""
    publish_chunk(event.trial)
    publish_note(event.trial)


NOTE_END = "*rfopt writes the part above after each chunk; write your own notes below this line.*"
_NOTE_SAMPLES = 8
_NOTE_CELL = 160
_NOTE_LEFT_OUT = {"reward_std", "completions/count", "completions/clipped_ratio"}
"""Eval metrics the note's table leaves out (spreads, counts, and the diversity measures, which the trial's charts and
rfopt's page show), so that it fits optuna-dashboard's trial page."""


def trial_note(record: TrialRecord, objective: str = "reward", kept: str = "", study_id: int | None = None) -> str:
    """The trial's note as optuna-dashboard renders it (markdown): its value per chunk with the eval metrics, then the
    latest chunk's sample completions with their total and each reward function's score; `kept` (a person's notes)
    follows rfopt's part. With `study_id`, a link to the study's rfopt page (where ``rfopt dashboard`` serves it).
    Chunks are counted from 1, next to Optuna's step.

        >>> print(trial_note(TrialRecord(study.trials[3])))                        # doctest: +SKIP
        ### rfopt: trial 3, 2 of 4 chunks
        | chunk | reward | rewards/correctness/mean | ...
    """
    units = record.unit_metrics()
    values = record.trial.intermediate_values
    total = f" of {record.num_units}" if record.num_units else ""
    state = situation(record)
    lines = [f"### rfopt: trial {record.number}, {state}, {record.committed}{total} chunks"]
    if state == "paused":
        lines.append("\n**paused** (rfopt): Optuna keeps it RUNNING. Resume it on rfopt's page or with `rfopt resume`; "
                     "optuna-dashboard's Fail Trial button would end it for good.")
    reason = record.end_reason
    if reason:
        lines.append(f"\n**{state}**: {_cell(reason)}")
    if units:
        keys = sorted({k for m in units for k in m.eval
                       if k not in _NOTE_LEFT_OUT and not k.endswith("/std") and not k.startswith("diversity/")})
        lines += ["", "| step | after chunk | " + f"{objective} (value) | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 3) + "|"]
        for m in units:
            value = values.get(m.unit)
            cells = [str(m.unit), str(m.unit + 1), _number(value)] + [_number(m.eval.get(k)) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    samples = record.samples()
    if samples:
        unit = max(samples)
        shown = samples[unit][:_NOTE_SAMPLES]
        scores = [k for k in (shown[0] if shown else {}) if k not in ("prompt", "completion", "reward")]
        lines += ["", f"**Samples after chunk {unit + 1}** (step {unit}; eval set; `reward` is the weighted total)", "",
                  "| prompt | completion | reward | " + " | ".join(scores) + " |", "|---" * (len(scores) + 3) + "|"]
        for sample in shown:
            cells = [_cell(sample.get("prompt")), _cell(sample.get("completion")), _number(sample.get("reward"))]
            lines.append("| " + " | ".join(cells + [_number(sample.get(k)) for k in scores]) + " |")
    if study_id is not None:
        lines += ["", f"[This study on rfopt's page](/rfopt/studies/{study_id}) (what trains now, every trial "
                      "compared, controls; served by `rfopt dashboard`)"]
    lines += ["", "---", NOTE_END]
    return "\n".join(lines) + ("\n" + kept if kept else "\n")


def _persons_part(note: str) -> str:
    """What a person wrote below rfopt's part of a note (all of it, if rfopt never wrote one)."""
    if NOTE_END in note:
        return note.split(NOTE_END, 1)[1].lstrip("\n")
    return note


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.4g}"


def _cell(text: Any) -> str:
    """Text in one markdown table cell: one line, pipes escaped, cut short."""
    text = " ".join(str(text if text is not None else "").split())
    if len(text) > _NOTE_CELL:
        text = text[: _NOTE_CELL - 1] + "…"
    return text.replace("|", "\\|") or " "


def samples_jsonl(record: TrialRecord) -> str:
    """Every chunk's sample completions of a trial, one JSON object a line with its ``step`` and ``chunk``."""
    chunks = {m.unit: m.chunk for m in record.unit_metrics()}
    lines = []
    for unit, samples in record.samples().items():
        for sample in samples:
            lines.append(json.dumps({"step": unit, "chunk": chunks.get(unit, unit), **sample}))
    return "\n".join(lines) + ("\n" if lines else "")


class StudyArtifacts:
    """optuna-dashboard's artifact store: every rfopt study's ``<checkpoint dir>/artifacts`` (a directory or a URL).

    Files uploaded through the dashboard go to `upload_dir` (created on the first upload).
    """

    def __init__(self, storage: optuna.storages.BaseStorage, upload_dir: str | os.PathLike) -> None:
        self._storage = storage
        self.upload_dir = Path(upload_dir)

    def _stores(self) -> list[Any]:
        roots = [r for r in (study_record(s).checkpoint_dir for s in self._storage.get_all_studies()) if r]
        dirs = [self.upload_dir] + [Path(r) / "artifacts" for r in roots if not is_url(r)]
        local = [optuna.artifacts.FileSystemArtifactStore(d) for d in dict.fromkeys(dirs) if d.is_dir()]
        return local + [ObjectArtifactStore(f"{r}/artifacts") for r in dict.fromkeys(roots) if is_url(r)]

    def _holder(self, artifact_id: str) -> Any:
        from optuna.artifacts.exceptions import ArtifactNotFound

        for store in self._stores():
            try:
                store.open_reader(artifact_id).close()
            except ArtifactNotFound:
                continue
            return store
        raise ArtifactNotFound(f"artifact {artifact_id} is in none of the studies' artifact directories")

    def open_reader(self, artifact_id: str) -> Any:
        return self._holder(artifact_id).open_reader(artifact_id)

    def write(self, artifact_id: str, content_body: Any) -> None:
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        optuna.artifacts.FileSystemArtifactStore(self.upload_dir).write(artifact_id, content_body)

    def remove(self, artifact_id: str) -> None:
        self._holder(artifact_id).remove(artifact_id)
