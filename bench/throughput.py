"""Throughput of rfopt's round-robin time-slicing against plain sequential TRL, in one process (issue 2).

Trains the same N GRPO configs (LoRA adapters with different learning rates and ranks on one base
model) over the same rows, in the same order, for the same number of steps, two ways:

(a) plain TRL, one config after another, the way a user does it without rfopt: load the base model,
    ``GRPOTrainer(..., peft_config=lora, train_dataset=rows)`` with ``shuffle_dataset=False``,
    ``train()``. The rows are the ones rfopt's chunk plan feeds the trial
    (``plan.chunks[u][:schedule.prompts_per_chunk]`` for every chunk ``u``, concatenated).
(b) rfopt, round-robin over the same configs, chunk by chunk on one shared base model.

and prints two ratios b/a (> 1 means rfopt is slower):

training only   (b) `TrialRunner`s interleaved round-robin (adapter creation + every chunk: swap,
                trainer construction, training) vs (a) trainer construction (with its PEFT wrapping)
                + ``train()``. Model loading is timed apart and left out of both sides (a loads the
                base model N times, b once); the ratio with loading is printed as well.
full study      (b) ``rfopt.create_study(...).optimize(configs, ...)``: evaluation after every chunk,
                a durable checkpoint per chunk, SQLite reports, rung decisions, final adapter saved,
                and its one model load; vs (a) plain TRL with the SAME evaluation
                (`rfopt.training.evaluation.evaluate` with the same `EvalSettings`, called from a
                `TrainerCallback` at the same step boundaries), ``trainer.save_model`` at the end,
                and its N model loads. The ratio without model loading is printed as well.

Both sides do the same arithmetic: rfopt's chunked training is bit-identical to straight-through
training on the CPU, so the completions, and so the work, are the same. The script checks it: it
compares every trial's final adapter between (a) and (b) and prints the largest difference.

Fairness: one warm-up run of each kind (a one-step plain trainer, one rfopt chunk, one evaluation)
before anything is timed, so imports and first-call costs fall on neither side; and the order
alternates (a then b for training only, b then a for the full study; reversed on every other
``--repeats``). Wall time (``time.perf_counter``) is the figure; the process CPU time is printed
beside it because on a shared machine it is the steadier of the two.

Also printed: the median swap time (`ChunkMetrics.swap_seconds`, the call to ``train_chunk`` to the
chunk's first optimizer step), plain TRL's time to first step (construction + ``train()`` to the
first step), and the checkpoint save time per unit (`CheckpointStore.save`, plus taking the state).

    python bench/throughput.py --model tiny
    python bench/throughput.py --model smollm2 --configs 2 --chunks 4 --steps-per-chunk 1

The result is also written as JSON (default ``/tmp/rfopt-bench/<model>-throughput.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent
# The repository root, for rfopt (with rfopt.rewards and rfopt.studies) when it is not installed. Appended, not prepended, so that another copy of
# rfopt put first on PYTHONPATH (a prototype engine change) is the one measured.
sys.path.append(str(ROOT))

# Per model: defaults that keep a run short (smollm2: one GRPO step is ~8 s on 2 cores), and targets from issue 2.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        configs=3, chunks=4, steps_per_chunk=2, max_completion_length=16, eval_prompts=8,
        learning_rates=[5e-3, 1e-3, 2e-3, 5e-4], ratio_target=1.05, swap_target_ms=None,
    ),
    "smollm2": dict(
        configs=2, chunks=4, steps_per_chunk=1, max_completion_length=64, eval_prompts=4,
        learning_rates=[1e-5, 5e-5, 2e-5, 1e-4], ratio_target=1.02, swap_target_ms=50.0,
    ),
}
LORA_RANKS = [16, 16, 8, 32]
BATCH = 4  # per_device_train_batch_size = num_generations: one prompt per optimizer step


# ---------------------------------------------------------------------- timing
@dataclass
class Clock:
    """Wall and process-CPU seconds of a block."""

    wall: float = 0.0
    cpu: float = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu

    def __add__(self, other: Clock) -> Clock:
        return Clock(self.wall + other.wall, self.cpu + other.cpu)


@dataclass
class SideResult:
    """One side (a or b) of one comparison."""

    train: Clock = field(default_factory=Clock)
    """Training (incl. eval, checkpoints, reports for the full study), model loading left out."""
    load: Clock = field(default_factory=Clock)
    """Base model loading (a: once per config; b: once)."""
    eval_seconds: float = 0.0
    checkpoint_seconds: list[float] = field(default_factory=list)
    swap_seconds: list[float] = field(default_factory=list)
    """rfopt: `ChunkMetrics.swap_seconds` per unit, in run order. Plain TRL: construction + train() to first step."""
    construct_seconds: list[float] = field(default_factory=list)
    first_step_seconds: list[float] = field(default_factory=list)
    chunk_seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """TRL's logged ``step_time`` of every optimizer step: time inside ``training_step`` (generation, rewards,
    forward, backward). The same work on both sides; what a side spends outside it is its overhead."""
    train_chunk_seconds: float = 0.0
    """Full study: time inside `TrialRunner.train_chunk` (the rest is eval, checkpoints, storage, final adapters)."""
    weights: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> Clock:
        return self.train + self.load


@dataclass
class Setup:
    model: str
    source: str
    configs: list[Any]
    train: Any
    test: Any
    plan: Any
    schedules: list[Any]
    settings: Any
    workdir: Path
    device: str = "cpu"
    """Where both sides train (bench/gpu.py: ``cuda``); the placement fields of every config follow it."""
    precision: str = "auto"


# ---------------------------------------------------------------------- configs and data
def build_setup(
    args: argparse.Namespace,
    workdir: Path,
    *,
    source: str | None = None,
    learning_rates: list[float] | None = None,
    lora_ranks: list[int] | None = None,
    device: str = "cpu",
    precision: str = "auto",
) -> Setup:
    """The configs, rows and chunk plan both sides train. `source` etc. override `MODELS[args.model]` (bench/gpu.py)."""
    from rfopt import rewards
    from peft import LoraConfig
    from trl import GRPOConfig

    import rfopt
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.studies.data import load_arithmetic

    spec = MODELS.get(args.model, {})
    learning_rates = learning_rates or spec["learning_rates"]
    lora_ranks = lora_ranks or LORA_RANKS
    if source is None and args.model == "tiny":
        from rfopt.tiny import build_tiny_model

        source = str(build_tiny_model(workdir / "tiny-llama"))
    elif source is None:
        source = "smollm2"
    max_len = args.max_completion_length or spec["max_completion_length"]
    configs = []
    for i in range(args.configs):
        grpo = GRPOConfig(
            output_dir=str(workdir / "unused"),
            learning_rate=learning_rates[i % len(learning_rates)],
            per_device_train_batch_size=BATCH,
            num_generations=BATCH,
            max_completion_length=max_len,
            num_train_epochs=1,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            seed=42,
        )
        peft = LoraConfig(
            r=lora_ranks[i % len(lora_ranks)], lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        configs.append(
            rfopt.TrialConfig(
                model=source,
                # A length reward varies between completions, so advantages and gradients are not zero.
                reward_funcs=[rewards.length_reward(target_length=max_len // 2), rewards.tag_count],
                args=grpo,
                peft_config=peft,
            )
        )
    n_train = args.chunks * args.steps_per_chunk  # one prompt per step (batch 4 = one group of 4 completions)
    train, test = load_arithmetic(n_train=n_train, n_test=args.eval_prompts, seed=0)
    plan = ChunkPlan.build(len(train), args.chunks, seed=0)
    schedules = [trial_schedule(plan, c.args) for c in configs]
    for s in schedules:
        assert s.steps_per_chunk == args.steps_per_chunk, s
    settings = rfopt.EvalSettings(batch_size=max(1, args.eval_prompts), num_samples=2)
    return Setup(args.model, source, configs, train, test, plan, schedules, settings, workdir, device, precision)


def plan_rows(setup: Setup, index: int) -> list[int]:
    """The rows rfopt feeds trial `index`, in order: every chunk's first `prompts_per_chunk` rows."""
    schedule = setup.schedules[index]
    return [
        row
        for unit in range(schedule.num_units)
        for row in setup.plan.chunks[schedule.chunk_of_unit(unit)][: schedule.prompts_per_chunk]
    ]


