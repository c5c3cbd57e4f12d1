"""Every use rfopt makes of another library's private internals, in one package: a module per library.

A private attribute, an overridden private method or a replaced global can move in any release of
the library it belongs to, and a patch that silently stops applying is worse than none. So each one
lives here, in its library's module, says what it relies on, why rfopt needs it and what it buys (an
entry of that module's docstring), and is checked:

- against the versions it was tested with (`TESTED`; pyproject.toml pins the same ranges): outside
  them, using it warns once (`CompatWarning`);
- by a canary in ``tests/compat/`` (a test module per library) that fails loudly when the symbol *or the
  call site* it relies on is gone (a hook that is never called any more fails its canary, not only a
  renamed one);
- at run time where that is cheap: a correctness patch whose target is missing raises `CompatError`
  instead of training wrongly.

Kept for exactness or correctness (none of them is a speed trick):

| module | entries |
|---|---|
| `_trl` | ``carried_trainer_state``, ``kl_reference_base_model``, ``telemetry_once`` (`chunk_trainer_class`), ``shared_model_restored`` (`restore_shared_model`, `forward_patches`), ``trl_model_loading`` (`create_model`), ``trl_prompt_tokenization`` (`tokenized_prompts`), ``gang_backbone_calls`` (`intercept_backbone`); `GRPO_LOSS_TYPES` |
| `_transformers` | ``trainer_generate_call`` (`extra_logits_processor`), ``attention_implementation``, ``generation_defaults`` |
| `_torch` | ``ddp_ignored_parameters`` (`data_parallel_model`), ``module_view`` |
| `_accelerate` | ``gang_gradient_state`` (`gradient_state`, `set_gradient_state`), ``gang_backward`` (`route_backward`) |
| `_bitsandbytes` | ``bitsandbytes_cpu_kernel_warning`` (`quiet_bitsandbytes`), ``bitsandbytes_trainable_4bit`` (`keep_4bit_trainable`) |
| `_optuna` | ``optimize_loop`` (`optimize_loop`, `stop_requested`), ``finished_trial_cache`` (`cached`), ``optuna_ids`` (`storage_of`, `trial_id_of`, `study_id_of`), ``enqueued_params`` (`enqueue_trial`), ``pruner_settings`` (`pruner_settings`, `patience_gate`, `percentile_helpers`, `frozen_copy`, `StudyView`) |
| `_optuna_dashboard` | ``dashboard_backlink`` (`with_backlink`) |
| `_trackio` | ``trackio_run_per_trial`` (`trackio_run`), ``trackio_flush`` |
| `_pickling` | ``plain_object_state`` (`object_state`, `object_from_state`): instances stored as pickle stores them |
| `_versions` | `TESTED`, `check_version`, `CompatWarning`: the ranges each library was checked against |

rfopt's modules import these names from ``rfopt.compat`` (``from rfopt.compat import storage_of``), never from a
library's module here. PEFT has no entry: rfopt uses its public API only.

None is kept for speed: each speed patch was measured on the SmolLM2 full study and removed when it
did not buy 1% of it (BENCHMARKS.md, "Engine core").
"""

from ._accelerate import gradient_state, route_backward, set_gradient_state
from ._bitsandbytes import BITSANDBYTES_CPU_KERNEL_WARNING, keep_4bit_trainable, quiet_bitsandbytes
from ._optuna import (
    StudyView,
    cached,
    enqueue_trial,
    frozen_copy,
    optimize_loop,
    patience_gate,
    percentile_helpers,
    pruner_settings,
    stop_requested,
    storage_of,
    study_id_of,
    trial_id_of,
)
from ._optuna_dashboard import with_backlink
from ._pickling import object_from_state, object_state
from ._torch import data_parallel_model, module_view
from ._trackio import trackio_flush, trackio_run
from ._transformers import attention_implementation, extra_logits_processor, generation_defaults
from ._trl import (
    GRPO_LOSS_TYPES,
    chunk_trainer_class,
    create_model,
    forward_patches,
    intercept_backbone,
    restore_shared_model,
    set_forward_patches,
    tokenized_prompts,
)
from ._versions import TESTED, CompatWarning, check_version

__all__ = [
    "BITSANDBYTES_CPU_KERNEL_WARNING",
    "GRPO_LOSS_TYPES",
    "TESTED",
    "CompatWarning",
    "StudyView",
    "attention_implementation",
    "cached",
    "check_version",
    "chunk_trainer_class",
    "create_model",
    "data_parallel_model",
    "enqueue_trial",
    "extra_logits_processor",
    "forward_patches",
    "frozen_copy",
    "generation_defaults",
    "gradient_state",
    "intercept_backbone",
    "keep_4bit_trainable",
    "module_view",
    "object_from_state",
    "object_state",
    "optimize_loop",
    "patience_gate",
    "percentile_helpers",
    "pruner_settings",
    "quiet_bitsandbytes",
    "restore_shared_model",
    "route_backward",
    "set_forward_patches",
    "set_gradient_state",
    "stop_requested",
    "storage_of",
    "study_id_of",
    "tokenized_prompts",
    "trackio_flush",
    "trackio_run",
    "trial_id_of",
    "with_backlink",
]
