"""Charts that compare a study's trials: one Plotly figure per metric, every trial overlaid (rfopt's dashboard page),
the "why it wins" figures (each param against the value, param importances), and what every chart shares: each
trial's colour and series name, a param's axis scale. The parallel coordinates are `rfopt.reports.parallel`'s; which
trial leads, `rfopt.reports.lead`'s.

    >>> figures = comparison(study.trials, optuna.study.StudyDirection.MAXIMIZE).figures   # doctest: +SKIP
    >>> [f.key for f in figures]
    ['params', 'objective', 'reward', 'rewards/correctness/mean', 'reward_std', 'entropy', ...]

A figure is plain data in Plotly's JSON schema (``{"data": [...], "layout": {...}}``); the page draws it with the
plotly.js that the ``plotly`` package bundles, served by the dashboard itself (nothing is fetched from outside).

- ``params`` (section ``why``): each param against the value, one panel per param, one point per trial in its colour;
  a cross marks a pruned, stopped or failed trial, a star the best one.
- ``objective``: the value each trial reported to Optuna after each chunk (x: chunks trained, 1 to C), with each
  baseline (the base model with no adapter) as a dashed line (``meta.role == "baseline"``).
- ``eval:diversity/distinct``, ``eval:diversity/repeated_ngrams``, ``eval:completions/clipped_ratio``: how diverse each
  chunk's eval completions were (`rfopt.training.diversity`): a collapse shows as distinct completions falling to
  near 0.
- TRL's per-step metrics (`schema.TrialRecord.step_metrics`) on the global optimizer step, chunk boundaries marked
  (``chunk 2`` where the second chunk starts): the total reward, each reward function's mean, the reward's std, KL
  (only when some trial logged it: TRL logs none with ``beta=0``), entropy, completion length, clip ratio and loss;
  where the evaluation after a chunk measured the same metric, that value is a hollow marker at the chunk's last step.
  The steps of a chunk in training, published before it commits (`schema.TrialRecord.in_flight_steps`), continue the
  trial's line dashed (``meta.role == "in-flight"``). A metric no trial logged has no figure.

In every figure a trial has one colour (`colour`: distinct for any number of trials), its series are named by its
config (``t12 lr=0.05 T=1``: the params that differ between trials, `trial_labels`) with ``meta.role == "series"``,
and hovering shows the trial, its params and the value; the best trial (`best_trial`) is drawn thicker, named with a
star and marked with one (``meta.role == "best"``, no legend entry of its own); a pruned, stopped or failed trial's
series ends where it ended, with a cross whose hover gives the reason (``meta.role == "end"``). Every trace on the step
or chunk axis carries ``meta.t``: when each point happened (ms since the epoch; None where not recorded), so the page
can put the x axis on wall time (`rfopt.reports.timeline`).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from rfopt.storage.schema import TrialRecord

from .lead import best_trial, param_importance
from .timeline import step_times, value_times

# 24 colours, the first 10 Tableau's, each next one far from the others (no light tints of earlier ones); past 24,
# hues walk the golden angle, so trial N's colour stays distinct from its neighbours' in any study size.
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#e6ab02", "#1b9e77", "#a6761d", "#e7298a", "#66a61e", "#7570b3", "#b15928", "#0b5d1e", "#f781bf",
    "#843c39", "#3182bd", "#d95f02", "#000000",
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

# Short names for series labels (``t3 lr=0.05 r=8``); a param not listed keeps its name.
_SHORT_PARAMS = {
    "learning_rate": "lr", "temperature": "T", "lora_r": "r", "r": "r", "lora_alpha": "alpha",
    "lora_dropout": "dropout", "per_device_train_batch_size": "bs", "gradient_accumulation_steps": "ga",
    "num_generations": "G", "max_completion_length": "len", "weight_decay": "wd", "num_iterations": "iters",
    "lr_scheduler_type": "sched", "warmup_steps": "warmup", "max_grad_norm": "clip", "epsilon": "eps",
}


def colour(number: int) -> str:
    """The colour of trial `number` in every chart and in the leaderboard."""
    if number < len(_PALETTE):
        return _PALETTE[number]
    return f"hsl({(number * 137.508) % 360:.1f}, 70%, {40 + 12 * (number % 3)}%)"


def trial_labels(trials: Sequence[FrozenTrial]) -> dict[int, str]:
    """Each trial's series name: ``t12 lr=0.05 T=1``, its number and the params that differ between the trials (all
    of a lone trial's); just ``t12`` when the trials differ in no param."""
    names = list(dict.fromkeys(k for t in trials for k in t.params))
    varying = [k for k in names if len({repr(t.params.get(k)) for t in trials}) > 1 or len(trials) == 1]
    labels = {}
    for t in trials:
        parts = [f"{_SHORT_PARAMS.get(k, k)}={_short(t.params[k])}" for k in varying if k in t.params]
        labels[t.number] = " ".join([f"t{t.number}", *parts])
    return labels