# ---------------------------------------------------------------------- (a) plain TRL
def _plain_probe(every: int, on_boundary: Callable[[], None] | None):
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Notes when the first step begins; evaluates at every chunk boundary (full-study comparison)."""

        def __init__(self) -> None:
            self.first_step_at: float | None = None
            self.eval_seconds = 0.0
            self.step_seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_step_at is None:
                self.first_step_at = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if on_boundary is not None and state.global_step % every == 0:
                started = time.perf_counter()
                on_boundary()
                self.eval_seconds += time.perf_counter() - started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs and "train_runtime" not in logs:
                self.step_seconds.append(float(logs["step_time"]))

    return Probe()


def run_plain(setup: Setup, *, with_eval: bool, out_dir: Path) -> SideResult:
    """(a): each config trained straight through by its own GRPOTrainer, one after another."""
    from peft import get_peft_model_state_dict
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from rfopt.training.evaluation import evaluate
    from rfopt.training.loading import load_model
    from rfopt.training.models import Placement

    result = SideResult()
    placement = Placement.of(setup.device, setup.precision)
    for i, config in enumerate(setup.configs):
        schedule = setup.schedules[i]
        with result.load.measure():
            model, tokenizer = load_model(config, setup.device)
        # The plumbing rfopt sets for its own trainers, so that only the time-slicing differs.
        args = dataclasses.replace(
            config.args,
            output_dir=str(out_dir / f"plain-{i}"),
            shuffle_dataset=False,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
            generation_batch_size=None,
            **placement.args(),
        )
        trainer_box: list[Any] = []

        def evaluate_now() -> None:
            evaluate(
                trainer_box[0].model,
                tokenizer,
                setup.test,
                list(config.reward_funcs),
                config.args.reward_weights,
                setup.settings,
                max_new_tokens=config.args.max_completion_length,
            )

        probe = _plain_probe(schedule.steps_per_chunk, evaluate_now if with_eval else None)
        with result.train.measure():
            started = time.perf_counter()
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=list(config.reward_funcs),
                args=args,
                train_dataset=setup.train.select(plan_rows(setup, i)),
                processing_class=tokenizer,
                peft_config=copy.deepcopy(config.peft_config),
                callbacks=[probe],
            )
            trainer.remove_callback(PrinterCallback)  # rfopt's trainers print nothing either
            trainer_box.append(trainer)
            constructed = time.perf_counter()
            trainer.train()
            if with_eval:
                trainer.save_model(str(out_dir / f"plain-{i}" / "final"))
        if trainer.state.global_step != schedule.total_steps:
            raise RuntimeError(f"config {i}: plain TRL ran {trainer.state.global_step} steps, expected {schedule.total_steps}")
        result.construct_seconds.append(constructed - started)
        result.first_step_seconds.append((probe.first_step_at or constructed) - constructed)
        result.swap_seconds.append((probe.first_step_at or constructed) - started)
        result.eval_seconds += probe.eval_seconds
        result.step_seconds += probe.step_seconds
        result.weights.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()})
        trainer = trainer_box = model = None  # freed before the next config loads
        gc.collect()
    return result


# ---------------------------------------------------------------------- (b) rfopt
def run_runners(setup: Setup, out_dir: Path, checkpoint_reps: int) -> SideResult:
    """(b) training only: one `TrialRunner` per config on one `ModelPool`, interleaved round-robin."""
    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.training.models import ModelPool
    from rfopt.training.runner import TrialRunner

    result = SideResult()
    pool = ModelPool(setup.device, setup.precision)
    with result.load.measure():
        pool.tokenizer(setup.configs[0])  # loads the shared base model
    with result.train.measure():
        runners = [
            TrialRunner(i, c, setup.plan, setup.schedules[i], setup.train, pool, out_dir / "trainer")
            for i, c in enumerate(setup.configs)
        ]
        for runner in runners:
            runner.setup()  # creates the trial's adapter (plain TRL does it inside the trainer's constructor)
        while not all(r.finished for r in runners):
            for runner in runners:
                if not runner.finished:
                    metrics = runner.train_chunk()
                    result.swap_seconds.append(metrics.swap_seconds)
                    result.chunk_seconds.append(metrics.seconds)
                    result.step_seconds += _chunk_step_times(metrics, runner.schedule.steps_per_chunk)
    result.weights = [r.trainable_weights() for r in runners]
    # Checkpoint cost per unit, measured here outside the timed region (the full study pays it inside its time).
    store = CheckpointStore(out_dir / "checkpoints")
    for runner in runners:
        for _ in range(checkpoint_reps):
            started = time.perf_counter()
            store.save(runner.number, runner.state())
            result.checkpoint_seconds.append(time.perf_counter() - started)
    for runner in runners:
        runner.cleanup()
    del pool, runners
    gc.collect()
    return result


def _chunk_step_times(metrics: Any, steps: int) -> list[float]:
    """A chunk's ``step_time`` values: the runner reports their mean over the chunk (logging_steps=1)."""
    if "step_time" not in metrics.values:
        return []
    return [metrics.values["step_time"]] * steps


