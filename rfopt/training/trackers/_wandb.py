"""Weights & Biases: each trial a run object of its own (``wandb.init(..., reinit="create_new")``), never the
process's ``wandb.run``, so a gang's members log at once. The run's id is fixed by the study and trial
(``rfopt-<study id>-<n>``, ``resume="allow"``): every process and every rerun continues the same run. Steps are on
W&B's custom axis ``train/global_step`` (as the Trainer's integration logs them), not W&B's own ``_step``, which
restarts when a run resumes offline and refuses to go back after a crash."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._records import END_STATES, ChunkLog, Leaderboard, TrialEnd, TrialInfo

STEP = "train/global_step"


def run_id(study_id: str, number: int | str) -> str:
    return f"rfopt-{study_id[:12]}-{number}"


class WandbTracker:
    name = "wandb"

    def __init__(self, study: str, study_id: str) -> None:
        self.study = study
        self.study_id = study_id
        self.project = os.environ.get("WANDB_PROJECT") or study
        self.group = os.environ.get("WANDB_RUN_GROUP") or study

    def _init(self, **kwargs: Any) -> Any:
        import wandb

        return wandb.init(project=self.project, group=self.group, resume="allow", reinit="create_new",
                          # one process holds several runs: none of them takes over the console
                          settings=wandb.Settings(console="off"), **kwargs)

    def open(self, info: TrialInfo) -> WandbRun:
        return WandbRun(lambda: self._open(info))

    def _open(self, info: TrialInfo) -> Any:
        tags = ["rfopt", "trial"] + (["clone"] if info.clone_of is not None else [])
        run = self._init(id=run_id(self.study_id, info.number), name=info.name, job_type="trial",
                         config=info.run_config(), tags=tags, notes=info.description)
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        return run

    def leaderboard(self, board: Leaderboard) -> None:
        import wandb

        run = self._init(id=run_id(self.study_id, "study"), name=self.study, job_type="study", tags=["rfopt", "study"],
                         notes=f"rfopt study {self.study!r}: its trials are the runs of group {self.group!r}")
        try:
            run.log({"leaderboard": wandb.Table(columns=board.columns, data=board.rows)})
            if board.best is not None:
                run.summary["best_trial"], run.summary["best_value"] = board.best
            run.summary["finished"] = board.finished
        finally:
            run.finish()

    def close(self) -> None:
        pass


class WandbRun:
    """A trial's W&B run, finished at each flush (W&B writes an offline run's file every 15 s and when it finishes;
    a killed process loses the rest) and resumed when next logged to."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self.start = start
        self._run: Any = None

    @property
    def run(self) -> Any:
        if self._run is None:
            self._run = self.start()
        return self._run

    def steps(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            self.run.log({STEP: row["step"], **{f"train/{k}": v for k, v in row.items() if k != "step"}})

    def chunk(self, log: ChunkLog) -> None:
        self.run.log({STEP: log.step, **log.metrics()})

    def flush(self) -> None:
        self.release()

    def end(self, end: TrialEnd) -> None:
        run = self.run
        run.summary["state"] = end.state
        if end.reason:
            run.summary["end_reason"] = end.reason
        if end.value is not None:
            run.summary["value"] = end.value
        run.tags = (*[t for t in run.tags or () if t not in END_STATES], end.state)
        run.finish(exit_code=1 if end.failed else 0)
        self._run = None

    def release(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
