"""How a trial and a study are written down: a trial's config, its JSON form, its search space, a study's settings.

| module | owns |
|---|---|
| `trial` | `TrialConfig` (a ``GRPOTrainer(...)`` call, renamed) and its validation |
| `arguments` | GRPOTrainer's arguments as a `TrialConfig` takes or refuses them; `GRPOConfig` values training refuses |
| `codec` | a config as JSON (functions, callbacks, tokenizers, `GRPOConfig` and PEFT fields); the first rfopt's layout |
| `overrides` | FIELD=VALUE overrides typed by their fields (clones, ``rfopt clone --set``) |
| `params` | the one naming of config fields as Optuna params, both ways, and the distributions that hold their values |
| `usercode` | the user's functions by import path, and the user files imported to find them |
| `rewardfuncs` | a reward function as TRL calls it: its name, the columns it takes, the call checked |
| `settings` | what every trial of a study shares: `EvalSettings` |
| `spaces` | search spaces: a function, a list of configs, a grid |
| `form` | a stored config as the clone form's typed fields |
| `studyfile` | `StudySpec`: a ready-made study file |

`rfopt.config` itself offers the names the single ``config`` module offered before it was split.
"""

from rfopt.config.arguments import UNSUPPORTED_TRAINER_ARGUMENTS, check_training_values
from rfopt.config.codec import (
    PLACEMENT_FIELDS,
    PLUMBING_FIELDS,
    TokenizerSpec,
    callback_from_json,
    callback_to_json,
    current_layout,
    grpo_default,
    grpo_to_dict,
    instance_from_json,
    instance_to_json,
    reward_from_json,
    reward_to_json,
)
from rfopt.config.overrides import override_dict, parse_assignments, typed_value
from rfopt.config.trial import TrialConfig, check_model
from rfopt.config.usercode import import_path, importing_user_file, load_file_module, resolve_import, study_on_import
from rfopt.errors import ConfigError

__all__ = [
    "UNSUPPORTED_TRAINER_ARGUMENTS", "ConfigError", "TrialConfig", "check_model", "check_training_values",
    "PLACEMENT_FIELDS", "PLUMBING_FIELDS", "TokenizerSpec", "callback_from_json", "callback_to_json",
    "current_layout", "grpo_default", "grpo_to_dict", "instance_from_json", "instance_to_json", "reward_from_json",
    "reward_to_json", "override_dict", "parse_assignments", "typed_value", "import_path", "importing_user_file",
    "load_file_module", "resolve_import", "study_on_import",
]
