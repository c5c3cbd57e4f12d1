"""MLflow: written through an ``MlflowClient`` with explicit run ids, never ``mlflow.start_run`` (one active run per
thread), so a gang's members log at once. The study is a parent run in the experiment (``MLFLOW_EXPERIMENT_NAME``,
else the study's name), each trial a child run of it; both are found again by their tags (``rfopt.study_id``,
``rfopt.trial``), so every process and every rerun continues the same runs."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ._records import ChunkLog, Leaderboard, TrialEnd, TrialInfo

# Where a trial's run ends up: MLflow's statuses have no "pruned"; the ``rfopt.state`` tag says which end it was.
_STATUS = {"complete": "FINISHED", "pruned": "FINISHED", "stopped": "FINISHED", "failed": "FAILED",
           "cancelled": "FAILED"}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, study: str, study_id: str) -> None:
        from mlflow import MlflowClient

        self.study = study
        self.study_id = study_id
        self.client = MlflowClient()
        self._experiment: str | None = None
        self._parent: str | None = None

    @property
    def experiment(self) -> str:
        if self._experiment is None:
            explicit = os.environ.get("MLFLOW_EXPERIMENT_ID")
            if explicit:
                self._experiment = explicit
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.study
                found = self.client.get_experiment_by_name(name)
                self._experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        return self._experiment

    def _find(self, **tags: str) -> Any:
        """The oldest run carrying `tags` (a second one can only come from two processes creating it at once)."""
        where = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment], filter_string=where, order_by=["attributes.start_time ASC"],
                                       max_results=1)
        return runs[0] if runs else None

    @property
    def parent(self) -> str:
        """The study's run (created the first time)."""
        if self._parent is None:
            found = self._find(**{"rfopt.study_id": self.study_id, "rfopt.role": "study"})
            if found is None:
                found = self.client.create_run(self.experiment, run_name=self.study, tags={
                    "rfopt.study": self.study, "rfopt.study_id": self.study_id, "rfopt.role": "study",
                    "mlflow.note.content": f"rfopt study {self.study!r}; its trials are the child runs"})
            elif found.info.status != "RUNNING":  # more trials after it ended: it runs again
                self.client.update_run(found.info.run_id, status="RUNNING")
            self._parent = found.info.run_id
        return self._parent

    def open(self, info: TrialInfo) -> MlflowRun:
        from mlflow.entities import Param

        found = self._find(**{"rfopt.study_id": self.study_id, "rfopt.trial": str(info.number)})
        if found is not None:
            return MlflowRun(self.client, found.info.run_id)
        tags = {"rfopt.study": self.study, "rfopt.study_id": self.study_id, "rfopt.trial": str(info.number),
                "rfopt.role": "trial", "mlflow.parentRunId": self.parent, "mlflow.note.content": info.description}
        if info.clone_of is not None:
            tags |= {"rfopt.clone_of": str(info.clone_of), "rfopt.warm_start": str(info.warm_start).lower()}
        run_id = self.client.create_run(self.experiment, run_name=info.name, tags=tags).info.run_id
        params = [Param(str(k), str(v)[:6000]) for k, v in info.params.items()]
        self.client.log_batch(run_id, params=params + [Param("trial", str(info.number))])
        self.client.log_dict(run_id, info.config, "config.json")
        return MlflowRun(self.client, run_id)

    def leaderboard(self, board: Leaderboard) -> None:
        from mlflow.entities import Metric

        parent = self.parent
        self.client.log_text(parent, board.markdown() + "\n", "leaderboard.md")
        self.client.log_text(parent, json.dumps({"columns": board.columns, "data": board.rows}, default=str),
                             "leaderboard.json")
        if board.best is not None:
            now = int(time.time() * 1000)
            self.client.log_batch(parent, metrics=[Metric("best_value", board.best[1], now, 0),
                                                   Metric("best_trial", float(board.best[0]), now, 0)])
        if board.finished:
            self.client.set_terminated(parent, status="FINISHED")

    def close(self) -> None:
        pass


class MlflowRun:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def _log(self, metrics: dict[str, float], step: int | float) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, int(step)) for k, v in metrics.items()])

    def steps(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            self._log({f"train/{k}": v for k, v in row.items() if k != "step"}, row["step"])

    def chunk(self, log: ChunkLog) -> None:
        self._log(log.metrics(), log.step)

    def flush(self) -> None:
        pass  # the client writes each call through

    def end(self, end: TrialEnd) -> None:
        tags = {"rfopt.state": end.state}
        if end.reason:
            tags["rfopt.end_reason"] = end.reason[:5000]
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        self.client.set_terminated(self.run_id, status=_STATUS[end.state])

    def release(self) -> None:
        pass  # the run stays RUNNING: the trial goes on
