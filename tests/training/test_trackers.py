"""Trials' TRL logs in TensorBoard: one run per trial, per-step scalars on the trial's global step, a resumed trial
continuing its run, and results bit-identical with the tracker on; ``report_to`` checked before anything runs, and a
tracker passed on to TRL's one-run-per-process integration training one trial at a time. (W&B, MLflow and trackio,
and TensorBoard's part of them: tests/training/test_tracker_runs.py.)"""

from pathlib import Path

import pytest
import torch
from rfopt_testkit import prompts_dataset, trial_config
from safetensors.torch import load_file

import rfopt
from rfopt.cli.program import _parser
from rfopt.storage.schema import TrialRecord
from rfopt.storage.schema import study_attrs

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="tensorboard is not installed: pip install -e '.[test]'")

TRAIN, EVAL = prompts_dataset(4), prompts_dataset(2, "E")


class Interrupted(Exception):
    pass


def _adapter(study, number):
    return load_file(TrialRecord(study.optuna.trials[number]).adapter + "/adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.e2e
def test_tensorboard_gets_one_run_per_trial_with_per_step_scalars_and_the_same_results(
        tiny_model, tmp_path, monkeypatch):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    plain = rfopt.create_study(study_name="plain", storage=f"sqlite:///{tmp_path / 'plain.db'}", num_chunks=2)
    plain.optimize(configs, TRAIN, EVAL, show_progress_bar=False)

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    tracked = rfopt.create_study(study_name="tracked", storage=f"sqlite:///{tmp_path / 'tracked.db'}", num_chunks=2,
                                 report_to="tensorboard")

    def interrupt(number, step, value):
        if (number, step) == (0, 0):
            raise Interrupted  # the run ends after trial 0's first chunk; trial 0 stays resumable

    with pytest.raises(Interrupted):
        tracked.optimize(configs, TRAIN, EVAL, show_progress_bar=False, on_unit=interrupt)
    tracked.optimize(configs, TRAIN, EVAL, show_progress_bar=False)  # continues trial 0, runs trial 1

    runs = sorted(p.name for p in (tmp_path / "tb" / "tracked").iterdir())
    assert runs == ["leaderboard", "trial-0", "trial-1"]  # one run per trial, grouped under the study
    for number in (0, 1):
        run = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "tracked" / f"trial-{number}"))
        run.Reload()
        tags = run.Tags()["scalars"]
        assert {"train/reward", "train/loss", "train/learning_rate", "train/rewards/reward_len/mean"} <= set(tags)
        rewards = run.Scalars("train/reward")
        assert [e.step for e in rewards] == [1, 2, 3, 4]  # both chunks, one global step axis
        stored = TrialRecord(tracked.optuna.trials[number]).step_metrics()
        assert [e.value for e in rewards] == pytest.approx([row["reward"] for row in stored])
    resumed = Path(tmp_path / "tb" / "tracked" / "trial-0")
    assert len(list(resumed.glob("events.out.tfevents.*"))) == 2  # each process appended to the trial's run

    for number in (0, 1):
        a, b = plain.optuna.trials[number], tracked.optuna.trials[number]
        assert a.intermediate_values == b.intermediate_values and a.value == b.value
        weights_a, weights_b = _adapter(plain, number), _adapter(tracked, number)
        assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert study_attrs(tracked.optuna)["rfopt:report_to"] == ["tensorboard"]


def test_report_to_is_checked_before_anything_runs_and_the_cli_takes_it(tmp_path):
    with pytest.raises(ValueError, match=r"report_to: unknown tracker \['tensorbord'\]"):
        rfopt.create_study(study_name="x", storage=f"sqlite:///{tmp_path / 'x.db'}", report_to="tensorbord")
    for command in ("run", "worker"):
        args = _parser().parse_args([command, "arithmetic", "--report-to", "tensorboard", "--report-to", "mlflow"])
        assert args.report_to == ["tensorboard", "mlflow"]


def test_report_to_of_the_wrong_type_is_refused_naming_what_to_give(tmp_path):
    """Issue 35: ``create_study(report_to=42)`` raised ``TypeError: 'int' object is not iterable``."""
    storage = f"sqlite:///{tmp_path / 'x.db'}"
    for value in (42, {"tensorboard": True}, True):
        with pytest.raises(TypeError, match="report_to must be a tracker name or a list of them"):
            rfopt.create_study(study_name="x", storage=storage, report_to=value)
    import optuna

    assert not (tmp_path / "x.db").exists() or optuna.get_all_study_summaries(storage) == []  # nothing stored


def test_report_to_in_a_trials_grpo_config_is_named_with_the_studys_that_applies(tiny_model, tmp_path, caplog):
    """Issue 35: a TRL user writes ``report_to`` in the GRPOConfig; rfopt gives every chunk's trainer the study's, and
    dropped the config's without a word."""
    from rfopt.engine.planning.checks import check_run, say_placement
    from rfopt.engine.planning.request import RunRequest
    from rfopt.training.models import Placement

    study = rfopt.create_study(study_name="x", storage=f"sqlite:///{tmp_path / 'x.db'}")
    configs = [trial_config(tiny_model), trial_config(tiny_model, report_to="tensorboard")]
    checked = check_run(study.optuna, RunRequest(configs, prompts_dataset(8), prompts_dataset(2), settings=_settings()))
    with caplog.at_level("WARNING", logger="rfopt"):
        say_placement(Placement.of("cpu"), checked)
    [message] = [r.getMessage() for r in caplog.records if "report_to" in r.getMessage()]
    assert "configs[1] sets report_to=['tensorboard'] in its GRPOConfig, which rfopt does not use" in message
    assert "the study's report_to applies to every trial (now none)" in message and "--report-to" in message


