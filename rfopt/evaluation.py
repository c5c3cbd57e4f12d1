"""Evaluating a trial after each chunk: fixed generation settings and seed, the trial's own reward functions.

The objective reported to Optuna is the mean weighted total reward on the eval set (``"reward"``),
or the mean of one reward function (its name). Evaluation forks the RNG, so it never changes what
training does next.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import RfoptError


class RewardFunctionError(RfoptError, RuntimeError):
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

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            problems.append(f"max_new_tokens={self.max_new_tokens!r}: give a whole number >= 1, or None for the "
                            "trial's max_completion_length")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r}: give a number >= 0 (0 decodes greedily)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r}: give a number in (0, 1]")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size!r}: give a whole number >= 1 (prompts generated at once)")
        if not _is_int(self.seed):
            problems.append(f"seed={self.seed!r}: give a whole number")
        if not _is_int(self.num_samples) or self.num_samples < 0:
            problems.append(f"num_samples={self.num_samples!r}: give a whole number >= 0 (completions kept)")
        if problems:
            raise ValueError("EvalSettings: " + "; ".join(problems))


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


@dataclass
class EvalPrompts:
    """An eval set as evaluation uses it: the prompts, the texts generation starts from, the other columns."""

    prompts: list[Any]
    texts: list[str]
    columns: dict[str, list[Any]]

    @classmethod
    def of(cls, dataset: Any, tokenizer: Any) -> EvalPrompts:
        prompts = list(dataset["prompt"])
        columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
        texts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if is_conversational(p)
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


def evaluate(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list,
    reward_weights: list[float] | None,
    settings: EvalSettings,
    max_new_tokens: int,
    trainer_state: Any = None,
) -> EvalResult:
    """Generate one completion per eval prompt and score it with the reward functions, called as TRL calls them
    (`trainer_state` is the trial's `transformers.TrainerState` at the evaluated step)."""
    import torch

    prompts = EvalPrompts.of(dataset, tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    completion_ids: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(settings.seed)
            texts = prompts.texts
            for start in range(0, len(texts), settings.batch_size):
                batch = tokenizer(
                    texts[start : start + settings.batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="left",  # as TRL pads prompts to generate, whatever the tokenizer's own side
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
                completion_ids.extend(_until_eos(row, eos_ids, tokenizer.pad_token_id) for row in new_tokens.tolist())
    finally:
        model.train(was_training)
    return scored(prompts, completion_ids, tokenizer, reward_funcs, reward_weights, settings, trainer_state)


def scored(
    prompts: EvalPrompts,
    completion_ids: list[list[int]],
    tokenizer: Any,
    reward_funcs: list,
    reward_weights: list[float] | None,
    settings: EvalSettings,
    trainer_state: Any = None,
) -> EvalResult:
    """The eval result of one completion per prompt: each reward function's scores, their weighted total, samples."""
    completions_text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    completions: list[Any] = [
        [{"role": "assistant", "content": text}] if is_conversational(p) else text
        for p, text in zip(prompts.prompts, completions_text)
    ]
    scores = score_completions(reward_funcs, prompts.prompts, completions, completion_ids, prompts.columns,
                               trainer_state)
    weights = reward_weights or [1.0] * len(reward_funcs)
    metrics: dict[str, float] = {}
    n = len(prompts.prompts)
    # A sample's total is the weighted sum of its non-NaN rewards, NaN when none is valid (then it is skipped).
    totals = [math.nan] * n
    for func, weight, values in zip(reward_funcs, weights, scores):
        metrics[f"rewards/{reward_name(func)}/mean"] = _nanmean(values)
        for i, v in enumerate(values):
            if not math.isnan(v):
                totals[i] = weight * v + (0.0 if math.isnan(totals[i]) else totals[i])
    metrics["reward"] = _nanmean(totals) if totals else math.nan
    metrics["completions/mean_length"] = sum(len(c) for c in completion_ids) / max(1, len(completion_ids))
    samples = [
        {"prompt": _prompt_text(prompts.prompts[i]), "completion": completions_text[i], "reward": totals[i]}
        | {reward_name(f): s[i] for f, s in zip(reward_funcs, scores)}
        for i in range(min(settings.num_samples, n))
    ]
    return EvalResult(metrics=metrics, samples=samples)


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


def checked_reward(func: Any) -> Callable[..., Any]:
    """`func` as TRL calls it, with what it returns checked: one finite number (or None) per completion. A reward
    function that raises, or returns anything else, raises `RewardFunctionError` naming it, what it gave and what is
    expected; so does one that calls ``sys.exit()`` (a bug in one trial's reward: that trial fails alone). The
    wrapper keeps the name TRL logs the rewards under (and is async when `func` is)."""
    name = reward_name(func)

    def check(values: Any, kwargs: dict[str, Any]) -> Any:
        return _checked_values(name, values, len(kwargs.get("completions") or ()))

    def failed(exc: BaseException, kwargs: dict[str, Any]) -> RewardFunctionError:
        if isinstance(exc, SystemExit):  # one config's bug, not a request to end the study: its trial fails alone
            return RewardFunctionError(
                f"reward function {name!r} called sys.exit({exc.code!r}) (raised SystemExit); a reward function must "
                "return its scores, not end the process: raise an exception (or return None for a completion it does "
                "not score) instead")
        hint = ""
        if isinstance(exc, KeyError) and exc.args and exc.args[0] not in kwargs:
            columns = sorted(k for k in kwargs if k not in TRL_REWARD_ARGUMENTS)
            hint = f" (the dataset has no column {exc.args[0]!r}; its columns: {columns})"
        return RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__}: {exc}{hint}")

    if is_async(func):
        async def checked(**kwargs: Any) -> Any:
            try:
                values = await func(**kwargs)
            except (Exception, SystemExit) as exc:  # named and re-raised; KeyboardInterrupt still ends the run
                raise failed(exc, kwargs) from exc
            return check(values, kwargs)
    else:
        def checked(**kwargs: Any) -> Any:
            try:
                values = func(**kwargs)
            except (Exception, SystemExit) as exc:  # named and re-raised; KeyboardInterrupt still ends the run
                raise failed(exc, kwargs) from exc
            return check(values, kwargs)

    checked.__name__ = checked.__qualname__ = name
    checked.__wrapped__ = func  # type: ignore[attr-defined]
    return checked


TRL_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                        "environments")
"""What TRL's trainer passes every reward function besides the dataset's columns."""


def reward_columns(func: Any) -> list[str]:
    """The dataset columns `func` declares as required parameters (read from its signature)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values()
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in TRL_REWARD_ARGUMENTS]


def reward_name(func: Any) -> str:
    """The name TRL logs a reward function's values under (``rewards/<name>/mean``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _checked_values(name: str, values: Any, expected: int) -> list[Any]:
    what = f"reward function {name!r}"
    rule = f"it must return a list of {expected} numbers, one per completion (None for a completion it does not score)"
    if values is None:
        raise RewardFunctionError(f"{what} returned None; {rule}")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not hasattr(values, "tolist"):
        raise RewardFunctionError(f"{what} returned {_shown(values)}; {rule}")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != expected:
        raise RewardFunctionError(f"{what} returned {len(values)} values for {expected} completions; {rule}")
    for i, value in enumerate(values):
        if value is None:
            continue
        if not _is_number(value):  # bools count, as in TRL
            raise RewardFunctionError(f"{what} returned {_shown(value)} for completion {i}; {rule}")
        if math.isinf(float(value)):
            raise RewardFunctionError(f"{what} returned {float(value)} for completion {i}; rewards must be finite "
                                      "(return None, or NaN, for a completion it does not score)")
    return values


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """TRL's ``log_extra`` / ``log_metric``: evaluation keeps no such logs."""


def _until_eos(ids: list[int], eos_ids: list[int], pad_id: int | None) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return [t for t in ids if t != pad_id] if pad_id not in eos_ids else ids


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _prompt_text(prompt: Any) -> str:
    if is_conversational(prompt):
        return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    return str(prompt)
