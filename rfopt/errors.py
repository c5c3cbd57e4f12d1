"""The root of rfopt's exceptions, the two that the engine itself uses as signals, and every exception a user catches.

Every exception class rfopt defines derives from `RfoptError`, so ``except rfopt.RfoptError`` catches any error rfopt
raised on purpose (as ``optuna.exceptions.OptunaError`` does for Optuna). Every one a user may catch is defined here,
below every module that raises it (``rfopt.errors.OpError``, ``from rfopt.errors import CheckpointError``): the
module that raises it imports it from here, so this module reaches up to none and the layering test sees every import
(tests/product/test_architecture.py). Each keeps the builtin base users caught it by before (``ValueError`` for a refused input, ``RuntimeError`` for a failure while
running):

- `Refusal` (a ``ValueError``): rfopt refuses an input or a request before writing anything; the message names the
  field and the fix, and a note (``exc.add_note``) may say where (``in configs[2]``). `TypeRefusal` (also a
  ``TypeError``: a value of the wrong type), `MissingPackage` (also an ``ImportError``), `MissingFile` (also a
  ``FileNotFoundError``), `ConfigError`, `PlanError`,
  `OpError`, `StorageLocationError`, `StudyNameError`, `ClusterStorageError`, `ClusterTooSmallError`,
  `TrackerRefused`. The dashboard answers these with 400 and the message; any other exception is a bug, not the
  user's mistake.
- ``RuntimeError`` kin: `CheckpointError`, `RewardFunctionError`, `ModelUnavailableError`, `StorageUnavailableError`,
  `StorageRefusedError`, `StudyDeletedError`, `TrialDiverged`, `CompatError`, `StudyBusyError`,
  `StorageUnreachableError`, `DatasetUnavailableError`; and the engine's own ``rfopt.storage.leases.LeaseLost``,
  ``rfopt.training.runner.ChunkAborted``, ``rfopt.training.rollouts.DecodeAborted`` (and
  ``rfopt.training.rollouts.Ungangable``, a ``ValueError``), which never reach a user and are not offered here.
- `NothingToAnswer` (a ``LookupError``): what was asked for is not there yet (a study of that name, a best adapter
  before one is kept); `NoSuchTrial` (also an ``IndexError``): no trial of that number.
- `PopulationBasedTrainingMisplaced` (a ``TypeError``): `rfopt.PopulationBasedTraining` given to a plain Optuna study.
- `StaleRead`: what the engine read of a study changed under it (a trial ended in another process); the one signal
  that means "read again next round". Nothing else is deferred that way: a user's pruner that raises fails its trial.
- `PrunerFailed`: the study's pruner raised while judging a trial; the trial fails with that exception, as a trial
  whose ``should_prune()`` raises fails in Optuna.

    >>> try:                                                                       # doctest: +SKIP
    ...     study.clone_trial(3, {"learning_rat": 2e-6})
    ... except rfopt.RfoptError as exc:
    ...     print(exc)   # clone of trial 3: learning_rat: unknown field; use a GRPOConfig field ...
"""

from __future__ import annotations

from typing import Any


class RfoptError(Exception):
    """The root of every exception class rfopt defines."""


class Refusal(RfoptError, ValueError):
    """An input or a request that rfopt refuses before anything is written; the message names the field and the fix,
    so the fix can be applied and the call repeated."""


class TypeRefusal(Refusal, TypeError):
    """A `Refusal` of a value of the wrong type: also a ``TypeError``, as Python's own refusal of one is."""


class MissingPackage(Refusal, ImportError):
    """A `Refusal` of an input that needs a package that is not installed (the message names the ``pip install``):
    also an ``ImportError``."""


class MissingFile(Refusal, FileNotFoundError):
    """A `Refusal` of a path that names no file (a study file, a SQLite file to watch): also a ``FileNotFoundError``."""


class NothingToAnswer(RfoptError, LookupError):
    """What was asked for is not there (yet): a study of that name, a best trial or a checkpoint to export before one
    exists, a trial's config it never stored. Also a ``LookupError``, as rfopt raised it before."""


class NoSuchTrial(NothingToAnswer, IndexError):
    """The study has no trial of that number (``study.trial_config(7)``): also an ``IndexError``, as
    ``study.trials[7]`` raises."""


class ConfigError(Refusal):
    """A trial configuration that rfopt refuses before any training, with the field and the fix (here, below
    every module that reads configs, overrides or param names)."""


class StaleRead(RfoptError, ValueError):
    """What was read of the study is out of date: a trial ended in another process since (a worker, the dashboard's
    "Fail trial" button, a stop). The caller reads the study again and retries; nothing was decided or written."""


