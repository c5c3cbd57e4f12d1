"""Charts that compare a study's trials: one Plotly figure per metric, every trial overlaid (rfopt's dashboard page).

    >>> figures = comparison(study.trials, optuna.study.StudyDirection.MAXIMIZE).figures   # doctest: +SKIP
    >>> [f.key for f in figures]
    ['objective', 'reward', 'rewards/correctness/mean', 'reward_std', 'entropy', 'completions/mean_length', ...]

A figure is plain data in Plotly's JSON schema (``{"data": [...], "layout": {...}}``); the page draws it with the
plotly.js that the ``plotly`` package bundles, served by the dashboard itself (nothing is fetched from outside).

- ``objective``: the value each trial reported to Optuna after each chunk (x: the chunk, Optuna's step).
- TRL's per-step metrics (`schema.TrialRecord.step_metrics`) on the global optimizer step, chunk boundaries marked:
  the total reward, each reward function's mean, the reward's std, KL (only when some trial logged it: TRL logs none
  with ``beta=0``), entropy, completion length, clip ratio and loss; where the evaluation after a chunk measured the
  same metric, that value is a hollow marker at the chunk's last step. A metric no trial logged has no figure.

In every figure a trial has one colour (`colour`), its series are named ``trial N`` (``meta.role == "series"``) and
hovering shows the trial, its params and the value; the best trial (`best_trial`) is drawn thicker and marked with a
star (``meta.role == "best"``); a pruned, stopped or failed trial's series ends where it ended, with a cross whose
hover gives the reason (``meta.role == "end"``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from .schema import TrialRecord, UnitMetrics

# Twenty distinct colours (Tableau 10 and its light tints, reordered so neighbours differ): trial N gets N mod 20.
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)

# TRL's per-step keys charted, in order, with their titles; rewards/<func>/mean are added after "reward".
_STEP_METRICS = (
    ("reward", "reward (total)"),
    ("reward_std", "reward std"),
    ("kl", "KL"),
    ("entropy", "entropy"),
    ("completions/mean_length", "completion length (tokens)"),
    ("clip_ratio/region_mean", "clip ratio"),
    ("loss", "loss"),
)


def colour(number: int) -> str:
    """The colour of trial `number` in every chart and in the leaderboard."""
    return _PALETTE[number % len(_PALETTE)]


@dataclass(frozen=True)
class Figure:
    """One chart: a Plotly figure (`data`, `layout`) of one metric."""

    key: str
    """The metric: ``objective`` or TRL's name (``rewards/correctness/mean``)."""
    title: str
    data: list[dict[str, Any]]
    layout: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "data": self.data, "layout": self.layout}


@dataclass(frozen=True)
class Comparison:
    """A study's trials side by side: the best one and a figure per metric."""

    best: int | None
    """The best trial's number (`best_trial`); None while no trial can be called best."""
    best_label: str
    """``best`` (Optuna's best trial: among COMPLETE ones) or ``leading`` (no trial complete yet)."""
    figures: list[Figure] = field(default_factory=list)


def best_trial(trials: Sequence[FrozenTrial], direction: StudyDirection | None) -> tuple[int | None, str]:
    """The trial to mark as best and how to call it: Optuna's best trial (the best value among COMPLETE trials) when
    there is one, else ``leading``: the best last reported value among trials still running. None for a
    multi-objective study (`direction` None) or when no trial has a value."""
    if direction is None:
        return None, ""
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    complete = [(t.values[0], t.number) for t in trials if t.state == TrialState.COMPLETE and t.values]
    if complete:
        return max(complete, key=lambda vn: (sign * vn[0], -vn[1]))[1], "best"
    running = [(v, t.number) for t in trials if t.state == TrialState.RUNNING
               and (v := TrialRecord(t).last_value) is not None]
    if running:
        return max(running, key=lambda vn: (sign * vn[0], -vn[1]))[1], "leading"
    return None, ""


def comparison(trials: Sequence[FrozenTrial], direction: StudyDirection | None, objective: str = "objective") -> Comparison:
    """The study's trials compared: the best one and every chart (`objective` names the objective's y axis)."""
    best, label = best_trial(trials, direction)
    lines = [_Trial.of(t) for t in trials]
    figures = [_objective_figure(lines, best, label, objective)]
    reward_keys = sorted({k for line in lines for row in line.steps for k in row
                          if k.startswith("rewards/") and k.endswith("/mean")})
    keys = [("reward", "reward (total)")] + [(k, f"reward: {k[len('rewards/'):-len('/mean')]}") for k in reward_keys]
    keys += list(_STEP_METRICS[1:])
    for key, title in keys:
        figure = _step_figure(lines, best, label, key, title)
        if figure is not None:
            figures.append(figure)
    return Comparison(best=best, best_label=label, figures=figures)


