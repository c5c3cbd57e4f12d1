"""optuna-dashboard with rfopt's controls and per-chunk charts, in one server: ``rfopt dashboard``.

    rfopt dashboard --storage sqlite:///rfopt.db        # then open http://127.0.0.1:8080/rfopt

The server is optuna-dashboard's own Bottle app (studies, plots, artifacts, its "Fail trial"
button, which the engine honours at the trial's next chunk boundary) with rfopt's routes added
under ``/rfopt``:

- ``GET /rfopt``: the storage's studies. ``GET /rfopt/studies/<study_id>``: one study's trials,
  each with its per-chunk charts (eval and train reward per reward function, KL, entropy,
  completion length; inline SVG, nothing fetched from outside) and its controls: pause, resume,
  stop, and clone with ``FIELD=VALUE`` overrides and an optional warm start.
- ``POST /rfopt/api/studies/<study_id>/trials/<number>/pause`` (``resume``, ``stop``) and
  ``.../clone`` with a JSON body ``{"set": ["learning_rate=2e-6"], "warm_start": true}`` (or
  ``{"overrides": {"learning_rate": 2e-6}}``). They call `rfopt.ops`, as the Python API and the
  command line do: an op is a request stored on the trial, applied by the process running the
  study at the trial's next chunk boundary. An op that cannot apply answers 400 with the reason
  and writes nothing. ``GET /rfopt/api/studies/<study_id>/trials`` gives the page's data as JSON.

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

Artifacts: a running study keeps two artifacts per trial up to date after each chunk
(`rfopt.artifacts`), in ``<checkpoint dir>/artifacts``: ``rfopt-metrics.svg`` (the charts) and
``rfopt-samples.jsonl`` (every chunk's sample completions, a table in optuna-dashboard). The
dashboard finds each study's artifacts there by itself (`rfopt.artifacts.StudyArtifacts`).
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
import logging
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

from . import ops
from .artifacts import StudyArtifacts
from .charts import chart_svg, charts
from .compat import study_id_of
from .schema import TrialRecord, UnitMetrics, json_safe, study_record

logger = logging.getLogger("rfopt")

TOKEN_ENV = "RFOPT_DASHBOARD_TOKEN"
_STATE_ORDER = {"RUNNING": 0, "WAITING": 1, "COMPLETE": 2, "PRUNED": 3, "FAIL": 4}


# ---------------------------------------------------------------------- trials as the page shows them
@dataclass
class TrialView:
    """One trial, as the control page shows it."""

    number: int
    state: str
    paused: bool
    pending: str | None
    """An op requested and not applied yet."""
    steps_done: int
    num_steps: int | None
    value: float | None
    """The last reported value (the final value once COMPLETE)."""
    params: dict[str, Any]
    clone_of: dict[str, Any] | None
    reason: str | None
    can_clone: bool
    chunks: list[UnitMetrics] = field(default_factory=list)

    @classmethod
    def of(cls, trial: optuna.trial.FrozenTrial) -> TrialView:
        record = TrialRecord(trial)
        pending = record.pending
        return cls(
            number=trial.number,
            state=trial.state.name,
            paused=record.paused,
            pending=pending[-1].op if pending else None,
            steps_done=len(trial.intermediate_values),
            num_steps=record.num_units,
            value=record.value,
            params=dict(trial.params),
            clone_of=None if record.lineage is None else record.lineage.to_attr(),
            reason=record.end_reason,
            can_clone=record.config_json is not None,
            chunks=record.unit_metrics(),
        )

    @property
    def controls(self) -> list[str]:
        """The control buttons shown for this trial (the server checks each request again)."""
        shown = []
        if self.state == "RUNNING" and self.pending != "stop":
            shown.append("resume" if self.paused or self.pending == "pause" else "pause")
            shown.append("stop")
        return shown + (["clone"] if self.can_clone else [])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["controls"] = self.controls
        return data


def trial_views(storage: optuna.storages.BaseStorage, study_id: int) -> list[TrialView]:
    """Every trial of the study: running first, then waiting, finished; by number within each."""
    views = [TrialView.of(t) for t in storage.get_all_trials(study_id, deepcopy=False)]
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
        return _html(_render_study(study, trial_views(storage, study_id)))

    @app.get("/rfopt/static/rfopt.js")
    def script() -> Any:
        return HTTPResponse(_SCRIPT, headers={"Content-Type": "text/javascript; charset=utf-8", "Cache-Control": "no-cache"})

    @app.get("/rfopt/api/studies/<study_id:int>/trials")
    def trials_api(study_id: int) -> Any:
        study_or_404(study_id)
        return {"trials": [json_safe(v.to_json()) for v in trial_views(storage, study_id)]}

    @app.post("/rfopt/api/studies/<study_id:int>/trials/<number:int>/<op:re:pause|resume|stop>")
    def control(study_id: int, number: int, op: str) -> Any:
        json_body()
        study = study_or_404(study_id)
        try:
            ops.request(study, number, op, by=by())
        except ops.OpError as exc:
            return fail(400, str(exc))
        return {"trial": number, "op": op, "message": f"trial {number}: {op} requested; it applies at the trial's next chunk boundary"}

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
        start = " from its parent's latest checkpoint" if warm_start else ""
        notes = "".join(f"; note: {note}" for note in made.notes)
        return {
            "trial": made.number,
            "parent": number,
            "overrides": overrides,
            "warm_start": warm_start,
            "notes": list(made.notes),
            "message": f"trial {made.number}: clone of trial {number} with {overrides or 'no changes'} "
                       f"enqueued{start}{notes}",
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
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
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
def _page(title: str, body: str, refresh: bool = False) -> str:
    script = '<script src="/rfopt/static/rfopt.js" defer></script>' if refresh else ""
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
        f"<style>{_CSS}</style>{script}</head><body>{body}</body></html>"
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


def _render_study(study: Any, views: list[TrialView]) -> str:
    sid = study_id_of(study)
    record = study_record(study)
    direction = study.directions[0].name.lower() if len(study.directions) == 1 else "multi-objective"
    plan = record.plan
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    facts = [
        f"objective: {_e(record.settings.get('objective', '?'))} ({direction})",
        f"{plan.num_chunks} chunks of {plan.num_rows} rows" if plan else "not an rfopt study: no controls",
    ]
    tally = ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items(), key=lambda kv: _STATE_ORDER.get(kv[0], 5)))
    header = (
        f"<h1>{_e(study.study_name)}</h1><p class='facts'>{' · '.join(facts)} · "
        f"<a href='/dashboard/studies/{sid}'>open in optuna-dashboard</a> · <a href='/rfopt'>all studies</a></p>"
        "<p class='bar'><label><input type='checkbox' id='autorefresh' checked> refresh every 5 s</label> "
        "<span id='status' role='status'></span></p>"
        "<p class='hint'>Ops apply at the trial's next chunk boundary, in the process running the study.</p>"
    )
    cards = "".join(_render_trial(sid, v, steerable=plan is not None) for v in views) or "<p>No trials yet.</p>"
    body = f"{header}<main id='trials' data-study='{sid}'><p class='facts'>trials: {tally or 'none yet'}</p>{cards}</main>"
    return _page(f"{study.study_name} · rfopt", body, refresh=True)


def _render_trial(study_id: int, v: TrialView, steerable: bool) -> str:
    api = f"/rfopt/api/studies/{study_id}/trials/{v.number}"
    state = v.state + (" · paused" if v.paused else "")
    steps = f"{v.steps_done}" + (f"/{v.num_steps}" if v.num_steps else "") + " chunks trained"
    value = f"value {_num(v.value)}" if v.value is not None else "no value yet"
    notes = []
    if v.params:
        notes.append(", ".join(f"{_e(k)}={_e(_num(p) if isinstance(p, float) else p)}" for k, p in v.params.items()))
    if v.clone_of:
        lineage = v.clone_of
        warm = f", warm from step {_e(lineage.get('start_unit', 0))}" if lineage.get("warm_start") else ""
        notes.append(f"clone of trial {_e(lineage.get('parent'))} with {_e(json.dumps(lineage.get('overrides', {})))}{warm}")
    if v.pending:
        notes.append(f"<b>{_e(v.pending)} requested</b>")
    if v.reason:
        notes.append(_e(v.reason))
    buttons = ""
    if steerable:
        for op in (o for o in v.controls if o != "clone"):
            buttons += f"<button type='button' class='op {op}' data-op='{op}' data-url='{api}/{op}'>{op.capitalize()}</button>"
        if "clone" in v.controls:
            buttons += (
                "<details class='clone'><summary>Clone…</summary><form>"
                f"<textarea name='set' rows='3' cols='34' placeholder='one FIELD=VALUE per line, e.g.&#10;learning_rate=2e-6&#10;lora_r=8'></textarea>"
                "<label><input type='checkbox' name='warm_start'> warm start from its latest checkpoint</label>"
                f"<button type='button' class='op clone' data-op='clone' data-url='{api}/clone'>Clone</button>"
                "</form></details>"
            )
    chart_html = "".join(chart_svg(c) for c in charts(v.chunks)) if v.chunks else "<p class='hint'>no chunk trained yet</p>"
    return (
        f"<section class='trial {v.state.lower()}' data-trial='{v.number}' data-state='{v.state}'>"
        f"<header><h2>Trial {v.number}</h2><span class='state'>{state}</span><span>{steps}</span><span>{value}</span>"
        f"<a href='/dashboard/studies/{study_id}/trials?numbers={v.number}'>details</a></header>"
        f"<p class='notes'>{' · '.join(notes)}</p><div class='controls'>{buttons}</div>"
        f"<div class='charts'>{chart_html}</div></section>"
    )


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222}
h1{margin:.2em 0} .facts,.hint{color:#555} .hint{font-size:.9em}
.bar{display:flex;gap:1.5em;align-items:center} #status{font-weight:bold} #status.error{color:#b00020}
table{border-collapse:collapse} td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:left}
.trial{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:.8em 0}
.trial.running{border-left:5px solid #1f77b4} .trial.complete{border-left:5px solid #2ca02c}
.trial.pruned,.trial.fail{border-left:5px solid #999} .trial.waiting{border-left:5px solid #ff7f0e}
.trial header{display:flex;gap:1.2em;align-items:baseline} .trial h2{font-size:1.1em;margin:0}
.state{font-weight:bold} .notes{color:#444;margin:.3em 0}
.controls{display:flex;gap:.6em;align-items:flex-start;flex-wrap:wrap}
.controls form{display:flex;flex-direction:column;gap:.3em;margin:.3em 0}
button.op{padding:.25em .9em;cursor:pointer} button.stop{color:#b00020}
.charts{display:flex;flex-wrap:wrap;gap:.5em;margin-top:.4em}
"""

