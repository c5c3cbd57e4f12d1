"""Parallel coordinates as an SVG: one line per trial through its params, the chunks it trained and its value (the
dashboard's "why it wins" view)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from optuna.distributions import CategoricalDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt.storage.schema import TrialRecord

from .charts import _short, colour, log_scale, trial_labels
from .lead import best_trial


def parallel_svg(trials: Sequence[FrozenTrial], direction: StudyDirection | None, objective: str = "objective",
                 width: int = 640, height: int = 300, states: Mapping[int, str] | None = None) -> str:
    """Parallel coordinates as an SVG: one line per trial that has a value, through each param, the chunks it trained
    and its value, in the trial's colour (the same as in every chart and the leaderboard); a pruned, stopped or failed
    trial's line is dashed, the best drawn thicker and last. Params searched on a log scale (or spanning two orders of
    magnitude) get a log axis. Hovering a line names the trial, its params and its value (``<title>``). Drawn here,
    not by plotly.js, whose parallel coordinates need WebGL (and a Content-Security-Policy that allows ``eval``).
    `states`: what each trial is doing, by number, in the words every view uses (`rfopt.reports.status.situation`:
    ``interrupted`` rather than Optuna's RUNNING once no process runs the study); else its stored state."""
    shown = [t for t in trials if t.intermediate_values]
    if not shown:
        return ""
    labels = trial_labels(trials)
    names = list(dict.fromkeys(k for t in shown for k in t.params))
    values = [TrialRecord(t).value for t in shown]
    axes: list[tuple[str, list[float | None], list[tuple[float, str]]]] = []
    for name in names:
        dist = next((t.distributions[name] for t in shown if name in t.distributions), None)
        axes.append(_axis(name, [t.params.get(name) for t in shown], dist))
    axes.append(_axis("chunks trained", [TrialRecord(t).committed for t in shown], None))
    axes.append(_axis(objective, values, None))
    left, right, top, bottom = 40, 40, 28, 40
    span = (width - left - right) / max(1, len(axes) - 1)
    plot_h = height - top - bottom
    parts = [f'<svg class="parallel" width="100%" viewBox="0 0 {width} {height}" preserveAspectRatio="xMidYMid meet" '
             'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="10" role="img" '
             f'aria-label="parallel coordinates: params to {_attr(objective)}, one line per trial">']
    lo, hi = min(v for v in values if v is not None), max(v for v in values if v is not None)
    maximize = direction != StudyDirection.MINIMIZE
    best, _ = best_trial(trials, direction)
    order = sorted(range(len(shown)), key=lambda i: (shown[i].number == best, _goodness(values[i], lo, hi, maximize)))
    for i in order:
        trial = shown[i]
        points = []
        for a, (_, positions, _) in enumerate(axes):
            y = positions[i]
            points.append(f"{left + a * span:.1f},{top + (1 - y) * plot_h:.1f}" if y is not None else None)
        coords = " ".join(p for p in points if p is not None)
        ended = trial.state in (TrialState.PRUNED, TrialState.FAIL) or TrialRecord(trial).stop is not None
        state = TrialRecord(trial).shown_state
        said = (states or {}).get(trial.number) or state.lower()
        dash = ' stroke-dasharray="5 3"' if ended else ""
        parts.append(f'<polyline data-trial="{trial.number}" data-state="{state}" points="{coords}" fill="none" '
                     f'stroke="{colour(trial.number)}" stroke-width="{3 if trial.number == best else 1.6}" '
                     f'stroke-opacity="0.9"{dash}><title>{_attr(labels[trial.number])} · {_attr(said)} · '
                     f'{_attr(objective)} {_short(values[i])}</title></polyline>')
    for a, (name, _, ticks) in enumerate(axes):
        x = left + a * span
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#888"/>')
        anchor = "start" if a == 0 else "end" if a == len(axes) - 1 else "middle"
        parts.append(f'<text x="{x:.1f}" y="{top - 10}" text-anchor="{anchor}" font-weight="bold">{_attr(name)}</text>')
        for position, text in ticks:
            y = top + (1 - position) * plot_h
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 3:.1f}" fill="#444">{_attr(text)}</text>')
    parts.append(f'<text x="{left}" y="{height - 12}" fill="#666">one colour per trial, as in every chart · thick: '
                 f'the {"best" if best is not None else "leading"} trial · dashed: pruned, stopped or failed</text></svg>')
    return "".join(parts)


def _axis(name: str, raw: list[Any], dist: Any) -> tuple[str, list[float | None], list[tuple[float, str]]]:
    """An axis of the parallel coordinates: its label, each trial's position on it (0 bottom, 1 top; None: no value)
    and a few ticks. Categorical and text values are spaced evenly, log-scale params on a log scale."""
    present = [v for v in raw if v is not None]
    if not present:
        return name, [None] * len(raw), []
    if isinstance(dist, CategoricalDistribution) or any(not isinstance(v, (int, float)) for v in present):
        choices = list(dict.fromkeys(str(v) for v in present))
        where = {c: (i + 0.5) / len(choices) for i, c in enumerate(choices)}
        return name, [None if v is None else where[str(v)] for v in raw], [(where[c], c) for c in choices][:12]
    log = log_scale(present, dist)
    scale = (lambda v: math.log10(v)) if log else (lambda v: float(v))
    lo, hi = scale(min(present)), scale(max(present))
    width = hi - lo or 1.0

    def position(v: Any) -> float | None:
        return None if v is None else 0.5 if hi == lo else (scale(v) - lo) / width

    distinct = sorted(set(present))
    ticks = distinct if len(distinct) <= 6 else [distinct[0], distinct[len(distinct) // 2], distinct[-1]]
    return name, [position(v) for v in raw], [(position(v) or 0.0, _short(v)) for v in ticks]


def _goodness(value: float | None, lo: float, hi: float, maximize: bool) -> float:
    if value is None or hi == lo:
        return 1.0 if value is not None else 0.0
    good = (value - lo) / (hi - lo)
    return good if maximize else 1 - good


def _attr(value: Any) -> str:
    return html.escape(str(value), quote=True)
