"""Each trial its own run in W&B, MLflow, trackio and TensorBoard, in gangs too, with the real packages offline: runs
read back from W&B's offline files, an MLflow SQLite store, trackio's local database and TensorBoard's event files."""

import os
import shutil
import socket

import optuna
import pytest
from rfopt_testkit import prompts_dataset, reward_len, reward_raises, reward_vowels, trial_config
from trackerkit import (by_step, mlflow_history, mlflow_runs, tensorboard_scalars, tensorboard_text, tracker_env,
                        trackio_alerts, trackio_config, trackio_logs, trackio_runs, wandb_runs)

import rfopt
from rfopt.storage.schema import TrialRecord, study_record
from rfopt.training import trackers
from rfopt.training.trackers import _report_to
from rfopt.errors import TrackerRefused

for package in ("wandb", "mlflow", "trackio", "tensorboard"):
    pytest.importorskip(package, reason=f"{package} is not installed: pip install -e '.[trackers]'")

ALL = ["wandb", "mlflow", "trackio", "tensorboard"]
TRAIN, EVAL = prompts_dataset(4), prompts_dataset(2, "E")


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An MLflow SQLite store with its tables made (MLflow's migrations take some 10 s): each test copies it."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def offline(tmp_path, mlflow_template, monkeypatch):
    """All four trackers writing under `tmp_path`, in this process; W&B set up afresh (it reads its environment
    once)."""
    import wandb

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    variables = tracker_env(tmp_path, tmp_path / "mlflow.db")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "wb").mkdir()
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts go to ./mlruns
    wandb.teardown()
    yield variables
    wandb.teardown()


def _steps(record: TrialRecord, key: str = "reward") -> dict[int, float]:
    return {int(row["step"]): row[key] for row in record.step_metrics() if key in row}


def _values_by_step(record: TrialRecord) -> dict[int, float]:
    """The trial's reported values, each at its chunk's last global step."""
    ends = {}
    for row in record.step_metrics():
        ends[int(row["unit"])] = max(ends.get(int(row["unit"]), 0), int(row["step"]))
    return {ends[unit]: value for unit, value in record.trial.intermediate_values.items()}


