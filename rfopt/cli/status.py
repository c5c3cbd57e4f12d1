"""``rfopt status``: the studies in a storage, or one study's leaderboard, who runs it, what trains now, the compute
spent, its pending requests and WAITING trials."""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import add_command, existing_storage, storage_argument, study_argument


def register(commands: Any) -> None:
    status = add_command(commands, "status", help="list studies, or show one study's leaderboard and what trains now",
                         description="List the studies in a storage (trials by state, best value, running or not), or "
                         "show one study's leaderboard, who runs it, what trains now (trial, chunk c of C, step s of "
                         "S, ETAs), the compute spent, pending requests and WAITING trials.")
    storage_argument(status)
    study_argument(status, help="show this study's leaderboard")
    status.set_defaults(handler=show_status)


def show_status(args: argparse.Namespace) -> int:
    import rfopt
    from rfopt.reports.status import summaries

    storage = existing_storage(args.storage)
    if args.study_name is None:
        found = summaries(storage)
        if not found:
            print(f"no studies in {args.storage}")
        for summary in found:
            print(summary.line())
        return 0
    study = rfopt.load_study(args.study_name, storage)
    print(study.leaderboard_text())
    print()
    print(status_text(study.optuna))
    return 0


def status_text(study: Any) -> str:
    """Who runs the study, what trains now (trial, chunk c of C, step s of S, ETAs), the compute spent, the requests
    not applied yet and the WAITING trials: what ``rfopt status --study`` prints under the leaderboard."""
    from optuna.trial import TrialState

    from rfopt.reports.status import liveness
    from rfopt.reports.timeline import now_training, study_cost
    from rfopt.storage.schema import TrialRecord

    trials = study.get_trials(deepcopy=False)
    records = [TrialRecord(t) for t in trials]
    live = liveness(study, trials)
    lines = [live.message]
    processes = max(1, len(live.holders))
    if live.running:
        flights = now_training(records, processes)
        lines += [f"now training: {n.line()}" for n in flights] or ["now training: nothing (between chunks)"]
    cost = study_cost(records, processes)
    if cost.units_without_pruning:
        lines.append(cost.line() if live.running else cost.line().split(" · study:")[0])
    for record in records:
        for request in record.pending:
            lines.append(f"pending: {request.op} trial {record.number}, asked by {request.by} at {request.at}; it "
                         "applies at the trial's next chunk boundary (rfopt withdraw to take it back)")
    for record in records:
        if record.state == TrialState.WAITING:
            lineage = record.lineage
            what = "a listed config" if lineage is None else (
                f"clone of trial {lineage.parent}" + (f", warm from chunk {lineage.start_unit + 1}"
                                                      if lineage.warm_start else "")
                + (f" with {lineage.overrides}" if lineage.overrides else ""))
            lines.append(f"WAITING: trial {record.number} ({what}); starts when a slot frees in a run of the study")
    return "\n".join(lines)
