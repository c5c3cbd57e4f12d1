"""optuna-dashboard with rfopt's study page and controls, in one server: ``rfopt dashboard``.

    rfopt dashboard --storage sqlite:///rfopt.db        # then open http://127.0.0.1:8080/rfopt

The server is optuna-dashboard's own Bottle app (studies, plots, artifacts, its "Fail trial"
button, which the engine honours at the trial's next chunk boundary) with rfopt's routes added
under ``/rfopt``:

- ``GET /rfopt``: the storage's studies. ``GET /rfopt/studies/<study_id>``: one study, comparison first:
  whether a process is running it (`rfopt.ops.liveness`; a warning when WAITING trials have nobody to
  start them), a leaderboard of every trial (best first, sortable by any column), one chart per metric
  with every trial overlaid (`rfopt.charts`: the objective per chunk, TRL's per-step logs on the global
  step), then each trial with its controls (pause, resume, stop; cancel a WAITING clone; withdraw a
  pending request; clone with ``FIELD=VALUE`` overrides and an optional warm start), the answer to an
  op shown next to it, and its eval samples with each reward function's score
  (``GET /rfopt/studies/<study_id>/trials/<number>/samples``, loaded when opened). The page refreshes
  its data every 5 s; an open clone form and what is typed in it stay as they are.
- The charts are drawn by the plotly.js that the ``plotly`` package bundles, served from
  ``/rfopt/static/plotly-<version>.min.js`` (cached for good, gzip when asked): nothing is fetched
  from outside. The page's own script and style are ``/rfopt/static/rfopt.js`` and ``rfopt.css``
  (files in ``rfopt/static``).
- ``POST /rfopt/api/studies/<study_id>/trials/<number>/pause`` (``resume``, ``stop``, ``cancel``),
  ``.../withdraw`` with a JSON body ``{"op": "stop"}``, and ``.../clone`` with a JSON body
  ``{"set": ["learning_rate=2e-6"], "warm_start": true}`` (or ``{"overrides": {"learning_rate": 2e-6}}``).
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
import math
import os
import secrets
import socket
import sys
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as _wsgiref_server

import optuna
from optuna.trial import TrialState

from . import ops
from .artifacts import StudyArtifacts
from .charts import colour, comparison
from .compat import study_id_of
from .schema import TrialRecord, json_safe, study_record

logger = logging.getLogger("rfopt")

TOKEN_ENV = "RFOPT_DASHBOARD_TOKEN"
_STATE_ORDER = {"RUNNING": 0, "WAITING": 1, "COMPLETE": 2, "PRUNED": 3, "FAIL": 4}


# ---------------------------------------------------------------------- trials as the page shows them
@dataclass
class TrialView:
    """One trial, as the control page shows it."""

    number: int
    state: str
    """Optuna's state name, or ``CANCELLED`` for a clone cancelled before it started."""
    paused: bool
    pending: list[str]
    """Ops requested and not applied (nor withdrawn) yet, oldest first."""
    steps_done: int
    """Chunks trained, a warm clone's inherited ones included."""
    num_steps: int | None
    value: float | None
    """The last reported value (the final value once COMPLETE)."""
    value_step: int | None
    """The chunk of `value`."""
    params: dict[str, Any]
    held_as: dict[str, str]
    """A clone's fields whose values its Optuna params hold under an alternate name (`rfopt.ops.held_as`)."""
    clone_of: dict[str, Any] | None
    reason: str | None
    can_clone: bool
    can_cancel: bool
    """A WAITING clone no process has started (`rfopt.ops.cancel`)."""
    colour: str
    eval: dict[str, float] = field(default_factory=dict)
    """The eval metrics of its latest chunk."""
    sample_units: list[int] = field(default_factory=list)
    """The units whose eval samples are stored."""

    @classmethod
    def of(cls, trial: optuna.trial.FrozenTrial) -> TrialView:
        record = TrialRecord(trial)
        units = record.unit_metrics()
        values = trial.intermediate_values
        return cls(
            number=trial.number,
            state=record.shown_state,
            paused=record.paused,
            pending=[r.op for r in record.pending],
            steps_done=record.committed,
            num_steps=record.num_units,
            value=record.value,
            value_step=max(values) if values else None,
            params=dict(trial.params),
            held_as=ops.held_as(trial),
            clone_of=None if record.lineage is None else record.lineage.to_attr(),
            reason=record.end_reason,  # a cancelled clone's too: cancelling stores it as the fail reason
            can_clone=record.config_json is not None,
            can_cancel=trial.state == TrialState.WAITING and record.lineage is not None,
            colour=colour(trial.number),
            eval=units[-1].eval if units else {},
            sample_units=sorted(record.samples()),
        )

    @property
    def controls(self) -> list[str]:
        """The control buttons shown for this trial (the server checks each request again)."""
        shown = []
        if self.state == "RUNNING" and "stop" not in self.pending:
            shown.append("resume" if self.paused or self.pending[-1:] == ["pause"] else "pause")
            shown.append("stop")
        if self.can_cancel:
            shown.append("cancel")
        return shown + (["clone"] if self.can_clone else [])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["controls"] = self.controls
        return data


