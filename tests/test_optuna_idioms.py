"""An rfopt study speaks Optuna: `optimize(n_trials, timeout, callbacks, catch)` mean what they mean to
`optuna.Study.optimize`, `n_trials` means the same in `optimize`, `work` and the command line, Optuna's study
attributes work on an rfopt study, trial ops cannot be confused with `optuna.Study.stop`, and a study's settings are
stored once."""

import time

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from rfopt_testkit import prompts_dataset, reward_len, reward_raises, trial_config

import rfopt
from rfopt.chunks import ChunkPlan
from rfopt.errors import RewardFunctionError
from rfopt.cli import main
from rfopt.storage.schema import study_attrs, trial_attrs

TRAIN, EVAL = prompts_dataset(16), prompts_dataset(2, "E")


def _space(model_path):
    def space(trial):
        return trial_config(model_path, learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True))

    return space


def _run(study, space, **kwargs):
    kwargs.setdefault("num_chunks", 2)
    study.optimize(space, TRAIN, EVAL, show_progress_bar=False, **kwargs)


def _states(study):
    return [t.state for t in study.optuna.get_trials(deepcopy=False)]


def _sampler():
    return optuna.samplers.RandomSampler(seed=0)


# ---------------------------------------------------------------------- n_trials, timeout, callbacks, catch
def test_n_trials_counts_the_trials_each_call_starts_as_in_optuna(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage, sampler=_sampler())
    _run(study, _space(tiny_model), n_trials=2)
    _run(study, _space(tiny_model), n_trials=1)
    assert _states(study) == [TrialState.COMPLETE] * 3
    # The study's total: a rerun only tops it up, whichever call started the trials.
    _run(study, _space(tiny_model), n_trials_total=4)
    _run(study, _space(tiny_model), n_trials_total=4)
    assert _states(study) == [TrialState.COMPLETE] * 4


def test_work_counts_n_trials_as_optimize_does(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="w", storage=storage, sampler=_sampler())
    for _ in range(2):
        study.work(_space(tiny_model), TRAIN, EVAL, n_trials=1, num_chunks=2, lease_seconds=5, poll_seconds=0.05)
    assert _states(study) == [TrialState.COMPLETE] * 2
    study.work(_space(tiny_model), TRAIN, EVAL, n_trials_total=3, lease_seconds=5, poll_seconds=0.05)
    assert _states(study) == [TrialState.COMPLETE] * 3


def test_timeout_stops_starting_units_and_a_rerun_finishes_the_same_trials(scripted, tiny_model, tmp_path):
    def values(study):
        return [(t.number, t.state, t.intermediate_values) for t in study.optuna.get_trials(deepcopy=False)]

    straight = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}", sampler=_sampler())
    _run(straight, _space(tiny_model), n_trials=2, num_chunks=4)

    study = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'b.db'}", sampler=_sampler())
    started = time.monotonic()

    def slow_first_unit(number, unit, value):
        time.sleep(max(0.0, started + 1.5 - time.monotonic()))  # the timeout passes while the first unit commits

    # One trial at a time: a gang started before the deadline would train each member's unit (as it should).
    _run(study, _space(tiny_model), n_trials=2, num_chunks=4, timeout=1.0, on_unit=slow_first_unit, gang_size=1)
    stopped = study.optuna.get_trials(deepcopy=False)
    assert [t.state for t in stopped] == [TrialState.RUNNING] * len(stopped)
    assert sum(len(t.intermediate_values) for t in stopped) == 1  # no unit started after the timeout
    _run(study, _space(tiny_model), n_trials=2 - len(stopped), num_chunks=4)
    assert values(study) == values(straight)  # resumed, exactly where it stopped


