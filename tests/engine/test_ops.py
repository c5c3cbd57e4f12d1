"""Pause, resume, stop and clone while a study runs, through the Python API and the command line."""

import optuna
import pytest
import torch
from safetensors.torch import load_file

import rfopt
from rfopt.cli import main as cli
from rfopt.errors import OpError
from rfopt_testkit import prompts_dataset, trial_config
from stored_study import stored_study
from rfopt.storage.schema import trial_attrs

OPS_LOG_ATTR = "rfopt:ops"

TRAIN, EVAL = prompts_dataset(16), prompts_dataset(2, "E")


def _configs(model):
    return rfopt.grid(trial_config(model, gradient_accumulation_steps=2), learning_rate=[1e-3, 5e-3])


def _optimize(study, configs, on_unit=None, num_chunks=4):
    done = []

    def record(number, step, value):
        done.append((number, step))
        if on_unit is not None:
            on_unit(number, step, len(done))

    study.optimize(configs, TRAIN, EVAL, num_chunks=num_chunks, show_progress_bar=False, on_unit=record)
    return done


def _adapter(study, number):
    return load_file(trial_attrs(study.optuna.trials[number])["rfopt:adapter"] + "/adapter_model.safetensors")


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stopped_trial_ends_pruned_with_its_last_value_and_trains_no_further(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)

    def on_unit(number, step, count):
        if (number, step) == (1, 0):
            study.stop_trial(1)

    done = _optimize(study, _configs(tiny_model), on_unit)
    assert [step for number, step in done if number == 1] == [0]
    stopped = study.optuna.trials[1]
    assert stopped.state == optuna.trial.TrialState.PRUNED
    assert stopped.value == stopped.intermediate_values[0]
    assert trial_attrs(stopped)["rfopt:stopped"]["reason"] == "stopped by user"
    history = trial_attrs(stopped)[OPS_LOG_ATTR]
    assert history[0]["op"] == "stop" and "@" in history[0]["by"] and history[0]["applied_at"]
    assert "stopped by user" in study.leaderboard_text()
    assert study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE


def test_paused_trial_resumes_exactly_where_it_was(scripted, tiny_model, tmp_path):
    reference = rfopt.create_study(study_name="r", storage=f"sqlite:///{tmp_path / 'ref.db'}")
    _optimize(reference, _configs(tiny_model))

    study = rfopt.create_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.db'}")
    order = []

    def on_unit(number, step, count):
        order.append((number, step))
        if (number, step) == (1, 0):
            study.pause_trial(1)
        if (number, step) == (0, 2):
            study.resume_trial(1)

    _optimize(study, _configs(tiny_model), on_unit)
    # Trial 1 sat out while paused (trial 0 ran chunks 1 and 2 alone), then caught up.
    assert order[:4] == [(0, 0), (1, 0), (0, 1), (0, 2)]
    paused, ref = study.optuna.trials[1], reference.optuna.trials[1]
    assert paused.state == ref.state == optuna.trial.TrialState.COMPLETE
    assert paused.intermediate_values == ref.intermediate_values
    assert _same(_adapter(study, 1), _adapter(reference, 1))
    assert [op["op"] for op in trial_attrs(paused)[OPS_LOG_ATTR]] == ["pause", "resume"]


def test_a_warm_clones_weights_are_stored_before_it_is_enqueued_and_removed_if_it_is_cancelled(
        scripted, tiny_model, storage, monkeypatch):
    """A process running the study may start a clone the moment it is WAITING: its starting weights must already
    be there (they are named by the clone's lineage token, not by its number). A cancelled one's are removed."""
    study = rfopt.create_study(study_name="w", storage=storage)
    seen = []
    add_trial = optuna.Study.add_trial

    def checked_add_trial(self, trial):
        token = trial_attrs(trial)["rfopt:clone"]["token"]
        seen.append(study.checkpoints.has_warm_start(token))
        return add_trial(self, trial)

    def on_unit(number, step, count):
        if (number, step) == (0, 0):
            with monkeypatch.context() as patch:
                patch.setattr(optuna.Study, "add_trial", checked_add_trial)
                made = study.clone_trial(0, {"learning_rate": 2e-3}, warm_start=True)
            token = trial_attrs(study.optuna.trials[made])["rfopt:clone"]["token"]
            assert seen == [True] and study.checkpoints.has_warm_start(token)
            study.cancel_clone(made)  # before anybody starts it: one trial runs at a time here
            assert not study.checkpoints.has_warm_start(token)

    _optimize(study, _configs(tiny_model)[:1], on_unit, num_chunks=2)
    assert [t.state for t in study.optuna.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]


