"""What every command's parser shares: a command's parser with ``-v``, ``--storage``, ``--study``, the numeric argument
types (a count, a whole number from 1, a port, a number of seconds); the parser of a command on one study
(`study_command`), and the storage and study such a command opens (`existing_storage`, `load_study`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rfopt.errors import Refusal

DEFAULT_STORAGE = "sqlite:///rfopt.db"
VERBOSE_HELP = "log each trial's progress and show tracebacks"


def add_command(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser; it accepts -v too (``rfopt status -v``), without resetting a -v given before it."""
    parser = commands.add_parser(name, **kwargs)
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


ONE_STUDY_HELP = "the study's name (may be left out where the storage holds one study)"


def study_command(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of a command on one study of a storage that exists: ``--storage``, and ``--study`` (which may be
    left out where the storage holds one study: `one_study`)."""
    parser = add_command(commands, name, **kwargs)
    storage_argument(parser)
    study_argument(parser, help=ONE_STUDY_HELP)
    return parser


def storage_argument(parser: argparse.ArgumentParser, *, creates: bool = False) -> None:
    made = "created if missing" if creates else "it must exist"
    parser.add_argument("--storage", default=DEFAULT_STORAGE, help="Optuna storage URL: sqlite:///path.db (relative "
                        f"to the working directory; {made}) or postgresql://user@host/db (default: %(default)s)")


def study_argument(parser: argparse.ArgumentParser, *, help: str, required: bool = False) -> None:
    parser.add_argument("--study", "--study-name", dest="study_name", metavar="NAME", required=required, help=help)


def _whole_number(text: str, minimum: int, what: str, maximum: int | None = None) -> int:
    """`text` as a whole number from `minimum` (to `maximum`), `what` saying which in the parser's refusal."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number ({what}), got {text!r}") from None
    if value < minimum or maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _positive_number(text: str, kind: str, unit: str = "") -> float:
    """`text` as a finite number more than 0 (which also refuses nan and inf), `kind` and `unit` naming it in the
    parser's refusal."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0{unit}, got {text}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0{unit}, got {text}")
    return value


def positive_int(text: str) -> int:
    """``--num-chunks``, ``--max-concurrent``: 1 or more."""
    return _whole_number(text, 1, "1 or more")


def count(text: str) -> int:
    """``--n-trials``: 0 or more."""
    return _whole_number(text, 0, "0 or more")


def port(text: str) -> int:
    """``--port``: 1 to 65535."""
    return _whole_number(text, 1, "a port from 1 to 65535", maximum=65535)


def positive_float(text: str) -> float:
    """``--cpus-per-worker``: a number more than 0."""
    return _positive_number(text, "a number")


def positive_seconds(text: str) -> float:
    """``--timeout``, ``--lease-seconds``: a number of seconds more than 0."""
    return _positive_number(text, "a number of seconds", " seconds")


def existing_storage(url: str) -> Any:
    """The storage of a command that reads or steers a study: never created, never in memory (`check_lasting_url`)."""
    from rfopt.storage.database import check_lasting_url, open_storage

    check_lasting_url(url, create=False)
    return open_storage(url, create=False)


def load_study(args: argparse.Namespace, storage: Any = None) -> Any:
    """The study ``--study`` names in ``--storage`` (or the storage's only study), for a command that reads or steers
    it (`existing_storage`)."""
    import rfopt

    storage = storage if storage is not None else existing_storage(args.storage)
    return rfopt.load_study(one_study(args, storage), storage)


def one_study(args: argparse.Namespace, storage: Any) -> str:
    """The study a command reads or steers: ``--study``, or the storage's only study (refused, naming them, where it
    holds several or none)."""
    if args.study_name is not None:
        return args.study_name
    names = sorted(s.study_name for s in storage.get_all_studies())
    if len(names) == 1:
        return names[0]
    have = f"holds {len(names)}: {', '.join(names)}" if names else "holds none"
    raise Refusal(f"which study? {args.storage} {have}; name one with --study NAME")


def absolute_sqlite(storage: str) -> str:
    prefix = "sqlite:///"
    if storage.startswith(prefix) and not storage.startswith(prefix + "/"):
        return prefix + str(Path(storage[len(prefix):]).resolve())
    return storage
