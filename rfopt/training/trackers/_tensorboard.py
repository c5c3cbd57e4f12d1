"""TensorBoard: each trial a directory of its own, ``<dir>/<study>/trial-<n>`` (``<dir>``: the user's
``TENSORBOARD_LOGGING_DIR``, else ``runs``), written by a ``SummaryWriter`` of its own. TensorBoard reads a
directory's event files as one run, so a trial resumed here or in another process (which adds an event file) is the
same run. Each trial's Optuna params and its ``value`` go to the HParams tab (a table of the study's trials), its
whole config and its end to the Text tab; the leaderboard is the text of the run ``<study>/leaderboard``."""

from __future__ import annotations

import json
import os
from typing import Any

from ._records import ChunkLog, Leaderboard, TrialEnd, TrialInfo


def _writer(directory: str) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=directory)


def _hparam(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


class TensorboardTracker:
    name = "tensorboard"

    def __init__(self, study: str, study_id: str) -> None:
        self.study = study
        self.base = os.environ.get("TENSORBOARD_LOGGING_DIR") or "runs"

    def directory(self, run: str) -> str:
        return os.path.join(self.base, self.study, run)

    def location(self, info: TrialInfo) -> str:
        """The trial's folder, absolute: ``runs`` is relative to the working directory."""
        return os.path.abspath(self.directory(f"trial-{info.number}"))

    def open(self, info: TrialInfo) -> TensorboardRun:
        from torch.utils.tensorboard.summary import hparams

        writer = _writer(self.directory(f"trial-{info.number}"))
        params = {k: _hparam(v) for k, v in info.params.items()} | {"trial": info.number}
        for summary in hparams(params, {"value": 0.0}):  # the experiment, the session's params, its end
            writer.file_writer.add_summary(summary)
        writer.add_text("config", f"{info.description}\n\n```json\n{json.dumps(info.config, indent=1)}\n```")
        return TensorboardRun(writer)

    def leaderboard(self, board: Leaderboard) -> None:
        writer = _writer(self.directory("leaderboard"))
        try:
            writer.add_text("leaderboard", board.markdown())
        finally:
            writer.close()

    def close(self) -> None:
        pass


class TensorboardRun:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def steps(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(f"train/{key}", value, int(row["step"]))
        self.writer.flush()

    def chunk(self, log: ChunkLog) -> None:
        for key, value in log.metrics().items():
            self.writer.add_scalar(key, value, log.step)
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def end(self, end: TrialEnd) -> None:
        self.writer.add_text("end", end.state + (f": {end.reason}" if end.reason else ""))
        self.writer.close()

    def release(self) -> None:
        self.writer.close()
