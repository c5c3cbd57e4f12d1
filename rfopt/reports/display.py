"""What a person sees while a study runs: a progress bar over optimizer steps (or plain lines in a log), and the
leaderboard."""

from __future__ import annotations

import math
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any, TextIO


class ProgressBar:
    """What a run shows while it trains: a tqdm bar over the optimizer steps of its units, advancing at every step,
    with what trains now (trial, chunk c of C, step s of S), live counts and the best value so far; or, when its
    stream is not a terminal (a log file, CI), plain lines instead of ``\r`` updates: one when a chunk commits and one
    at most every `plain_seconds` while a chunk trains.

    It is handed each `rfopt.engine.roster.RunProgress` the run reports (units and steps committed, trial states, the best value,
    the last unit) and each step of a unit in flight (`rfopt.training.progress.UnitProgress`, via `step`); it keeps no count of
    its own but the steps of the units in flight.
    """

    def __init__(self, study_name: str, enabled: bool = True, stream: TextIO | None = None,
                 plain: bool | None = None, plain_seconds: float = 30.0) -> None:
        self.study_name = study_name
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.plain = plain if plain is not None else not _is_terminal(self.stream)
        self.plain_seconds = plain_seconds
        self._bar: Any = None
        self._run: Any = None
        self._flight: dict[int, Any] = {}
        self._last_line = -math.inf
        self._last_commit: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled and not self.plain:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=f"{self.study_name}", unit="step", file=self.stream, dynamic_ncols=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def __call__(self, progress: Any) -> None:
        """The run's progress after a round of the driver or a commit."""
        self._run = progress
        self._flight = {n: e for n, e in self._flight.items() if progress.committed.get(n, e.unit + 1) <= e.unit}
        if not self.enabled:
            return
        if self.plain:
            if progress.last is not None and progress.last != self._last_commit:
                self._last_commit = progress.last
                trial, unit, value = progress.last
                self._line(f"trial {trial} chunk {unit + 1} committed: {value:.4g} · {self._totals()}")
            return
        self._draw()

    def step(self, event: Any) -> None:
        """A unit in flight reached a step or a phase (`rfopt.training.progress.UnitProgress`)."""
        self._flight[event.trial] = event
        if not self.enabled:
            return
        if self.plain:
            now = time.monotonic()
            if event.phase == "training" and now - self._last_line >= self.plain_seconds:
                self._line(f"{self._now()} · {self._totals()}")
            return
        self._draw()

    # ------------------------------------------------------------------ showing it
    def _steps(self) -> tuple[int, int]:
        run = self._run
        flying = sum(e.step for e in self._flight.values())
        if run is None:
            return flying, 0
        return run.steps_done + flying, run.steps_total

    def _now(self) -> str:
        """What trains now: ``trial 3 chunk 2/4 step 5/8 (2.1 s/step)``, one per trial in flight."""
        parts = []
        for e in sorted(self._flight.values(), key=lambda e: e.trial):
            text = f"trial {e.trial} chunk {e.unit + 1}/{e.num_units} "
            text += {"loading": "loading", "evaluating": "evaluating"}.get(e.phase, f"step {e.step}/{e.steps}")
            if e.step_seconds is not None and e.phase == "training":
                text += f" ({e.step_seconds:.3g} s/step)"
            parts.append(text)
        return ", ".join(parts) or "between chunks"

    def _totals(self) -> str:
        run = self._run
        done, total = self._steps()
        text = f"{done}/{total} steps"
        if run is not None:
            text += f", {run.done}/{run.total} chunks"
            counts = ", ".join(f"{n} {_SHORT[k]}" for k, n in run.counts.items() if k in _SHORT)
            if counts:
                text += f" · {counts}"
            if run.best is not None and math.isfinite(run.best):
                text += f" · best {run.best:.4g}"
        return text

    def _line(self, text: str) -> None:
        self._last_line = time.monotonic()
        print(f"{self.study_name}: {text}", file=self.stream, flush=True)

    def _draw(self) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.n, bar.total = self._steps()
        bar.set_description(f"{self.study_name} | {self._now()}", refresh=False)
        run = self._run
        postfix: dict[str, Any] = {}
        if run is not None:
            postfix["chunks"] = f"{run.done}/{run.total}"
            postfix.update({_SHORT[k]: v for k, v in run.counts.items() if k in _SHORT})
            if run.best is not None and math.isfinite(run.best):
                postfix["best"] = f"{run.best:.4g}"
        bar.set_postfix(postfix, refresh=False)
        bar.refresh()