@dataclass(frozen=True)
class Figure:
    """One chart: a Plotly figure (`data`, `layout`) of one metric."""

    key: str
    """The metric: ``objective`` or TRL's name (``rewards/correctness/mean``); or ``parallel``, ``params``."""
    title: str
    data: list[dict[str, Any]]
    layout: dict[str, Any]
    section: str = "charts"
    """Where the page shows it: ``why`` (next to the leaderboard) or ``charts`` (the metrics compared)."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "data": self.data, "layout": self.layout, "section": self.section}


@dataclass(frozen=True)
class Comparison:
    """A study's trials side by side: the best one and a figure per metric."""

    best: int | None
    """The best trial's number (`best_trial`); None while no trial can be called best."""
    best_label: str
    """``best`` (Optuna's best trial: among COMPLETE ones) or ``leading`` (no trial complete yet)."""
    figures: list[Figure] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)
    """Each trial's series name (`trial_labels`)."""


def _importance_figure(trials: Sequence[FrozenTrial], direction: StudyDirection | None,
                       objective: str = "reward") -> Figure | None:
    found = param_importance(trials, direction, objective)
    if found is None:
        return None
    names = list(found.importances)[::-1]  # the most important on top
    title = (f"param importance (Optuna's get_param_importances) over {found.trials} trials' values after chunk "
             f"{found.step + 1}")
    if (caution := found.caution()) is not None:
        title += f"<br>caution: {caution}"
    data = [{"type": "bar", "orientation": "h", "x": [found.importances[n] for n in names], "y": [_e(n) for n in names],
             "marker": {"color": "#5b7fa6"}, "hovertemplate": "%{y}: %{x:.2f}<extra></extra>",
             "meta": {"role": "importance", "step": found.step, "trials": found.trials,
                      "within_noise": found.within_noise}}]
    layout = {"title": {"text": _e(title).replace("&lt;br&gt;", "<br>"), "font": {"size": 13}, "x": 0.01},
              "height": 120 + 28 * len(names) + (20 if found.within_noise else 0),
              "margin": {"l": 140, "r": 10, "t": 60 if found.within_noise else 40, "b": 35}, "showlegend": False, "uirevision": "importance",
              "xaxis": {"title": {"text": "share of the value's variance"}, "range": [0, 1]},
              "paper_bgcolor": "white", "plot_bgcolor": "white"}
    return Figure("importance", title, data, layout, section="why")


def comparison(trials: Sequence[FrozenTrial], direction: StudyDirection | None, objective: str = "objective",
               baselines: Sequence[Any] = ()) -> Comparison:
    """The study's trials compared: the best one and every chart (`objective` names the objective's y axis;
    `baselines`, the study's `rfopt.storage.schema.Baseline` records, are drawn on the objective's chart)."""
    best, label = best_trial(trials, direction)
    labels = trial_labels(trials)
    lines = [_Trial.of(t, labels[t.number]) for t in trials]
    figures = [f for f in (_params_figure(lines, trials, best, objective), _importance_figure(trials, direction, objective))
               if f is not None]
    figures.append(_objective_figure(lines, best, label, objective, baselines))
    for key, title in _EVAL_METRICS:
        figure = _eval_figure(lines, best, label, key, title)
        if figure is not None:
            figures.append(figure)
    reward_keys = sorted({k for line in lines for row in line.steps + line.flight for k in row
                          if k.startswith("rewards/") and k.endswith("/mean")})
    keys = [("reward", "reward (total)")] + [(k, f"reward: {k[len('rewards/'):-len('/mean')]}") for k in reward_keys]
    keys += list(_STEP_METRICS[1:])
    for key, title in keys:
        figure = _step_figure(lines, best, label, key, title)
        if figure is not None:
            figures.append(figure)
    return Comparison(best=best, best_label=label, figures=figures, labels=labels)