def test_warm_clone_starts_from_the_parents_weights_and_cold_clone_from_the_base(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="c", storage=storage)
    parent_weights = {}
    clones = {}

    def on_unit(number, step, count):
        if (number, step) == (0, 1):
            parent_weights.update(study.checkpoints.load(0).weights)
            # A learning rate of 1e-300 (a clone's must be > 0) keeps, to float64's precision, whatever the clone
            # starts from: its final adapter shows where it started.
            clones["warm"] = study.clone_trial(0, {"learning_rate": 1e-300}, warm_start=True)
            clones["cold"] = study.clone_trial(0, {"learning_rate": 1e-300})

    _optimize(study, _configs(tiny_model)[:1], on_unit)
    warm, cold = study.optuna.trials[clones["warm"]], study.optuna.trials[clones["cold"]]
    assert warm.state == cold.state == optuna.trial.TrialState.COMPLETE
    # The warm clone reports at its parent's step numbers onward; the cold one from step 0.
    assert sorted(warm.intermediate_values) == [2, 3]
    assert sorted(cold.intermediate_values) == [0, 1, 2, 3]
    assert _same(_adapter(study, warm.number), parent_weights)
    assert _adapter(study, cold.number)["w"].abs().item() < 1e-290  # a fresh start (the parent's is far from 0)
    assert trial_attrs(warm)["rfopt:clone"]["parent"] == 0
    assert trial_attrs(warm)["rfopt:clone"]["overrides"] == {"learning_rate": 1e-300}
    assert trial_attrs(warm)["rfopt:clone"]["warm_start"] is True
    assert rfopt.TrialConfig.from_json(trial_attrs(warm)["rfopt:config"]).args.learning_rate == 1e-300


def test_ops_from_the_command_line_reach_the_running_study(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="cli", storage=storage)
    replies = {}

    def on_unit(number, step, count):
        if (number, step) == (0, 0):
            replies["clone"] = cli(["clone", "0", "--study", "cli", "--storage", storage,
                                    "--set", "learning_rate=2e-3", "--warm-start"])
        if (number, step) == (1, 0):
            replies["stop"] = cli(["stop", "1", "--study", "cli", "--storage", storage])

    _optimize(study, _configs(tiny_model), on_unit, num_chunks=2)
    assert replies == {"clone": 0, "stop": 0}
    trials = study.optuna.trials
    assert trials[1].state == optuna.trial.TrialState.PRUNED
    assert trial_attrs(trials[2])["rfopt:clone"]["parent"] == 0
    assert trials[2].state == optuna.trial.TrialState.COMPLETE and sorted(trials[2].intermediate_values) == [1]


def test_bad_ops_are_refused_and_change_nothing(tiny_model, storage, capsys):
    study = stored_study(storage, "b", _configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2)  # one COMPLETE trial
    before = len(study.optuna.trials)
    with pytest.raises(OpError, match="trial 0 is COMPLETE; only a RUNNING trial can be paused"):
        study.pause_trial(0)
    with pytest.raises(OpError, match="has no trial 7"):
        study.stop_trial(7)
    with pytest.raises(OpError, match="unknown field"):
        study.clone_trial(0, {"learning_rat": 1e-3})
    with pytest.raises(OpError, match="expected a number"):
        study.clone_trial(0, {"learning_rate": "high"})
    with pytest.raises(OpError, match="num_generations"):
        study.clone_trial(0, {"num_generations": 3})
    with pytest.raises(OpError, match="shape must stay.*'r'"):
        study.clone_trial(0, {"lora_r": 8}, warm_start=True)
    with pytest.raises(OpError, match="nothing left to train"):
        study.clone_trial(0, {}, warm_start=True)
    assert len(study.optuna.trials) == before
    assert cli(["clone", "0", "--study", "b", "--storage", storage, "--set", "learning_rate"]) == 1
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    assert cli(["resume", "0", "--study", "b", "--storage", storage]) == 1
    assert "only a RUNNING trial can be resumed" in capsys.readouterr().err


def test_clone_set_refuses_values_that_train_nothing_or_past_the_models_positions(tiny_model, storage, capsys):
    """Issue 41 item 11: ``rfopt clone --set`` (the dashboard's Check's validation) took these."""
    study = stored_study(storage, "v", _configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2)
    before = len(study.optuna.trials)
    for assignment, says in [("learning_rate=0", "args.learning_rate: 0.0; give a number > 0"),
                             ("lora_alpha=-3", "peft_config.lora_alpha: -3; give a number > 0"),
                             ("epsilon=-1", "args.epsilon: -1.0; the clipping range is a number >= 0"),
                             ("max_completion_length=1024", "args.max_completion_length: 1024 tokens, and "
                              f"'{tiny_model}' has 1024 positions (its max_position_embeddings)")]:
        assert cli(["clone", "0", "--study", "v", "--storage", storage, "--set", assignment]) == 1, assignment
        assert says in capsys.readouterr().err, assignment
    assert cli(["clone", "0", "--study", "v", "--storage", storage, "--set", "max_completion_length=1023"]) == 0
    assert len(study.optuna.trials) == before + 1


