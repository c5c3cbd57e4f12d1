"""Eval samples as HTML: one trial's per chunk (its card's "Samples"), and the same eval prompt's completions across
trials after one chunk ("why it wins")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optuna

from rfopt.reports.charts import colour, trial_labels
from rfopt.storage.schema import TrialRecord

from .markup import _cut, _e, _num, _score


def render_samples(record: TrialRecord) -> str:
    """A trial's eval samples: a table per chunk, latest first, with the total and each reward function's score."""
    chunks = {m.unit: m for m in record.unit_metrics()}
    parts = []
    for i, (unit, samples) in enumerate(sorted(record.samples().items(), reverse=True)):
        scores = list(dict.fromkeys(k for s in samples for k in s if k not in ("prompt", "completion", "reward")))
        head = "".join(f"<th>{_e(k)}</th>" for k in ["#", "prompt", "completion", "reward (total)", *scores])
        rows = "".join(
            f"<tr><td>{j}</td><td><pre>{_e(s.get('prompt', ''))}</pre></td><td><pre>{_e(s.get('completion', ''))}</pre></td>"
            + "".join(f"<td class='score'>{_score(s.get(k))}</td>" for k in ["reward", *scores]) + "</tr>"
            for j, s in enumerate(samples)
        )
        metrics = chunks.get(unit)
        mean = f" · eval reward {_num(metrics.eval['reward'])}" if metrics and "reward" in metrics.eval else ""
        data_chunk = f" (data chunk {metrics.chunk + 1})" if metrics and metrics.chunk != unit else ""
        parts.append(
            f"<details class='unit' data-unit='{unit}'{' open' if i == 0 else ''}><summary>after chunk {unit + 1}"
            f"{data_chunk}{mean}</summary><table class='samples'><thead><tr>{head}</tr></thead>"
            f"<tbody>{rows}</tbody></table></details>"
        )
    return "".join(parts) or "<p class='hint'>no samples stored yet</p>"


def render_side_by_side(trials: Sequence[optuna.trial.FrozenTrial], direction: Any, unit: int | None = None,
                        url: str = "") -> str:
    """Each eval prompt of the trials' samples after one chunk (`unit`; by default the last chunk at least two
    trials have samples of), with every trial's completion of it and each reward's score, best total first: trials
    compared at the same chunk. A select shows one prompt at a time, another picks the chunk (`url` loads it)."""
    labels = trial_labels(trials)
    stored = {t.number: TrialRecord(t).samples() for t in trials}
    units = sorted({u for samples in stored.values() for u in samples})
    if not units:
        return "<p class='hint'>no samples stored yet</p>"
    if unit is None or unit not in units:
        shared = [u for u in units if sum(u in samples for samples in stored.values()) >= 2]
        unit = (shared or units)[-1]
    by_prompt: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for t in trials:
        for sample in stored[t.number].get(unit, []):
            by_prompt.setdefault(str(sample.get("prompt", "")), []).append((t.number, unit, sample))
    sign = -1 if direction is not None and direction.name == "MINIMIZE" else 1
    options = "".join(f"<option value='{i}'>prompt {i + 1}: {_e(_cut(p, 80))}</option>" for i, p in enumerate(by_prompt))
    chunks = "".join(f"<option value='{u}'{' selected' if u == unit else ''}>after chunk {u + 1} "
                     f"({sum(u in samples for samples in stored.values())} trials)</option>" for u in units)
    sections = []
    for i, (prompt, rows) in enumerate(by_prompt.items()):
        scores = list(dict.fromkeys(k for _, _, s in rows for k in s if k not in ("prompt", "completion", "reward")))
        head = "".join(f"<th>{_e(k)}</th>" for k in ["trial", "after chunk", "completion", "reward (total)", *scores])
        ordered = sorted(rows, key=lambda r: -sign * (r[2].get("reward") if isinstance(r[2].get("reward"), (int, float))
                                                       and math.isfinite(r[2]["reward"]) else -math.inf * sign))
        body = "".join(
            f"<tr data-trial='{n}'><td><span class='swatch' style='background:{colour(n)}'></span>{_e(labels[n])}</td>"
            f"<td>{u + 1}</td><td><pre>{_e(s.get('completion', ''))}</pre></td>"
            + "".join(f"<td class='score'>{_score(s.get(k))}</td>" for k in ["reward", *scores]) + "</tr>"
            for n, u, s in ordered)
        sections.append(f"<section class='prompt' data-prompt='{i}'{'' if i == 0 else ' hidden'}><pre class='prompt-text'>"
                        f"{_e(prompt)}</pre><table class='samples'><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
                        "</table></section>")
    return (f"<p data-unit='{unit}'><label>eval prompt <select class='prompt-picker'>{options}</select></label> "
            f"<label>trials compared <select class='chunk-picker' data-url='{_e(url)}'>{chunks}</select></label> "
            "<span class='hint'>every trial's completion after the same chunk</span></p>" + "".join(sections))
