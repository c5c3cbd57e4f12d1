"""Every use rfopt makes of another library's private internals, in one place.

A private attribute, an overridden private method or a replaced global can move in any release of
the library it belongs to, and a patch that silently stops applying is worse than none. So each one
lives here, says what it relies on, why rfopt needs it and what it buys, and is checked:

- against the versions it was tested with (`TESTED`; pyproject.toml pins the same ranges): outside
  them, using it warns once (`CompatWarning`);
- by a canary in ``tests/test_compat.py`` that fails loudly when the symbol *or the call site* it
  relies on is gone (a hook that is never called any more fails its canary, not only a renamed one);
- at run time where that is cheap: a correctness patch whose target is missing raises `CompatError`
  instead of training wrongly.

Kept for exactness or correctness (none of them is a speed trick):

``carried_trainer_state``  `ChunkTrainer` sets ``global_step`` and ``num_input_tokens_seen`` in
    ``Trainer._init_training_state`` (transformers): the state a chunk continues from must be in place
    before the training loop reads it for its first log (``on_train_begin`` is too late), or the first
    logged loss of every chunk is wrong. Buys: exactness of chunked training.
``kl_reference_base_model``  `ChunkTrainer` is built with ``beta=0`` and gets the trial's ``beta`` after
    construction (GRPOTrainer's ``beta`` attribute): with ``beta > 0`` TRL would copy a PEFT model's adapter
    into a "ref" adapter on the shared model (once per trainer, and of trained weights). Built with 0, TRL
    makes no copy, and its own fallback for a PEFT model without "ref" takes the reference from the base model
    with the adapter disabled, which is exact for a fresh LoRA. Buys: KL penalties on shared base models.
``telemetry_once``  `ChunkTrainer` sends TRL's usage ping (``_send_telemetry``) from a trial's first
    chunk only: a trial is one training run, not one per chunk. Buys: honest usage counts for TRL.
``shared_model_restored``  `restore_shared_model` puts back what a ``GRPOTrainer`` does to the model it
    is given (an instance ``forward`` wrapper, transformers' ``_require_grads_hook``, dropout,
    gradient checkpointing), so trials sharing one base model never see each other's settings (after
    ~1000 chunks the stacked wrappers also overflowed the stack). Buys: correctness of shared models.
``trl_model_loading``  `create_model` loads a string ``model`` with TRL's ``create_model_from_path``
    (``trl.trainer.utils``; not in TRL's public API), the function ``GRPOTrainer.__init__`` loads a string
    ``model`` with, given ``args.model_init_kwargs``: ``dtype`` defaults to float32 and may be a name
    (``"bfloat16"``), the architecture comes from the model's config. Buys: ``args.model_init_kwargs`` mean in a
    trial what they mean to TRL, with no copy of TRL's rules to drift from them.
``trainer_generate_call``  `extra_logits_processor` shadows ``generate`` on the model instance that
    ``GRPOTrainer`` generates with (it calls ``unwrapped_model.generate(..., generation_config=...)`` and passes no
    processor) to add one: custom processors run after transformers' own and before its sampling warpers. Buys:
    rollouts sampled per row in data-parallel trials, the same however the batch is split (`rfopt.training.parallel`).
``ddp_ignored_parameters``  `data_parallel_model` lists every parameter but the active adapter's with
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (torch), so DDP broadcasts and reduces
    only the trial's adapter: the lead of a data-parallel group holds other trials' adapters on the shared base,
    the other ranks do not. Buys: data-parallel trials on a shared base model.
``plain_object_state``  `object_state` and `object_from_state` store an instance (a per-trial
    ``TrainerCallback``; a callable reward such as ``trl.rewards.get_soft_overlong_punishment(...)`` returns, an
    instance of a private TRL class) as pickle stores a plain object: its class, then its instance attributes,
    private ones included; restored with ``cls.__new__(cls)`` and the attributes put back. Buys: callbacks and TRL's
    factory-made rewards stored with a trial, as JSON.
``gang_gradient_state``  `gradient_state` / `set_gradient_state` read and replace accelerate's process-wide
    ``GradientState`` (one dict, ``GradientState._shared_state``, shared by every instance): each Trainer's
    Accelerator writes its gradient-accumulation plugin and sync flag there, and its dataloader registers there. The
    trainers of a gang (`rfopt.training.gang`) interleave in one process, so each member keeps its own copy, swapped in when it
    runs. Buys: gang members with different ``gradient_accumulation_steps`` training in lockstep correctly.
``trl_prompt_tokenization``  `tokenized_prompts` calls ``GRPOTrainer._tokenize_prompts`` from a gang member's
    ``rollout_func`` (TRL's public rollout hook hands over untokenized prompts): the chat template with the trainer's
    tools, template and kwargs, as TRL tokenizes prompts for its own ``generate``. Buys: a gang's rollouts start from
    exactly the prompt tokens plain TRL would generate from.
``gang_backbone_calls``  `intercept_backbone` sets an instance ``forward`` on the backbone of a gang's shared model
    (``PreTrainedModel.base_model``): TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) computes a trainer's
    log-probabilities by calling ``getattr(self, "base_model")(...)`` and then its own head, so routing that call lets
    the members' forwards run as one batch (`rfopt.training.batched_step`) while each keeps its own head and
    temperature. Buys: one batched forward for a gang's training (``gang_training="batched"``).
``gang_backward``  `route_backward` replaces a gang member's ``Accelerator.backward`` on its trainer's accelerator,
    which ``Trainer.training_step`` calls with the step's loss: the member's loss, divided by the accumulation steps as
    accelerate divides it, goes to the gang, which differentiates every member's loss in one backward. Buys: one
    backward for a gang's training.
``optimize_loop``  `optimize_loop` marks an Optuna study as inside an optimize loop
    (``Study._thread_local.in_optimize_loop``, ``Study._stop_flag``), as ``optuna.Study.optimize``
    does, so that ``study.stop()`` (which GridSampler calls when its grid is done) works under rfopt.
``finished_trial_cache``  `cached` puts Optuna's cache of finished trials in front of an
    ``RDBStorage`` (``optuna.storages.get_storage``, "for internal usage"), as Optuna does when it
    opens a storage URL itself. Buys: Optuna's own read behaviour for rfopt's storages.
``optuna_ids``  `storage_of`, `trial_id_of`, `study_id_of`: Optuna objects' ``_storage``,
    ``_trial_id`` and ``_study_id``. Optuna has no public accessor; optuna-dashboard reads them too.
``dashboard_backlink``  `with_backlink` adds a link to rfopt's page to the HTML optuna-dashboard serves for its
    single-page app (its ``index.html``, before ``</body>``): optuna-dashboard has no extension point for a link, and
    its pages would otherwise never lead to rfopt's. Buys: both UIs link to each other.
``enqueued_params``  `enqueue_trial` enqueues a trial with system attrs, as ``Study.enqueue_trial`` does with user
    attrs: a WAITING trial whose ``fixed_params`` system attr (Optuna's own key, which ``Trial.suggest_*`` reads)
    holds its params. ``enqueue_trial`` takes no system attrs, and writing them after it would race a process that
    asks the trial the moment it is enqueued. Buys: rfopt's records of a listed config out of the user's attrs.
``module_view``  `module_view` makes a second ``torch.nn.Module`` tree over the same weights: a shallow copy of each
    module with a children dict of its own (``Module._modules``), no hooks (``Module._forward_hooks`` and the other
    hook dicts) and no instance ``forward`` attribute (a trainer's wrapper), with some modules replaced. torch has no
    public way to copy a module without its parameters. Buys: the batched rollout backend serves every gang member's
    adapter from its LoRA bank (`rfopt.training.rollouts.bank`) without changing the shared model, and so without
    Python hooks in its decode step (which a CUDA graph captures).
``attention_implementation``  `attention_implementation` reads a transformers config's ``_attn_implementation``
    (the attention the model was loaded with; transformers has no public getter): the batched decoder builds the
    attention mask that implementation takes (a boolean mask for ``sdpa``, an additive one for ``eager``).
``generation_defaults``  `generation_defaults` reads transformers' global generation defaults
    (``GenerationConfig._get_default_generation_params``: ``top_k=50``, ``num_beams=1``, ...), the values
    ``model.generate`` fills (in ``_prepare_generation_config``) where neither its caller nor the model's own
    ``generation_config`` set a field. Buys: the batched rollout backend samples with the settings ``generate`` would
    (`rfopt.training.rollouts.sampler.generation_settings`), and knows a setting it lacks from a default.
``pruner_settings``  `pruner_settings`, `patience_gate`, `percentile_helpers`, `StudyView`: rfopt's
    rung decisions (``rfopt.pruning``) run Optuna's pruners on a view of the study at one step, and
    need their constructor arguments (kept in private attributes), Optuna's percentile helpers (for
    the reason text) and a read-only `optuna.Study` that serves trials from a list.
``trackio_run_per_trial``  `trackio_run` opens a run with ``trackio.init`` in an empty ``contextvars.Context``:
    ``trackio.init`` finishes the run that is current (``trackio.context_vars.current_run``, a ``ContextVar``) before
    it opens another, so one process could hold one run. In a context of its own each ``init`` sees none and leaves
    the caller's alone. Buys: a trackio run per trial of a gang (`rfopt.training.trackers`).
``bitsandbytes_cpu_kernel_warning``  `quiet_bitsandbytes` drops one log record of bitsandbytes' CPU backend (logger
    ``bitsandbytes.backends.cpu.ops``): when it is imported on a CPU with AVX512-BF16, bitsandbytes 0.50 tries to fetch
    a faster 4-bit kernel through the Hub's ``kernels`` package and, where that package is missing, warns "Failed to
    load CPU gemm_4bit_forward from kernels-community", then uses its own kernel. PEFT imports bitsandbytes whenever
    it is installed (``peft/helpers.py``), so every run would print it, QLoRA or not. Buys: a quiet start where the
    ``qlora`` extra is installed (nothing changes in what trains).
``bitsandbytes_trainable_4bit``  `keep_4bit_trainable` sets ``support_avx512bf16_for_cpu = False`` on every
    bitsandbytes ``Linear4bit`` of a loaded model (bitsandbytes 0.50, ``nn/modules.py``): on a CPU with AVX512-BF16,
    the first forward in eval mode without gradients (an evaluation's ``generate``, the batched decoder's view) repacks
    the layer's weight in place into a CPU inference layout, and every forward after it, training included, goes
    through ``gemv_4bit``, which has no autograd kernel ("an autograd kernel was not registered ... silently
    incorrect"): the gradients of the adapters below it would be wrong. Buys: QLoRA trials that evaluate (or decode in
    a gang) between training steps train correctly on the CPU (the dequantizing path, a little slower to decode).
``trackio_flush``  `trackio_flush` writes what a local trackio run (``Run._is_local``) has queued now (``Run._flush_queues_inline``,
    under ``Run._client_lock``, as its sender thread does every ``BATCH_SEND_INTERVAL``); trackio has no public
    flush but ``finish``. Buys: a committed chunk is in trackio's database when the commit returns, so a crash right
    after it loses nothing of it.

None is kept for speed: each speed patch was measured on the SmolLM2 full study and removed when it
did not buy 1% of it (BENCHMARKS.md, "Engine core").
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import warnings
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

import optuna

from rfopt.errors import CompatError

TESTED: dict[str, str] = {
    "transformers": "~=5.23.0",
    "trl": "~=1.16.0",
    "peft": "~=0.21.0",
    "accelerate": "~=1.15.0",
    "optuna": "~=5.0.0",
    "optuna-dashboard": "~=0.21.0",
    "torch": ">=2.4,<2.15",
    "trackio": "~=0.43.0",
}
"""The versions each patched library was checked against (compatible-release ranges, as pinned in pyproject.toml)."""

class CompatWarning(UserWarning):
    """A patched library is outside the versions rfopt was tested with."""


@functools.cache
def check_version(package: str) -> bool:
    """Whether `package` is in its `TESTED` range; warns once if not."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = importlib.metadata.version(package)
    if Version(installed) in SpecifierSet(TESTED[package]):
        return True
    warnings.warn(
        f"rfopt was tested with {package}{TESTED[package]}; {installed} is installed. Its patches of {package}'s "
        f"internals may no longer apply (see rfopt/compat.py); if training fails or differs, "
        f"pip install '{package}{TESTED[package]}'",
        CompatWarning,
        stacklevel=3,
    )
    return False


