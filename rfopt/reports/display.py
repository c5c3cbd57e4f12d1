"""What a person sees while a study runs: a progress bar over optimizer steps (or plain lines in a log), and the
leaderboard."""

from __future__ import annotations

import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .timeline import STUCK_FLOOR, STUCK_TIMES, STUCK_UNKNOWN, duration


class ProgressBar:
    """What a run shows while it trains: a tqdm bar over the optimizer steps of its units, advancing at every step, in
    one line that fits 100 columns (``t3,t4,t5 c2/4 s5/8 1.2s/st`` for a gang in flight, then live and pruned counts,
    the best value as the leaderboard shows it, and the time left as the dashboard shows it); or, when its stream is
    not a terminal (a log file, CI), plain lines: one when a chunk commits, one when a trial is pruned (with the
    reason), one at most every `plain_seconds` while a chunk trains, and one when a chunk is overdue (no step for
    several step times: stuck or very slow).

    It is handed each `rfopt.engine.roster.RunProgress` the run reports (units and steps committed, the last unit)
    and each step of a unit in flight (`rfopt.training.progress.UnitProgress`, via `step`). With `study`, it reads the
    study's records after each commit, rung or change of counts: the trial counts, the
    best value and the forecast are then the storage's, the same as the page's and ``rfopt status``'s. Its total
    (steps committed plus the steps of the units the forecast expects) never runs backwards.
    """

    WIDTH = 100
    """The widest line it draws."""

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
        self._said_stuck: dict[int, float] = {}
        self._last_line = -math.inf
        self._last_commit: Any = None
        self._view: _StudyView | None = None
        self._read_key: Any = None
        self._total = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> ProgressBar:
        if self.enabled and not self.plain:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=f"{self.study_name}", unit="step", file=self.stream, dynamic_ncols=True,
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}")
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
                for number, reason in pruned:
                    self._line(f"trial {number} pruned: {reason}")
                return
            for number, reason in pruned:
                self._bar.write(f"{self.study_name}: trial {number} pruned: {reason}", file=self.stream)
            self._draw()

    def step(self, event: Any) -> None:
        """A unit in flight reached a step or a phase (`rfopt.training.progress.UnitProgress`)."""
        with self._lock:
            self._flight[event.trial] = event
            self._heard[event.trial] = time.monotonic()
            self._said_stuck.pop(event.trial, None)
            if not self.enabled:
                return
            if self.plain:
                now = time.monotonic()
                if event.phase == "training" and now - self._last_line >= self.plain_seconds:
                    self._line(f"{self._now(long=True)} · {self._totals()}")
                return
            self._draw()

    # ------------------------------------------------------------------ what it reads
    def _read(self, progress: Any) -> list[tuple[int, str]]:
        """Read the study's records when something changed (at most once a second); return the trials pruned since
        the last read, with their reasons."""
        if self.study is None:
            return []
        key = (progress.last, progress.done, tuple(sorted(progress.counts.items())))
        if key == self._read_key:
            return []
        self._read_key = key
        try:
            view = _StudyView.read(self.study)
        except Exception:  # noqa: BLE001 - a display's failure is not the run's
            return []
        before = self._view
        self._view = view
        if before is None:
            return []
        return [(n, reason) for n, reason in view.pruned.items() if n not in before.pruned]

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

    def _now(self, long: bool = False) -> str:
        """What trains now: ``t3,t4 c2/4 s5/8 1.2s/st`` (a gang at the same step, one group), or in a log
        ``trial 3 chunk 2/4 step 5/8 (1.2 s/step)``."""
        groups: dict[tuple, list[Any]] = {}
        for e in sorted(self._flight.values(), key=lambda e: e.trial):
            phase = {"loading": "loading", "evaluating": "eval"}.get(e.phase, f"s{e.step}/{e.steps}")
            groups.setdefault((e.unit, e.num_units, phase), []).append(e)
        if long:
            parts = []
            for e in sorted(self._flight.values(), key=lambda e: e.trial):
                text = f"trial {e.trial} chunk {e.unit + 1}/{e.num_units} "
                text += {"loading": "loading", "evaluating": "evaluating"}.get(e.phase, f"step {e.step}/{e.steps}")
                if e.step_seconds is not None and e.phase == "training":
                    text += f" ({e.step_seconds:.3g} s/step)"
                parts.append(text)
            return ", ".join(parts) or "between chunks"
        parts = []
        for (unit, units, phase), events in groups.items():
            paces = [e.step_seconds for e in events if e.step_seconds is not None and e.phase == "training"]
            pace = f" {sum(paces) / len(paces):.2g}s/st" if paces else ""
            parts.append(f"{','.join(f't{e.trial}' for e in events)} c{unit + 1}/{units} {phase}{pace}")
        return "; ".join(parts) or "between chunks"

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
            if self._view is not None and self._view.left is not None:
                text += f" · {self._view.left}"
        return text

    def _line(self, text: str) -> None:
        self._last_line = time.monotonic()
        print(f"{self.study_name}: {text}", file=self.stream, flush=True)

    def _draw(self) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.n, bar.total = self._steps()
        postfix = []
        counts = self._counts()
        if counts:
            postfix.append(" ".join(f"{k} {n}" for k, n in counts.items()))
        if (best := self._best()) is not None:
            postfix.append(f"best {best}")
        if self._view is not None and self._view.left is not None:
            postfix.append(self._view.left.replace(" left", ""))
        stuck = self._stuck_text(time.monotonic())
        tail = " · ".join(postfix)
        room = self.WIDTH - len(tail) - 36  # the percentage, the bar's least width, n/total and the elapsed time
        name = self.study_name if len(self.study_name) <= 16 else self.study_name[:15] + "…"
        desc = f"{name} {stuck or self._now()}"
        bar.set_description_str(desc if len(desc) <= room else desc[: max(8, room - 1)] + "…", refresh=False)
        bar.set_postfix_str(tail, refresh=False)
        bar.ncols = min(self.WIDTH, _columns(self.stream))
        bar.refresh()

    # ------------------------------------------------------------------ overdue chunks
    def _stuck_text(self, now: float) -> str | None:
        """``STUCK? t3 no step 1m40s`` for the first trial in flight past its limit (`Silence`'s), else None."""
        for e in sorted(self._flight.values(), key=lambda e: e.trial):
            quiet = now - self._heard.get(e.trial, now)
            if quiet >= _limit(e):
                return f"STUCK? t{e.trial} no step {duration(quiet)}"
        return None

    def _watch(self) -> None:
        """Every `watch_seconds`: say a chunk is overdue (a line in a log, once and then every 2 minutes; the bar's
        description in a terminal)."""
        while not self._stop.wait(self.watch_seconds):
            with self._lock:
                now = time.monotonic()
                for e in list(self._flight.values()):
                    quiet = now - self._heard.get(e.trial, now)
                    if quiet < _limit(e) or now - self._said_stuck.get(e.trial, -math.inf) < 120:
                        continue
                    self._said_stuck[e.trial] = now
                    if self.plain:
                        what = {"evaluating": "evaluating", "loading": "loading"}.get(e.phase, "no step")
                        usual = (f"a step takes ~{e.step_seconds:.2g} s" if e.step_seconds is not None
                                 else "its usual pace is not known yet")
                        self._line(f"trial {e.trial} chunk {e.unit + 1}/{e.num_units}: {what} for {duration(quiet)} "
                                   f"({usual}): stuck or very slow")
                if not self.plain:
                    self._draw()