def test_callbacks_get_the_optuna_study_and_each_finished_trial_once(scripted, tiny_model, storage):
    seen = []

    def callback(optuna_study, trial):
        assert isinstance(optuna_study, optuna.Study) and isinstance(trial, FrozenTrial)
        seen.append((trial.number, trial.state))

    def space(trial):
        if trial.number == 1:
            return trial_config(tiny_model, rewards=(reward_raises,))
        return _space(tiny_model)(trial)

    study = rfopt.create_study(study_name="s", storage=storage, sampler=_sampler(),
                               pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    _run(study, space, n_trials=4, callbacks=[callback])
    assert sorted(seen) == sorted((t.number, t.state) for t in study.trials)
    assert {state for _, state in seen} >= {TrialState.COMPLETE, TrialState.FAIL}


def test_optunas_max_trials_callback_stops_an_open_ended_run(scripted, tiny_model, storage):
    """``n_trials=None`` asks trials until stopped, as in Optuna; Optuna's own callback stops it."""
    study = rfopt.create_study(study_name="s", storage=storage, sampler=_sampler())
    stop_at_two = optuna.study.MaxTrialsCallback(2, states=(TrialState.COMPLETE,))
    _run(study, _space(tiny_model), max_concurrent=1, callbacks=[stop_at_two])
    assert _states(study) == [TrialState.COMPLETE] * 2


def test_study_stop_from_on_unit_stops_asking_new_trials(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage, sampler=_sampler())
    _run(study, _space(tiny_model), n_trials=5, max_concurrent=1, on_unit=lambda *unit: study.stop())
    assert _states(study) == [TrialState.COMPLETE]


def test_catch_decides_whether_a_failing_trial_ends_the_run(scripted, tiny_model, tmp_path):
    configs = [trial_config(tiny_model, rewards=(reward_raises,)), trial_config(tiny_model, rewards=(reward_len,))]
    alone = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    _run(alone, configs)  # rfopt's default: the failing trial fails alone
    assert _states(alone) == [TrialState.FAIL, TrialState.COMPLETE]

    optuna_like = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'b.db'}")
    with pytest.raises(RewardFunctionError, match="reward_raises"):
        _run(optuna_like, configs, catch=())  # Optuna's default: the error ends the run, its trial failed
    failed, other = optuna_like.optuna.get_trials(deepcopy=False)
    assert failed.state == TrialState.FAIL and "reward_raises" in trial_attrs(failed)["rfopt:fail_reason"]
    assert other.state == TrialState.RUNNING  # left resumable
    _run(optuna_like, configs)
    assert _states(optuna_like) == [TrialState.FAIL, TrialState.COMPLETE]


class _RaisesJudgingTrialOne(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        if trial.number == 1:
            raise ValueError("my pruner cannot judge trial 1")
        return False


def test_a_pruner_that_raises_fails_the_trial_it_judges_as_in_optuna(scripted, tiny_model, tmp_path):
    """A trial whose ``should_prune()`` raises fails in Optuna, and `catch` decides whether the run goes on. A rung
    decision is the same call: the pruner's ValueError is not taken for "a peer ended elsewhere" and deferred."""
    configs = [trial_config(tiny_model, rewards=(reward_len,))] * 2
    alone = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}",
                               pruner=_RaisesJudgingTrialOne())
    _run(alone, configs)
    assert _states(alone) == [TrialState.COMPLETE, TrialState.FAIL]
    reason = trial_attrs(alone.optuna.trials[1])["rfopt:fail_reason"]
    assert "_RaisesJudgingTrialOne.prune raised ValueError: my pruner cannot judge trial 1" in reason

    optuna_like = rfopt.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'b.db'}",
                                     pruner=_RaisesJudgingTrialOne())
    with pytest.raises(ValueError, match="my pruner cannot judge trial 1"):
        _run(optuna_like, configs, catch=())
    assert _states(optuna_like) == [TrialState.RUNNING, TrialState.FAIL]  # the other left resumable


# ---------------------------------------------------------------------- an Optuna study to its user
def test_optunas_study_attributes_work_on_an_rfopt_study(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="attrs", storage=storage, sampler=_sampler())
    _run(study, _space(tiny_model), n_trials=2)
    real = study.optuna
    assert study.study_name == "attrs" and study.direction == real.direction and study.directions == real.directions
    assert study.best_trial.number == real.best_trial.number and study.best_value == real.best_value
    assert study.best_params == real.best_params
    assert [t.number for t in study.trials] == [0, 1] == [t.number for t in study.get_trials(states=[TrialState.COMPLETE])]
    frame = study.trials_dataframe()
    assert list(frame["number"]) == [0, 1] and "params_learning_rate" in frame.columns
    study.set_user_attr("owner", "me")
    assert study.user_attrs["owner"] == "me" == optuna.load_study(study_name="attrs", storage=storage).user_attrs["owner"]
    assert "best_trial" in dir(study)
    with pytest.raises(AttributeError, match="no attribute 'optimise'"):
        study.optimise  # noqa: B018