# ---------------------------------------------------------------------- one trial's lines
@dataclass(frozen=True)
class _Trial:
    number: int
    state: str
    hover: str
    """The trial's first hover lines (escaped): number, state, params."""
    ended: str | None
    """Why it ended early (pruned, stopped, failed), escaped; None otherwise."""
    values: dict[int, float]
    steps: list[dict[str, float]]
    evals: dict[int, dict[str, float]]
    """Each unit's eval metrics, by unit."""

    @classmethod
    def of(cls, trial: FrozenTrial) -> _Trial:
        record = TrialRecord(trial)
        state = record.shown_state
        params = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        hover = f"<b>trial {trial.number}</b> · {state}" + (f"<br>{_e(params)}" if params else "")
        ended = None
        if trial.state in (TrialState.PRUNED, TrialState.FAIL) or record.stop is not None:
            ended = _e(record.end_reason or trial.state.name.lower())
        return cls(trial.number, state, hover, ended, dict(sorted(trial.intermediate_values.items())),
                   record.step_metrics(), {m.unit: m.eval for m in record.unit_metrics()})

    def unit_ends(self) -> dict[int, int]:
        """The last optimizer step of each unit trained."""
        ends: dict[int, int] = {}
        for row in self.steps:
            ends[int(row["unit"])] = max(ends.get(int(row["unit"]), 0), int(row["step"]))
        return ends


def _objective_figure(lines: list[_Trial], best: int | None, label: str, objective: str) -> Figure:
    data: list[dict[str, Any]] = []
    for line in lines:
        if line.values:
            xs, ys = list(line.values), list(line.values.values())
            data += _traces(line, xs, ys, best, label, f"chunk %{{x}}: {_e(objective)} %{{y:.4g}}")
    layout = _layout("objective", f"objective: {objective} (after each chunk)", "chunk", objective)
    layout["xaxis"]["dtick"] = 1
    return Figure("objective", f"objective: {objective}", data, layout)


def _step_figure(lines: list[_Trial], best: int | None, label: str, key: str, title: str) -> Figure | None:
    data: list[dict[str, Any]] = []
    boundaries: dict[float, set[int]] = {}
    for line in lines:
        rows = [r for r in line.steps if key in r]
        if not rows:
            continue
        data += _traces(line, [int(r["step"]) for r in rows], [r[key] for r in rows], best, label,
                        f"step %{{x}}: {_e(key)} %{{y:.4g}}")
        ends = line.unit_ends()
        for unit in ends:
            if unit + 1 in ends:
                boundaries.setdefault(ends[unit] + 0.5, set()).add(unit + 1)
        evals = [(ends[u], m[key]) for u, m in sorted(line.evals.items()) if key in m and u in ends]
        if evals:
            data.append({
                "type": "scatter", "mode": "markers", "x": [x for x, _ in evals], "y": [y for _, y in evals],
                "name": f"trial {line.number} eval", "showlegend": False, "legendgroup": f"trial {line.number}",
                "marker": {"color": colour(line.number), "symbol": "circle-open", "size": 9, "line": {"width": 2}},
                "hovertemplate": f"{line.hover}<br>eval after the chunk ending at step %{{x}}: %{{y:.4g}}<extra></extra>",
                "meta": {"trial": line.number, "role": "eval"},
            })
    if not data:
        return None
    layout = _layout(key, title, "optimizer step", key)
    layout["shapes"] = [
        {"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
         "line": {"color": "#bbb", "width": 1, "dash": "dot"}}
        for x in sorted(boundaries)
    ]
    layout["annotations"] = [
        {"x": x, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "showarrow": False,
         "text": f"chunk {min(units)}" if len(units) == 1 else "", "font": {"size": 10, "color": "#888"}}
        for x, units in sorted(boundaries.items()) if len(units) == 1
    ]
    return Figure(key, title, data, layout)


