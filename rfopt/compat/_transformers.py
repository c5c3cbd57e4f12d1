"""transformers' internals that rfopt relies on: the attention a model was loaded with, the defaults ``generate``
fills, a logits processor added to the ``generate`` call TRL makes.

``trainer_generate_call``  `extra_logits_processor` shadows ``generate`` on the model instance that
    ``GRPOTrainer`` generates with (it calls ``unwrapped_model.generate(..., generation_config=...)`` and passes no
    processor) to add one: custom processors run after transformers' own and before its sampling warpers. Buys:
    rollouts sampled per row in data-parallel trials, the same however the batch is split (`rfopt.training.parallel`).
``attention_implementation``  `attention_implementation` reads a transformers config's ``_attn_implementation``
    (the attention the model was loaded with; transformers has no public getter): the batched decoder builds the
    attention mask that implementation takes (a boolean mask for ``sdpa``, an additive one for ``eager``).
``generation_defaults``  `generation_defaults` reads transformers' global generation defaults
    (``GenerationConfig._get_default_generation_params``: ``top_k=50``, ``num_beams=1``, ...), the values
    ``model.generate`` fills (in ``_prepare_generation_config``) where neither its caller nor the model's own
    ``generation_config`` set a field. Buys: the batched rollout backend samples with the settings ``generate`` would
    (`rfopt.training.rollouts.sampler.generation_settings`), and knows a setting it lacks from a default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._versions import check_version, require


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
    require(GenerationConfig, "_get_default_generation_params", "generation_defaults")
    return dict(GenerationConfig._get_default_generation_params())


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
