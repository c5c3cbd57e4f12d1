"""Optuna's internals that rfopt relies on: its objects' storage and ids, the optimize loop's marker, its cache of
finished trials, system attrs on an enqueued trial, pruners' settings and helpers, a study view over a list.

``optimize_loop``  `optimize_loop` marks an Optuna study as inside an optimize loop
    (``Study._thread_local.in_optimize_loop``, ``Study._stop_flag``), as ``optuna.Study.optimize``
    does, so that ``study.stop()`` (which GridSampler calls when its grid is done) works under rfopt.
``finished_trial_cache``  `cached` puts Optuna's cache of finished trials in front of an
    ``RDBStorage`` (``optuna.storages.get_storage``, "for internal usage"), as Optuna does when it
    opens a storage URL itself. Buys: Optuna's own read behaviour for rfopt's storages.
``optuna_ids``  `storage_of`, `trial_id_of`, `study_id_of`: Optuna objects' ``_storage``,
    ``_trial_id`` and ``_study_id``. Optuna has no public accessor; optuna-dashboard reads them too.
``enqueued_params``  `enqueue_trial` enqueues a trial with system attrs, as ``Study.enqueue_trial`` does with user
    attrs: a WAITING trial whose ``fixed_params`` system attr (Optuna's own key, which ``Trial.suggest_*`` reads)
    holds its params. ``enqueue_trial`` takes no system attrs, and writing them after it would race a process that
    asks the trial the moment it is enqueued. Buys: rfopt's records of a listed config out of the user's attrs.
``pruner_settings``  `pruner_settings`, `patience_gate`, `percentile_helpers`, `StudyView`: rfopt's
    rung decisions (``rfopt.pruning``) run Optuna's pruners on a view of the study at one step, and
    need their constructor arguments (kept in private attributes), Optuna's percentile helpers (for
    the reason text) and a read-only `optuna.Study` that serves trials from a list.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

import optuna

from rfopt.errors import CompatError

from ._versions import check_version, require


def storage_of(study: Any) -> Any:
    """An `optuna.Study`'s storage (``Study._storage``; entry ``optuna_ids``)."""
    return study._storage


def trial_id_of(trial: Any) -> int:
    """A `FrozenTrial`'s or `Trial`'s id in its storage (``_trial_id``)."""
    return trial._trial_id


def study_id_of(study: Any) -> int:
    """A `FrozenStudy`'s or `Study`'s id in its storage (``_study_id``)."""
    return study._study_id


def enqueue_trial(study: Any, params: dict[str, Any], system_attrs: dict[str, Any]) -> None:
    """``study.enqueue_trial(params)`` with `system_attrs` on the enqueued trial, in one write (entry
    ``enqueued_params``)."""
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                              system_attrs={**system_attrs, "fixed_params": dict(params)}))


@contextmanager
def optimize_loop(study: Any) -> Iterator[None]:
    """Inside this block ``study.stop()`` works as inside ``optuna.Study.optimize`` (entry ``optimize_loop``)."""
    check_version("optuna")
    require(study, "_thread_local", "optimize_loop")
    study._thread_local.in_optimize_loop = True
    study._stop_flag = False
    try:
        yield
    finally:
        study._thread_local.in_optimize_loop = False


def stop_requested(study: Any) -> bool:
    """Whether ``study.stop()`` was called inside `optimize_loop`."""
    return bool(study._stop_flag)


def cached(rdb: Any) -> Any:
    """Optuna's cache of finished trials in front of an ``RDBStorage``, as Optuna puts it in front of a storage it
    opens from a URL (entry ``finished_trial_cache``)."""
    check_version("optuna")
    return optuna.storages.get_storage(rdb)


