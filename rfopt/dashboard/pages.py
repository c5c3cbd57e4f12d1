"""The HTML of rfopt's dashboard pages (`rfopt.dashboard.routes` serves them; the trials they show are
`rfopt.dashboard.views`).

- `render_index`: every study of the storage with its trials by state, its best value, and whether a process runs it.
- `study_page`: one study as the page shows it, in parts the page refreshes one by one (`StudyPage`): who runs it,
  what trains now (trial, chunk c of C, step s of S, since when, ETAs) and the compute spent against a run without
  pruning, warnings (trials whose objectives weigh rewards differently), the leaderboard (best first, with lineage and
  times), the "why it wins" views and the charts (`rfopt.reports.charts`), and each trial's card (controls, times, samples), in
  leaderboard order. `StudyPage.version` fingerprints the stored data the page shows
  (`rfopt.dashboard.views.data_version`): the page asks again with it (an ETag) and gets "not modified" while nothing
  changed.
- `render_samples` (a trial's eval samples per chunk) and `render_side_by_side` (the same eval prompt's completions
  across trials, with each reward's score).

Chunks are counted from 1 for people ("after chunk 1" is Optuna's step 0). Times that move (how long a chunk has
trained, when it should end) are sent as timestamps (``data-since``, ``data-until``) that the page's script turns into
"for 1m12s" and "in ~45s": the HTML changes only when the stored data does.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from rfopt.compat import study_id_of
from rfopt.noise import gap
from rfopt.config.form import reward_weighting
from rfopt.reports.outcome import StudyOutcome, outcome
from rfopt.reports.status import Liveness, StudySummary, tally
from rfopt.reports.charts import colour, comparison, trial_labels
from rfopt.reports.lead import Lead, lead
from rfopt.reports.parallel import parallel_svg
from rfopt.reports.forecast import Forecast, forecast
from rfopt.reports.timeline import NowTraining, StudyCost, clock_time, duration, now_training, study_cost
from rfopt.storage.schema import RunShape, TrialRecord, json_safe, study_record

from .views import TrialView, trial_views

REFRESH_SECONDS = 5


# ---------------------------------------------------------------------- the study page
@dataclass
class StudyPage:
    """A study's page in the parts the page's script refreshes one at a time."""

    study_id: int
    title: str
    version: str
    """A fingerprint of the stored data shown (`data_version`): unchanged data, unchanged version."""
    running: bool
    """A process runs the study (its page refreshes every few seconds; else it stops until something changes)."""
    parts: dict[str, str]
    """``facts``, ``liveness``, ``now``, ``warnings``, ``leaderboard``, ``why`` (the parallel coordinates), ``versus``
    (the leader against the runner-up, reward by reward): HTML, each replaced whole when it changes."""
    cards: list[tuple[int, str]]
    """Each trial's card (HTML), in leaderboard order."""
    figures: list[dict[str, Any]]
    steerable: bool

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "running": self.running, "refresh": REFRESH_SECONDS if self.running else None,
                "parts": self.parts, "cards": [{"trial": n, "html": h} for n, h in self.cards],
                "figures": self.figures}


def study_page(study: optuna.Study, trials: list[optuna.trial.FrozenTrial], live: Liveness,
               version: str) -> StudyPage:
    """The study page's parts (see the module's docstring)."""
    sid = study_id_of(study)
    record = study_record(study)
    direction = study.directions[0] if len(study.directions) == 1 else None
    objective = record.settings.get("objective", "objective")
    found = outcome(study, trials)
    compared = comparison(trials, direction, objective, list(found.baselines.values()))
    views = trial_views(trials, study, live, found)
    ahead = lead(trials, direction, objective)
    records = [TrialRecord(t) for t in trials]
    steerable = record.plan is not None
    parts = {
        "facts": _render_facts(study, record, views, objective, direction),
        "liveness": _render_liveness(live, sid, steerable),
        "now": _render_now(records, live, record.run_shape),
        "warnings": _render_warnings(records, objective),
        "leaderboard": _render_leaderboard(views, compared.best, compared.best_label, direction, ahead, found),
        "why": parallel_svg(trials, direction, objective),
        "versus": _render_versus(trials, ahead, objective),
    }
    cards = [(v.number, _render_trial(sid, v, steerable)) for v in views]
    figures = [json_safe(f.to_json()) for f in compared.figures]
    return StudyPage(sid, study.study_name, version, live.running, parts, cards, figures, steerable)


