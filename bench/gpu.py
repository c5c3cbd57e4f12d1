"""rfopt on one GPU: round-robin against sequential TRL, memory, GPU busy time, exactness, workers (issue 16).

Self-contained: the GPU machine reaches no hub and no index, so the model is built here, on the device, with the
*shape* of Qwen2.5-0.5B-Instruct (bench/qwen2.5-0.5b-config.json) and seeded random weights, beside an offline
tokenizer; the prompts are rfopt's synthetic arithmetic set. One run measures, on ``cuda`` in bf16:

- (a) N=4 configs (learning rates apart, LoRA r16) trained one after another by plain ``trl.GRPOTrainer`` vs
  (b) the same configs round-robin by rfopt's `TrialRunner`s on one shared base model, the same rows and steps
  (bench/throughput.py's training-only comparison, whose functions this reuses): wall ratio b/a, median swap time,
  checkpoint save time per unit;
- peak GPU memory (``torch.cuda.max_memory_allocated``) of (b) against one trial alone, and the goal
  base + N x (adapter + AdamW states) + 10%;
- how busy the GPU was during (b) (``torch.cuda.utilization()`` sampled in a thread; needs pynvml, else "n/a");
- exactness: one trial trained in chunks vs straight through, ``torch.use_deterministic_algorithms(True)``;
- the same sweep as a study on SQLite run by 1, 2 and 4 ``rfopt worker`` processes sharing the GPU;
- one trial over several devices: the sweep with ``--devices-per-trial K`` on K GPUs against one GPU with the same
  global batch (``--devices-per-trial 1``), wall times and the largest difference in per-chunk values (needs K GPUs);
- the Ray path: the sweep by ``rfopt run --ray --workers N`` on a local Ray cluster (an actor per GPU), and Ray's
  start-up alone (needs ``pip install 'rfopt[ray]'``);
- gangs (issue 23): the same configs as a full study (evaluation after every chunk, adapters saved) by plain TRL one
  after another against ``optimize(..., gang_size=G, gang_training=mode)`` for each G and each mode (issue 42:
  ``sequential`` and ``batched``; bench/gang.py's functions), with each gang run's time by part and peak GPU memory
  against `rfopt.training.memory.gang_memory`'s estimate;
- steps (issue 42): the members' training time per gang step (every part of a member step but the rollout decode,
  bench/step_profile.py's profile) at G = the configs, in each mode, against one member's step alone (one config at
  G=1); the goal: batched <= 1.5x one member alone;
- study_decode (issue 42): the study configuration's rollout decode (G trials x 4 rows of a training prompt, the study's
  completion length) by the batched backend in the float32 master weights and in the bf16 copy mixed precision decodes
  with (`BatchedBackend(dtype=...)`);
- big_gang (issue 42, opt-in): a 16-config study at G=16 against plain TRL (goal <= 0.05), plain TRL's 16 configs
  extrapolated from its 4 (each config the same work: random weights never emit EOS), or ``--plain-wall-s``.

    python bench/gpu.py                    # on the GPU machine: see bench/gpu.md (study_decode, gangs, steps)
    python bench/gpu.py --only big_gang --plain-wall-s 234.3   # the G=16 study, plain TRL's 4 configs given
    python bench/gpu.py --dry-run          # the same code path on the CPU, tiny model, well under two minutes
    python bench/gpu.py --dry-run --workers none --data-parallel 2 --ray 1   # the new paths, as two CPU processes

It prints one table and writes the figures as JSON (default ``/tmp/rfopt-bench/gpu-results.json``, outside the
repository: results are not committed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Deterministic cuBLAS needs this before CUDA starts (the exactness check turns deterministic algorithms on).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH)]
import throughput  # noqa: E402  (bench/throughput.py: its comparison functions; it puts the repository on sys.path)

QWEN_CONFIG = BENCH / "qwen2.5-0.5b-config.json"
WORKER_COUNTS = (1, 2, 4)
DATA_PARALLEL = (2,)
"""Devices per trial measured by default where the machine has that many GPUs."""
RAY_WORKERS = (1,)
"""Ray worker counts measured by default (a GPU each) where Ray is installed."""
GANG_SIZES = (4,)
"""Gang sizes of the full study by default (plain TRL alone takes ~240 s on an H100; --gangs 1,4,8 for more)."""
DECODE_GANGS = (1, 4, 8, 16)
GANG_TRAINING = ("sequential", "batched")
"""The gang training modes the full study and the step profile compare by default (issue 42)."""
STEP_CHUNKS = 2
"""Chunks of the step profile's studies (the full study has 4): 4 gang steps per mode keep the part short."""
BIG_GANG = 16
"""The opt-in big gang's size and configs (issue 42: a 16-config study at G=16)."""
STUDY_DECODE_GANGS = (4, 16)
"""Trials per decode of the study configuration's decode (``study_decode``); the dry run decodes 1 and 2."""
PARTS = ("decode", "anchor", "study_decode", "gangs", "steps", "big_gang", "round_robin", "exactness", "workers",
         "data_parallel", "ray")
"""What bench/gpu.py can measure (``--only``); ``anchor``: transformers' static cache with its compiled forward."""
DEFAULT_PARTS = ("study_decode", "gangs", "steps")
"""The default run (issue 42), about 7.5 minutes on an H100 by BENCHMARKS.md's figures (bench/gpu.md, "How long")."""


@dataclass(frozen=True)
class Sizes:
    """What one run trains, and where."""

    model: str
    configs: int
    chunks: int
    steps_per_chunk: int
    max_completion_length: int
    eval_prompts: int
    learning_rates: tuple[float, ...]
    device: str
    precision: str


GPU = Sizes("qwen2.5-0.5b-shape", 4, 4, 2, 64, 4, (1e-5, 5e-5, 2e-5, 1e-4), "cuda", "bf16")
# The CPU dry run: the tiny model, 2 steps per config; bf16 is refused on the CPU, so fp32.
DRY = Sizes("tiny", 4, 2, 1, 8, 2, (5e-3, 1e-3, 2e-3, 5e-4), "cpu", "fp32")
LORA_RANK = 16


