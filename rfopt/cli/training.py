"""What ``rfopt run`` and ``rfopt worker`` share: their options, defined once (the study file, its storage and name,
the plan, the precision, the checkpoint store, and how workers share a study), the study file loaded (a failure
while importing it reported as the file's, with the line), its study opened, and the settings both give
`Study.optimize` / `Study.work` (`run_arguments`)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any

from rfopt.errors import Refusal
from rfopt.training.gang import DEFAULT_GANG_SIZE, DEFAULT_GANG_TRAINING, GANG_TRAINING

from .arguments import count, positive_int, positive_seconds, storage_argument, study_argument


def study_options(parser: argparse.ArgumentParser, *, worker: bool) -> None:
    """The study file and the options of its run that ``rfopt run`` and ``rfopt worker`` (`worker`) both take: the
    storage, the study's name, its plan (`plan_arguments`), the precision, the checkpoint store, the fast variant."""
    parser.add_argument("study_file", help="a study file (my_study.py), or a ready-made study: arithmetic, gsm8k_lite, "
                        "deepmath, numina_tir" + ("; every worker of the study runs the same" if worker else ""))
    storage_argument(parser, creates=True)
    study_argument(parser, help="study name (default: the study file's name)")
    if worker:
        plan_arguments(parser, max_concurrent="trials time-sliced at once across all workers",
                       starter="each worker process")
    else:
        plan_arguments(parser, max_concurrent="trials time-sliced at once")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="auto: fp32 on the CPU, bf16 on a GPU that has it (default: %(default)s)")
    parser.add_argument("--checkpoint-dir", help="where checkpoints and adapters go, a store every worker can reach: a "
                        "directory or an fsspec URL such as s3://bucket/prefix (default: the one the study recorded, "
                        "else rfopt-checkpoints/<study>-<id>/ beside the SQLite file; a PostgreSQL study needs one)")
    parser.add_argument("--fast", action="store_true", help="the study file's quick variant (fewer trials and rows)")


def sharing_options(parser: argparse.ArgumentParser, *, worker: bool) -> None:
    """How workers share a study: ``--lease-seconds`` and ``--devices-per-trial``, for ``rfopt worker`` (`worker`) and
    ``rfopt run --ray``."""
    ray = "" if worker else "with --ray: "
    parser.add_argument("--lease-seconds", type=positive_seconds, default=30.0, metavar="SECONDS",
                        help=f"{ray}how long a unit's lease lasts without a renewal, more than 0: a dead worker's unit "
                        "is taken over after this (default: %(default)s)")
    over = "K of the listed devices" if worker else "K workers' devices"
    groups = "; the devices form groups of K, one worker each" if worker else " (default: 1)"
    parser.add_argument("--devices-per-trial", type=positive_int, metavar="K", help=f"{ray}train each trial over {over} "
                        "at once, as one data-parallel job (its batch split over them; rollouts sampled per row, so K "
                        f"devices match one){groups}")


def plan_arguments(parser: argparse.ArgumentParser, *, max_concurrent: str, starter: str = "this command") -> None:
    """``--n-trials``, ``--n-trials-total``, ``--timeout``, ``--num-chunks``, ``--max-concurrent``, ``--gang-size``,
    ``--gang-training`` and ``--report-to``, each checked by the parser."""
    parser.add_argument("--n-trials", type=count, metavar="N", help=f"new trials {starter} starts, 0 or more, as "
                        "optuna's optimize(n_trials=...); trials a stopped run left continue on top (default: the "
                        "study file's n_trials, else as many as --n-trials-total allows)")
    parser.add_argument("--n-trials-total", type=count, metavar="N", help="the study's total trials, 0 or more, "
                        "whichever command started them: a rerun tops the study up to it (default: the study file's "
                        "n_trials_total unless --n-trials is given)")
    parser.add_argument("--timeout", type=positive_seconds, metavar="SECONDS", help="no chunk starts after this "
                        "many seconds; trials not finished stay resumable (rerun the command to continue them)")
    parser.add_argument("--num-chunks", type=positive_int, metavar="N", help="chunks the training set is split "
                        "into, 1 or more (default: the study file's)")
    parser.add_argument("--max-concurrent", type=positive_int, metavar="N",
                        help=f"{max_concurrent}, 1 or more (default: the study file's)")
    parser.add_argument("--gang-size", type=positive_int, metavar="N",
                        help="trials of one base model trained at once, in lockstep, their rollouts generated in one "
                        "batch; 1 trains one trial at a time, bit for bit as plain TRL (default: the study file's, "
                        f"else {DEFAULT_GANG_SIZE}, or 1 with --devices-per-trial; see the README, Gangs)")
    parser.add_argument("--gang-training", choices=GANG_TRAINING,
                        help="how a gang's members take their training steps: batched (one forward and backward for "
                        "all, each its own loss, clipping and optimizer; equal up to rounding; every member's "
                        "activations in memory at once, and a gang that does not fit so trains sequentially) or "
                        "sequential (each its own forwards and backward, bit for bit as alone) (default: the study "
                        "file's, else "
                        f"{DEFAULT_GANG_TRAINING}; see the README, Gangs)")
    parser.add_argument("--report-to", action="append", metavar="TRACKER",
                        help="send each trial's TRL logs to this tracker, as TRL's report_to (tensorboard, wandb, "
                        "mlflow, trackio, all, none); repeat for several. One run per trial, <study>-trial-<n>, "
                        "grouped by study; stored on the study (default: the study's, none for a new one)")


