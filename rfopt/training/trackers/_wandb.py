"""Weights & Biases: each trial a run object of its own (``wandb.init(..., reinit="create_new")``), never the
process's ``wandb.run``, so a gang's members log at once. The run's id is fixed by the study and trial
(``rfopt-<study id>-<n>``, ``resume="allow"``): every process and every rerun continues the same run. Steps are on
W&B's custom axis ``train/global_step`` (as the Trainer's integration logs them), not W&B's own ``_step``, which
restarts when a run resumes offline and refuses to go back after a crash."""

from __future__ import annotations

import os
from typing import Any

from ._records import ChunkLog, Leaderboard, TrialEnd, TrialInfo

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
        tags = ["rfopt", "trial"] + (["clone"] if info.clone_of is not None else [])
        run = self._init(id=run_id(self.study_id, info.number), name=info.name, job_type="trial",
                         config=info.run_config(), tags=tags, notes=info.description)
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        return WandbRun(run)

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
    def __init__(self, run: Any) -> None:
        self.run = run

    def steps(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            self.run.log({STEP: row["step"], **{f"train/{k}": v for k, v in row.items() if k != "step"}})

    def chunk(self, log: ChunkLog) -> None:
        self.run.log({STEP: log.step, **log.metrics()})

    def end(self, end: TrialEnd) -> None:
        self.run.summary["state"] = end.state
        if end.reason:
            self.run.summary["end_reason"] = end.reason
        if end.value is not None:
            self.run.summary["value"] = end.value
        self.run.tags = (*[t for t in self.run.tags or () if t not in ("complete", "pruned", "stopped", "failed")],
                         end.state)
        self.run.finish(exit_code=1 if end.failed else 0)

    def release(self) -> None:
        self.run.finish()
