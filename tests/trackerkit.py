"""Reading back what the trackers wrote, offline, from their own files and stores: W&B's offline run files, an MLflow
SQLite store (through ``MlflowClient``), trackio's local database, TensorBoard's event files."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# ---------------------------------------------------------------------- W&B
@dataclass
class WandbSession:
    """One process's part of a W&B run: one offline run file."""

    run_id: str
    project: str
    group: str
    name: str
    job_type: str
    config: dict[str, Any]
    tags: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    directory: Path | None = None
    """The session's folder (its ``files/`` hold what it logged as files: tables)."""

    def table(self, key: str) -> dict[str, Any]:
        """The last table logged under `key`: ``{"columns": [...], "data": [[...], ...]}``."""
        path = [row[f"{key}/path"] for row in self.history if f"{key}/path" in row][-1]
        return json.loads((self.directory / "files" / path).read_text())


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks,
    each record a 7-byte header of checksum, length and type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left - 7
            continue
        payload += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def _item(item: Any) -> tuple[str, Any]:
    return (item.key or "/".join(item.nested_key)), json.loads(item.value_json)


def wandb_runs(directory: Path) -> dict[str, list[WandbSession]]:
    """Every run W&B wrote offline under `directory` (its ``WANDB_DIR``), by run id, each as its sessions in time
    order."""
    runs: dict[str, list[WandbSession]] = defaultdict(list)
    for path in sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb")):
        session = None
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config = dict(_item(i) for i in run.config.update)
                config.pop("_wandb", None)
                if session is None:
                    session = WandbSession(run.run_id, run.project, run.run_group, run.display_name, run.job_type,
                                           config, list(run.tags), directory=path.parent)
                else:
                    session.tags = list(run.tags)
            elif kind == "history":
                session.history.append(dict(_item(i) for i in record.history.item))
            elif kind == "summary":
                session.summary.update(_item(i) for i in record.summary.update)
            elif kind == "exit":
                session.exit_code = record.exit.exit_code
        if session is not None:  # else a killed process's file: W&B had written nothing of it yet
            runs[session.run_id].append(session)
    return dict(runs)


def by_step(rows: list[dict[str, Any]], step: str, key: str) -> dict[int, float]:
    """``{step: value}`` of `key` over `rows` (rows logged twice, by a process that crashed and its rerun, must
    agree)."""
    found: dict[int, float] = {}
    for row in rows:
        if key in row and step in row:
            number = int(row[step])
            assert number not in found or found[number] == row[key], f"{key} at step {number}: two values"
            found[number] = row[key]
    return found


# ---------------------------------------------------------------------- MLflow
def mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {uri}"
    return client.search_runs([found.experiment_id])


def mlflow_history(uri: str, run_id: str, key: str) -> dict[int, float]:
    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(run_id, key)
    return by_step([{"step": m.step, key: m.value} for m in history], "step", key)


# ---------------------------------------------------------------------- trackio (TRACKIO_DIR: tests/conftest.py)
def trackio_runs(project: str) -> list[str]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_runs(project)


def trackio_logs(project: str, run: str) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def trackio_alerts(project: str, run: str) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_alerts(project, run_name=run)


def trackio_config(project: str, run: str) -> dict[str, Any]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, run) or {}


# ---------------------------------------------------------------------- TensorBoard
def tensorboard_scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(directory))
    events.Reload()
    return by_step([{"step": e.step, tag: e.value} for e in events.Scalars(tag)], "step", tag)


def tensorboard_text(directory: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    return [b"".join(e.tensor_proto.string_val).decode() for e in events.Tensors(f"{tag}/text_summary")]


# ---------------------------------------------------------------------- the environment of a study that logs offline
def tracker_env(where: Path, mlflow_db: Path) -> dict[str, str]:
    """Environment variables that send all four trackers to files under `where` (trackio: TRACKIO_DIR, set for the
    whole test session by conftest)."""
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": str(where / "wb"), "WANDB_CONFIG_DIR": str(where / "wb-config"),
        "WANDB_CACHE_DIR": str(where / "wb-cache"), "WANDB_DATA_DIR": str(where / "wb-data"), "WANDB_SILENT": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}",
        "TENSORBOARD_LOGGING_DIR": str(where / "tb"),
    }
