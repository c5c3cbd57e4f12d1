"""A study's settings (`rfopt.config.settings.StudySettings`): checked when made, fixed once, stored and read back."""

import re

import pytest

from rfopt.chunks import ChunkPlan
from rfopt.config.settings import EvalSettings, StudySettings
from rfopt.errors import Refusal


def test_settings_round_trip_through_the_attrs_the_study_stores():
    given = StudySettings(num_chunks=6, chunk_seed=3, objective="correctness",
                          eval_settings=EvalSettings(temperature=0.7, num_samples=2))
    assert StudySettings.from_attrs(given.to_attrs()) == given
    assert StudySettings().to_attrs() == {}  # nothing given, nothing stored


def test_a_setting_left_out_takes_the_stored_one_else_the_default():
    stored = StudySettings(num_chunks=6)
    resolved = StudySettings(objective="correctness").resolved(stored)
    assert resolved == StudySettings(num_chunks=6, chunk_seed=0, objective="correctness", eval_settings=EvalSettings())


def test_a_setting_that_differs_from_the_stored_one_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"study 'gsm8k' was planned with num_chunks=6, and this call gives "
                                         r"num_chunks=4; .* Leave num_chunks out"):
        StudySettings(num_chunks=4).resolved(StudySettings(num_chunks=6), "gsm8k")
    assert StudySettings(num_chunks=6).resolved(StudySettings(num_chunks=6)).num_chunks == 6


def test_a_study_planned_before_settings_were_stored_one_by_one_reads_them_from_its_plan():
    plan = ChunkPlan.build(12, 3, 5)
    assert StudySettings.from_attrs({"objective": "reward"}, plan) == StudySettings(num_chunks=3, chunk_seed=5,
                                                                                   objective="reward")


@pytest.mark.parametrize("field, value, error, says", [
    ("num_chunks", 0, ValueError, "num_chunks must be a whole number >= 1, got 0"),
    ("num_chunks", True, ValueError, "num_chunks must be a whole number >= 1, got True"),
    ("chunk_seed", 1.5, ValueError, "chunk_seed must be a whole number, got 1.5"),
    ("objective", 3, TypeError, "objective must be 'reward' or a reward function's name, got 3"),
    ("eval_settings", {"temperature": 1}, TypeError, "eval_settings must be an rfopt.EvalSettings, got dict"),
])
def test_a_bad_setting_is_refused_when_it_is_made(field, value, error, says):
    with pytest.raises(error, match=says) as refused:
        StudySettings(**{field: value})
    assert isinstance(refused.value, Refusal)


@pytest.mark.parametrize("given, error, says", [
    (dict(n_trials=-1), ValueError, r"n_trials must be a whole number >= 0, got -1"),
    (dict(n_trials_total=1.5), ValueError, r"n_trials_total must be a whole number >= 0, got 1.5"),
    (dict(timeout=-3), ValueError, r"timeout must be a number of seconds >= 0, got -3"),
    (dict(max_concurrent=0), ValueError, r"max_concurrent must be a whole number >= 1, got 0"),
    (dict(callbacks=[1]), TypeError, r"callbacks: 1 is not callable"),
    (dict(catch="oops"), TypeError, r"catch must be a tuple of exception classes"),
    (dict(gang_size=0), ValueError, r"gang_size=0: give a whole number >= 1"),
    (dict(num_chunks=0), ValueError, r"num_chunks must be a whole number >= 1, got 0"),
    *[(dict(prune_collapsed=value), TypeError, re.escape(f"prune_collapsed={value!r}: give True (prune a trial"))
      for value in ("no", 1, None, [True])],  # issue 41 item 12: "no" turned the guard on
])
def test_optimize_and_work_refuse_a_bad_argument_alike_before_anything_is_stored(tiny_model, storage, given, error,
                                                                                 says):
    """Both build one `RunRequest`, which checks every argument when it is made: the same refusal, nothing stored."""
    import rfopt
    from rfopt.storage.schema import study_attrs
    from rfopt_testkit import prompts_dataset, trial_config

    study = rfopt.create_study(study_name="refused", storage=storage)
    space, train, test = [trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E")
    for call in (study.optimize, study.work):
        with pytest.raises(error, match=says) as refused:
            call(space, train, test, **given)
        assert isinstance(refused.value, Refusal)
    assert study.optuna.trials == [] and study_attrs(study.optuna) == {}
