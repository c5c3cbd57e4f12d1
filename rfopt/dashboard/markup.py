"""What every rfopt page's HTML shares: the page around a body (its stylesheet, scripts and plotly.js) and the small
formatters of values in it (escaping, numbers, scores, times)."""

from __future__ import annotations

import html
import math
from typing import Any

from rfopt.reports.timeline import clock_time


def plotly_version() -> str:
    """The version of the plotly.js the page loads: the ``plotly`` package's bundled one (`rfopt.dashboard` serves
    it)."""
    import plotly

    return plotly.__version__


def _page(title: str, body: str, scripts: bool = False, refresh: int | None = None) -> str:
    """A whole page; `refresh`: seconds after which the browser loads it again (a page with no script of its own that
    shows something running)."""
    head = "<meta name='viewport' content='width=device-width'><link rel='stylesheet' href='/rfopt/static/rfopt.css'>"
    if refresh:
        head += f"<meta http-equiv='refresh' content='{int(refresh)}'>"
    if scripts:
        head += (f"<script src='/rfopt/static/plotly-{plotly_version()}.min.js' defer></script>"
                 "<script src='/rfopt/static/rfopt.js' defer></script>")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>{head}</head>"
        f"<body>{body}</body></html>"
    )


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _score(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "<span class='hint' title='the reward function gave None for it: skipped'>not scored</span>"
    return _e(_num(value))


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _clock_time(epoch: float, millis: bool = False) -> str:
    """The local time of day (with the date when not today), as the server's clock reads it."""
    return clock_time(epoch, millis)