def test_trial_ops_have_names_apart_from_optunas_stop(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)
    with pytest.raises(TypeError, match=r"study.stop_trial\(0\)"):
        study.stop(0)
    with pytest.raises(RuntimeError):  # Optuna's: stop() belongs inside a running optimize
        study.stop()

    def pause_after_first_unit(number, unit, value):
        if unit == 0:
            study.pause_trial(number)

    _run(study, [trial_config(tiny_model)], on_unit=pause_after_first_unit)
    assert rfopt.storage.schema.TrialRecord(study.trials[0]).paused and study.trials[0].state == TrialState.RUNNING
    study.resume_trial(0)
    assert main(["stop", "0", "--study", "s", "--storage", storage]) == 0  # the CLI's verbs are unchanged
    assert [r.op for r in rfopt.storage.schema.TrialRecord(study.trials[0]).requests] == ["pause", "resume", "stop"]
    _run(study, [trial_config(tiny_model)])
    assert study.trials[0].state == TrialState.PRUNED and len(study.trials[0].intermediate_values) == 1
    clone = study.clone_trial(0, {"learning_rate": 0.002})
    assert main(["clone", "0", "--study", "s", "--storage", storage, "--set", "learning_rate=0.003"]) == 0
    assert [t.state for t in study.trials[clone:]] == [TrialState.WAITING] * 2
    assert [rfopt.TrialConfig.from_json(trial_attrs(t)["rfopt:config"]).args.learning_rate
            for t in study.trials[clone:]] == [0.002, 0.003]


# ---------------------------------------------------------------------- settings stored once
def test_settings_fixed_at_create_study_are_read_back_and_a_different_one_is_refused(scripted, tiny_model, storage):
    settings = rfopt.EvalSettings(max_new_tokens=4)
    study = rfopt.create_study(study_name="s", storage=storage, num_chunks=2, objective="reward_len",
                               eval_settings=settings, chunk_seed=3)
    study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False)  # nothing repeated
    plan = rfopt.storage.schema.study_record(study.optuna).plan
    assert (plan.num_chunks, plan.seed) == (2, 3)
    assert study_attrs(study.optuna)["rfopt:objective"] == "reward_len"
    assert study_attrs(study.optuna)["rfopt:eval"]["max_new_tokens"] == 4
    assert study.optuna.metric_names == ["reward_len"]  # optuna-dashboard names the value by the objective
    assert len(study.trials[0].intermediate_values) == 2

    for name, value, shown in (("num_chunks", 4, "num_chunks=2"), ("objective", "reward", "objective='reward_len'"),
                               ("chunk_seed", 0, "chunk_seed=3"),
                               ("eval_settings", rfopt.EvalSettings(), "max_new_tokens=4")):
        with pytest.raises(ValueError, match=f"was planned with .*{shown}.*Leave {name} out to use the stored one"):
            study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False, **{name: value})
        with pytest.raises(ValueError, match=f"was planned with .*{shown}"):
            rfopt.create_study(study_name="s", storage=storage, load_if_exists=True, **{name: value})
    # The same values, or none, continue it.
    rfopt.create_study(study_name="s", storage=storage, load_if_exists=True, num_chunks=2, objective="reward_len")
    rfopt.load_study("s", storage).optimize([trial_config(tiny_model)], TRAIN, EVAL, num_chunks=2,
                                            show_progress_bar=False)


