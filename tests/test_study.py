"""A study on SQLite: trials trained round-robin, reported per chunk, stored, and their adapters saved."""

import json
import re
import threading
from pathlib import Path

import optuna
import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import rfopt
from rfopt.storage.schema import metrics_key
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import trial_attrs


def _space_factory(model_path):
    def space(trial):
        lr = trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)
        r = trial.suggest_categorical("lora_r", [4, 8])
        return trial_config(model_path, learning_rate=lr, peft=rfopt_lora(r))

    return space


def rfopt_lora(r):
    from rfopt_testkit import lora_config

    return lora_config(r=r)


@pytest.mark.slow
@pytest.mark.e2e
def test_four_trials_three_chunks_complete_with_per_chunk_values_in_sqlite(tiny_model, tmp_path, storage):
    study = rfopt.create_study(study_name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    units = []
    study.optimize(
        _space_factory(tiny_model),
        prompts_dataset(24),
        prompts_dataset(4, prefix="E"),
        n_trials=4,
        num_chunks=3,
        show_progress_bar=False,
        on_unit=lambda number, step, value: units.append((number, step)),
    )

    # Round-robin: every trial trains chunk k before any trains chunk k+1.
    assert [step for _, step in units] == [0] * 4 + [1] * 4 + [2] * 4

    # Everything is in the SQLite file, readable by plain Optuna in a fresh load.
    loaded = optuna.load_study(study_name="s", storage=storage)
    trials = loaded.get_trials()
    assert len(trials) == 4
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert sorted(t.intermediate_values) == [0, 1, 2]
        assert t.value == t.intermediate_values[2]
        for step in range(3):
            metrics = trial_attrs(t)[metrics_key(step)]
            assert metrics["eval"]["reward"] == pytest.approx(t.intermediate_values[step])
            for key in ("loss", "reward", "reward_std", "rewards/reward_len/mean", "completions/mean_length", "entropy"):
                assert key in metrics["train"], key
        config = rfopt.TrialConfig.from_json(trial_attrs(t)["rfopt:config"])
        assert config.args.learning_rate == pytest.approx(t.params["learning_rate"])
        assert config.peft_config.r == t.params["lora_r"]

    # The best adapter loads with PEFT onto the base model and generates.
    path = study.export_best(tmp_path / "best")
    assert path.joinpath("adapter_config.json").exists()
    best = loaded.best_trial
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(base, str(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer("Q1: add 1 and 1", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    # ... and holds the trained weights: the adapter stored for the best trial is not a fresh LoRA.
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert trial_attrs(best)["rfopt:adapter"].endswith("adapter")

    rows = study.leaderboard()
    assert [r.number for r in rows][0] == best.number
    assert "complete" in study.leaderboard_text()


def test_later_trials_are_asked_when_slots_free_and_sampler_sees_finished_ones(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="s", storage=storage)
    seen_complete = []

    def space(trial):
        if trial.study.study_name == "s":  # not the scratch trial that checks the study's inputs before it starts
            seen_complete.append(len(trial.study.get_trials(states=[optuna.trial.TrialState.COMPLETE])))
        return trial_config(tiny_model, learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2))

    study.optimize(space, prompts_dataset(16), prompts_dataset(2, "E"), n_trials=3, num_chunks=2,
                   max_concurrent=2, show_progress_bar=False, gang_size=1)  # in a gang, trials 0 and 1 end together
    # Trial 2 is asked as soon as trial 0 finishes, while trial 1 still trains its last chunk.
    assert seen_complete == [0, 0, 1]
    assert all(t.state.name == "COMPLETE" for t in study.optuna.trials)


def test_explicit_list_and_grid_become_enqueued_trials_with_params(scripted, tiny_model, storage):
    base = trial_config(tiny_model)
    configs = rfopt.grid(base, learning_rate=[1e-3, 1e-2], lora_r=[4, 8])
    assert len(configs) == 4
    study = rfopt.create_study(study_name="g", storage=storage)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    params = sorted((t.params["learning_rate"], t.params["lora_r"]) for t in study.optuna.trials)
    assert params == [(1e-3, 4), (1e-3, 8), (1e-2, 4), (1e-2, 8)]
    for t in study.optuna.trials:
        config = rfopt.TrialConfig.from_json(trial_attrs(t)["rfopt:config"])
        assert (config.args.learning_rate, config.peft_config.r) == (t.params["learning_rate"], t.params["lora_r"])
    # Running the same list again enqueues nothing new.
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    assert len(study.optuna.trials) == 4


def test_checkpoint_of_each_chunk_is_written_and_older_ones_removed(scripted, tiny_model, storage, tmp_path):
    study = rfopt.create_study(study_name="c", storage=storage, checkpoint_dir=tmp_path / "ck")
    study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2,
                   show_progress_bar=False)
    trial_dir = tmp_path / "ck" / "trial-00000"
    assert (trial_dir / "LATEST").read_text() == "unit-0002"
    assert sorted(p.name for p in trial_dir.glob("unit-*")) == ["unit-0002"]
    state = study.checkpoints.load(0)
    # 8 prompts, one prompt (4 completions) per optimizer step: 4 steps a chunk, 8 in all.
    assert state.units_done == 2 and state.global_step == 8
    assert json.loads((trial_dir / "unit-0002" / "state.json").read_text())["units_done"] == 2


@pytest.mark.parametrize("gang_size", [1, 2])
def test_a_units_checkpoint_is_written_while_it_is_evaluated_and_named_with_its_report_after(
        scripted, tiny_model, storage, tmp_path, monkeypatch, gang_size):
    """The checkpoint's state files are written by a thread while the unit is evaluated (issue 42 point 6); the
    checkpoint is published and named, with the evaluation's report inside, only after the evaluation, so a unit is
    still committed only once its files are durable."""
    from rfopt.engine.running import unit
    from rfopt.storage.checkpoints import CheckpointStore

    evaluating, staging = threading.Event(), threading.Event()
    seen: list[tuple[str, bool]] = []
    start, stage, evaluate = unit._Staging.__init__, CheckpointStore.stage, unit.evaluate_runners
    root = tmp_path / "ck"

    def start_unit(self, *args, **kwargs):
        evaluating.clear()
        staging.clear()
        start(self, *args, **kwargs)

    def stage_waiting(self, number, state):
        if not staging.is_set():  # the unit's first: the evaluation is under way meanwhile
            staging.set()
            seen.append(("staged while evaluating", evaluating.wait(10)))
        return stage(self, number, state)

    def evaluate_waiting(backend, runners, *args, **kwargs):
        evaluating.set()
        seen.append(("evaluated while staging", staging.wait(10)))
        results = evaluate(backend, runners, *args, **kwargs)
        for runner in runners:  # this unit's checkpoint is not named yet
            assert not (root / f"trial-{runner.number:05d}" / f"unit-{runner.units_done:04d}").exists()
        return results

    monkeypatch.setattr(unit._Staging, "__init__", start_unit)
    monkeypatch.setattr(CheckpointStore, "stage", stage_waiting)
    monkeypatch.setattr(unit, "evaluate_runners", evaluate_waiting)
    study = rfopt.create_study(study_name="c", storage=storage, checkpoint_dir=root)
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 2e-3])
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, gang_size=gang_size,
                   show_progress_bar=False)

    assert len(seen) == 2 * (4 // gang_size) and all(ok for _, ok in seen), seen  # each side waited for the other
    for trial in study.optuna.trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE
        report = json.loads((root / f"trial-{trial.number:05d}" / "unit-0002" / "report.json").read_text())
        assert report["unit"] == 1 and report["value"] == trial.intermediate_values[1]
        assert study.checkpoints.load(trial.number).units_done == 2


def test_a_unit_whose_evaluation_fails_drops_its_staged_checkpoint_and_keeps_its_previous_one(
        scripted, tiny_model, storage, tmp_path, monkeypatch):
    """A trial whose second evaluation raises fails alone with the reason; the checkpoint written while it was being
    evaluated is removed, never named: the trial keeps its first unit's checkpoint."""
    from rfopt.engine.running import unit

    evaluate = unit.evaluate_runners

    def evaluate_failing(backend, runners, *args, **kwargs):
        results = evaluate(backend, runners, *args, **kwargs)
        return [RuntimeError("the evaluation broke") if runner.number == 1 and runner.units_done == 2 else result
                for runner, result in zip(runners, results)]

    monkeypatch.setattr(unit, "evaluate_runners", evaluate_failing)
    study = rfopt.create_study(study_name="c", storage=storage, checkpoint_dir=tmp_path / "ck")
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 2e-3])
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)

    failed = study.optuna.trials[1]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert "the evaluation broke" in trial_attrs(failed)["rfopt:fail_reason"]
    trial_dir = tmp_path / "ck" / "trial-00001"
    assert sorted(p.name for p in trial_dir.iterdir()) == ["LATEST", "best", "unit-0001"]  # nothing staged is left
    assert study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE


