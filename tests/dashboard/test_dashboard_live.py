"""The dashboard page in headless Chromium on a live study: `rfopt run tests/dashboard_study.py` (4 trials of the tiny
model, 2 chunks of 4 steps, two of them pruned after their first chunk, the other two alike: a tie) in a subprocess,
the page open while it trains and after it exits.

One study, server and browser for the whole module (the study runs once, ~70 s: each step is slowed to 0.5 s and the
progress record written at most every 0.2 s, so that the page can watch chunks train step by step; one reward call of
the second chunk hangs for 30 s, a stuck reward server); each test then looks at what the page showed while it
trained, or at the page after.
"""

from __future__ import annotations

import datetime
import json
import re
import sqlite3
import subprocess
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest
from crashkit import env, rfopt_command, start
from optuna.trial import TrialState
from rfopt_testkit import chromium

import rfopt
from rfopt.dashboard import make_server
from rfopt.storage.schema import TrialRecord

STUDY_FILE = Path(__file__).resolve().parents[1] / "dashboard_study.py"

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.e2e]


@dataclass
class Live:
    storage: str
    study_id: int
    server: object
    browser: object
    log: Path
    tiny_model: Path
    running_notice: str = ""
    """The liveness notice the page showed while the study trained."""
    states_seen: set[str] = field(default_factory=set)
    """Trial states the page's cards showed while the study trained."""
    now_lines: list[dict] = field(default_factory=list)
    """Each "now training" line the page showed while the study trained: trial, unit, step, phase and its text."""
    in_flight: list[dict] = field(default_factory=list)
    """Each dashed in-flight series of the reward chart the page drew while the study trained: trial and steps, with
    the units the trial had committed when the page showed it (from the storage, read right after)."""
    status: str = ""
    """What ``rfopt status --study live`` printed while a chunk trained."""
    status_runs: int = 0
    situations_seen: set[str] = field(default_factory=set)
    """What the cards said the trials were doing while the study trained (``data-situation``)."""
    stuck_lines: list[dict] = field(default_factory=list)
    """Each "now training" line the page showed as stuck (amber), with the study's forecast line then."""
    stuck_status: str = ""
    """What ``rfopt status`` printed while the page showed a unit stuck."""
    snapshot: tuple[dict, str] | None = None
    """While a chunk trained: the study's end as the page gave it from a copy of the storage taken then, and what
    ``rfopt status`` printed from the same copy (the same records on both sides, while progress records change several
    times a second)."""
    index_row: str = ""
    """The index's row of the study while it trained."""

    @property
    def page(self) -> str:
        return self.server.url(f"/rfopt/studies/{self.study_id}")

    def study(self) -> optuna.Study:
        return optuna.load_study(study_name="live", storage=self.storage)


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    where = tmp_path_factory.mktemp("live")
    browser = chromium(where / "chromium")
    if browser is None:
        pytest.skip("needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver")
    storage = f"sqlite:///{where / 'live.db'}"
    log = where / "run.log"
    process = start(rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--no-progress", "--checkpoint-dir",
                                  str(where / "ck")), where,
                    env(tiny_model, RFOPT_TEST_STEP_SECONDS=0.5, RFOPT_PROGRESS_SECONDS=0.2,
                        RFOPT_TEST_HANG_CALL=24, RFOPT_TEST_HANG_SECONDS=30), log)
    server = None
    try:
        study_id = _wait_for_study(where / "live.db", process, log)
        server = make_server(storage, port=0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        state = Live(storage, study_id, server, browser, log, tiny_model)
        # While it trains: load the page until it says who runs the study (the study's process beats every 5 s, from
        # before it writes anything) and shows a trial training.
        from selenium.webdriver.common.by import By

        while process.poll() is None and not (state.running_notice and "RUNNING" in state.states_seen):
            browser.get(state.page)
            notice = browser.find_element(By.ID, "liveness")
            state.states_seen |= {c.get_attribute("data-state") for c in browser.find_elements(By.CSS_SELECTOR, "section.trial")}
            if notice.get_attribute("data-running") == "true":
                state.running_notice = notice.text
            time.sleep(0.3)
        # The index's row while it trains (a few tries: between two chunks its trials are queued for a moment).
        for _ in range(20):
            browser.get(server.url("/rfopt"))
            state.index_row = browser.find_element(By.CSS_SELECTOR, f"tr[data-study='{study_id}']").text
            if "training" in state.index_row or process.poll() is not None:
                break
            time.sleep(0.2)
        browser.get(state.page)
        # Then watch it train: refresh the open page (what its timer does every 5 s) as fast as it answers.
        while process.poll() is None:
            _watch(state)
        assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
        browser.implicitly_wait(5)
        yield state
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        browser.quit()
        if server is not None:
            server.shutdown()
            server.server_close()


def _watch(state: Live) -> None:
    """Refresh the page once and note what it shows of the chunks in flight."""
    from selenium.common.exceptions import JavascriptException, StaleElementReferenceException

    browser = state.browser
    try:
        browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
        lines = browser.execute_script(
            "return [...document.querySelectorAll('#now li[data-trial]')].map(li => ({trial: +li.dataset.trial, "
            "unit: +li.dataset.unit, step: +li.dataset.step, phase: li.dataset.phase, text: li.textContent, "
            "stuck: li.classList.contains('stuck'), silence: li.querySelector('.silence').textContent}))")
        flights = browser.execute_script(
            "const el = document.getElementById('chart-reward');"
            "return el && el.data ? el.data.filter(t => t.meta.role === 'in-flight').map(t => ({trial: t.meta.trial, "
            "x: t.x, dash: t.line.dash})) : []")
        state.situations_seen |= set(browser.execute_script(
            "return [...document.querySelectorAll('section.trial')].map(c => c.dataset.situation)"))
        eta = browser.execute_script(_ETA)  # as the page shows it with these lines
    except (JavascriptException, StaleElementReferenceException):
        return
    committed = {t.number: len(t.intermediate_values) for t in state.study().trials}
    state.now_lines += lines
    state.in_flight += [f | {"committed": committed[f["trial"]]} for f in flights]
    state.stuck_lines += [line | {"eta": eta} for line in lines if line["stuck"]]
    stuck = any(line["stuck"] for line in lines)
    training = any(line["phase"] == "training" for line in lines)
    if state.snapshot is None and training and not stuck and eta is not None:
        state.snapshot = _both_from_a_copy(state)
    if (stuck and not state.stuck_status or "now training: trial " not in state.status and state.status_runs < 3
            and training):
        # asked while a chunk trains: until it says so (three tries), once stuck
        state.status_runs += 1
        printed = subprocess.run(rfopt_command("status", "--study", "live", "--storage", state.storage),
                                 capture_output=True, text=True, env=env(state.tiny_model), timeout=120).stdout
        state.status = state.status if "now training: trial " in state.status else printed
        if stuck:
            state.stuck_status = printed
    time.sleep(0.1)


def _both_from_a_copy(state: Live) -> tuple[dict, str] | None:
    """The study's end as the page and ``rfopt status`` give it from one copy of the storage, taken now (SQLite's
    online backup: one consistent version of the records); the page is served from the copy by a second server."""
    path = Path(state.storage.removeprefix("sqlite:///"))
    copy = path.with_name("copy.db")
    with closing(sqlite3.connect(path)) as live, closing(sqlite3.connect(copy)) as to:
        live.backup(to)
    server = make_server(f"sqlite:///{copy}", port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        state.browser.get(server.url(f"/rfopt/studies/{state.study_id}"))
        eta = state.browser.execute_script(_ETA)
    finally:
        server.shutdown()
        server.server_close()
        state.browser.get(state.page)
    printed = subprocess.run(rfopt_command("status", "--study", "live", "--storage", f"sqlite:///{copy}"),
                             capture_output=True, text=True, env=env(state.tiny_model), timeout=120).stdout
    return (eta, printed) if eta is not None else None


_ETA = ("const e = document.getElementById('eta'); return e && e.dataset.end ? {end: +e.dataset.end, "
        "anchor: +e.dataset.anchor, hold: e.classList.contains('on-hold'), text: e.textContent} : null")


def _wait_for_study(path: Path, process, log: Path) -> int:
    """The study's id once the running process has created it (read without writing: opening the storage here would
    create Optuna's tables, racing the process that does)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None or process.returncode == 0, log.read_text()[-3000:]
        try:
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                row = db.execute("SELECT study_id FROM studies WHERE study_name = 'live'").fetchone()
        except sqlite3.Error:  # no database or no tables yet
            row = None
        if row is not None:
            return row[0]
        time.sleep(0.2)
    raise AssertionError(f"the study never appeared: {log.read_text()[-3000:]}")


def _wait(live: Live, condition, timeout: float = 20):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(live.browser, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(condition)


def _chart(live: Live, key_id: str) -> list[dict]:
    """The Plotly figure data the page drew in ``#chart-<key_id>`` (read back from the browser)."""
    return _wait(live, lambda d: d.execute_script(
        f"const el = document.getElementById('chart-{key_id}');"
        "return el && el.data && el.data.map(t => ({x: t.x, y: t.y, meta: t.meta, name: t.name}))"))


def _open(live: Live) -> None:
    if live.browser.current_url != live.page:
        live.browser.get(live.page)


# ---------------------------------------------------------------------- the tests
def test_page_says_who_runs_the_study_while_it_trains_and_that_nobody_does_after_it_exits(live):
    from selenium.webdriver.common.by import By

    assert live.running_notice.startswith("running: ") and "(run)" in live.running_notice
    assert "RUNNING" in live.states_seen
    _open(live)
    _wait(live, lambda d: d.find_element(By.ID, "liveness").text.startswith("nobody is running this study"))
    assert live.browser.find_element(By.ID, "liveness").get_attribute("data-running") == "false"


def test_objective_chart_has_one_series_per_trial_and_stars_the_best(live):
    study = live.study()
    _open(live)
    data = _chart(live, "objective")
    series = [t for t in data if t["meta"]["role"] == "series"]
    assert sorted(t["meta"]["trial"] for t in series) == [0, 1, 2, 3]
    for trace in series:
        assert trace["y"] == list(study.trials[trace["meta"]["trial"]].intermediate_values.values())
    [star] = [t for t in data if t["meta"]["role"] == "best"]
    assert star["meta"]["trial"] == study.best_trial.number and star["y"] == [study.best_value]
    assert star["name"] == f"★ best: t{study.best_trial.number} lr={study.best_trial.params['learning_rate']:.4g}"


def test_sorting_the_leaderboard_by_value_puts_the_best_first(live):
    from selenium.webdriver.common.by import By

    best = live.study().best_trial.number
    _open(live)
    heads = {th.text: th for th in live.browser.find_elements(By.CSS_SELECTOR, "table.leaderboard th")}
    heads["trial"].click()  # by number first, so that the next sort has something to undo
    heads["trial"].click()  # descending: the highest number on top
    assert live.browser.find_element(By.CSS_SELECTOR, "table.leaderboard tbody tr").get_attribute("data-trial") == "3"
    live.browser.find_element(By.XPATH, "//table[@class='leaderboard']//th[text()='value']").click()
    rows = live.browser.find_elements(By.CSS_SELECTOR, "table.leaderboard tbody tr")
    values = [float(r.find_elements(By.TAG_NAME, "td")[2].get_attribute("data-sort")) for r in rows]
    assert values[0] == live.study().trials[best].value  # the best value on top (trial 3 ties with it)
    assert values == sorted(values, reverse=True)  # maximize: the best value first


def test_a_pruned_trials_series_ends_at_its_last_step_with_its_reason_on_hover(live):
    from selenium.webdriver.common.by import By

    study = live.study()
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert pruned, "precondition: the MedianPruner pruned the trials that cannot learn"
    trial = pruned[0]
    record = TrialRecord(trial)
    reason = record.decision(max(trial.intermediate_values)).reason
    last_step = max(row["step"] for row in record.step_metrics())
    _open(live)
    data = _chart(live, "reward")
    [line] = [t for t in data if (t["meta"]["trial"], t["meta"]["role"], t["meta"].get("state")) == (
        trial.number, "series", "PRUNED")]
    [end] = [i for i, t in enumerate(data) if t["meta"]["role"] == "end" and t["meta"]["trial"] == trial.number]
    assert line["x"][-1] == last_step < max(max(t["x"]) for t in data if t["meta"]["role"] == "series")
    assert data[end]["x"] == [last_step]
    # Hover the cross as a person would (Plotly's hover on that point): the box gives the reason.
    live.browser.execute_script(
        f"Plotly.Fx.hover(document.getElementById('chart-reward'), [{{curveNumber: {end}, pointNumber: 0}}])")
    hover = _wait(live, lambda d: d.find_element(By.CSS_SELECTOR, "#chart-reward .hoverlayer").text)
    assert f"trial {trial.number}" in hover and "PRUNED" in hover
    assert f"ended here: {reason}" in " ".join(hover.split())


def test_samples_with_each_reward_functions_score_are_visible(live):
    from selenium.webdriver.common.by import By

    best = live.study().best_trial
    samples = TrialRecord(best).samples()
    _open(live)
    card = live.browser.find_element(By.CSS_SELECTOR, f"section[data-trial='{best.number}']")
    card.find_element(By.CSS_SELECTOR, "details.samples summary").click()
    table = _wait(live, lambda d: card.find_element(By.CSS_SELECTOR, "details.unit[open] table.samples"))
    heads = [th.text for th in table.find_elements(By.TAG_NAME, "th")]
    assert heads == ["#", "prompt", "completion", "reward (total)", "reward_lowercase", "reward_len"]
    first = samples[max(samples)][0]
    cells = [td.text for td in table.find_elements(By.CSS_SELECTOR, "tbody tr")[0].find_elements(By.TAG_NAME, "td")]
    assert cells[1] == first["prompt"]
    assert [float(c) for c in cells[3:]] == pytest.approx(
        [first["reward"], first["reward_lowercase"], first["reward_len"]], abs=5e-4)
    assert table.is_displayed()


def test_the_now_training_line_changed_step_by_step_while_a_chunk_trained_with_an_eta(live):
    steps = {}
    for line in live.now_lines:
        if line["phase"] == "training":
            steps.setdefault((line["trial"], line["unit"]), set()).add(line["step"])
    assert any(len(seen) >= 2 for seen in steps.values()), steps  # the same chunk, at two different steps
    line = next(x for x in live.now_lines if x["phase"] == "training")
    assert f"trial {line['trial']}" in line["text"] and f"chunk {line['unit'] + 1} of 2" in line["text"]
    assert f"{line['step']} of 4 steps done" in line["text"] and "for " in line["text"]
    assert any("s/step" in x["text"] for x in live.now_lines if x["step"] >= 1)
    assert any("chunk ends in ~" in x["text"] or "chunk ends any moment" in x["text"] for x in live.now_lines)
    assert any(x["phase"] == "evaluating" for x in live.now_lines)
    # rfopt status said the same while the chunk trained.
    assert "running: " in live.status, live.status
    assert "now training: trial " in live.status and " of 2 · " in live.status, live.status


def test_the_steps_of_a_chunk_in_training_were_drawn_dashed_before_it_committed(live):
    study = live.study()
    before_commit = 0
    for flight in live.in_flight:
        assert flight["dash"] == "dash"
        units = {int(r["step"]): int(r["unit"]) for r in TrialRecord(study.trials[flight["trial"]]).step_metrics()}
        unit = units[flight["x"][-1]]
        steps = [x for x in flight["x"] if units.get(x) == unit]
        assert steps and set(flight["x"]) - set(steps) <= {min(flight["x"])}  # from the last committed point on
        assert all(x in units for x in flight["x"])  # the steps it then committed, at the same x
        before_commit += flight["committed"] <= unit  # still not committed after the page showed it
    assert before_commit, live.in_flight


def test_a_finished_studys_page_stops_refetching(live):
    from selenium.webdriver.common.by import By

    live.browser.get(live.page)
    _wait(live, lambda d: "not refreshing" in d.find_element(By.ID, "refreshed").text)
    count = ("return performance.getEntriesByType('resource').filter(e => e.name.includes('/api/studies/') && "
             "e.name.endsWith('/page')).length")
    before = live.browser.execute_script(count)
    time.sleep(11)  # two refresh periods of a running study
    assert live.browser.execute_script(count) == before
    live.browser.find_element(By.ID, "check-now").click()  # a person asks: one conditional request, "no change"
    _wait(live, lambda d: "no change" in d.find_element(By.ID, "refreshed").text)
    assert live.browser.execute_script(count) == before + 1


def test_the_parallel_coordinates_have_one_line_per_trial_and_each_param_its_panel(live):
    from selenium.webdriver.common.by import By

    study = live.study()
    _open(live)
    lines = live.browser.find_elements(By.CSS_SELECTOR, "#parallel svg.parallel polyline[data-trial]")
    assert sorted(int(line.get_attribute("data-trial")) for line in lines) == [t.number for t in study.trials]
    for line in lines:
        pruned = study.trials[int(line.get_attribute("data-trial"))].state == TrialState.PRUNED
        assert (line.get_attribute("stroke-dasharray") is not None) == pruned  # pruned trials drawn, dashed
    params = _chart(live, "params")
    assert [(t["meta"]["param"], sorted(t["meta"]["trials"])) for t in params] == [("learning_rate", [0, 1, 2, 3])]


def test_the_clone_form_is_prefilled_with_the_parents_config_and_offers_a_warm_start_only_from_a_checkpoint(live):
    from selenium.webdriver.common.by import By

    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.storage.schema import study_record

    study = live.study()
    store = CheckpointStore(study_record(study).checkpoint_dir)
    configs = {n: rfopt.TrialConfig.from_json(TrialRecord(study.trials[n]).config_json) for n in (3, 2)}
    _open(live)
    for number in (3, 2):
        card = live.browser.find_element(By.CSS_SELECTOR, f"section[data-trial='{number}']")
        card.find_element(By.CSS_SELECTOR, "details.clone summary").click()
        config = configs[number]
        rate = _wait(live, lambda d: card.find_element(By.CSS_SELECTOR, ".field[data-name='learning_rate'] input"))
        assert float(rate.get_attribute("value")) == config.args.learning_rate
        batch = card.find_element(By.CSS_SELECTOR, ".field[data-name='per_device_train_batch_size'] input")
        assert int(batch.get_attribute("value")) == config.args.per_device_train_batch_size == 16
        scheduler = card.find_element(By.CSS_SELECTOR, ".field[data-name='lr_scheduler_type'] select")
        assert json.loads(scheduler.get_attribute("value")) == "constant"
        rewards = card.find_element(By.CSS_SELECTOR, ".field[data-name='reward_funcs'] textarea")
        assert json.loads(rewards.get_attribute("value")) == json.loads(TrialRecord(study.trials[number]).config_json)[
            "reward_funcs"]
        warm = card.find_elements(By.CSS_SELECTOR, "input[name='warm_start']")
        kept = store.latest(number) is not None and study.trials[number].state != TrialState.COMPLETE
        assert bool(warm) == kept, card.find_element(By.CSS_SELECTOR, ".warm").text
        card.find_element(By.CSS_SELECTOR, "details.clone summary").click()  # closed again


def test_optuna_dashboards_trial_page_fits_a_1440_pixel_window_and_links_to_rfopt(live):
    from selenium.webdriver.common.by import By

    browser = live.browser
    browser.set_window_size(1440, 1000)
    try:
        browser.get(live.server.url(f"/dashboard/studies/{live.study_id}/trials"))
        _wait(live, lambda d: "Trial 3" in d.find_element(By.TAG_NAME, "body").text, timeout=30)
        time.sleep(1)  # its tables lay out
        width, page = browser.execute_script(
            "return [window.innerWidth, document.documentElement.scrollWidth]")
        assert page <= width, f"optuna-dashboard's trial page is {page} px wide in a {width} px window"
        link = browser.find_element(By.ID, "rfopt-backlink")
        _wait(live, lambda d: link.get_attribute("href").endswith(f"/rfopt/studies/{live.study_id}"))
        # Both ways: rfopt's page links to optuna-dashboard's, and / leads to rfopt's list of studies.
        browser.get(live.server.url("/"))
        assert browser.current_url.endswith("/rfopt")
        row = browser.find_element(By.CSS_SELECTOR, f"tr[data-study='{live.study_id}']")
        assert "finished" in row.text and f"(trial {live.study().best_trial.number})" in row.text
    finally:
        browser.set_window_size(1400, 1000)


def test_the_charts_x_axis_can_be_wall_time(live):
    from selenium.webdriver.common.by import By

    _open(live)
    live.browser.find_element(By.CSS_SELECTOR, "input[name='xaxis'][value='time']").click()
    axis, series = _wait(live, lambda d: d.execute_script(
        "const el = document.getElementById('chart-reward');"
        "return el.layout.xaxis.type === 'date' && [el.layout.xaxis.type, el.data.filter("
        "t => t.meta.role === 'series').map(t => t.x.map(x => x === null ? null : new Date(x).getTime()))]"))
    assert axis == "date" and len(series) == 4
    for xs in series:  # each step when it ended: in order, within the run
        assert None not in xs and xs == sorted(xs)
    live.browser.find_element(By.CSS_SELECTOR, "input[name='xaxis'][value='step']").click()
    _wait(live, lambda d: d.execute_script("return document.getElementById('chart-reward').layout.xaxis.type "
                                           "!== 'date'"))


def test_cancelling_a_waiting_clone_from_the_page_takes_it_out_of_the_queue(live):
    from selenium.webdriver.common.by import By

    def card(number):
        return live.browser.find_element(By.CSS_SELECTOR, f"section[data-trial='{number}']")

    _open(live)
    # Nobody runs the study any more: a clone made now waits, and the page says so.
    card(1).find_element(By.CSS_SELECTOR, "details.clone summary").click()
    rate = card(1).find_element(By.CSS_SELECTOR, ".field[data-name='learning_rate'] input")
    rate.clear()
    rate.send_keys("0.03")
    card(1).find_element(By.CSS_SELECTOR, "button.clone").click()
    _wait(live, lambda d: "trial 4: clone of trial 1" in card(1).find_element(By.CSS_SELECTOR, ".feedback").text)
    notice = _wait(live, lambda d: "1 WAITING trial (clone 4)" in d.find_element(By.ID, "liveness").text
                   and d.find_element(By.ID, "liveness"))
    assert notice.text.startswith("nobody is running this study") and "warn" in notice.get_attribute("class")
    assert live.study().trials[4].state == TrialState.WAITING

    card(4).find_element(By.CSS_SELECTOR, "button.cancel").click()
    _wait(live, lambda d: _alert(d)).accept()
    _wait(live, lambda d: "trial 4: cancelled by dashboard" in card(4).find_element(By.CSS_SELECTOR, ".feedback").text)
    _wait(live, lambda d: card(4).get_attribute("data-state") == "CANCELLED")
    _wait(live, lambda d: "WAITING" not in d.find_element(By.ID, "liveness").text)
    clone = live.study().trials[4]
    assert clone.state == TrialState.FAIL and TrialRecord(clone).cancelled is not None
    assert live.study().get_trials(states=[TrialState.WAITING]) == []


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return False


# ---------------------------------------------------------------------- trust: stuck, the end, ties, states, clones
def test_a_hung_reward_call_turns_its_line_amber_and_puts_the_etas_on_hold(live):
    assert live.stuck_lines, "the page never showed the hung chunk as stuck"
    line = live.stuck_lines[-1]
    assert line["phase"] == "training" and line["unit"] == 1  # the second chunk's hung step
    assert line["silence"].startswith("no step for ") and "(a step takes ~" in line["silence"]
    assert line["silence"].endswith("stuck or very slow; ETAs on hold")
    assert "on hold: no progress" in line["text"]  # its chunk's ETA stopped counting down
    held = [x["eta"] for x in live.stuck_lines if x["eta"] is not None]
    assert held and all(e["hold"] and "on hold: no progress" in e["text"] for e in held)  # the study's end too
    # Not stuck before the hang: the lines of the first chunk, as it trained step by step, never were.
    assert not any(x["stuck"] for x in live.now_lines if x["unit"] == 0)
    # rfopt status said it too, from the same records.
    assert "STUCK? no step for " in live.stuck_status, live.stuck_status
    assert "study: its end is on hold while trial" in live.stuck_status


def test_the_page_and_rfopt_status_give_the_study_the_same_end(live):
    # Both forecast from the records in storage, anchored at the newest one's time: from the same records, the same
    # end. While the reward call hangs nothing is written, so the page and rfopt status read the same records.
    found = re.search(r"at its pace before, it ended by (\d\d:\d\d:\d\d)", live.stuck_status)
    assert found, live.stuck_status
    said = _today_at(found.group(1))
    shown = {x["eta"]["end"] for x in live.stuck_lines if x["eta"] is not None}
    assert shown and all(abs(end - said) <= 1.0 for end in shown), (live.stuck_status, shown)
    # And while a chunk trains (progress records every 0.2 s here: several versions of the records a second), from one
    # copy of the storage: both name the version they read by its newest record's time, to the millisecond, and give
    # the same end.
    assert live.snapshot is not None
    page, printed = live.snapshot
    found = re.search(r"; ends by (\d\d:\d\d:\d\d) \(as its records of (\d\d:\d\d:\d\d\.\d\d\d) say\)", printed)
    assert found and not page["hold"], (printed, page)
    assert abs(page["anchor"] - _today_at(found.group(2))) < 5e-4, (printed, page)
    assert 0 <= page["end"] - _today_at(found.group(1)) < 1.0, (printed, page)


def _today_at(clock: str) -> float:
    """``20:42:06`` or ``20:42:06.413``, today, in seconds since the epoch."""
    hours, minutes, seconds = clock.split(":")
    whole, _, millis = seconds.partition(".")
    return datetime.datetime.now().replace(hour=int(hours), minute=int(minutes), second=int(whole),
                                           microsecond=int(millis.ljust(3, "0")) * 1000).timestamp()


def test_the_leader_within_noise_of_the_runner_up_is_marked_a_tie(live):
    from selenium.webdriver.common.by import By

    study = live.study()
    assert study.trials[1].value == study.trials[3].value  # the same config: the same completions
    _open(live)
    row = live.browser.find_element(By.CSS_SELECTOR, "table.leaderboard tbody tr")
    assert row.get_attribute("data-trial") == "1" and "tie with trial 3" in row.text
    assert "± " in row.text and "(n=8)" in row.text  # the value with its standard error over the 8 eval prompts
    versus = live.browser.find_element(By.ID, "versus").text
    assert "Trial 1 against the runner-up, trial 3" in versus and "a tie: tie: within noise of trial 3" in versus


def test_each_trial_is_shown_what_it_is_doing_while_and_after_the_study_runs(live):
    from selenium.webdriver.common.by import By

    assert "training" in live.situations_seen and "running" not in live.situations_seen
    assert "running" in live.index_row and "training" in live.index_row
    _open(live)
    shown = {int(c.get_attribute("data-trial")): c.get_attribute("data-situation")
             for c in live.browser.find_elements(By.CSS_SELECTOR, "section.trial")}
    assert shown == {0: "pruned", 1: "complete", 2: "pruned", 3: "complete", **{n: shown[n] for n in shown if n > 3}}
    cells = {int(r.get_attribute("data-trial")): r.find_elements(By.TAG_NAME, "td")[1].text
             for r in live.browser.find_elements(By.CSS_SELECTOR, "table.leaderboard tbody tr")}
    assert cells[0] == cells[2] == "pruned" and cells[1] == cells[3] == "complete"


def test_the_clone_forms_first_fields_are_the_searched_params_and_it_opens_at_once(live):
    from selenium.webdriver.common.by import By

    _open(live)
    card = live.browser.find_element(By.CSS_SELECTOR, "section[data-trial='1']")
    card.find_element(By.CSS_SELECTOR, "details.clone summary").click()
    first = _wait(live, lambda d: card.find_element(By.CSS_SELECTOR, "form.clone-form fieldset .field"))
    took = live.browser.execute_script(  # the form's request, as the browser timed it
        "const e = performance.getEntriesByType('resource').filter(e => e.name.endsWith('/trials/1/config'));"
        "return e[e.length - 1].duration / 1000")
    legend = card.find_element(By.CSS_SELECTOR, "form.clone-form fieldset legend").text
    assert legend.startswith("Searched") and first.get_attribute("data-name") == "learning_rate"
    assert first.find_element(By.TAG_NAME, "label").text == "learning_rate"
    set_here = card.find_elements(By.CSS_SELECTOR, "fieldset[data-group='set'] .field")
    assert 0 < len(set_here) < 15  # what the trial sets, not every GRPOConfig field
    assert not card.find_element(By.CSS_SELECTOR, "details.all-fields").get_attribute("open")
    assert took < 1.0, f"the first clone form took {took:.2f} s"
    card.find_element(By.CSS_SELECTOR, "details.clone summary").click()  # closed again
