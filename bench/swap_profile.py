"""Where a swap's time goes: `TrialRunner.train_chunk` from its call to the chunk's first optimizer step.

Builds N trials on one shared base model (the configs of bench/throughput.py), trains each one chunk
(so that every later swap has an optimizer, a scheduler and an RNG state to bring back), then
measures many swaps without training: the first ``training_step`` of each probed chunk raises, so
the runner's state is left as it was (nothing counts as trained; the trainer's patches are undone)
and the same swap can be measured again. Each swap is split into its parts by timing the functions
it calls (wrappers add about a microsecond each):

    activate adapter        ModelPool.activate (TrialRunner.model): the trial's adapter made the active, trainable one
    chunk_args              TrialRunner.chunk_args: a GRPOConfig copy (dataclasses.replace reruns __post_init__)
    chunk_dataset           TrialRunner.chunk_dataset: Dataset.select of the chunk's rows
    construct               GRPOTrainer.__init__ (Trainer + Accelerator + fused LM head patch)
      construct: gc          gc.collect() calls made inside the constructor
    free_memory (gc)        Accelerator.free_memory at the top of Trainer.train: a full gc.collect()
    dataloader              Trainer.get_train_dataloader
    init_state              _init_training_state (TrainerState, carried counters)
    prepare                 Trainer._prepare_for_training (optimizer/scheduler, accelerator.prepare)
    rng_restore             RngState.restore at the first step
    other                   the rest (callbacks, epoch iterator, first batch fetch, ...)

Then it trains one real round of chunks and reports the tail of a chunk too: from the last step's
logging (which training straight through does as well) to ``train_chunk`` returning (the epoch's
end, Trainer._finalize_training, undoing the trainer's patches, the runner's bookkeeping).

    python bench/swap_profile.py --model smollm2 --configs 2 --reps 10

``--gc-freeze`` calls ``gc.freeze()`` once after the model and adapters are set up (a candidate
engine change: a full collection then only walks objects made later). Run it with another copy of
rfopt first on PYTHONPATH to measure a prototype engine change against the same harness.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (sets the environment and sys.path for rfopt)


# The disjoint parts of a swap (the gc figures overlap with them).
PARTS = [
    "activate adapter", "chunk_args", "chunk_dataset", "construct", "free_memory (gc)", "dataloader", "init_state", "prepare",
    "rng_restore",
]


class _Abort(Exception):
    """Raised at a probed chunk's first training step."""


