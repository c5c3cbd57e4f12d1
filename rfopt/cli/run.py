"""``rfopt run``: run (or continue) a study file's study in this process, or on a Ray cluster, and end with its
leaderboard, the recommendation (the best checkpoint, beside the base model), its sample completions and the command
that opens the dashboard."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from rfopt.errors import Refusal

from .arguments import absolute_sqlite, add_command, positive_float, positive_int
from .training import open_study_file, run_arguments, sharing_options, study_options


def register(commands: Any) -> None:
    run = add_command(
        commands,
        "run",
        help="run (or continue) a study file",
        description="Run the study defined in a study file (STUDY = rfopt.StudySpec(...)). Rerunning the same "
        "command continues the study: finished trials are kept, running ones resume from their checkpoints.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt run arithmetic                              # the offline demo (rfopt/studies/arithmetic.py)
              rfopt run arithmetic --fast --storage sqlite:///smoke.db
              rfopt run gsm8k_lite --device cuda --study gsm8k-2
              rfopt run my_study.py --n-trials 4 --timeout 3600  # 4 new trials; no chunk starts after an hour
              rfopt run my_study.py --ray                       # one worker per CPU of a new local Ray cluster
              rfopt run my_study.py --ray auto --storage postgresql://rfopt@db/rfopt --checkpoint-dir s3://b/rfopt
            """
        ),
    )
    study_options(run, worker=False)
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where every trial trains, whatever the "
                     "study file's use_cpu/bf16 say (default: %(default)s)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="train on a Ray cluster: one worker per "
                     "GPU of the cluster (else per --cpus-per-worker CPUs), each a Ray actor sharing the study through "
                     "its storage. ADDRESS as ray.init takes it (auto, ray://head:10001); none: $RAY_ADDRESS, else a "
                     "new local cluster (give --ray after the study file, or --ray=ADDRESS). Needs pip install "
                     "'rfopt[ray]'; on several nodes, PostgreSQL and a shared --checkpoint-dir")
    run.add_argument("--workers", type=positive_int, metavar="N", help="with --ray: actors to start (default: one "
                     "per GPU, else one per --cpus-per-worker CPUs)")
    run.add_argument("--cpus-per-worker", type=positive_float, default=1.0, metavar="N",
                     help="with --ray: each CPU worker's share of a node's CPUs (default: %(default)s)")
    sharing_options(run, worker=False)
    run.set_defaults(handler=run_study)


def run_study(args: argparse.Namespace) -> int:
    executor = None
    if args.ray is not None:
        import rfopt

        if args.device != "cpu":
            raise Refusal(f"--device {args.device} with --ray: each worker trains on the device Ray gives it (a "
                             "GPU each where the cluster has GPUs); leave --device out")
        executor = rfopt.RayCluster(address=args.ray or None, num_workers=args.workers,
                                    cpus_per_worker=args.cpus_per_worker, lease_seconds=args.lease_seconds,
                                    devices_per_trial=args.devices_per_trial or 1)
    elif args.workers is not None or args.devices_per_trial not in (None, 1):
        raise Refusal("--workers and --devices-per-trial are for --ray; to start workers on this machine use "
                         "rfopt worker --devices ... [--devices-per-trial K]")
    spec, study, space, train, evaluation = open_study_file(args, "study")
    study.optimize(space, train, evaluation, **run_arguments(args, spec, space), device=args.device,
                   show_progress_bar=not args.no_progress, executor=executor)
    _print_summary(study, args.storage)
    return 0


def _print_summary(study: Any, storage: str) -> None:
    from rfopt.reports.display import format_recommendation
    from rfopt.storage.schema import TrialRecord

    print()
    print(study.leaderboard_text())
    print()
    found = study.outcome()
    recommended = found.recommendation
    samples = [] if recommended is None else \
        TrialRecord(study.optuna.trials[recommended.trial]).samples().get(recommended.unit, [])
    print("\n".join(format_recommendation(found, samples)))
    print()
    print("open the dashboard:")
    print(f"  optuna-dashboard {absolute_sqlite(storage)}")
    print("or, with rfopt's trial comparison and controls:")
    print(f"  rfopt dashboard --storage {absolute_sqlite(storage)}")

