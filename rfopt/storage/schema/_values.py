"""Values as rfopt's records store them in JSON attrs, and read back: NaN and infinities as text (`json_safe`),
finite numbers only, and TRL's per-step logs by column (`StepColumns`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def json_safe(data: Any) -> Any:
    """A copy that SQL storages can keep as JSON: NaN and infinities become strings."""
    if isinstance(data, Mapping):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    return data


_NOT_FINITE = {"nan", "inf", "-inf"}


def _sample(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A stored sample with its scores as numbers again (`json_safe` stored NaN and infinities as text)."""
    return {k: float(v) if k not in ("prompt", "completion") and isinstance(v, str) and v in _NOT_FINITE else v
            for k, v in sample.items()}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _numbers(data: Any) -> dict[str, float]:
    if not isinstance(data, Mapping):
        return {}
    return {str(k): float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _score_lists(data: Any) -> dict[str, list[float]]:
    """Stored per-prompt scores read back: lists of numbers by name, NaN where stored as text (`json_safe`)."""
    if not isinstance(data, Mapping):
        return {}
    out = {}
    for name, values in data.items():
        if isinstance(values, list):
            out[str(name)] = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                              else float(v) if v in _NOT_FINITE else math.nan for v in values]
    return out


class StepColumns:
    """TRL's logs of one unit's optimizer steps as they are stored: one trial *system* attr per unit, by column.

    ``{"step": [5, 6], "reward": [0.4, 0.5], "kl": [null, 0.01], ...}``: one list per metric, aligned with ``step``
    (the trainer's global step), ``null`` where a step did not log that metric. Why this layout:

    - per unit, not per step: a trial gets one attr per chunk it trains (as its ``rfopt:metrics:<unit>``), not
      hundreds; the unit's steps are written once, in the write that commits its metrics, and never rewritten;
    - by column: each metric name is spelled once per unit, not once per step (a third of the size of a list of
      dicts for 4 steps of ~25 metrics, less for longer chunks);
    - a system attr, as all of rfopt's records (see `rfopt.storage.schema`). `get_trials` still loads them: some
      20 numbers a step, which is small next to a chunk's samples;
    - not the artifact store: `TrialRecord` reads a trial from storage alone (the dashboard, ``rfopt status`` and
      another host may not reach the study's checkpoint location), and artifacts can only be added while the trial
      runs.
    """

    @staticmethod
    def encode(steps: list[Mapping[str, float]]) -> dict[str, list[float | None]]:
        keys = sorted({k for log in steps for k in log if k != "step"})
        columns: dict[str, list[float | None]] = {"step": [int(log["step"]) for log in steps]}
        for key in keys:
            columns[key] = [_finite(log.get(key)) for log in steps]
        return columns

    @staticmethod
    def decode(columns: Any) -> list[dict[str, float]]:
        if not isinstance(columns, Mapping) or not isinstance(columns.get("step"), list):
            return []
        rows: list[dict[str, float]] = [{"step": int(step)} for step in columns["step"]]
        for key, values in columns.items():
            if key == "step" or not isinstance(values, list):
                continue
            for row, value in zip(rows, values):
                if (number := _finite(value)) is not None:
                    row[str(key)] = number
        return rows
