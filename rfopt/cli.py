"""The ``rfopt`` command line.

    rfopt run arithmetic | my_study.py              run (or continue) a ready-made study or a study file
    rfopt status [--study NAME]                     studies in a storage; a study's leaderboard, what trains now
    rfopt halt --study NAME                         stop every process running a study (trials stay resumable)
    rfopt pause|resume|stop TRIAL --study NAME      steer a running trial (applied at its next chunk boundary)
    rfopt clone TRIAL --study NAME --set k=v ...    enqueue a copy of a trial with changed settings
    rfopt cancel TRIAL --study NAME                 cancel a WAITING clone before it starts
    rfopt withdraw pause|resume|stop TRIAL --study NAME   take back a pending request before it applies
    rfopt dashboard [--port 8080]                   optuna-dashboard plus rfopt's trial comparison and controls
    rfopt worker my_study.py --storage URL          join a study as workers (one per device), here or on any host
    rfopt --version                                 rfopt's version and those of the libraries it drives

``--n-trials N`` means what it means to ``optuna.Study.optimize``: new trials this command starts;
``--n-trials-total N`` is the study's total (a study file's ``n_trials_total``): a rerun tops the
study up to it. Every command takes ``--storage URL`` (default ``sqlite:///rfopt.db`` in the working directory) and ``-v`` (before
or after the command); every command on a study names it with ``--study`` (``--study-name`` is the same flag).
Bad input is refused before anything is stored: a malformed storage URL, a SQLite file whose folder is missing, a
study file that does not import, a count or port out of range. Only ``run`` and ``worker`` create a database;
the other commands refuse a SQLite file that does not exist. An error prints ``rfopt: error: <what and the fix>``
and exits 1 (2 for a bad argument); ``-v`` shows its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from rfopt.training.gang import DEFAULT_GANG_SIZE

DEFAULT_STORAGE = "sqlite:///rfopt.db"
VERBOSE_HELP = "log each trial's progress and show tracebacks"


WORKER_PARENT = "RFOPT_WORKER_PARENT"
"""Set by ``rfopt worker --devices a,b`` on each worker process it starts: the parent's pid, which the worker ends
with (`_end_with_parent`)."""


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(WORKER_PARENT, "").isdigit():
        _end_with_parent(int(os.environ.pop(WORKER_PARENT)))
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rfopt").setLevel(logging.INFO if args.verbose else logging.WARNING)
    _quiet_libraries(args.verbose)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to continue the study from its last committed chunks",
              file=sys.stderr)
        return 130
    except Exception as exc:  # any failure is one line to the user; -v shows the traceback
        if args.verbose:
            raise
        print(f"rfopt: error: {_error_text(exc)}\n(run with -v for the traceback)", file=sys.stderr)
        return 1


def _error_text(exc: Exception) -> str:
    """The error as a person reads it: rfopt's own errors (`RfoptError`; ValueError, LookupError, OSError,
    RuntimeError and their kin) say what and how to fix; anything else, from a library or a study file, is named by
    its type too."""
    from .errors import RfoptError

    text = str(exc).strip()
    if text and (isinstance(exc, RfoptError) or isinstance(exc, (ValueError, LookupError, OSError, RuntimeError))
                 and not isinstance(exc, KeyError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rfopt",
        description="Optuna-native GRPO hyperparameter search: train many TRL GRPO configurations "
        "concurrently, chunk by chunk, and let Optuna prune the losers.",
        epilog=f"Storage defaults to {DEFAULT_STORAGE} (a SQLite file in the working directory); "
        "any Optuna storage URL works (postgresql://user@host/db across hosts). Only run and worker create a "
        "database. -v may come before or after the command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--version", action=_VersionAction,
                        help="print rfopt's version and those of optuna, trl, transformers, peft and torch, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = _command(
        sub,
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
    run.add_argument("study_file", help="a study file (my_study.py), or a ready-made study: "
                     "arithmetic, gsm8k_lite, deepmath, numina_tir")
    _storage_argument(run, creates=True)
    _study_argument(run, help="study name (default: the study file's name)")
    _plan_arguments(run, max_concurrent="trials time-sliced at once")
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where every trial trains, whatever the "
                     "study file's use_cpu/bf16 say (default: %(default)s)")
    run.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                     help="auto: fp32 on the CPU, bf16 on a GPU that has it (default: %(default)s)")
    run.add_argument("--checkpoint-dir", help="where checkpoints and adapters go: a directory or an fsspec URL such "
                     "as s3://bucket/prefix (default: rfopt-checkpoints/<study>-<id>/ beside the SQLite file; a "
                     "PostgreSQL study needs one)")
    run.add_argument("--fast", action="store_true", help="the study file's quick variant (fewer trials and rows)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="train on a Ray cluster: one worker per "
                     "GPU of the cluster (else per --cpus-per-worker CPUs), each a Ray actor sharing the study through "
                     "its storage. ADDRESS as ray.init takes it (auto, ray://head:10001); none: $RAY_ADDRESS, else a "
                     "new local cluster (give --ray after the study file, or --ray=ADDRESS). Needs pip install "
                     "'rfopt[ray]'; on several nodes, PostgreSQL and a shared --checkpoint-dir")
    run.add_argument("--workers", type=_positive_int, metavar="N", help="with --ray: actors to start (default: one "
                     "per GPU, else one per --cpus-per-worker CPUs)")
    run.add_argument("--cpus-per-worker", type=_positive_float, default=1.0, metavar="N",
                     help="with --ray: each CPU worker's share of a node's CPUs (default: %(default)s)")
    run.add_argument("--lease-seconds", type=_positive_seconds, default=30.0, metavar="SECONDS",
                     help="with --ray: a dead worker's unit is trained again after this (default: %(default)s)")
    run.add_argument("--devices-per-trial", type=_positive_int, default=1, metavar="K",
                     help="with --ray: train each trial over K workers' devices at once, as one data-parallel job "
                     "(default: %(default)s)")
    run.set_defaults(handler=_cmd_run)

    worker = _command(
        sub,
        "worker",
        help="join a study as workers, one process per device, beside workers on other devices or hosts",
        description="Train a study file's study together with every other worker on the same storage: each unit "
        "is trained under a lease on its trial, kept in the study's database (renewed while it trains; a worker "
        "whose lease expired cannot commit; a dead worker's unit is trained by another once its lease expires). "
        "PostgreSQL for many hosts (with a checkpoint store every host can reach: a shared directory or an fsspec URL "
        "such as s3://bucket/prefix), SQLite on one host.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt worker arithmetic --devices auto                  # one worker per GPU, or the CPU
              rfopt worker arithmetic --devices cuda:0,cuda:1 --storage postgresql://db/rfopt \\
                  --checkpoint-dir s3://my-bucket/rfopt      # or a directory every host mounts
              rfopt worker arithmetic --devices cpu,cpu --n-trials-total 16      # two workers on the CPU
            """
        ),
    )
    worker.add_argument("study_file", help="the study file (or ready-made study) every worker of the study runs")
    _storage_argument(worker, creates=True)
    _study_argument(worker, help="study name (default: the study file's name)")
    worker.add_argument("--devices", default="cpu", help="auto (every CUDA device, else the CPU), cpu, cuda:N, or a "
                        "comma-separated list: one worker process each (default: %(default)s)")
    worker.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="auto: fp32 on the CPU, bf16 on a GPU that has it (default: %(default)s)")
    _plan_arguments(worker, max_concurrent="trials time-sliced at once across all workers",
                    starter="each worker process")
    worker.add_argument("--checkpoint-dir", help="checkpoint store every worker can reach: a shared directory or an "
                        "fsspec URL such as s3://bucket/prefix (default: the one the study recorded, else "
                        "rfopt-checkpoints/<study>-<id>/ beside the SQLite file; a PostgreSQL study needs one)")
    worker.add_argument("--lease-seconds", type=_positive_seconds, default=30.0, metavar="SECONDS",
                        help="how long a unit's lease lasts without a renewal, more than 0: a dead worker's unit is "
                        "taken over after this (default: %(default)s)")
    worker.add_argument("--devices-per-trial", type=_positive_int, metavar="K", help="train each trial over K of the "
                        "listed devices at once, as one data-parallel job (its batch split over them; rollouts "
                        "sampled per row, so K devices match one); the devices form groups of K, one worker each")
    worker.add_argument("--data-parallel-rank", help=argparse.SUPPRESS)  # RANK/K@ADDRESS:PORT, for the group's processes
    worker.add_argument("--fast", action="store_true", help="the study file's quick variant")
    worker.set_defaults(handler=_cmd_worker)

    status = _command(sub, "status", help="list studies, or show one study's leaderboard and what trains now",
                      description="List the studies in a storage (trials by state, best value, running or not), or "
                      "show one study's leaderboard, who runs it, what trains now (trial, chunk c of C, step s of S, "
                      "ETAs), the compute spent, pending requests and WAITING trials.")
    _storage_argument(status)
    _study_argument(status, help="show this study's leaderboard")
    status.set_defaults(handler=_cmd_status)

    for op, text in (
        ("pause", "pause a running trial at its next chunk boundary (it keeps its place; frees its memory)"),
        ("resume", "resume a paused trial exactly where it was"),
        ("stop", "stop a running trial at its next chunk boundary: it ends PRUNED, 'stopped by user'"),
    ):
        p = _command(sub, op, help=text, description=text[0].upper() + text[1:] + ".")
        _storage_argument(p)
        _study_argument(p, help="the study's name", required=True)
        p.add_argument("trial", type=int, help="trial number")
        p.set_defaults(handler=_cmd_op, op=op)

    halt = _command(sub, "halt", help="stop every process running a study at its trials' next chunk boundary",
                    description="Stop every process running the study (rfopt run, rfopt worker) at its trials' next "
                    "chunk boundary: the chunks in flight commit, the trials stay RUNNING and resumable; run the study "
                    "again to continue. Processes started after the request run.")
    _storage_argument(halt)
    _study_argument(halt, help="the study's name", required=True)
    halt.set_defaults(handler=_cmd_halt)

    cancel = _command(sub, "cancel", help="cancel a WAITING clone before any process starts it",
                      description="Cancel a WAITING clone before any process starts it: it leaves the queue and ends "
                      "FAIL, 'cancelled by ... at ...'. A clone that a process started is refused: stop it instead.")
    _storage_argument(cancel)
    _study_argument(cancel, help="the study's name", required=True)
    cancel.add_argument("trial", type=int, help="the clone's trial number")
    cancel.set_defaults(handler=_cmd_cancel)

    withdraw = _command(sub, "withdraw", help="take back a pending pause, resume or stop before it applies",
                        description="Take back a pending pause, resume or stop request on a running trial before it "
                        "applies at the trial's next chunk boundary. Refused if none is pending or it applied already.")
    _storage_argument(withdraw)
    _study_argument(withdraw, help="the study's name", required=True)
    withdraw.add_argument("op", choices=("pause", "resume", "stop"), help="the request to take back")
    withdraw.add_argument("trial", type=int, help="trial number")
    withdraw.set_defaults(handler=_cmd_withdraw)

    clone = _command(
        sub,
        "clone",
        help="enqueue a copy of a trial with changed settings",
        description="Enqueue a copy of a trial with some settings changed (validated before anything is written). "
        "A running `rfopt run` of the study picks it up when a slot frees; otherwise the next run does.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt clone 3 --study demo --set learning_rate=2e-6 --warm-start
              rfopt clone 3 --study demo --set lora_r=8 --set lora_alpha=16
            """
        ),
    )
    _storage_argument(clone)
    _study_argument(clone, help="the study's name", required=True)
    clone.add_argument("trial", type=int, help="the parent trial's number")
    clone.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a GRPOConfig field (learning_rate, reward_weights), a LoRA field (lora_r, lora_alpha, "
                       "peft_config.<field>), model or reward_funcs; repeat for several")
    clone.add_argument("--warm-start", action="store_true",
                       help="start from the parent's latest checkpoint (its weights; a fresh LR schedule over the "
                       "remaining steps) instead of from scratch")
    clone.set_defaults(handler=_cmd_clone)

    dashboard = _command(
        sub,
        "dashboard",
        help="optuna-dashboard plus rfopt's trial comparison and controls",
        description="Serve optuna-dashboard with rfopt's page at /rfopt: a leaderboard and charts comparing every "
        "trial, whether a process runs the study, each trial's samples, and pause / resume / stop / clone / cancel / "
        "withdraw buttons (pause, resume, stop apply at the trial's next chunk boundary). Bound to a non-local "
        "address, every request needs a token.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt dashboard                                  # http://127.0.0.1:8080/rfopt
              rfopt dashboard --storage postgresql://db/rfopt --host 0.0.0.0 --port 8081
            """
        ),
    )
    _storage_argument(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    dashboard.add_argument("--port", type=_port, default=8080, help="port, 1 to 65535 (default: %(default)s)")
    dashboard.add_argument("--token", help="token every request must carry; default: $RFOPT_DASHBOARD_TOKEN, or, "
                           "bound to a non-local address, a generated one (printed)")
    dashboard.add_argument("--artifact-dir", default="rfopt-artifacts", help="where files uploaded through the "
                           "dashboard go (default: %(default)s); rfopt's own artifacts are found in each study's "
                           "checkpoint directory")
    dashboard.set_defaults(handler=_cmd_dashboard)
    return parser


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser; it accepts -v too (``rfopt status -v``), without resetting a -v given before it."""
    parser = sub.add_parser(name, **kwargs)
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def _storage_argument(parser: argparse.ArgumentParser, *, creates: bool = False) -> None:
    made = "created if missing" if creates else "it must exist"
    parser.add_argument("--storage", default=DEFAULT_STORAGE, help="Optuna storage URL: sqlite:///path.db (relative "
                        f"to the working directory; {made}) or postgresql://user@host/db (default: %(default)s)")


def _plan_arguments(parser: argparse.ArgumentParser, *, max_concurrent: str, starter: str = "this command") -> None:
    """``--n-trials``, ``--n-trials-total``, ``--timeout``, ``--num-chunks`` and ``--max-concurrent``, each checked by
    the parser."""
    parser.add_argument("--n-trials", type=_count, metavar="N", help=f"new trials {starter} starts, 0 or more, as "
                        "optuna's optimize(n_trials=...); trials a stopped run left continue on top (default: the "
                        "study file's n_trials, else as many as --n-trials-total allows)")
    parser.add_argument("--n-trials-total", type=_count, metavar="N", help="the study's total trials, 0 or more, "
                        "whichever command started them: a rerun tops the study up to it (default: the study file's "
                        "n_trials_total unless --n-trials is given)")
    parser.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS", help="no chunk starts after this "
                        "many seconds; trials not finished stay resumable (rerun the command to continue them)")
    parser.add_argument("--num-chunks", type=_positive_int, metavar="N", help="chunks the training set is split "
                        "into, 1 or more (default: the study file's)")
    parser.add_argument("--max-concurrent", type=_positive_int, metavar="N",
                        help=f"{max_concurrent}, 1 or more (default: the study file's)")
    parser.add_argument("--gang-size", type=_positive_int, metavar="N",
                        help="trials of one base model trained at once, in lockstep, their rollouts generated in one "
                        "batch; 1 trains one trial at a time, bit for bit as plain TRL (default: the study file's, "
                        f"else {DEFAULT_GANG_SIZE}, or 1 with --devices-per-trial; see the README, Gangs)")
    parser.add_argument("--report-to", action="append", metavar="TRACKER",
                        help="send each trial's TRL logs to this tracker, as TRL's report_to (tensorboard, wandb, "
                        "mlflow, trackio, all, none); repeat for several. One run per trial, <study>-trial-<n>, "
                        "grouped by study; stored on the study (default: the study's, none for a new one)")


def _study_argument(parser: argparse.ArgumentParser, *, help: str, required: bool = False) -> None:
    parser.add_argument("--study", "--study-name", dest="study_name", metavar="NAME", required=required, help=help)


def _whole_number(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number ({what}), got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _positive_int(text: str) -> int:
    """``--num-chunks``, ``--max-concurrent``: 1 or more."""
    return _whole_number(text, 1, "1 or more")


def _count(text: str) -> int:
    """``--n-trials``: 0 or more."""
    return _whole_number(text, 0, "0 or more")


def _port(text: str) -> int:
    value = _whole_number(text, 1, "a port from 1 to 65535")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    """``--cpus-per-worker``: a number more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


class _VersionAction(argparse.Action):
    """``--version``: rfopt's version and those of the libraries it drives, read from their installed metadata (so
    that nothing heavy is imported)."""

    LIBRARIES = ("optuna", "trl", "transformers", "peft", "torch")

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        lines = [f"rfopt {_installed('rfopt')}"] + [f"  {name} {_installed(name)}" for name in self.LIBRARIES]
        lines.append(f"  python {sys.version.split()[0]}")
        print("\n".join(lines))
        parser.exit()


def _installed(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _load_spec(path: str) -> Any:
    """The `StudySpec` of the study file at `path`. A failure while importing the file (a syntax error, a missing
    import, any exception its code raises) is reported as the file's, with the line."""
    import traceback

    from rfopt.config import studyfile

    try:
        return studyfile.load_spec(path)
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and frames[-1].filename == studyfile.__file__:
            raise  # load_spec's own refusal (no such file, no STUDY) says it all
        if isinstance(exc, SyntaxError):
            reason, line = exc.msg, exc.lineno
        else:
            here = os.path.abspath(path)
            reason = str(exc).strip()
            line = next((f.lineno for f in reversed(frames) if os.path.abspath(f.filename) == here), None)
        where = f" (line {line})" if line else ""
        raise ValueError(f"study file {path}: {type(exc).__name__}: {reason}{where}") from exc


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


def _open_study_file(args: argparse.Namespace, banner: str) -> tuple[Any, Any, Any, Any, Any]:
    """``(spec, study, space, train, evaluation)`` of ``args.study_file`` (its fast variant with ``--fast``)."""
    import rfopt
    from rfopt.storage.database import check_lasting_url, redact
    from rfopt.training.trackers import normalize as trackers_of

    from .study import check_study_name

    check_lasting_url(args.storage)  # a mistyped URL or a missing folder fails before the study file loads its data
    check_study_name(args.study_name)  # so does a --study that would choose where files go
    trackers_of(args.report_to)  # and a --report-to tracker that is not installed
    spec = _load_spec(args.study_file)
    if args.fast:
        spec = spec.with_fast()
    name = args.study_name or spec.name
    print(f"rfopt: {banner} {name!r} from {args.study_file} in {redact(args.storage)}", file=sys.stderr)
    if spec.description:
        print(textwrap.fill(spec.description, 100), file=sys.stderr)
    train, evaluation = spec.datasets()
    space = spec.search_space()
    study = rfopt.create_study(
        study_name=name,
        storage=args.storage,
        sampler=spec.sampler() if spec.sampler else None,
        pruner=spec.pruner() if spec.pruner else None,
        direction=spec.direction,
        load_if_exists=True,
        checkpoint_dir=args.checkpoint_dir,
    )
    return spec, study, space, train, evaluation


def _cmd_run(args: argparse.Namespace) -> int:
    executor = None
    if args.ray is not None:
        import rfopt

        if args.device != "cpu":
            raise ValueError(f"--device {args.device} with --ray: each worker trains on the device Ray gives it (a "
                             "GPU each where the cluster has GPUs); leave --device out")
        executor = rfopt.RayCluster(address=args.ray or None, num_workers=args.workers,
                                    cpus_per_worker=args.cpus_per_worker, lease_seconds=args.lease_seconds,
                                    devices_per_trial=args.devices_per_trial)
    elif args.workers is not None or args.devices_per_trial != 1:
        raise ValueError("--workers and --devices-per-trial are for --ray; to start workers on this machine use "
                         "rfopt worker --devices ... [--devices-per-trial K]")
    spec, study, space, train, evaluation = _open_study_file(args, "study")
    study.optimize(
        space,
        train,
        evaluation,
        **_trial_counts(args, spec, space),
        timeout=args.timeout,
        num_chunks=args.num_chunks if args.num_chunks is not None else spec.num_chunks,
        max_concurrent=args.max_concurrent if args.max_concurrent is not None else spec.max_concurrent,
        objective=spec.objective,
        eval_settings=spec.eval_settings,
        device=args.device,
        precision=args.precision,
        show_progress_bar=not args.no_progress,
        report_to=args.report_to,
        executor=executor,
        gang_size=_gang_size(args, spec),
        prune_collapsed=spec.prune_collapsed,
    )
    _print_summary(study, args.storage)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    devices = _devices(args.devices)
    group = _data_parallel(args, devices)
    if group is not None:
        group.start(devices[0])  # before the study file builds its configs: Accelerate reads the group once
    if len(devices) > 1:  # one process per device, each this same command on its one device
        import subprocess

        from rfopt.storage.database import check_lasting_url
        from rfopt.training.trackers import normalize as trackers_of

        from .study import check_study_name

        check_lasting_url(args.storage)  # bad input fails here once, not in every worker
        check_study_name(args.study_name)
        trackers_of(args.report_to)
        _load_spec(args.study_file)

        base = ["-v"] * args.verbose + ["worker", args.study_file, "--storage", args.storage,
                                        "--lease-seconds", str(args.lease_seconds),
                                        "--precision", args.precision] + ["--fast"] * args.fast
        for flag, value in (("--study", args.study_name), ("--n-trials", args.n_trials),
                            ("--n-trials-total", args.n_trials_total), ("--timeout", args.timeout),
                            ("--num-chunks", args.num_chunks), ("--max-concurrent", args.max_concurrent),
                            ("--gang-size", args.gang_size), ("--checkpoint-dir", args.checkpoint_dir)):
            if value is not None:
                base += [flag, str(value)]
        for tracker in args.report_to or ():
            base += ["--report-to", tracker]
        per_trial = args.devices_per_trial or 1
        if len(devices) % per_trial:
            raise ValueError(f"--devices {args.devices} --devices-per-trial {per_trial}: {len(devices)} devices do "
                             f"not form groups of {per_trial}; list a multiple of {per_trial}")
        ranks = [[] for _ in devices]
        if args.devices_per_trial is not None:
            for start in range(0, len(devices), per_trial):
                port = _free_port()
                for rank in range(per_trial):
                    ranks[start + rank] = ["--data-parallel-rank", f"{rank}/{per_trial}@127.0.0.1:{port}"]
        workers = len(devices) // per_trial
        print(f"rfopt: {workers} workers on {', '.join(devices)}"
              + (f", {per_trial} devices per trial" if per_trial > 1 else ""), file=sys.stderr)
        child_env = dict(os.environ, **{WORKER_PARENT: str(os.getpid())})  # each ends with this process
        processes = [subprocess.Popen([sys.executable, "-m", "rfopt.cli", *base, "--devices", d, *rank], env=child_env)
                     for d, rank in zip(devices, ranks)]
        try:
            codes = [p.wait() for p in processes]
        except BaseException:  # Ctrl-C or a signal to this process alone: its workers stop too, as after a Ctrl-C
            _interrupt(processes)
            raise
        return max(codes, key=abs)

    spec, study, space, train, evaluation = _open_study_file(args, f"worker on {devices[0]} for study")
    study.work(
        space,
        train,
        evaluation,
        **_trial_counts(args, spec, space),
        timeout=args.timeout,
        num_chunks=args.num_chunks if args.num_chunks is not None else spec.num_chunks,
        max_concurrent=args.max_concurrent if args.max_concurrent is not None else spec.max_concurrent,
        objective=spec.objective,
        eval_settings=spec.eval_settings,
        device=devices[0],
        precision=args.precision,
        lease_seconds=args.lease_seconds,
        report_to=args.report_to,
        data_parallel=group,
        gang_size=_gang_size(args, spec),
        prune_collapsed=spec.prune_collapsed,
    )
    if group is not None:
        group.stop()
    if group is None or group.lead:
        print(study.leaderboard_text())
    return 0


def _data_parallel(args: argparse.Namespace, devices: list[str]) -> Any:
    """This process's place in a data-parallel group: from ``--data-parallel-rank`` (a process of a group the command
    started), or rank 0 of 1 for ``--devices-per-trial 1`` on one device (one device, rollouts sampled per row, as a
    group's trial)."""
    from rfopt.training.parallel import DataParallel

    if args.data_parallel_rank:
        place, _, where = args.data_parallel_rank.partition("@")
        rank, _, world = place.partition("/")
        address, _, port = where.rpartition(":")
        return DataParallel(int(rank), int(world), address, int(port))
    if args.devices_per_trial is not None and len(devices) == 1:
        if args.devices_per_trial != 1:
            raise ValueError(f"--devices-per-trial {args.devices_per_trial} needs that many devices in --devices "
                             f"(got {devices[0]})")
        return DataParallel(0, 1)
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gang_size(args: argparse.Namespace, spec: Any) -> int | None:
    """``--gang-size``, else the study file's, else None: rfopt's default (`rfopt.training.gang.DEFAULT_GANG_SIZE`)."""
    return args.gang_size if args.gang_size is not None else spec.gang_size


def _interrupt(processes: list[Any], seconds: float = 60.0) -> None:
    """Interrupt the worker processes still running (SIGINT: each stops as after a Ctrl-C, every trial resumable) and
    wait for them; kill those still running after `seconds`."""
    import signal
    import subprocess

    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _end_with_parent(parent: int) -> None:
    """End this worker when the ``rfopt worker --devices`` process that started it ends, however it ends (SIGKILL
    included): Linux sends SIGINT (a Ctrl-C: every trial stays resumable) when the parent dies (PR_SET_PDEATHSIG);
    elsewhere a thread watches the parent's pid. A parent gone already ends this process at once."""
    import signal
    import threading
    import time

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    # A Ctrl-C ends the worker even where it was started with SIGINT ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGINT, 0, 0, 0)
    if os.getppid() != parent:  # it died before this process could ask to end with it
        raise SystemExit("rfopt: the `rfopt worker` process that started this worker has ended; so does this worker")
    if sys.platform.startswith("linux"):
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        interrupt()

    threading.Thread(target=watch, name="rfopt-parent-watch", daemon=True).start()


def _devices(spec: str) -> list[str]:
    """`--devices`: auto (every CUDA device, else the CPU), or a comma-separated list such as cuda:0,cuda:1."""
    if spec == "auto":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in devices if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()))]
    if not devices or bad:
        raise ValueError(f"--devices {spec!r}: give auto, cpu, cuda:N, or a comma-separated list of them")
    return devices


