"""optuna-dashboard with rfopt's study page and controls, in one server: ``rfopt dashboard``.

    rfopt dashboard --storage sqlite:///rfopt.db        # then open http://127.0.0.1:8080/rfopt

The server is optuna-dashboard's own Bottle app (studies, plots, artifacts, its "Fail trial"
button, which the engine honours at the trial's next chunk boundary) with rfopt's routes added
under ``/rfopt`` (the pages themselves are `rfopt.pages`):

- ``GET /`` leads to ``/rfopt``: every study with its trials by state, its best value, and whether a process runs it.
  Every optuna-dashboard page gets a link to the rfopt page of the study it shows (bottom right), and rfopt's pages
  link to optuna-dashboard's.
- ``GET /rfopt/studies/<study_id>``: one study, comparison first: who runs it, what trains now (trial, chunk c of C,
  step s of S, since when, ETAs) and the compute spent against a run without pruning, the leaderboard (best first,
  sortable, with lineage and times), "why it wins" (parallel coordinates, each param against the value, the same eval
  prompt's completions side by side: ``GET /rfopt/studies/<study_id>/compare``), one chart per metric with every trial
  overlaid (`rfopt.charts`; steps of a chunk still training dashed), then each trial with its controls (pause, resume,
  stop; cancel a WAITING clone; withdraw a pending request; a clone form pre-filled with the trial's whole config) and
  its eval samples (``GET /rfopt/studies/<study_id>/trials/<number>/samples``, loaded when opened).
- ``GET /rfopt/api/studies/<study_id>/page``: the page's parts as JSON, with an ETag fingerprinting the stored data
  they show (`rfopt.pages.data_version`): asked with ``If-None-Match``, the answer is 304 while nothing changed. The
  page asks every 5 s while a process runs the study and updates only the parts (and charts) that changed; while
  nobody runs it, it stops asking until you act on the page or come back to it.
- The charts are drawn by the plotly.js that the ``plotly`` package bundles, served from
  ``/rfopt/static/plotly-<version>.min.js`` (cached for good, gzip when asked): nothing is fetched
  from outside. The page's own script and style are ``/rfopt/static/rfopt.js`` and ``rfopt.css``
  (files in ``rfopt/static``).
- ``POST /rfopt/api/studies/<study_id>/trials/<number>/pause`` (``resume``, ``stop``, ``cancel``),
  ``.../withdraw`` with a JSON body ``{"op": "stop"}``, and ``.../clone`` with a JSON body
  ``{"set": ["learning_rate=2e-6"], "warm_start": true}`` (or ``{"overrides": {"learning_rate": 2e-6}}``;
  ``"check_only": true`` checks the clone and writes nothing); ``GET .../config`` gives the clone form's fields
  (`rfopt.configform`) and whether a warm start is possible. ``POST /rfopt/api/studies/<study_id>/halt`` asks every
  process running the study to stop at its trials' next chunk boundary (`rfopt.ops.halt`).
  They call `rfopt.ops`, as the Python API and the command line do: pause, resume and stop are
  requests stored on the trial, applied by the process running the study at the trial's next chunk
  boundary; cancel and withdraw take effect at once, or are refused when the engine got there first.
  An op that cannot apply answers 400 with the reason and writes nothing.
  ``GET /rfopt/api/studies/<study_id>/trials`` gives the trials as the page shows them, as JSON.

Security: optuna-dashboard has no authentication, and its API can delete a study. Bound to a
loopback address (the default), the server answers only requests addressed to a loopback name
(no DNS rebinding) and refuses cross-origin writes. Bound to any other address it needs a token
on *every* request, optuna-dashboard's included: ``--token``, else ``RFOPT_DASHBOARD_TOKEN``, else
a generated one, printed at startup. Send ``Authorization: Bearer <token>``, or open
``/rfopt?token=<token>`` once in a browser, which keeps it in a cookie. No token: 401; a wrong
one: 403.

Clones are checked here before anything is written (`rfopt.ops.clone`). Where the study's own code
(its reward functions) cannot be imported in this process, the clone is still checked in every other
way and made, and the reply says so: the process running the study imports that code.

Artifacts: a running study keeps its trials' artifacts up to date after each chunk (`rfopt.artifacts`),
in ``<checkpoint dir>/artifacts``; the dashboard finds each study's artifacts there by itself
(`rfopt.artifacts.StudyArtifacts`).
"""

