"""A study stopped mid-way and run again continues its RUNNING trials from their checkpoints, and ends
exactly where an uninterrupted run of the same study ends."""

import optuna
import pytest
import torch
from safetensors.torch import load_file

import rfopt
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import trial_attrs


class _Crash(BaseException):
    """Stands in for the process dying: nothing in rfopt catches it."""


def _configs(model):
    return rfopt.grid(trial_config(model, gradient_accumulation_steps=2), learning_rate=[1e-3, 5e-3, 1e-2])


def _run(model, storage, checkpoints, crash_after=None):
    study = rfopt.create_study(study_name="r", storage=storage, checkpoint_dir=checkpoints, load_if_exists=True)
    done = []

    def on_unit(number, step, value):
        done.append((number, step))
        if crash_after is not None and len(done) == crash_after:
            raise _Crash

    study.optimize(_configs(model), prompts_dataset(16), prompts_dataset(2, "E"), num_chunks=2,
                   show_progress_bar=False, on_unit=on_unit)
    return study, done


def _adapter(study, number):
    return load_file(str(trial_attrs(study.optuna.trials[number])["rfopt:adapter"] + "/adapter_model.safetensors"))


@pytest.mark.parametrize("crash_after", [1, 4])
def test_rerun_after_a_crash_reproduces_the_uninterrupted_study(scripted_or_trl, tiny_model, tmp_path, crash_after):
    reference, _ = _run(tiny_model, f"sqlite:///{tmp_path / 'ref.db'}", tmp_path / "ref")

    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    with pytest.raises(_Crash):
        _run(tiny_model, storage, tmp_path / "crash", crash_after=crash_after)
    states = [t.state for t in optuna.load_study(study_name="r", storage=storage).trials]
    assert optuna.trial.TrialState.RUNNING in states

    resumed, done = _run(tiny_model, storage, tmp_path / "crash")
    assert len(done) == 6 - crash_after  # no chunk trained twice
    assert len(resumed.optuna.trials) == 3
    for ref, got in zip(reference.optuna.trials, resumed.optuna.trials):
        assert got.state == ref.state == optuna.trial.TrialState.COMPLETE
        assert got.intermediate_values == ref.intermediate_values
        expected, actual = _adapter(reference, ref.number), _adapter(resumed, got.number)
        assert expected.keys() == actual.keys()
        assert all(torch.equal(expected[k], actual[k]) for k in expected)
