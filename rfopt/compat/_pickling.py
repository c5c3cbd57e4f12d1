"""Instances stored as pickle stores them (Python's pickle protocol, read without pickling): a per-trial callback
or one of TRL's factory-made reward functions (an instance of a private TRL class), stored with a trial as JSON.

``plain_object_state``  `object_state` and `object_from_state` store an instance (a per-trial
    ``TrainerCallback``; a callable reward such as ``trl.rewards.get_soft_overlong_punishment(...)`` returns, an
    instance of a private TRL class) as pickle stores a plain object: its class, then its instance attributes,
    private ones included; restored with ``cls.__new__(cls)`` and the attributes put back. Buys: callbacks and TRL's
    factory-made rewards stored with a trial, as JSON.
"""

from __future__ import annotations

from typing import Any


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