def load_spec(path: str) -> Any:
    """The `StudySpec` of the study file at `path`. A failure while importing the file (a syntax error, a missing
    import, any exception its code raises) is reported as the file's, with the line."""
    import traceback

    from rfopt.config import studyfile

    try:
        return studyfile.load_spec(path)
    except (Exception, SystemExit) as exc:  # sys.exit() at import, too: said, not a silent exit
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and frames[-1].filename == studyfile.__file__:
            raise  # load_spec's own refusal (no such file, no STUDY) says it all
        if isinstance(exc, SystemExit):
            raise Refusal(f"study file {path}: {studyfile.failure(exc, path)} while it was imported; a study "
                          "file defines STUDY and runs nothing when imported") from exc
        if isinstance(exc, SyntaxError):
            reason, line = exc.msg, exc.lineno
        else:
            here = os.path.abspath(path)
            reason = str(exc).strip()
            line = next((f.lineno for f in reversed(frames) if os.path.abspath(f.filename) == here), None)
        where = f" (line {line})" if line else ""
        raise Refusal(f"study file {path}: {type(exc).__name__}: {reason}{where}") from exc


def run_arguments(args: argparse.Namespace, spec: Any, space: Any) -> dict[str, Any]:
    """What ``rfopt run`` and ``rfopt worker`` give `Study.optimize` / `Study.work` alike: each setting from its flag,
    else from the study file."""
    return dict(
        **_trial_counts(args, spec, space),
        timeout=args.timeout,
        num_chunks=args.num_chunks if args.num_chunks is not None else spec.num_chunks,
        max_concurrent=args.max_concurrent if args.max_concurrent is not None else spec.max_concurrent,
        objective=spec.objective,
        eval_settings=spec.eval_settings,
        precision=args.precision,
        report_to=args.report_to,
        gang_size=_gang_size(args, spec),
        gang_training=args.gang_training if args.gang_training is not None else spec.gang_training,
        prune_collapsed=spec.prune_collapsed,
    )


def _trial_counts(args: argparse.Namespace, spec: Any, space: Any) -> dict[str, int | None]:
    """``n_trials`` and ``n_trials_total`` for `Study.optimize` / `Study.work`: the flags, else the study file's (its
    total only when no ``--n-trials`` says how many trials this command starts)."""
    n_trials = args.n_trials if args.n_trials is not None else spec.n_trials
    total = args.n_trials_total
    if total is None and args.n_trials is None:
        total = spec.n_trials_total
    if n_trials is None and total is None and args.timeout is None and not _is_list(space):
        print("rfopt: no --n-trials, --n-trials-total or --timeout (nor n_trials_total in the study file): new "
              "trials start until Ctrl-C, as in Optuna; rerun to continue", file=sys.stderr)
    return {"n_trials": n_trials, "n_trials_total": total}


def _is_list(space: Any) -> bool:
    from rfopt.config.spaces import ListSpace, as_space

    return isinstance(as_space(space), ListSpace)


def open_study_file(args: argparse.Namespace, banner: str) -> tuple[Any, Any, Any, Any, Any]:
    """``(spec, study, space, train, evaluation)`` of ``args.study_file`` (its fast variant with ``--fast``)."""
    import rfopt
    from rfopt.config import studyfile
    from rfopt.storage.database import check_lasting_url, redact
    from rfopt.study import check_study_name
    from rfopt.training.trackers import normalize as trackers_of

    check_lasting_url(args.storage)  # a mistyped URL or a missing folder fails before the study file loads its data
    check_study_name(args.study_name)  # so does a --study that would choose where files go
    trackers_of(args.report_to)  # and a --report-to tracker that is not installed
    spec = load_spec(args.study_file)
    if args.fast:
        spec = spec.with_fast()
    name = args.study_name or spec.name
    print(f"rfopt: {banner} {name!r} from {args.study_file} in {redact(args.storage)}", file=sys.stderr)
    if spec.description:
        print(textwrap.fill(spec.description, 100), file=sys.stderr)
    train, evaluation = studyfile.call(args.study_file, spec, "datasets")  # a failure names the file and function
    space = studyfile.call(args.study_file, spec, "configs")
    study = rfopt.create_study(
        study_name=name,
        storage=args.storage,
        sampler=studyfile.call(args.study_file, spec, "sampler") if spec.sampler else None,
        pruner=studyfile.call(args.study_file, spec, "pruner") if spec.pruner else None,
        direction=spec.direction,
        load_if_exists=True,
        checkpoint_dir=args.checkpoint_dir,
    )
    return spec, study, space, train, evaluation


def _gang_size(args: argparse.Namespace, spec: Any) -> int | None:
    """``--gang-size``, else the study file's, else None: rfopt's default (`rfopt.training.gang.DEFAULT_GANG_SIZE`)."""
    return args.gang_size if args.gang_size is not None else spec.gang_size
