"""How much the study page costs the browser: main-thread time and data fetches per refresh, in headless Chromium.

    python bench/dashboard_timing.py [--trials 17] [--seconds 30]

Builds a study synthetically (no training: Optuna plus the records the engine writes, through `rfopt.storage.schema`), with
`--trials` trials of 4 chunks of 8 optimizer steps (two reward functions, eval samples; some COMPLETE, some PRUNED, the
rest RUNNING), serves the dashboard on a free local port, opens the study's page in headless Chromium (Debian's
chromium and chromium-driver, selenium) and, after the first draw, measures for `--seconds` seconds:

- main-thread time (Chrome's ``Performance.getMetrics``: TaskDuration, ScriptDuration, LayoutDuration), in total and
  per 5 s refresh period;
- the page's requests for its data (``performance.getEntriesByType("resource")``), and how many got a full answer.

Two cases: "finished" (nobody runs the study: nothing changes) and "running" (a process beats on the study, nothing
changes either); with `--changing`, a third in which a trial's in-chunk progress record is rewritten every 3 s, as a
training process does. Prints one line per case with the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
sys.path[:0] = [str(REPO), str(TESTS)]

CHUNKS, STEPS = 4, 8


def build(storage: str, trials: int):
    """A study of `trials` trials as the engine leaves it after some chunks."""
    import optuna
    from rfopt_testkit import trial_config

    from rfopt.storage import schema
    from rfopt.chunks import ChunkPlan, TrialSchedule
    from rfopt.compat import storage_of, trial_id_of
    from rfopt.storage.database import open_storage

    study = optuna.create_study(study_name="timing", storage=open_storage(storage), direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    schema.write_plan(study, ChunkPlan.build(16 * CHUNKS, CHUNKS, 0))
    schema.write_settings(study, {"objective": "reward"})
    config = trial_config("tiny-model-not-loaded-here").to_json()
    for number in range(trials):
        trial = study.ask()
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        trial.suggest_categorical("lora_r", [4, 8, 16])
        ref = schema.TrialRef(storage_of(study), trial_id_of(trial), number)
        schema.write_config(ref, config)
        schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=16, steps_per_chunk=STEPS, num_epochs=1,
                                                 num_chunks=CHUNKS))
        units = CHUNKS if number % 3 == 0 else 1 if number % 3 == 1 else 2
        for unit in range(units):
            reward = 0.1 + 0.02 * number + 0.05 * unit + lr
            steps = [{"step": STEPS * unit + i + 1, "reward": reward + 0.01 * i, "rewards/reward_len/mean": reward,
                      "rewards/reward_vowels/mean": 0.05, "reward_std": 0.1, "entropy": 4.6 - 0.01 * i, "loss": 0.0,
                      "completions/mean_length": 7.5, "clip_ratio/region_mean": 0.0, "learning_rate": lr}
                     for i in range(STEPS)]
            train = {"reward": reward, "rewards/reward_len/mean": reward, "seconds": 12.0}
            evaluation = {"reward": reward, "rewards/reward_len/mean": reward, "rewards/reward_vowels/mean": 0.0}
            samples = [{"prompt": f"E{i}: add {i} and {i}", "completion": "x" * (unit + 4), "reward": reward,
                        "reward_len": reward, "reward_vowels": 0.0} for i in range(4)]
            schema.write_unit(ref, unit, {"chunk": unit, "train": train, "eval": evaluation}, samples, steps)
            trial.report(reward, step=unit)
        if units == CHUNKS:
            study.tell(trial, reward)
        elif number % 3 == 1:
            schema.write_decision(ref, schema.PruneDecision(number, 0, True, "rank 9 of 12 at rung 0", (0, 1),
                                                            "MedianPruner"))
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    return study


def measure(browser, url: str, seconds: float) -> dict[str, float]:
    browser.get(url)
    time.sleep(4)  # the first draw
    browser.execute_cdp_cmd("Performance.enable", {})

    def metrics() -> dict[str, float]:
        return {m["name"]: m["value"] for m in browser.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}

    def fetches() -> list[dict]:
        return browser.execute_script(
            "return performance.getEntriesByType('resource').filter(e => e.initiatorType === 'fetch')"
            ".map(e => ({name: e.name, size: e.transferSize, status: e.responseStatus}))")

    before, seen = metrics(), len(fetches())
    time.sleep(seconds)
    after, requests = metrics(), fetches()[seen:]
    periods = seconds / 5
    full = [r for r in requests if r["status"] == 200 and r["size"] > 2000]
    return {
        "task_ms_per_refresh": 1000 * (after["TaskDuration"] - before["TaskDuration"]) / periods,
        "script_ms_per_refresh": 1000 * (after["ScriptDuration"] - before["ScriptDuration"]) / periods,
        "layout_ms_per_refresh": 1000 * (after["LayoutDuration"] - before["LayoutDuration"]) / periods,
        "requests": len(requests),
        "full_answers": len(full),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=17)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--changing", action="store_true", help="also the case with a progress record rewritten")
    args = parser.parse_args(argv)

    from rfopt_testkit import chromium

    from rfopt.dashboard import make_server
    from rfopt.storage.leases import Presence

    with tempfile.TemporaryDirectory(prefix="rfopt-timing-") as tmp:
        storage = f"sqlite:///{Path(tmp) / 'timing.db'}"
        study = build(storage, args.trials)
        server = make_server(storage, port=0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        browser = chromium(Path(tmp) / "chromium", width=1400, height=1000)
        if browser is None:
            print("needs Debian's chromium and chromium-driver", file=sys.stderr)
            return 1
        url = server.url("/rfopt/studies/1")
        try:
            cases = [("finished", None)]
            cases.append(("running", "beat"))
            if args.changing:
                cases.append(("running, progress rewritten every 3 s", "progress"))
            for name, mode in cases:
                stop = threading.Event()
                presence = Presence(study, "run", interval=2.0) if mode else None
                writer = None
                if presence is not None:
                    presence.__enter__()
                if mode == "progress":
                    writer = threading.Thread(target=_rewrite_progress, args=(study, stop), daemon=True)
                    writer.start()
                try:
                    result = measure(browser, url, args.seconds)
                finally:
                    stop.set()
                    if writer is not None:
                        writer.join()
                    if presence is not None:
                        presence.__exit__(None, None, None)
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                print(f"{name:40s} main thread {result['task_ms_per_refresh']:7.0f} ms per 5 s (script "
                      f"{result['script_ms_per_refresh']:.0f}, layout {result['layout_ms_per_refresh']:.0f}); "
                      f"{result['requests']} data requests in {args.seconds:.0f} s, {result['full_answers']} full "
                      f"answers; {args.trials} trials; load average {load}")
        finally:
            browser.quit()
            server.shutdown()
            server.server_close()
    return 0


def _rewrite_progress(study, stop: threading.Event) -> None:
    """A training process's in-chunk progress record, a step further every 3 s (rfopt's `ProgressRecord`)."""
    from rfopt.storage import schema
    from rfopt.compat import storage_of, trial_id_of

    running = [t for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"][0]
    ref = schema.TrialRef(storage_of(study), trial_id_of(running), running.number)
    step = 0
    while not stop.wait(3.0):
        step += 1
        unit = len(running.intermediate_values)
        logs = [{"step": STEPS * unit + i + 1, "reward": 0.3 + 0.01 * i, "loss": 0.0} for i in range(step % STEPS + 1)]
        schema.write_progress(ref, schema.ProgressRecord(
            unit=unit, num_units=CHUNKS, phase="training", step=len(logs), steps=STEPS,
            global_step=STEPS * unit + len(logs), started=time.time() - 3 * step, updated=time.time(),
            step_seconds=3.0, logs=schema.StepColumns.encode(logs)))


if __name__ == "__main__":
    sys.exit(main())