def _require(owner: Any, name: str, entry: str) -> None:
    if not hasattr(owner, name):
        raise CompatError(
            f"{entry}: {getattr(owner, '__qualname__', owner)}.{name} is gone; this rfopt does not support the installed "
            f"version (tested: {', '.join(f'{k}{v}' for k, v in TESTED.items())})"
        )


# ---------------------------------------------------------------------- bitsandbytes
BITSANDBYTES_CPU_KERNEL_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"
"""The start of the warning `quiet_bitsandbytes` drops (bitsandbytes 0.50, ``backends/cpu/ops.py``)."""


def quiet_bitsandbytes() -> None:
    """Keep bitsandbytes' warning about the optional CPU kernel it could not fetch from users (entry
    ``bitsandbytes_cpu_kernel_warning``): a filter on its logger, set before bitsandbytes is imported (it warns while
    it is imported). Imports nothing; idempotent."""
    import logging

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropCpuKernelWarning) for f in logger.filters):
        logger.addFilter(_DropCpuKernelWarning())


def keep_4bit_trainable(model: Any) -> None:
    """Keep every bitsandbytes 4-bit Linear of `model` on its trainable path (entry ``bitsandbytes_trainable_4bit``):
    never repacked for CPU inference by an eval-mode forward."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


class _DropCpuKernelWarning:
    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(BITSANDBYTES_CPU_KERNEL_WARNING)


# ---------------------------------------------------------------------- torch / transformers: the batched decoder
_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def module_view(root: Any, replace: Callable[[Any, Callable[[Any], Any]], Any | None], dtype: Any = None) -> Any:
    """A module tree of its own over `root`'s weights (entry ``module_view``): each module shallow-copied with its own
    children, no hooks and no instance ``forward``; ``replace(module, view_of)`` may return a module to put in its
    place (`view_of` views a child), or None to copy it. With `dtype`, the view's floating-point parameters are copies
    in that dtype (tied weights stay tied; the model's own are untouched), its buffers the model's."""
    import torch.nn as nn

    check_version("torch")
    _require(nn.Module(), "_modules", "module_view")
    memo: dict[int, Any] = {}
    converted: dict[int, Any] = {}

    def weight(param: Any) -> Any:
        if param is None or dtype is None or not param.is_floating_point() or param.dtype == dtype:
            return param
        if id(param) not in converted:
            converted[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
        return converted[id(param)]

    def view_of(module: Any) -> Any:
        if id(module) in memo:
            return memo[id(module)]
        made = replace(module, view_of)
        if made is None:
            made = copy.copy(module)
            state = vars(made)
            state.pop("forward", None)  # a trainer's wrapper around the shared model's forward
            for hooks in _MODULE_HOOKS:
                if hooks in state:
                    state[hooks] = type(state[hooks])()
            state["_modules"] = {name: (view_of(child) if child is not None else None)
                                 for name, child in module._modules.items()}
            state["_parameters"] = {name: weight(param) for name, param in module._parameters.items()}
        memo[id(module)] = made
        return made

    return view_of(root)


def attention_implementation(config: Any) -> str:
    """The attention a transformers model was loaded with (entry ``attention_implementation``): ``"sdpa"``,
    ``"eager"``, ``"flash_attention_2"``, ..."""
    check_version("transformers")
    return getattr(config, "_attn_implementation", None) or "eager"


def generation_defaults() -> dict[str, Any]:
    """The values ``model.generate`` gives the generation fields that neither its caller nor the model's
    ``generation_config`` set (entry ``generation_defaults``)."""
    from transformers import GenerationConfig

    check_version("transformers")
    _require(GenerationConfig, "_get_default_generation_params", "generation_defaults")
    return dict(GenerationConfig._get_default_generation_params())


# ---------------------------------------------------------------------- TRL / transformers: the chunk trainer
@functools.cache
def chunk_trainer_class() -> type:
    """``GRPOTrainer`` that continues a trial (entries ``carried_trainer_state``, ``kl_reference_base_model`` and
    ``telemetry_once``). Give it ``args`` with ``beta=0`` and the trial's beta as `beta`."""
    from transformers import Trainer
    from trl import GRPOTrainer

    check_version("transformers")
    check_version("trl")
    _require(Trainer, "_init_training_state", "carried_trainer_state")
    _require(GRPOTrainer, "_send_telemetry", "telemetry_once")
    _require(GRPOTrainer, "_compute_loss", "kl_reference_base_model")

    class ChunkTrainer(GRPOTrainer):
        """GRPOTrainer that continues a trial: its TrainerState starts at the carried step and token counts."""

        def __init__(self, *args: Any, start_step: int, tokens_seen: int, first_chunk: bool, beta: float,
                     **kwargs: Any) -> None:
            self._rfopt_start = (start_step, tokens_seen)
            self._rfopt_first_chunk = first_chunk
            super().__init__(*args, **kwargs)
            self.beta = beta

        def _send_telemetry(self) -> None:
            if self._rfopt_first_chunk:
                super()._send_telemetry()

        def _init_training_state(self, *args: Any, **kwargs: Any):
            out = super()._init_training_state(*args, **kwargs)
            self.state.global_step, self.state.num_input_tokens_seen = self._rfopt_start
            return out

    return ChunkTrainer


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""The ``loss_type`` values GRPOTrainer computes (TRL 1.16: its loss raises "Unknown loss type" for any other, at the
first training step, while ``GRPOConfig`` accepts any text). Checked against TRL's source by tests/test_compat.py."""


def create_model(model_id: str, **kwargs: Any) -> Any:
    """A model loaded from a Hub id or directory as ``GRPOTrainer`` loads a string ``model`` (entry
    ``trl_model_loading``): ``trl.trainer.utils.create_model_from_path(model_id, **kwargs)``, kwargs being
    ``args.model_init_kwargs`` (with ``quantization_config`` and ``trust_remote_code`` as TRL adds them)."""
    check_version("trl")
    from trl.trainer import utils

    _require(utils, "create_model_from_path", "trl_model_loading")
    return utils.create_model_from_path(model_id, **kwargs)


@contextmanager
def restore_shared_model(model: Any, args: Any) -> Iterator[None]:
    """Put back what constructing and running a GRPOTrainer with `args` changes on a (shared) model
    (entry ``shared_model_restored``).

    TRL wraps ``forward`` on the model instance (a fused LM head with that trainer's temperature), zeroes dropout
    with ``args.disable_dropout``, and with gradient checkpointing turns it on and adds transformers' input hook
    (``_require_grads_hook``). Dropout and checkpointing are walked only when the trainer will change them.
    """
    import torch.nn as nn

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    patched = {m: vars(m).get("forward") for m in (model, base)}
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, nn.Dropout)] if args.disable_dropout else []
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; after __post_init__ they mirror.
    checkpoints = bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", False))
    checkpointing = checkpoints and getattr(base, "is_gradient_checkpointing", False)
    try:
        yield
    finally:
        for module, forward in patched.items():
            if forward is None:
                vars(module).pop("forward", None)
            else:
                module.forward = forward
        for module, p in dropouts:
            module.p = p
        if getattr(base, "_require_grads_hook", None) is not None:
            base.disable_input_require_grads()
        if checkpoints and not checkpointing and getattr(base, "is_gradient_checkpointing", False):
            base.gradient_checkpointing_disable()