# ---------------------------------------------------------------------- a gang of 3, a crash, a rerun
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.e2e
def test_a_gang_of_three_writes_three_runs_in_each_tracker_and_a_crash_and_rerun_continues_the_same_runs(
        tiny_model, tmp_path, mlflow_template):
    """`rfopt run --gang-size 3 --report-to wandb mlflow trackio tensorboard`, killed (SIGKILL) right after the
    gang's second commit, then run again: each tracker holds one run per trial (continued, not doubled) with its
    params, every optimizer step on the trial's global step and the values Optuna got, all equal to the study's."""
    from crashkit import env, run, run_command

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    (tmp_path / "wb").mkdir()
    environ = env(tiny_model, RFOPT_TEST_CHUNKS=2, **tracker_env(tmp_path, tmp_path / "mlflow.db"))
    storage = f"sqlite:///{tmp_path / 'gang.db'}"
    command = run_command(storage, "--gang-size", "3", "--checkpoint-dir", str(tmp_path / "ck"),
                          *[arg for name in ALL for arg in ("--report-to", name)])
    assert run(command, tmp_path, environ | {"RFOPT_CRASH_AT": "unit-committed:2"}, tmp_path / "log") == -9
    assert run(command, tmp_path, environ, tmp_path / "log") == 0, (tmp_path / "log").read_text()[-3000:]

    study = rfopt.load_study("tiny", storage)
    records = [TrialRecord(t) for t in study.optuna.trials]
    assert [r.state.name for r in records] == ["COMPLETE"] * 3
    assert all(any(k.startswith("rfopt:gang:") for k in r.attrs) for r in records)  # trained as a gang
    uid = study_record(study.optuna).uid

    # W&B: one run per trial, its id fixed by study and trial, written by both processes.
    runs = wandb_runs(tmp_path / "wb")
    assert sorted(runs) == sorted([f"rfopt-{uid[:12]}-{n}" for n in range(3)] + [f"rfopt-{uid[:12]}-study"])
    for record in records:
        sessions = runs[f"rfopt-{uid[:12]}-{record.number}"]  # each process's, and one per committed chunk
        assert {(s.project, s.group, s.name, s.job_type) for s in sessions} == {
            ("tiny", "tiny", f"tiny-trial-{record.number}", "trial")}
        assert sessions[0].config["learning_rate"] == record.trial.params["learning_rate"]
        assert sessions[0].config["config"]["args"]["learning_rate"] == record.trial.params["learning_rate"]
        history = [row for s in sessions for row in s.history]
        assert by_step(history, "train/global_step", "train/reward") == _steps(record)
        assert by_step(history, "train/global_step", "value") == _values_by_step(record)
        assert sessions[-1].summary["state"] == "complete" and sessions[-1].exit_code == 0
        assert "complete" in sessions[-1].tags

    # MLflow: the study's parent run and one child run per trial.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    found = mlflow_runs(uri, "tiny")
    parents = [r for r in found if r.data.tags.get("rfopt.role") == "study"]
    children = {int(r.data.tags["rfopt.trial"]): r for r in found if r.data.tags.get("rfopt.role") == "trial"}
    assert len(parents) == 1 and len(found) == 4 and sorted(children) == [0, 1, 2]
    assert parents[0].info.status == "FINISHED"  # every trial ended
    for record in records:
        child = children[record.number]
        assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert child.info.run_name == f"tiny-trial-{record.number}"
        assert float(child.data.params["learning_rate"]) == record.trial.params["learning_rate"]
        assert mlflow_history(uri, child.info.run_id, "train/reward") == _steps(record)
        assert mlflow_history(uri, child.info.run_id, "value") == _values_by_step(record)
        assert child.data.tags["rfopt.state"] == "complete" and child.info.status == "FINISHED"

    # trackio: the study's project, one run per trial (resumed by name, not made twice), and the study's run.
    assert sorted(trackio_runs("tiny")) == ["tiny", "tiny-trial-0", "tiny-trial-1", "tiny-trial-2"]
    for record in records:
        logs = trackio_logs("tiny", f"tiny-trial-{record.number}")
        assert by_step(logs, "step", "train/reward") == _steps(record)
        assert by_step(logs, "step", "value") == _values_by_step(record)
        assert trackio_config("tiny", f"tiny-trial-{record.number}")["learning_rate"] == \
            record.trial.params["learning_rate"]
        assert [a["title"] for a in trackio_alerts("tiny", f"tiny-trial-{record.number}")] == ["complete"]

    # TensorBoard: a directory per trial under the study's folder.
    folder = tmp_path / "tb" / "tiny"
    assert sorted(p.name for p in folder.iterdir()) == ["leaderboard", "trial-0", "trial-1", "trial-2"]
    for record in records:
        assert tensorboard_scalars(folder / f"trial-{record.number}", "train/reward") == _steps(record)
        assert tensorboard_scalars(folder / f"trial-{record.number}", "value") == _values_by_step(record)


# ---------------------------------------------------------------------- how trials end, and a warm clone
class PruneTrialOne(optuna.pruners.BasePruner):
    """Prunes trial 1, keeps the others."""

    def prune(self, study, trial):
        return trial.number == 1


