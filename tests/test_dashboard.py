"""rfopt dashboard: control routes over real HTTP, access checks, artifacts, and the page in headless Chromium.

The study is built synthetically (optuna plus the attrs the engine writes), so no model trains here.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import optuna
import pytest
from optuna.trial import TrialState

import rfopt
from rfopt.chunks import ChunkPlan
from rfopt.cli import main as cli
from rfopt import schema
from rfopt.artifacts import CHART_ARTIFACT, SAMPLES_ARTIFACT, publish_chunk
from rfopt.dashboard import make_server, resolve_token
from rfopt.schema import TrialRecord, metrics_key, samples_key
from rfopt_testkit import trial_config

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


# ---------------------------------------------------------------------- a study as the engine leaves it
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Trial 0 COMPLETE (2 chunks), trial 1 RUNNING and paused (1 chunk), trial 2 RUNNING (1 chunk): built once."""
    path = tmp_path_factory.mktemp("template") / "study.db"
    opt = optuna.create_study(study_name="demo", storage=f"sqlite:///{path}", direction="maximize",
                              sampler=optuna.samplers.RandomSampler(seed=0))
    schema.write_plan(opt, ChunkPlan.build(16, 2, 0))
    schema.write_settings(opt, {"objective": "reward"})
    config = trial_config("tiny-model-not-loaded-here").to_json()
    for number, units in enumerate([2, 1, 1]):
        trial = opt.ask()
        trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        trial.set_user_attr("rfopt:config", config)
        trial.set_user_attr("rfopt:schedule", {"prompts_per_chunk": 8, "steps_per_chunk": 8, "num_epochs": 1,
                                               "num_chunks": 2})
        for unit in range(units):
            _commit_chunk(trial, unit, reward=0.2 * (number + 1) + 0.1 * unit)
        if number == 0:
            opt.tell(trial, 0.3)
        if number == 1:
            trial.set_user_attr("rfopt:paused", True)
            trial.set_user_attr("rfopt:request:t-1", {"op": "pause", "by": "me@host", "at": "t", "id": "1"})
            trial.set_user_attr("rfopt:ops", [{"op": "pause", "by": "me@host", "requested_at": "t", "applied_at": "t",
                                               "id": "1"}])
    return path


@pytest.fixture
def study(template, tmp_path):
    """A fresh copy of the template study, with its own checkpoint directory, as the study's first run records it."""
    shutil.copy(template, tmp_path / "study.db")
    study = rfopt.load_study("demo", f"sqlite:///{tmp_path / 'study.db'}")
    schema.write_identity(study.optuna, "0123456789abcdef", str(tmp_path / "checkpoints"))
    return study


def _commit_chunk(trial, unit, reward):
    """What `Study` stores after a chunk: metrics (a NaN comes as a string), samples, pruning decision, report."""
    train = {
        "reward": reward + 0.05, "rewards/reward_len/mean": reward, "rewards/reward_vowels/mean": 0.05,
        "kl": 0.01 * (unit + 1), "entropy": 4.6 - 0.1 * unit, "completions/mean_length": 7.5 + unit, "loss": "nan",
    }
    evaluation = {"reward": reward, "rewards/reward_len/mean": reward, "rewards/reward_vowels/mean": 0.0,
                  "completions/mean_length": 8.0}
    trial.set_user_attr(metrics_key(unit), {"chunk": unit, "train": train, "eval": evaluation})
    trial.set_user_attr(samples_key(unit), [
        {"prompt": f"E{i}: add {i} and {i}", "completion": "0" * (unit + 4), "reward": reward, "reward_len": reward}
        for i in range(2)
    ])
    trial.set_user_attr(f"rfopt:pruning:{unit}", {"prune": False, "reason": "kept", "peers": [0], "pruner": "MedianPruner"})
    trial.report(reward, step=unit)


def _trials(study):
    return optuna.load_study(study_name=study.study_name, storage=study.optuna._storage).get_trials()


def _snapshot(study):
    return [(t.state, t.params, t.user_attrs) for t in _trials(study)]


# ---------------------------------------------------------------------- real HTTP
@contextmanager
def running(server):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def serving(storage, **kwargs):
    return running(make_server(storage, host=kwargs.pop("host", "127.0.0.1"), port=0, **kwargs))


