"""Evaluating a trial after each chunk: fixed generation settings and seed, the trial's own reward functions.

The objective reported to Optuna is the mean weighted total reward on the eval set (``"reward"``),
or the mean of one reward function (its name). Evaluation forks the RNG, so it never changes what
training does next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class RewardFunctionError(RuntimeError):
    """A reward function that raised or returned something unusable, named with the fix."""


@dataclass(frozen=True)
class EvalSettings:
    """How each chunk's evaluation generates. Same for every trial of a study, so values compare."""

    max_new_tokens: int | None = None
    """Completion budget; default: the trial's ``max_completion_length``."""
    temperature: float = 0.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0
    num_samples: int = 4
    """Completions kept per evaluation (stored on the trial for inspection)."""


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)

    def objective(self, name: str) -> float:
        key = "reward" if name == "reward" else f"rewards/{name}/mean"
        if key not in self.metrics:
            known = ["reward"] + sorted(k.split("/")[1] for k in self.metrics if k.startswith("rewards/"))
            raise KeyError(f"objective {name!r} is not among the evaluated values {known}")
        return self.metrics[key]


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def evaluate(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list,
    reward_weights: list[float] | None,
    settings: EvalSettings,
    max_new_tokens: int,
) -> EvalResult:
    """Generate one completion per eval prompt and score it with the reward functions."""
    import torch

    prompts = list(dataset["prompt"])
    columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
    texts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if is_conversational(p) else p
        for p in prompts
    ]
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    device = next(model.parameters()).device
    completions_text: list[str] = []
    completion_ids: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(settings.seed)
            for start in range(0, len(texts), settings.batch_size):
                batch = tokenizer(
                    texts[start : start + settings.batch_size],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                ).to(device)
                sampling = settings.temperature > 0
                out = model.generate(
                    **batch,
                    max_new_tokens=settings.max_new_tokens or max_new_tokens,
                    do_sample=sampling,
                    temperature=settings.temperature if sampling else None,
                    top_p=settings.top_p if sampling else None,
                    top_k=None,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=eos_ids,
                )
                new_tokens = out[:, batch["input_ids"].shape[1] :]
                for row in new_tokens.tolist():
                    ids = _until_eos(row, eos_ids, tokenizer.pad_token_id)
                    completion_ids.append(ids)
                    completions_text.append(tokenizer.decode(ids, skip_special_tokens=True))
    finally:
        model.train(was_training)

    completions: list[Any] = [
        [{"role": "assistant", "content": text}] if is_conversational(p) else text
        for p, text in zip(prompts, completions_text)
    ]
    scores = score_completions(reward_funcs, prompts, completions, completion_ids, columns)
    weights = reward_weights or [1.0] * len(reward_funcs)
    metrics: dict[str, float] = {}
    # A sample's total is the weighted sum of its non-NaN rewards, NaN when none is valid (then it is skipped).
    totals = [math.nan] * len(prompts)
    for func, weight, values in zip(reward_funcs, weights, scores):
        metrics[f"rewards/{_name(func)}/mean"] = _nanmean(values)
        for i, v in enumerate(values):
            if not math.isnan(v):
                totals[i] = weight * v + (0.0 if math.isnan(totals[i]) else totals[i])
    metrics["reward"] = _nanmean(totals) if totals else math.nan
    metrics["completions/mean_length"] = sum(len(c) for c in completion_ids) / max(1, len(completion_ids))
    samples = [
        {"prompt": _prompt_text(prompts[i]), "completion": completions_text[i], "reward": totals[i]}
        | {_name(f): s[i] for f, s in zip(reward_funcs, scores)}
        for i in range(min(settings.num_samples, len(prompts)))
    ]
    return EvalResult(metrics=metrics, samples=samples)


def score_completions(
    reward_funcs: list, prompts: list, completions: list, completion_ids: list, columns: dict[str, list]
) -> list[list[float]]:
    """Call each reward function as TRL does; None becomes NaN. Raises `RewardFunctionError` on bad output."""
    scores = []
    for func in reward_funcs:
        name = _name(func)
        try:
            values = func(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=None,
                log_extra=lambda *a, **k: None,
                log_metric=lambda *a, **k: None,
                **columns,
            )
        except Exception as exc:
            raise RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} values"
            raise RewardFunctionError(f"reward function {name!r} returned {got} for {len(completions)} completions")
        try:
            scores.append([math.nan if v is None else float(v) for v in values])
        except (TypeError, ValueError) as exc:
            raise RewardFunctionError(f"reward function {name!r} returned a non-number: {exc}") from exc
    return scores


def _until_eos(ids: list[int], eos_ids: list[int], pad_id: int | None) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return [t for t in ids if t != pad_id] if pad_id not in eos_ids else ids


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _name(func: Any) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _prompt_text(prompt: Any) -> str:
    if is_conversational(prompt):
        return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    return str(prompt)
