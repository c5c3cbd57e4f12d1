"""Canaries for rfopt/compat/_optuna.py (Optuna): each fails loudly when the library symbol, or the call site, that one
of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

import optuna
import pytest
from optuna.trial import TrialState

from rfopt import compat


# ---------------------------------------------------------------------- optimize_loop, finished_trial_cache, optuna_ids
def test_study_stop_works_inside_the_optimize_loop_marker_only():
    study = optuna.create_study()
    with pytest.raises(RuntimeError):
        study.stop()  # outside optimize(): Optuna refuses
    with compat.optimize_loop(study):
        study.stop()
        assert compat.stop_requested(study)
    assert not study._thread_local.in_optimize_loop


def test_optuna_puts_its_cache_of_finished_trials_in_front_of_an_rdb_storage(tmp_path):
    rdb = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'c.db'}")
    cached = compat.cached(rdb)
    assert cached is not rdb and isinstance(cached, optuna.storages.BaseStorage)
    study = optuna.create_study(storage=cached, study_name="c")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="c", storage=rdb).trials) == 2


def test_optuna_objects_keep_their_storage_and_ids_where_rfopt_reads_them():
    study = optuna.create_study(study_name="ids")
    study.ask()
    frozen = study.trials[0]
    storage = compat.storage_of(study)
    assert storage.get_trial(compat.trial_id_of(frozen)).number == 0
    summary = next(s for s in storage.get_all_studies() if s.study_name == "ids")
    assert compat.study_id_of(summary) == storage.get_study_id_from_name("ids") == compat.study_id_of(study)


# ---------------------------------------------------------------------- pruner_settings
@pytest.mark.parametrize(
    "pruner, expected",
    [
        (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2, interval_steps=4, n_min_trials=5),
         {"percentile": 50.0, "n_startup_trials": 3, "n_warmup_steps": 2, "interval_steps": 4, "n_min_trials": 5}),
        (optuna.pruners.ThresholdPruner(lower=0.1, upper=0.9, n_warmup_steps=1, interval_steps=2),
         {"lower": 0.1, "upper": 0.9, "n_warmup_steps": 1, "interval_steps": 2}),
        (optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=3, min_early_stopping_rate=1,
                                                bootstrap_count=0),
         {"min_resource": 2, "reduction_factor": 3, "min_early_stopping_rate": 1, "bootstrap_count": 0}),
        (optuna.pruners.HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2),
         {"min_resource": 1, "max_resource": 8, "reduction_factor": 2, "bootstrap_count": 0}),
        (optuna.pruners.WilcoxonPruner(p_threshold=0.2, n_startup_steps=3), {"p_threshold": 0.2, "n_startup_steps": 3}),
    ],
)
def test_pruners_keep_their_constructor_arguments_where_rfopt_reads_them(pruner, expected):
    assert compat.pruner_settings(pruner) == expected


def test_a_patient_pruner_without_its_wrapped_pruner_is_the_patience_test_alone():
    inner = optuna.pruners.NopPruner()
    pruner = optuna.pruners.PatientPruner(inner, patience=1, min_delta=0.0)
    assert compat.pruner_settings(pruner) == {"wrapped_pruner": inner, "patience": 1, "min_delta": 0.0}
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    for step, value in enumerate([1.0, 0.5, 0.4]):  # no improvement for two steps
        trial.report(value, step)
    frozen = study.trials[0]
    assert compat.patience_gate(pruner).prune(study, frozen) is True  # Nop alone would never prune
    assert pruner.prune(study, frozen) is False


def test_optunas_percentile_helpers_compute_what_the_median_pruner_compares():
    best_over_steps, percentile_over_trials, first_in_interval = compat.percentile_helpers()
    study = optuna.create_study(direction="maximize")
    for values in ([0.1, 0.4], [0.2, 0.8], [0.3, 0.6]):
        trial = study.ask()
        for step, value in enumerate(values):
            trial.report(value, step)
        study.tell(trial, values[-1])
    trials = study.trials
    assert best_over_steps(trials[0], study.direction) == 0.4
    assert percentile_over_trials(trials, study.direction, 1, 50.0, 1) == 0.6
    assert first_in_interval(1, [0, 1], 0, 1) is True


def test_a_study_view_serves_optunas_public_reads_from_its_list():
    class View(compat.StudyView):
        def _best_of(self, deepcopy):
            return self._view_trials[-1]

    study = optuna.create_study()
    for x in (1.0, 2.0):
        trial = study.ask()
        study.tell(trial, x)
    view = View("v", [optuna.study.StudyDirection.MINIMIZE], list(reversed(study.trials)))
    assert [t.number for t in view.trials] == [0, 1]
    assert [t.number for t in view.get_trials(states=(TrialState.COMPLETE,))] == [0, 1]
    assert view.best_trial.number == 1 and view.direction == optuna.study.StudyDirection.MINIMIZE


# ---------------------------------------------------------------------- enqueued_params
def test_an_enqueued_trial_holds_its_params_in_the_fixed_params_system_attr_which_suggest_reads():
    study = optuna.create_study()
    study.enqueue_trial({"x": 0.25})
    assert study.get_trials()[0].system_attrs["fixed_params"] == {"x": 0.25}  # what compat.enqueue_trial writes
    compat.enqueue_trial(study, {"x": 0.5}, {"rfopt:list_index": 1})
    waiting = study.get_trials()[1]
    assert waiting.state == TrialState.WAITING and waiting.user_attrs == {}
    assert waiting.system_attrs == {"rfopt:list_index": 1, "fixed_params": {"x": 0.5}}
    study.ask()
    trial = study.ask()
    assert trial.suggest_float("x", 0, 1) == 0.5 and trial.number == 1