# ---------------------------------------------------------------------- one trial's lines
@dataclass(frozen=True)
class _Trial:
    number: int
    state: str
    label: str
    """Its series name (`trial_labels`)."""
    hover: str
    """The trial's first hover lines (escaped): number, state, params."""
    ended: str | None
    """Why it ended early (pruned, stopped, failed), escaped; None otherwise."""
    values: dict[int, float]
    steps: list[dict[str, float]]
    flight: list[dict[str, float]]
    """The steps of its unit in training, published before the unit commits."""
    evals: dict[int, dict[str, float]]
    """Each unit's eval metrics, by unit."""
    times: dict[tuple[int, int], float]
    """When each step ended (seconds since the epoch), by (unit, step): `rfopt.reports.timeline.step_times`."""
    value_times: dict[int, float]
    """When each unit's value was known, by unit."""
    committed: int

    @classmethod
    def of(cls, trial: FrozenTrial, label: str) -> _Trial:
        record = TrialRecord(trial)
        state = record.shown_state
        params = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        hover = f"<b>trial {trial.number}</b> · {state}" + (f"<br>{_e(params)}" if params else "")
        ended = None
        if trial.state in (TrialState.PRUNED, TrialState.FAIL) or record.stop is not None:
            ended = _e(record.end_reason or trial.state.name.lower())
        return cls(trial.number, state, label, hover, ended, dict(sorted(trial.intermediate_values.items())),
                   record.step_metrics(), record.in_flight_steps(), {m.unit: m.eval for m in record.unit_metrics()},
                   step_times(record), value_times(record), record.committed)

    def unit_ends(self) -> dict[int, int]:
        """The last optimizer step of each unit trained."""
        ends: dict[int, int] = {}
        for row in self.steps:
            ends[int(row["unit"])] = max(ends.get(int(row["unit"]), 0), int(row["step"]))
        return ends

    def step_time(self, row: Mapping[str, float]) -> float | None:
        t = self.times.get((int(row["unit"]), int(row["step"])))
        return None if t is None else round(1000 * t)


def log_scale(values: Sequence[Any], dist: Any) -> bool:
    """Whether a param's axis is logarithmic: searched on a log scale, or (a list's params, whose ranges are
    linear) all positive and spanning two orders of magnitude."""
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not numbers or min(numbers) <= 0:
        return False
    if isinstance(dist, (FloatDistribution, IntDistribution)) and dist.log:
        return True
    return not isinstance(dist, CategoricalDistribution) and max(numbers) / min(numbers) >= 100


def _params_figure(lines: list[_Trial], trials: Sequence[FrozenTrial], best: int | None,
                   objective: str) -> Figure | None:
    """Each param against the value: one panel per param, one point per trial that has a value."""
    shown = [(line, t) for line, t in zip(lines, trials) if line.values]
    names = list(dict.fromkeys(k for _, t in shown for k in t.params))
    if not shown or not names:
        return None
    data: list[dict[str, Any]] = []
    layout: dict[str, Any] = {
        "title": {"text": f"each param against the value ({_e(objective)})", "font": {"size": 14}, "x": 0.01},
        "height": 340, "margin": {"l": 55, "r": 10, "t": 40, "b": 45}, "showlegend": False, "hovermode": "closest",
        "uirevision": "params", "paper_bgcolor": "white", "plot_bgcolor": "white",
        "yaxis": {"title": {"text": _e(objective)}, "zeroline": False},
    }
    gap = 0.04
    width = (1 - gap * (len(names) - 1)) / len(names)
    for i, name in enumerate(names):
        axis = "x" if i == 0 else f"x{i + 1}"
        key = "xaxis" if i == 0 else f"xaxis{i + 1}"
        dist = next((t.distributions[name] for _, t in shown if name in t.distributions), None)
        layout[key] = {"domain": [i * (width + gap), i * (width + gap) + width], "title": {"text": _e(name)},
                       "zeroline": False}
        points = [(line, t.params[name]) for line, t in shown if name in t.params]
        if log_scale([v for _, v in points], dist):
            layout[key]["type"] = "log"
        elif isinstance(dist, CategoricalDistribution):
            layout[key]["type"] = "category"
        data.append({
            "type": "scatter", "mode": "markers", "xaxis": axis, "yaxis": "y",
            "x": [v if isinstance(v, (int, float)) else str(v) for _, v in points],
            "y": [line.values[max(line.values)] for line, _ in points],
            "text": [line.label for line, _ in points],
            "marker": {"color": [colour(line.number) for line, _ in points], "size": [16 if line.number == best else 10
                                                                                       for line, _ in points],
                       "symbol": ["star" if line.number == best else "x" if line.ended else "circle"
                                  for line, _ in points],
                       "line": {"color": "#222", "width": 1}},
            "hovertemplate": f"%{{text}}<br>{_e(name)} %{{x}}<br>{_e(objective)} %{{y:.4g}}<extra></extra>",
            "meta": {"role": "param", "param": name, "trials": [line.number for line, _ in points]},
        })
    return Figure("params", "each param against the value", data, layout, section="why")


