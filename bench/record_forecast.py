"""Record a study as it runs, for the forecast's tests (`tests/reports/test_forecast.py`): run `tests/forecast_study.py`
(6 trials of the tiny model, 4 chunks, two gangs of 3, successive halving) with `rfopt run` in a subprocess, read its
storage every 0.2 s, and keep a snapshot of every trial each time a unit commits or a rung is decided, with the time it
was taken; the time the run ended closes the recording.

    python bench/record_forecast.py tests/recorded/forecast-halving.json

A snapshot keeps what the forecast reads (states, reported values, schedules, unit metrics, rung decisions, progress,
gangs) and the study's run shape, not the samples or per-step logs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TIMES = ("seconds", "eval_seconds", "swap_seconds", "started_at")
KEPT = ("rfopt:schedule", "rfopt:metrics:", "rfopt:pruning:", "rfopt:progress", "rfopt:gang:", "rfopt:paused",
        "rfopt:clone", "rfopt:stopped", "rfopt:cancelled")


def snapshot_trial(trial) -> dict:
    attrs = {}
    for key, value in trial.system_attrs.items():
        if not key.startswith(KEPT):
            continue
        if key.startswith("rfopt:metrics:"):  # the unit's times, not its metrics
            value = {"chunk": value.get("chunk"), "train": {k: v for k, v in (value.get("train") or {}).items()
                                                            if k in TIMES}}
        if key == "rfopt:progress":
            value = {k: v for k, v in value.items() if k != "logs"}
        attrs[key] = value
    return {"number": trial.number, "state": trial.state.name,
            "intermediate_values": {str(k): v for k, v in trial.intermediate_values.items()},
            "value": trial.value if trial.state.name == "COMPLETE" else None,
            "datetime_start": trial.datetime_start.timestamp() if trial.datetime_start else None,
            "datetime_complete": trial.datetime_complete.timestamp() if trial.datetime_complete else None,
            "system_attrs": attrs}


def main(out: str) -> None:
    import optuna

    from rfopt.tiny import build_tiny_model

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    where = Path(tempfile.mkdtemp(prefix="rfopt-forecast-"))
    model = build_tiny_model(where / "tiny")
    db = where / "study.db"
    storage = f"sqlite:///{db}"
    env = {**os.environ, "RFOPT_TEST_TINY_MODEL": str(model), "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rfopt.cli", "run", str(ROOT / "tests" / "forecast_study.py"), "--storage",
               storage, "--no-progress", "--checkpoint-dir", str(where / "ck")]
    with open(where / "run.log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    while process.poll() is None:
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                if con.execute("SELECT 1 FROM studies WHERE study_name = 'forecast'").fetchone():
                    break
        except sqlite3.Error:  # no database or no tables yet
            pass
        time.sleep(0.2)
    study = optuna.load_study(study_name="forecast", storage=storage)
    snapshots, seen = [], None
    while True:
        running = process.poll() is None
        trials = study.get_trials(deepcopy=False)
        key = json.dumps([[t.state.name, sorted(t.intermediate_values), sorted(k for k in t.system_attrs
                                                                                 if k.startswith("rfopt:pruning:"))]
                          for t in trials])
        if key != seen and trials:
            seen = key
            attrs = study.system_attrs if hasattr(study, "system_attrs") else \
                study._storage.get_study_system_attrs(study._study_id)  # noqa: SLF001 - a bench script
            snapshots.append({"time": time.time(), "trials": [snapshot_trial(t) for t in trials],
                              "study_attrs": {k: v for k, v in attrs.items() if k == "rfopt:run_shape"}})
        if not running:
            break
        time.sleep(0.2)
    assert process.returncode == 0, (where / "run.log").read_text()[-3000:]
    ended = max(t["datetime_complete"] or 0 for t in snapshots[-1]["trials"])
    Path(out).write_text(json.dumps({"study": "tests/forecast_study.py", "ended": ended, "snapshots": snapshots},
                                    indent=None, separators=(",", ":")))
    print(f"{len(snapshots)} snapshots, {ended - snapshots[0]['time']:.1f} s from the first; written to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "tests" / "recorded" / "forecast-halving.json"))