def render_study(page: StudyPage) -> str:
    """The whole study page: its parts, with the data to draw its charts and to refresh it."""
    sid = page.study_id
    figures = json.dumps(page.figures).replace("</", "<\\/")
    boot = json.dumps({"version": page.version, "running": page.running,
                       "refresh": REFRESH_SECONDS if page.running else None}).replace("</", "<\\/")
    stop = ("<button type='button' id='halt' class='op stop' data-op='halt' "
            f"data-url='/rfopt/api/studies/{sid}/halt'>Stop the study…</button>" if page.steerable else "")
    header = (
        f"<h1>{_e(page.title)}</h1><div id='facts'>{page.parts['facts']}</div>"
        "<p class='bar'><label><input type='checkbox' id='autorefresh' checked> refresh while a process runs it</label>"
        f"<span id='refreshed'></span><span id='status' role='status'></span>{stop}</p>"
    )
    charts = (
        "<section id='comparison'><h2>Trials compared</h2>"
        "<p class='hint'>One colour per trial in every chart, each series named by its trial and the params that "
        "differ; ★ marks the best trial, × where a trial was pruned, stopped or failed (hover: why). Per-step charts: "
        "TRL's logs on the global optimizer step, dotted lines where a chunk starts, hollow circles the evaluation "
        "after each chunk, dashed the steps of a chunk still training (not committed). Click a legend entry to hide "
        "a trial.</p>"
        "<p class='axis'>x axis: <label><input type='radio' name='xaxis' value='step' checked> optimizer step / "
        "chunk</label> <label><input type='radio' name='xaxis' value='time'> wall time</label></p>"
        "<div class='charts' data-section='charts'></div></section>"
    )
    why = (
        "<section id='why'><h2>Why it wins</h2><div class='why' data-section='why'>"
        f"<div id='parallel' class='parallel-box'>{page.parts['why']}</div></div>"
        f"<div id='versus'>{page.parts['versus']}</div>"
        f"<details id='side-by-side' data-url='/rfopt/studies/{sid}/compare'><summary>The same eval prompt, every "
        "trial's completion, each reward's score</summary><div class='side-body'>loading…</div></details></section>"
    )
    cards = "".join(html_ for _, html_ in page.cards) or "<p>No trials yet.</p>"
    body = (
        f"{header}<div id='live' data-study='{sid}'>"
        f"<div id='liveness-part'>{page.parts['liveness']}</div><section id='now'>{page.parts['now']}</section>"
        f"<div id='warnings'>{page.parts['warnings']}</div>"
        f"<div class='board-row'><div id='board'>{page.parts['leaderboard']}</div></div>{why}{charts}"
        "<h2>Trials</h2><p class='hint'>In leaderboard order. Ops apply at the trial's next chunk boundary, in the "
        f"process running the study.</p><main id='trials'>{cards}</main></div>"
        f"<script type='application/json' id='rfopt-figures'>{figures}</script>"
        f"<script type='application/json' id='rfopt-page'>{boot}</script>"
    )
    return _page(f"{page.title} · rfopt", body, scripts=True)


def _render_facts(study: Any, record: Any, views: list[TrialView], objective: str, direction: Any) -> str:
    sid = study_id_of(study)
    plan = record.plan
    counts: dict[str, int] = {}
    for v in views:
        counts[v.situation] = counts.get(v.situation, 0) + 1
    shown = tally(counts) if counts else "none yet"
    facts = [
        f"objective: {_e(objective)} ({direction.name.lower() if direction else 'multi-objective'})",
        f"{plan.num_chunks} chunks of {plan.num_rows} rows" if plan else "not an rfopt study: no controls",
    ]
    return (f"<p class='facts'>{' · '.join(facts)} · trials: {shown} · "
            f"<a href='/dashboard/studies/{sid}'>open in optuna-dashboard</a> · <a href='/rfopt'>all studies</a></p>")


def _render_liveness(live: Liveness, study_id: int, steerable: bool) -> str:
    notice_class = "running" if live.running else "idle warn" if live.waiting_unattended else "idle"
    return (f"<p id='liveness' class='notice {notice_class}' data-running='{str(live.running).lower()}'>"
            f"{_e(live.message)}</p>")


def _render_now(records: list[TrialRecord], live: Liveness, shape: RunShape | None) -> str:
    """What trains now, one line per trial in flight (with its silence: slow or stuck), the study's forecast, and the
    compute pruning saved."""
    processes = max(1, len(live.holders))
    flights = now_training(records, processes) if live.running else []
    cost = study_cost(records, processes=processes)
    lines = "".join(_now_line(n) for n in flights)
    if live.running and not flights:
        lines = "<li class='between'>between chunks (choosing, loading or committing one)</li>"
    head = "<h2>Now training</h2>" if flights else ""
    eta = _eta_line(forecast(records, shape, processes), flights) if live.running else ""
    body = f"{head}<ul class='now'>{lines}</ul>{eta}{_cost_line(cost)}"
    return body if (lines or cost.units_without_pruning) else ""