def _objective_figure(lines: list[_Trial], best: int | None, label: str, objective: str,
                      baselines: Sequence[Any] = ()) -> Figure:
    data: list[dict[str, Any]] = []
    most = 1
    for line in lines:
        if line.values:
            xs, ys = [u + 1 for u in line.values], list(line.values.values())
            times = [_ms(line.value_times.get(u)) for u in line.values]
            most = max(most, xs[-1])
            data += _traces(line, xs, ys, times, best, label, f"after chunk %{{x}}: {_e(objective)} %{{y:.4g}}")
    for baseline in baselines:  # the base model with no adapter: a dashed line across every chunk
        data.append({
            "type": "scatter", "mode": "lines", "x": [0.5, most + 0.5], "y": [baseline.value] * 2,
            "name": f"base model ({_e(baseline.model)}, no adapter)",
            "line": {"color": "#666", "width": 1.5, "dash": "dash"},
            "hovertemplate": f"base model {_e(baseline.model)} with no adapter: {_e(objective)} %{{y:.4g}}<extra></extra>",
            "meta": {"role": "baseline", "baseline": baseline.key},
        })
    layout = _layout("objective", f"objective: {objective} (after each chunk)", "chunks trained", objective)
    layout["xaxis"].update(_integer_ticks(1, most))
    return Figure("objective", f"objective: {objective}", data, layout)


_EVAL_METRICS = (
    ("diversity/distinct", "eval: distinct completions per prompt (1: each prompt its own; collapsed: near 0)"),
    ("diversity/repeated_ngrams", "eval: repeated 4-grams within a completion"),
    ("completions/clipped_ratio", "eval: completions cut at the length limit"),
)
"""Each chunk's evaluation measures of diversity, charted per chunk (`rfopt.training.diversity`)."""


def _eval_figure(lines: list[_Trial], best: int | None, label: str, key: str, title: str) -> Figure | None:
    """An eval metric of each chunk, per trial, on the chunk axis; None when no trial's evaluation measured it."""
    data: list[dict[str, Any]] = []
    most = 1
    for line in lines:
        units = [u for u in sorted(line.evals) if key in line.evals[u]]
        if units:
            xs, ys = [u + 1 for u in units], [line.evals[u][key] for u in units]
            most = max(most, xs[-1])
            data += _traces(line, xs, ys, [_ms(line.value_times.get(u)) for u in units], best, label,
                            f"after chunk %{{x}}: {_e(key)} %{{y:.3g}}")
    if not data:
        return None
    layout = _layout(f"eval:{key}", title, "chunks trained", key)
    layout["xaxis"].update(_integer_ticks(1, most))
    return Figure(f"eval:{key}", title, data, layout)