def test_ctrl_c_during_an_evaluation_leaves_no_staged_checkpoint_and_the_rerun_ends_as_an_uninterrupted_run(
        scripted, tiny_model, storage, tmp_path, monkeypatch):
    from rfopt.engine.running import unit

    evaluate = unit.evaluate_runners

    def evaluate_interrupted(backend, runners, *args, **kwargs):
        if runners[0].units_done == 2:
            raise KeyboardInterrupt
        return evaluate(backend, runners, *args, **kwargs)

    monkeypatch.setattr(unit, "evaluate_runners", evaluate_interrupted)
    configs = [trial_config(tiny_model)]
    study = rfopt.create_study(study_name="c", storage=storage, checkpoint_dir=tmp_path / "ck")
    with pytest.raises(KeyboardInterrupt):
        study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    assert sorted(p.name for p in (tmp_path / "ck" / "trial-00000").iterdir()) == ["LATEST", "best", "unit-0001"]

    monkeypatch.setattr(unit, "evaluate_runners", evaluate)
    study = rfopt.create_study(study_name="c", storage=storage, checkpoint_dir=tmp_path / "ck", load_if_exists=True)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    reference = rfopt.create_study(study_name="r", storage=storage, checkpoint_dir=tmp_path / "ref")
    reference.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    assert study.optuna.trials[0].intermediate_values == reference.optuna.trials[0].intermediate_values


