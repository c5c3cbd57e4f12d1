"""Screenshots of rfopt's dashboard page on a short live study of the tiny model (the README's, in docs/dashboard).

    python bench/dashboard_screenshots.py docs/dashboard            # [--chunks 3] [--width 960]

Runs tests/dashboard_study.py (4 trials of LoRA adapters on one base model, trained in gangs; a MedianPruner stopping
the two that cannot learn; each optimizer step slowed to 1 s so that a chunk can be watched) with `rfopt run` in a
subprocess, serves the dashboard on a free local port and
saves PNGs with headless Chromium (Debian's chromium and chromium-driver, selenium), each shrunk to `--width` pixels
and to a 256-colour palette (Pillow) so that the README's pictures stay small:

1. the top of the page while a chunk trains: who runs the study, what trains now (a gang as one line: chunk c of C,
   step s of S, whose turn it is, ETAs), the leaderboard;
2. the charts while it trains: the chunk in training drawn dashed;
3. once the study has exited: the leaderboard and "why it wins" (parallel coordinates, each param against the value);
4. a hover on a pruned trial's cross, with the reason;
5. the same eval prompt across trials, each reward's score;
6. the clone form, pre-filled with the trial's config;
7. a chunk whose reward call hangs (one call of the third chunk sleeps 40 s): its line amber, in the turn of the
   member whose call hangs, the ETAs on hold.

Prints each file's path and size. Needs no network; takes a few minutes on a busy 2-core machine.
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
    parser.add_argument("--width", type=int, default=960, help="width of the saved pictures in pixels (default 960)")
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
            where, env(model, RFOPT_TEST_CHUNKS=args.chunks, RFOPT_TEST_STEP_SECONDS=1.0, RFOPT_PROGRESS_SECONDS=0.5,
                       RFOPT_TEST_LORA=1,
                       RFOPT_TEST_HANG_CALL=HANG_CALL, RFOPT_TEST_HANG_SECONDS=40),
            where / "run.log",
        )
        browser = chromium(where / "chromium", width=1400, height=900)
        if browser is None:
            print("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)", file=sys.stderr)
            process.kill()
            return 1
        server = None
        shots: list[Path] = []

        def shot(name: str, element: str | None = None) -> None:
            """The window (or one element, scrolled into view), saved small."""
            if element is not None:
                browser.execute_script(f"document.querySelector({element!r}).scrollIntoView()")
                time.sleep(0.5)
            path = args.out / name
            browser.save_screenshot(str(path))
            _shrink(path, args.width)
            shots.append(path)

        try:
            study_id = _wait_for_study(where / "live.db", process)
            server = make_server(storage, port=0)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            page = server.url(f"/rfopt/studies/{study_id}")
            from selenium.webdriver.common.by import By

            browser.implicitly_wait(5)
            browser.get(page)
            while process.poll() is None:  # while it trains: its second chunks, a step or two in
                browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
                lines = browser.find_elements(By.CSS_SELECTOR, "#now li[data-phase='training']")
                if lines and int(lines[0].get_attribute("data-unit")) >= 1 and \
                        int(lines[0].get_attribute("data-step")) >= 2 and "training member" in lines[0].text:
                    time.sleep(1.2)  # the clocks count
                    shot("1-now-training.png")
                    shot("2-chunk-in-training-dashed.png", "#comparison")
                    break
                time.sleep(0.5)
            browser.execute_script("window.scrollTo(0, 0)")
            while process.poll() is None:  # until the hung call reads as stuck
                browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
                if browser.find_elements(By.CSS_SELECTOR, "#now li.stuck"):
                    time.sleep(3)  # a few seconds of silence counted
                    path = args.out / "7-stuck.png"
                    browser.find_element(By.ID, "now").screenshot(str(path))
                    _shrink(path, args.width)
                    shots.append(path)
                    break
                time.sleep(0.5)
            if process.wait(timeout=900) != 0:
                print((where / "run.log").read_text()[-3000:], file=sys.stderr)
                return 1
            browser.get(page)
            time.sleep(2)
            shot("3-leaderboard-and-why-it-wins.png", "#leaderboard")

            # Hover the cross that ends a pruned trial's reward curve.
            browser.execute_script(
                "const el = document.getElementById('chart-reward');"
                "const i = el.data.findIndex(t => t.meta.role === 'end');"
                "el.scrollIntoView(); if (i >= 0) Plotly.Fx.hover(el, [{curveNumber: i, pointNumber: 0}]);")
            time.sleep(0.5)
            shot("4-hover-pruned-trial.png")

            browser.get(page)
            browser.find_element(By.CSS_SELECTOR, "#side-by-side summary").click()
            browser.find_element(By.CSS_SELECTOR, "#side-by-side select.prompt-picker")
            time.sleep(0.5)
            shot("5-same-prompt-every-trial.png", "#side-by-side")

            card = browser.find_element(By.CSS_SELECTOR, "section.trial[data-state='COMPLETE']")
            card.find_element(By.CSS_SELECTOR, "details.clone summary").click()
            card.find_element(By.CSS_SELECTOR, ".field[data-name='learning_rate'] input")
            time.sleep(0.5)
            browser.execute_script("arguments[0].scrollIntoView()", card)
            shot("6-clone-form.png")
        finally:
            if process.poll() is None:
                process.kill()
            browser.quit()
            if server is not None:
                server.shutdown()
                server.server_close()
    for path in shots:
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


HANG_CALL = 34
"""The reward call that hangs: the third chunk's second step (4 trials x 4 steps and 4 evaluations in the first chunk,
the 2 trials the pruner keeps x 4 steps and 2 evaluations in the second)."""


def _shrink(path: Path, width: int) -> None:
    """The picture scaled to `width` pixels and to a 256-colour palette: some 100 KiB instead of a few hundred."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.width > width:
            image = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
        image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


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
