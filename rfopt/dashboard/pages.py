"""rfopt's dashboard pages as HTML: the index and the study page with its parts (`rfopt.dashboard.routes` serves them;
the trials they show are `rfopt.dashboard.views`). The leaderboard is `rfopt.dashboard.leaderboard`'s, the samples
`rfopt.dashboard.samples`', what every page shares `rfopt.dashboard.markup`'s.

- `render_index`: every study of the storage with its trials by state, its best value, and whether a process runs it
  (reloaded every `REFRESH_SECONDS` while one does).
- `study_page`: one study as the page shows it, in parts the page refreshes one by one (`StudyPage`): who runs it,
  what trains now (a trial alone or a gang as one: its phase, chunk c of C, step s of S, since when, the chunk's ETA)
  and the compute spent against a run without
  pruning, warnings (trials whose objectives weigh rewards differently), the leaderboard (best first, with lineage and
  times), the "why it wins" views and the charts (`rfopt.reports.charts`), and each trial's card (controls, times, samples), in
  leaderboard order. `StudyPage.version` fingerprints the stored data the page shows
  (`rfopt.dashboard.views.data_version`): the page asks again with it (an ETag) and gets "not modified" while nothing
  changed.
- `rfopt.dashboard.samples`: a trial's eval samples per chunk (loaded when its card's "Samples" opens) and the same
  eval prompt's completions across trials, with each reward's score.

Chunks are counted from 1 for people ("after chunk 1" is Optuna's step 0). Times that move (how long a chunk has
trained, when it should end) are sent as timestamps (``data-since``, ``data-until``) that the page's script turns into
"for 1m12s" and "in ~45s": the HTML changes only when the stored data does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import optuna

from rfopt.compat import study_id_of
from rfopt.config.form import reward_weighting
from rfopt.reports.outcome import outcome
from rfopt.reports.status import Liveness, StudySummary, tally
from rfopt.reports.charts import colour, comparison
from rfopt.reports.lead import lead
from rfopt.reports.parallel import parallel_svg
from rfopt.reports.forecast import Forecast, forecast
from rfopt.reports.timeline import NowTraining, StudyCost, duration, now_training, study_cost
from rfopt.storage.schema import RunShape, TrialRecord, json_safe, study_record

from .leaderboard import _render_leaderboard, _render_versus
from .markup import _clock_time, _e, _num, _page
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


IDLE_HALT = "nobody is running this study: there is nothing to stop"
"""Why the study's stop button is disabled while no process runs it."""


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
    label = compared.best_label
    if label == "leading" and live.known and not live.running:  # a live trial leads, but nothing trains it now
        label = "leading, interrupted"
    steerable = record.plan is not None
    parts = {
        "facts": _render_facts(study, record, views, objective, direction),
        "liveness": _render_liveness(live, sid, steerable),
        "now": _render_now(records, live, record.run_shape),
        "warnings": _render_warnings(records, objective),
        "leaderboard": _render_leaderboard(views, compared.best, label, direction, ahead, found),
        "why": parallel_svg(trials, direction, objective, states={v.number: v.situation for v in views}),
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
    idle = "" if page.running else f" disabled title='{IDLE_HALT}'"
    stop = ("<button type='button' id='halt' class='op stop' data-op='halt' "
            f"data-url='/rfopt/api/studies/{sid}/halt'{idle}>Stop the study…</button>" if page.steerable else "")
    if page.steerable:  # replicates of the best configs with new seeds (`rfopt.engine.trials.replicates`, `rfopt confirm`)
        stop += (f"<button type='button' id='confirm' class='op' data-op='confirm' data-top='3' data-seeds='2' "
                 f"data-url='/rfopt/api/studies/{sid}/confirm' title='train the 3 best configs again, each with 2 new "
                 "seeds, as new trials: the answer then reads across seeds'>Confirm the best configs…</button>")
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
    """One line per trial alone or per gang (one step counter, one pace, one stuck verdict)."""
    p = now.progress
    swatches = "".join(f"<span class='swatch' style='background:{colour(n)}'></span>" for n in now.trials)
    what = _e(now.what())
    if p.activity is not None and p.activity.what == "member" and p.activity.since:  # counted by the page's clock
        what += (f", <span class='clock' data-into='{p.activity.since:.0f}'>"
                 f"{duration(time.time() - p.activity.since)} into its turn</span>")
    parts = [f"<b>{_e(now.who())}</b> {swatches}", f"chunk {p.unit + 1} of {p.num_units}", what,
             f"<span class='clock' data-since='{p.started:.0f}'>since {_clock_time(p.started)}</span>"]
    if p.step_seconds is not None and p.phase == "training":
        parts.append(f"{p.step_seconds:.3g} s/step")
    if now.chunk_end_at is not None:
        parts.append(f"chunk ends <span class='clock' data-until='{now.chunk_end_at:.0f}'>"
                     f"by {_clock_time(now.chunk_end_at)}</span>")
    silence = now.silence
    quiet = ""
    stuck = ""
    if silence is not None:
        noun = {"step": "no step", "evaluation": "evaluating", "loading": "loading",
                "baseline": "evaluating the base model", "saving": "saving"}[silence.what]
        quiet = (f" data-moved='{silence.since:.1f}' data-stuck-at='{silence.stuck_at:.1f}' data-quiet='{noun}' "
                 f"data-usual='{_e(silence.usual_text())}'")
        if now.stuck():
            stuck = " stuck"
    text = silence.text() + ": stuck or very slow; ETAs on hold" if stuck and silence is not None else ""
    members = f" data-members='{','.join(map(str, now.members))}'" if now.members else ""
    return (f"<li class='flight{stuck}' data-trial='{now.trial}'{members} data-unit='{p.unit}' data-step='{p.step}' "
            f"data-phase='{p.phase}'{quiet}>{' · '.join(parts)} <span class='silence'>{_e(text)}</span></li>")


def _eta_line(ahead: Forecast, flights: list[NowTraining]) -> str:
    """The study's forecast (`rfopt.reports.forecast`): when it ends, as its pruner's schedule lets the trials go on,
    with a range where that is an expectation."""
    if ahead.units_left <= 0:
        return ""
    if any(n.progress.phase == "baseline" for n in flights):
        return (f"<p id='eta' class='eta on-hold'>study: its end is on hold while the base model is evaluated with no "
                f"adapter (the study's baseline) · {ahead.units_left:.3g} chunk units left ({_e(ahead.schedule)})</p>")
    if ahead.end_at is None or not ahead.firm:
        return (f"<p id='eta' class='eta'>study: {ahead.units_left:.3g} chunk units left ({_e(ahead.schedule)}); "
                "its end is estimated after the first chunk commits</p>")
    ends = (f"ends <span class='clock' data-until='{ahead.end_at:.0f}'>by {_clock_time(ahead.end_at)}</span>")
    if ahead.ranged and ahead.end_at_max is not None:
        ends += (f", <span class='clock' data-until='{ahead.end_at_max:.0f}'>by {_clock_time(ahead.end_at_max)}"
                 "</span> at the latest (if nothing more is pruned)")
    stuck = " on-hold" if any(n.stuck() for n in flights) else ""
    return (f"<p id='eta' class='eta{stuck}' data-end='{ahead.end_at:.3f}' data-anchor='{ahead.anchor:.3f}' "
            f"data-units='{ahead.units_left:.3g}' "
            f"title='from the records written up to {_clock_time(ahead.anchor, millis=True)}'>study "
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


def _by_gang(gangs: dict[int, tuple[int, ...]]) -> list[tuple[tuple[int, ...], list[int]]]:
    """The units a trial trained with each set of partners, in the order it first trained with them."""
    grouped: dict[tuple[int, ...], list[int]] = {}
    for unit, members in sorted(gangs.items()):
        grouped.setdefault(tuple(sorted(members)), []).append(unit)
    return list(grouped.items())


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
    running = any(s.status == "running" for s in studies)
    note = (f"<p class='hint' id='index-refresh'>refreshes every {REFRESH_SECONDS} s while a study runs</p>"
            if running else "")
    return _page("rfopt studies", f"<h1>rfopt studies</h1>{table}{note}<p><a href='/dashboard'>optuna-dashboard</a> "
                 "(every study, Optuna's own views)</p>", refresh=REFRESH_SECONDS if running else None)


def render_missing(study_id: int) -> str:
    return _page("no such study", f"<p>No study with id {study_id}. <a href='/rfopt'>All studies</a></p>")
