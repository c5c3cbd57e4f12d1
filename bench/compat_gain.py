"""What a speed entry of rfopt/compat.py buys: the full study with the entry on and off, side by side.

rfopt keeps a patch of another library's internals for speed only if it buys at least 1% of the
SmolLM2 full study (issue 11). This runs rfopt's side of `bench/throughput.py --only study` (the
same configs, `Study.optimize` with evaluation, checkpoints, SQLite and adapters) with the entry on
and with it off (``RFOPT_COMPAT_OFF``), alternating the order over ``--repeats``, and prints each
run's wall time, the median of the per-repeat ratios off/on, and the time spent in full garbage
collections (every ``gc.collect()`` call, and automatic generation-2 collections).

Unlike throughput.py, each run starts with nothing frozen (``gc.unfreeze`` then a collection), as a
fresh ``rfopt run`` does: freezing the heap up front would do the entry's work for it.

    python bench/compat_gain.py --model smollm2 --entry gc_freeze --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (sets the environment and sys.path for rewards/ and studies/)


class GcClock:
    """Seconds spent in full collections: explicit ``gc.collect()`` calls and automatic generation-2 ones."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._started: float | None = None
        self._collect = gc.collect

    def __enter__(self) -> GcClock:
        def collect(*args: Any) -> int:
            started = time.perf_counter()
            try:
                return self._collect(*args)
            finally:
                self.seconds += time.perf_counter() - started
                self.count += 1

        gc.collect = collect
        gc.callbacks.append(self._automatic)
        return self

    def _automatic(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.count += 1
            self._started = None

    def __exit__(self, *exc: Any) -> None:
        gc.collect = self._collect
        gc.callbacks.remove(self._automatic)


def run_side(setup: Any, out_dir: Path, entry: str, on: bool) -> dict[str, float]:
    if on:
        os.environ.pop("RFOPT_COMPAT_OFF", None)
    else:
        os.environ["RFOPT_COMPAT_OFF"] = entry
    gc.unfreeze()
    gc.collect()
    with GcClock() as clock:
        started = time.perf_counter()
        result = throughput.run_study(setup, out_dir)
        wall = time.perf_counter() - started
    os.environ.pop("RFOPT_COMPAT_OFF", None)
    return {"wall_s": wall, "train_wall_s": result.train.wall, "gc_s": clock.seconds, "gc_count": clock.count,
            "swap_s": sum(result.swap_seconds), "step_s": sum(result.step_seconds)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="smollm2")
    parser.add_argument("--entry", default="gc_freeze", help="the compat speed entry to turn off (default: gc_freeze)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="JSON result path; default /tmp/rfopt-bench/<model>-<entry>.json")
    args = parser.parse_args(argv)
    throughput_args = throughput.parse_args(["--model", args.model, "--threads", str(args.threads), "--only", "study"])
    import torch

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rfopt-compat-gain-") as tmp:
        setup = throughput.build_setup(throughput_args, Path(tmp))
        throughput.warm_up(setup, Path(tmp) / "warm")
        for repeat in range(args.repeats):
            order = [True, False] if repeat % 2 == 0 else [False, True]
            pair = {}
            for on in order:
                side = run_side(setup, Path(tmp) / f"r{repeat}-{'on' if on else 'off'}", args.entry, on)
                pair["on" if on else "off"] = side
                print(f"repeat {repeat}: {args.entry} {'on ' if on else 'off'} {side['wall_s']:.1f} s, "
                      f"{side['gc_count']} full collections {side['gc_s']:.2f} s", flush=True)
            runs.append(pair)
    ratios = [r["off"]["wall_s"] / r["on"]["wall_s"] for r in runs]
    gc_saved = statistics.median(r["off"]["gc_s"] - r["on"]["gc_s"] for r in runs)
    record = {
        "model": args.model, "entry": args.entry, "repeats": args.repeats, "runs": runs,
        "ratio_off_over_on_per_repeat": ratios, "ratio_off_over_on_median": statistics.median(ratios),
        "gc_seconds_saved_median": gc_saved,
        "gc_share_of_on_wall_median": statistics.median(
            (r["off"]["gc_s"] - r["on"]["gc_s"]) / r["on"]["wall_s"] for r in runs),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    print(f"\n{args.entry}: wall off/on per repeat {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{record['ratio_off_over_on_median']:.3f}. Full collections: {gc_saved:.2f} s saved a study "
          f"({100 * record['gc_share_of_on_wall_median']:.1f}% of it). Load average {load_start} -> {os.getloadavg()}")
    out = args.out or Path("/tmp/rfopt-bench") / f"{args.model}-{args.entry}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"result written to {out}")
    return record


if __name__ == "__main__":
    main()