def test_each_trials_end_is_in_its_runs_and_a_warm_clones_run_says_whose_clone_it_is(
        scripted, tiny_model, tmp_path, offline):
    """A gang of three: trial 0 completes, trial 1 is pruned at its first rung, trial 2's reward function raises;
    then a warm clone of trial 1 continues its step axis in a run of its own that names its parent."""
    configs = [trial_config(tiny_model, learning_rate=1e-3), trial_config(tiny_model, learning_rate=5e-3),
               trial_config(tiny_model, rewards=(reward_len, reward_vowels, reward_raises), learning_rate=1e-3)]
    scripted.values = {0: [0.5, 1.0]}  # trial 0 the best
    study = rfopt.create_study(study_name="ends", storage=f"sqlite:///{tmp_path / 's.db'}", num_chunks=2,
                               report_to=ALL, pruner=PruneTrialOne())
    study.optimize(configs, TRAIN, EVAL, show_progress_bar=False, gang_size=3)
    clone = study.clone_trial(1, {"learning_rate": 2e-3}, warm_start=True)
    study.optimize(configs, TRAIN, EVAL, show_progress_bar=False)
    records = [TrialRecord(t) for t in study.optuna.trials]
    assert [r.state.name for r in records] == ["COMPLETE", "PRUNED", "FAIL", "COMPLETE"] and clone == 3
    pruned_reason, fail_reason = records[1].end_reason, records[2].end_reason
    assert "PruneTrialOne" in pruned_reason and "reward_raises" in fail_reason
    uid = study_record(study.optuna).uid

    runs = wandb_runs(tmp_path / "wb")
    last = {n: runs[f"rfopt-{uid[:12]}-{n}"][-1] for n in range(4)}
    assert [last[n].summary["state"] for n in range(4)] == ["complete", "pruned", "failed", "complete"]
    assert last[1].summary["end_reason"] == pruned_reason and last[2].summary["end_reason"] == fail_reason
    assert [last[n].exit_code for n in range(4)] == [0, 0, 1, 0]
    clone_run = runs[f"rfopt-{uid[:12]}-3"][0]
    assert clone_run.config["rfopt"]["clone_of"] == 1 and clone_run.config["rfopt"]["warm_start"] is True
    assert "clone" in clone_run.tags
    clone_steps = by_step([row for s in runs[f"rfopt-{uid[:12]}-3"] for row in s.history], "train/global_step",
                          "train/reward")
    parent = _steps(records[1])
    assert clone_steps == _steps(records[3])  # its parent's steps up to where it starts, then its own after them
    assert {s: v for s, v in clone_steps.items() if s <= max(parent)} == parent and max(clone_steps) > max(parent)
    board = runs[f"rfopt-{uid[:12]}-study"][-1].table("leaderboard")  # the study's leaderboard, best first
    assert board["columns"] == ["trial", "state", "value", "chunks", "learning_rate", "rewards", "reason"]
    assert [(row[0], row[1]) for row in board["data"]] == [(0, "COMPLETE"), (3, "COMPLETE"), (1, "PRUNED"), (2, "FAIL")]

    uri = os.environ["MLFLOW_TRACKING_URI"]
    children = {int(r.data.tags["rfopt.trial"]): r for r in mlflow_runs(uri, "ends")
                if r.data.tags.get("rfopt.role") == "trial"}
    assert [children[n].data.tags["rfopt.state"] for n in range(4)] == ["complete", "pruned", "failed", "complete"]
    assert [children[n].info.status for n in range(4)] == ["FINISHED", "FINISHED", "FAILED", "FINISHED"]
    assert children[1].data.tags["rfopt.end_reason"] == pruned_reason
    assert children[3].data.tags["rfopt.clone_of"] == "1"

    titles = {n: [a["title"] for a in trackio_alerts("ends", f"ends-trial-{n}")] for n in range(4)}
    assert titles == {0: ["complete"], 1: ["pruned"], 2: ["failed"], 3: ["complete"]}
    assert trackio_config("ends", "ends-trial-3")["rfopt"]["clone_of"] == 1

    ends = [tensorboard_text(tmp_path / "tb" / "ends" / f"trial-{n}", "end") for n in range(4)]
    assert ends[1] == [f"pruned: {pruned_reason}"] and ends[2][0].startswith("failed: ")


# ---------------------------------------------------------------------- refused up front
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_mlflow_tracking_uri_that_cannot_be_reached_is_refused_before_anything_is_stored(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")
    study = rfopt.create_study(study_name="down", storage=f"sqlite:///{tmp_path / 's.db'}", report_to="mlflow")
    with pytest.raises(TrackerRefused, match=r"mlflow: its tracking URI http://127.0.0.1:\d+ cannot be reached"):
        study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False)
    assert study.optuna.trials == [] and study_record(study.optuna).plan is None


def test_wandb_online_without_credentials_is_refused_before_anything_is_stored(tiny_model, tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    try:
        study = rfopt.create_study(study_name="nokey", storage=f"sqlite:///{tmp_path / 's.db'}", report_to="wandb")
        with pytest.raises(TrackerRefused, match=r"wandb is online .* but has no credentials .* WANDB_MODE=offline"):
            study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False)
        assert study.optuna.trials == [] and study_record(study.optuna).plan is None
    finally:
        wandb.teardown()


def test_rfopt_logs_the_four_trackers_itself_and_passes_the_others_on_to_trl(monkeypatch):
    assert trackers.own(["wandb", "comet_ml", "tensorboard"]) == ["tensorboard", "wandb"]
    assert trackers.passed_on(["wandb", "comet_ml", "tensorboard"]) == ["comet_ml"]
    monkeypatch.setattr(_report_to, "_installed", lambda name: name in ("mlflow", "trackio"))
    assert trackers.own(["all"]) == ["mlflow", "trackio"]  # "all": those installed
