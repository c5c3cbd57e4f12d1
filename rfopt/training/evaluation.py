"""Evaluating a trial after each chunk: fixed generation settings and seed, the trial's own reward functions.

The objective reported to Optuna is the mean weighted total reward on the eval set (``"reward"``),
or the mean of one reward function (its name). Evaluation forks the RNG, so it never changes what
training does next.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rfopt.config.rewardfuncs import checked_reward, is_async, reward_name
from rfopt.config.settings import EvalSettings

from .diversity import diversity
from .rollouts import EXACT, GenerationRequest, Progress, RolloutBackend, make_backend, request_sampling


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)
    """Each eval prompt's score, in eval-set order, by objective name: ``reward`` (the weighted total) and each reward
    function's name (NaN where it gave None). The means above are their means; stored with the unit, they give each
    value its standard error (`rfopt.noise`)."""

    def objective(self, name: str) -> float:
        key = "reward" if name == "reward" else f"rewards/{name}/mean"
        if key not in self.metrics:
            known = ["reward"] + sorted(k.split("/")[1] for k in self.metrics if k.startswith("rewards/"))
            raise KeyError(f"objective {name!r} is not among the evaluated values {known}")
        return self.metrics[key]


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


@dataclass
class EvalPrompts:
    """An eval set as evaluation uses it: the prompts, the texts generation starts from, the other columns."""

    prompts: list[Any]
    texts: list[str]
    columns: dict[str, list[Any]]

    @classmethod
    def of(cls, dataset: Any, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> EvalPrompts:
        """`chat_template_kwargs`: the trial's ``args.chat_template_kwargs`` (e.g. ``enable_thinking=False``), passed
        to the chat template as TRL passes them when it builds the training prompts."""
        prompts = list(dataset["prompt"])
        columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
        texts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False,
                                          **(chat_template_kwargs or {})) if is_conversational(p)
            else p
            for p in prompts
        ]
        return cls(prompts, texts, columns)

    def token_ids(self, tokenizer: Any) -> list[list[int]]:
        """Each text's token ids, as `evaluate` generates from them (no special tokens added)."""
        return [list(ids) for ids in tokenizer(self.texts, add_special_tokens=False)["input_ids"]]


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end an eval completion: the model's generation config's, and the tokenizer's EOS."""
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return eos_ids


@dataclass
class EvalMember:
    """What evaluating one trial needs besides the eval set: its adapter, its reward functions as its config names
    them, how long a completion may be, and TRL's trainer state at the evaluated step."""

    adapter: str | None
    reward_funcs: list
    reward_weights: list[float] | None
    max_new_tokens: int
    trainer_state: Any = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """What the trial's chat template is rendered with (its ``args.chat_template_kwargs``), as in its training."""

    def score(self, prompts: EvalPrompts, completion_ids: list[list[int]], tokenizer: Any,
              settings: EvalSettings) -> EvalResult:
        """This member's result from its completions of `prompts` (`scored`, with its reward functions)."""
        return scored(prompts, completion_ids, tokenizer, self.reward_funcs, self.reward_weights, settings,
                      self.trainer_state)


