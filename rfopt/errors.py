"""The root of rfopt's exceptions, the two that the engine itself uses as signals, and every exception a user catches.

Every exception class rfopt defines derives from `RfoptError`, so ``except rfopt.RfoptError`` catches any error rfopt
raised on purpose (as ``optuna.exceptions.OptunaError`` does for Optuna). Each class lives in the module that raises
it (`ConfigError`, raised by every module that reads configs, overrides or param names, lives here); this module offers
every one a user may catch (``rfopt.errors.OpError``, ``from rfopt.errors import CheckpointError``), and each keeps the
builtin base users caught it by before (``ValueError`` for a refused input, ``RuntimeError`` for a failure while
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

import importlib


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


# Where each exception this module offers but does not define lives: the module that raises it, most of them above
# this one (every layer imports this module, so importing theirs here would be a cycle). Each is imported when first
# asked for.
_ELSEWHERE = {
    "CheckpointError": "rfopt.storage.files",
    "ClusterStorageError": "rfopt.engine.ray_worker",
    "ClusterTooSmallError": "rfopt.engine.cluster",
    "CompatError": "rfopt.compat",
    "DatasetUnavailableError": "rfopt.studies.data",
    "ModelUnavailableError": "rfopt.smollm2",
    "OpError": "rfopt.engine.ops",
    "PlanError": "rfopt.chunks",
    "PopulationBasedTrainingMisplaced": "rfopt.pruning._pbt",
    "RewardFunctionError": "rfopt.config.rewardfuncs",
    "StorageLocationError": "rfopt.storage.database",
    "StorageRefusedError": "rfopt.storage.database",
    "StorageUnavailableError": "rfopt.storage.database",
    "StorageUnreachableError": "rfopt.engine.ray_worker",
    "StudyBusyError": "rfopt.storage.leases",
    "StudyDeletedError": "rfopt.engine.run",
    "StudyNameError": "rfopt.engine.checks",
    "TrackerRefused": "rfopt.training.trackers",
    "TrialDiverged": "rfopt.training.runner",
}

# Those defined here, then the others, spread from the table: ruff's check that each name in `__all__` is defined
# does not know that `__getattr__` supplies them.
__all__ = ["ConfigError", "MissingFile", "MissingPackage", "NoSuchTrial", "NothingToAnswer", "PrunerFailed", "Refusal",
           "RfoptError", "StaleRead", "TypeRefusal", *_ELSEWHERE]


def __getattr__(name: str) -> type[RfoptError]:
    home = _ELSEWHERE.get(name)
    if home is None:
        raise AttributeError(f"module 'rfopt.errors' has no attribute {name!r}")
    cls = getattr(importlib.import_module(home), name)
    globals()[name] = cls  # asked for once
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
