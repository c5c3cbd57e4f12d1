"""The study's trials ranked, as HTML: the leaderboard (best first, sortable, with the baselines and the adapter to
take) and the leader against the runner-up, reward by reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna

from rfopt.config.form import reward_weighting
from rfopt.noise import gap
from rfopt.reports.lead import Lead
from rfopt.reports.results import StudyOutcome
from rfopt.reports.timeline import duration
from rfopt.storage.schema import TrialRecord

from .markup import _clock_time, _e, _num
from .views import TrialView


def _render_leaderboard(views: list[TrialView], best: int | None, label: str, direction: Any,
                        ahead: Lead | None = None, found: StudyOutcome | None = None) -> str:
    """Every trial in a table, best first (`views` come in that order); the page sorts it by any column. With the
    study's outcome (`found`): each value's difference from the baseline, each trial's best checkpoint and warnings
    (collapsed, degraded), the baselines as reference rows under the trials, and the adapter to take above them."""
    maximize = direction is not None and direction.name == "MAXIMIZE"
    first = "desc" if maximize else "asc"
    params = list(dict.fromkeys(k for v in views for k in v.params))
    rewards = sorted({k for v in views for k in v.eval if k.startswith("rewards/") and k.endswith("/mean")})
    baselines = list(found.baselines.values()) if found is not None else []
    compared = bool(baselines) or any(v.vs_base is not None for v in views)
    kept = any(v.best_value is not None for v in views)
    flagged = any(v.flags for v in views)
    heads = [("trial", "num", "asc"), ("state", "text", "asc"), ("value", "num", first)]
    heads += [("vs base", "num", first)] if compared else []
    heads += [("best checkpoint", "num", first)] if kept else []
    heads += [("after chunk", "num", "desc"), ("chunks trained", "num", "desc")]
    heads += [(p, "auto", "asc") for p in params]
    heads += [(f"eval {k[len('rewards/'):-len('/mean')]}", "num", "desc") for k in rewards]
    lineage = any(v.lineage for v in views)
    heads += [("lineage", "text", "asc")] if lineage else []
    heads += [("time", "num", "desc"), ("why it ended", "text", "asc")]
    heads += [("warnings", "text", "asc")] if flagged else []
    # A header may break after an underscore (soft_<wbr>format_<wbr>reward_<wbr>func), so that long reward names
    # do not widen the table past the window.
    head = "".join(f"<th data-kind='{kind}' data-first='{first}' title='sort by {_e(name)}'>"
                   f"{_e(name).replace('_', '_<wbr>')}</th>" for name, kind, first in heads)
    rows = []
    for v in views:
        star = f" <span class='best'>★ {label}</span>" if v.number == best else ""
        if v.number == best and ahead is not None and ahead.tie:
            star += f" <span class='tie' title='{_e(ahead.text())}'>tie with trial {ahead.runner_up}</span>"
        name = (f"<span class='name'><span class='swatch' style='background:{v.colour}'></span>trial {v.number}</span>"
                f"{star}")
        elapsed = v.ended - v.started if v.started is not None and v.ended is not None else None
        cells = [(v.number, name), (v.situation, _e(v.situation)), (v.value, _value_cell(v))]
        cells += [(v.vs_base, "-" if v.vs_base is None else f"{v.vs_base:+.4g}")] if compared else []
        cells += [(v.best_value, "-" if v.best_value is None or v.best_step is None else
                   f"{_num(v.best_value)} <span class='hint'>after chunk {v.best_step + 1}</span>")] if kept else []
        cells += [
            (None if v.value_step is None else v.value_step + 1, _num(None if v.value_step is None else v.value_step + 1)),
            (v.steps_done, f"{v.steps_done}" + (f"/{v.num_steps}" if v.num_steps else "")),
        ]
        cells += [_param_cell(v, p) for p in params]
        cells += [(v.eval.get(k), _num(v.eval.get(k))) for k in rewards]
        cells += [(v.lineage, _e(v.lineage))] if lineage else []
        if v.started is not None and v.ended is None and v.situation == "training":
            since = f"since {_clock_time(v.started)}"
            cells += [(v.started, f"<span class='clock' data-since='{v.started:.0f}' title='{since}'>{since}</span>")]
        elif elapsed is not None:
            cells += [(elapsed, f"<span title='from {_clock_time(v.started)} to {_clock_time(v.ended)}'>"
                                f"{duration(elapsed)}</span>")]
        else:
            cells += [(None, "")]
        cells += [(v.reason or "", _e(v.reason or ""))]
        cells += [("; ".join(v.flags), "".join(f"<span class='warn'>{_e(f)}</span> " for f in v.flags))] if flagged else []
        tds = "".join(f"<td data-sort='{_e('' if key is None else key)}'>{text}</td>" for key, text in cells)
        rows.append(f"<tr data-trial='{v.number}'>{tds}</tr>")
    # The baselines are reference rows under the trials (the page sorts the trials' rows only).
    purposes = found.baseline_purposes() if found is not None else {}
    references = "".join(
        f"<tr class='baseline' data-baseline='{_e(b.key)}'><td><b>base model</b></td><td>no adapter</td>"
        f"<td>{_num(b.value)}</td><td colspan='{len(heads) - 3}' class='hint'>{_e(b.model)}"
        + (f" ({_e(purposes[b.key])})" if b.key in purposes else "") + " evaluated before any trial "
        "trained, on the same eval set and settings: the reference every value here compares with</td></tr>"
        for b in baselines)
    said = "".join(f"<p class='recommendation'>{_e(line)}</p>" for line in (found.lines() if found else []))
    return (
        f"<section id='leaderboard'><h2>Leaderboard</h2>{said}"
        f"<div class='table-scroll'><table class='leaderboard'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody>" + (f"<tfoot>{references}</tfoot>" if references else "")
        + "</table></div></section>"
    )


def _render_versus(trials: Sequence[optuna.trial.FrozenTrial], ahead: Lead | None, objective: str) -> str:
    """The leader against the runner-up, reward by reward: each reward function's eval mean for both, its weight in
    the objective, and the weighted gap with its standard error (prompt by prompt), the total last; which reward the
    lead comes from."""
    if ahead is None:
        return ""
    by_number = {t.number: TrialRecord(t) for t in trials}
    best, other = by_number[ahead.best], by_number[ahead.runner_up]
    units = [_value_unit(best), _value_unit(other)]
    if best.config_json is None or None in units:
        return ""
    rows = []
    for name, weight in reward_weighting(best.config_json):
        a, b = (_unit_of(r, u) for r, u in zip((best, other), units))
        mean_a, mean_b = (m.eval.get(f"rewards/{name}/mean") if m else None for m in (a, b))
        if mean_a is None or mean_b is None:
            continue
        found = gap([weight * x for x in a.scores_of(name)], [weight * y for y in b.scores_of(name)])
        rows.append((name, weight, mean_a, mean_b, weight * (mean_a - mean_b), found))
    if not rows:
        return ""
    lead_from = max(rows, key=lambda r: r[4] if ahead.gap.difference >= 0 else -r[4])[0]
    cells = ""
    for name, weight, x, y, diff, found in rows:
        marked = " class='lead-from'" if name == lead_from and not ahead.tie else ""
        error = f" <span class='sem'>± {found.stderr:.2g}</span>" if found is not None and found.stderr is not None else ""
        noisy = " <span class='sem'>(within noise)</span>" if found is not None and found.within_noise else ""
        cells += (f"<tr{marked}><td>{_e(name)}</td><td>× {weight:g}</td><td>{_num(x)}</td><td>{_num(y)}</td>"
                  f"<td>{diff:+.3g}{error}{noisy}</td></tr>")
    error = f" <span class='sem'>± {ahead.gap.stderr:.2g}</span>" if ahead.gap.stderr is not None else ""
    total = (f"<tr class='total'><td>{_e(objective)} (the value)</td><td></td><td>{_num(best.value)}</td>"
             f"<td>{_num(other.value)}</td><td>{ahead.gap.difference:+.3g}{error}</td></tr>")
    chunks = (f"after chunk {units[0] + 1}" if units[0] == units[1]
              else f"trial {ahead.best} after chunk {units[0] + 1}, trial {ahead.runner_up} after chunk {units[1] + 1}")
    verdict = (f"<b class='tie'>a tie</b>: {_e(ahead.text())}" if ahead.tie else
               f"the lead comes mostly from <b>{_e(lead_from)}</b>: {_e(ahead.text())}")
    return (f"<h3>Trial {ahead.best} against the runner-up, trial {ahead.runner_up}</h3>"
            f"<table class='versus'><thead><tr><th>reward</th><th>weight</th><th>trial {ahead.best}</th>"
            f"<th>trial {ahead.runner_up}</th><th>weighted gap</th></tr></thead><tbody>{cells}{total}</tbody></table>"
            f"<p class='hint'>eval means {chunks}; {verdict}</p>")


def _value_unit(record: TrialRecord) -> int | None:
    values = record.trial.intermediate_values
    return max(values) if values else None


def _unit_of(record: TrialRecord, unit: int | None) -> Any:
    return next((m for m in record.unit_metrics() if m.unit == unit), None)


def _value_cell(v: TrialView) -> str:
    """The value, with its standard error and eval count beneath where its unit stored per-prompt scores."""
    if v.value is None:
        return "-"
    if v.eval_count is None:
        return _num(v.value)
    error = "" if v.value_error is None else f"± {v.value_error:.2g} "
    return (f"{_num(v.value)}<br><span class='sem' title='standard error of the mean over {v.eval_count} eval "
            f"prompts'>{error}(n={v.eval_count})</span>")


def _param_cell(v: TrialView, param: str) -> tuple[Any, str]:
    """A leaderboard cell: the trial's value of `param`; for a clone whose value Optuna holds under an alternate
    param (`rfopt.reports.leaderboard.held_as`), that value, marked, so that the column never reads as the parent's."""
    holder = v.held_as.get(param)
    if holder is not None:
        value = v.params[holder]
        why = (f"Optuna's param {param} cannot hold this clone's value (a categorical cannot gain a choice): it is the "
               f"param {holder}")
        return value, f"<span class='held' title='{_e(why)}'>{_e(_num(value))} ⚠</span>"
    return v.params.get(param), _e(_num(v.params[param])) if param in v.params else ""