def _settings():
    from rfopt.config.settings import StudySettings

    return StudySettings(num_chunks=2)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.e2e
def test_the_readmes_command_line_writes_one_tensorboard_run_per_trial_under_runs(tiny_model, tmp_path):
    """`rfopt run STUDY --report-to tensorboard && tensorboard --logdir runs`: the runs land in ./runs/<study>/."""
    from crashkit import env, run, run_command

    storage = f"sqlite:///{tmp_path / 'cli.db'}"
    environ = env(tiny_model, RFOPT_TEST_TRIALS=2, RFOPT_TEST_CHUNKS=2)
    environ.pop("TENSORBOARD_LOGGING_DIR", None)
    command = run_command(storage, "--report-to", "tensorboard", "--checkpoint-dir", str(tmp_path / "ck"))
    assert run(command, tmp_path, environ, tmp_path / "log") == 0, (tmp_path / "log").read_text()
    runs = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in runs.iterdir()) == ["leaderboard", "trial-0", "trial-1"]
    study = rfopt.load_study("tiny", storage)
    for number in (0, 1):
        events = event_accumulator.EventAccumulator(str(runs / f"trial-{number}"))
        events.Reload()
        stored = TrialRecord(study.optuna.trials[number]).step_metrics()
        rewards = events.Scalars("train/reward")
        assert [e.step for e in rewards] == list(range(1, len(stored) + 1)) and len(stored) == 4  # 2 chunks, one axis
        assert [e.value for e in rewards] == pytest.approx([row["reward"] for row in stored])
    assert study_attrs(study.optuna)["rfopt:report_to"] == ["tensorboard"]


def test_a_run_reporting_to_a_tracker_passed_on_to_trl_trains_one_trial_at_a_time_and_says_so(
        scripted, tiny_model, tmp_path, monkeypatch, caplog):
    """TRL's integrations of trackers other than the four rfopt logs itself keep one active run per process: a run
    reporting to one trains with gang_size 1 and says so in a warning."""
    from rfopt.training import trackers
    from rfopt.training.trackers import _tracking

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setattr(_tracking, "passed_on", lambda report_to: ["comet_ml"])  # comet_ml is not installed here
    monkeypatch.setattr(trackers.Tracking, "trainer_args", lambda self, number: {"report_to": []})
    study = rfopt.create_study(study_name="one-run", storage=f"sqlite:///{tmp_path / 's.db'}", num_chunks=2,
                               report_to="tensorboard")
    with caplog.at_level("WARNING", logger="rfopt"):
        study.optimize(rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3]), TRAIN, EVAL,
                       show_progress_bar=False)
    assert "report_to comet_ml: one trial at a time (gang_size 1 instead of 4)" in caplog.text
    assert not [k for t in study.optuna.trials for k in t.system_attrs if k.startswith("rfopt:gang:")]
    assert all(t.state.name == "COMPLETE" for t in study.optuna.trials)


def test_the_trackers_leaderboard_ranks_the_trials_as_the_study_does(tiny_model, tmp_path):
    from stored_study import stored_study

    from rfopt.training.trackers._tracking import _leaderboard

    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 2e-3, 3e-3, 4e-3, 5e-3])
    # complete (0.4, 0.6, 0.6), running after one unit (0.9), running after none
    values = {0: [0.2, 0.4], 1: [0.9], 2: [0.5, 0.6], 3: [], 4: [0.3, 0.6]}
    study = stored_study(f"sqlite:///{tmp_path / 's.db'}", "s", configs, prompts_dataset(8), prompts_dataset(2, "E"),
                         values=values)
    trials = study.optuna.get_trials(deepcopy=False)
    ranked = [row[0] for row in _leaderboard(study.optuna, trials).rows]
    assert ranked == [r.number for r in study.leaderboard()] == [2, 4, 0, 1, 3]


def test_a_trial_whose_tensorboard_folder_moved_is_logged_whole_in_the_new_one_with_a_warning(
        tiny_model, tmp_path, monkeypatch, caplog):
    """Issue 41 item 14: a changed TENSORBOARD_LOGGING_DIR (or another working directory, ``runs`` being relative)
    split each trial's run between two folders without a word."""
    from stored_study import stored_study
    from trackerkit import tensorboard_scalars

    from rfopt.training.trackers import Tracking

    study = stored_study(f"sqlite:///{tmp_path / 's.db'}", "s", [trial_config(tiny_model)], prompts_dataset(8),
                         prompts_dataset(2, "E"), values={0: [0.25]})  # RUNNING after its first unit
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(first))
    tracking = Tracking(["tensorboard"], study.optuna)
    tracking.committed(0, 0, 0.25)
    tracking.close()
    assert TrialRecord(study.optuna.trials[0]).tracked_at == {"tensorboard": str(first / "s" / "trial-0")}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(second))
    with caplog.at_level("WARNING", logger="rfopt"):
        tracking = Tracking(["tensorboard"], study.optuna)
        tracking.committed(0, 0, 0.25)
        tracking.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"trial 0: report_to tensorboard logged its run to {first / 's' / 'trial-0'}, and this process "
                    f"logs it to {second / 's' / 'trial-0'} (its folder moved: TENSORBOARD_LOGGING_DIR or the working "
                    "directory changed); its 1 committed units are logged there again from storage, so the run there "
                    "is whole"]
    for where in (first, second):
        assert list(tensorboard_scalars(where / "s" / "trial-0", "value").values()) == [0.25]
    assert TrialRecord(study.optuna.trials[0]).tracked_at == {"tensorboard": str(second / "s" / "trial-0")}
