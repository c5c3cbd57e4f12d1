"""``rfopt dashboard``: optuna-dashboard with rfopt's trial comparison and controls (`rfopt.dashboard`), on a storage
that exists already."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from .arguments import absolute_sqlite, add_command, port, storage_argument


def register(commands: Any) -> None:
    dashboard = add_command(
        commands,
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
    storage_argument(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    dashboard.add_argument("--port", type=port, default=8080, help="port, 1 to 65535 (default: %(default)s)")
    dashboard.add_argument("--token", help="token every request must carry; default: $RFOPT_DASHBOARD_TOKEN, or, "
                           "bound to a non-local address, a generated one (printed)")
    dashboard.add_argument("--artifact-dir", default="rfopt-artifacts", help="where files uploaded through the "
                           "dashboard go (default: %(default)s); rfopt's own artifacts are found in each study's "
                           "checkpoint directory")
    dashboard.set_defaults(handler=serve_dashboard)


def serve_dashboard(args: argparse.Namespace) -> int:
    from rfopt.dashboard import serve
    from rfopt.storage.database import check_lasting_url

    check_lasting_url(args.storage, create=False)  # a dashboard only shows a study: it never creates the database
    serve(absolute_sqlite(args.storage), host=args.host, port=args.port, token=args.token,
          artifact_dir=args.artifact_dir)
    return 0