_PRUNER_SETTINGS: dict[str, tuple[str, ...]] = {
    "PercentilePruner": ("percentile", "n_startup_trials", "n_warmup_steps", "interval_steps", "n_min_trials"),
    "ThresholdPruner": ("lower", "upper", "n_warmup_steps", "interval_steps"),
    "PatientPruner": ("wrapped_pruner", "patience", "min_delta"),
    "SuccessiveHalvingPruner": ("min_resource", "reduction_factor", "min_early_stopping_rate", "bootstrap_count"),
    "HyperbandPruner": ("min_resource", "max_resource", "reduction_factor", "bootstrap_count"),
    "WilcoxonPruner": ("p_threshold", "n_startup_steps"),
}


def pruner_settings(pruner: Any) -> dict[str, Any]:
    """The constructor arguments Optuna keeps in a pruner's private attributes (entry ``pruner_settings``), by
    argument name: ``pruner_settings(MedianPruner(n_warmup_steps=2))["n_warmup_steps"] == 2``."""

    check_version("optuna")
    for name, fields in _PRUNER_SETTINGS.items():
        if isinstance(pruner, getattr(optuna.pruners, name)):
            missing = [f for f in fields if not hasattr(pruner, f"_{f}")]
            if missing:
                raise CompatError(f"pruner_settings: {name} has no {missing}; this optuna is not supported")
            return {f: getattr(pruner, f"_{f}") for f in fields}
    raise TypeError(f"no settings known for {type(pruner).__name__}")


def patience_gate(pruner: Any) -> Any:
    """A copy of a ``PatientPruner`` without its wrapped pruner: its ``prune()`` is then Optuna's patience test
    alone ("stalled or not")."""
    gate = copy.copy(pruner)
    gate._wrapped_pruner = None
    return gate


def percentile_helpers() -> tuple[Callable[..., float], Callable[..., float], Callable[..., bool]]:
    """Optuna's own ``_get_best_intermediate_result_over_steps``, ``_get_percentile_intermediate_result_over_trials``
    and ``_is_first_in_interval_step`` (``optuna.pruners._percentile``), so the reasons rfopt stores quote the
    numbers the pruner compared."""
    from optuna.pruners import _percentile

    return (_percentile._get_best_intermediate_result_over_steps,
            _percentile._get_percentile_intermediate_result_over_trials,
            _percentile._is_first_in_interval_step)


def frozen_copy(trial: Any, **changes: Any) -> Any:
    """A `FrozenTrial` like `trial` (same id in storage) with `changes` to its public fields."""
    fields = dict(
        number=trial.number, state=trial.state, value=None, datetime_start=trial.datetime_start,
        datetime_complete=trial.datetime_complete, params=dict(trial.params), distributions=dict(trial.distributions),
        user_attrs=dict(trial.user_attrs), system_attrs=dict(trial.system_attrs),
        intermediate_values=dict(trial.intermediate_values), trial_id=trial_id_of(trial),
    )
    fields.update(changes)
    return optuna.trial.FrozenTrial(**fields)


class StudyView(optuna.Study):
    """An `optuna.Study` without storage that serves a fixed list of trials (entry ``pruner_settings``).

    ``get_trials``, ``trials``, ``best_trial`` and ``direction`` work: the public methods call Optuna's private
    ``_get_trials`` and ``_get_best_trial``, which this class serves from the list. Subclasses define
    ``_best_of(deepcopy)``; anything that needs a storage raises.
    """

    def __init__(self, study_name: str, directions: list[Any], trials: list[Any]) -> None:
        # optuna.Study.__init__ is skipped on purpose: it binds a storage, and a view has none.
        self.study_name = study_name
        self._directions = list(directions)
        self._view_trials = sorted(trials, key=lambda t: t.number)

    def _get_trials(self, deepcopy: bool = True, states: Container[Any] | None = None,
                    use_cache: bool = False) -> list[Any]:
        trials = [t for t in self._view_trials if states is None or t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    def _get_best_trial(self, deepcopy: bool) -> Any:
        return self._best_of(deepcopy)

    def _best_of(self, deepcopy: bool) -> Any:
        raise NotImplementedError