class PrunerFailed(RfoptError, RuntimeError):
    """The study's pruner raised while judging trial `trial_number` at `step`; the pruner's exception is the cause
    (``__cause__``). The trial fails with it, as a trial whose ``should_prune()`` raises fails in Optuna."""

    def __init__(self, message: str, trial_number: int, step: int) -> None:
        super().__init__(message)
        self.trial_number = trial_number
        self.step = step


# ---------------------------------------------------------------------- refused input (the module that refuses it)
class PlanError(Refusal):
    """A chunk plan that cannot work (more chunks than steps, batch sizes that do not divide), with the fix
    (`rfopt.chunks`)."""


class OpError(Refusal):
    """An op that cannot apply: unknown or finished trial, conflicting op, bad overrides (`rfopt.engine.trials.ops`)."""


class StorageLocationError(Refusal):
    """A storage URL that names no usable database: malformed, or a SQLite file that cannot be there (or, where it
    must exist, is not) (`rfopt.storage.database`)."""


class StudyNameError(Refusal):
    """A study name that cannot be a folder's name as it is (it would choose where files go) (`rfopt.engine.planning.checks`)."""


class ClusterStorageError(Refusal):
    """A study whose storage the cluster's workers cannot share (SQLite across nodes, an in-memory study)
    (`rfopt.engine.cluster.ray_worker`)."""


class ClusterTooSmallError(Refusal):
    """No node of the Ray cluster can hold one worker (its CPUs, or a GPU and a CPU): Ray would wait forever
    (`rfopt.engine.cluster.ray_cluster`)."""


class TrackerRefused(Refusal):
    """A tracker in ``report_to`` that cannot work here (not installed, unreachable, no credentials)
    (`rfopt.training.trackers`)."""


class PopulationBasedTrainingMisplaced(RfoptError, TypeError):
    """`PopulationBasedTraining` used as an Optuna pruner: only rfopt can carry it out (`rfopt.pruning`)."""


# ---------------------------------------------------------------------- failures while running
class CheckpointError(RfoptError, RuntimeError):
    """A checkpoint that is missing, unreadable, corrupt or could not be written; names the trial and the file
    (`rfopt.storage.files`)."""


class CompatError(RfoptError, RuntimeError):
    """A library that rfopt patches moved: the symbol or call site a correctness patch relies on is gone
    (`rfopt.compat`)."""


class DatasetUnavailableError(RfoptError, RuntimeError):
    """A loader could not get its rows: Hub unreachable, local file missing, or a column missing
    (`rfopt.studies.data`).

    The message names the dataset, the reason, and how to fix it; the underlying `datasets`
    error, if any, is chained as ``__cause__``.
    """


class ModelUnavailableError(RfoptError, RuntimeError):
    """The offline default model cannot be provided; the message says how to fix it (`rfopt.smollm2`)."""


class RewardFunctionError(RfoptError, RuntimeError):
    """A reward function that raised or returned something unusable, named with the fix."""


class StorageUnavailableError(RfoptError, RuntimeError):
    """The study's database stayed unreachable past the retry budget (`rfopt.storage.database`)."""


class StorageRefusedError(RfoptError, RuntimeError):
    """The database refuses a call for a reason waiting does not fix (`rfopt.storage.database.persistent_fault`):
    raised at once, not retried."""

    def __init__(self, message: str, refused: Any = None) -> None:
        super().__init__(message)
        self.refused = refused
        """Why (`rfopt.storage.database.PersistentFault`: its ``kind``, e.g. ``read-only``), or None."""


class StorageUnreachableError(RfoptError, RuntimeError):
    """The cluster's workers cannot connect to the study's storage (`rfopt.engine.cluster.ray_worker`)."""


class StudyBusyError(RfoptError, RuntimeError):
    """Another process runs the study in a way this one cannot join: `rfopt run` takes no leases, so it shares a study
    with no other process, and workers share one only with workers (`rfopt.storage.leases`)."""


class StudyDeletedError(RfoptError, RuntimeError):
    """The study was deleted from its storage while this process ran it (`rfopt.engine.running.run`)."""


class TrialDiverged(RfoptError, RuntimeError):
    """Training produced a NaN or infinite loss or gradient (`rfopt.training.runner`)."""


__all__ = ["CheckpointError", "ClusterStorageError", "ClusterTooSmallError", "CompatError", "ConfigError",
           "DatasetUnavailableError", "MissingFile", "MissingPackage", "ModelUnavailableError", "NoSuchTrial",
           "NothingToAnswer", "OpError", "PlanError", "PopulationBasedTrainingMisplaced", "PrunerFailed", "Refusal",
           "RewardFunctionError", "RfoptError", "StaleRead", "StorageLocationError", "StorageRefusedError",
           "StorageUnavailableError", "StorageUnreachableError", "StudyBusyError", "StudyDeletedError",
           "StudyNameError", "TrackerRefused", "TrialDiverged", "TypeRefusal"]