def _traces(line: _Trial, xs: list[int], ys: list[float], best: int | None, label: str, point: str) -> list[dict]:
    """A trial's series, then a cross where it ended early and a star if it is the best trial."""
    is_best = line.number == best
    name = f"trial {line.number}" + (f" ★ {label}" if is_best else "")
    traces = [{
        "type": "scatter", "mode": "lines+markers" if len(xs) < 30 else "lines", "x": xs, "y": ys, "name": name,
        "legendgroup": f"trial {line.number}",
        "line": {"color": colour(line.number), "width": 4 if is_best else 1.6},
        "marker": {"color": colour(line.number), "size": 5},
        "hovertemplate": f"{line.hover}<br>{point}<extra></extra>",
        "meta": {"trial": line.number, "role": "series", "state": line.state},
    }]
    if line.ended is not None:
        traces.append({
            "type": "scatter", "mode": "markers", "x": [xs[-1]], "y": [ys[-1]], "name": f"trial {line.number} ended",
            "showlegend": False, "legendgroup": f"trial {line.number}",
            "marker": {"color": colour(line.number), "symbol": "x", "size": 11},
            "hovertemplate": f"{line.hover}<br>ended here: {line.ended}<extra></extra>",
            "meta": {"trial": line.number, "role": "end", "reason": line.ended},
        })
    if is_best:
        traces.append({
            "type": "scatter", "mode": "markers", "x": [xs[-1]], "y": [ys[-1]], "name": f"★ {label}: trial {line.number}",
            "legendgroup": f"trial {line.number}",
            "marker": {"color": colour(line.number), "symbol": "star", "size": 16, "line": {"color": "#222", "width": 1}},
            "hovertemplate": f"{line.hover}<br>{label} trial<br>{point}<extra></extra>",
            "meta": {"trial": line.number, "role": "best"},
        })
    return traces


def _layout(key: str, title: str, x_title: str, y_title: str) -> dict[str, Any]:
    return {
        "title": {"text": _e(title), "font": {"size": 14}, "x": 0.01},
        "height": 320, "margin": {"l": 55, "r": 10, "t": 40, "b": 40},
        "xaxis": {"title": {"text": x_title}, "zeroline": False},
        "yaxis": {"title": {"text": _e(y_title)}, "zeroline": False},
        "hovermode": "closest", "showlegend": True, "legend": {"font": {"size": 11}},
        "uirevision": key,  # a refresh keeps the user's zoom and hidden trials
        "paper_bgcolor": "white", "plot_bgcolor": "white",
    }


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _e(text: Any) -> str:
    # Plotly renders a subset of HTML in hover text and titles: params, reasons and names come from users.
    return html.escape(str(text), quote=False)


# ---------------------------------------------------------------------- one trial's charts as SVG: the ``rfopt-metrics.svg`` artifact
_LEGEND_TOP = 162  # baseline of a chart's first legend row, below the x axis and its label
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class Chart:
    """One small line chart: a value per chunk unit for each named series."""

    title: str
    series: dict[str, list[tuple[int, float]]]

    @property
    def num_points(self) -> int:
        return sum(len(points) for points in self.series.values())


def charts(chunks: list[UnitMetrics]) -> list[Chart]:
    """The charts shown for a trial: eval reward, train reward (total and per reward function), KL, entropy, length."""

    def series(source: str, keys: Iterable[tuple[str, str]]) -> dict[str, list[tuple[int, float]]]:
        out: dict[str, list[tuple[int, float]]] = {}
        for label, key in keys:
            points = [(c.unit, getattr(c, source)[key]) for c in chunks if key in getattr(c, source)]
            if points:
                out[label] = points
        return out

    def rewards(source: str) -> list[tuple[str, str]]:
        names = sorted({k for c in chunks for k in getattr(c, source) if k.startswith("rewards/") and k.endswith("/mean")})
        return [("total", "reward")] + [(k[len("rewards/"):-len("/mean")], k) for k in names]

    length = series("train", [("train", "completions/mean_length")])
    length |= series("eval", [("eval", "completions/mean_length")])
    return [
        Chart("eval reward", series("eval", rewards("eval"))),
        Chart("train reward", series("train", rewards("train"))),
        Chart("KL", series("train", [("kl", "kl")])),
        Chart("entropy", series("train", [("entropy", "entropy")])),
        Chart("completion length", length),
    ]


