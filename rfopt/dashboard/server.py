"""The dashboard's server: optuna-dashboard's Bottle app with rfopt's routes (`rfopt.dashboard.routes`), a link from
optuna-dashboard's pages to rfopt's, and the access checks in front of both (`rfopt.dashboard.access`).

    >>> server = make_server("sqlite:///rfopt.db", port=0)  # bound to a free port   # doctest: +SKIP
    >>> server.serve_forever()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as _wsgiref_server

import optuna

from rfopt.errors import MissingFile
from rfopt import compat
from rfopt.engine.outputs.artifacts import StudyArtifacts

from . import actions
from .access import TOKEN_ENV, Guard, is_loopback, resolve_token
from .routes import add_routes


# ---------------------------------------------------------------------- the app
def create_app(
    storage: str | optuna.storages.BaseStorage,
    *,
    token: str | None = None,
    loopback: bool = True,
    artifact_dir: str | os.PathLike = "rfopt-artifacts",
) -> Callable:
    """optuna-dashboard's WSGI app with rfopt's routes, behind rfopt's access checks.

    `token`: required on every request when given. `loopback`: the server is bound to a loopback
    address, so only requests addressed to a loopback name are answered. `artifact_dir`: where files
    uploaded through the dashboard go (rfopt's own artifacts are found in each study's checkpoint dir).
    """
    import optuna_dashboard

    from rfopt.storage.database import open_storage, read_only_sqlite

    if isinstance(storage, str):  # as optuna-dashboard does: no cache in front of the storage, others write to it
        # A SQLite file this user cannot write (a shared, finished study) is opened read-only: every page shows, and
        # each button answers that the database is read-only. It is never created.
        storage = open_storage(read_only_sqlite(storage) or storage, cache=False, create=False)
        storage = optuna.storages.get_storage(storage) if isinstance(storage, str) else storage
    app = optuna_dashboard.wsgi(storage, artifact_store=StudyArtifacts(storage, artifact_dir))
    add_routes(app, storage)
    return Guard(_Backlink(app), token=token, loopback=loopback)


# ---------------------------------------------------------------------- optuna-dashboard -> rfopt
_BACKLINK = (b"<a id='rfopt-backlink' href='/rfopt' style='position:fixed;right:14px;bottom:14px;z-index:2000;"
             b"background:#1f77b4;color:#fff;padding:6px 12px;border-radius:4px;font:14px sans-serif;"
             b"text-decoration:none;box-shadow:0 1px 4px rgba(0,0,0,.3)'>rfopt page &#8599;</a>"
             b"<script src='/rfopt/static/backlink.js'></script>")


class _Backlink:
    """WSGI middleware: optuna-dashboard's pages get a link to rfopt's page of the study they show (bottom right;
    ``/rfopt/static/backlink.js`` keeps it pointing at the study in the address bar as the single-page app moves)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "GET" or not (path == "/dashboard" or path.startswith("/dashboard/")):
            return self.app(environ, start_response)
        captured: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            captured.update(status=status, headers=headers, exc_info=exc_info)
            return lambda data: None

        body_parts = self.app(environ, capture)
        try:
            body = b"".join(body_parts)
        finally:
            if hasattr(body_parts, "close"):
                body_parts.close()
        headers = captured["headers"]
        kind = next((v for k, v in headers if k.lower() == "content-type"), "")
        encoded = any(k.lower() == "content-encoding" for k, _ in headers)
        if captured["status"].startswith("200") and kind.startswith("text/html") and not encoded:
            linked = compat.with_backlink(body, _BACKLINK)
            if linked is not None:
                body = linked
                headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
                headers.append(("Content-Length", str(len(body))))
        start_response(captured["status"], headers, captured["exc_info"])
        return [body]


# ---------------------------------------------------------------------- the server
class DashboardServer(ThreadingMixIn, WSGIServer):
    """A threaded wsgiref server (the browser's parallel requests do not queue behind a slow one)."""

    daemon_threads = True
    token: str | None = None
    public_host: str = "127.0.0.1"

    def url(self, path: str = "/rfopt", with_token: bool = False) -> str:
        host = f"[{self.public_host}]" if ":" in self.public_host else self.public_host
        query = f"?token={urllib.parse.quote(self.token)}" if with_token and self.token else ""
        return f"http://{host}:{self.server_port}{path}{query}"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_server(
    storage: str | optuna.storages.BaseStorage,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    artifact_dir: str | os.PathLike = "rfopt-artifacts",
) -> DashboardServer:
    """A bound, not yet serving, dashboard server (port 0: any free port). Its `token` is set when one is required."""
    if isinstance(storage, str) and storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///"):])
        if not path.exists():
            raise MissingFile(f"no SQLite file {path.resolve()}; give the storage your study runs in (--storage)")
    token, _ = resolve_token(host, token)
    server_class = DashboardServer
    if ":" in host:
        server_class = type("DashboardServer6", (DashboardServer,), {"address_family": socket.AF_INET6})
    app = create_app(storage, token=token, loopback=is_loopback(host), artifact_dir=artifact_dir)
    try:
        server = _wsgiref_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port or --host") from exc
    server.token = token
    server.public_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    # TRL's import and GRPOConfig's fields take seconds the first time: done now, not when the first clone form opens.
    threading.Thread(target=actions.warm_up, name="rfopt-warm-up", daemon=True).start()
    return server


def serve(
    storage: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    artifact_dir: str | os.PathLike = "rfopt-artifacts",
    out: TextIO = sys.stdout,
) -> None:
    """Serve until interrupted, after printing where (with the token when one is required)."""
    given = token or os.environ.get(TOKEN_ENV)
    server = make_server(storage, host=host, port=port, token=token, artifact_dir=artifact_dir)
    print(f"rfopt dashboard for {storage}", file=out)
    print(f"  rfopt controls:   {server.url('/rfopt', with_token=True)}", file=out)
    print(f"  optuna-dashboard: {server.url('/dashboard')}", file=out)
    if server.token is not None:
        origin = "generated for this run" if not given else "from --token" if token else f"from {TOKEN_ENV}"
        print(f"  token ({origin}): {server.token}", file=out)
        print("  every request needs it: open the rfopt link above once in a browser (it keeps a cookie), "
              "or send 'Authorization: Bearer <token>'", file=out)
    out.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
