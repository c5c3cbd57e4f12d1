"""TRL's internals that rfopt relies on: the chunk trainer, TRL's model loading, a shared model put back after a
trainer, the prompt tokens TRL generates from, the backbone call of its fused LM head.

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
``trl_prompt_tokenization``  `tokenized_prompts` calls ``GRPOTrainer._tokenize_prompts`` from a gang member's
    ``rollout_func`` (TRL's public rollout hook hands over untokenized prompts): the chat template with the trainer's
    tools, template and kwargs, as TRL tokenizes prompts for its own ``generate``. Buys: a gang's rollouts start from
    exactly the prompt tokens plain TRL would generate from.
``gang_backbone_calls``  `intercept_backbone` sets an instance ``forward`` on the backbone of a gang's shared model
    (``PreTrainedModel.base_model``): TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) computes a trainer's
    log-probabilities by calling ``getattr(self, "base_model")(...)`` and then its own head, so routing that call lets
    the members' forwards run as one batch (`rfopt.training.batched_step`) while each keeps its own head and
    temperature. Buys: one batched forward for a gang's training (``gang_training="batched"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rfopt.errors import CompatError

from ._versions import check_version, require


@functools.cache
def chunk_trainer_class() -> type:
    """``GRPOTrainer`` that continues a trial (entries ``carried_trainer_state``, ``kl_reference_base_model`` and
    ``telemetry_once``). Give it ``args`` with ``beta=0`` and the trial's beta as `beta`."""
    from transformers import Trainer
    from trl import GRPOTrainer

    check_version("transformers")
    check_version("trl")
    require(Trainer, "_init_training_state", "carried_trainer_state")
    require(GRPOTrainer, "_send_telemetry", "telemetry_once")
    require(GRPOTrainer, "_compute_loss", "kl_reference_base_model")

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
first training step, while ``GRPOConfig`` accepts any text). Checked against TRL's source by tests/compat/test_trl.py."""


def create_model(model_id: str, **kwargs: Any) -> Any:
    """A model loaded from a Hub id or directory as ``GRPOTrainer`` loads a string ``model`` (entry
    ``trl_model_loading``): ``trl.trainer.utils.create_model_from_path(model_id, **kwargs)``, kwargs being
    ``args.model_init_kwargs`` (with ``quantization_config`` and ``trust_remote_code`` as TRL adds them)."""
    check_version("trl")
    from trl.trainer import utils

    require(utils, "create_model_from_path", "trl_model_loading")
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


def tokenized_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """The token ids ``GRPOTrainer`` generates from for `prompts` (entry ``trl_prompt_tokenization``): a list of ids
    per prompt, the chat template applied to conversational prompts with the trainer's tools and template."""
    check_version("trl")
    require(type(trainer), "_tokenize_prompts", "trl_prompt_tokenization")
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