def chart_svg(chart: Chart, width: int = 270, x: int | None = None, y: int | None = None) -> str:
    """An SVG line chart with one line and one marker (hover: its value) per chunk unit and series."""
    left, right, top, bottom = 46, 10, 22, 26
    legend = _legend_rows(list(chart.series), width - left)
    height = _chart_height(chart, width)
    plot_w, plot_h = width - left - right, 150 - top - bottom
    position = "" if x is None else f' x="{x}" y="{y}"'
    parts = [
        (f'<svg class="rfopt-chart" data-title="{_attr(chart.title)}" data-points="{chart.num_points}"{position} '
         f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" '
         'font-family="sans-serif" font-size="10">'),
        f'<text x="{left}" y="13" font-size="12" font-weight="bold">{_attr(chart.title)}</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>',
    ]
    points = [p for ps in chart.series.values() for p in ps]
    if not points:
        parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" fill="#999">not logged</text>')
        parts.append("</svg>")
        return "".join(parts)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad

    def px(u: float) -> float:
        return left + (plot_w / 2 if x0 == x1 else (u - x0) / (x1 - x0) * plot_w)

    def py(v: float) -> float:
        return top + plot_h - (v - y0) / (y1 - y0) * plot_h

    ticks = (y0, (y0 + y1) / 2, y1)
    for v, label in zip(ticks, _tick_labels(ticks)):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 4}" y="{py(v) + 3:.1f}" text-anchor="end" fill="#555">{label}</text>')
    for u in sorted({x0, x1}):
        parts.append(f'<text x="{px(u):.1f}" y="{top + plot_h + 12}" text-anchor="middle" fill="#555">{u}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 23}" text-anchor="middle" fill="#888">step (chunk unit)</text>')
    for i, (label, series) in reversed(list(enumerate(chart.series.items()))):  # the first (the total) on top
        color = _COLORS[i % len(_COLORS)]
        coords = " ".join(f"{px(u):.1f},{py(v):.1f}" for u, v in series)
        parts.append(f'<polyline data-series="{_attr(label)}" points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for u, v in series:
            parts.append(
                f'<circle cx="{px(u):.1f}" cy="{py(v):.1f}" r="2.5" fill="{color}">'
                f"<title>{_attr(label)}, step {u}: {v:.6g}</title></circle>"
            )
    for row, labels in enumerate(legend):
        lx = left
        for label in labels:
            color = _COLORS[list(chart.series).index(label) % len(_COLORS)]
            ly = _LEGEND_TOP + 14 * row
            parts.append(f'<rect x="{lx}" y="{ly - 8}" width="8" height="8" fill="{color}"/>')
            parts.append(f'<text x="{lx + 11}" y="{ly}">{_attr(label)}</text>')
            lx += _label_width(label)
    parts.append("</svg>")
    return "".join(parts)


def charts_svg(chunks: list[UnitMetrics], title: str) -> str:
    """All of a trial's charts in one standalone SVG document (the ``rfopt-metrics.svg`` artifact)."""
    width, gap, columns = 270, 10, 2  # two columns: legible as optuna-dashboard's artifact thumbnail
    shown = charts(chunks)
    row_h = max(_chart_height(chart, width) for chart in shown) + gap
    rendered = [
        chart_svg(chart, width, x=(i % columns) * (width + gap), y=24 + (i // columns) * row_h)
        for i, chart in enumerate(shown)
    ]
    total_w = columns * (width + gap) - gap
    total_h = 24 + math.ceil(len(shown) / columns) * row_h
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        f'viewBox="0 0 {total_w} {total_h}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="4" y="16" font-size="13" font-weight="bold">{_attr(title)}</text>{"".join(rendered)}</svg>'
    )


def _chart_height(chart: Chart, width: int) -> int:
    rows = len(_legend_rows(list(chart.series), width - 46))
    return _LEGEND_TOP - 10 + 14 * rows + (4 if rows else 0)


def _tick_labels(values: tuple[float, ...]) -> list[str]:
    """The fewest significant digits that tell the ticks apart."""
    for digits in range(3, 9):
        labels = [f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _label_width(label: str) -> int:
    return 16 + 6 * len(label)


def _legend_rows(labels: list[str], width: int) -> list[list[str]]:
    if len(labels) <= 1:
        return []  # one series: the title says what it is
    rows: list[list[str]] = [[]]
    used = 0
    for label in labels:
        if rows[-1] and used + _label_width(label) > width:
            rows.append([])
            used = 0
        rows[-1].append(label)
        used += _label_width(label)
    return rows


def _attr(value: Any) -> str:
    return html.escape(str(value), quote=True)
