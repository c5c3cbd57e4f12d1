"""rfopt: an Optuna-native engine for GRPO hyperparameter search.

Each GRPO configuration (`TrialConfig`, a `trl.GRPOTrainer(...)` call renamed) is an Optuna trial;
`Study.optimize` time-slices all live trials chunk by chunk on TRL's `GRPOTrainer`, reports every
chunk's evaluation to Optuna, and lets Optuna's pruners stop losers at rung boundaries.

    import optuna, rfopt
    study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db", num_chunks=4,
                               pruner=optuna.pruners.SuccessiveHalvingPruner())
    study.optimize(space, train_dataset, eval_dataset, n_trials=8, timeout=3600)
    print(study.best_trial.params, study.leaderboard_text())

``import rfopt`` offers the Optuna-shaped verbs (`create_study`, `load_study`, `Study`), the config types users write
(`TrialConfig`, `grid`, `EvalSettings`, `PopulationBasedTraining`, `RayCluster`, `StudySpec`), `LeaderboardRow`, the
root exceptions (`RfoptError`, `Refusal`) and `errors`, which offers every exception a user may catch
(``rfopt.errors.ConfigError``). The engine's parts are imported from their sub-packages
(``from rfopt.training.runner import TrialRunner``).
"""

import importlib
import warnings

from rfopt.config.settings import EvalSettings
from rfopt.config.spaces import grid
from rfopt.config.studyfile import StudySpec
from rfopt.config.trial import TrialConfig
from rfopt.engine.cluster.ray_cluster import RayCluster
from rfopt.pruning import PopulationBasedTraining
from rfopt.reports.results import LeaderboardRow

from . import errors
from .errors import Refusal, RfoptError
from .study import Study, create_study, load_study
from .compat import quiet_bitsandbytes

# Before anything imports PEFT, which imports bitsandbytes where it is installed (and bitsandbytes warns as it loads).
quiet_bitsandbytes()

__all__ = [
    "EvalSettings",
    "LeaderboardRow",
    "PopulationBasedTraining",
    "RayCluster",
    "Refusal",
    "RfoptError",
    "Study",
    "StudySpec",
    "TrialConfig",
    "create_study",
    "errors",
    "grid",
    "load_study",
]

# Names `import rfopt` offered up to 0.1.0, and where they live now: each exception in `rfopt.errors`, the engine's
# internals in their own modules. They still import from `rfopt`, with a DeprecationWarning, until the next release.
_MOVED = {
    "CheckpointError": "rfopt.errors",
    "CheckpointStore": "rfopt.storage.checkpoints",
    "ChunkPlan": "rfopt.chunks",
    "CompatError": "rfopt.errors",
    "ConfigError": "rfopt.errors",
    "EvalResult": "rfopt.training.evaluation",
    "ModelUnavailableError": "rfopt.errors",
    "OpError": "rfopt.errors",
    "PlanError": "rfopt.errors",
    "RewardFunctionError": "rfopt.errors",
    "StorageLocationError": "rfopt.errors",
    "StorageRefusedError": "rfopt.errors",
    "StorageUnavailableError": "rfopt.errors",
    "StudyDeletedError": "rfopt.errors",
    "StudyNameError": "rfopt.errors",
    "TrialDiverged": "rfopt.errors",
    "TrialRunner": "rfopt.training.runner",
    "TrialSchedule": "rfopt.chunks",
    "trial_schedule": "rfopt.chunks",
}


def __getattr__(name: str) -> object:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'rfopt' has no attribute {name!r}")
    warnings.warn(f"rfopt.{name} is deprecated and goes in the next release: use {home}.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(home), name)


__version__ = "0.1.0"