def _limit(event: Any) -> float:
    """Seconds without a step before a unit in flight reads as stuck (`rfopt.reports.timeline.Silence`'s rule)."""
    if event.step_seconds is None or event.phase != "training":
        return STUCK_UNKNOWN
    return max(STUCK_TIMES * event.step_seconds, STUCK_FLOOR)


@dataclass(frozen=True)
class _StudyView:
    """What the bar shows from the study's records: the same counts, best value and forecast as the page."""

    counts: dict[str, int]
    best: str | None
    left: str | None
    """``~4m10s left``, from the forecast (`rfopt.reports.forecast`)."""
    units_left: float
    steps_left: int | None
    """Steps of the units the forecast expects still to commit (the units in flight whole)."""
    pruned: dict[int, str]
    """Pruned trials, with the reason."""

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
        left = None
        if ahead.seconds_left is not None and ahead.units_left > 0:
            left = f"~{duration(max(0.0, (ahead.end_at or 0) - time.time()))} left"
        spc = [r.schedule.steps_per_chunk for r in records if r.schedule is not None and r.state == TrialState.RUNNING]
        steps_left = None if not spc else round(ahead.units_to_commit * sum(spc) / len(spc))
        pruned = {r.number: r.end_reason or "pruned" for r in records if r.state == TrialState.PRUNED}
        return cls(counts, best, left, ahead.units_left, steps_left, pruned)


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
                       lines: Sequence[str] = ()) -> str:
    """The leaderboard as a text table: rank, trial, what it is doing, value (± its standard error over the eval
    prompts), its difference from the baseline, the best checkpoint (value and chunk), chunks, params, note (collapse,
    degradation, why it ended, its adapter); a reference row per `baselines` (`rfopt.storage.schema.Baseline`: the base
    model with no adapter) first, and `lines` (the recommendation: `rfopt.reports.outcome.StudyOutcome.lines`) under
    it."""
    if not rows:
        return "(no trials yet)"
    compared = bool(baselines) or any(getattr(row, "vs_base", None) is not None for row in rows)
    kept = any(getattr(row, "best_value", None) is not None for row in rows)
    header = ["#", "trial", "state", objective] + (["vs base"] if compared else []) + \
        (["best (chunk)"] if kept else []) + ["chunks", "params", "note"]
    table = []
    for baseline in baselines:
        table.append(["-", "base", "-", f"{baseline.value:.4f}"] + ([""] if compared else []) + ([""] if kept else [])
                     + ["-", "", f"{baseline.model} with no adapter: the baseline"])
    for rank, row in enumerate(rows, 1):
        value = "-" if row.value is None else f"{row.value:.4f}"
        if row.value is not None and getattr(row, "value_error", None) is not None:
            value += f" ± {row.value_error:.2g}"
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(row.params.items()))
        said = list(getattr(row, "flags", ()))
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
    recommended adapter against the baseline, on the objective and on each reward function, and up to `shown` of
    `samples` (that checkpoint's eval completions), each line of a completion under the one before."""
    recommended = found.recommendation
    if recommended is None:
        return [line for line in found.lines() if line.startswith("no adapter")] or ["no adapter to take yet"]
    lines = [f"recommended adapter (PEFT format; trial {recommended.trial} after chunk {recommended.unit + 1}): "
             f"{recommended.location}"]
    baseline = recommended.baseline
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
        lines.append("sample completions of the recommended adapter on the eval set (reward: the weighted total, then "
                     "each reward function's score):")
        for sample in list(samples)[:shown]:
            lines.append(f"  prompt:     {textwrap.shorten(str(sample.get('prompt', '')), 100)}")
            text = str(sample.get("completion", "")).strip() or "(empty)"
            first, *rest = text.splitlines() or [""]
            lines.append(f"  completion: {first}")
            lines += [f"              {line}" for line in rest]
            lines.append(f"  reward:     {_scores(sample)}")
    return lines


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