def _now_line(now: NowTraining) -> str:
    p = now.progress
    if p.phase == "loading":
        what = "loading (swapping the trial in)"
    elif p.phase == "evaluating":
        what = f"evaluating after its {p.steps} steps"
    else:
        what = f"{p.step} of {p.steps} steps done"
    parts = [f"<b>trial {now.trial}</b> <span class='swatch' style='background:{colour(now.trial)}'></span>",
             f"chunk {p.unit + 1} of {p.num_units}", what,
             f"<span class='clock' data-since='{p.started:.0f}'>since {_clock_time(p.started)}</span>"]
    if p.step_seconds is not None and p.phase == "training":
        parts.append(f"{p.step_seconds:.3g} s/step")
    if now.chunk_end_at is not None:
        parts.append(f"chunk ends <span class='clock' data-until='{now.chunk_end_at:.0f}'>"
                     f"by {_clock_time(now.chunk_end_at)}</span>")
    if now.trial_end_at is not None and p.unit + 1 < p.num_units:
        parts.append(f"its last chunk, if it is kept, done <span class='clock' data-until='{now.trial_end_at:.0f}'>"
                     f"by {_clock_time(now.trial_end_at)}</span>")
    if len(p.gang) > 1:
        parts.append(f"trained together with trials {', '.join(str(n) for n in p.gang if n != now.trial)}")
    silence = now.silence
    quiet = ""
    stuck = ""
    if silence is not None:
        noun = {"step": "no step", "evaluation": "evaluating", "loading": "loading"}[silence.what]
        quiet = (f" data-moved='{silence.since:.1f}' data-stuck-at='{silence.stuck_at:.1f}' data-quiet='{noun}' "
                 f"data-usual='{_e(silence.usual_text())}'")
        if now.stuck():
            stuck = " stuck"
    text = silence.text() + ": stuck or very slow; ETAs on hold" if stuck and silence is not None else ""
    return (f"<li class='flight{stuck}' data-trial='{now.trial}' data-unit='{p.unit}' data-step='{p.step}' "
            f"data-phase='{p.phase}'{quiet}>{' · '.join(parts)} <span class='silence'>{_e(text)}</span></li>")


def _eta_line(ahead: Forecast, flights: list[NowTraining]) -> str:
    """The study's forecast (`rfopt.reports.forecast`): when it ends, as its pruner's schedule lets the trials go on,
    with a range where that is an expectation."""
    if ahead.units_left <= 0:
        return ""
    if ahead.end_at is None:
        return (f"<p id='eta' class='eta'>study: {ahead.units_left:.3g} chunk units left ({_e(ahead.schedule)}); "
                "no unit's time measured yet</p>")
    ends = (f"ends <span class='clock' data-until='{ahead.end_at:.0f}'>by {_clock_time(ahead.end_at)}</span>")
    if ahead.ranged and ahead.end_at_max is not None:
        ends += (f", <span class='clock' data-until='{ahead.end_at_max:.0f}'>by {_clock_time(ahead.end_at_max)}"
                 "</span> at the latest (if nothing more is pruned)")
    stuck = " on-hold" if any(n.stuck() for n in flights) else ""
    return (f"<p id='eta' class='eta{stuck}' data-end='{ahead.end_at:.0f}' data-anchor='{ahead.anchor:.0f}' "
            f"data-units='{ahead.units_left:.3g}' title='from the records written up to {_clock_time(ahead.anchor)}'>study "
            f"{ends} · {ahead.units_left:.3g} chunk units left of {ahead.trials} live trial"
            f"{'s' if ahead.trials != 1 else ''} ({_e(ahead.schedule)})</p>")


def _cost_line(cost: StudyCost) -> str:
    if not cost.units_without_pruning:
        return ""
    return f"<p id='cost' class='hint'>{_e(cost.line())}</p>"