def trial_views(trials: Iterable[optuna.trial.FrozenTrial]) -> list[TrialView]:
    """Every trial: running first, then waiting, finished; by number within each."""
    views = [TrialView.of(t) for t in trials]
    return sorted(views, key=lambda v: (_STATE_ORDER.get(v.state, 5), v.number))


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

    from .storage import open_storage

    if isinstance(storage, str):  # as optuna-dashboard does: no cache in front of the storage, others write to it
        storage = open_storage(storage, cache=False)
        storage = optuna.storages.get_storage(storage) if isinstance(storage, str) else storage
    app = optuna_dashboard.wsgi(storage, artifact_store=StudyArtifacts(storage, artifact_dir))
    _add_routes(app, storage)
    return _Guard(app, token=token, loopback=loopback)


def _add_routes(app: Any, storage: optuna.storages.BaseStorage) -> None:
    from bottle import HTTPResponse, request

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

    @app.get("/rfopt")
    def index_page() -> Any:
        return _html(_render_index(storage.get_all_studies()))

    @app.get("/rfopt/studies/<study_id:int>")
    def study_page(study_id: int) -> Any:
        try:
            study = next(s for s in storage.get_all_studies() if study_id_of(s) == study_id)
        except StopIteration:
            return _html(_page("no such study", f"<p>No study with id {study_id}. <a href='/rfopt'>All studies</a></p>"), 404)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        return _html(_render_study(study, trials, ops.liveness(study_or_404(study_id), trials)))

    @app.get("/rfopt/studies/<study_id:int>/trials/<number:int>/samples")
    def samples_part(study_id: int, number: int) -> Any:
        study = study_or_404(study_id)
        trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if trial is None:
            return _html(f"<p>study {_e(study.study_name)} has no trial {number}</p>", 404)
        return _html(_render_samples(TrialRecord(trial)))

    @app.get("/rfopt/static/<name:re:rfopt\\.(?:js|css)>")
    def static_file(name: str) -> Any:
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return HTTPResponse(_static(name), headers={"Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache"})

    @app.get("/rfopt/static/plotly-<version>.min.js")
    def plotly_js(version: str) -> Any:
        # The plotly package's bundled plotly.js, under a versioned name: cached for good, sent compressed.
        if version != _plotly_version():
            return HTTPResponse("no such plotly.js version", status=404)
        headers = {"Content-Type": "text/javascript; charset=utf-8", "Cache-Control": "public, max-age=31536000, immutable",
                   "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return HTTPResponse(_plotly_gzip(), headers={**headers, "Content-Encoding": "gzip"})
        return HTTPResponse(_plotly_js(), headers=headers)

    @app.get("/rfopt/api/studies/<study_id:int>/trials")
    def trials_api(study_id: int) -> Any:
        study = study_or_404(study_id)
        return {"trials": [json_safe(v.to_json()) for v in trial_views(study.get_trials(deepcopy=False))]}

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
        from .config import parse_assignments

        body = json_body()
        study = study_or_404(study_id)
        unknown = sorted(set(body) - {"overrides", "set", "warm_start"})
        if unknown:
            return fail(400, f"unknown fields {unknown}; send overrides (an object) or set (FIELD=VALUE strings), and warm_start")
        overrides = body.get("overrides") or {}
        if not isinstance(overrides, dict):
            return fail(400, "overrides must be a JSON object, e.g. {\"learning_rate\": 2e-6}")
        assignments = body.get("set") or []
        if not isinstance(assignments, list) or not all(isinstance(a, str) for a in assignments):
            return fail(400, "set must be a list of FIELD=VALUE strings, e.g. [\"learning_rate=2e-6\"]")
        warm_start = body.get("warm_start", False)
        if not isinstance(warm_start, bool):
            return fail(400, "warm_start must be true or false")
        try:
            overrides = {**overrides, **parse_assignments([a for a in assignments if a.strip()])}
            made = ops.clone_in_study(study, number, overrides, warm_start=warm_start, by=by())
        except ValueError as exc:  # OpError, ConfigError, a bad FIELD=VALUE: nothing was written
            return fail(400, str(exc))
        return {
            "trial": made.number,
            "parent": number,
            "overrides": dict(made.overrides),
            "warm_start": warm_start,
            "notes": list(made.notes),
            "message": made.describe(number, warm_start),
        }


def _html(text: str, status: int = 200) -> Any:
    from bottle import HTTPResponse

    csp = (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; frame-ancestors 'none'"
    )
    return HTTPResponse(
        text, status=status, headers={"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": csp}
    )


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


# ---------------------------------------------------------------------- HTML
def _page(title: str, body: str, scripts: bool = False) -> str:
    head = "<link rel='stylesheet' href='/rfopt/static/rfopt.css'>"
    if scripts:
        head += (f"<script src='/rfopt/static/plotly-{_plotly_version()}.min.js' defer></script>"
                 "<script src='/rfopt/static/rfopt.js' defer></script>")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>{head}</head>"
        f"<body>{body}</body></html>"
    )


