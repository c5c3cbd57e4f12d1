"""How a factory-made reward function is named and stored as data (rfopt.config.codec stores and rebuilds it).

A reward is saved in a trial's config as an import path plus keyword arguments:

- a plain function: ``("rfopt.rewards.answers:correctness", None)``; rebuilt by importing it;
- a factory's product: the factory's path and its arguments, kept on the product as
  ``rfopt_factory``, e.g. ``("rfopt.rewards.length:soft_overlong_punishment",
  {"max_completion_length": 256, "soft_punish_cache": 64})``; rebuilt by calling the factory.

Factory products are instances of :class:`FactoryReward` subclasses, not closures, because TRL
pickles reward functions to send them to rollout worker processes and closures do not pickle.
"""

from collections.abc import Callable, Mapping
from typing import Any

RewardFunc = Callable[..., list[float | None]]
"""TRL's reward signature: ``f(prompts, completions, **columns) -> list[float | None]``."""


class FactoryReward:
    """Base of rewards built by a factory: named for TRL's metrics and rebuildable from ``rfopt_factory``.

    ``__name__`` is what TRL logs under (``rewards/<name>/mean``); ``rfopt_factory`` is the
    ``(import path, kwargs)`` pair from which ``rfopt.config.codec.reward_from_json`` rebuilds an equal reward.
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