def forward_patches(model: Any) -> dict[Any, Any]:
    """The instance ``forward`` attributes a ``GRPOTrainer`` sets on a (shared) model and its base model (entry
    ``shared_model_restored``): a gang member's trainer wraps ``forward`` with its own fused LM head (its temperature),
    so each member's wrapper is put in place when that member runs (`set_forward_patches`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {m: vars(m).get("forward") for m in (model, base)}


def set_forward_patches(patches: dict[Any, Any]) -> None:
    """Put back what `forward_patches` read (None: no instance attribute, the class's ``forward``)."""
    for module, forward in patches.items():
        if forward is None:
            vars(module).pop("forward", None)
        else:
            module.forward = forward


# ---------------------------------------------------------------------- gangs: several trainers in one process
def gradient_state() -> dict[str, Any]:
    """A copy of accelerate's process-wide gradient state (entry ``gang_gradient_state``)."""
    from accelerate.state import GradientState

    _require(GradientState, "_shared_state", "gang_gradient_state")
    return dict(GradientState._shared_state)


def set_gradient_state(state: dict[str, Any]) -> None:
    """Make `state` (from `gradient_state`) accelerate's process-wide gradient state, in place (every ``GradientState``
    instance shares the one dict)."""
    from accelerate.state import GradientState

    shared = GradientState._shared_state
    shared.clear()
    shared.update(state)


def tokenized_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """The token ids ``GRPOTrainer`` generates from for `prompts` (entry ``trl_prompt_tokenization``): a list of ids
    per prompt, the chat template applied to conversational prompts with the trainer's tools and template."""
    check_version("trl")
    _require(type(trainer), "_tokenize_prompts", "trl_prompt_tokenization")
    prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
    if images is not None:
        raise CompatError("trl_prompt_tokenization: prompts with images cannot be decoded by rfopt's rollout engine")
    return [list(ids) for ids in prompt_ids]


@contextmanager
def intercept_backbone(model: Any, call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
                       ) -> Iterator[Any]:
    """Route every call of a (shared) model's backbone through ``call(original, args, kwargs)`` (entry
    ``gang_backbone_calls``); yields the backbone. The instance ``forward`` is removed again on exit."""
    check_version("trl")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = base.base_model
    if backbone is base:
        raise CompatError("gang_backbone_calls: the model has no backbone apart from its LM head")
    had = vars(backbone).get("forward")
    original = backbone.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return call(original, args, kwargs)

    backbone.forward = forward
    try:
        yield backbone
    finally:
        if had is None:
            vars(backbone).pop("forward", None)
        else:
            backbone.forward = had


def route_backward(trainer: Any, backward: Callable[[Any], None]) -> bool:
    """Make `trainer`'s ``accelerator.backward(loss)`` call ``backward(loss / gradient_accumulation_steps)`` (the
    loss as accelerate would differentiate it) instead (entry ``gang_backward``); False, and nothing changed, where
    accelerate would do more than ``loss.backward()`` (DeepSpeed, Megatron, a gradient scaler, LOMO)."""
    from accelerate.utils import DistributedType

    check_version("accelerate")
    accelerator = trainer.accelerator
    _require(accelerator, "has_lomo_optimizer", "gang_backward")
    if (accelerator.distributed_type != DistributedType.NO or accelerator.scaler is not None
            or accelerator.has_lomo_optimizer):
        return False

    def routed(loss: Any, **kwargs: Any) -> None:
        if kwargs:
            raise CompatError(f"gang_backward: accelerate's backward got {sorted(kwargs)}, which the gang does not pass")
        backward(loss / accelerator.gradient_accumulation_steps)

    accelerator.backward = routed
    return True


# ---------------------------------------------------------------------- instances stored as pickle stores them
def object_state(obj: Any) -> dict[str, Any] | None:
    """The instance attributes pickle stores for `obj` when it pickles it as a plain object (its class, then its
    ``__dict__``); None for anything pickle stores otherwise: a function, a class, a builtin, an object with slots or
    its own ``__reduce__``/``__getstate__``/``__setstate__`` (entry ``plain_object_state``)."""
    cls = type(obj)
    if isinstance(obj, type) or cls.__module__ == "builtins" or not hasattr(obj, "__dict__"):
        return None
    if (cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__
            or cls.__getstate__ is not object.__getstate__ or hasattr(cls, "__setstate__")
            or any("__slots__" in vars(k) for k in cls.__mro__[:-1])):
        return None
    return dict(vars(obj))


def object_from_state(cls: type, state: dict[str, Any]) -> Any:
    """An instance of `cls` with the attributes `state`, made as pickle makes one (``cls.__new__(cls)``, no
    ``__init__``)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


# ---------------------------------------------------------------------- Optuna
@contextmanager
def extra_logits_processor(model: Any, make: Callable[[Any, int], Any]) -> Iterator[None]:
    """While the block runs, every ``model.generate(...)`` call also gets the logits processor ``make(generation_config,
    rows)`` (``rows``: the call's batch size), after transformers' own processors and before its sampling warpers.

    Entry ``trainer_generate_call``: `GRPOTrainer` calls ``generate`` on the unwrapped model (the one rfopt gives
    it) with ``generation_config=`` and no ``logits_processor``; an instance attribute shadows the method for the
    block. Buys: per-row sampling streams for data-parallel trials (`rfopt.training.parallel`)."""
    from transformers import LogitsProcessorList

    check_version("transformers")
    check_version("trl")
    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        inputs = kwargs.get("input_ids", args[0] if args else None)
        rows = inputs.shape[0]
        config = kwargs.get("generation_config") or model.generation_config
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), make(config, rows)])
        return original(*args, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        del model.generate


@contextmanager
def data_parallel_model(model: Any) -> Iterator[None]:
    """While the block runs, DDP (which the Trainer wraps the model in under ``torch.distributed``) syncs and reduces
    only the model's trainable parameters: the active trial's adapter.

    Entry ``ddp_ignored_parameters``: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (torch;
    it sets ``_ddp_params_and_buffers_to_ignore`` on the module, which DDP reads at construction). DDP broadcasts
    every parameter and buffer from rank 0 when it wraps a model; the lead of a data-parallel group holds other
    trials' adapters on the shared base too, which the other ranks do not, and the broadcast would not match.
    Buys: data-parallel trials on a shared base model (`rfopt.training.parallel`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    ignored = [name for name, _ in model.named_parameters() if name not in trainable]
    ignored += [name for name, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    try:
        yield
    finally:
        model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)


def storage_of(study: Any) -> Any:
    """An `optuna.Study`'s storage (``Study._storage``; entry ``optuna_ids``)."""
    return study._storage


def trial_id_of(trial: Any) -> int:
    """A `FrozenTrial`'s or `Trial`'s id in its storage (``_trial_id``)."""
    return trial._trial_id


def study_id_of(study: Any) -> int:
    """A `FrozenStudy`'s or `Study`'s id in its storage (``_study_id``)."""
    return study._study_id


def with_backlink(page: bytes, snippet: bytes) -> bytes | None:
    """optuna-dashboard's page (`page`, its ``index.html``) with `snippet` before ``</body>``; None if the page has no
    ``</body>`` (it changed: the link is left out, the page is served as it is). Entry ``dashboard_backlink``."""
    end = page.rfind(b"</body>")
    return None if end < 0 else page[:end] + snippet + page[end:]


def enqueue_trial(study: Any, params: dict[str, Any], system_attrs: dict[str, Any]) -> None:
    """``study.enqueue_trial(params)`` with `system_attrs` on the enqueued trial, in one write (entry
    ``enqueued_params``)."""
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                              system_attrs={**system_attrs, "fixed_params": dict(params)}))


@contextmanager
def optimize_loop(study: Any) -> Iterator[None]:
    """Inside this block ``study.stop()`` works as inside ``optuna.Study.optimize`` (entry ``optimize_loop``)."""
    check_version("optuna")
    _require(study, "_thread_local", "optimize_loop")
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


# ---------------------------------------------------------------------- Optuna pruners (rfopt.pruning)
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


# ---------------------------------------------------------------------- trackio (rfopt.training.trackers)
def trackio_run(**kwargs: Any) -> Any:
    """``trackio.init(**kwargs)``'s run, the runs opened before it left running (entry ``trackio_run_per_trial``)."""
    import contextvars

    import trackio
    from trackio import context_vars

    check_version("trackio")
    _require(context_vars, "current_run", "trackio_run_per_trial")
    return contextvars.Context().run(trackio.init, **kwargs)


def trackio_flush(run: Any) -> None:
    """Write what `run` (a local ``trackio.Run``) has queued now (entry ``trackio_flush``)."""
    _require(run, "_flush_queues_inline", "trackio_flush")
    if not getattr(run, "_is_local", False):  # a Space's or server's run: its sender thread sends it
        return
    with run._client_lock:
        run._flush_queues_inline()