def test_resume_of_a_running_trial_that_is_not_paused_is_refused(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="x", storage=storage)
    errors = []

    def on_unit(number, step, count):
        if (number, step) == (0, 0):
            try:
                study.resume_trial(1)
            except OpError as exc:
                errors.append(str(exc))

    _optimize(study, _configs(tiny_model), on_unit, num_chunks=2)
    assert errors == ["trial 1 is not paused; only a paused trial can be resumed"]


def test_a_stop_that_arrives_while_a_pause_is_being_applied_is_honoured(scripted, tiny_model, storage, monkeypatch):
    """Requests are kept under keys of their own and applied by id: a stop written between the engine's read of the
    pending pause and its record of it applied is not lost (a single request slot, cleared after applying, lost it)."""
    from rfopt.storage import schema

    study = rfopt.create_study(study_name="race", storage=storage)
    write_paused = schema.write_paused

    def pause_then_a_stop_arrives(ref, paused):
        write_paused(ref, paused)
        if paused and ref.number == 1:
            study.stop_trial(1)  # another process asks, while this one is applying the pause

    monkeypatch.setattr(schema, "write_paused", pause_then_a_stop_arrives)

    def on_unit(number, step, count):
        if (number, step) == (1, 0):
            study.pause_trial(1)

    done = _optimize(study, _configs(tiny_model), on_unit)
    trial = study.optuna.trials[1]
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert trial_attrs(trial)["rfopt:stopped"]["reason"] == "stopped by user"
    assert [op["op"] for op in trial_attrs(trial)[OPS_LOG_ATTR]] == ["pause", "stop"]
    assert len({op["id"] for op in trial_attrs(trial)[OPS_LOG_ATTR]}) == 2  # each request applied once, by its id
    assert [step for number, step in done if number == 1] == [0]
    assert study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE


def test_requests_made_at_the_same_moment_are_all_kept_and_applied_in_order(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="many", storage=storage)

    def on_unit(number, step, count):
        if (number, step) == (1, 0):
            study.pause_trial(1)
            study.resume_trial(1)  # both pending at once: applied oldest first, the trial goes on unpaused

    _optimize(study, _configs(tiny_model), on_unit)
    trial = study.optuna.trials[1]
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert [op["op"] for op in trial_attrs(trial)[OPS_LOG_ATTR]] == ["pause", "resume"]
    assert not trial_attrs(trial).get("rfopt:paused", False)


@pytest.fixture(scope="module")
def finished(tiny_model, tmp_path_factory):
    """A study whose one trial trained both chunks (written as a run leaves it): its database file, copied by each test
    that uses it."""
    where = tmp_path_factory.mktemp("finished")
    stored_study(f"sqlite:///{where / 'f.db'}", "f", _configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2,
                 checkpoint_dir=where / "ck")
    return where / "f.db"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learning_rate": -1}, "optimizer or LR scheduler refuses these settings: Invalid learning rate: -1"),
        ({"lr_scheduler_type": "cosin"}, "cosin is not a valid SchedulerType"),
        ({"temperature": 0.0}, "generation refuses these sampling settings: `temperature` \\(=0.0\\)"),
        ({"top_p": 1.5}, "`top_p` has to be a float > 0 and < 1"),
        ({"model": "/no/such/dir"}, "model '/no/such/dir' cannot be found: it is not a local directory with config.json"),
        ({"rewards": ["no_such_module:reward"]}, "'no_such_module:reward' cannot be imported"),
        ({"learning_rate": "fast"}, "learning_rate: expected a number, got 'fast'"),
        ({"use_cpu": False}, "the device a study runs on decides use_cpu, bf16 and fp16"),
    ],
)
def test_a_clone_override_training_would_refuse_is_refused_before_anything_is_written(finished, tmp_path, overrides,
                                                                                        message):
    import shutil

    shutil.copy(finished, tmp_path / "f.db")
    study = rfopt.load_study("f", f"sqlite:///{tmp_path / 'f.db'}")
    with pytest.raises(OpError, match=f"clone of trial 0: .*{message}"):
        study.clone_trial(0, overrides)
    assert len(study.optuna.trials) == 1


