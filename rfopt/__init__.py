"""rfopt: an Optuna-native engine for GRPO hyperparameter search.

Each GRPO configuration (`TrialConfig`, a `trl.GRPOTrainer(...)` call renamed) is an Optuna trial;
`Study.optimize` time-slices all live trials chunk by chunk on TRL's `GRPOTrainer`, reports every
chunk's evaluation to Optuna, and lets Optuna's pruners stop losers at rung boundaries.

    import optuna, rfopt
    study = rfopt.create_study(study_name="demo", storage="sqlite:///rfopt.db", num_chunks=4,
                               pruner=optuna.pruners.SuccessiveHalvingPruner())
    study.optimize(space, train_dataset, eval_dataset, n_trials=8, timeout=3600)
    print(study.best_trial.params, study.leaderboard_text())
"""

from rfopt.config.rewardfuncs import RewardFunctionError
from rfopt.config.settings import EvalSettings
from rfopt.config.spaces import grid
from rfopt.config.studyfile import StudySpec
from rfopt.config.trial import ConfigError, TrialConfig
from rfopt.engine.cluster import RayCluster
from rfopt.engine.ops import OpError
from rfopt.pruning import PopulationBasedTraining
from rfopt.reports.outcome import Recommendation, StudyOutcome
from rfopt.storage.checkpoints import CheckpointError, CheckpointStore
from rfopt.storage.database import StorageLocationError, StorageRefusedError, StorageUnavailableError
from rfopt.training.evaluation import EvalResult
from rfopt.training.models import ModelUnavailableError
from rfopt.training.runner import TrialDiverged, TrialRunner

from .chunks import ChunkPlan, PlanError, TrialSchedule, trial_schedule
from .compat import CompatError
from .errors import Refusal, RfoptError
from .study import LeaderboardRow, Study, StudyDeletedError, StudyNameError, create_study, load_study

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "ChunkPlan",
    "CompatError",
    "ConfigError",
    "EvalResult",
    "EvalSettings",
    "LeaderboardRow",
    "ModelUnavailableError",
    "OpError",
    "PlanError",
    "PopulationBasedTraining",
    "RayCluster",
    "Recommendation",
    "Refusal",
    "RewardFunctionError",
    "RfoptError",
    "StorageLocationError",
    "StorageRefusedError",
    "StorageUnavailableError",
    "Study",
    "StudyDeletedError",
    "StudyNameError",
    "StudyOutcome",
    "StudySpec",
    "TrialConfig",
    "TrialDiverged",
    "TrialRunner",
    "TrialSchedule",
    "create_study",
    "grid",
    "load_study",
    "trial_schedule",
]

__version__ = "0.1.0"
