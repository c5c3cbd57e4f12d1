"""trackio: each trial a ``trackio.Run`` of its own, in the project named after the study (or the project its
config's ``project`` names), grouped by the study; never trackio's current run, so a gang's members log at once
(`rfopt.compat.trackio_run`). trackio resumes a run by its name (``<study>-trial-<n>``, ``resume="allow"``): every
process and every rerun continues the same run. trackio keeps no summary or tags: a trial's end is an alert on its
run (``<state>: <reason>``), and the study's leaderboard a table in the run named after the study."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from rfopt import compat

from ._records import ChunkLog, Leaderboard, TrialEnd, TrialInfo

DEFAULT_PROJECT = "huggingface"
"""`TrainingArguments.project`'s default: a trial config that keeps it logs to the project named after the study."""


def _quiet() -> Any:
    """trackio prints a few lines for every run it opens or finishes; rfopt shows its own progress."""
    return contextlib.redirect_stdout(io.StringIO())


class TrackioTracker:
    name = "trackio"

    def __init__(self, study: str, study_id: str) -> None:
        self.study = study
        self.study_id = study_id

    def project(self, config: dict[str, Any] | None = None) -> str:
        chosen = ((config or {}).get("args") or {}).get("project")
        return chosen if isinstance(chosen, str) and chosen and chosen != DEFAULT_PROJECT else self.study

    def _open(self, project: str, name: str, config: dict[str, Any]) -> Any:
        with _quiet():
            return compat.trackio_run(project=project, name=name, group=self.study, config=config, resume="allow",
                                      auto_log_cpu=False, auto_log_gpu=False)

    def open(self, info: TrialInfo) -> TrackioRun:
        return TrackioRun(self._open(self.project(info.config), info.name, info.run_config()))

    def leaderboard(self, board: Leaderboard) -> None:
        import trackio

        run = self._open(self.project(), self.study, {"rfopt": {"study": self.study, "study_id": self.study_id}})
        metrics: dict[str, Any] = {"leaderboard": trackio.Table(columns=board.columns, data=board.rows)}
        if board.best is not None:
            metrics |= {"best_trial": board.best[0], "best_value": board.best[1]}
        try:
            run.log(metrics)
        finally:
            with _quiet():
                run.finish()

    def close(self) -> None:
        pass


class TrackioRun:
    def __init__(self, run: Any) -> None:
        self.run = run

    def steps(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            self.run.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def chunk(self, log: ChunkLog) -> None:
        self.run.log(log.metrics(), step=log.step)

    def flush(self) -> None:
        compat.trackio_flush(self.run)  # on disk now: trackio's own thread writes every half second

    def end(self, end: TrialEnd) -> None:
        import trackio

        level = trackio.AlertLevel.ERROR if end.failed else trackio.AlertLevel.INFO
        with _quiet():
            self.run.alert(title=end.state, text=end.reason or (f"value {end.value}" if end.value is not None else None),
                           level=level)
            self.run.finish()

    def release(self) -> None:
        with _quiet():
            self.run.finish()