from __future__ import annotations

import functools
import gzip
import hmac
import html
import importlib.resources
import ipaddress
import json
import logging
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from http.cookies import SimpleCookie
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as _wsgiref_server

import optuna

from .. import compat, ops
from . import pages
from ..artifacts import StudyArtifacts
from ..configform import form_fields
from ..errors import Refusal
from ..schema import TrialRecord, json_safe, study_attrs, study_record

logger = logging.getLogger("rfopt")

TOKEN_ENV = "RFOPT_DASHBOARD_TOKEN"


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

    from ..storage import open_storage

    if isinstance(storage, str):  # as optuna-dashboard does: no cache in front of the storage, others write to it
        storage = open_storage(storage, cache=False)
        storage = optuna.storages.get_storage(storage) if isinstance(storage, str) else storage
    app = optuna_dashboard.wsgi(storage, artifact_store=StudyArtifacts(storage, artifact_dir))
    _add_routes(app, storage)
    return _Guard(_Backlink(app), token=token, loopback=loopback)


def _add_routes(app: Any, storage: optuna.storages.BaseStorage) -> None:  # noqa: C901 - debt (issue 24)
    from bottle import HTTPResponse, redirect, request

    def fail(status: int, message: str) -> HTTPResponse:
        return HTTPResponse(json.dumps({"error": message}), status=status, headers={"Content-Type": "application/json"})

    def study_or_404(study_id: int) -> optuna.Study:
        try:
            name = storage.get_study_name_from_id(study_id)
        except KeyError:
            raise fail(404, f"no study with id {study_id}") from None
        return optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler())

    def json_body() -> dict[str, Any]:
        # JSON only: a cross-site HTML form cannot send it without a CORS preflight this server never grants.
        if request.content_length and not request.content_type.startswith("application/json"):
            raise fail(415, "send the request body as JSON (Content-Type: application/json)")
        raw = request.body.read() or b"{}"
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise fail(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise fail(400, "the request body must be a JSON object")
        return body

    def by() -> str:
        return f"dashboard ({request.remote_addr or 'unknown'})"

    def page_of(study_id: int, since: str | None = None) -> tuple[str, pages.StudyPage | None]:
        """The study's data version, and its page unless the version is `since` (the page has it already)."""
        study = study_or_404(study_id)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        live = ops.liveness(study, trials)
        version = pages.data_version(trials, live, study_attrs(study))
        if version == since:
            return version, None
        return version, pages.study_page(study, trials, live, version)

    @app.get("/")
    def root() -> Any:
        return redirect("/rfopt", 302)

    @app.get("/rfopt")
    def index_page() -> Any:
        return _html(pages.render_index(ops.summaries(storage)))

    @app.get("/rfopt/studies/<study_id:int>")
    def study_page(study_id: int) -> Any:
        try:
            _, page = page_of(study_id)
        except HTTPResponse:
            return _html(pages.render_missing(study_id), 404)
        return _html(pages.render_study(page))

    @app.get("/rfopt/api/studies/<study_id:int>/page")
    def page_api(study_id: int) -> Any:
        since = request.headers.get("If-None-Match", "").strip('"') or None
        version, page = page_of(study_id, since)
        headers = {"ETag": f'"{version}"', "Cache-Control": "no-cache"}
        if page is None:
            return HTTPResponse(status=304, headers=headers)
        return HTTPResponse(json.dumps(page.to_json()), headers={**headers, "Content-Type": "application/json"})

    @app.get("/rfopt/studies/<study_id:int>/trials/<number:int>/samples")
    def samples_part(study_id: int, number: int) -> Any:
        study = study_or_404(study_id)
        trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if trial is None:
            return _html(f"<p>study {html.escape(study.study_name)} has no trial {number}</p>", 404)
        return _html(pages.render_samples(TrialRecord(trial)))

    @app.get("/rfopt/studies/<study_id:int>/compare")
    def side_by_side(study_id: int) -> Any:
        study = study_or_404(study_id)
        direction = study.directions[0] if len(study.directions) == 1 else None
        return _html(pages.render_side_by_side(study.get_trials(deepcopy=False), direction))

    @app.get("/rfopt/static/<name:re:(?:rfopt|backlink)\\.(?:js|css)>")
    def static_file(name: str) -> Any:
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return HTTPResponse(_static(name), headers={"Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache"})

    @app.get("/rfopt/static/plotly-<version>.min.js")
    def plotly_js(version: str) -> Any:
        # The plotly package's bundled plotly.js, under a versioned name: cached for good, sent compressed.
        if version != pages.plotly_version():
            return HTTPResponse("no such plotly.js version", status=404)
        headers = {"Content-Type": "text/javascript; charset=utf-8", "Cache-Control": "public, max-age=31536000, immutable",
                   "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return HTTPResponse(_plotly_gzip(), headers={**headers, "Content-Encoding": "gzip"})
        return HTTPResponse(_plotly_js(), headers=headers)

    @app.get("/rfopt/api/studies/<study_id:int>/trials")
    def trials_api(study_id: int) -> Any:
        study = study_or_404(study_id)
        return {"trials": [json_safe(v.to_json()) for v in pages.trial_views(study.get_trials(deepcopy=False), study)]}

    @app.get("/rfopt/api/studies/<study_id:int>/trials/<number:int>/config")
    def config_api(study_id: int, number: int) -> Any:
        study = study_or_404(study_id)
        trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if trial is None:
            return fail(404, f"study {study.study_name!r} has no trial {number}")
        record = TrialRecord(trial)
        if record.config_json is None:
            return fail(400, f"trial {number} has no rfopt config to clone")
        with _FIRST_IMPORT:
            fields = form_fields(record.config_json, trial.params)
        return {"trial": number, "fields": [f.to_json() for f in fields], "warm_start": _warm_start(study, record)}

    @app.post("/rfopt/api/studies/<study_id:int>/halt")
    def halt(study_id: int) -> Any:
        json_body()
        study = study_or_404(study_id)
        try:
            ops.halt(study, by=by())
        except ops.OpError as exc:
            return fail(400, str(exc))
        return {"op": "halt", "message": f"study {study.study_name}: stop requested; every process running it stops "
                "at its trials' next chunk boundary, and the trials stay resumable (run the study again to continue)"}

    @app.post("/rfopt/api/studies/<study_id:int>/trials/<number:int>/<op:re:pause|resume|stop>")
    def control(study_id: int, number: int, op: str) -> Any:
        json_body()
        study = study_or_404(study_id)
        try:
            ops.request(study, number, op, by=by())
        except ops.OpError as exc:
            return fail(400, str(exc))
        return {"trial": number, "op": op, "message": f"trial {number}: {op} requested; it applies at the trial's next chunk boundary"}

    @app.post("/rfopt/api/studies/<study_id:int>/trials/<number:int>/cancel")
    def cancel(study_id: int, number: int) -> Any:
        json_body()
        study = study_or_404(study_id)
        try:
            cancelled = ops.cancel(study, number, by=by())
        except ops.OpError as exc:
            return fail(400, str(exc))
        return {"trial": number, "op": "cancel", "message": f"trial {number}: {cancelled.reason}; it left the queue"}

    @app.post("/rfopt/api/studies/<study_id:int>/trials/<number:int>/withdraw")
    def withdraw(study_id: int, number: int) -> Any:
        body = json_body()
        study = study_or_404(study_id)
        op = body.get("op")
        if set(body) != {"op"} or not isinstance(op, str):
            return fail(400, "send {\"op\": \"pause\"} (or resume, stop): the pending request to withdraw")
        try:
            ops.withdraw(study, number, op, by=by())
        except ops.OpError as exc:
            return fail(400, str(exc))
        return {"trial": number, "op": "withdraw", "message": f"trial {number}: {op} request withdrawn; it will not apply"}

    @app.post("/rfopt/api/studies/<study_id:int>/trials/<number:int>/clone")
    def clone(study_id: int, number: int) -> Any:
        from ..overrides import parse_assignments

        body = json_body()
        study = study_or_404(study_id)
        unknown = sorted(set(body) - {"overrides", "set", "warm_start", "check_only"})
        if unknown:
            return fail(400, f"unknown fields {unknown}; send overrides (an object) or set (FIELD=VALUE strings), "
                        "warm_start and check_only")
        overrides = body.get("overrides") or {}
        if not isinstance(overrides, dict):
            return fail(400, "overrides must be a JSON object, e.g. {\"learning_rate\": 2e-6}")
        assignments = body.get("set") or []
        if not isinstance(assignments, list) or not all(isinstance(a, str) for a in assignments):
            return fail(400, "set must be a list of FIELD=VALUE strings, e.g. [\"learning_rate=2e-6\"]")
        warm_start, check_only = body.get("warm_start", False), body.get("check_only", False)
        if not isinstance(warm_start, bool):
            return fail(400, "warm_start must be true or false")
        if not isinstance(check_only, bool):
            return fail(400, "check_only must be true or false")
        try:
            overrides = {**overrides, **parse_assignments([a for a in assignments if a.strip()])}
            with _FIRST_IMPORT:
                made = ops.clone_in_study(study, number, overrides, warm_start=warm_start, by=by(),
                                          check_only=check_only)
        except Refusal as exc:  # OpError, ConfigError (a bad FIELD=VALUE too): nothing was written
            return fail(400, str(exc))
        if check_only:
            return {"trial": None, "parent": number, "overrides": dict(made.overrides), "warm_start": warm_start,
                    "notes": list(made.notes), "message": made.describe_check(number, warm_start)}
        return {
            "trial": made.number,
            "parent": number,
            "overrides": dict(made.overrides),
            "warm_start": warm_start,
            "notes": list(made.notes),
            "message": made.describe(number, warm_start),
        }


class _FirstImport:
    """Held while a request imports TRL and transformers the first time: their lazy modules are not safe to import
    from two threads at once (a request could fail with "cannot import name 'GRPOConfig' from 'trl'"). Once TRL is
    imported, it is not held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def __enter__(self) -> None:
        if not self._done:
            with self._lock:
                from trl import GRPOConfig  # noqa: F401 - imported once, under the lock

                self._done = True

    def __exit__(self, *exc: object) -> None:
        pass


_FIRST_IMPORT = _FirstImport()


def _warm_start(study: optuna.Study, record: TrialRecord) -> dict[str, Any]:
    """Whether a clone of the trial can start from its latest checkpoint, and why not."""
    from ..checkpoints import CheckpointStore

    where = study_record(study).checkpoint_dir
    if record.committed == 0 or where is None:
        return {"available": False, "why": "it has no checkpoint yet (no chunk committed)"}
    if record.num_units is not None and record.committed >= record.num_units:
        return {"available": False, "why": f"it trained all {record.num_units} chunks: a warm clone would have "
                "nothing left to train"}
    try:
        latest = CheckpointStore(where).latest(record.number)
    except Exception as exc:  # noqa: BLE001 - a store this process cannot reach: say so, offer no warm start
        return {"available": False, "why": f"its checkpoint store {where} cannot be read here ({exc})"}
    if latest is None:
        return {"available": False, "why": f"its checkpoint is not in {where} (kept only while it trains)"}
    return {"available": True, "why": f"from its checkpoint after chunk {record.committed}"}


def _html(text: str, status: int = 200) -> Any:
    from bottle import HTTPResponse

    csp = (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; frame-ancestors 'none'"
    )
    return HTTPResponse(
        text, status=status, headers={"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": csp}
    )


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


# ---------------------------------------------------------------------- access checks
class _Guard:
    """WSGI middleware in front of the whole app: the token, the Host check, no cross-origin writes."""

    def __init__(self, app: Callable, *, token: str | None, loopback: bool) -> None:
        self.app = app
        self.token = token
        self.loopback = loopback

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        host = environ.get("HTTP_HOST", "")
        if self.loopback and host and not _is_loopback(_hostname(host)):
            return _refuse(start_response, 403, f"this dashboard answers only requests to localhost, not to {host!r}")
        origin = environ.get("HTTP_ORIGIN")
        if method not in ("GET", "HEAD", "OPTIONS") and origin and urllib.parse.urlsplit(origin).netloc != host:
            return _refuse(start_response, 403, f"cross-origin request from {origin} refused")
        if self.token is None:
            return self.app(environ, start_response)
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        cookie_name = f"rfopt_token_{environ.get('SERVER_PORT', '')}"
        if method == "GET" and "token" in query:
            if not self._matches(query["token"][0]):
                return _refuse(start_response, 403, "wrong token")
            # Keep the token in a cookie and drop it from the address bar (and from history and referrers).
            rest = urllib.parse.urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs])
            location = environ.get("PATH_INFO", "/") + (f"?{rest}" if rest else "")
            start_response("303 See Other", [
                ("Location", location),
                ("Set-Cookie", f"{cookie_name}={self.token}; Path=/; HttpOnly; SameSite=Lax"),
                ("Content-Length", "0"),
            ])
            return [b""]
        given = _bearer(environ.get("HTTP_AUTHORIZATION", ""))
        if given is None:
            morsel = SimpleCookie(environ.get("HTTP_COOKIE", "")).get(cookie_name)
            given = morsel.value if morsel is not None else None
        if given is None:
            return _refuse(start_response, 401, "a token is required: send 'Authorization: Bearer <token>', "
                           "or open /rfopt?token=<token> (printed by rfopt dashboard at startup)")
        if not self._matches(given):
            return _refuse(start_response, 403, "wrong token")
        return self.app(environ, start_response)

    def _matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.token.encode())


def _refuse(start_response: Callable, status: int, message: str) -> list[bytes]:
    reason = {401: "Unauthorized", 403: "Forbidden"}[status]
    body = json.dumps({"error": message}).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if status == 401:
        headers.append(("WWW-Authenticate", 'Bearer realm="rfopt"'))
    start_response(f"{status} {reason}", headers)
    return [body]


def _bearer(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _hostname(host_header: str) -> str:
    return urllib.parse.urlsplit(f"//{host_header}").hostname or ""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token: str | None = None) -> tuple[str | None, bool]:
    """The token the server will require, and whether it was generated: a non-loopback bind always has one."""
    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None and not _is_loopback(host):
        return secrets.token_urlsafe(24), True
    return token, False


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
            raise FileNotFoundError(f"no SQLite file {path.resolve()}; give the storage your study runs in (--storage)")
    token, _ = resolve_token(host, token)
    server_class = DashboardServer
    if ":" in host:
        server_class = type("DashboardServer6", (DashboardServer,), {"address_family": socket.AF_INET6})
    app = create_app(storage, token=token, loopback=_is_loopback(host), artifact_dir=artifact_dir)
    try:
        server = _wsgiref_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port or --host") from exc
    server.token = token
    server.public_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
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


# ---------------------------------------------------------------------- static files
@functools.cache
def _static(name: str) -> bytes:
    return importlib.resources.files("rfopt").joinpath("static", name).read_bytes()


@functools.cache
def _plotly_js() -> bytes:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


@functools.cache
def _plotly_gzip() -> bytes:
    return gzip.compress(_plotly_js(), compresslevel=6, mtime=0)
