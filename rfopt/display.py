"""What a person sees while a study runs: a progress bar over chunk units, and the leaderboard."""

from __future__ import annotations

import math
import sys
from typing import Any


class Progress:
    """A tqdm bar over the chunk units of a run, with live counts and the best value so far.

    It is handed each `rfopt.roster.Progress` the run reports (units done and in all, trial states, the best value,
    the last unit), and shows it; it keeps no count of its own.
    """

    def __init__(self, study_name: str, enabled: bool = True) -> None:
        self.study_name = study_name
        self.enabled = enabled
        self._bar: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=f"{self.study_name}", unit="chunk", file=sys.stderr, dynamic_ncols=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def __call__(self, progress: Any) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.total, bar.n = progress.total, progress.done
        if progress.last is not None:
            trial, unit, value = progress.last
            bar.set_description(f"{self.study_name} | trial {trial} chunk {unit}: {value:.4g}", refresh=False)
        short = {"RUNNING": "live", "COMPLETE": "done", "PRUNED": "pruned", "FAIL": "failed"}
        postfix = {short[k]: v for k, v in progress.counts.items() if k in short}
        if progress.best is not None and math.isfinite(progress.best):
            postfix["best"] = f"{progress.best:.4g}"
        bar.set_postfix(postfix, refresh=False)
        bar.refresh()


def format_leaderboard(rows: list[Any], objective: str = "reward") -> str:
    """The leaderboard as a text table: rank, trial, state, value, chunks, params, note."""
    if not rows:
        return "(no trials yet)"
    header = ["#", "trial", "state", objective, "chunks", "params", "note"]
    lines = []
    for rank, row in enumerate(rows, 1):
        value = "-" if row.value is None else f"{row.value:.4f}"
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(row.params.items()))
        note = row.reason or (row.adapter or "")
        held = row.held_as
        if held:  # said on the row itself: the Optuna param a reader would look for does not hold the trial's value
            note = "; ".join([f"! its {k} is the param {v} (not a choice of {k})" for k, v in sorted(held.items())]
                             + ([note] if note else []))
        lines.append([str(rank), str(row.number), row.state, value, str(row.chunks_done), params, note])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    widths[-1] = len(header[-1])
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
