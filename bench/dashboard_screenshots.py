"""Screenshots of rfopt's dashboard page on a short live study of the tiny model.

    python bench/dashboard_screenshots.py /tmp/rfopt-shots            # [--chunks 3]

Runs tests/dashboard_study.py (4 trials, a MedianPruner stopping the two that cannot learn) with `rfopt run` in a
subprocess, serves the dashboard on a free local port and saves PNGs with headless Chromium (Debian's chromium and
chromium-driver, selenium): the page while the study trains, the whole page once it has exited, a hover on a pruned
trial's cross, a trial's samples opened, and a WAITING clone with the "nobody is running" warning. Prints each
file's path. Needs no network; takes about a minute.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
sys.path[:0] = [str(REPO), str(TESTS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the PNG files (created)")
    parser.add_argument("--chunks", type=int, default=3, help="chunks per trial (default 3)")
    args = parser.parse_args(argv)

    from crashkit import env, rfopt_command, start
    from rfopt_testkit import chromium

    from rfopt.dashboard import make_server
    from rfopt.tiny import build_tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rfopt-shots-") as tmp:
        where = Path(tmp)
        model = build_tiny_model(where / "tiny")
        storage = f"sqlite:///{where / 'live.db'}"
        process = start(
            rfopt_command("run", str(TESTS / "dashboard_study.py"), "--storage", storage, "--no-progress",
                          "--checkpoint-dir", str(where / "ck")),
            where, env(model, RFOPT_TEST_CHUNKS=args.chunks), where / "run.log",
        )
        browser = chromium(where / "chromium", width=1400, height=1000)
        if browser is None:
            print("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)", file=sys.stderr)
            process.kill()
            return 1
        server = None
        shots: list[Path] = []

        def shot(name: str, full: bool = True) -> None:
            if full:
                height = browser.execute_script("return document.body.scrollHeight")
                browser.set_window_size(1400, min(max(height, 1000), 8000))
                time.sleep(0.8)  # charts resize with the window
            path = args.out / name
            browser.save_screenshot(str(path))
            browser.set_window_size(1400, 1000)
            shots.append(path)

        try:
            study_id = _wait_for_study(where / "live.db", process)
            server = make_server(storage, port=0)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            page = server.url(f"/rfopt/studies/{study_id}")
            from selenium.webdriver.common.by import By

            browser.implicitly_wait(5)
            while process.poll() is None:  # while it trains: once some chunks are in and a process is seen
                browser.get(page)
                done = browser.execute_script(
                    "const el = document.getElementById('chart-objective');"
                    "return el && el.data ? el.data.filter(t => t.meta.role === 'series').length : 0")
                running = browser.find_element(By.ID, "liveness").get_attribute("data-running") == "true"
                if running and done >= 2:
                    time.sleep(1.5)
                    shot("1-live-study-training.png")
                    break
                time.sleep(1)
            if process.wait(timeout=600) != 0:
                print((where / "run.log").read_text()[-3000:], file=sys.stderr)
                return 1
            browser.get(page)
            time.sleep(2)
            shot("2-study-finished.png")

            # Hover the cross that ends a pruned trial's reward curve.
            browser.execute_script(
                "const el = document.getElementById('chart-reward');"
                "const i = el.data.findIndex(t => t.meta.role === 'end');"
                "el.scrollIntoView(); if (i >= 0) Plotly.Fx.hover(el, [{curveNumber: i, pointNumber: 0}]);")
            time.sleep(0.5)
            shot("3-hover-pruned-trial.png", full=False)

            # A trial's samples, and a clone nobody will run.
            browser.get(page)
            card = browser.find_element(By.CSS_SELECTOR, "section.trial[data-state='COMPLETE']")
            card.find_element(By.CSS_SELECTOR, "details.samples summary").click()
            time.sleep(1)
            browser.execute_script("arguments[0].scrollIntoView()", card)
            shot("4-samples.png", full=False)
            card.find_element(By.CSS_SELECTOR, "details.clone summary").click()
            card.find_element(By.CSS_SELECTOR, "textarea[name='set']").send_keys("learning_rate=0.03")
            card.find_element(By.CSS_SELECTOR, "button.clone").click()
            time.sleep(2)
            browser.execute_script("window.scrollTo(0, 0)")
            shot("5-waiting-clone-nobody-running.png", full=False)
        finally:
            if process.poll() is None:
                process.kill()
            browser.quit()
            if server is not None:
                server.shutdown()
                server.server_close()
    for path in shots:
        print(path)
    return 0


def _wait_for_study(path: Path, process) -> int:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() in (None, 0):
        try:
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                row = db.execute("SELECT study_id FROM studies WHERE study_name = 'live'").fetchone()
        except sqlite3.Error:
            row = None
        if row is not None:
            return row[0]
        time.sleep(0.2)
    raise SystemExit("the study never appeared in its storage")


if __name__ == "__main__":
    sys.exit(main())