def _render_index(studies: list[Any]) -> str:
    rows = []
    for s in sorted(studies, key=study_id_of):
        kind = "rfopt" if study_record(s).planned else "optuna"
        rows.append(
            f"<tr><td><a href='/rfopt/studies/{study_id_of(s)}'>{_e(s.study_name)}</a></td><td>{kind}</td>"
            f"<td><a href='/dashboard/studies/{study_id_of(s)}'>optuna-dashboard</a></td></tr>"
        )
    table = "<table><tr><th>study</th><th>kind</th><th></th></tr>" + "".join(rows) + "</table>" if rows else "<p>No studies in this storage yet.</p>"
    return _page("rfopt studies", f"<h1>rfopt studies</h1>{table}<p><a href='/dashboard'>optuna-dashboard</a></p>")


def _render_study(study: Any, trials: list[optuna.trial.FrozenTrial], live: ops.Liveness) -> str:
    """The study page: who runs it, the leaderboard, the comparison charts, then each trial with its controls."""
    sid = study_id_of(study)
    record = study_record(study)
    single = len(study.directions) == 1
    direction = study.directions[0] if single else None
    objective = record.settings.get("objective", "objective")
    plan = record.plan
    views = trial_views(trials)
    compared = comparison(trials, direction, objective)
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    facts = [
        f"objective: {_e(objective)} ({direction.name.lower() if direction else 'multi-objective'})",
        f"{plan.num_chunks} chunks of {plan.num_rows} rows" if plan else "not an rfopt study: no controls",
    ]
    tally = ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items(), key=lambda kv: _STATE_ORDER.get(kv[0], 5)))
    header = (
        f"<h1>{_e(study.study_name)}</h1><p class='facts'>{' · '.join(facts)} · trials: {tally or 'none yet'} · "
        f"<a href='/dashboard/studies/{sid}'>open in optuna-dashboard</a> · <a href='/rfopt'>all studies</a></p>"
        "<p class='bar'><label><input type='checkbox' id='autorefresh' checked> refresh every 5 s</label> "
        "<span id='refreshed'></span><span id='status' role='status'></span></p>"
    )
    notice_class = "running" if live.running else "idle warn" if live.waiting_unattended else "idle"
    notice = f"<p id='liveness' class='notice {notice_class}' data-running='{str(live.running).lower()}'>{_e(live.message)}</p>"
    board = _render_leaderboard(views, compared.best, compared.best_label, direction)
    charts_html = "".join(
        f"<div class='chart' id='chart-{_slug(f.key)}' data-key='{_e(f.key)}'></div>" for f in compared.figures
    )
    figures = json.dumps([json_safe(f.to_json()) for f in compared.figures]).replace("</", "<\\/")
    charts_part = (
        "<section id='comparison'><h2>Trials compared</h2>"
        "<p class='hint'>One colour per trial in every chart; ★ marks the best trial, × where a trial was pruned, "
        "stopped or failed (hover: why). Per-step charts: TRL's logs on the global optimizer step, dotted lines at "
        "chunk boundaries, hollow circles the evaluation after each chunk. Click a legend entry to hide a trial.</p>"
        f"<div class='charts'>{charts_html or '<p>No trial has trained a chunk yet.</p>'}</div>"
        f"<script type='application/json' id='rfopt-figures'>{figures}</script></section>"
    )
    cards = "".join(_render_trial(sid, v, steerable=plan is not None) for v in views) or "<p>No trials yet.</p>"
    body = (
        f"{header}<div id='live' data-study='{sid}'>{notice}{board}{charts_part}"
        "<h2>Trials</h2><p class='hint'>Ops apply at the trial's next chunk boundary, in the process running the study.</p>"
        f"<main id='trials'>{cards}</main></div>"
    )
    return _page(f"{study.study_name} · rfopt", body, scripts=True)