def _render_warnings(records: list[TrialRecord], objective: str) -> str:
    """Trials whose objectives weigh their rewards differently: their values do not compare."""
    if objective != "reward":
        return ""
    groups: dict[tuple, list[int]] = {}
    for record in records:
        if record.config_json is None or record.cancelled is not None:
            continue
        groups.setdefault(reward_weighting(record.config_json), []).append(record.number)
    if len(groups) < 2:
        return ""
    items = "".join(
        f"<li>trials {', '.join(map(str, numbers))}: "
        + (", ".join(f"{_e(name)} × {weight:g}" for name, weight in weighting) or "no reward functions") + "</li>"
        for weighting, numbers in sorted(groups.items(), key=lambda kv: kv[1]))
    return ("<div class='notice warn' id='weights-warning'>These trials' objectives weigh their reward functions "
            "differently, so their values (the weighted total reward) do not compare across groups: compare them on "
            f"one reward's eval column, or clone with the same reward_weights.<ul>{items}</ul></div>")


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
    references = "".join(
        f"<tr class='baseline' data-baseline='{_e(b.key)}'><td><b>base model</b></td><td>no adapter</td>"
        f"<td>{_num(b.value)}</td><td colspan='{len(heads) - 3}' class='hint'>{_e(b.model)} evaluated before any trial "
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


def _by_gang(gangs: dict[int, tuple[int, ...]]) -> list[tuple[tuple[int, ...], list[int]]]:
    """The units a trial trained with each set of partners, in the order it first trained with them."""
    grouped: dict[tuple[int, ...], list[int]] = {}
    for unit, members in sorted(gangs.items()):
        grouped.setdefault(tuple(sorted(members)), []).append(unit)
    return list(grouped.items())


def _param_cell(v: TrialView, param: str) -> tuple[Any, str]:
    """A leaderboard cell: the trial's value of `param`; for a clone whose value Optuna holds under an alternate
    param (`rfopt.engine.clones.held_as`), that value, marked, so that the column never reads as the parent's."""
    holder = v.held_as.get(param)
    if holder is not None:
        value = v.params[holder]
        why = (f"Optuna's param {param} cannot hold this clone's value (a categorical cannot gain a choice): it is the "
               f"param {holder}")
        return value, f"<span class='held' title='{_e(why)}'>{_e(_num(value))} ⚠</span>"
    return v.params.get(param), _e(_num(v.params[param])) if param in v.params else ""


def _render_trial(study_id: int, v: TrialView, steerable: bool) -> str:
    api = f"/rfopt/api/studies/{study_id}/trials/{v.number}"
    state = v.situation
    if v.situation == "training" and len(v.gang) > 1:
        state += f" with trials {', '.join(str(n) for n in v.gang if n != v.number)}"
    steps = f"{v.steps_done}" + (f"/{v.num_steps}" if v.num_steps else "") + " chunks trained"
    value = (f"value {_e(v.value_text())} after chunk {v.value_step + 1}"
             if v.value is not None and v.value_step is not None else "no value yet")
    notes = []
    if v.params:
        notes.append(", ".join(f"{_e(k)}={_e(_num(p))}" for k, p in v.params.items()))
    for field_param, holder in v.held_as.items():
        notes.append(f"<span class='held'>⚠ its {_e(field_param)} ({_e(_num(v.params[holder]))}) is not a choice of "
                     f"Optuna's param {_e(field_param)}: Optuna's params hold it as {_e(holder)}</span>")
    if v.clone_of:
        lineage = v.clone_of
        warm = f", warm from chunk {int(lineage.get('start_unit', 0)) + 1}" if lineage.get("warm_start") else ""
        notes.append(f"clone of trial {_e(lineage.get('parent'))} with {_e(json.dumps(lineage.get('overrides', {})))}{warm}")
    if v.replaced_by is not None:
        notes.append(f"replaced by trial {v.replaced_by}")
    if v.gangs:
        notes.append("trained together with " + "; ".join(
            f"trials {', '.join(str(n) for n in members if n != v.number)} (chunk{'s' if len(units) > 1 else ''} "
            f"{', '.join(str(u + 1) for u in units)})" for members, units in _by_gang(v.gangs)))
    if v.reason:
        notes.append(_e(v.reason))
    if v.best_value is not None and v.best_step is not None:
        gain = "" if v.vs_base is None else f" (last value {v.vs_base:+.4g} against the base model)"
        notes.append(f"best checkpoint: {_num(v.best_value)} after chunk {v.best_step + 1}{gain}")
    notes += [f"<span class='warn'>{_e(flag)}</span>" for flag in v.flags]
    times = []
    if v.started is not None:
        times.append(f"started {_clock_time(v.started)}")
    if v.ended is not None and v.started is not None:
        times.append(f"ended {_clock_time(v.ended)} after {duration(v.ended - v.started)}")
    if v.chunk_seconds:
        times.append("chunks took " + ", ".join(f"{u + 1}: {duration(s)}" for u, s in sorted(v.chunk_seconds.items())))
    pending = "".join(
        f"<li><b>{_e(op)} requested</b>, applies at the next chunk boundary "
        + (f"<button type='button' class='op withdraw' data-op='withdraw' data-what='{_e(op)}' data-url='{api}/withdraw'>"
           f"Withdraw {_e(op)}</button>" if steerable else "")
        + "</li>"
        for op in v.pending
    )
    buttons = ""
    if steerable:
        for op in (o for o in v.controls if o != "clone"):
            buttons += f"<button type='button' class='op {op}' data-op='{op}' data-url='{api}/{op}'>{op.capitalize()}</button>"
        if "clone" in v.controls:
            buttons += (
                f"<details class='clone' data-config='{api}/config'><summary>Clone…</summary>"
                "<form class='clone-form'><p class='hint'>loading the trial's config…</p></form></details>"
            )
    samples = ""
    if v.sample_units:
        n = len(v.sample_units)
        samples = (
            f"<details class='samples' data-url='/rfopt/studies/{study_id}/trials/{v.number}/samples' "
            f"data-version='{v.sample_units[-1]}'><summary>Samples: eval completions and each reward function's score "
            f"({n} chunk{'s' if n > 1 else ''})</summary><div class='samples-body'>loading…</div></details>"
        )
    return (
        f"<section class='trial {v.state.lower()} {v.situation}' data-trial='{v.number}' data-state='{v.state}' "
        f"data-situation='{v.situation}' data-pending='{' '.join(v.pending)}'>"
        f"<header><span class='swatch' style='background:{v.colour}'></span><h3>Trial {v.number}</h3>"
        f"<span class='state'>{_e(state)}</span><span class='progress'>{steps}</span><span>{value}</span>"
        f"<a href='/dashboard/studies/{study_id}/trials?numbers={v.number}'>details</a></header>"
        f"<p class='notes'>{' · '.join(notes)}</p>"
        + (f"<p class='times hint'>{' · '.join(times)}</p>" if times else "")
        + (f"<ul class='pending'>{pending}</ul>" if pending else "")
        + f"<div class='controls'>{buttons}</div><p class='feedback' role='status'></p>{samples}</section>"
    )


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


# ---------------------------------------------------------------------- the index
def render_index(studies: list[StudySummary]) -> str:
    rows = []
    for s in studies:
        sid = s.study_id
        kind = "rfopt" if s.planned else "optuna"
        best = "-" if s.best is None else f"{s.best[1]:.4g} (trial {s.best[0]})"
        take = "-" if s.recommended is None else \
            f"{s.recommended[2]:.4g} (trial {s.recommended[0]} after chunk {s.recommended[1]})"
        base = "-" if s.baseline is None else f"{s.baseline:.4g}"
        rows.append(
            f"<tr data-study='{sid}'><td><a href='/rfopt/studies/{sid}'>{_e(s.name)}</a></td><td>{kind}</td>"
            f"<td>{tally(s.counts)}</td><td>{best}</td><td>{take}</td><td>{base}</td>"
            f"<td class='status {s.status}' title='{_e(s.live.message)}'>"
            f"{s.status}{''.join(f'<span class=stuck>⚠ {_e(line)}</span>' for line in s.stuck)}</td>"
            f"<td><a href='/dashboard/studies/{sid}'>optuna-dashboard</a></td></tr>"
        )
    table = ("<table class='index'><tr><th>study</th><th>kind</th><th>trials</th><th>best value</th>"
             "<th>adapter to take</th><th>base model</th><th>now</th><th></th>"
             "</tr>" + "".join(rows) + "</table>") if rows else "<p>No studies in this storage yet.</p>"
    return _page("rfopt studies", f"<h1>rfopt studies</h1>{table}<p><a href='/dashboard'>optuna-dashboard</a> "
                 "(every study, Optuna's own views)</p>")


def render_missing(study_id: int) -> str:
    return _page("no such study", f"<p>No study with id {study_id}. <a href='/rfopt'>All studies</a></p>")


# ---------------------------------------------------------------------- HTML
def plotly_version() -> str:
    """The version of the plotly.js the page loads: the ``plotly`` package's bundled one (`rfopt.dashboard` serves
    it)."""
    import plotly

    return plotly.__version__


def _page(title: str, body: str, scripts: bool = False) -> str:
    head = "<meta name='viewport' content='width=device-width'><link rel='stylesheet' href='/rfopt/static/rfopt.css'>"
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


def _clock_time(epoch: float) -> str:
    """The local time of day (with the date when not today), as the server's clock reads it."""
    return clock_time(epoch)