@pytest.mark.e2e
def test_a_model_given_as_a_function_is_stored_by_import_path_and_trains(tiny_model, storage, monkeypatch):
    from rfopt_testkit import tiny_model_factory

    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    config = trial_config(tiny_model)
    config.model = tiny_model_factory
    study = rfopt.create_study(study_name="f", storage=storage)
    study.optimize([config], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=1, show_progress_bar=False)
    trial = study.optuna.trials[0]
    assert trial.state.name == "COMPLETE"
    assert json.loads(trial_attrs(trial)["rfopt:config"])["model"] == {"factory": "rfopt_testkit:tiny_model_factory"}


def test_a_user_callback_that_raises_ends_the_call_with_its_exception_and_the_trial_is_not_failed(
        scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="callback", storage=storage)
    train, evaluation = prompts_dataset(8), prompts_dataset(2, prefix="E")

    def on_unit(number, step, value):
        raise ValueError("my logging broke")

    with pytest.raises(ValueError, match="my logging broke"):  # as an Optuna callback's exception propagates
        study.optimize([trial_config(tiny_model)], train, evaluation, num_chunks=2, show_progress_bar=False,
                       on_unit=on_unit)
    trial = study.optuna.trials[0]
    assert trial.state == optuna.trial.TrialState.RUNNING and trial.intermediate_values.keys() == {0}
    assert "rfopt:fail_reason" not in trial_attrs(trial)

    study.optimize([trial_config(tiny_model)], train, evaluation, num_chunks=2, show_progress_bar=False)
    trial = study.optuna.trials[0]
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.intermediate_values.keys() == {0, 1}


