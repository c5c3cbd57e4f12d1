"""optuna-dashboard with rfopt's study page and controls, in one server: ``rfopt dashboard``.

    rfopt dashboard --storage sqlite:///rfopt.db        # then open http://127.0.0.1:8080/rfopt

The server is optuna-dashboard's own Bottle app (studies, plots, artifacts, its "Fail trial"
button, which the engine honours at the trial's next chunk boundary) with rfopt's routes added
under ``/rfopt``:

- ``GET /`` leads to ``/rfopt``: every study with its trials by state, its best value, and whether a process runs it
  (the page reloads itself every 5 s while one does).
  Every optuna-dashboard page gets a link to the rfopt page of the study it shows (bottom right), and rfopt's pages
  link to optuna-dashboard's.
- ``GET /rfopt/studies/<study_id>``: one study, comparison first: who runs it, what trains now (a trial alone or a
  gang as one: its phase, chunk c of C, step s of S, since when, the chunk's ETA, slow or stuck; the study's end) and the compute spent against a run without pruning, the leaderboard (best first,
  sortable, with lineage and times), "why it wins" (parallel coordinates, each param against the value, the same eval
  prompt's completions side by side: ``GET /rfopt/studies/<study_id>/compare``), one chart per metric with every trial
  overlaid (`rfopt.reports.charts`; steps of a chunk still training dashed), then each trial with its controls (pause, resume,
  stop; cancel a WAITING clone; withdraw a pending request; a clone form pre-filled with the trial's whole config) and
  its eval samples (``GET /rfopt/studies/<study_id>/trials/<number>/samples``, loaded when opened).
- ``GET /rfopt/api/studies/<study_id>/page``: the page's parts as JSON, with an ETag fingerprinting the stored data
  they show (`rfopt.dashboard.views.data_version`): asked with ``If-None-Match``, the answer is 304 while nothing changed. The
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
  (`rfopt.config.form`) and whether a warm start is possible. ``POST /rfopt/api/studies/<study_id>/halt`` asks every
  process running the study to stop at its trials' next chunk boundary (`rfopt.engine.trials.ops.halt`).
  They call `rfopt.engine.trials.ops`, as the Python API and the command line do: pause, resume and stop are
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

Clones are checked here before anything is written (`rfopt.engine.trials.clones.clone`). Where the study's own code
(its reward functions) cannot be imported in this process, the clone is still checked in every other
way and made, and the reply says so: the process running the study imports that code.

Artifacts: a running study keeps its trials' artifacts up to date after each chunk (`rfopt.engine.outputs.artifacts`),
in ``<checkpoint dir>/artifacts``; the dashboard finds each study's artifacts there by itself
(`rfopt.engine.outputs.artifacts.StudyArtifacts`).

The package, one concern a module:

- `server`: `create_app` (optuna-dashboard's app with rfopt's routes, behind the access checks), `make_server`,
  `serve` (``rfopt dashboard``), and the link from optuna-dashboard's pages to rfopt's.
- `access`: who may reach the server (loopback names, the token, no cross-origin writes) and what an action's request
  must be (a JSON object), `resolve_token`.
- `routes`: every URL above, one small method each.
- `actions`: what the buttons do (pause, resume, stop, cancel, withdraw, halt, clone), through `rfopt.engine.trials.ops`.
- `views`: the trials as the pages show them (`TrialView`), and the page's data version.
- `pages`: the HTML of the index and of the study page, in the parts the page refreshes (each trial's card among them).
- `leaderboard`: the trials ranked: the leaderboard, and the leader against the runner-up reward by reward.
- `samples`: eval samples: one trial's per chunk, and the same eval prompt across trials.
- `markup`: what every page's HTML shares: the page around a body, the formatters of values.
"""

from .access import TOKEN_ENV, resolve_token
from .server import DashboardServer, create_app, make_server, serve

__all__ = ["TOKEN_ENV", "DashboardServer", "create_app", "make_server", "resolve_token", "serve"]
