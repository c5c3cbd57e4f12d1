"""What a person sees while a study runs: a progress bar over optimizer steps (or plain lines in a log), and the
leaderboard."""

from __future__ import annotations

import logging
import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .timeline import STUCK_FLOOR, STUCK_TIMES, STUCK_UNKNOWN, activity_text, duration


class ProgressBar:
    """What a run shows while it trains: a tqdm bar over the optimizer steps of its units, advancing at every step, in
    one line as wide as the terminal, what matters first and cut from the right: a stuck unit (``STUCK? t3,t4,t5 no
    step 2m10s``) or what trains now (``t3,t4,t5 c2/4 s5/8 1.2s/st``: a gang is one group, one step counter, one pace),
    the live and pruned counts, the best value as the leaderboard shows it, and the time left as the dashboard shows
    it; what a unit does within its phase follows it (``dec 40/128tok``, ``m2/3 t4``, ``16/32 prompts``:
    `rfopt.reports.timeline.activity_text`). Or, when its stream is not a terminal (a log file, CI), plain lines: one
    when a chunk commits, one when a trial is pruned (with the reason), one per trial or gang and phase change (the
    base model evaluated, loading, training, evaluating; a member's turn, a token or a prompt is no line of its own),
    one at most every `plain_seconds` while a chunk trains or a phase says how far it is (with that: ``member 2 of 3
    (trial 4)``, ``16 of 32 prompts``), and one when a trial or gang is overdue (no step for several step times: stuck
    or very slow).

    It is handed each `rfopt.engine.running.roster.RunProgress` the run reports (units and steps committed, the last unit)
    and each step of a unit in flight (`rfopt.training.progress.UnitProgress`, via `step`). With `study`, it reads the
    study's records after each commit and at least every `watch_seconds` (a prune or a change of counts is shown when
    it is decided, the forecast follows the estimator between commits): the trial counts, the best value and the
    forecast are then the storage's, the same as the page's and ``rfopt status``'s. Its total (steps committed plus
    the steps of the units the forecast expects) never runs backwards. While the bar is drawn, log records are written
    above it, never over it.
    """

    WIDTH = 100
    """The line's width when the stream's width cannot be told."""

    def __init__(self, study_name: str, enabled: bool = True, stream: TextIO | None = None,
                 plain: bool | None = None, plain_seconds: float = 30.0, study: Any = None,
                 watch_seconds: float = 5.0) -> None:
        self.study_name = study_name
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.plain = plain if plain is not None else not _is_terminal(self.stream)
        self.plain_seconds = plain_seconds
        self.study = study
        self.watch_seconds = watch_seconds
        self._bar: Any = None
        self._run: Any = None
        self._flight: dict[int, Any] = {}
        self._heard: dict[int, float] = {}
        """When each trial in flight last moved (`time.monotonic`)."""
        self._said_stuck: dict[tuple[int, ...], float] = {}
        self._said_phase: dict[tuple[int, ...], tuple[int, str]] = {}
        self._last_line = -math.inf
        self._last_commit: Any = None
        self._view: _StudyView | None = None
        self._read_key: Any = None
        self._read_at = -math.inf
        self._total = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._redirect: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled and not self.plain:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=0, desc=f"{self.study_name}", unit="step", file=self.stream, dynamic_ncols=True,
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}")
            # Log records go above the bar (tqdm.write), not over it.
            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger(), logging.getLogger("rfopt")])
            self._redirect.__enter__()
        if self.enabled and self.watch_seconds > 0:
            self._watcher = threading.Thread(target=self._watch, name="rfopt-progress-watch", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2 * self.watch_seconds)
        if self._bar is not None:
            view = self._view
            if view is not None and view.units_left == 0 and self._bar.n:
                self._bar.total = self._bar.n  # nothing left: done, whatever the forecast expected
                self._bar.refresh()
            self._bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
            self._redirect = None

    def __call__(self, progress: Any) -> None:
        """The run's progress after a round of the driver or a commit."""
        with self._lock:
            self._run = progress
            self._flight = {n: e for n, e in self._flight.items() if progress.committed.get(n, e.unit + 1) <= e.unit}
            if not self.enabled:
                return
            committed = progress.last is not None and progress.last != self._last_commit
            pruned = self._read(progress)
            if self.plain:
                if committed:
                    self._last_commit = progress.last
                    trial, unit, value = progress.last
                    self._line(f"trial {trial} chunk {unit + 1} committed: {value:.4g} · {self._totals()}")
            self._say_pruned(pruned)
            if not self.plain:
                self._draw()

    def step(self, event: Any) -> None:
        """A unit in flight reached a step or a phase, or does something else within its phase
        (`rfopt.training.progress.UnitProgress`)."""
        with self._lock:
            before = self._flight.get(event.trial)
            self._flight[event.trial] = event
            # A step or a phase is a sign of life; a turn or a token within the phase is not (as in the records:
            # `ProgressRecord.stepped`), so the bar calls stuck what the page and `rfopt status` call stuck.
            if before is None or (before.unit, before.phase, before.step) != (event.unit, event.phase, event.step):
                self._heard[event.trial] = time.monotonic()
                for key in [k for k in self._said_stuck if event.trial in k]:
                    del self._said_stuck[key]
            if not self.enabled:
                return
            if self.plain:
                now = time.monotonic()
                members = _members(event)
                # A gang's phase is its least advanced member's (as on the page): a member that starts training while
                # the others are still loading changes nothing yet, so the log does not flap between the two.
                phase = min((e.phase for e in self._flight.values() if _members(e) == members and e.unit == event.unit),
                            key=lambda phase: _ORDER.get(phase, 2))
                said = self._said_phase.get(members)
                if said != (event.unit, phase):  # one line per trial or gang and phase change
                    self._said_phase[members] = (event.unit, phase)
                    who = _who(members, long=True)
                    self._line(f"{who} chunk {event.unit + 1}/{event.num_units}: {_PHASES[phase]}")
                elif ((event.phase == "training" or event.activity is not None)
                      and now - self._last_line >= self.plain_seconds):
                    self._line(f"{self._now(long=True)} · {self._totals()}")
                return
            self._draw()

    # ------------------------------------------------------------------ what it reads
    def _read(self, progress: Any = None, *, every: float | None = None) -> list[tuple[int, str]]:
        """Read the study's records when something changed, or (`every`) when the last read is that many seconds old;
        return the trials pruned since the last read, with their reasons."""
        if self.study is None:
            return []
        now = time.monotonic()
        if progress is not None:
            key = (progress.last, progress.done, tuple(sorted(progress.counts.items())))
            if key == self._read_key:
                return []
            self._read_key = key
        elif every is None or now - self._read_at < every:
            return []
        self._read_at = now
        try:
            view = _StudyView.read(self.study)
        except Exception:  # noqa: BLE001 - a display's failure is not the run's
            return []
        before = self._view
        self._view = view
        if before is None:
            return []
        return [(n, reason) for n, reason in view.pruned.items() if n not in before.pruned]

    def _say_pruned(self, pruned: list[tuple[int, str]]) -> None:
        for number, reason in pruned:
            if self.plain:
                self._line(f"trial {number} pruned: {reason}")
            elif self._bar is not None:
                self._bar.write(f"{self.study_name}: trial {number} pruned: {reason}", file=self.stream)

    # ------------------------------------------------------------------ showing it
    def _steps(self) -> tuple[int, int]:
        run = self._run
        flying = sum(e.step for e in self._flight.values())
        if run is None:
            return flying, 0
        total = run.steps_total
        view = self._view
        if view is not None and view.steps_left is not None:
            total = run.steps_done + view.steps_left
        self._total = max(self._total, total, run.steps_done + flying)
        return run.steps_done + flying, self._total

    def _groups(self) -> list[list[Any]]:
        """The units in flight, a gang's members as one group (by their first member)."""
        groups: dict[tuple[int, ...], list[Any]] = {}
        for e in sorted(self._flight.values(), key=lambda e: e.trial):
            members = _members(e)
            groups.setdefault((e.unit, *members), []).append(e)
        return list(groups.values())

    def _now(self, long: bool = False) -> str:
        """What trains now: ``t3,t4 c2/4 s5/8 1.2s/st`` (a gang as one: the steps every member has done, their median
        pace), or in a log ``trials 3, 4 chunk 2/4 step 5/8 (1.2 s/step)``."""
        parts = []
        for events in self._groups():
            behind = min(events, key=lambda e: (_ORDER.get(e.phase, 2), e.step))
            paces = sorted(e.step_seconds for e in events if e.step_seconds is not None and e.phase == "training")
            pace = paces[len(paces) // 2] if paces else None
            numbers = tuple(e.trial for e in events)
            activity = _activity(events, behind.phase)
            if long:
                text = f"{_who(numbers, long=True)} chunk {behind.unit + 1}/{behind.num_units} "
                text += f"step {behind.step}/{behind.steps}" if behind.phase == "training" else _PHASES[behind.phase]
                if pace is not None and behind.phase == "training":
                    text += f" ({pace:.3g} s/step)"
                if activity is not None:
                    text += f", {activity_text(activity, time.time())}"
            else:
                phase = _SHORT_PHASES.get(behind.phase) or f"s{behind.step}/{behind.steps}"
                text = f"{_who(numbers)} c{behind.unit + 1}/{behind.num_units} {phase}"
                if pace is not None and behind.phase == "training":
                    text += f" {pace:.2g}s/st"
                if activity is not None:
                    text += f" {activity_text(activity, short=True)}"
            parts.append(text)
        return ("; " if not long else ", ").join(parts) or "between chunks"

    def _counts(self) -> dict[str, int]:
        if self._view is not None:
            return self._view.counts
        run = self._run
        return {_SHORT[k]: n for k, n in (run.counts.items() if run is not None else ()) if k in _SHORT}

    def _best(self) -> str | None:
        if self._view is not None:
            return self._view.best
        run = self._run
        return f"{run.best:.4g}" if run is not None and run.best is not None and math.isfinite(run.best) else None

    def _left(self) -> str | None:
        """The time left from the forecast as last read, counted down to now; on hold while a unit is stuck."""
        view = self._view
        if view is None or view.units_left <= 0:
            return None
        if self._stuck_text(time.monotonic()) is not None or view.baseline:
            return "ETA on hold"
        if view.end_at is None:
            return "ETA after the first chunk"
        return f"~{duration(max(0.0, view.end_at - time.time()))} left"

    def _totals(self) -> str:
        run = self._run
        done, total = self._steps()
        text = f"{done}/{total} steps"
        if run is not None:
            text += f", {run.done}/{run.total} chunks"
            counts = ", ".join(f"{n} {k}" for k, n in self._counts().items())
            if counts:
                text += f" · {counts}"
            if (best := self._best()) is not None:
                text += f" · best {best}"
            if (left := self._left()) is not None:
                text += f" · {left}"
        return text

    def _line(self, text: str) -> None:
        self._last_line = time.monotonic()
        print(f"{self.study_name}: {text}", file=self.stream, flush=True)

    def _draw(self) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.n, bar.total = self._steps()
        width = _columns(self.stream)
        parts = [self._stuck_text(time.monotonic()) or self._now()]
        counts = self._counts()
        if counts:
            parts.append(" ".join(f"{k} {n}" for k, n in counts.items()))
        if (best := self._best()) is not None:
            parts.append(f"best {best}")
        if (left := self._left()) is not None:
            parts.append(left.replace(" left", ""))
        name = self.study_name if len(self.study_name) <= 16 else self.study_name[:15] + "…"
        # What matters first, cut from the right; the bar keeps its percentage, 10 columns, n/total and elapsed time.
        room = width - 2 - len(f" 100%|{'#' * 10}| {bar.n}/{bar.total} [00:00:00]")
        desc = f"{name} {' · '.join(parts)}"
        bar.set_description_str(desc if len(desc) <= room else desc[: max(8, room - 1)] + "…", refresh=False)
        bar.set_postfix_str("", refresh=False)
        bar.ncols = width
        bar.refresh()

    # ------------------------------------------------------------------ overdue chunks
    def _overdue(self, now: float) -> list[tuple[list[Any], float]]:
        """Each trial or gang in flight past its limit (`Silence`'s rule: a gang moved when any member moved, its
        usual step the members' median, a prior from the other units in flight for a first step), with its quiet
        seconds."""
        out = []
        known = [e.step_seconds for e in self._flight.values() if e.step_seconds is not None and e.phase == "training"]
        for events in self._groups():
            quiet = now - max(self._heard.get(e.trial, now) for e in events)
            if quiet >= _limit(events, known):
                out.append((events, quiet))
        return out

    def _stuck_text(self, now: float) -> str | None:
        """``STUCK? t3,t4,t5 no step 1m40s`` for the first trial or gang in flight past its limit, else None."""
        for events, quiet in self._overdue(now):
            behind = min(events, key=lambda e: (_ORDER.get(e.phase, 2), e.step))
            what = {"training": "no step"}.get(behind.phase) or _SHORT_PHASES[behind.phase]
            doing = activity_text(_activity(events, behind.phase), short=True)  # in whose turn, say
            return f"STUCK? {_who(tuple(e.trial for e in events))} {what} {duration(quiet)}" + (f" {doing}" * bool(doing))
        return None

    def _watch(self) -> None:
        """Every `watch_seconds`: read the study's records (a prune is said when decided, the forecast follows the
        estimator), and say a chunk is overdue (a line in a log, once per trial or gang and then every 2 minutes; the
        bar's description in a terminal)."""
        while not self._stop.wait(self.watch_seconds):
            with self._lock:
                self._say_pruned(self._read(every=self.watch_seconds))
                now = time.monotonic()
                for events, quiet in self._overdue(now):
                    key = tuple(e.trial for e in events)
                    if now - self._said_stuck.get(key, -math.inf) < 120:
                        continue
                    self._said_stuck[key] = now
                    if self.plain:
                        behind = min(events, key=lambda e: (_ORDER.get(e.phase, 2), e.step))
                        what = {"training": "no step"}.get(behind.phase) or _PHASES[behind.phase]
                        doing = activity_text(_activity(events, behind.phase), time.time())
                        self._line(f"{_who(key, long=True)} chunk {behind.unit + 1}/{behind.num_units}: {what} for "
                                   f"{duration(quiet)} ({_usual(events, self._flight.values())})"
                                   f"{', ' + doing if doing else ''}: stuck or very slow")
                if not self.plain:
                    self._draw()


_ORDER = {"baseline": 0, "loading": 1, "training": 2, "evaluating": 3, "saving": 4}
_PHASES = {"baseline": "evaluating the base model with no adapter (the study's baseline)",
           "loading": "loading", "training": "training", "evaluating": "evaluating",
           "saving": "saving its checkpoint"}
_SHORT_PHASES = {"baseline": "base model eval", "loading": "loading", "evaluating": "eval", "saving": "saving"}


def _activity(events: list[Any], phase: str) -> Any:
    """What a trial or gang in flight does within `phase`: the newest activity heard (a gang's members all hear the
    gang's; of an evaluation's prompts, the member furthest behind), or None."""
    doing = [e.activity for e in events if e.activity is not None and e.phase == phase]
    return max(doing, key=lambda a: (a.since, -a.done)) if doing else None


def _members(event: Any) -> tuple[int, ...]:
    gang = tuple(getattr(event, "gang", ()) or ())
    return gang if len(gang) > 1 else (event.trial,)


def _who(numbers: tuple[int, ...], long: bool = False) -> str:
    if long:
        return f"trial {numbers[0]}" if len(numbers) == 1 else f"trials {', '.join(map(str, numbers))}"
    return ",".join(f"t{n}" for n in numbers)


def _usual_step(events: list[Any], known: Sequence[float]) -> tuple[float | None, bool]:
    """The usual step time of a trial or gang in flight (the members' median), else a prior (the other units' median
    in flight); whether it is the prior."""
    own = sorted(e.step_seconds for e in events if e.step_seconds is not None and e.phase == "training")
    if own:
        return own[len(own) // 2], False
    others = sorted(known)
    return (others[len(others) // 2], True) if others else (None, False)


def _limit(events: list[Any], known: Sequence[float] = ()) -> float:
    """Seconds without a step before a trial or gang in flight reads as stuck (`rfopt.reports.timeline.Silence`'s
    rule)."""
    if any(e.phase != "training" for e in events):
        return STUCK_UNKNOWN
    usual, _ = _usual_step(events, known)
    return STUCK_UNKNOWN if usual is None else max(STUCK_TIMES * usual, STUCK_FLOOR)


def _usual(events: list[Any], flight: Any) -> str:
    known = [e.step_seconds for e in flight if e.step_seconds is not None and e.phase == "training"]
    if any(e.phase != "training" for e in events):
        return f"no time to compare with yet: stuck only after {duration(STUCK_UNKNOWN)}, a generous bound"
    usual, prior = _usual_step(events, known)
    if usual is None:
        return f"no step time to compare with yet: stuck only after {duration(STUCK_UNKNOWN)}, a generous bound"
    if prior:
        return f"a step of the other trials in flight takes ~{usual:.2g} s (its own: not measured yet)"
    return f"a step takes ~{usual:.2g} s"


@dataclass(frozen=True)
class _StudyView:
    """What the bar shows from the study's records: the same counts, best value and forecast as the page."""

    counts: dict[str, int]
    best: str | None
    end_at: float | None
    """When the forecast (`rfopt.reports.forecast`) says the study ends; None before a chunk's time is measured."""
    units_left: float
    steps_left: int | None
    """Steps of the units the forecast expects still to commit (the units in flight whole)."""
    pruned: dict[int, str]
    """Pruned trials, with the reason."""
    baseline: bool = False
    """Whether the base model is being evaluated (the forecast is on hold)."""

    @classmethod
    def read(cls, study: Any) -> _StudyView:
        from optuna.trial import TrialState

        from rfopt.storage.schema import TrialRecord, study_record

        from .forecast import forecast
        from .lead import best_trial
        from .status import situation

        trials = study.get_trials(deepcopy=False)
        records = [TrialRecord(t) for t in trials]
        counts = dict.fromkeys(dict.fromkeys(_WORDS.values()), 0)
        for r in records:
            word = _WORDS.get(situation(r))
            if word:
                counts[word] += 1
        counts = {word: n for word, n in counts.items() if n}
        best = None
        if len(study.directions) == 1:
            number, label = best_trial(trials, study.directions[0])
            if number is not None and (value := records[number].value) is not None:
                best = f"{value:.4g}" + ("" if label == "best" else " (leading)")
        ahead = forecast(records, study_record(study).run_shape)
        end_at = ahead.end_at if ahead.firm else None
        spc = [r.schedule.steps_per_chunk for r in records if r.schedule is not None and r.state == TrialState.RUNNING]
        steps_left = None if not spc else round(ahead.units_to_commit * sum(spc) / len(spc))
        pruned = {r.number: r.end_reason or "pruned" for r in records if r.state == TrialState.PRUNED}
        baseline = any((f := r.in_flight) is not None and f.phase == "baseline" for r in records)
        return cls(counts, best, end_at, ahead.units_left, steps_left, pruned, baseline)


_SHORT = {"RUNNING": "live", "COMPLETE": "done", "PRUNED": "pruned", "FAIL": "failed"}
_WORDS = {"training": "live", "queued": "live", "paused": "paused", "interrupted": "live", "complete": "done",
          "pruned": "pruned", "stopped": "stopped", "failed": "failed"}


def _columns(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return ProgressBar.WIDTH


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_leaderboard(rows: list[Any], objective: str = "reward", baselines: Sequence[Any] = (),
                       lines: Sequence[str] = (), purposes: Mapping[str, str] | None = None, ahead: Any = None) -> str:
    """The leaderboard as a text table: rank, trial, what it is doing, value (± its standard error over the eval
    prompts), its difference from the baseline, the best checkpoint (value and chunk), chunks, params, note (collapse,
    degradation, why it ended, its adapter); a reference row per `baselines` (`rfopt.storage.schema.Baseline`: the base
    model with no adapter) first, each with what it is for where two share a model (`purposes`, by key:
    `rfopt.reports.outcome.StudyOutcome.baseline_purposes`), and `lines` (the recommendation:
    `rfopt.reports.outcome.StudyOutcome.lines`) under it. `ahead`: the best trial against the runner-up
    (`rfopt.reports.lead.Lead`): where its lead is within noise, both rows say it is a tie, as the dashboard's does."""
    if not rows:
        return "(no trials yet)"
    compared = bool(baselines) or any(getattr(row, "vs_base", None) is not None for row in rows)
    kept = any(getattr(row, "best_value", None) is not None for row in rows)
    header = ["#", "trial", "state", objective] + (["vs base"] if compared else []) + \
        (["best (chunk)"] if kept else []) + ["chunks", "params", "note"]
    table = []
    for baseline in baselines:
        table.append(["-", "base", "-", f"{baseline.value:.4f}"] + ([""] if compared else []) + ([""] if kept else [])
                     + ["-", "", f"{baseline.model} with no adapter: the baseline"
                        + (f" ({purposes[baseline.key]})" if purposes and baseline.key in purposes else "")])
    for rank, row in enumerate(rows, 1):
        value = "-" if row.value is None else f"{row.value:.4f}"
        if row.value is not None and getattr(row, "value_error", None) is not None:
            value += f" ± {row.value_error:.2g}"
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(row.params.items()))
        said = list(getattr(row, "flags", ()))
        if ahead is not None and ahead.tie and row.number in (ahead.best, ahead.runner_up):
            other = ahead.runner_up if row.number == ahead.best else ahead.best
            said.insert(0, f"= tie with trial {other} (within noise: {ahead.gap.text()})")
        said.append(row.reason or (row.adapter or ""))
        held = row.held_as
        if held:  # said on the row itself: the Optuna param a reader would look for does not hold the trial's value
            said = [f"! its {k} is the param {v} (not a choice of {k})" for k, v in sorted(held.items())] + said
        cells = [str(rank), str(row.number), getattr(row, "situation", "") or row.state, value]
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
    counts = {row.eval_count for row in rows if getattr(row, "eval_count", None)}
    if counts:
        prompts = " or ".join(str(n) for n in sorted(counts))
        out.append(f"(± is the standard error over the {prompts} eval prompts: values within about two of them of each "
                   "other could swap on other prompts)")
    return "\n".join(out + ([""] if lines else []) + list(lines))


def format_recommendation(found: Any, samples: Sequence[dict[str, Any]] = (), shown: int = 3) -> list[str]:
    """What a run's closing summary says of its answer (`found`: a `rfopt.reports.outcome.StudyOutcome`): the
    recommended adapter against the baseline, on the objective, in plain words for a correctness reward ("it answers 9
    of 32 eval questions right (the base model: 0)"), and on each reward function; then its sample completions
    (`samples`: that checkpoint's eval completions): with a correctness reward a right answer and a typical one, each
    marked right or wrong, else up to `shown`, each line of a completion under the one before."""
    recommended = found.recommendation
    if recommended is None:
        return [line for line in found.lines() if line.startswith("no adapter")] or ["no adapter to take yet"]
    lines = [f"recommended adapter (PEFT format; trial {recommended.trial} after chunk {recommended.unit + 1}): "
             f"{recommended.location}"]
    baseline = recommended.baseline
    right = _correctness(recommended.metrics)
    if right is not None:
        name, top, hits, count = right
        base = ""
        said = _correctness(baseline.metrics, name) if baseline is not None else None
        if said is not None:
            base = f" (the base model: {said[2]})"
        lines.append(f"it answers {hits} of {count} eval questions right{base}, as the {name} reward judges them")
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
        marked: list[tuple[dict[str, Any], str]] = [(sample, "") for sample in list(samples)[:shown]]
        if right is not None:
            name, top, hits, count = right
            correct = [x for x in samples if _number(x.get(name)) and x[name] >= top - 1e-6]
            wrong = [x for x in samples if x not in correct]
            typical = (correct[1:] if 2 * hits > count else wrong)[:1] or wrong[:1]
            marked = [(x, "right") for x in correct[:1]] + [(x, "right" if x in correct else "wrong") for x in typical]
            said = ("a right answer and a typical one" if correct else
                    "none of the kept samples is a right answer; a typical one")
            lines.append(f"sample completions of the recommended adapter on the eval set ({said}; reward: the "
                         "weighted total, then each reward function's score):")
        else:
            lines.append("sample completions of the recommended adapter on the eval set (reward: the weighted total, "
                         "then each reward function's score):")
        for sample, verdict in marked:
            lines.append(f"  prompt:     {textwrap.shorten(str(sample.get('prompt', '')), 100)}")
            text = str(sample.get("completion", "")).strip() or "(empty)"
            first, *rest = text.splitlines() or [""]
            lines.append(f"  completion: {first}")
            lines += [f"              {line}" for line in rest]
            lines.append(f"  reward:     {_scores(sample)}" + (f"  [{verdict.upper()}]" if verdict else ""))
    return lines


CORRECTNESS_NAMES = ("correct", "accuracy", "accurate", "exact_match")
"""A reward function whose name holds one of these, and whose eval scores are 0 or its full score, counts right
answers (`format_recommendation`)."""


def _correctness(metrics: Mapping[str, float], name: str | None = None) -> tuple[str, float, int, int] | None:
    """(name, full score, prompts right, prompts scored) of the first correctness reward (`CORRECTNESS_NAMES`, or
    `name`) in an evaluation's `metrics`, or None. A reward that gives each prompt 0 or its full score ``f`` has mean
    ``p f`` and population std ``f sqrt(p (1 - p))``, so ``f = (std^2 + mean^2) / mean``; it counts right answers only
    where that makes a whole number of prompts."""
    count = metrics.get("completions/count")
    if not count:
        return None
    for key in sorted(metrics):
        if not (key.startswith("rewards/") and key.endswith("/mean")):
            continue
        found = key[len("rewards/"):-len("/mean")]
        if found != name and (name is not None or not any(word in found.lower() for word in CORRECTNESS_NAMES)):
            continue
        mean, std = metrics[key], metrics.get(f"rewards/{found}/std")
        if not _number(mean) or not _number(std) or mean < 0:
            continue
        if mean == 0:
            return found, math.inf, 0, int(count)
        top = (std * std + mean * mean) / mean
        hits = mean / top * count
        if abs(hits - round(hits)) < 0.05:
            return found, top, round(hits), int(count)
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