def test_an_rfopt_listener_of_committed_units_that_raises_does_not_fail_the_trial(
        scripted, tiny_model, storage, caplog, monkeypatch):
    def broken(event):
        raise OSError("artifact store full")

    monkeypatch.setattr("rfopt.engine.running.run.publish_unit", broken)
    study = rfopt.create_study(study_name="listener", storage=storage)
    study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, prefix="E"), num_chunks=2,
                   show_progress_bar=False)
    assert study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert "a listener of committed units failed (OSError: artifact store full); the trial goes on" in caplog.text


def test_a_trial_told_complete_outside_rfopt_while_it_trains_is_said_so_and_marked_on_the_leaderboard(
        scripted, tiny_model, storage, monkeypatch, caplog):
    """Issue 35: optuna-dashboard's "Mark as Complete" (value 99) on a trial rfopt was training: the run logged "trial
    1 failed: UpdateFinishedTrialError", and that one-chunk, adapter-less trial became the best with nothing said."""
    import rfopt_testkit
    from rfopt_testkit import reward_len, reward_len_hooked

    calls = {"n": 0}

    def mark_complete_once():
        calls["n"] += 1
        if calls["n"] == 1:  # the first call scores trial 1's baseline (its base model with no adapter), before it trains
            return
        monkeypatch.setattr(rfopt_testkit, "REWARD_HOOK", None)
        optuna.load_study(study_name="told", storage=storage).tell(1, 99.0)  # as the dashboard's button does

    monkeypatch.setattr(rfopt_testkit, "REWARD_HOOK", mark_complete_once)
    study = rfopt.create_study(study_name="told", storage=storage, num_chunks=2)
    configs = [trial_config(tiny_model, rewards=(reward_len,)),
               trial_config(tiny_model, rewards=(reward_len_hooked,), learning_rate=1e-2)]
    with caplog.at_level("WARNING", logger="rfopt"):
        study.optimize(configs, prompts_dataset(4), prompts_dataset(2, "E"), gang_size=1, show_progress_bar=False)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "trial 1 failed" in m], said
    told = "told COMPLETE with value 99 outside rfopt after 0 of 2 chunks (optuna-dashboard's buttons, or Optuna's tell)"
    assert any(m.startswith(f"trial 1 was {told}; no adapter was saved while it trained its chunk 1") for m in said)
    rows = {row.number: row for row in study.leaderboard()}
    assert rows[1].state == "COMPLETE" and rows[1].reason == f"{told}; no adapter was saved"
    assert rows[0].reason is None and rows[0].chunks_done == 2
    # Optuna's best trial is the one told from outside: its final adapter does not exist, and exporting it says why.
    with pytest.raises(LookupError, match=re.escape(f"trial 1, the best, was {told}; no adapter was saved: nothing")):
        study.export_best(storage.removeprefix("sqlite:///") + ".export", best_trial=True)
    # The recommendation is a checkpoint rfopt kept (trial 0's), never the value told from outside.
    assert study.recommendation().trial == 0
    assert study.export_best(storage.removeprefix("sqlite:///") + ".export").is_dir()


# ---------------------------------------------------------------------- export_best never deletes what it did not write
def _exportable(tiny_model, tmp_path):
    """A stored study on SQLite in `tmp_path` whose trial 0 finished with its best chunk first (0.9, then 0.4): its
    recommended ``best/`` and its final adapter differ."""
    from stored_study import stored_study

    return stored_study(f"sqlite:///{tmp_path / 'study.db'}", "s", [trial_config(tiny_model)], prompts_dataset(8),
                        prompts_dataset(2, "E"), values={0: [0.9, 0.4]})


