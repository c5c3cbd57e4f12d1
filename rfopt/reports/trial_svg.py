"""One trial's charts as a small SVG: the ``rfopt-metrics.svg`` artifact published after each unit (eval reward, train
reward in total and per reward function, KL, entropy, completion length, one point per chunk), which
optuna-dashboard shows with the trial's other artifacts (`rfopt.engine.outputs.artifacts`).

    >>> svg = charts_svg(TrialRecord(trial).unit_metrics(), title="trial 3")   # doctest: +SKIP
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rfopt.storage.schema import UnitMetrics

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
    """The charts shown for a trial: eval reward, train reward (total and per reward function), KL, entropy, length, and
    the diversity of its eval completions (distinct per prompt, repeated 4-grams, cut at the limit: a collapse shows)."""

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
        Chart("eval diversity", series("eval", [("distinct", "diversity/distinct"),
                                                ("repeated 4-grams", "diversity/repeated_ngrams"),
                                                ("clipped", "completions/clipped_ratio")])),
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