@contextlib.contextmanager
def _timed(owner: Any, name: str, sink: list[tuple[float, Any]]) -> Iterator[None]:
    """Wrap ``owner.name`` so that each call's duration (and result) lands in `sink`; restored on exit.

    Instrumentation only: `Study.optimize` runs unchanged, the wrapper adds about a microsecond per call.
    """
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        value = original(*args, **kwargs)
        sink.append((time.perf_counter() - started, value))
        return value

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run_study(setup: Setup, out_dir: Path) -> SideResult:
    """(b) full study: `rfopt.create_study(...).optimize(configs, ...)` with evaluation, checkpoints, SQLite."""
    import optuna

    import rfopt
    import rfopt.training.models
    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.training.runner import TrialRunner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = SideResult()
    loads: list[tuple[float, Any]] = []
    evals: list[tuple[float, Any]] = []
    saves: list[tuple[float, Any]] = []
    chunks: list[tuple[float, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timed(rfopt.training.models, "load_model", loads))
        stack.enter_context(_timed(TrialRunner, "evaluate", evals))
        stack.enter_context(_timed(CheckpointStore, "save_staged", saves))  # what the engine waits for: the files
        stack.enter_context(_timed(TrialRunner, "train_chunk", chunks))   # were staged while the unit was evaluated
        clock = Clock()
        with clock.measure():
            study = rfopt.create_study(
                study_name="throughput",
                storage=f"sqlite:///{out_dir / 'study.db'}",
                pruner=optuna.pruners.NopPruner(),  # every trial runs every chunk, as in (a)
                checkpoint_dir=out_dir / "checkpoints",
            )
            study.optimize(
                setup.configs,
                setup.train,
                setup.test,
                num_chunks=setup.plan.num_chunks,
                eval_settings=setup.settings,
                show_progress_bar=False,
                device=setup.device,
                precision=setup.precision,
                gang_size=1,  # round-robin, one trial at a time, as plain TRL trains; bench/gang.py times gangs
            )
    load = sum(s for s, _ in loads)
    result.load = Clock(wall=load, cpu=load)  # CPU time of the load is not separable; count it as wall
    result.train = Clock(wall=clock.wall - load, cpu=clock.cpu - load)
    result.eval_seconds = sum(s for s, _ in evals)
    result.checkpoint_seconds = [s for s, _ in saves]
    result.swap_seconds = [m.swap_seconds for _, m in chunks]
    result.chunk_seconds = [m.seconds for _, m in chunks]
    result.train_chunk_seconds = sum(s for s, _ in chunks)
    steps = setup.schedules[0].steps_per_chunk  # the same for every config (build_setup checks)
    result.step_seconds = [t for _, m in chunks for t in _chunk_step_times(m, steps)]
    states = {t.number: t.state.name for t in study.optuna.trials}
    if any(state != "COMPLETE" for state in states.values()):
        reasons = {t.number: t.user_attrs.get("rfopt:fail_reason") for t in study.optuna.trials}
        raise RuntimeError(f"study trials did not all complete: {states} {reasons}")
    from safetensors.torch import load_file

    for t in sorted(study.optuna.trials, key=lambda t: t.number):
        weights = load_file(str(Path(t.user_attrs["rfopt:adapter"]) / "adapter_model.safetensors"))
        result.weights.append(weights)
    return result


def _settle() -> None:
    """Start each side with the same garbage-collector state, untimed.

    What one side leaves behind lands in the next side's time otherwise: garbage left by one side's models was
    collected inside the other side's first chunk, and an automatic full collection of about a million objects
    (0.3-0.9 s) fell on whichever side crossed the collector's threshold. Collected and frozen here, both sides start
    with nothing to collect and a heap the collector skips (both alike; each is faster than in a fresh process).
    """
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------------- warm-up
def warm_up(setup: Setup, out_dir: Path) -> float:
    """One plain TRL step, one rfopt chunk and one evaluation, untimed, so first-call costs bias neither side."""
    from rfopt.chunks import ChunkPlan, trial_schedule

    started = time.perf_counter()
    one = setup.train.select([0])
    plan = ChunkPlan.build(1, 1, seed=0)
    warm = dataclasses.replace(
        setup,
        configs=setup.configs[:1],
        train=one,
        test=setup.test.select([0]),
        plan=plan,
        schedules=[trial_schedule(plan, setup.configs[0].args)],
    )
    run_plain(warm, with_eval=True, out_dir=out_dir / "plain")
    run_runners(warm, out_dir / "runners", checkpoint_reps=1)
    return time.perf_counter() - started


# ---------------------------------------------------------------------- report
def max_weight_diff(a: SideResult, b: SideResult) -> float:
    worst = 0.0
    for wa, wb in zip(a.weights, b.weights, strict=True):
        if wa.keys() != wb.keys():
            raise RuntimeError(f"adapter keys differ: {sorted(set(wa) ^ set(wb))[:4]}")
        for key in wa:
            worst = max(worst, float((wa[key].float() - wb[key].float()).abs().max()))
    return worst


def _median_ms(values: list[float]) -> float | None:
    return 1000 * statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:8.1f}"