# ---------------------------------------------------------------------- the model, built offline
def _padded_tokenizer(vocab_size: int) -> Any:
    """rfopt.tiny's character-level ChatML tokenizer, its vocabulary padded with ``<xN>`` tokens to `vocab_size`.

    The model keeps Qwen2.5's vocabulary of 151,936 (rather than shrinking it to the tokenizer's ~100): the embedding
    and LM head are 136M of its 494M parameters, and the logits over that vocabulary dominate GRPO's memory and
    time, so a smaller vocabulary would not measure Qwen's shape. Padding the tokenizer instead makes every id the
    random model samples decode (to ``<xN>``); encoding is still character by character.
    """
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rfopt.tiny import CHATML_TEMPLATE

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(set(string.printable))
    tokens += [f"<x{i}>" for i in range(len(tokens), vocab_size)]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<|im_start|>",
        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_qwen_shaped(path: Path, seed: int = 0) -> Path:
    """Write a random model of Qwen2.5-0.5B-Instruct's shape (bench/qwen2.5-0.5b-config.json) and its tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config_dict = json.loads(QWEN_CONFIG.read_text())
    tokenizer = _padded_tokenizer(config_dict["vocab_size"])
    assert len(tokenizer) == config_dict["vocab_size"], (len(tokenizer), config_dict["vocab_size"])
    config = Qwen2Config.from_dict(
        {**config_dict, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
         "eos_token_id": tokenizer.eos_token_id}
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_model(sizes: Sizes, workdir: Path) -> Path:
    if sizes.model == "tiny":
        from rfopt.tiny import build_tiny_model

        return build_tiny_model(workdir / "tiny-llama")
    return build_qwen_shaped(workdir / sizes.model)


def bench_setup(sizes: Sizes, source: Path, workdir: Path) -> throughput.Setup:
    """The configs, rows and chunk plan of this benchmark (also what bench/gpu_study.py gives its workers)."""
    args = argparse.Namespace(
        model=sizes.model, configs=sizes.configs, chunks=sizes.chunks, steps_per_chunk=sizes.steps_per_chunk,
        eval_prompts=sizes.eval_prompts, max_completion_length=sizes.max_completion_length,
    )
    return throughput.build_setup(
        args, workdir, source=str(source), learning_rates=list(sizes.learning_rates), lora_ranks=[LORA_RANK],
        device=sizes.device, precision=sizes.precision,
    )


# ---------------------------------------------------------------------- GPU probes
def _cuda(setup: throughput.Setup) -> Any:
    """torch.cuda when the setup trains on a GPU, else None (every GPU figure is then "n/a (cpu)")."""
    import torch

    return torch.cuda if setup.device.startswith("cuda") else None


@contextlib.contextmanager
def peak_memory(setup: throughput.Setup, sink: dict[str, Any]) -> Iterator[None]:
    """Peak GPU memory allocated in the block, in bytes, into ``sink["peak"]`` (None on the CPU)."""
    cuda = _cuda(setup)
    sink["peak"] = None
    if cuda is not None:
        gc.collect()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()
    yield
    if cuda is not None:
        cuda.synchronize()
        sink["peak"] = cuda.max_memory_allocated()


class BusySampler:
    """Samples ``torch.cuda.utilization()`` (percent of time a kernel ran) every `interval` s in a thread."""

    def __init__(self, setup: throughput.Setup, interval: float = 0.1) -> None:
        self.cuda = _cuda(setup)
        self.interval = interval
        self.samples: list[float] = []
        self.error: str | None = None if self.cuda is not None else "cpu"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(float(self.cuda.utilization()))
            except Exception as exc:  # no pynvml / amdsmi: the figure is "n/a"
                self.error = f"{type(exc).__name__}: {exc}"
                return

    def __enter__(self) -> BusySampler:
        if self.cuda is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def busy_fraction(self) -> float | None:
        return statistics.mean(self.samples) / 100 if self.samples and self.error is None else None


def base_model_bytes(setup: throughput.Setup) -> int | None:
    """GPU memory the base model takes once loaded (None on the CPU)."""
    from rfopt.training.loading import load_model

    cuda = _cuda(setup)
    if cuda is None:
        return None
    gc.collect()
    cuda.empty_cache()
    before = cuda.memory_allocated()
    model, _ = load_model(setup.configs[0], setup.device)
    taken = cuda.memory_allocated() - before
    del model
    gc.collect()
    cuda.empty_cache()
    return taken


def _one_trial(setup: throughput.Setup) -> throughput.Setup:
    return dataclasses.replace(setup, configs=setup.configs[:1], schedules=setup.schedules[:1])


# ---------------------------------------------------------------------- the measurements
def measure_round_robin(setup: throughput.Setup, workdir: Path) -> dict[str, Any]:
    """(a) sequential plain TRL vs (b) rfopt round-robin; memory of (b) and of one trial alone; GPU busy in (b)."""
    throughput._settle()
    a = throughput.run_plain(setup, with_eval=False, out_dir=workdir / "plain")
    throughput._settle()
    memory: dict[str, Any] = {}
    with BusySampler(setup) as busy, peak_memory(setup, memory):
        b = throughput.run_runners(setup, workdir / "runners", checkpoint_reps=2)
    alone: dict[str, Any] = {}
    with peak_memory(setup, alone):
        one = throughput.run_runners(_one_trial(setup), workdir / "alone", checkpoint_reps=0)
    adapter = sum(t.numel() * t.element_size() for t in one.weights[0].values())
    base = base_model_bytes(setup)
    n = len(setup.configs)
    # The goal: the base once, and per trial its adapter and AdamW's two states (each the adapter's size).
    goal = None if base is None else 1.1 * (base + n * 3 * adapter)
    later_swaps = b.swap_seconds[n:]  # unit 0 of each trial also builds its optimizer
    return {
        "plain_trl_wall_s": a.train.wall,
        "rfopt_wall_s": b.train.wall,
        "ratio_wall": b.train.wall / a.train.wall,
        "ratio_wall_with_model_loading": b.total.wall / a.total.wall,
        "swap_ms_median": throughput._median_ms(b.swap_seconds),
        "swap_ms_median_after_first_chunk": throughput._median_ms(later_swaps),
        "plain_time_to_first_step_ms_median": throughput._median_ms(a.swap_seconds),
        "checkpoint_ms_per_unit_median": throughput._median_ms(b.checkpoint_seconds),
        "max_abs_weight_diff_a_vs_b": throughput.max_weight_diff(a, b),
        "peak_gpu_bytes_round_robin": memory["peak"],
        "peak_gpu_bytes_one_trial": alone["peak"],
        "base_model_gpu_bytes": base,
        "adapter_bytes_per_trial": adapter,
        "goal_gpu_bytes": goal,
        "goal_met": None if goal is None else memory["peak"] <= goal,
        "gpu_busy_fraction": busy.busy_fraction,
        "gpu_busy_samples": len(busy.samples),
        "gpu_busy_error": busy.error,
    }


def measure_exactness(setup: throughput.Setup, workdir: Path) -> dict[str, Any]:
    """One trial trained in chunks (rfopt) vs straight through (plain TRL), deterministic algorithms on."""
    import torch

    one = _one_trial(setup)
    torch.use_deterministic_algorithms(True)
    try:
        straight = throughput.run_plain(one, with_eval=False, out_dir=workdir / "straight")
        chunked = throughput.run_runners(one, workdir / "chunked", checkpoint_reps=0)
        return {"max_abs_diff": throughput.max_weight_diff(straight, chunked), "error": None}
    except RuntimeError as exc:  # an op with no deterministic implementation on this device
        return {"max_abs_diff": None, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.use_deterministic_algorithms(False)


def _sweep(sizes: Sizes, source: Path, where: Path, argv: list[str], label: str) -> tuple[float, Any]:
    """Run the sweep (bench/gpu_study.py, a study on SQLite in `where`) with ``rfopt <argv>``; its wall time and the
    finished study. Raises unless every trial completed."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    where.mkdir(parents=True)
    storage = f"sqlite:///{where / 'study.db'}"
    # The repository on the workers' path: on the GPU machine rfopt is not installed, only carried.
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, RFOPT_BENCH_GPU_MODEL=str(source),
               RFOPT_BENCH_GPU_DRY=str(int(sizes is DRY)))
    command = [sys.executable, "-m", "rfopt.cli", argv[0], str(BENCH / "gpu_study.py"), "--storage", storage,
               "--checkpoint-dir", str(where / "ck"), "--precision", sizes.precision, *argv[1:]]
    started = time.perf_counter()
    with open(where / "output.log", "wb") as log:
        code = subprocess.run(command, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - started
    study = optuna.load_study(study_name="gpu-bench", storage=storage)
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    if code != 0 or complete != sizes.configs:
        tail = (where / "output.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{label}: exit {code}, {complete}/{sizes.configs} trials complete\n{tail}")
    print(f"  {label}: {wall:.1f} s", flush=True)
    return wall, study


def measure_workers(sizes: Sizes, source: Path, workdir: Path, counts: list[int]) -> dict[str, Any]:
    """The same sweep as a study on SQLite, run by `count` ``rfopt worker`` processes sharing the device."""
    result: dict[str, Any] = {}
    for count in counts:
        wall, _ = _sweep(sizes, source, workdir / f"workers-{count}",
                         ["worker", "--devices", ",".join([sizes.device] * count)], f"{count} worker(s)")
        result[str(count)] = {"wall_s": wall}
    return result


def devices_for(sizes: Sizes, count: int) -> list[str]:
    """`count` devices for one data-parallel worker: ``cuda:0`` ... on the GPU, the CPU `count` times in the dry run."""
    return [f"cuda:{i}" for i in range(count)] if sizes.device == "cuda" else ["cpu"] * count


def measure_data_parallel(sizes: Sizes, source: Path, workdir: Path, counts: list[int]) -> dict[str, Any]:
    """The sweep with each trial over K devices, against one device with the same global batch (rollouts sampled per
    row in both): wall times, and the largest difference between the two runs' per-chunk values."""
    if not counts:
        return {}
    one, reference = _sweep(sizes, source, workdir / "dp-1", ["worker", "--devices", devices_for(sizes, 1)[0],
                                                              "--devices-per-trial", "1"], "1 device per trial")
    result: dict[str, Any] = {}
    for count in counts:
        wall, study = _sweep(sizes, source, workdir / f"dp-{count}",
                             ["worker", "--devices", ",".join(devices_for(sizes, count)), "--devices-per-trial",
                              str(count)], f"{count} devices per trial")
        result[str(count)] = {"wall_s": wall, "wall_s_one_device": one,
                              "max_abs_value_diff": max_value_diff(reference.trials, study.trials)}
    return result


def max_value_diff(a: list[Any], b: list[Any]) -> float:
    """The largest difference between two studies' per-chunk values, trial by trial."""
    return max((abs(x.intermediate_values[step] - y.intermediate_values[step]) for x, y in zip(a, b, strict=True)
                for step in x.intermediate_values), default=0.0)


def measure_ray(sizes: Sizes, source: Path, workdir: Path, counts: list[int]) -> dict[str, Any]:
    """The sweep by ``rfopt run --ray --workers N`` on a local Ray cluster the command starts (a GPU per actor where
    there are GPUs), and Ray's start-up alone (bench/workers.py's probe)."""
    if not counts:
        return {}
    import workers  # bench/workers.py

    result: dict[str, Any] = {"startup_s": workers._ray_startup()}
    print(f"  Ray start-up alone: {result['startup_s']:.1f} s", flush=True)
    for count in counts:
        wall, _ = _sweep(sizes, source, workdir / f"ray-{count}", ["run", "--no-progress", "--ray", "--workers",
                                                                   str(count)], f"Ray, {count} worker(s)")
        result[str(count)] = {"wall_s": wall}
    return result


# ---------------------------------------------------------------------- report
def _failed(what: str, exc: Exception, **fields: Any) -> dict[str, Any]:
    """A side that raised, as its result: one side failing on the GPU must not cost the next parts' figures (the
    device time of a session is one call or two)."""
    print(f"  {what}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return {**fields, "error": f"{type(exc).__name__}: {exc}"}


def _prompt_tokens(setup: throughput.Setup) -> int:
    """The longest training prompt in tokens (what the gang memory estimate sizes its rows by)."""
    from rfopt.training.evaluation import EvalPrompts
    from rfopt.training.models import ModelPool

    tokenizer = ModelPool(setup.device, setup.precision).tokenizer(setup.configs[0])
    return max(map(len, EvalPrompts.of(setup.train, tokenizer).token_ids(tokenizer)))


def measure_gangs(setup: throughput.Setup, workdir: Path, gangs: list[int], repeats: int,
                  on_result: Any = None, modes: tuple[str, ...] = ("sequential",)) -> dict[str, Any]:
    """The full study by plain TRL against rfopt in gangs of each size and each gang training mode (a side each,
    named by bench/gang.py's `side_key`: ``G4``, ``G4-batched``; a gang of 1 trains alone whatever the mode): the gang
    runs before and after the one plain run (``repeats`` = 2: gangs, plain, gangs), each ratio against the plain run,
    their median the figure."""
    import gang as gang_bench  # bench/gang.py

    if not gangs:
        return {}
    prompt_tokens = _prompt_tokens(setup)
    sides = [(size, mode) for size in gangs for mode in modes if size > 1 or mode == modes[0]]
    record: dict[str, Any] = {"runs": {gang_bench.side_key(size, mode): [] for size, mode in sides},
                              "load_before": os.getloadavg()[0]}

    def gang_runs(tag: str) -> None:
        for size, mode in sides:
            key = gang_bench.side_key(size, mode)
            throughput._settle()
            try:
                run = gang_bench.run_gang_study(setup, workdir / f"gang-{key}-{tag}", size, prompt_tokens,
                                                training=mode)
            except Exception as exc:  # noqa: BLE001 - recorded; the other sides and parts go on
                record["runs"][key].append(_failed(f"gangs of {size}, {mode} ({tag})", exc, gang_size=size,
                                                   gang_training=mode))
                if on_result is not None:
                    on_result(record)
                continue
            run["gang_training"] = mode
            if "plain_wall_s" in record:
                run["ratio_wall"] = run["wall_s"] / record["plain_wall_s"]
            record["runs"][key].append(run)
            print(f"  gangs of {size}, {mode} ({tag}): {run['wall_s']:.1f} s; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in run["parts_s"].items()), flush=True)
            if on_result is not None:
                on_result(record)

    gang_runs("first")
    throughput._settle()
    plain = gang_bench.run_plain_side(setup, workdir / "plain")
    record["plain_wall_s"] = plain["wall_s"]
    record["plain_evaluation_s"] = plain["evaluation_s"]
    print(f"  plain TRL: {plain['wall_s']:.1f} s", flush=True)
    for runs in record["runs"].values():
        for run in runs:
            if "wall_s" in run:
                run["ratio_wall"] = run["wall_s"] / plain["wall_s"]
    if on_result is not None:
        on_result(record)
    if repeats > 1:
        gang_runs("after")
    for runs in record["runs"].values():
        for run in runs:
            if "wall_s" in run:
                run["ratio_wall"] = run["wall_s"] / plain["wall_s"]
    record["median_ratio_wall"] = {size: statistics.median(r["ratio_wall"] for r in runs if "ratio_wall" in r)
                                   for size, runs in record["runs"].items()
                                   if any("ratio_wall" in r for r in runs)}
    record["load_after"] = os.getloadavg()[0]
    return record


def measure_steps(sizes: Sizes, source: Path, workdir: Path, modes: tuple[str, ...],
                  on_result: Any = None) -> dict[str, Any]:
    """The members' training time per gang step, in each gang training mode, against one member's step alone
    (issue 42's goal: batched at G=4 <= 1.5x). bench/step_profile.py's profile of ``optimize``: one config at G=1,
    then the configs in one gang of G = their number, over `STEP_CHUNKS` chunks; a run's training time is every part
    of its member steps but the rollout decode (`step_profile.member_training_seconds`)."""
    import step_profile  # bench/step_profile.py

    setup = bench_setup(dataclasses.replace(sizes, chunks=STEP_CHUNKS), source, workdir / "setup")
    gang_size = len(setup.configs)
    record: dict[str, Any] = {"chunks": STEP_CHUNKS, "gang_size": gang_size, "runs": {}}

    def profiled(key: str, where: throughput.Setup, size: int, mode: str) -> dict[str, Any]:
        try:
            run = step_profile.profile_study(where, workdir / key, size, mode)
        except Exception as exc:  # noqa: BLE001 - recorded; the other runs and parts go on
            record["runs"][key] = _failed(f"steps, {key}", exc, gang_size=size, training=mode)
            if on_result is not None:
                on_result(record)
            return record["runs"][key]
        run["training_s"] = step_profile.member_training_seconds(run)
        run["gang_steps"] = run["member_steps"] // size
        run["training_s_per_gang_step"] = run["training_s"] / run["gang_steps"]
        run["rollout_decode_s"] = run["seconds"].get("rollout decode", 0.0)
        record["runs"][key] = run
        print(f"  steps, {key}: {run['wall_s']:.1f} s; members' training {run['training_s']:.2f} s over "
              f"{run['gang_steps']} gang steps ({run['training_s_per_gang_step'] * 1e3:.0f} ms each), rollout decode "
              f"{run['rollout_decode_s']:.2f} s", flush=True)
        if on_result is not None:
            on_result(record)
        return run

    alone = profiled("alone", _one_trial(setup), 1, "sequential")
    for mode in modes:
        run = profiled(f"G{gang_size}-{mode}", setup, gang_size, mode)
        if "error" in run or "error" in alone:
            continue
        run["ratio_to_one_member_alone"] = run["training_s_per_gang_step"] / alone["training_s_per_gang_step"]
        if on_result is not None:
            on_result(record)
    return record


def measure_study_decode(setup: throughput.Setup, gangs: tuple[int, ...], on_result: Any) -> dict[str, Any]:
    """The study configuration's rollout decode: G trials x the study's rows per step (one prompt's group) of a
    training prompt, the study's completion length, by the batched backend (captured graphs on a GPU, eager on the
    CPU) reading the model's own weights (the float32 master weights mixed precision trains) and reading the bf16
    copy (`BatchedBackend(dtype=torch.bfloat16)`, what a study under bf16 decodes with), per decode iteration
    (bench/decode.py's `time_batched`)."""
    import decode  # bench/decode.py
    import torch

    from rfopt.training.loading import load_model
    from rfopt.training.models import Placement

    model, tokenizer = load_model(setup.configs[0], setup.device)
    peft = decode.adapters(model, max(gangs))
    prompt = tokenizer.apply_chat_template(setup.train["prompt"][0], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    new_tokens = setup.configs[0].args.max_completion_length
    compute = Placement.of(setup.device, setup.precision).compute_dtype()
    record: dict[str, Any] = {"prompt_tokens": len(prompt), "rows_per_trial": throughput.BATCH,
                              "new_tokens": new_tokens, "model_dtype": str(next(model.parameters()).dtype),
                              "study_compute_dtype": None if compute is None else str(compute), "results": []}

    def heard(result: dict[str, Any]) -> None:
        record["results"].append(result)
        on_result(record)

    mode = "graph" if setup.device.startswith("cuda") else "eager"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # The bf16 copy on the CPU too (the dry run's study is fp32): the same code path as the GPU's.
    for dtype in (None, torch.bfloat16):
        try:
            decode.time_batched(peft, prompt, list(gangs), throughput.BATCH, new_tokens, mode, 2, pad, heard,
                                dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - the master weights failing must not cost the bf16 copy's figure
            heard({"what": "batched", "mode": mode, "dtype": None if dtype is None else "bfloat16",
                   "error": f"{type(exc).__name__}: {exc}"})
            print(f"  study decode, {dtype}: FAILED {type(exc).__name__}: {exc}", flush=True)
    del peft, model
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return record


def big_gang_learning_rates(sizes: Sizes, count: int) -> tuple[float, ...]:
    """`count` learning rates spread geometrically between the smallest and largest of `sizes` (every config its
    own)."""
    low, high = min(sizes.learning_rates), max(sizes.learning_rates)
    return tuple(low * (high / low) ** (i / max(count - 1, 1)) for i in range(count))


def measure_big_gang(sizes: Sizes, source: Path, workdir: Path, size: int, modes: tuple[str, ...],
                     plain_wall_s: float | None, plain_setup: throughput.Setup,
                     on_result: Any = None) -> dict[str, Any]:
    """`size` configs as one study in gangs of `size`, in each mode, against plain TRL's time for them: plain TRL's
    `plain_setup` configs (4) one after another, measured here unless `plain_wall_s` gives that figure (the default
    run's "plain TRL" row), scaled by `size` / their number (every config the same work on the GPU: the same rows,
    shapes and completion lengths, random weights never emitting EOS)."""
    import gang as gang_bench  # bench/gang.py

    setup = bench_setup(dataclasses.replace(sizes, configs=size, learning_rates=big_gang_learning_rates(sizes, size)),
                        source, workdir / "setup")
    plain_configs = len(plain_setup.configs)
    record: dict[str, Any] = {"configs": size, "gang_size": size, "plain_configs_measured": plain_configs,
                              "plain_wall_s_given": plain_wall_s is not None, "runs": {}}
    # plain_wall_s_given: this part did not run plain TRL's configs (--plain-wall-s, or this run's gangs part did)
    if plain_wall_s is None:
        throughput._settle()
        plain_wall_s = gang_bench.run_plain_side(plain_setup, workdir / "plain")["wall_s"]
        print(f"  plain TRL, {plain_configs} configs: {plain_wall_s:.1f} s", flush=True)
    record["plain_wall_s_measured"] = plain_wall_s
    record["plain_wall_s"] = plain_wall_s * size / plain_configs
    if on_result is not None:
        on_result(record)
    prompt_tokens = _prompt_tokens(setup)
    for mode in modes:
        throughput._settle()
        try:
            run = gang_bench.run_gang_study(setup, workdir / f"G{size}-{mode}", size, prompt_tokens, training=mode)
        except Exception as exc:  # noqa: BLE001 - recorded; the other mode goes on
            record["runs"][gang_bench.side_key(size, mode)] = _failed(f"{size} configs in gangs of {size}, {mode}",
                                                                      exc, gang_size=size, gang_training=mode)
            if on_result is not None:
                on_result(record)
            continue
        run["gang_training"] = mode
        run["ratio_wall"] = run["wall_s"] / record["plain_wall_s"]
        record["runs"][gang_bench.side_key(size, mode)] = run
        print(f"  {size} configs in gangs of {size}, {mode}: {run['wall_s']:.1f} s, ratio {run['ratio_wall']:.3f}; "
              + ", ".join(f"{k} {v:.1f}" for k, v in run["parts_s"].items()), flush=True)
        if on_result is not None:
            on_result(record)
    return record


def measure_decode(setup: throughput.Setup, gangs: list[int], modes: list[str], anchor: bool,
                   on_result: Any) -> dict[str, Any]:
    """bench/decode.py on this benchmark's model and device: the batched backend per decode iteration at each G,
    ``model.generate`` one adapter at a time, and (`anchor`) transformers' static cache with its compiled forward."""
    import decode  # bench/decode.py
    import torch

    from rfopt.training.loading import load_model

    model, tokenizer = load_model(setup.configs[0], setup.device)
    peft = decode.adapters(model, max(gangs))
    prompt = tokenizer.apply_chat_template(setup.train["prompt"][0], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    record: dict[str, Any] = {"prompt_tokens": len(prompt), "results": []}

    def heard(result: dict[str, Any]) -> None:
        record["results"].append(result)
        on_result(record)

    if not setup.device.startswith("cuda"):  # the CPU decodes eagerly only
        modes = ["eager"]
    for mode in modes:
        try:  # on a GPU, eager and compiled steps are measured at G = 4 only (compiling takes minutes per shape)
            some = gangs if mode == "graph" or not setup.device.startswith("cuda") else [min(4, max(gangs))]
            decode.run(peft, tokenizer, prompt, some, modes=[mode], on_result=heard, with_generate=False,
                       with_agreement=mode == modes[0])
        except Exception as exc:  # noqa: BLE001 - one mode failing must not cost the others' figures
            heard({"what": "batched", "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  batched {mode}: FAILED {type(exc).__name__}: {exc}", flush=True)
    rows = 16 if setup.device.startswith("cuda") else 4  # the 16 rows of the anchor table
    decode.time_generate(peft, prompt, rows, decode.NEW_TOKENS, 2, tokenizer.pad_token_id, static=False,
                         on_result=heard)
    if anchor:
        try:
            decode.time_generate(peft, prompt, rows, decode.NEW_TOKENS, 2, tokenizer.pad_token_id, static=True,
                                 on_result=heard)
        except Exception as exc:  # noqa: BLE001
            heard({"what": "static", "error": f"{type(exc).__name__}: {exc}"})
            print(f"  static compiled: FAILED {type(exc).__name__}: {exc}", flush=True)
    kernels = decode.count_kernels(peft, prompt, 4, 4, tokenizer.pad_token_id)
    if kernels is not None:
        heard({"what": "kernels", "gang_size": 4, "kernels_per_iteration": kernels})
        print(f"  CUDA kernels per eager decode step, G=4: {kernels}", flush=True)
    del peft, model
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return record


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def _gang_rows(key: str, runs: list[dict[str, Any]], median: float | None, goal: str = "") -> list[tuple[str, str]]:
    """A gang side's rows: its wall ratio to plain TRL (each run), and its last run's memory and time by part."""
    import gang as gang_bench  # bench/gang.py

    size, mode, _ = gang_bench.parse_side(key)
    done = [r for r in runs if "error" not in r]
    ratios = ", ".join(f"{r['ratio_wall']:.3f}" for r in done if "ratio_wall" in r)
    walls = ", ".join(f"{r['wall_s']:.1f}" for r in done)
    head = f"{median:.3f} median " if median is not None and len(done) > 1 else ""
    rows = [(f"full study in gangs of {size}, {mode}, wall ratio to plain TRL (each run)",
             f"{head}({ratios}; {walls} s){goal}")]
    rows += [(f"  gangs of {size}, {mode}: a run", f"FAILED: {r['error'][:80]}") for r in runs if "error" in r]
    for r in done[-1:]:
        rows.append((f"  gangs of {size}, {mode}: peak memory / estimate",
                     f"{_gib(r['peak_bytes'])} / {_gib(r['estimate_bytes'])}"))
        rows.append((f"  gangs of {size}, {mode}: time by part",
                     ", ".join(f"{k} {v:.1f} s" for k, v in r["parts_s"].items())))
    return rows


def print_table(record: dict[str, Any]) -> None:  # noqa: C901 - one row per figure, each optional
    cpu = record["device"] == "cpu"
    na = "n/a (cpu)" if cpu else "n/a"

    def fmt(value: Any, spec: str, unit: str = "") -> str:
        return na if value is None else f"{value:{spec}}{unit}"

    rows: list[tuple[str, str]] = []
    decode = record.get("decode")
    if decode is None:
        rows.append(("decode (batched backend, model.generate)", "not run"))
    else:
        for r in decode["results"]:
            if "error" in r:
                rows.append((f"decode, {r['what']} {r.get('mode', '')}", f"FAILED: {r['error'][:80]}"))
            elif r["what"] == "batched":
                rows.append((f"decode, batched ({r['mode']}), {r['gang_size']} trial(s) x 4 rows",
                             f"{r['ms_per_iteration']:.2f} ms/iteration, {r['tok_s']:.0f} tok/s "
                             f"(prefill {r['prefill_ms']:.0f} ms, capture {r['capture_s']:.1f} s)"))
            elif r["what"] in ("generate", "static"):
                label = "eager, dynamic cache" if r["what"] == "generate" else "static cache, compiled"
                rows.append((f"decode, model.generate {label}, 1 adapter x {r['rows']} rows",
                             f"{r['ms_per_iteration']:.2f} ms/token, {r['tok_s']:.0f} tok/s "
                             f"(first call {r['first_call_s']:.1f} s)"))
            elif r["what"] == "agreement":
                rows.append((f"decode, greedy tokens equal to model.generate's (1 adapter, {r['rows']} rows)",
                             f"{r['tokens_equal_before_first_difference']} of {r['new_tokens']} before the first "
                             "difference"))
            elif r["what"] == "kernels":
                rows.append((f"CUDA kernels per eager decode step, {r['gang_size']} trials",
                             str(r["kernels_per_iteration"])))
    gangs = record.get("gangs")
    if not gangs:
        rows.append(("full study against plain TRL", "not run"))
    else:
        rows.append(("full study, plain TRL one after another, wall",
                     f"{gangs['plain_wall_s']:.1f} s" if "plain_wall_s" in gangs else "not finished"))
        if "plain_evaluation_s" in gangs:
            rows.append(("  plain TRL: evaluation", f"{gangs['plain_evaluation_s']:.1f} s"))
        for key, runs in gangs["runs"].items():
            rows += _gang_rows(key, runs, gangs.get("median_ratio_wall", {}).get(key))
    steps = record.get("steps")
    if steps is not None:
        for key, run in steps["runs"].items():
            if "error" in run:
                rows.append((f"members' training per step, {key}", f"FAILED: {run['error'][:80]}"))
        alone = steps["runs"].get("alone")
        if alone is not None and "error" not in alone:
            rows.append(("members' training per step, one member alone (G=1)",
                         f"{alone['training_s_per_gang_step'] * 1e3:.0f} ms ({alone['gang_steps']} steps)"))
        for key, run in steps["runs"].items():
            if key != "alone" and "ratio_to_one_member_alone" in run:
                rows.append((f"members' training per gang step, {key}, x one member alone",
                             f"{run['ratio_to_one_member_alone']:.2f}x ({run['training_s_per_gang_step'] * 1e3:.0f} "
                             f"ms, {run['gang_steps']} gang steps; goal <= 1.5x)"))
    study_decode = record.get("study_decode")
    if study_decode is not None:
        for r in study_decode["results"]:
            weights = "bf16 copy" if r.get("dtype") else f"model's own weights ({study_decode['model_dtype']})"
            if "error" in r:
                rows.append((f"study decode, {weights}", f"FAILED: {r['error'][:80]}"))
                continue
            rows.append((f"study decode, {weights}, {r['gang_size']} trials x {r['rows'] // r['gang_size']} rows",
                         f"{r['ms_per_iteration']:.2f} ms/iteration, {r['tok_s']:.0f} tok/s (prefill "
                         f"{r['prefill_ms']:.0f} ms)"))
    big = record.get("big_gang")
    if big is not None and "plain_wall_s" in big:
        how = "given or from the gangs part" if big["plain_wall_s_given"] else "measured here"
        rows.append((f"plain TRL, {big['configs']} configs (x{big['configs']}/{big['plain_configs_measured']} of "
                     f"{big['plain_configs_measured']} {how})",
                     f"{big['plain_wall_s']:.1f} s ({big['plain_wall_s_measured']:.1f} s)"))
        for key, run in big["runs"].items():
            rows += _gang_rows(key, [run], run.get("ratio_wall"), goal=" (goal <= 0.05)")
    rr = record.get("round_robin")
    if rr is not None:
        busy = rr["gpu_busy_fraction"]
        rows += [
            ("plain TRL, sequential (a), wall", fmt(rr["plain_trl_wall_s"], ".2f", " s")),
            ("rfopt round-robin (b), wall", fmt(rr["rfopt_wall_s"], ".2f", " s")),
            ("wall ratio b/a (model loading excluded)", fmt(rr["ratio_wall"], ".3f")),
            ("wall ratio b/a (with model loading)", fmt(rr["ratio_wall_with_model_loading"], ".3f")),
            ("swap, median", fmt(rr["swap_ms_median"], ".1f", " ms")),
            ("swap after chunk 0, median", fmt(rr["swap_ms_median_after_first_chunk"], ".1f", " ms")),
            ("plain TRL time to first step, median", fmt(rr["plain_time_to_first_step_ms_median"], ".1f", " ms")),
            ("checkpoint save per unit, median", fmt(rr["checkpoint_ms_per_unit_median"], ".1f", " ms")),
            ("same weights a vs b: max |a - b|", f"{rr['max_abs_weight_diff_a_vs_b']:.3g}"),
            ("peak GPU memory, round-robin (b)", na if cpu else _gib(rr["peak_gpu_bytes_round_robin"])),
            ("peak GPU memory, one trial alone", na if cpu else _gib(rr["peak_gpu_bytes_one_trial"])),
            ("base model on the GPU", na if cpu else _gib(rr["base_model_gpu_bytes"])),
            ("adapter per trial (+2x for AdamW)", f"{rr['adapter_bytes_per_trial'] / 2**20:.2f} MiB"),
            (f"goal base + {record['configs']} x (adapter + AdamW) + 10%",
             na if cpu else f"{_gib(rr['goal_gpu_bytes'])} ({'met' if rr['goal_met'] else 'NOT met'})"),
            ("GPU busy during (b)", na if cpu else ("n/a" if busy is None else f"{busy:.0%}")),
        ]
    ex = record.get("exactness")
    if ex is not None:
        rows.append(("exactness, chunks vs straight: max |a - b|",
                     f"{ex['max_abs_diff']:.3g}" if ex["max_abs_diff"] is not None else f"n/a ({ex['error'][:60]})"))
    w = record.get("workers")
    if w is not None:
        for count in WORKER_COUNTS:
            entry = w.get(str(count))
            rows.append((f"sweep with {count} worker(s) sharing the device, wall",
                         f"{entry['wall_s']:.1f} s" if entry else "not run"))
    dp = record.get("data_parallel")
    if dp is not None:
        for count in sorted({*DATA_PARALLEL, *map(int, dp)}):
            entry = dp.get(str(count))
            rows.append((f"sweep with {count} devices per trial, wall (1 device)",
                         f"{entry['wall_s']:.1f} s ({entry['wall_s_one_device']:.1f} s), per-chunk values differ by "
                         f"at most {entry['max_abs_value_diff']:.3g}" if entry else "not run"))
    ray = record.get("ray")
    if ray is not None:
        rows.append(("Ray start-up alone (init, one actor, shutdown)",
                     f"{ray['startup_s']:.1f} s" if "startup_s" in ray else "not run"))
        for count in sorted({*RAY_WORKERS, *(int(k) for k in ray if k.isdigit())}):
            entry = ray.get(str(count))
            rows.append((f"sweep on a local Ray cluster, {count} worker(s), wall",
                         f"{entry['wall_s']:.1f} s" if entry else "not run"))
    print()
    print(f"rfopt GPU benchmark - {record['model']} on {record['device_name']} ({record['precision']}), "
          f"{record['configs']} configs (lr {', '.join(f'{x:g}' for x in record['learning_rates'])}, LoRA r{LORA_RANK}), "
          f"{record['chunks']} chunks x {record['steps_per_chunk']} steps, max_completion_length "
          f"{record['max_completion_length']}; parts: {', '.join(record['parts'])}")
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        print(f"  {name:<{width}}{value}")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same code path on the CPU with the tiny model")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rfopt-bench" / "gpu-results.json",
                        help="JSON result path (default: %(default)s)")
    parser.add_argument("--workers", default=",".join(map(str, WORKER_COUNTS)),
                        help="worker counts for the sweep, comma-separated, or 'none' (default: %(default)s)")
    parser.add_argument("--data-parallel", metavar="K", help="devices per trial for the data-parallel sweep, "
                        "comma-separated, or 'none' (default: 2 where there are 2 GPUs; none in the dry run)")
    parser.add_argument("--ray", metavar="N", help="Ray worker counts for the sweep on a local Ray cluster, or 'none' "
                        "(default: 1 where Ray is installed; none in the dry run)")
    parser.add_argument("--gangs", default=",".join(map(str, GANG_SIZES)),
                        help="gang sizes of the full-study comparison, comma-separated, or 'none' (default: "
                        "%(default)s)")
    parser.add_argument("--gang-repeats", type=int, default=1, choices=(1, 2),
                        help="gang runs of the full study: 2 runs them before and after the one plain TRL run "
                        "(default: %(default)s)")
    parser.add_argument("--gang-training", default=",".join(GANG_TRAINING),
                        help="gang training modes of the full study and the step profile, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--big-gang", type=int, default=BIG_GANG, metavar="G",
                        help="configs and gang size of the big_gang part (default: %(default)s)")
    parser.add_argument("--big-gang-training", default="batched",
                        help="gang training modes of the big_gang part, comma-separated (default: %(default)s)")
    parser.add_argument("--plain-wall-s", type=float, metavar="S",
                        help="big_gang: plain TRL's wall time for the 4 configs (the default run's 'plain TRL' row), "
                        "instead of measuring it again")
    parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                        help=f"parts to run, comma-separated, or 'all' ({', '.join(PARTS)}; default: %(default)s)")
    parser.add_argument("--decode-gangs", default=",".join(map(str, DECODE_GANGS)),
                        help="trials per batched decode (4 rows each; default: %(default)s)")
    parser.add_argument("--decode-modes", default="graph",
                        help="batched decode modes on a GPU: graph, eager, compiled (default: %(default)s)")
    args = parser.parse_args(argv)
    args.only = list(PARTS) if args.only == "all" else [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(args.only) - set(PARTS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a part; give some of {', '.join(PARTS)}, or all")
    args.decode_gangs = [int(x) for x in args.decode_gangs.split(",")]
    for flag in ("gang_training", "big_gang_training"):
        modes = tuple(m.strip() for m in getattr(args, flag).split(",") if m.strip())
        wrong = [m for m in modes if m not in GANG_TRAINING]
        if wrong or not modes:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: give {' and/or '.join(GANG_TRAINING)}, "
                         "comma-separated")
        setattr(args, flag, modes)
    if args.big_gang < 2:
        parser.error("--big-gang: a gang of 2 or more")
    args.decode_modes = [m.strip() for m in args.decode_modes.split(",")]
    try:
        args.workers = [] if args.workers == "none" else [int(x) for x in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers {args.workers!r}: give counts such as 1,2,4, or none")
    if any(count < 1 for count in args.workers):
        parser.error("--workers: every count must be >= 1")
    for flag in ("data_parallel", "ray"):
        value = getattr(args, flag)
        if value in (None, "none"):
            setattr(args, flag, None if value is None else [])
            continue
        try:
            counts = [int(x) for x in value.split(",")]
        except ValueError:
            parser.error(f"--{flag.replace('_', '-')} {value!r}: give counts such as 2, or none")
        if any(count < 1 for count in counts) or (flag == "data_parallel" and any(c < 2 for c in counts)):
            parser.error(f"--{flag.replace('_', '-')}: every count must be >= {2 if flag == 'data_parallel' else 1}")
        setattr(args, flag, counts)
    try:
        args.gangs = [] if args.gangs == "none" else [int(x) for x in args.gangs.split(",")]
    except ValueError:
        parser.error(f"--gangs {args.gangs!r}: give gang sizes such as 1,2,4, or none")
    if any(size < 1 for size in args.gangs):
        parser.error("--gangs: every size must be >= 1")
    return args


def default_counts(args: argparse.Namespace, sizes: Sizes, gpus: int, has_ray: bool) -> tuple[list[int], list[int]]:
    """Devices per trial and Ray worker counts to measure: those given, else what this machine can run (K devices
    per trial needs K GPUs; Ray needs Ray and an actor per GPU); the dry run measures neither unless asked."""
    data_parallel, ray = args.data_parallel, args.ray
    if data_parallel is None:
        data_parallel = [] if sizes is DRY else [k for k in DATA_PARALLEL if k <= gpus]
    if ray is None:
        ray = [] if sizes is DRY or not has_ray else [n for n in RAY_WORKERS if n <= max(gpus, 1)]
    if sizes is not DRY and any(k > gpus for k in data_parallel):
        raise SystemExit(f"--data-parallel {data_parallel}: this machine has {gpus} GPU(s)")
    if ray and not has_ray:
        raise SystemExit("--ray: Ray is not installed here (pip install 'rfopt[ray]')")
    return data_parallel, ray


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizes = DRY if args.dry_run else GPU
    import peft
    import torch
    import transformers
    import trl

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model load otherwise
    if sizes.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on the GPU machine (bench/gpu.md), or use --dry-run")
    parts = args.only
    record: dict[str, Any] = {
        **dataclasses.asdict(sizes),
        "dry_run": args.dry_run,
        "lora_r": LORA_RANK,
        "parts": parts,
        "device_name": torch.cuda.get_device_name() if sizes.device == "cuda" else platform.processor() or "cpu",
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "transformers": transformers.__version__, "trl": trl.__version__,
                    "peft": peft.__version__},
        "loadavg_start": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(key: str | None = None, value: Any = None) -> None:
        """Write the JSON after every measurement: a call cut short keeps what it measured."""
        if key is not None:
            record[key] = value
        args.out.write_text(json.dumps(record, indent=2, default=str))

    save()
    workdir = Path(tempfile.mkdtemp(prefix="rfopt-bench-gpu-"))
    try:
        started = time.perf_counter()
        source = build_model(sizes, workdir)
        print(f"model built in {time.perf_counter() - started:.1f} s: {source}", flush=True)
        setup = bench_setup(sizes, source, workdir)
        if "decode" in parts or "anchor" in parts:
            started = time.perf_counter()
            print("decode:", flush=True)
            modes = args.decode_modes if "decode" in parts else []
            measure_decode(setup, args.decode_gangs, modes, "anchor" in parts,
                           on_result=lambda value: save("decode", value))
            print(f"decode: {time.perf_counter() - started:.1f} s", flush=True)
        if "study_decode" in parts:
            started = time.perf_counter()
            print("study decode:", flush=True)
            measure_study_decode(setup, (1, 2) if args.dry_run else STUDY_DECODE_GANGS,
                                 on_result=lambda value: save("study_decode", value))
            print(f"study decode: {time.perf_counter() - started:.1f} s", flush=True)
        if any(p in parts for p in ("gangs", "steps", "big_gang", "round_robin", "exactness")):
            print(f"warm-up: {throughput.warm_up(setup, workdir / 'warmup'):.1f} s", flush=True)
        if "gangs" in parts and args.gangs:
            started = time.perf_counter()
            print("gangs:", flush=True)
            save("gangs", measure_gangs(setup, workdir / "gangs", args.gangs, args.gang_repeats,
                                        on_result=lambda value: save("gangs", value), modes=args.gang_training))
            print(f"gangs: {time.perf_counter() - started:.1f} s", flush=True)
        if "steps" in parts:
            started = time.perf_counter()
            print("steps:", flush=True)
            save("steps", measure_steps(sizes, source, workdir / "steps", args.gang_training,
                                        on_result=lambda value: save("steps", value)))
            print(f"steps: {time.perf_counter() - started:.1f} s", flush=True)
        if "big_gang" in parts:
            started = time.perf_counter()
            print(f"big gang ({args.big_gang} configs):", flush=True)
            plain = args.plain_wall_s
            if plain is None and record.get("gangs", {}).get("plain_wall_s") is not None:
                plain = record["gangs"]["plain_wall_s"]  # this run's own plain TRL, the same 4 configs
            save("big_gang", measure_big_gang(sizes, source, workdir / "big-gang", args.big_gang,
                                              args.big_gang_training, plain, setup,
                                              on_result=lambda value: save("big_gang", value)))
            print(f"big gang: {time.perf_counter() - started:.1f} s", flush=True)
        if "round_robin" in parts:
            started = time.perf_counter()
            save("round_robin", measure_round_robin(setup, workdir / "round-robin"))
            print(f"round-robin comparison: {time.perf_counter() - started:.1f} s", flush=True)
        if "exactness" in parts:
            save("exactness", measure_exactness(setup, workdir / "exactness"))
        if "workers" in parts:
            save("workers", measure_workers(sizes, source, workdir, args.workers))
        import importlib.util

        gpus = torch.cuda.device_count() if sizes.device == "cuda" else 0
        data_parallel, ray = default_counts(args, sizes, gpus, importlib.util.find_spec("ray") is not None)
        if "data_parallel" in parts:
            save("data_parallel", measure_data_parallel(sizes, source, workdir, data_parallel))
        if "ray" in parts:
            save("ray", measure_ray(sizes, source, workdir, ray))
        record["loadavg_end"] = os.getloadavg()
        save()
        print_table(record)
        print(f"\nresult written to {args.out}")
        return record
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
