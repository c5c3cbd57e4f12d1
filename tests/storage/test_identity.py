"""Checkpoints belong to exactly one study: deleting a database and starting over just works, two databases in one
folder with studies of the same name keep apart, and a checkpoint location that is not the study's is refused with
what to do, before anything is written."""

import json
import os
import shutil

import optuna
import pytest
import torch
from safetensors.torch import load_file

import rfopt
from rfopt.errors import CheckpointError
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import study_attrs, trial_attrs
from stored_study import stored_study

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")


class _Crash(BaseException):
    """Stands in for the process dying: nothing in rfopt catches it."""


def _configs(model, rates=(1e-3, 5e-3)):
    return rfopt.grid(trial_config(model), learning_rate=list(rates))


def _run(storage, configs, checkpoint_dir=None, crash_after=None, eval_dataset=EVAL, name="arithmetic"):
    study = rfopt.create_study(study_name=name, storage=storage, load_if_exists=True, checkpoint_dir=checkpoint_dir)
    done = []

    def on_unit(number, step, value):
        done.append((number, step))
        if crash_after is not None and len(done) == crash_after:
            raise _Crash

    study.optimize(configs, TRAIN, eval_dataset, num_chunks=2, show_progress_bar=False, on_unit=on_unit)
    return study


def _outcome(study):
    """Each trial's state, reported values and final adapter weights."""
    out = []
    for t in study.optuna.get_trials():
        adapter = load_file(f"{trial_attrs(t)['rfopt:adapter']}/adapter_model.safetensors")
        out.append((t.state, t.intermediate_values, adapter))
    return out


def _same(a, b):
    assert [(s, v) for s, v, _ in a] == [(s, v) for s, v, _ in b]
    for (_, _, x), (_, _, y) in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_deleting_the_database_and_running_the_same_study_again_trains_it_afresh(
        scripted, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _outcome(_run("sqlite:///rfopt.db", _configs(tiny_model)))
    assert all(state == optuna.trial.TrialState.COMPLETE for state, _, _ in first)
    os.remove("rfopt.db")

    second = _run("sqlite:///rfopt.db", _configs(tiny_model))
    _same(_outcome(second), first)  # every trial COMPLETE again, with the same values, from its own checkpoints
    uid = study_attrs(second.optuna)["rfopt:id"]
    new = tmp_path / "rfopt-checkpoints" / f"arithmetic-{uid[:12]}"
    assert study_attrs(second.optuna)["rfopt:checkpoint_dir"] == str(new)
    assert len(list((tmp_path / "rfopt-checkpoints").iterdir())) == 2  # the first study's are left as they were
    owner = json.loads((new / "rfopt-study.json").read_text())
    assert owner["id"] == uid and owner["study"] == "arithmetic"


def test_two_databases_in_one_folder_with_studies_of_one_name_keep_their_checkpoints_apart(
        scripted, tiny_model, tmp_path, monkeypatch):
    reference = _outcome(_run(f"sqlite:///{tmp_path / 'reference.db'}", _configs(tiny_model),
                              checkpoint_dir=tmp_path / "reference-ck"))
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.chdir(shared)
    with pytest.raises(_Crash):  # A trains a chunk of each trial, then dies
        _run("sqlite:///a.db", _configs(tiny_model), crash_after=2)
    # B: other learning rates, and an eval set on which every reward differs
    b = _run("sqlite:///b.db", _configs(tiny_model, rates=(2e-3, 7e-3)), eval_dataset=prompts_dataset(2, "Other"))
    assert all(state == optuna.trial.TrialState.COMPLETE for state, _, _ in _outcome(b))
    a = _run("sqlite:///a.db", _configs(tiny_model))  # A continues from its own checkpoints, not B's
    _same(_outcome(a), reference)
    assert len(list((shared / "rfopt-checkpoints").iterdir())) == 2


def test_a_checkpoint_location_that_holds_another_studys_checkpoints_is_refused_before_anything_is_written(
        tiny_model, tmp_path):
    stored_study(f"sqlite:///{tmp_path / 'a.db'}", "arithmetic", _configs(tiny_model)[:1], TRAIN, EVAL,
                 checkpoint_dir=tmp_path / "ck")  # as a run leaves it
    other = rfopt.create_study(study_name="arithmetic", storage=f"sqlite:///{tmp_path / 'b.db'}",
                               checkpoint_dir=tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"belongs to study 'arithmetic' \(id [0-9a-f]+\) of "
                       r"sqlite:///.*a\.db, not to study 'arithmetic' .* of sqlite:///.*b\.db. If that study is gone"):
        other.optimize(_configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2, show_progress_bar=False)
    assert other.optuna.get_trials() == [] and "rfopt:plan" not in study_attrs(other.optuna)

    # A directory with trials' checkpoints that names no study (an older rfopt wrote it, or it was copied there).
    (tmp_path / "unmarked" / "trial-00000").mkdir(parents=True)
    third = rfopt.create_study(study_name="c", storage=f"sqlite:///{tmp_path / 'c.db'}",
                               checkpoint_dir=tmp_path / "unmarked")
    with pytest.raises(CheckpointError, match="holds trials' checkpoints but names no study"):
        third.optimize(_configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2, show_progress_bar=False)
    assert third.optuna.get_trials() == []


def test_a_checkpoint_dir_other_than_the_recorded_one_is_refused_unless_the_checkpoints_moved_there(tiny_model,
                                                                                                   tmp_path):
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    study = stored_study(storage, "arithmetic", _configs(tiny_model)[:1], TRAIN, EVAL, checkpoint_dir=tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"keeps its checkpoints in .*/ck; this call gives .*/elsewhere\. "
                       r"Leave checkpoint_dir \(--checkpoint-dir\) out"):
        rfopt.load_study("arithmetic", storage, checkpoint_dir=tmp_path / "elsewhere")
    assert study_attrs(study.optuna)["rfopt:checkpoint_dir"] == str(tmp_path / "ck")  # not repointed

    shutil.copytree(tmp_path / "ck", tmp_path / "moved")
    moved = rfopt.load_study("arithmetic", storage, checkpoint_dir=tmp_path / "moved")
    assert study_attrs(moved.optuna)["rfopt:checkpoint_dir"] == str(tmp_path / "moved")
    assert str(moved.best_adapter()).startswith(str(tmp_path / "ck"))  # the adapter paths stored stay as they were
    assert moved.checkpoints.load(0).units_done == 2


@pytest.mark.slow
def test_a_study_in_a_server_database_without_a_shared_checkpoint_location_is_refused_at_start(postgres, tiny_model):
    study = rfopt.create_study(study_name="pg", storage=postgres.new_database())
    with pytest.raises(CheckpointError, match=r"is in a server database \(postgresql://.*\) that several hosts "
                       r"may share, so its checkpoints need a location every worker can reach: give checkpoint_dir"):
        study.optimize(_configs(tiny_model)[:1], TRAIN, EVAL, num_chunks=2, show_progress_bar=False)
    assert study.optuna.get_trials() == [] and study.optuna.user_attrs == {}