def test_a_study_planned_before_settings_were_stored_reads_its_chunks_and_seed_from_its_plan(
        scripted, tiny_model, storage):
    """A study planned by an earlier rfopt has ``rfopt:plan`` but no ``rfopt:num_chunks`` / ``rfopt:chunk_seed``."""
    earlier = optuna.create_study(study_name="old", storage=storage, direction="maximize")
    earlier.set_user_attr("rfopt:plan", ChunkPlan.build(len(TRAIN), 2, 3).to_dict())
    study = rfopt.load_study("old", storage)
    with pytest.raises(ValueError, match="was planned with num_chunks=2, and this call gives num_chunks=4"):
        study.optimize([trial_config(tiny_model)], TRAIN, EVAL, num_chunks=4, show_progress_bar=False)
    with pytest.raises(ValueError, match="was planned with chunk_seed=3"):
        study.optimize([trial_config(tiny_model)], TRAIN, EVAL, chunk_seed=0, show_progress_bar=False)
    study.optimize([trial_config(tiny_model)], TRAIN, EVAL, show_progress_bar=False)
    assert len(study.trials[0].intermediate_values) == 2 and study_attrs(study.optuna)["rfopt:chunk_seed"] == 3


def test_a_bad_setting_is_refused_before_create_study_stores_anything(storage, tmp_path):
    with pytest.raises(ValueError, match="num_chunks must be a whole number >= 1, got 0"):
        rfopt.create_study(study_name="s", storage=storage, num_chunks=0)
    assert not (tmp_path / "study.db").exists() or optuna.get_all_study_summaries(storage) == []


# ---------------------------------------------------------------------- the command line means the same
STUDY_FILE = """
import rfopt
from rfopt.cli import main
from rfopt_testkit import prompts_dataset, trial_config

def space(trial):
    return trial_config({model!r}, learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True))

STUDY = rfopt.StudySpec(name="cli", space=space, datasets=lambda: (prompts_dataset(8), prompts_dataset(2, "E")),
                        num_chunks=1, n_trials_total=2)
"""


def test_cli_n_trials_is_per_command_and_n_trials_total_is_the_studys(scripted, tiny_model, tmp_path, monkeypatch):
    study_file = tmp_path / "cli_study.py"
    study_file.write_text(STUDY_FILE.format(model=str(tiny_model)))
    storage = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.chdir(tmp_path)

    def rfopt_run(*flags):  # in this process, as `rfopt run` would
        assert main(["run", str(study_file), "--storage", storage, "--no-progress", *flags]) == 0
        return len(optuna.load_study(study_name="cli", storage=storage).trials)

    assert rfopt_run() == 2  # the study file's total
    assert rfopt_run() == 2  # a rerun: the total is reached
    assert rfopt_run("--n-trials", "1") == 3  # one new trial, as optimize(n_trials=1)
    assert rfopt_run("--n-trials-total", "4") == 4


def test_a_study_an_earlier_rfopt_kept_in_user_attrs_is_read_and_continued_and_its_new_records_are_system_attrs(
        scripted, tiny_model, storage, monkeypatch):
    """rfopt's records moved from user attrs (which optuna-dashboard lists on its pages) to system attrs. A study an
    earlier rfopt wrote keeps loading: its records are read from the user attrs, and a run continues it."""
    from rfopt import compat
    from rfopt.storage import schema
    from rfopt.compat import storage_of, study_id_of

    # The first chunk of each trial written the old way: every rfopt record in user attrs (steps were system attrs).
    def old_trial_write(ref, key, value):
        target = ref.storage.set_trial_system_attr if key.startswith("rfopt:steps:") else ref.storage.set_trial_user_attr
        target(ref.trial_id, key, value)

    monkeypatch.setattr(schema.TrialRef, "set", old_trial_write)
    monkeypatch.setattr(schema._study, "_set_study", lambda study, key, value: study.set_user_attr(key, value))
    monkeypatch.setattr(compat, "enqueue_trial", lambda study, params, attrs: study.enqueue_trial(params, user_attrs=attrs))

    class FirstChunks(Exception):
        pass

    def stop_after_every_first_chunk(number, step, value):
        if number == 1:
            raise FirstChunks

    old = rfopt.create_study(study_name="old-layout", storage=storage, direction="maximize")
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    with pytest.raises(FirstChunks):
        _run(old, configs, on_unit=stop_after_every_first_chunk)
    monkeypatch.undo()
    written = optuna.load_study(study_name="old-layout", storage=storage)
    assert "rfopt:plan" in written.user_attrs
    assert not [k for k in storage_of(written).get_study_system_attrs(study_id_of(written)) if k.startswith("rfopt:")]
    assert all({"rfopt:config", "rfopt:metrics:0000"} <= set(t.user_attrs) for t in written.trials)

    study = rfopt.load_study("old-layout", storage)
    _run(study, configs)
    trials = study.optuna.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    for trial in trials:
        record = rfopt.storage.schema.TrialRecord(trial)
        assert rfopt.TrialConfig.from_json(record.config_json).args.learning_rate in (1e-3, 5e-3)  # a user attr
        assert [m.unit for m in record.unit_metrics()] == [0, 1]  # unit 0 from user attrs, unit 1 from system attrs
        assert "rfopt:metrics:0001" in trial.system_attrs and "rfopt:metrics:0001" not in trial.user_attrs
        assert [int(r["unit"]) for r in record.step_metrics()][-1] == 1
    assert [row.chunks_done for row in study.leaderboard()] == [2, 2]


