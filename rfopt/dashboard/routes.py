"""rfopt's routes in optuna-dashboard's Bottle app: the pages (`rfopt.dashboard.pages`, `rfopt.dashboard.samples`),
their data, their static files, and the actions (`rfopt.dashboard.actions`). `add_routes` lists every URL; each route
is one method of `_Routes`, which holds the storage.
"""

from __future__ import annotations

import functools
import gzip
import html
import importlib.resources
import json
from typing import Any

import optuna
from bottle import HTTPResponse, redirect, request

from rfopt.reports.status import liveness, summaries
from rfopt.errors import Refusal, StorageRefusedError
from rfopt.storage.schema import TrialRecord, json_safe, study_attrs

from . import actions, markup, pages, samples
from .access import actor, json_body, json_error
from .views import data_version, trial_views

_STUDY = "/rfopt/studies/<study_id:int>"
_API = "/rfopt/api/studies/<study_id:int>"
_TRIAL_API = f"{_API}/trials/<number:int>"

_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; frame-ancestors 'none'"
)


def add_routes(app: Any, storage: optuna.storages.BaseStorage) -> None:
    """Add rfopt's routes to optuna-dashboard's Bottle `app`, serving the studies of `storage`."""
    r = _Routes(storage)
    for method, path, callback in [
        ("GET", "/", r.root),
        ("GET", "/rfopt", r.index_page),
        ("GET", _STUDY, r.study_page),
        ("GET", f"{_API}/page", r.page_api),
        ("GET", f"{_STUDY}/trials/<number:int>/samples", r.samples_part),
        ("GET", f"{_STUDY}/compare", r.side_by_side),
        ("GET", "/rfopt/static/<name:re:(?:rfopt|backlink)\\.(?:js|css)>", r.static_file),
        ("GET", "/rfopt/static/plotly-<version>.min.js", r.plotly_js),
        ("GET", f"{_API}/trials", r.trials_api),
        ("GET", f"{_TRIAL_API}/config", r.config_api),
        ("POST", f"{_API}/halt", r.halt),
        ("POST", f"{_API}/confirm", r.confirm),
        ("POST", f"{_TRIAL_API}/<op:re:pause|resume|stop>", r.control),
        ("POST", f"{_TRIAL_API}/cancel", r.cancel),
        ("POST", f"{_TRIAL_API}/withdraw", r.withdraw),
        ("POST", f"{_TRIAL_API}/clone", r.clone),
    ]:
        app.route(path, method, callback)