def test_clone_overrides_from_the_command_line_are_read_as_their_fields_types(finished, tmp_path, capsys):
    import shutil

    shutil.copy(finished, tmp_path / "f.db")
    storage = f"sqlite:///{tmp_path / 'f.db'}"
    assert cli(["clone", "0", "--study", "f", "--storage", storage, "--set", "learning_rate=2e-6",
                "--set", "lora_r=8", "--set", "use_liger_kernel=false", "--set", "reward_weights=[1.0, 0.5]"]) == 0
    # The reply quotes the values as the clone holds them, not the texts typed.
    assert capsys.readouterr().out.strip() == ("trial 1: clone of trial 0 with learning_rate=2e-06, lora_r=8, "
                                               "use_liger_kernel=False, reward_weights=[1.0, 0.5] enqueued")
    clone = rfopt.load_study("f", storage).optuna.trials[1]
    assert trial_attrs(clone)["rfopt:clone"]["overrides"] == {
        "learning_rate": 2e-6, "lora_r": 8, "use_liger_kernel": False, "reward_weights": [1.0, 0.5]}
    config = rfopt.TrialConfig.from_json(trial_attrs(clone)["rfopt:config"])
    assert (config.args.learning_rate, config.peft_config.r, config.args.reward_weights) == (2e-6, 8, [1.0, 0.5])


def test_a_clone_started_by_a_running_process_the_moment_it_is_enqueued_is_still_reported(finished, tmp_path,
                                                                                          monkeypatch):
    """`clone` finds the trial it made by its lineage token in any state: a process running the study may ask it
    (WAITING -> RUNNING) before `clone` reads it back."""
    import shutil

    from rfopt.compat import storage_of, trial_id_of

    shutil.copy(finished, tmp_path / "f.db")
    study = rfopt.load_study("f", f"sqlite:///{tmp_path / 'f.db'}")
    add_trial = optuna.Study.add_trial

    def add_then_start(self, trial):
        add_trial(self, trial)
        made = self.get_trials(deepcopy=False)[-1]
        assert storage_of(self).set_trial_state_values(trial_id_of(made), optuna.trial.TrialState.RUNNING)

    monkeypatch.setattr(optuna.Study, "add_trial", add_then_start)
    assert study.clone_trial(0, {"learning_rate": 2e-3}) == 1
    assert study.optuna.trials[1].state == optuna.trial.TrialState.RUNNING


def test_a_clone_with_a_model_the_categorical_param_lacks_is_described_by_what_the_study_reports(
        scripted, tiny_model, tmp_path, caplog, capsys):
    """The clone trains another model than the space's one choice: its Optuna params hold it as model#2 (never its
    parent's model), the clone, leaderboard and page say so, and study.best_config is the config it trained."""
    import shutil

    from rfopt.dashboard.leaderboard import _render_leaderboard
    from rfopt.dashboard.pages import _render_trial
    from rfopt.dashboard.views import TrialView

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    storage = f"sqlite:///{tmp_path / 'c.db'}"
    study = rfopt.create_study(study_name="c", storage=storage)

    def space(trial):
        return trial_config(trial.suggest_categorical("model", [str(tiny_model)]),
                            learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2))

    def steer(number, step, value):
        if number == 0 and step == 0:
            study.clone_trial(0, {"model": str(other)})
            study.stop_trial(0)  # the clone is the one that completes: the best trial

    study.optimize(space, TRAIN, EVAL, n_trials=1, num_chunks=2, show_progress_bar=False, on_unit=steer)
    assert "clone of trial 0: model='" in caplog.text and "The clone's Optuna params hold it as 'model#2'" in caplog.text
    parent, clone = study.optuna.trials
    assert (parent.state.name, clone.state.name) == ("PRUNED", "COMPLETE")
    assert "model" not in clone.params and clone.params["model#2"] == str(other)
    assert clone.params["learning_rate"] == parent.params["learning_rate"]
    assert study.best_params == {"model#2": str(other), "learning_rate": parent.params["learning_rate"]}
    assert study.best_config.model == str(other) == study.trial_config(1).model
    assert "! its model is the param model#2 (not a choice of model)" in study.leaderboard_text()

    views = {v.number: v for v in map(TrialView.of, study.optuna.trials)}
    assert views[1].held_as == {"model": "model#2"} and views[0].held_as == {}
    board = _render_leaderboard(list(views.values()), 1, "best", study.optuna.direction)
    assert "<span class='held' title='Optuna&#x27;s param model cannot hold this clone" in board
    assert f"{other} ⚠</span>" in board
    assert "Optuna's params hold it as model#2" in _render_trial(0, views[1], steerable=True)

    # The command line says it where the clone is made; the same value reuses model#2.
    assert cli(["clone", "0", "--study", "c", "--storage", storage, "--set", f"model={other}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trial 2: clone of trial 0 with model=") and "note: model=" in out
    assert "The clone's Optuna params hold it as 'model#2'" in out
    assert study.optuna.trials[2].params["model#2"] == str(other)