def call(server, method, path, body=None, headers=None, raw=None):
    """(status, decoded JSON body or text, response headers); never raises on an HTTP error status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = dict(headers or {})
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    url = f"http://127.0.0.1:{server.server_port}{path}"
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method, headers=headers), timeout=30) as r:
            status, text, response_headers = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as exc:
        status, text, response_headers = exc.code, exc.read().decode(), exc.headers
    try:
        return status, json.loads(text), response_headers
    except ValueError:
        return status, text, response_headers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def api(study, number, op):
    return f"/rfopt/api/studies/{study.optuna._study_id}/trials/{number}/{op}"


# ---------------------------------------------------------------------- control routes
def test_pause_resume_stop_and_clone_routes_store_requests_the_engine_applies(study):
    with serving(study.optuna._storage) as server:
        status, body, _ = call(server, "POST", api(study, 2, "pause"), {})
        assert status == 200 and "next chunk boundary" in body["message"]
        assert call(server, "POST", api(study, 1, "resume"), {})[0] == 200
        status, body, _ = call(server, "POST", api(study, 1, "clone"), {"set": ["learning_rate=0.004"]})
        assert status == 200 and body["trial"] == 3, body
        assert call(server, "POST", api(study, 2, "stop"), {})[0] == 200

    trials = _trials(study)
    resumed, stopped, clone = trials[1], trials[2], trials[3]
    assert [r.op for r in TrialRecord(resumed).pending] == ["resume"]
    assert [(r.op, r.by) for r in TrialRecord(stopped).pending] == [("pause", "dashboard (127.0.0.1)"),
                                                                    ("stop", "dashboard (127.0.0.1)")]
    assert clone.state == TrialState.WAITING
    assert clone.params == {"learning_rate": 0.004}
    assert clone.user_attrs["rfopt:clone"]["parent"] == 1 and clone.user_attrs["rfopt:clone"]["warm_start"] is False
    assert rfopt.TrialConfig.from_json(clone.user_attrs["rfopt:config"]).args.learning_rate == 0.004


@pytest.mark.parametrize(
    "number, op, body, status, message",
    [
        (0, "pause", {}, 400, "trial 0 is COMPLETE; only a RUNNING trial can be paused"),
        (99, "stop", {}, 400, "has no trial 99"),
        (2, "resume", {}, 400, "trial 2 is not paused"),
        (1, "clone", {"set": ["nope=1"]}, 400, "nope: unknown field"),
        (1, "clone", {"overrides": {"learning_rate": "fast"}}, 400, "learning_rate: expected a number"),
        (1, "clone", {"set": ["learning_rate"]}, 400, "expected FIELD=VALUE"),
        (1, "clone", {"overrides": ["learning_rate", 1]}, 400, "overrides must be a JSON object"),
        (1, "clone", {"set": [], "warm_start": "yes"}, 400, "warm_start must be true or false"),
        (1, "clone", {"set": [], "warm_start": True}, 400, "trial 1 has no checkpoint yet"),
        (1, "clone", {"lr": 1}, 400, "unknown fields ['lr']"),
    ],
)
def test_refused_op_answers_400_with_the_reason_and_changes_nothing(study, number, op, body, status, message):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        got, answer, _ = call(server, "POST", api(study, number, op), body)
    assert got == status
    assert message in answer["error"]
    assert _snapshot(study) == before


def test_a_clone_of_a_study_whose_code_the_dashboard_cannot_import_is_checked_in_every_other_way(study):
    """The study's reward functions live in a study file this process cannot import: the clone is still made, the
    reply says what could not be checked here, and a bad override is still refused."""
    from rfopt import compat

    config = json.loads(_trials(study)[2].user_attrs["rfopt:config"])
    config["reward_funcs"] = ["/home/someone/studies/my_study.py:correctness"]
    storage = compat.storage_of(study.optuna)
    storage.set_trial_user_attr(compat.trial_id_of(_trials(study)[2]), "rfopt:config", json.dumps(config))
    with serving(storage) as server:
        refused = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=-1"]})
        before = _snapshot(study)
        status, body, _ = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=0.004"]})
    assert refused[0] == 400 and "Invalid learning rate: -1" in refused[1]["error"]
    assert status == 200 and body["trial"] == 3, body
    assert "cannot be imported here" in body["message"] and "my_study.py" in body["notes"][0]
    clone = _trials(study)[3]
    assert len(before) == 3 and json.loads(clone.user_attrs["rfopt:config"])["reward_funcs"] == config["reward_funcs"]
    assert json.loads(clone.user_attrs["rfopt:config"])["args"]["learning_rate"] == 0.004


def test_malformed_requests_are_refused_and_change_nothing(study):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        status, body, _ = call(server, "POST", api(study, 2, "pause"), raw=b"{not json", headers={"Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in body["error"]
        # A cross-site HTML form can post urlencoded bodies without a preflight: refused.
        status, body, _ = call(server, "POST", api(study, 2, "stop"), raw=b"x=1",
                               headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415
        status, body, _ = call(server, "POST", "/rfopt/api/studies/42/trials/0/stop", {})
        assert status == 404 and "no study with id 42" in body["error"]
    assert _snapshot(study) == before


def test_trial_failed_with_the_dashboards_own_button_takes_no_more_ops(study):
    trial_id = _trials(study)[2]._trial_id
    with serving(study.optuna._storage) as server:
        assert call(server, "POST", f"/api/trials/{trial_id}/tell", {"state": "Fail"})[0] == 204
        status, body, _ = call(server, "POST", api(study, 2, "stop"), {})
    assert status == 400 and "trial 2 is FAIL" in body["error"]


# ---------------------------------------------------------------------- access
def test_with_a_token_every_request_needs_it_and_a_refused_one_changes_nothing(study):
    before = _snapshot(study)
    sid = study.optuna._study_id
    with serving(study.optuna._storage, token="s3cret") as server:
        assert call(server, "POST", api(study, 2, "stop"), {})[0] == 401
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Authorization": "Bearer wrong"})[0] == 403
        assert call(server, "GET", f"/api/studies/{sid}")[0] == 401  # optuna-dashboard's own API too
        assert call(server, "DELETE", f"/api/studies/{sid}", headers={"Authorization": "Bearer nope"})[0] == 403
        assert call(server, "GET", "/rfopt?token=wrong")[0] == 403
        assert _snapshot(study) == before

        # A browser opens the printed link once: the token moves into a cookie and out of the address.
        status, _, headers = call(server, "GET", "/rfopt?token=s3cret")
        assert status == 303 and headers["Location"] == "/rfopt"
        cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"]
        assert call(server, "GET", f"/rfopt/studies/{sid}", headers={"Cookie": cookie})[0] == 200
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Cookie": cookie})[0] == 200
    assert TrialRecord(_trials(study)[2]).pending[-1].op == "stop"


def test_a_non_local_bind_always_requires_a_token(study, monkeypatch):
    monkeypatch.delenv("RFOPT_DASHBOARD_TOKEN", raising=False)
    assert resolve_token("127.0.0.1") == (None, False)
    token, generated = resolve_token("0.0.0.0")
    assert generated and len(token) >= 24
    monkeypatch.setenv("RFOPT_DASHBOARD_TOKEN", "from-env")
    assert resolve_token("0.0.0.0") == ("from-env", False)
    monkeypatch.delenv("RFOPT_DASHBOARD_TOKEN")

    with serving(study.optuna._storage, host="0.0.0.0") as server:
        assert server.token and server.token in server.url(with_token=True)
        assert call(server, "POST", api(study, 2, "pause"), {})[0] == 401
        assert call(server, "POST", api(study, 2, "pause"), {}, {"Authorization": f"Bearer {server.token}"})[0] == 200


def test_a_local_bind_refuses_other_host_names_and_cross_origin_writes(study):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        # DNS rebinding: a page on evil.example resolved to 127.0.0.1 still sends its own Host.
        assert call(server, "GET", "/rfopt", headers={"Host": "evil.example"})[0] == 403
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Origin": "http://evil.example"})[0] == 403
        assert call(server, "GET", "/rfopt", headers={"Host": "localhost"})[0] == 200
    assert _snapshot(study) == before


def test_cli_dashboard_refuses_a_missing_sqlite_file(tmp_path, capsys):
    assert cli(["dashboard", "--storage", f"sqlite:///{tmp_path / 'missing.db'}"]) == 1
    assert "no SQLite file" in capsys.readouterr().err


# ---------------------------------------------------------------------- artifacts and plain optuna-dashboard
def test_publish_chunk_keeps_one_chart_and_one_samples_file_per_trial(study):
    opt = study.optuna
    frozen = _trials(study)[2]
    trial = optuna.trial.Trial(opt, frozen._trial_id)
    publish_chunk(trial)
    _commit_chunk(trial, 1, reward=0.9)
    publish_chunk(trial)

    metas = {m.filename: m for m in optuna.artifacts.get_all_artifact_meta(trial)}
    assert sorted(metas) == [CHART_ARTIFACT, SAMPLES_ARTIFACT]
    with serving(opt._storage) as server:
        base = f"/artifacts/{opt._study_id}/{frozen._trial_id}"
        status, samples, _ = call(server, "GET", f"{base}/{metas[SAMPLES_ARTIFACT].artifact_id}")
        status_svg, svg, headers = call(server, "GET", f"{base}/{metas[CHART_ARTIFACT].artifact_id}")
    rows = [json.loads(line) for line in samples.splitlines()]
    assert status == 200 and [r["step"] for r in rows] == [0, 0, 1, 1] and rows[-1]["reward"] == 0.9
    assert status_svg == 200 and headers["Content-Type"] == "image/svg+xml"
    assert 'data-title="eval reward" data-points="6"' in svg  # total and 2 reward functions, 2 chunks


def test_publish_chunk_never_fails_the_trial(study, caplog):
    finished = optuna.trial.Trial(study.optuna, _trials(study)[0]._trial_id)
    publish_chunk(finished)  # optuna refuses artifacts on a finished trial
    assert "trial 0: could not publish its chunk artifacts" in caplog.text


def test_plain_optuna_dashboard_shows_an_rfopt_study(study):
    import optuna_dashboard
    from wsgiref.simple_server import make_server as wsgiref_server

    with running(wsgiref_server("127.0.0.1", 0, optuna_dashboard.wsgi(study.optuna._storage))) as server:
        status, detail, _ = call(server, "GET", f"/api/studies/{study.optuna._study_id}")
    assert status == 200
    assert [t["state"] for t in detail["trials"]] == ["Complete", "Running", "Running"]
    keys = {a["key"] for a in detail["trials"][0]["user_attrs"]}
    assert {"rfopt:config", "rfopt:metrics:0001", "rfopt:samples:0000", "rfopt:pruning:1"} <= keys


# ---------------------------------------------------------------------- the page in a browser
@pytest.fixture
def browser(tmp_path):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def test_page_shows_running_trials_charts_and_its_buttons_clone_and_stop(study, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # The page redraws its trial list when it refreshes: an element found just before a redraw is gone by the time
    # its text is read, and the wait looks again.
    wait = WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,))
    with serving(study.optuna._storage) as server:
        browser.get(server.url(f"/rfopt/studies/{study.optuna._study_id}"))
        card = browser.find_element(By.CSS_SELECTOR, "section[data-trial='2'][data-state='RUNNING']")
        chart = card.find_element(By.CSS_SELECTOR, "svg.rfopt-chart[data-title='eval reward']")
        assert int(chart.get_attribute("data-points")) == 3  # one chunk: total and two reward functions
        assert len(chart.find_elements(By.CSS_SELECTOR, "circle")) == 3
        kl = card.find_element(By.CSS_SELECTOR, "svg.rfopt-chart[data-title='KL']")
        assert kl.find_element(By.CSS_SELECTOR, "polyline").get_attribute("data-series") == "kl"
        paused = browser.find_element(By.CSS_SELECTOR, "section[data-trial='1']")
        assert [b.get_attribute("data-op") for b in paused.find_elements(By.CSS_SELECTOR, "button.op")] == [
            "resume", "stop", "clone"]
        browser.save_screenshot(str(tmp_path / "rfopt-dashboard.png"))

        # Clone trial 1: a bad field first (the reason is shown, nothing written), then a good one.
        paused.find_element(By.CSS_SELECTOR, "details.clone summary").click()
        box = paused.find_element(By.CSS_SELECTOR, "textarea[name='set']")
        box.send_keys("nope=1")
        paused.find_element(By.CSS_SELECTOR, "button.clone").click()
        wait.until(lambda d: "unknown field" in d.find_element(By.ID, "status").text)
        assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
        box.clear()
        box.send_keys("learning_rate=0.004\nlora_alpha=16")
        paused.find_element(By.CSS_SELECTOR, "button.clone").click()
        wait.until(lambda d: "trial 3: clone of trial 1" in d.find_element(By.ID, "status").text)

        # Stop trial 2 (the page asks first).
        browser.find_element(By.CSS_SELECTOR, "section[data-trial='2'] button.stop").click()
        wait.until(lambda d: _alert(d)).accept()
        wait.until(lambda d: "trial 2: stop requested" in d.find_element(By.ID, "status").text)
        # The list refreshed: trial 2 now says so and offers no more pause or stop.
        wait.until(lambda d: "stop requested" in d.find_element(By.CSS_SELECTOR, "section[data-trial='2'] .notes").text)
        browser.implicitly_wait(0)
        assert browser.find_elements(By.CSS_SELECTOR, "section[data-trial='2'] button.stop") == []
        assert browser.find_element(By.CSS_SELECTOR, "section[data-trial='3'][data-state='WAITING']")
        browser.save_screenshot(str(tmp_path / "rfopt-dashboard-after-ops.png"))

    trials = _trials(study)
    assert len(trials) == 4
    clone = trials[3]
    assert clone.user_attrs["rfopt:clone"]["overrides"] == {"learning_rate": 0.004, "lora_alpha": 16}
    assert rfopt.TrialConfig.from_json(clone.user_attrs["rfopt:config"]).peft_config.lora_alpha == 16
    assert TrialRecord(trials[2]).pending[-1].op == "stop"


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return False
