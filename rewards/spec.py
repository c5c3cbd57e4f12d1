"""How a reward function is named, stored as data, and rebuilt.

A reward is saved in a trial's config as an import path plus keyword arguments:

- a plain function: ``("rewards.answers:correctness", None)``; rebuilt by importing it;
- a factory's product: the factory's path and its arguments, kept on the product as
  ``rfopt_factory``, e.g. ``("rewards.length:soft_overlong_punishment",
  {"max_completion_length": 256, "soft_punish_cache": 64})``; rebuilt by calling the factory.

Factory products are instances of :class:`FactoryReward` subclasses, not closures, because TRL
pickles reward functions to send them to rollout worker processes and closures do not pickle.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any

RewardFunc = Callable[..., list[float | None]]
"""TRL's reward signature: ``f(prompts, completions, **columns) -> list[float | None]``."""


class FactoryReward:
    """Base of rewards built by a factory: named for TRL's metrics and rebuildable from ``rfopt_factory``.

    ``__name__`` is what TRL logs under (``rewards/<name>/mean``); ``rfopt_factory`` is the
    ``(import path, kwargs)`` pair that :func:`load_reward` turns back into an equal reward.
    """

    def __init__(self, name: str, factory: str, kwargs: Mapping[str, Any]) -> None:
        self.__name__ = name
        self.rfopt_factory: tuple[str, dict[str, Any]] = (factory, dict(kwargs))

    def __repr__(self) -> str:
        path, kwargs = self.rfopt_factory
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return f"<reward {self.__name__}: {path}({args})>"

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        raise NotImplementedError


def reward_spec(func: RewardFunc) -> tuple[str, dict[str, Any] | None]:
    """Return ``(import path, kwargs)`` from which :func:`load_reward` rebuilds ``func``.

    ``kwargs`` is None for a plain function (import it as is) and a dict for a factory product
    (call the factory with it). Raises ValueError for a function that cannot be imported back,
    such as a lambda or a function defined inside another.

    >>> from rewards import soft_overlong_punishment
    >>> reward_spec(soft_overlong_punishment(256, 64))
    ('rewards.length:soft_overlong_punishment', {'max_completion_length': 256, 'soft_punish_cache': 64})
    """
    factory = getattr(func, "rfopt_factory", None)
    if factory is not None:
        path, kwargs = factory
        return path, dict(kwargs)
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(
            f"reward function {func!r} cannot be rebuilt from an import path: define it at module level "
            f"in an importable module, or give it an 'rfopt_factory' = (path, kwargs) attribute"
        )
    return f"{module}:{qualname}", None


def load_reward(path: str, kwargs: Mapping[str, Any] | None = None) -> RewardFunc:
    """Import the object at ``path`` ("package.module:name"); call it with ``kwargs`` unless None.

    >>> load_reward("rewards.answers:correctness").__name__
    'correctness'
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward path {path!r} must look like 'package.module:name'")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target if kwargs is None else target(**kwargs)