def evaluate_members(backend: RolloutBackend, model: Any, tokenizer: Any, members: list[EvalMember], dataset: Any,
                     settings: EvalSettings, progress: Progress | None = None) -> list[EvalResult | Exception]:
    """Generate one completion per eval prompt for each member through `backend` (the one they trained on: the unit's
    plan's, `rfopt.engine.planning.plan.UnitPlan.backend`; the batched backend decodes every member's batch of
    `settings.batch_size` prompts together) and score it with the member's reward functions, called as TRL calls them
    (`EvalMember.score`). A member whose decoding or scoring fails gets its exception; the others their results. Each
    member's conversational prompts are rendered with its `EvalMember.chat_template_kwargs`, as in its training.

    Greedy by default (`EvalSettings`); the generation settings are the model's generation config with evaluation's
    over it, as ``model.generate(**settings)`` merges them (a model whose config has a repetition penalty keeps it).
    `progress` hears how far the decoding has got (`rfopt.training.rollouts.Decoded`: each member's prompts done, in
    member order, and the tokens of the batch decoding now).
    """
    rendered: dict[str, tuple[EvalPrompts, list[list[int]]]] = {}  # by chat template kwargs: members mostly share
    eos = eos_token_ids(model, tokenizer)
    requests, prompts_of = [], []
    for member in members:
        key = repr(sorted(member.chat_template_kwargs.items()))
        if key not in rendered:
            prompts = EvalPrompts.of(dataset, tokenizer, member.chat_template_kwargs)
            rendered[key] = (prompts, prompts.token_ids(tokenizer))
        prompts, ids = rendered[key]
        prompts_of.append(prompts)
        kwargs = _generate_kwargs(tokenizer, settings, settings.max_new_tokens or member.max_new_tokens, eos)
        # merged over the model's generation config as generate merges them; None: decoded through generate
        sampling = request_sampling(model.generation_config, **kwargs)
        requests.append(GenerationRequest(member.adapter, ids, sampling, seed=settings.seed,
                                          batch_rows=settings.batch_size, generate_kwargs=kwargs))
    outcomes = backend.generate(requests, progress=progress)
    results: list[EvalResult | Exception] = []
    for member, prompts, outcome in zip(members, prompts_of, outcomes):
        if isinstance(outcome, Exception):
            results.append(outcome)
            continue
        try:
            results.append(member.score(prompts, outcome.token_ids, tokenizer, settings))
        except Exception as exc:  # noqa: BLE001 - this member's reward functions failed: it fails alone
            results.append(exc)
    return results


def evaluate_runners(backend: RolloutBackend, runners: Sequence[Any], dataset: Any, settings: EvalSettings,
                     progress: Progress | None = None) -> list[EvalResult | Exception]:
    """The evaluations of a unit's trained `runners` (`rfopt.training.runner.Runner`: a gang on one model, or a trial
    alone) through `backend`, the one they trained on (the unit's plan's): `evaluate_members` with each runner's
    `eval_member()`, on the first runner's model (its generation config) and tokenizer. Each one's `EvalResult`, or the
    exception that failed it alone. `progress` hears how far its decoding has got."""
    first = runners[0]
    return evaluate_members(backend, first.model, first.tokenizer, [runner.eval_member() for runner in runners],
                            dataset, settings, progress)


def evaluate(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list,
    reward_weights: list[float] | None,
    settings: EvalSettings,
    max_new_tokens: int,
    trainer_state: Any = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    backend: RolloutBackend | None = None,
    progress: Progress | None = None,
) -> EvalResult:
    """One model's evaluation (its active adapter, or none): `evaluate_members` through `backend`, the one the caller's
    plan or pool chose (`rfopt.training.models.ModelPool.backend`; a baseline's is the exact kind on its base model);
    None: the exact kind on `model` in its own precision (`rfopt.training.rollouts.make_backend`). `trainer_state` is
    the trial's `transformers.TrainerState` at the evaluated step; `chat_template_kwargs` its
    ``args.chat_template_kwargs``; `progress` hears how far it has got."""
    member = EvalMember(None, reward_funcs, reward_weights, max_new_tokens, trainer_state,
                        dict(chat_template_kwargs or {}))
    backend = backend if backend is not None else make_backend(EXACT, model)
    (result,) = evaluate_members(backend, model, tokenizer, [member], dataset, settings, progress)
    if isinstance(result, Exception):
        raise result
    return result


def _generate_kwargs(tokenizer: Any, settings: EvalSettings, max_new_tokens: int, eos: list[int]) -> dict[str, Any]:
    """What evaluation asks ``model.generate`` for (the exact backend calls it with these)."""
    sampling = settings.temperature > 0
    return dict(max_new_tokens=max_new_tokens, do_sample=sampling,
                temperature=settings.temperature if sampling else None, top_p=settings.top_p if sampling else None,
                top_k=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=list(eos))