def summarize(setup: Setup, args: argparse.Namespace, pairs: dict[str, list[tuple[SideResult, SideResult]]]) -> dict[str, Any]:
    """Sum each side over the repeats and build the JSON record."""
    spec = MODELS[args.model]
    record: dict[str, Any] = {"comparisons": {}}
    for name, runs in pairs.items():
        a = [x for x, _ in runs]
        b = [y for _, y in runs]
        a_train = sum((x.train for x in a), Clock())
        b_train = sum((y.train for y in b), Clock())
        a_total = sum((x.total for x in a), Clock())
        b_total = sum((y.total for y in b), Clock())
        rfopt_swaps = [s for y in b for s in y.swap_seconds]
        n_trials = len(setup.configs)
        # Units 1.. of each trial: a real swap, another trial ran in between (unit 0 also builds the optimizer).
        later_swaps = [s for y in b for s in y.swap_seconds[n_trials:]]
        a_steps = sum(s for x in a for s in x.step_seconds)
        b_steps = sum(s for y in b for s in y.step_seconds)
        a_over, b_over = a_train.wall - a_steps, b_train.wall - b_steps
        record["comparisons"][name] = {
            "plain_trl": {
                "train_wall_s": a_train.wall, "train_cpu_s": a_train.cpu,
                "load_wall_s": sum(x.load.wall for x in a), "eval_s": sum(x.eval_seconds for x in a),
                "construct_ms_median": _median_ms([s for x in a for s in x.construct_seconds]),
                "train_to_first_step_ms_median": _median_ms([s for x in a for s in x.first_step_seconds]),
                "time_to_first_step_ms_median": _median_ms([s for x in a for s in x.swap_seconds]),
            },
            "rfopt": {
                "train_wall_s": b_train.wall, "train_cpu_s": b_train.cpu,
                "load_wall_s": sum(y.load.wall for y in b), "eval_s": sum(y.eval_seconds for y in b),
                "swap_ms_median": _median_ms(rfopt_swaps),
                "swap_ms_median_after_first_chunk": _median_ms(later_swaps),
                "swap_ms_all": [1000 * s for s in rfopt_swaps],
                "checkpoint_ms_median": _median_ms([s for y in b for s in y.checkpoint_seconds]),
                "checkpoint_s_total": sum(s for y in b for s in y.checkpoint_seconds),
                "swap_s_total": sum(rfopt_swaps),
                # Full study: what is neither training a chunk nor evaluating nor checkpointing: Optuna/SQLite writes
                # (params, user attrs, reports), rung decisions, final adapter saves, study setup.
                "study_bookkeeping_s": (
                    b_train.wall - sum(y.train_chunk_seconds for y in b) - sum(y.eval_seconds for y in b)
                    - sum(s for y in b for s in y.checkpoint_seconds)
                ) if name == "study" else None,
            },
            "ratio_wall": b_train.wall / a_train.wall,
            # training_step time (generation + loss + backward) is the same work on both sides (same weights, same
            # completions); its ratio shows how much the machine's load moved between the two runs.
            "training_step_s": {"plain_trl": a_steps, "rfopt": b_steps},
            "ratio_training_step_time": b_steps / a_steps if a_steps else None,
            "outside_training_step_s": {"plain_trl": a_over, "rfopt": b_over},
            # The ratio with that noise taken out: both sides charged (a)'s training_step time plus their own overhead.
            "ratio_wall_same_compute": (a_steps + b_over) / (a_steps + a_over) if a_steps else None,
            "ratio_cpu": b_train.cpu / a_train.cpu,
            "ratio_wall_with_model_loading": b_total.wall / a_total.wall,
            "ratio_wall_per_repeat": [y.train.wall / x.train.wall for x, y in runs],
            # The least disturbed run of each side (interference only ever adds time).
            "ratio_wall_of_minimums": min(y.train.wall for y in b) / min(x.train.wall for x in a),
            "ratio_training_step_time_per_repeat": [
                sum(y.step_seconds) / sum(x.step_seconds) if x.step_seconds else None for x, y in runs
            ],
            "max_abs_weight_diff": max(max_weight_diff(x, y) for x, y in runs),
        }
    import peft
    import torch
    import transformers
    import trl

    record.update(
        model=args.model,
        configs=[
            {"learning_rate": c.args.learning_rate, "lora_r": c.peft_config.r, "target_modules": "all-linear"}
            for c in setup.configs
        ],
        chunks=args.chunks,
        steps_per_chunk=args.steps_per_chunk,
        total_steps_per_config=setup.schedules[0].total_steps,
        max_completion_length=setup.configs[0].args.max_completion_length,
        eval_prompts=len(setup.test),
        repeats=args.repeats,
        targets={"ratio": spec["ratio_target"], "swap_ms": spec["swap_target_ms"]},
        machine={
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": args.loadavg_start,
            "loadavg_end": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "peft": peft.__version__,
        },
        warmup_s=args.warmup_seconds,
    )
    return record