_SCRIPT = r"""
// rfopt control page: buttons post JSON to /rfopt/api/...; the trial list refreshes every 5 s
// unless a clone form is open or being typed in.
const status = (text, error) => {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = error ? "error" : "";
};

async function refresh() {
  const response = await fetch(location.href, {credentials: "same-origin"});
  if (!response.ok) return;
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = page.getElementById("trials");
  if (fresh) document.getElementById("trials").replaceWith(fresh);
}

document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-op]");
  if (!button) return;
  const op = button.dataset.op;
  const trial = button.closest("[data-trial]").dataset.trial;
  let body = {};
  if (op === "clone") {
    const form = button.closest("form");
    body = {
      set: form.elements.set.value.split("\n").map((s) => s.trim()).filter(Boolean),
      warm_start: form.elements.warm_start.checked,
    };
  } else if (op === "stop" && !confirm(`Stop trial ${trial}? It ends PRUNED at its next chunk boundary.`)) {
    return;
  }
  button.disabled = true;
  try {
    const response = await fetch(button.dataset.url, {
      method: "POST",
      credentials: "same-origin",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body),
    });
    const data = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
    if (response.ok) {
      status(data.message, false);
      if (op === "clone") button.closest("details").open = false;
      await refresh();
    } else {
      status(`trial ${trial}: ${data.error}`, true);
    }
  } catch (error) {
    status(`trial ${trial}: ${error}`, true);
  } finally {
    button.disabled = false;
  }
});

setInterval(() => {
  const busy = document.querySelector("details[open]") || document.activeElement.matches("textarea, input[type=text]");
  if (document.getElementById("autorefresh").checked && !busy) refresh();
}, 5000);
"""


# ---------------------------------------------------------------------- small helpers
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