def _tree(folder):
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_best_refuses_a_folder_of_the_users_own_files_and_keeps_them(tiny_model, tmp_path):
    study = _exportable(tiny_model, tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own work")
    with pytest.raises(rfopt.Refusal, match=r"is a folder that is not empty: .*overwrite=True"):
        study.export_best(mine)
    assert _tree(mine) == {"notes.txt": b"my own work"}
    (tmp_path / "a-file").write_text("mine too")
    for overwrite in (False, True):
        with pytest.raises(rfopt.Refusal, match="is a file, not a folder"):
            study.export_best(tmp_path / "a-file", overwrite=overwrite)
    assert (tmp_path / "a-file").read_text() == "mine too"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _tree(study.export_best(empty)) == _tree(study.recommendation().location)


@pytest.mark.parametrize("path", ["", ".", "./"])
def test_export_best_refuses_the_working_directory_and_leaves_it_intact(tiny_model, tmp_path, monkeypatch, path):
    study = _exportable(tiny_model, tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(rfopt.Refusal, match="is the working directory"):
            study.export_best(path, overwrite=overwrite)
    with pytest.raises(rfopt.Refusal, match="is the working directory or holds it"):
        study.export_best(tmp_path.parent, overwrite=True)
    assert _tree(tmp_path) == before and (tmp_path / "study.db").is_file()


def test_export_best_with_overwrite_never_removes_the_checkpoint_store_the_storage_or_the_adapter(tiny_model, tmp_path):
    study = _exportable(tiny_model, tmp_path)
    store = Path(study.checkpoints.root)
    best = Path(study.recommendation().location)
    before = _tree(tmp_path)
    # The checkpoint folder of every study beside the SQLite file, this study's store, the recommended best/ given as
    # its own target, its trial's folder, the folder holding the SQLite file.
    for target, what in [(store.parent, "the study's checkpoint store"), (store, "the study's checkpoint store"),
                         (best, "the study's checkpoint store"), (best.parent, "the study's checkpoint store"),
                         (tmp_path, "the study's SQLite file")]:
        with pytest.raises(rfopt.Refusal, match=re.escape(what)):
            study.export_best(target, overwrite=True)
    # A new folder inside the store or the adapter is refused too: the store is rfopt's.
    with pytest.raises(rfopt.Refusal, match="is inside"):
        study.export_best(best / "copy")
    # Another study's checkpoint store, wherever it is, is never removed.
    other = tmp_path / "elsewhere" / "old-study"
    other.mkdir(parents=True)
    (other / "rfopt-study.json").write_text("{}")
    with pytest.raises(rfopt.Refusal, match="holds a checkpoint store"):
        study.export_best(tmp_path / "elsewhere", overwrite=True)
    assert _tree(tmp_path) == {**before, "elsewhere/old-study/rfopt-study.json": b"{}"}
    assert Path(study.recommendation().location) == best and _tree(best)


def test_export_best_refuses_a_damaged_adapter_before_anything_at_the_target_changed(tiny_model, tmp_path):
    from rfopt.errors import CheckpointError

    study = _exportable(tiny_model, tmp_path)
    target = study.export_best(tmp_path / "export")
    before = _tree(target)
    weights = Path(study.recommendation().location) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="is not a whole safetensors file"):
        study.export_best(target, overwrite=True)
    assert _tree(target) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")] == []  # no staging folder left


def test_export_best_with_overwrite_replaces_a_folder_it_exported_before(tiny_model, tmp_path):
    study = _exportable(tiny_model, tmp_path)
    target = study.export_best(tmp_path / "export", best_trial=True)
    assert _tree(target) == _tree(study.best_adapter(best_trial=True))
    with pytest.raises(rfopt.Refusal, match="overwrite=True"):
        study.export_best(target)
    assert study.export_best(target, overwrite=True) == target
    assert _tree(target) == _tree(study.best_adapter()) != _tree(study.best_adapter(best_trial=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", "rfopt-checkpoints", "study.db"])
