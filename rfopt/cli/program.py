"""The ``rfopt`` program: its parser (each command registers its own arguments), ``-v``, ``--version``, and any
error as one line with exit code 1 (2 for a bad argument).

    rfopt run arithmetic | my_study.py              run (or continue) a ready-made study or a study file
    rfopt status [--study NAME]                     studies in a storage; a study's leaderboard, what trains now
    rfopt halt --study NAME                         stop every process running a study (trials stay resumable)
    rfopt pause|resume|stop TRIAL --study NAME      steer a running trial (applied at its next chunk boundary)
    rfopt clone TRIAL --study NAME --set k=v ...    enqueue a copy of a trial with changed settings
    rfopt confirm --study NAME --top K --seeds N    train the K best configs again with N new seeds each
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
from typing import Any

from . import clone, confirm, dashboard, ops, run, status, worker
from .arguments import DEFAULT_STORAGE, VERBOSE_HELP
from .launcher import end_with_starter


def main(argv: list[str] | None = None) -> int:
    end_with_starter()
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given: `rfopt worker --devices a,b` hands it on to its workers
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
    its type too. Its notes (``exc.add_note``: where, such as ``in configs[2]``) follow in parentheses."""
    from rfopt.errors import RfoptError

    text = str(exc).strip()
    notes = [str(note).strip() for note in getattr(exc, "__notes__", ()) if str(note).strip()]
    if notes:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


COMMANDS = (run, worker, status, ops, clone, confirm, dashboard)
"""The modules of rfopt's commands, in the order ``rfopt --help`` lists them; each registers its own."""


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