def test_a_user_attr_named_like_an_rfopt_record_is_the_users_and_never_breaks_the_study(
        scripted, tiny_model, storage, caplog):
    """Issue 35: ``trial.set_user_attr("rfopt:stopped", True)`` in a search space made `optimize` raise
    AttributeError (the attr read as an earlier rfopt's stop record), leaving both trials RUNNING, and `rfopt status`
    fail the same way."""
    def space(trial):
        trial.set_user_attr("rfopt:stopped", True)
        trial.set_user_attr("rfopt:paused", True)  # the shape an earlier rfopt wrote: still the user's
        return trial_config(tiny_model, learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True))

    study = rfopt.create_study(study_name="attrs", storage=storage, direction="maximize", sampler=_sampler())
    study.set_user_attr("rfopt:plan", "mine")
    study.optimize(space, prompts_dataset(4), EVAL, n_trials=2, num_chunks=1, show_progress_bar=False)
    assert _states(study) == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert study.trials[0].user_attrs == {"rfopt:stopped": True, "rfopt:paused": True}  # left as the user set them
    assert "rfopt:plan" in study_attrs(study.optuna) and study_attrs(study.optuna)["rfopt:plan"] != "mine"
    assert main(["status", "--storage", storage, "--study", "attrs"]) == 0


def test_an_earlier_rfopts_records_are_read_only_with_the_shape_it_wrote_else_skipped_with_a_warning(caplog):
    """A trial configured by an earlier rfopt keeps its records in user attrs: a record of another shape (set by the
    user, or broken) is skipped with a warning naming the trial and the key; the others are read."""
    from rfopt.storage.schema import TrialRecord

    config = trial_config("a-model-not-loaded-here").to_json()
    study = optuna.create_study(study_name="earlier")
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, intermediate_values={0: 0.5}, user_attrs={
        "rfopt:config": config, "rfopt:metrics:0000": {"chunk": 0, "train": {"loss": 1.0}, "eval": {}},
        "rfopt:stopped": True, "rfopt:pruning:x": {"prune": True}, "rfopt:samples:0000": "text", "rfopt:mine": 1,
        "rfopt:ops": [{"op": "pause", "by": "me@host"}]}))
    legacy = study.trials[0]
    with caplog.at_level("WARNING", logger="rfopt"):
        record = TrialRecord(legacy)
        assert record.config_json == config and [m.train for m in record.unit_metrics()] == [{"loss": 1.0}]
        assert record.stop is None and record.samples() == {} and record.decided_steps == set()
        assert [op.op for op in record.applied] == ["pause"]
        assert "stop" not in (record.end_reason or "")  # the bad stop record is not read as one
        TrialRecord(legacy)  # read again: warned once
    warned = [r.getMessage() for r in caplog.records]
    for key in ("rfopt:stopped", "rfopt:pruning:x", "rfopt:samples:0000", "rfopt:mine"):
        assert len([m for m in warned if f"trial 0: its user attr {key!r}" in m]) == 1, warned
    assert not [m for m in warned if "rfopt:metrics:0000" in m or "rfopt:config" in m or "rfopt:ops" in m]
