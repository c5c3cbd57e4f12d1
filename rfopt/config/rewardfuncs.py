"""A reward function as TRL's trainer calls it: the name its values are logged under, the dataset columns it takes, and
the call checked (`RewardFunctionError` names the function, what it gave and what is expected)."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from rfopt.errors import RewardFunctionError
from rfopt.values import reads_as_number, shown


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
        raise RewardFunctionError(f"{what} returned {shown(values)}; {rule}")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != expected:
        raise RewardFunctionError(f"{what} returned {len(values)} values for {expected} completions; {rule}")
    for i, value in enumerate(values):
        if value is None:
            continue
        if not reads_as_number(value):  # bools count, as in TRL
            raise RewardFunctionError(f"{what} returned {shown(value)} for completion {i}; {rule}")
        if math.isinf(float(value)):
            raise RewardFunctionError(f"{what} returned {float(value)} for completion {i}; rewards must be finite "
                                      "(return None, or NaN, for a completion it does not score)")
    return values