def _cmd_status(args: argparse.Namespace) -> int:
    import rfopt
    from rfopt.reports.status import summaries

    storage = _existing_storage(args.storage)
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
    print(_status_text(study.optuna))
    return 0


def _status_text(study: Any) -> str:
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


def _cmd_halt(args: argparse.Namespace) -> int:
    import rfopt
    from rfopt.engine import ops
    from rfopt.storage.database import open_storage

    study = rfopt.load_study(args.study_name, open_storage(args.storage, create=False))
    ops.halt(study.optuna)
    print(f"study {args.study_name}: stop requested; every process running it stops at its trials' next chunk "
          "boundary, and the trials stay resumable (run the study again to continue)")
    return 0


def _cmd_op(args: argparse.Namespace) -> int:
    import rfopt

    study = rfopt.load_study(args.study_name, _existing_storage(args.storage))
    getattr(study, f"{args.op}_trial")(args.trial)
    print(f"trial {args.trial}: {args.op} requested; it applies at the trial's next chunk boundary")
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    import rfopt

    study = rfopt.load_study(args.study_name, _existing_storage(args.storage))
    study.cancel_clone(args.trial)
    print(f"trial {args.trial}: cancelled; it left the queue and will not start")
    return 0


def _cmd_withdraw(args: argparse.Namespace) -> int:
    import rfopt

    study = rfopt.load_study(args.study_name, _existing_storage(args.storage))
    study.withdraw_request(args.trial, args.op)
    print(f"trial {args.trial}: its pending {args.op} was withdrawn; it will not apply")
    return 0