def scored(
    prompts: EvalPrompts,
    completion_ids: list[list[int]],
    tokenizer: Any,
    reward_funcs: list,
    reward_weights: list[float] | None,
    settings: EvalSettings,
    trainer_state: Any = None,
) -> EvalResult:
    """The eval result of one completion per prompt: each reward function's scores, their weighted total, their spread
    (``reward_std``, ``rewards/<name>/std``: a value's noise is its std over ``sqrt(completions/count)``), the
    completions' diversity (`rfopt.training.diversity`), samples."""
    completions_text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    completions: list[Any] = [
        [{"role": "assistant", "content": text}] if is_conversational(p) else text
        for p, text in zip(prompts.prompts, completions_text)
    ]
    scores = score_completions(reward_funcs, prompts.prompts, completions, completion_ids, prompts.columns,
                               trainer_state)
    weights = reward_weights or [1.0] * len(reward_funcs)
    metrics: dict[str, float] = {"completions/count": float(len(completion_ids))}
    n = len(prompts.prompts)
    # A sample's total is the weighted sum of its non-NaN rewards, NaN when none is valid (then it is skipped).
    totals = [math.nan] * n
    for func, weight, values in zip(reward_funcs, weights, scores):
        metrics[f"rewards/{reward_name(func)}/mean"] = _nanmean(values)
        metrics[f"rewards/{reward_name(func)}/std"] = _nanstd(values)
        for i, v in enumerate(values):
            if not math.isnan(v):
                totals[i] = weight * v + (0.0 if math.isnan(totals[i]) else totals[i])
    metrics["reward"] = _nanmean(totals) if totals else math.nan
    metrics["reward_std"] = _nanstd(totals)
    metrics["completions/mean_length"] = sum(len(c) for c in completion_ids) / max(1, len(completion_ids))
    metrics |= diversity(prompts.texts, completions_text, completion_ids, set(tokenizer.all_special_ids))
    samples = [
        {"prompt": _prompt_text(prompts.prompts[i]), "completion": completions_text[i], "reward": totals[i]}
        | {reward_name(f): s[i] for f, s in zip(reward_funcs, scores)}
        for i in _sample_indices(totals, settings.num_samples)
    ]
    per_prompt = {"reward": totals} | {reward_name(f): values for f, values in zip(reward_funcs, scores)}
    return EvalResult(metrics=metrics, samples=samples,
                      scores={k: [_rounded(v) for v in values] for k, values in per_prompt.items()})


def score_completions(
    reward_funcs: list, prompts: list, completions: list, completion_ids: list, columns: dict[str, list],
    trainer_state: Any = None,
) -> list[list[float]]:
    """Call each reward function as TRL's trainer does; None becomes NaN. Raises `RewardFunctionError` on bad
    output, naming the function."""
    scores = []
    for func in reward_funcs:
        call = checked_reward(func)
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      trainer_state=trainer_state, log_extra=_ignore, log_metric=_ignore, **columns)
        values = asyncio.run(call(**kwargs)) if is_async(func) else call(**kwargs)
        scores.append([math.nan if v is None else float(v) for v in values])
    return scores


def _ignore(*args: Any, **kwargs: Any) -> None:
    """TRL's ``log_extra`` / ``log_metric``: evaluation keeps no such logs."""


def _rounded(value: float) -> float:
    """A score as stored: 6 significant digits are plenty for a standard error, and keep the record small."""
    return value if math.isnan(value) else float(f"{value:.6g}")


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _nanstd(values: list[float]) -> float:
    """The population standard deviation of the values that are not NaN (NaN when none is)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan
    mean = sum(kept) / len(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))


def _prompt_text(prompt: Any) -> str:
    if is_conversational(prompt):
        return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    return str(prompt)


def _sample_indices(totals: list[float], count: int) -> list[int]:
    """The prompts whose completions are kept as samples: the first `count`, the last of them swapped for the
    best-scoring prompt where none of them scores best (so that the samples show what a right answer looks like
    beside typical ones)."""
    kept = list(range(min(count, len(totals))))
    scored = [i for i, total in enumerate(totals) if not math.isnan(total)]
    if not kept or not scored:
        return kept
    best = max(scored, key=lambda i: (totals[i], -i))
    if all(math.isnan(totals[i]) or totals[i] < totals[best] for i in kept):
        kept[-1] = best
    return kept
