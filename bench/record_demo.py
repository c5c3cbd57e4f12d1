"""Record the end of a demo run (``rfopt run arithmetic``, what ``make demo`` runs) for ``tests/product/test_demo.py``:
what the study's storage says it produced (its baselines, and each trial's values, eval metrics, samples, best
checkpoint, rung decisions and how it ended), as JSON, with the run's wall time, the load average around it and what it
printed.

    uptime; /usr/bin/time -v rfopt run arithmetic > demo.out 2> demo.err; uptime
    python bench/record_demo.py sqlite:///rfopt.db tests/recorded/demo-arithmetic.json --output demo.out \\
        --wall-seconds 840 --load "2.1 1.9 1.5" --load-after "2.0 2.0 1.7"

The test replays the record into an in-memory study and checks the demo's promise on it: the recommended adapter did
not collapse and beats the base model on the objective and on correctness. A demo whose settings changed since the
recording (its configs, chunks or eval size) fails that test until it is recorded again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import optuna
from optuna.distributions import distribution_to_json

KEPT = ("rfopt:metrics:", "rfopt:samples:", "rfopt:best", "rfopt:baseline_key", "rfopt:pruning:", "rfopt:stopped",
        "rfopt:schedule", "rfopt:fail_reason")
"""The trial records the test reads (the rest, such as each step's logs and the config, it does not)."""
STUDY_KEPT = ("rfopt:objective", "rfopt:eval", "rfopt:num_chunks", "rfopt:baseline:")


def record(storage: str, study_name: str) -> dict:
    study = optuna.load_study(study_name=study_name, storage=storage)
    system = study._storage.get_study_system_attrs(study._study_id)
    return {
        "study": {"name": study_name, "direction": study.direction.name.lower(),
                  "system_attrs": {k: v for k, v in system.items() if k.startswith(STUDY_KEPT)}},
        "trials": [{
            "number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
            "distributions": {k: distribution_to_json(d) for k, d in t.distributions.items()},
            "intermediate_values": {str(k): v for k, v in t.intermediate_values.items()},
            "system_attrs": {k: v for k, v in t.system_attrs.items() if k.startswith(KEPT)},
        } for t in study.get_trials()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("storage")
    parser.add_argument("out", type=Path)
    parser.add_argument("--study", default="arithmetic")
    parser.add_argument("--output", type=Path, help="what the run printed on stdout (its closing summary)")
    parser.add_argument("--wall-seconds", type=float)
    parser.add_argument("--load", help="the load average before the run (uptime's three numbers)")
    parser.add_argument("--load-after", help="the load average after it")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    data = record(args.storage, args.study)
    data["run"] = {"command": "rfopt run arithmetic", "wall_seconds": args.wall_seconds, "load_before": args.load,
                   "load_after": args.load_after, "note": args.note,
                   "output": args.output.read_text() if args.output else None}
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(data['trials'])} trials of {args.study!r} in {args.out}")


if __name__ == "__main__":
    main()