_SHORT = {"RUNNING": "live", "COMPLETE": "done", "PRUNED": "pruned", "FAIL": "failed"}


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_leaderboard(rows: list[Any], objective: str = "reward", baselines: Sequence[Any] = (),
                       lines: Sequence[str] = ()) -> str:
    """The leaderboard as a text table: rank, trial, state, value, its difference from the baseline, the best checkpoint
    (value and chunk), chunks, params, note (collapse, degradation, why it ended, its adapter); a reference row per
    `baselines` (`rfopt.storage.schema.Baseline`: the base model with no adapter) first, and `lines` (the
    recommendation: `rfopt.reports.outcome.StudyOutcome.lines`) under it."""
    if not rows:
        return "(no trials yet)"
    compared = bool(baselines) or any(getattr(row, "vs_base", None) is not None for row in rows)
    kept = any(getattr(row, "best_value", None) is not None for row in rows)
    header = ["#", "trial", "state", objective] + (["vs base"] if compared else []) + \
        (["best (chunk)"] if kept else []) + ["chunks", "params", "note"]
    table = []
    for baseline in baselines:
        table.append(["-", "base", "-", f"{baseline.value:.4f}"] + ([""] if compared else []) + ([""] if kept else [])
                     + ["-", "", f"{baseline.model} with no adapter: the baseline"])
    for rank, row in enumerate(rows, 1):
        value = "-" if row.value is None else f"{row.value:.4f}"
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(row.params.items()))
        said = list(getattr(row, "flags", ()))
        said.append(row.reason or (row.adapter or ""))
        held = row.held_as
        if held:  # said on the row itself: the Optuna param a reader would look for does not hold the trial's value
            said = [f"! its {k} is the param {v} (not a choice of {k})" for k, v in sorted(held.items())] + said
        cells = [str(rank), str(row.number), row.state, value]
        if compared:
            cells.append("-" if row.vs_base is None else f"{row.vs_base:+.4f}")
        if kept:
            cells.append("-" if row.best_value is None else f"{row.best_value:.4f} ({row.best_chunk})")
        table.append(cells + [str(row.chunks_done), params, "; ".join(text for text in said if text)])
    widths = [max(len(h), *(len(line[i]) for line in table)) for i, h in enumerate(header)]
    widths[-1] = len(header[-1])
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    return "\n".join(out + ([""] if lines else []) + list(lines))


def format_recommendation(found: Any, samples: Sequence[dict[str, Any]] = (), shown: int = 3) -> list[str]:
    """What a run's closing summary says of its answer (`found`: a `rfopt.reports.outcome.StudyOutcome`): the
    recommended adapter against the baseline, on the objective and on each reward function, and up to `shown` of
    `samples` (that checkpoint's eval completions), each line of a completion under the one before."""
    recommended = found.recommendation
    if recommended is None:
        return [line for line in found.lines() if line.startswith("no adapter")] or ["no adapter to take yet"]
    lines = [f"recommended adapter (PEFT format; trial {recommended.trial} after chunk {recommended.unit + 1}): "
             f"{recommended.location}"]
    baseline = recommended.baseline
    if baseline is not None:
        sign = 1 if found.maximize else -1
        gain = recommended.value - baseline.value
        verdict = "beats" if sign * gain > 0 else "does not beat"
        lines.append(f"it {verdict} the base model with no adapter on {found.objective}: {recommended.value:.4f} vs "
                     f"{baseline.value:.4f} ({gain:+.4f})")
        means = [(key[len("rewards/"):-len("/mean")], recommended.metrics[key], baseline.metrics[key])
                 for key in sorted(recommended.metrics) if key.startswith("rewards/") and key.endswith("/mean")
                 and key in baseline.metrics]
        if means:
            lines.append("eval means per reward function, recommended vs base: "
                         + ", ".join(f"{name} {ours:.3g} vs {theirs:.3g}" for name, ours, theirs in means))
    if samples:
        lines.append("sample completions of the recommended adapter on the eval set (reward: the weighted total, then "
                     "each reward function's score):")
        for sample in list(samples)[:shown]:
            lines.append(f"  prompt:     {textwrap.shorten(str(sample.get('prompt', '')), 100)}")
            text = str(sample.get("completion", "")).strip() or "(empty)"
            first, *rest = text.splitlines() or [""]
            lines.append(f"  completion: {first}")
            lines += [f"              {line}" for line in rest]
            lines.append(f"  reward:     {_scores(sample)}")
    return lines


def _scores(sample: dict[str, Any]) -> str:
    """``1 (correctness 0, soft_format 0.5, strict_format 0.5)``: a sample's total reward and each function's score,
    rounded."""
    def number(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)

    scores = [f"{k} {number(v)}" for k, v in sample.items() if k not in ("prompt", "completion", "reward")]
    return number(sample.get("reward")) + (f" ({', '.join(scores)})" if scores else "")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
