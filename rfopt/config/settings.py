"""The settings every trial of a study shares, so that their values compare: how each chunk's evaluation generates
(`EvalSettings`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