class _Routes:
    """The routes' callbacks, over one storage."""

    def __init__(self, storage: optuna.storages.BaseStorage) -> None:
        self.storage = storage

    # ------------------------------------------------------------------ pages
    def root(self) -> Any:
        return redirect("/rfopt", 302)

    def index_page(self) -> Any:
        return _html(pages.render_index(summaries(self.storage)))

    def study_page(self, study_id: int) -> Any:
        try:
            _, page = self._page_of(study_id)
        except HTTPResponse:
            return _html(pages.render_missing(study_id), 404)
        return _html(pages.render_study(page))

    def page_api(self, study_id: int) -> Any:
        """The page's parts as JSON, with an ETag: 304 while the stored data it shows is unchanged."""
        since = request.headers.get("If-None-Match", "").strip('"') or None
        version, page = self._page_of(study_id, since)
        headers = {"ETag": f'"{version}"', "Cache-Control": "no-cache"}
        if page is None:
            return HTTPResponse(status=304, headers=headers)
        return HTTPResponse(json.dumps(page.to_json()), headers={**headers, "Content-Type": "application/json"})

    def samples_part(self, study_id: int, number: int) -> Any:
        study = self._study(study_id)
        trial = _trial(study, number)
        if trial is None:
            return _html(f"<p>study {html.escape(study.study_name)} has no trial {number}</p>", 404)
        return _html(samples.render_samples(TrialRecord(trial)))

    def side_by_side(self, study_id: int) -> Any:
        """The same eval prompt across trials, after one chunk (``?unit=``: Optuna's step; default: the last chunk at
        least two trials have samples of)."""
        study = self._study(study_id)
        direction = study.directions[0] if len(study.directions) == 1 else None
        unit = request.query.get("unit", "")
        return _html(samples.render_side_by_side(study.get_trials(deepcopy=False), direction,
                                               int(unit) if unit.isdigit() else None,
                                               f"/rfopt/studies/{study_id}/compare"))

    # ------------------------------------------------------------------ static files
    def static_file(self, name: str) -> Any:
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return HTTPResponse(_static(name), headers={"Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache"})

    def plotly_js(self, version: str) -> Any:
        """The plotly package's bundled plotly.js, under a versioned name: cached for good, sent compressed."""
        if version != markup.plotly_version():
            return HTTPResponse("no such plotly.js version", status=404)
        headers = {"Content-Type": "text/javascript; charset=utf-8", "Cache-Control": "public, max-age=31536000, immutable",
                   "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return HTTPResponse(_plotly_gzip(), headers={**headers, "Content-Encoding": "gzip"})
        return HTTPResponse(_plotly_js(), headers=headers)

    # ------------------------------------------------------------------ data
    def trials_api(self, study_id: int) -> Any:
        study = self._study(study_id)
        trials = study.get_trials(deepcopy=False)
        return {"trials": [json_safe(v.to_json()) for v in trial_views(trials, study, liveness(study, trials))]}

    def config_api(self, study_id: int, number: int) -> Any:
        """The clone form's fields, pre-filled with the trial's config, and whether a warm start is possible."""
        study = self._study(study_id)
        trial = _trial(study, number)
        if trial is None:
            return json_error(404, f"study {study.study_name!r} has no trial {number}")
        if TrialRecord(trial).config_json is None:
            return json_error(400, f"trial {number} has no rfopt config to clone")
        return actions.clone_form(study, trial)

    # ------------------------------------------------------------------ actions: 400 with the reason when refused
    def halt(self, study_id: int) -> Any:
        json_body()
        return _act(actions.halt, self._study(study_id), by=actor())

    def confirm(self, study_id: int) -> Any:
        return _act(actions.confirm, self._study(study_id), json_body(), by=actor())

    def control(self, study_id: int, number: int, op: str) -> Any:
        json_body()
        return _act(actions.control, self._study(study_id), number, op, by=actor())

    def cancel(self, study_id: int, number: int) -> Any:
        json_body()
        return _act(actions.cancel, self._study(study_id), number, by=actor())

    def withdraw(self, study_id: int, number: int) -> Any:
        body = json_body()
        return _act(actions.withdraw, self._study(study_id), number, body, by=actor())

    def clone(self, study_id: int, number: int) -> Any:
        body = json_body()
        return _act(actions.clone, self._study(study_id), number, body, by=actor())

    # ------------------------------------------------------------------ helpers
    def _study(self, study_id: int) -> optuna.Study:
        """The study with that id; else raises the 404 answer."""
        try:
            name = self.storage.get_study_name_from_id(study_id)
        except (KeyError, OverflowError):  # an id past SQL's integers names no study either
            raise json_error(404, f"no study with id {study_id}") from None
        return optuna.load_study(study_name=name, storage=self.storage, sampler=optuna.samplers.RandomSampler())

    def _page_of(self, study_id: int, since: str | None = None) -> tuple[str, pages.StudyPage | None]:
        """The study's data version, and its page unless the version is `since` (the page has it already)."""
        study = self._study(study_id)
        trials = self.storage.get_all_trials(study_id, deepcopy=False)
        live = liveness(study, trials)
        version = data_version(trials, live, study_attrs(study))
        if version == since:
            return version, None
        return version, pages.study_page(study, trials, live, version)


def _act(action: Any, *args: Any, **kwargs: Any) -> Any:
    """The action's reply; 400 with the reason when rfopt refuses it (nothing was written). Any other exception is a
    bug, not the user's mistake: it is not answered as one."""
    try:
        return action(*args, **kwargs)
    except Refusal as exc:  # OpError, ConfigError (a bad FIELD=VALUE too), a malformed body
        return json_error(400, str(exc))
    except StorageRefusedError as exc:  # a read-only database (a shared file opened read-only), a missing right
        if exc.refused is not None and exc.refused.kind == "read-only":
            return json_error(409, "read-only database: this dashboard cannot write to the study's storage (a file "
                              "this user may not write is opened read-only), so pause, resume, stop, cancel, "
                              "withdraw, clone and halt cannot be stored; nothing was changed. Open a writable "
                              "database to steer the study")
        return json_error(409, str(exc))


def _trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial | None:
    return next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)


def _html(text: str, status: int = 200) -> HTTPResponse:
    """An HTML page or part, under a content security policy that allows only this server's own scripts."""
    return HTTPResponse(
        text, status=status, headers={"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": _CSP}
    )


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
