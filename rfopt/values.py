"""What kind a value is, as rfopt's checks ask it, and a wrong value as a message shows it: one home for each meaning.

- `is_int`: a whole number (``int``; not ``bool``).
- `is_number`: a real number (``int``, ``float``, numpy's; not ``bool``).
- `is_finite_number`: a real number that is neither infinite nor NaN (a param Optuna can hold in a range).
- `reads_as_number`: what ``float()`` reads and is not text: a reward function's score as TRL reads it (bools, numpy
  and torch scalars count).
- `shown`: a wrong value in a message: its type and a short repr (``int 5``, ``str 'MyCallback'``).

    >>> is_int(True), is_number(2.5), is_finite_number(float("nan")), reads_as_number(True), shown(5)
    (False, True, False, True, 'int 5')
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's floats and ints are Real


def is_finite_number(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def reads_as_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))


def shown(value: Any) -> str:
    """A wrong value as a message shows it: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
