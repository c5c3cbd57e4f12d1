"""The commands that steer a study's trials through `rfopt.engine.trials.ops`: ``rfopt pause|resume|stop TRIAL`` (applied at
the trial's next chunk boundary), ``rfopt halt`` (every process running the study stops), ``rfopt cancel`` (a WAITING
clone) and ``rfopt withdraw`` (a pending request taken back)."""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import load_study, study_command


def register(commands: Any) -> None:
    for op, text in (
        ("pause", "pause a running trial at its next chunk boundary (it keeps its place; frees its memory)"),
        ("resume", "resume a paused trial exactly where it was"),
        ("stop", "stop a running trial at its next chunk boundary: it ends PRUNED, 'stopped by user'"),
    ):
        p = study_command(commands, op, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("trial", type=int, help="trial number")
        p.set_defaults(handler=request_op, op=op)

    halt = study_command(commands, "halt", help="stop every process running a study at its trials' next chunk "
                         "boundary", description="Stop every process running the study (rfopt run, rfopt worker) at "
                         "its trials' next chunk boundary: the chunks in flight commit, the trials stay RUNNING and "
                         "resumable; run the study again to continue. Processes started after the request run.")
    halt.set_defaults(handler=halt_study)

    cancel = study_command(commands, "cancel", help="cancel a WAITING clone before any process starts it",
                           description="Cancel a WAITING clone before any process starts it: it leaves the queue and "
                           "ends FAIL, 'cancelled by ... at ...'. A clone that a process started is refused: stop it "
                           "instead.")
    cancel.add_argument("trial", type=int, help="the clone's trial number")
    cancel.set_defaults(handler=cancel_clone)

    withdraw = study_command(commands, "withdraw", help="take back a pending pause, resume or stop before it applies",
                             description="Take back a pending pause, resume or stop request on a running trial "
                             "before it applies at the trial's next chunk boundary. Refused if none is pending or it "
                             "applied already.")
    withdraw.add_argument("op", choices=("pause", "resume", "stop"), help="the request to take back")
    withdraw.add_argument("trial", type=int, help="trial number")
    withdraw.set_defaults(handler=withdraw_request)


def halt_study(args: argparse.Namespace) -> int:
    from rfopt.engine.trials import ops
    from rfopt.storage.database import open_storage

    study = load_study(args, open_storage(args.storage, create=False))
    ops.halt(study.optuna)
    print(f"study {study.study_name}: stop requested; every process running it stops at its trials' next chunk "
          "boundary, and the trials stay resumable (run the study again to continue)")
    return 0


def request_op(args: argparse.Namespace) -> int:
    study = load_study(args)
    getattr(study, f"{args.op}_trial")(args.trial)
    print(f"trial {args.trial}: {args.op} requested; it applies at the trial's next chunk boundary")
    return 0


def cancel_clone(args: argparse.Namespace) -> int:
    study = load_study(args)
    study.cancel_clone(args.trial)
    print(f"trial {args.trial}: cancelled; it left the queue and will not start")
    return 0


def withdraw_request(args: argparse.Namespace) -> int:
    study = load_study(args)
    study.withdraw_request(args.trial, args.op)
    print(f"trial {args.trial}: its pending {args.op} was withdrawn; it will not apply")
    return 0