def _step_figure(lines: list[_Trial], best: int | None, label: str, key: str, title: str) -> Figure | None:
    data: list[dict[str, Any]] = []
    boundaries: dict[float, set[int]] = {}
    last = 1
    for line in lines:
        rows = [r for r in line.steps if key in r]
        flight = [r for r in line.flight if key in r]
        if not rows and not flight:
            continue
        point = f"step %{{x}}: {_e(key)} %{{y:.4g}}"
        if rows:
            data += _traces(line, [int(r["step"]) for r in rows], [r[key] for r in rows],
                            [line.step_time(r) for r in rows], best, label, point)
        if flight:  # the chunk in training: dashed from the last committed point until it commits
            joined = rows[-1:] + flight
            data.append({
                "type": "scatter", "mode": "lines+markers", "x": [int(r["step"]) for r in joined],
                "y": [r[key] for r in joined], "name": f"{line.label} (training)", "showlegend": False,
                "legendgroup": f"trial {line.number}",
                "line": {"color": colour(line.number), "width": 1.6, "dash": "dash"},
                "marker": {"color": colour(line.number), "size": 4},
                "hovertemplate": f"{line.hover}<br>{point} (chunk in training, not committed)<extra></extra>",
                "meta": {"trial": line.number, "role": "in-flight", "t": [line.step_time(r) for r in joined]},
            })
        last = max([last, *(int(r["step"]) for r in rows + flight)])
        ends = line.unit_ends()
        for unit in ends:
            if unit + 1 in ends or (flight and unit + 1 == int(flight[0]["unit"])):
                boundaries.setdefault(ends[unit] + 0.5, set()).add(unit + 1)
        evals = [(ends[u], m[key], line.value_times.get(u)) for u, m in sorted(line.evals.items())
                 if key in m and u in ends]
        if evals:
            data.append({
                "type": "scatter", "mode": "markers", "x": [x for x, _, _ in evals], "y": [y for _, y, _ in evals],
                "name": f"{line.label} eval", "showlegend": False, "legendgroup": f"trial {line.number}",
                "marker": {"color": colour(line.number), "symbol": "circle-open", "size": 9, "line": {"width": 2}},
                "hovertemplate": f"{line.hover}<br>eval after the chunk ending at step %{{x}}: %{{y:.4g}}<extra></extra>",
                "meta": {"trial": line.number, "role": "eval", "t": [_ms(t) for _, _, t in evals]},
            })
    if not data:
        return None
    layout = _layout(key, title, "optimizer step", key)
    layout["xaxis"].update(_integer_ticks(1, last))
    layout["shapes"] = [
        {"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
         "line": {"color": "#bbb", "width": 1, "dash": "dot"}}
        for x in sorted(boundaries)
    ]
    # A boundary is labelled with the chunk that starts there, counted from 1 (as everywhere rfopt writes text).
    layout["annotations"] = [
        {"x": x, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "showarrow": False,
         "text": f"chunk {min(units) + 1}", "font": {"size": 10, "color": "#888"}}
        for x, units in sorted(boundaries.items()) if len(units) == 1
    ]
    return Figure(key, title, data, layout)


def _traces(line: _Trial, xs: list[int], ys: list[float], times: list[float | None], best: int | None, label: str,
            point: str) -> list[dict]:
    """A trial's series, then a cross where it ended early and a star if it is the best trial."""
    is_best = line.number == best
    name = line.label + (f" ★ {label}" if is_best else "")
    traces = [{
        "type": "scatter", "mode": "lines+markers" if len(xs) < 30 else "lines", "x": xs, "y": ys, "name": name,
        "legendgroup": f"trial {line.number}",
        "line": {"color": colour(line.number), "width": 4 if is_best else 1.6},
        "marker": {"color": colour(line.number), "size": 5},
        "hovertemplate": f"{line.hover}<br>{point}<extra></extra>",
        "meta": {"trial": line.number, "role": "series", "state": line.state, "t": times},
    }]
    if line.ended is not None:
        traces.append({
            "type": "scatter", "mode": "markers", "x": [xs[-1]], "y": [ys[-1]], "name": f"{line.label} ended",
            "showlegend": False, "legendgroup": f"trial {line.number}",
            "marker": {"color": colour(line.number), "symbol": "x", "size": 11},
            "hovertemplate": f"{line.hover}<br>ended here: {line.ended}<extra></extra>",
            "meta": {"trial": line.number, "role": "end", "reason": line.ended, "t": times[-1:]},
        })
    if is_best:
        traces.append({
            "type": "scatter", "mode": "markers", "x": [xs[-1]], "y": [ys[-1]], "name": f"★ {label}: {line.label}",
            "showlegend": False, "legendgroup": f"trial {line.number}",
            "marker": {"color": colour(line.number), "symbol": "star", "size": 16, "line": {"color": "#222", "width": 1}},
            "hovertemplate": f"{line.hover}<br>{label} trial<br>{point}<extra></extra>",
            "meta": {"trial": line.number, "role": "best", "t": times[-1:]},
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


def _integer_ticks(first: int, last: int) -> dict[str, Any]:
    """Ticks on whole numbers only (a step or a chunk count): at most some 10 of them, 1, 2 or 5 times a power of ten
    apart."""
    span = max(1, last - first)
    step = 1
    while span / step > 10:
        step = step * 5 // 2 if str(step).startswith("2") else step * 2
    return {"tick0": first if step == 1 else 0, "dtick": step, "tickformat": "d"}


def _ms(t: float | None) -> float | None:
    return None if t is None else round(1000 * t)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _e(text: Any) -> str:
    # Plotly renders a subset of HTML in hover text and titles: params, reasons and names come from users.
    return html.escape(str(text), quote=False)