def _render_leaderboard(views: list[TrialView], best: int | None, label: str, direction: Any) -> str:
    """Every trial in a table, best first; the page sorts it by any column (click a header)."""
    maximize = direction is not None and direction.name == "MAXIMIZE"
    params = list(dict.fromkeys(k for v in views for k in v.params))
    rewards = sorted({k for v in views for k in v.eval if k.startswith("rewards/") and k.endswith("/mean")})

    def rank(v: TrialView) -> tuple:
        key = (-v.value if maximize else v.value) if v.value is not None else float("inf")
        return (v.number != best, v.value is None, key, v.number)

    heads = [("trial", "num", "asc"), ("state", "text", "asc"), ("value", "num", "desc" if maximize else "asc"),
             ("at chunk", "num", "desc"), ("chunks trained", "num", "desc")]
    heads += [(p, "auto", "asc") for p in params]
    heads += [(f"eval {k[len('rewards/'):-len('/mean')]}", "num", "desc") for k in rewards]
    heads += [("why it ended", "text", "asc")]
    # A header may break after an underscore (soft_<wbr>format_<wbr>reward_<wbr>func), so that long reward names
    # do not widen the table past the window.
    head = "".join(f"<th data-kind='{kind}' data-first='{first}' title='sort by {_e(name)}'>"
                   f"{_e(name).replace('_', '_<wbr>')}</th>" for name, kind, first in heads)
    rows = []
    for v in sorted(views, key=rank):
        star = f" <span class='best'>★ {label}</span>" if v.number == best else ""
        name = f"<span class='name'><span class='swatch' style='background:{v.colour}'></span>trial {v.number}</span>"
        cells = [
            (v.number, f"{name}{star}"),
            (v.state, _e(v.state.lower())),
            (v.value, _num(v.value)),
            (v.value_step, _num(v.value_step)),
            (v.steps_done, f"{v.steps_done}" + (f"/{v.num_steps}" if v.num_steps else "")),
        ]
        cells += [_param_cell(v, p) for p in params]
        cells += [(v.eval.get(k), _num(v.eval.get(k))) for k in rewards]
        cells += [(v.reason or "", _e(v.reason or ""))]
        tds = "".join(f"<td data-sort='{_e('' if key is None else key)}'>{text}</td>" for key, text in cells)
        rows.append(f"<tr data-trial='{v.number}'>{tds}</tr>")
    return (
        "<section id='leaderboard'><h2>Leaderboard</h2>"
        f"<div class='table-scroll'><table class='leaderboard'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def _param_cell(v: TrialView, param: str) -> tuple[Any, str]:
    """A leaderboard cell: the trial's value of `param`; for a clone whose value Optuna holds under an alternate
    param (`rfopt.ops.held_as`), that value, marked, so that the column never reads as the parent's."""
    holder = v.held_as.get(param)
    if holder is not None:
        value = v.params[holder]
        why = (f"Optuna's param {param} cannot hold this clone's value (a categorical cannot gain a choice): it is the "
               f"param {holder}")
        return value, f"<span class='held' title='{_e(why)}'>{_e(_num(value))} ⚠</span>"
    return v.params.get(param), _e(_num(v.params[param])) if param in v.params else ""


def _render_trial(study_id: int, v: TrialView, steerable: bool) -> str:
    api = f"/rfopt/api/studies/{study_id}/trials/{v.number}"
    state = v.state + (" · paused" if v.paused else "")
    steps = f"{v.steps_done}" + (f"/{v.num_steps}" if v.num_steps else "") + " chunks trained"
    value = f"value {_num(v.value)}" if v.value is not None else "no value yet"
    notes = []
    if v.params:
        notes.append(", ".join(f"{_e(k)}={_e(_num(p))}" for k, p in v.params.items()))
    for field_param, holder in v.held_as.items():
        notes.append(f"<span class='held'>⚠ its {_e(field_param)} ({_e(_num(v.params[holder]))}) is not a choice of "
                     f"Optuna's param {_e(field_param)}: Optuna's params hold it as {_e(holder)}</span>")
    if v.clone_of:
        lineage = v.clone_of
        warm = f", warm from chunk {_e(lineage.get('start_unit', 0))}" if lineage.get("warm_start") else ""
        notes.append(f"clone of trial {_e(lineage.get('parent'))} with {_e(json.dumps(lineage.get('overrides', {})))}{warm}")
    if v.reason:
        notes.append(_e(v.reason))
    pending = "".join(
        f"<li><b>{_e(op)} requested</b>, applies at the next chunk boundary "
        + (f"<button type='button' class='op withdraw' data-op='withdraw' data-what='{_e(op)}' data-url='{api}/withdraw'>"
           f"Withdraw {_e(op)}</button>" if steerable else "")
        + "</li>"
        for op in v.pending
    )
    buttons = ""
    if steerable:
        for op in (o for o in v.controls if o != "clone"):
            buttons += f"<button type='button' class='op {op}' data-op='{op}' data-url='{api}/{op}'>{op.capitalize()}</button>"
        if "clone" in v.controls:
            buttons += (
                "<details class='clone'><summary>Clone…</summary><form>"
                "<textarea name='set' rows='3' cols='34' placeholder='one FIELD=VALUE per line, e.g.&#10;learning_rate=2e-6&#10;lora_r=8'></textarea>"
                "<label><input type='checkbox' name='warm_start'> warm start from its latest checkpoint</label>"
                f"<button type='button' class='op clone' data-op='clone' data-url='{api}/clone'>Clone</button>"
                "</form></details>"
            )
    samples = ""
    if v.sample_units:
        n = len(v.sample_units)
        samples = (
            f"<details class='samples' data-url='/rfopt/studies/{study_id}/trials/{v.number}/samples' "
            f"data-version='{v.sample_units[-1]}'><summary>Samples: eval completions and each reward function's score "
            f"({n} chunk{'s' if n > 1 else ''})</summary><div class='samples-body'>loading…</div></details>"
        )
    return (
        f"<section class='trial {v.state.lower()}' data-trial='{v.number}' data-state='{v.state}'>"
        f"<header><span class='swatch' style='background:{v.colour}'></span><h3>Trial {v.number}</h3>"
        f"<span class='state'>{_e(state)}</span><span class='progress'>{steps}</span><span>{value}</span>"
        f"<a href='/dashboard/studies/{study_id}/trials?numbers={v.number}'>details</a></header>"
        f"<p class='notes'>{' · '.join(notes)}</p>" + (f"<ul class='pending'>{pending}</ul>" if pending else "")
        + f"<div class='controls'>{buttons}</div><p class='feedback' role='status'></p>{samples}</section>"
    )


def _render_samples(record: TrialRecord) -> str:
    """A trial's eval samples: a table per chunk, latest first, with the total and each reward function's score."""
    chunks = {m.unit: m for m in record.unit_metrics()}
    parts = []
    for i, (unit, samples) in enumerate(sorted(record.samples().items(), reverse=True)):
        scores = list(dict.fromkeys(k for s in samples for k in s if k not in ("prompt", "completion", "reward")))
        head = "".join(f"<th>{_e(k)}</th>" for k in ["#", "prompt", "completion", "reward (total)", *scores])
        rows = "".join(
            f"<tr><td>{j}</td><td><pre>{_e(s.get('prompt', ''))}</pre></td><td><pre>{_e(s.get('completion', ''))}</pre></td>"
            + "".join(f"<td class='score'>{_score(s.get(k))}</td>" for k in ["reward", *scores]) + "</tr>"
            for j, s in enumerate(samples)
        )
        metrics = chunks.get(unit)
        mean = f" · eval reward {_num(metrics.eval['reward'])}" if metrics and "reward" in metrics.eval else ""
        data_chunk = f" (data chunk {metrics.chunk})" if metrics and metrics.chunk != unit else ""
        parts.append(
            f"<details class='unit' data-unit='{unit}'{' open' if i == 0 else ''}><summary>after chunk {unit}"
            f"{data_chunk}{mean}</summary><table class='samples'><thead><tr>{head}</tr></thead>"
            f"<tbody>{rows}</tbody></table></details>"
        )
    return "".join(parts) or "<p class='hint'>no samples stored yet</p>"


# ---------------------------------------------------------------------- static files
@functools.cache
def _static(name: str) -> bytes:
    return importlib.resources.files("rfopt").joinpath("static", name).read_bytes()


@functools.cache
def _plotly_version() -> str:
    import plotly

    return plotly.__version__


@functools.cache
def _plotly_js() -> bytes:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


@functools.cache
def _plotly_gzip() -> bytes:
    return gzip.compress(_plotly_js(), compresslevel=6, mtime=0)


# ---------------------------------------------------------------------- small helpers
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _score(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "<span class='hint' title='the reward function gave None for it: skipped'>not scored</span>"
    return _e(_num(value))


def _slug(key: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in key)
