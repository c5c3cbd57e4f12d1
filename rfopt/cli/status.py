"""``rfopt status``: the studies in a storage, or one study's leaderboard, who runs it, what trains now, the compute
spent, its pending requests and WAITING trials."""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import add_command, existing_storage, load_study, storage_argument, study_argument


def register(commands: Any) -> None:
    status = add_command(commands, "status", help="list studies, or show one study's leaderboard and what trains now",
                         description="List the studies in a storage (trials by state, best value, running or not), or "
                         "show one study's leaderboard, who runs it, what trains now (trial, chunk c of C, step s of "
                         "S, ETAs), the compute spent, pending requests and WAITING trials.")
    storage_argument(status)
    study_argument(status, help="show this study's leaderboard")
    status.set_defaults(handler=show_status)


def show_status(args: argparse.Namespace) -> int:
    from rfopt.reports.status import summaries

    storage = existing_storage(args.storage)
    if args.study_name is None:
        found = summaries(storage)
        if not found:
            print(f"no studies in {args.storage}")
        for summary in found:
            print(summary.line())
        if len(found) != 1:
            return 0
        print()  # the storage's one study: shown whole, as --study would
    study = load_study(args, storage)
    print(study.leaderboard_text())
    print()
    print(status_text(study.optuna))
    return 0


def status_text(study: Any) -> str:
    """Who runs the study, what trains now (trial, chunk c of C, step s of S, ETAs), the compute spent, the requests
    not applied yet and the WAITING trials: what ``rfopt status --study`` prints under the leaderboard."""
    from optuna.trial import TrialState

    from rfopt.reports.forecast import forecast
    from rfopt.reports.status import liveness
    from rfopt.reports.timeline import now_training, study_cost
    from rfopt.storage.schema import TrialRecord, study_record

    trials = study.get_trials(deepcopy=False)
    records = [TrialRecord(t) for t in trials]
    live = liveness(study, trials)
    lines = [live.message]
    processes = max(1, len(live.holders))
    if live.running:
        flights = now_training(records, processes)
        lines += [f"now training: {n.line()}" for n in flights] or ["now training: nothing (between chunks)"]
        lines.append(_forecast_line(forecast(records, study_record(study).run_shape, processes),
                                    [n.who() for n in flights if n.stuck()],
                                    any(n.progress.phase == "baseline" for n in flights)))
    cost = study_cost(records, processes)
    if cost.units_without_pruning:
        lines.append(cost.line())
    for record in records:
        for request in record.pending:
            lines.append(f"pending: {request.op} trial {record.number}, asked by {request.by} at {request.at}; it "
                         "applies at the trial's next chunk boundary (rfopt withdraw to take it back)")
    for record in records:
        if record.state == TrialState.WAITING:
            lineage = record.lineage
            what = "a listed config" if lineage is None else (
                f"clone of trial {lineage.parent}" + (f", warm-started from its checkpoint after chunk "
                                                      f"{lineage.start_unit}" if lineage.warm_start else "")
                + (f" with {lineage.overrides}" if lineage.overrides else ""))
            lines.append(f"WAITING: trial {record.number} ({what}); starts when a slot frees in a run of the study")
    return "\n".join(lines)


def _forecast_line(ahead: Any, stuck: list[str], baseline: bool = False) -> str:
    """``study: ~4m10s left, ends by 12:03:40 (...)``: the page's forecast, in the same words; on hold while a trial
    (or a gang: `stuck` holds ``trial 3``, ``trials 3, 4, 5 (one gang)``) is stuck, or while the base model is
    evaluated (`baseline`: no chunk's time counts it)."""
    import time

    from rfopt.reports.timeline import clock_time

    before = "" if ahead.end_at is None or not ahead.firm else f"; at its pace before, it ended by {clock_time(ahead.end_at)}"
    if stuck:
        return (f"study: its end is on hold while {' and '.join(stuck)} make{'s' if len(stuck) == 1 else ''} no "
                f"progress ({ahead.units_left:.3g} chunk units left{before})")
    if baseline:
        return (f"study: its end is on hold while the base model is evaluated with no adapter (the study's baseline; "
                f"{ahead.units_left:.3g} chunk units left{before})")
    text = f"study: {ahead.text(time.time())}"
    if ahead.end_at is not None and ahead.firm and ahead.units_left > 0:
        text += f"; ends by {clock_time(ahead.end_at)} (as its records of {clock_time(ahead.anchor, millis=True)} say)"
    return text
