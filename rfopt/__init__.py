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

from .checkpoints import CheckpointError, CheckpointStore
from .cluster import RayCluster
from .chunks import ChunkPlan, PlanError, TrialSchedule, trial_schedule
from .compat import CompatError
from .config import ConfigError, TrialConfig
from .errors import Refusal, RfoptError
from .evaluation import EvalResult, EvalSettings, RewardFunctionError
from .models import ModelUnavailableError
from .ops import OpError
from .pruning import PopulationBasedTraining
from .runner import TrialDiverged, TrialRunner
from .spaces import grid
from .storage import StorageLocationError, StorageRefusedError, StorageUnavailableError
from .study import LeaderboardRow, Study, StudyDeletedError, StudyNameError, create_study, load_study
from .studyfile import StudySpec

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
    "Refusal",
    "RewardFunctionError",
    "RfoptError",
    "StorageLocationError",
    "StorageRefusedError",
    "StorageUnavailableError",
    "Study",
    "StudyDeletedError",
    "StudyNameError",
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