class Timeline:
    """Durations of instrumented calls, grouped by part, for the swap being measured."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = defaultdict(float)
        self.active: list[str] = []
        self.first_step_at: float | None = None
        self.step_ends: list[float] = []
        self.log_ends: list[float] = []
        self.abort = False

    def reset(self) -> None:
        self.parts = defaultdict(float)
        self.first_step_at = None
        self.step_ends = []
        self.log_ends = []


@contextlib.contextmanager
def instrument(timeline: Timeline) -> Iterator[None]:
    import accelerate
    from trl import GRPOTrainer

    import rfopt.training.runner as runner_module
    from rfopt.training.models import ModelPool

    from rfopt import compat
    from rfopt.storage.state import RngState

    chunk_trainer = compat.chunk_trainer_class()
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, part: str) -> None:
        original = owner.__dict__.get(name)  # None: inherited, so restoring means deleting the wrapper
        bound_original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # Time only the outermost instrumented call of a part (gc inside construct is reported apart).
            started = time.perf_counter()
            timeline.active.append(part)
            try:
                return bound_original(*args, **kwargs)
            finally:
                timeline.active.pop()
                elapsed = time.perf_counter() - started
                if part not in timeline.active:
                    timeline.parts[part] += elapsed

        patched.append((owner, name, original))
        setattr(owner, name, wrapper)

    wrap(ModelPool, "activate", "activate adapter")
    wrap(runner_module.TrialRunner, "chunk_args", "chunk_args")
    wrap(runner_module.TrialRunner, "chunk_dataset", "chunk_dataset")
    wrap(GRPOTrainer, "__init__", "construct")
    wrap(accelerate.Accelerator, "free_memory", "free_memory (gc)")
    wrap(GRPOTrainer, "get_train_dataloader", "dataloader")
    wrap(chunk_trainer, "_init_training_state", "init_state")
    wrap(GRPOTrainer, "_prepare_for_training", "prepare")
    wrap(RngState, "restore", "rng_restore")
    wrap(GRPOTrainer, "_finalize_training", "tail: finalize_training")

    original_collect = gc.collect

    explicit = [False]

    def collect(*args: Any, **kwargs: Any) -> int:
        started = time.perf_counter()
        explicit[0] = True
        try:
            return original_collect(*args, **kwargs)
        finally:
            explicit[0] = False
            if "construct" in timeline.active:
                timeline.parts["construct: gc"] += time.perf_counter() - started
            elif not timeline.active:
                timeline.parts["gc.collect elsewhere"] += time.perf_counter() - started

    gc.collect = collect
    # Automatic collections (not gc.collect() calls): a generation-2 one walks the whole heap too.
    gc_started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2 or explicit[0]:
            return
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            timeline.parts["automatic full gc (count)"] += 1
            timeline.parts["automatic full gc"] += time.perf_counter() - gc_started.pop()

    gc.callbacks.append(on_gc)
    original_step = GRPOTrainer.__dict__["training_step"]

    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if timeline.first_step_at is None:
            timeline.first_step_at = time.perf_counter()
            if timeline.abort:
                raise _Abort
        try:
            return original_step(self, *args, **kwargs)
        finally:
            timeline.step_ends.append(time.perf_counter())

    GRPOTrainer.training_step = training_step
    original_log = GRPOTrainer.__dict__.get("_maybe_log_save_evaluate")
    inherited_log = GRPOTrainer._maybe_log_save_evaluate

    def maybe_log_save_evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return inherited_log(self, *args, **kwargs)
        finally:
            timeline.log_ends.append(time.perf_counter())

    GRPOTrainer._maybe_log_save_evaluate = maybe_log_save_evaluate
    try:
        yield
    finally:
        GRPOTrainer.training_step = original_step
        if original_log is None:
            del GRPOTrainer._maybe_log_save_evaluate
        else:
            GRPOTrainer._maybe_log_save_evaluate = original_log
        gc.callbacks.remove(on_gc)
        gc.collect = original_collect
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="tiny")
    parser.add_argument("--configs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10, help="probed swaps per trial")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once after setup (candidate fix)")
    parser.add_argument("--probes-only", action="store_true", help="skip the real chunks (tail, real swaps)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's top N of the probed swaps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    import rfopt
    from rfopt.training.models import ModelPool
    from rfopt.training.runner import TrialRunner

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="rfopt-swap-"))
    setup = throughput.build_setup(
        throughput.parse_args(["--model", args.model, "--configs", str(args.configs)]), workdir
    )
    pool = ModelPool("cpu")
    runners = [
        TrialRunner(i, c, setup.plan, setup.schedules[i], setup.train, pool, workdir / "trainer")
        for i, c in enumerate(setup.configs)
    ]
    timeline = Timeline()
    rows: list[dict[str, float]] = []
    tails: list[float] = []
    with instrument(timeline):
        for runner in runners:  # first chunk: creates adapter, optimizer and scheduler
            runner.train_chunk()
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        started = time.perf_counter()
        gc.collect()
        full_gc_ms = 1000 * (time.perf_counter() - started)
        timeline.abort = True
        profiler = None
        if args.cprofile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        for _ in range(args.reps):
            for runner in runners:
                timeline.reset()
                started = time.perf_counter()
                try:
                    runner.train_chunk()
                except _Abort:
                    pass
                else:
                    raise RuntimeError("the probe did not stop the chunk")
                swap = timeline.first_step_at - started
                row = {"swap": swap} | dict(timeline.parts)
                row["other"] = swap - sum(timeline.parts.get(k, 0.0) for k in PARTS)
                rows.append(row)
        timeline.abort = False
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
        for runner in [] if args.probes_only else runners:  # a real chunk each: the tail after the last step
            timeline.reset()
            runner.train_chunk()
            # Trainer._run_epoch calls _maybe_log_save_evaluate after each optimizer step and once more at the epoch's
            # end. Up to the last step's call is per-step work (clip, optimizer step, logging) that training straight
            # through pays as well; after it is what ending a train() call costs.
            returned = time.perf_counter()
            tails.append(
                {"tail": returned - timeline.log_ends[-2], "last step's optimizer+log": timeline.log_ends[-2] - timeline.step_ends[-1]}
                | {k: v for k, v in timeline.parts.items() if k.startswith(("tail", "gc", "automatic"))}
            )
    # A real chunk's swap is measured by the runner itself; check that the probes agree with it.
    real = [] if args.probes_only else [r.train_chunk().swap_seconds for r in runners if not r.finished]

    keys = ["swap", *PARTS, "other", "construct: gc"]
    summary = {k: 1000 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    summary["automatic full gc during swaps, mean"] = 1000 * statistics.mean(r.get("automatic full gc", 0.0) for r in rows)
    tails = tails or [{"tail": math.nan, "last step's optimizer+log": math.nan}]
    summary["last step: optimizer step + logging (per step, not a swap cost)"] = 1000 * statistics.median(
        t["last step's optimizer+log"] for t in tails
    )
    summary["tail (last step's log -> train_chunk returns)"] = 1000 * statistics.median(t["tail"] for t in tails)
    summary["  tail: Trainer._finalize_training"] = 1000 * statistics.median(t.get("tail: finalize_training", 0.0) for t in tails)
    summary["  gc.collect outside the parts above, per chunk"] = 1000 * statistics.median(
        t.get("gc.collect elsewhere", 0.0) for t in tails
    )
    summary["  automatic full gc per real chunk, mean"] = 1000 * statistics.median(
        t.get("automatic full gc", 0.0) for t in tails
    )
    summary["full gc.collect() in this process"] = full_gc_ms
    summary["real swaps (ChunkMetrics.swap_seconds)"] = 1000 * statistics.median(real) if real else float("nan")
    print(
        f"\nswap profile - model {args.model}, {args.configs} trials, {len(rows)} probed swaps"
        f"{', gc.freeze() after setup' if args.gc_freeze else ''}; rfopt from {Path(rfopt.__file__).parent}"
    )
    print(f"{'part':48}{'median ms':>10}")
    for key, value in summary.items():
        print(f"  {key:46}{value:10.1f}")
    record = {"model": args.model, "configs": args.configs, "gc_freeze": args.gc_freeze, "median_ms": summary,
              "rfopt": str(Path(rfopt.__file__).parent), "swaps_ms": [1000 * r["swap"] for r in rows]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
    for runner in runners:
        runner.cleanup()
    return record


if __name__ == "__main__":
    main()