def _cmd_clone(args: argparse.Namespace) -> int:
    import rfopt
    from rfopt.config.overrides import parse_assignments
    from rfopt.engine.clones import clone_in_study

    overrides = parse_assignments(args.set)
    study = rfopt.load_study(args.study_name, _existing_storage(args.storage))
    made = clone_in_study(study.optuna, args.trial, overrides, warm_start=args.warm_start)
    print(made.describe(args.trial, args.warm_start))
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from rfopt.dashboard import serve
    from rfopt.storage.database import check_lasting_url

    check_lasting_url(args.storage, create=False)  # a dashboard only shows a study: it never creates the database
    serve(_absolute_sqlite(args.storage), host=args.host, port=args.port, token=args.token,
          artifact_dir=args.artifact_dir)
    return 0


def _existing_storage(url: str) -> Any:
    """The storage of a command that reads or steers a study: never created, never in memory (`check_lasting_url`)."""
    from rfopt.storage.database import check_lasting_url, open_storage

    check_lasting_url(url, create=False)
    return open_storage(url, create=False)


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
    print(f"  optuna-dashboard {_absolute_sqlite(storage)}")
    print("or, with rfopt's trial comparison and controls:")
    print(f"  rfopt dashboard --storage {_absolute_sqlite(storage)}")


def _absolute_sqlite(storage: str) -> str:
    prefix = "sqlite:///"
    if storage.startswith(prefix) and not storage.startswith(prefix + "/"):
        return prefix + str(Path(storage[len(prefix):]).resolve())
    return storage


def _quiet_libraries(verbose: bool) -> None:
    import warnings

    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The Hub's and transformers' own bars ("Loading weights", downloads) would break rfopt's progress bar.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