def print_report(record: dict[str, Any]) -> None:
    m = record["machine"]
    configs = ", ".join(f"lr {c['learning_rate']:g} r{c['lora_r']}" for c in record["configs"])
    print()
    print(
        f"rfopt throughput - model {record['model']}, {len(record['configs'])} configs "
        f"({configs}), "
        f"{record['chunks']} chunks x {record['steps_per_chunk']} steps = {record['total_steps_per_config']} steps each, "
        f"max_completion_length {record['max_completion_length']}, {record['eval_prompts']} eval prompts"
    )
    print(
        f"machine: {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), transformers "
        f"{m['transformers']}, trl {m['trl']}, peft {m['peft']}; load average {m['loadavg_start'][0]:.2f} -> "
        f"{m['loadavg_end'][0]:.2f}"
    )
    print()
    header = f"{'':34}{'plain TRL (a)':>15}{'rfopt (b)':>12}{'b/a':>8}"
    for name, c in record["comparisons"].items():
        a, b = c["plain_trl"], c["rfopt"]
        title = {
            "training": "TRAINING ONLY (TrialRunner round-robin vs sequential GRPOTrainer)",
            "study": "FULL STUDY (Study.optimize vs sequential GRPOTrainer + same eval + save_model)",
        }[name]
        print(title)
        print(header)
        print(f"{'  wall s, model loading excluded':34}{a['train_wall_s']:15.2f}{b['train_wall_s']:12.2f}{c['ratio_wall']:8.3f}")
        print(f"{'  cpu s, model loading excluded':34}{a['train_cpu_s']:15.2f}{b['train_cpu_s']:12.2f}{c['ratio_cpu']:8.3f}")
        a_tot, b_tot = a["train_wall_s"] + a["load_wall_s"], b["train_wall_s"] + b["load_wall_s"]
        print(f"{'  wall s, with model loading':34}{a_tot:15.2f}{b_tot:12.2f}{c['ratio_wall_with_model_loading']:8.3f}")
        print(f"{'  model loading s':34}{a['load_wall_s']:15.2f}{b['load_wall_s']:12.2f}")
        steps, outside = c["training_step_s"], c["outside_training_step_s"]
        if c["ratio_training_step_time"] is not None:
            print(f"{'  in training_step s (same work)':34}{steps['plain_trl']:15.2f}{steps['rfopt']:12.2f}{c['ratio_training_step_time']:8.3f}")
            print(f"{'  outside training_step s':34}{outside['plain_trl']:15.2f}{outside['rfopt']:12.2f}")
            print(f"{'  ratio at equal training_step time':34}{'':27}{c['ratio_wall_same_compute']:8.3f}")
        if name == "study":
            print(f"{'  evaluation s':34}{a['eval_s']:15.2f}{b['eval_s']:12.2f}")
            print(f"{'  checkpoints s (rfopt only)':34}{'':15}{b['checkpoint_s_total']:12.2f}")
            print(f"{'  swaps s (rfopt only)':34}{'':15}{b['swap_s_total']:12.2f}")
            print(f"{'  SQLite, rungs, final adapters s':34}{'':15}{b['study_bookkeeping_s']:12.2f}")
        print(f"{'  time to first step, median ms':34}{_ms(a['time_to_first_step_ms_median']):>15}{_ms(b['swap_ms_median']):>12}")
        if name == "training":
            print(f"{'    plain: construct + train()->step':34}{_ms(a['construct_ms_median']):>8} + {_ms(a['train_to_first_step_ms_median']).strip()}")
            print(f"{'    rfopt: swaps after chunk 0':34}{'':15}{_ms(b['swap_ms_median_after_first_chunk']):>12}")
        print(f"{'  checkpoint save per unit, median ms':34}{'':15}{_ms(b['checkpoint_ms_median']):>12}")
        if len(c["ratio_wall_per_repeat"]) > 1:
            print(f"  ratio per repeat: {', '.join(f'{r:.3f}' for r in c['ratio_wall_per_repeat'])}; of the minimums: "
                  f"{c['ratio_wall_of_minimums']:.3f}")
            noise = c["ratio_training_step_time_per_repeat"]
            if None not in noise:
                print(f"  training_step time ratio per repeat (1.0 = no interference): {', '.join(f'{r:.3f}' for r in noise)}")
        print(f"  same weights on both sides: max |a - b| = {c['max_abs_weight_diff']:.3g}")
        print()
    t = record["targets"]
    train = record["comparisons"].get("training")
    if train:
        verdict = "met" if train["ratio_wall"] <= t["ratio"] else "NOT met"
        print(f"target ratio <= {t['ratio']} (training only): {train['ratio_wall']:.3f} {verdict}")
        swap = train["rfopt"]["swap_ms_median"]
        if t["swap_ms"] is not None and swap is not None:
            print(f"target swap <= {t['swap_ms']:.0f} ms: {swap:.1f} ms {'met' if swap <= t['swap_ms'] else 'NOT met'}")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--configs", type=int, help="GRPO configs (trials); default 3 (tiny), 2 (smollm2)")
    parser.add_argument("--chunks", type=int, help="chunks per epoch; default 4")
    parser.add_argument("--steps-per-chunk", type=int, help="optimizer steps per chunk; default 2 (tiny), 1 (smollm2)")
    parser.add_argument("--eval-prompts", type=int, help="eval set size; default 8 (tiny), 4 (smollm2)")
    parser.add_argument("--max-completion-length", type=int, help="default 16 (tiny), 64 (smollm2)")
    parser.add_argument(
        "--only", choices=["training", "study"], action="append",
        help="run only this comparison (repeatable); default both",
    )
    parser.add_argument("--repeats", type=int, default=1, help="repeat each comparison, alternating the order")
    parser.add_argument("--checkpoint-reps", type=int, default=3, help="timed checkpoint saves per trial")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--out", type=Path, help="JSON result path; default /tmp/rfopt-bench/<model>-throughput.json")
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    for name in ("configs", "chunks", "steps_per_chunk", "eval_prompts"):
        if getattr(args, name) is None:
            setattr(args, name, spec.get(name, 4))
    for name in ("configs", "chunks", "steps_per_chunk", "eval_prompts", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.only = args.only or ["training", "study"]
    args.out = args.out or Path(tempfile.gettempdir()) / "rfopt-bench" / f"{args.model}-throughput.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.loadavg_start = os.getloadavg()
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="rfopt-bench-"))
    try:
        setup = build_setup(args, workdir)
        args.warmup_seconds = 0.0 if args.no_warmup else warm_up(setup, workdir / "warmup")
        print(f"warm-up: {args.warmup_seconds:.1f} s", flush=True)
        pairs: dict[str, list[tuple[SideResult, SideResult]]] = {name: [] for name in args.only}
        for rep in range(args.repeats):
            flip = rep % 2 == 1
            for name in args.only:
                # Training only: a then b; full study: b then a; both reversed on odd repeats.
                b_first = (name == "study") != flip
                scratch = workdir / f"{name}-{rep}"

                def side_a() -> SideResult:
                    return run_plain(setup, with_eval=name == "study", out_dir=scratch / "plain")

                def side_b() -> SideResult:
                    if name == "study":
                        return run_study(setup, scratch / "study")
                    return run_runners(setup, scratch / "runners", args.checkpoint_reps)

                order = [("b", side_b), ("a", side_a)] if b_first else [("a", side_a), ("b", side_b)]
                done = {}
                for label, side in order:
                    _settle()
                    started = time.perf_counter()
                    done[label] = side()
                    print(f"{name} rep {rep}: ({label}) {time.perf_counter() - started:.1f} s", flush=True)
                pairs[name].append((done["a"], done["b"]))
                shutil.rmtree(scratch, ignore_errors=True)
        record = summarize(setup, args, pairs)
        print_report(record)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"\nresult written to {args.out}")
        return record
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
