"""The study's reference: the base model evaluated as it is, with no adapter, on the same eval set, with the same
settings and reward functions as the trials that train on it.

Every value a study reports reads as "better" only beside what the untrained model scores. Trials that share a base
model, reward functions and weights and a completion budget share one baseline (`baseline_key`); a study that
searches over models has one per model. The engine evaluates each once per study (`rfopt.engine.outputs.baselines`).

    >>> key = baseline_key(config, EvalSettings())                                   # doctest: +SKIP
    >>> evaluate_baseline(pool, config, eval_dataset, EvalSettings()).metrics["reward"]  # doctest: +SKIP
    1.15625
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rfopt.config.settings import EvalSettings
from rfopt.config.trial import TrialConfig

from .evaluation import EvalResult, evaluate
from .models import ModelPool
from .rollouts import EXACT, Progress


def baseline_key(config: TrialConfig, settings: EvalSettings) -> str:
    """What a trial's baseline depends on, as a short hash: its base model (how it is loaded, its tokenizer), its reward
    functions and their weights, the evaluation's completion budget, and the chat template kwargs its prompts are rendered
    with."""
    stored = config.to_dict()
    budget = settings.max_new_tokens or config.args.max_completion_length
    what = [config.model_key, stored.get("reward_funcs"), config.args.reward_weights, budget]
    if config.args.chat_template_kwargs:  # its prompts are rendered otherwise (absent: the keys stored before stay)
        what.append(config.args.chat_template_kwargs)
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def model_label(config: TrialConfig) -> str:
    """The base model as a person names it: its Hub id or directory, ``smollm2``, or a factory's import path."""
    model = config.model
    if isinstance(model, str):
        return model
    return f"{getattr(model, '__module__', '?')}:{getattr(model, '__qualname__', repr(model))}"


def evaluate_baseline(pool: ModelPool, config: TrialConfig, eval_dataset: Any, settings: EvalSettings,
                      progress: Progress | None = None) -> EvalResult:
    """`config`'s base model, with no adapter, evaluated as its trials are (`rfopt.training.evaluation.evaluate`): the
    trial's reward functions and weights, its completion budget, its chat template kwargs, and a trainer state at step
    0; through the pool's exact backend on the base model (`ModelPool.backend`). `progress` hears how far its decoding
    has got (its prompts done)."""
    from transformers import TrainerState

    with pool.base_model(config) as model:
        return evaluate(model, pool.tokenizer(config), eval_dataset, list(config.reward_funcs),
                        config.args.reward_weights, settings, max_new_tokens=config.args.max_completion_length,
                        trainer_state=TrainerState(global_step=0, max_steps=0, epoch=0.0),
                        chat_template_kwargs=config.args.chat_template_kwargs,
                        backend=pool.backend(EXACT, None, config),  # in the precision its trials are evaluated in
                        progress=progress)
