"""Gangs (issue 23): rfopt training G trials at once, their rollouts decoded together, against plain TRL.

Measured in one process:

1. **Full study, side by side.** The same N configs (LoRA adapters with different learning rates and ranks on one
   base model) over the same rows and chunks, with the same evaluation after every chunk and the final adapter
   saved: (a) plain TRL, one ``GRPOTrainer`` after another (`bench/throughput.py`'s `run_plain`, evaluating at every
   chunk boundary from a callback), against (b) ``rfopt.create_study(...).optimize(configs, ..., gang_size=G)`` for
   each G in ``--gangs``. Each repeat runs every side once, the order reversed on every other repeat; the figure
   for each G is the median of the per-repeat wall-time ratios b/a, printed with the load average before and after.
   Model loading is left out of both sides (a loads the base model N times, b once). The sides do not train the same
   numbers: a gang samples from each trial's own random stream, in eval mode (`rfopt.training.rollouts`), so completions
   differ, and so does the work (their lengths): the mean completion length of each side is printed beside the ratio.
2. **Where a gang's time goes**, per G: the batched decodes of rollouts; the rest of the members' training steps
   (rewards, loss, backward, optimizer); the hand-overs between members (random states, gradient state, model
   patches, adapter switch); the evaluation after each chunk (its decode inside it, and shown on its own); the study's
   baseline (the base model evaluated once, with no adapter: work plain TRL does not do; its decode likewise);
   checkpoints; the rest (storage, rungs, best and final adapters). The parts sum to the wall time; plain TRL's own
   evaluation time is printed beside them.
3. **Generation throughput**: completion tokens per second of one `BatchedBackend.generate` call decoding G trials'
   rows together, of G calls decoding one trial's rows each, and of ``model.generate`` on one adapter G times.
4. **Peak memory** of each gang run (the process's peak resident set, reset before the run; on a GPU
   ``torch.cuda.max_memory_allocated``) and what the run *held* above the process before it (the peak less the
   resident set, or the memory allocated, when it started: the base model, adapters, optimizer states, activations
   and the decoder's buffers, what the estimate counts), against `rfopt.training.memory.gang_memory`'s estimate
   (with the evaluation's rows and the decoder's dtype).
5. **QLoRA** (issue 43, ``--quantization none,nf4``): each gang side also runs with the base loaded in 4 bits
   (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, bitsandbytes' CPU backend on the CPU), as
   side ``G<g>-nf4``: the same configs and rows otherwise. Its wall time and memory (the loaded base's weights, the
   run's peak and what it held, the estimate) are printed against the same gang on the full-precision base (and its
   ratio to plain TRL, which stays full precision, beside the others). On the CPU the peak and held figures are the
   process's resident set, which keeps what earlier sides freed (and a 4-bit base is quantized from a full-precision
   load): the base's weights are the figure that says what 4 bits save. The tiny
   model is 32 wide, under the 64 of a 4-bit block: with an nf4 side, every side of a ``--model tiny`` run trains the
   same kind of model at hidden size 128. The generation throughput (3.) stays on the full-precision base.

    python bench/gang.py --model smollm2 --configs 4 --chunks 4 --gangs 1,2,4 --repeats 3
    python bench/gang.py --model smollm2 --configs 8 --chunks 4 --gangs 8 --repeats 2
    python bench/gang.py --model tiny --repeats 1            # a quick check of the script
    python bench/gang.py --model smollm2 --configs 2 --chunks 2 --gangs 2 --quantization none,nf4 --repeats 1 \
        --skip-generation                                    # QLoRA: nf4 against the full-precision base

The result is also written as JSON (default ``/tmp/rfopt-bench/<model>-gang.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402 - bench/throughput.py: the plain TRL side, the configs, the timing helpers


# ---------------------------------------------------------------------- memory
def _reset_peak_rss() -> None:
    """Start the process's peak resident set (VmHWM) from its current size (Linux: ``clear_refs`` 5)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss() -> int | None:
    """The process's resident set now (VmRSS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------- timing by part
class Parts:
    """Wall seconds spent in a few functions during a gang study, by part (each part's time includes what it calls);
    decodes told apart by where they ran: in a gang's training (rollouts), in the study's baseline evaluation, or in
    an evaluation after a chunk."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def _decode_part(self) -> str:
        if "gang" in self._open:
            return "rollout_decode"
        return "baseline_decode" if "baseline" in self._open else "eval_decode"

    @contextlib.contextmanager
    def wrapped(self, owner: Any, name: str, part: str) -> Iterator[None]:
        original = getattr(owner, name)
        parts = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            where = parts._decode_part() if part == "decode" else part
            parts._open.append(part)
            try:
                return original(*args, **kwargs)
            finally:
                # A gang's member (a greenlet) may leave its part after another member entered one: this one's goes.
                del parts._open[len(parts._open) - 1 - parts._open[::-1].index(part)]
                parts.add(where, time.perf_counter() - started)

        setattr(owner, name, wrapper)
        try:
            yield
        finally:
            setattr(owner, name, original)


QUANTIZATIONS = ("none", "nf4")
"""How a gang side's base is loaded: as the configs say (full precision), or in 4 bits (nf4)."""


def quantized(setup: throughput.Setup, quantization: str) -> throughput.Setup:
    """`setup` with every config's base loaded as `quantization` says (``"nf4"``: 4-bit NormalFloat, bitsandbytes);
    ``"none"``: `setup` itself."""
    import copy
    import dataclasses

    import rfopt

    if quantization == "none":
        return setup
    from transformers import BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization)
    configs = [rfopt.TrialConfig(model=c.model, reward_funcs=list(c.reward_funcs), args=copy.deepcopy(c.args),
                                 peft_config=copy.deepcopy(c.peft_config), quantization_config=bnb)
               for c in setup.configs]
    return dataclasses.replace(setup, configs=configs)


def side_key(gang_size: int, training: str = "sequential", quantization: str = "none") -> str:
    """A gang side's name: ``G2``, ``G2-batched``, ``G2-nf4``, ``G2-batched-nf4``."""
    return (f"G{gang_size}" + ("" if training == "sequential" else f"-{training}")
            + ("" if quantization == "none" else f"-{quantization}"))


def parse_side(key: str) -> tuple[int, str, str]:
    """`side_key`'s inverse: ``"G2-batched-nf4"`` -> ``(2, "batched", "nf4")``."""
    size, *rest = key[1:].split("-")
    quantization = next((q for q in rest if q in QUANTIZATIONS), "none")
    training = next((r for r in rest if r not in QUANTIZATIONS), "sequential")
    return int(size), training, quantization


def run_gang_study(setup: throughput.Setup, out_dir: Path, gang_size: int, prompt_tokens: int,
                   training: str = "sequential", quantization: str = "none") -> dict[str, Any]:
    """(b): ``optimize(configs, ..., gang_size=G, gang_training=training)`` with evaluation, checkpoints and SQLite,
    timed by part; with `quantization` ``"nf4"``, on the base loaded in 4 bits (`quantized`)."""
    import optuna
    import torch

    setup = quantized(setup, quantization)

    import rfopt
    import rfopt.engine.running.unit
    import rfopt.training.memory
    import rfopt.training.models
    from rfopt.engine.outputs.baselines import Baselines
    from rfopt.training import gang, rollouts
    from rfopt.training.batched_step import shares_prompts
    from rfopt.storage import schema
    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.training.runner import TrialRunner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = setup.device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss()
    _reset_peak_rss()
    parts = Parts()
    with contextlib.ExitStack() as stack:
        for owner, name, part in (
            (rfopt.training.models, "load_model", "load"), (gang.Gang, "train", "gang"),
            (rollouts.BatchedBackend, "generate", "decode"), (rollouts.ExactBackend, "generate", "decode"),
            (gang._MemberGlobals, "restore", "switching"),
            (gang._MemberGlobals, "capture", "switching"), (rfopt.training.models.ModelPool, "activate", "switching"),
            (rfopt.engine.running.unit, "evaluate_runners", "evaluation"), (Baselines, "_evaluate", "baseline"),
            (TrialRunner, "train_chunk", "train_chunk"),
            # A unit's checkpoint files are staged by a thread while it is evaluated (``stage``, shown apart: its time
            # overlaps the evaluation's); what the unit waits for is the rest: the staging it still waits for after
            # its evaluation, the report, publishing and naming.
            (rfopt.engine.running.unit._Staging, "written", "checkpoints"), (CheckpointStore, "stage", "staged"),
            (CheckpointStore, "save_gang", "checkpoints"), (CheckpointStore, "save_staged", "checkpoints"),
        ):
            stack.enter_context(parts.wrapped(owner, name, part))
        loaded: list[int] = []
        stack.enter_context(_weights_of_loaded(rfopt.training.models, loaded))
        clock = throughput.Clock()
        with clock.measure():
            study = rfopt.create_study(study_name="gang", storage=f"sqlite:///{out_dir / 'study.db'}",
                                       pruner=optuna.pruners.NopPruner(), checkpoint_dir=out_dir / "checkpoints")
            study.optimize(setup.configs, setup.train, setup.test, num_chunks=setup.plan.num_chunks,
                           eval_settings=setup.settings, show_progress_bar=False, device=setup.device,
                           precision=setup.precision, gang_size=gang_size, gang_training=training)
    states = {t.number: t.state.name for t in study.optuna.trials}
    if any(state != "COMPLETE" for state in states.values()):
        raise RuntimeError(f"gang study trials did not all complete: {states}")
    s = parts.seconds
    load = s.get("load", 0.0)
    wall = clock.wall - load
    batched = training == "batched"
    training = s.get("gang", 0.0)  # every unit trains as a gang (a trial alone: a gang of one)
    # One trial at a time: its generation is TRL's own, inside the steps, not told apart here.
    rest_of_steps = training - s.get("rollout_decode", 0.0) - s.get("switching", 0.0)
    # Each part's time includes its decodes: "evaluation_decode" is part of "evaluation", "baseline_decode" of
    # "baseline"; the parts without a "_decode" twin sum to the wall time. "checkpoints_staged" ran beside the
    # evaluation, in a thread: in no sum.
    breakdown = {
        "rollout_decode": s.get("rollout_decode", 0.0),
        "train_steps_rest": rest_of_steps,
        "switching": s.get("switching", 0.0),
        "evaluation": s.get("evaluation", 0.0),
        "evaluation_decode": s.get("eval_decode", 0.0),
        "baseline": s.get("baseline", 0.0),
        "baseline_decode": s.get("baseline_decode", 0.0),
        "checkpoints": s.get("checkpoints", 0.0),
        "checkpoints_staged": s.get("staged", 0.0),
    }
    breakdown["storage_rungs_adapters"] = (wall - training - breakdown["evaluation"] - breakdown["baseline"]
                                           - breakdown["checkpoints"])
    lengths = [m.train.get("completions/mean_length") for t in study.optuna.trials
               for m in schema.TrialRecord(t).unit_metrics()]
    dtype = rfopt.training.models.Placement.of(setup.device, setup.precision).compute_dtype()
    estimate = rfopt.training.memory.gang_memory(
        setup.configs[:gang_size], prompt_tokens, eval_rows=min(setup.settings.batch_size, len(setup.test)),
        compute_width=None if dtype is None else dtype.itemsize,
        shared_prompts=batched and shares_prompts(setup.device), on_cpu=not cuda)
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss()
    return {
        "gang_size": gang_size,
        "quantization": quantization,
        "wall_s": wall,
        "cpu_s": clock.cpu - load,
        "load_s": load,
        "parts_s": breakdown,
        "mean_completion_length": _mean(lengths),
        "peak_bytes": peak,
        "held_bytes": None if peak is None or before is None else peak - before,
        "base_weights_bytes": sum(loaded) if loaded else None,
        "estimate_bytes": None if estimate is None else estimate.need(gang_size, batched=batched),
        "estimate_parts": None if estimate is None else {
            "base": estimate.base, "members": sum(estimate.members),
            "step": sum(estimate.steps) if batched and gang_size > 1 else estimate.step + estimate.kept,
            "decoder": estimate.decoder, "decode": sum(estimate.decode)},
    }


@contextlib.contextmanager
def _weights_of_loaded(owner: Any, sink: list[int]) -> Iterator[None]:
    """Records the bytes of the parameters and buffers of every base model ``owner.load_model`` loads
    (``get_memory_footprint``: a 4-bit weight packed two to a byte, its quantization constants not counted)."""
    original = owner.load_model

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = original(*args, **kwargs)
        sink.append(int(model.get_memory_footprint()))
        return model, tokenizer

    owner.load_model = wrapper
    try:
        yield
    finally:
        owner.load_model = original


def run_plain_side(setup: throughput.Setup, out_dir: Path) -> dict[str, Any]:
    """(a): plain TRL with the same evaluation and saving (`throughput.run_plain`)."""
    gc.collect()
    _reset_peak_rss()
    result = throughput.run_plain(setup, with_eval=True, out_dir=out_dir)
    return {"wall_s": result.train.wall, "cpu_s": result.train.cpu, "load_s": result.load.wall,
            "evaluation_s": result.eval_seconds, "peak_bytes": _peak_rss(),
            "mean_completion_length": None}


def _mean(values: list[Any]) -> float | None:
    kept = [v for v in values if isinstance(v, (int, float))]
    return statistics.mean(kept) if kept else None


# ---------------------------------------------------------------------- generation throughput
def generation_throughput(setup: throughput.Setup, gangs: list[int], rows: int, new_tokens: int,
                          repeats: int = 2) -> list[dict[str, Any]]:
    """Completion tokens per second of one batched engine call for G trials against G one-trial calls and G
    ``model.generate`` calls, all decoding exactly `new_tokens` tokens per row (no EOS), on fresh adapters."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rfopt.training.evaluation import EvalPrompts
    from rfopt.training.loading import load_model
    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling

    model, tokenizer = load_model(setup.configs[0], setup.device)
    top = max(gangs)
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                            init_lora_weights=False), adapter_name="g0")
    for i in range(1, top):
        peft.add_adapter(f"g{i}", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                              init_lora_weights=False))
    prompt = EvalPrompts.of(setup.train.select([0]), tokenizer).token_ids(tokenizer)[0]
    sampling = Sampling(max_new_tokens=new_tokens, eos_token_ids=(-1,), pad_token_id=tokenizer.pad_token_id,
                        temperature=0.7)
    engine = BatchedBackend(peft)

    def plain(adapter: str) -> None:
        peft.set_adapter(adapter)
        ids = torch.tensor([prompt] * rows, device=peft.device)
        with torch.no_grad():
            peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=0.7, top_k=0,
                          pad_token_id=tokenizer.pad_token_id)

    def best(run: Any) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    engine.generate([GenerationRequest("g0", [prompt], sampling)])  # warm-up
    plain("g0")
    results = []
    for g in gangs:
        tokens = g * rows * new_tokens
        batched = best(lambda: engine.generate([GenerationRequest(f"g{i}", [prompt] * rows, sampling, seed=i)
                                                 for i in range(g)]))
        separate = best(lambda: [engine.generate([GenerationRequest(f"g{i}", [prompt] * rows, sampling, seed=i)])
                                 for i in range(g)])
        generate = best(lambda: [plain(f"g{i}") for i in range(g)])
        results.append({"gang_size": g, "rows_per_trial": rows, "new_tokens": new_tokens,
                        "batched_tok_s": tokens / batched, "separate_tok_s": tokens / separate,
                        "hf_generate_tok_s": tokens / generate, "speedup_vs_hf_generate": generate / batched})
        print(f"  G={g}: one batched call {tokens / batched:7.1f} tok/s; {g} engine calls {tokens / separate:7.1f} "
              f"tok/s; {g} x model.generate {tokens / generate:7.1f} tok/s; batched/generate speedup "
              f"{generate / batched:.2f}x", flush=True)
    engine = peft = model = None  # freed before the memory of what follows is read
    gc.collect()
    return results


# ---------------------------------------------------------------------- main
def study_arguments(parser: argparse.ArgumentParser, *, chunks: int, gangs: str) -> None:
    """The options of a gang study that this script and bench/step_profile.py share (the model, the study's shape,
    the gang sizes, torch's threads, the JSON result); `chunks` and `gangs` are each script's defaults."""
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="tiny")
    parser.add_argument("--configs", type=int, default=4, help="GRPO configs (trials)")
    parser.add_argument("--chunks", type=int, default=chunks)
    parser.add_argument("--steps-per-chunk", type=int, default=1)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, help="default 16 (tiny), 64 (smollm2)")
    parser.add_argument("--gangs", default=gangs, help="gang sizes of rfopt's side, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, help="JSON result; default /tmp/rfopt-bench/<model>-<result>.json")


def study_args(parser: argparse.ArgumentParser, argv: list[str] | None, result: str) -> argparse.Namespace:
    """`parser`'s arguments (made with `study_arguments`): ``--gangs`` as a list of sizes, ``--out`` defaulting to
    ``/tmp/rfopt-bench/<model>-<result>.json``."""
    args = parser.parse_args(argv)
    args.gangs = [int(g) for g in args.gangs.split(",")]
    args.out = args.out or Path(tempfile.gettempdir()) / "rfopt-bench" / f"{args.model}-{result}.json"
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    study_arguments(parser, chunks=4, gangs="1,2,4")
    parser.add_argument("--gang-training", default="sequential",
                        help="gang training modes of rfopt's side, comma-separated (sequential, batched): each G runs "
                        "in each; a batched side is named G<g>-batched")
    parser.add_argument("--quantization", default="none",
                        help="how rfopt's gang sides load the base, comma-separated (none, nf4): each G runs with "
                        "each; an nf4 side is named G<g>-nf4 (QLoRA: needs bitsandbytes, pip install 'rfopt[qlora]')")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every side, the order alternating")
    parser.add_argument("--skip-study", action="store_true", help="only the generation throughput")
    parser.add_argument("--skip-generation", action="store_true", help="only the full study")
    args = study_args(parser, argv, "gang")
    args.quantization = [q.strip() for q in args.quantization.split(",")]
    unknown = [q for q in args.quantization if q not in QUANTIZATIONS]
    if unknown:
        parser.error(f"--quantization {','.join(unknown)}: give {' or '.join(QUANTIZATIONS)}, comma-separated")
    # Each gang side's key (`side_key`): G<g> (sequential), G<g>-batched, G<g>-nf4, ...; gang size 1 trains alone
    # whatever the mode.
    args.sides = [side_key(g, mode, q) for g in args.gangs for mode in args.gang_training.split(",")
                  for q in args.quantization if g > 1 or mode == "sequential"]
    return args


MEMORY = ("base_weights", "peak", "held", "estimate")
"""What the QLoRA row compares: the loaded base's weights, the run's peak, what it held, the estimate."""


def quantized_vs_full(record: dict[str, Any], sides: list[str]) -> dict[str, dict[str, Any]]:
    """Each quantized side against the same gang on the full-precision base: the median of the per-repeat wall-time
    ratios, and the last repeat's peak, held and estimated bytes of both."""
    found = {}
    for key in sides:
        size, training, quantization = parse_side(key)
        full = side_key(size, training)
        if quantization == "none" or full not in sides:
            continue
        last, last_full = record["repeats"][-1][key], record["repeats"][-1][full]
        found[key] = {
            "against": full,
            "median_ratio_wall": statistics.median(r[key]["wall_s"] / r[full]["wall_s"] for r in record["repeats"]),
            **{f"{what}_bytes": last[f"{what}_bytes"] for what in MEMORY},
            **{f"full_{what}_bytes": last_full[f"{what}_bytes"] for what in MEMORY},
        }
    return found


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1024**3:.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.loadavg_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="rfopt-gang-bench-"))
    source = None
    if args.model == "tiny" and any(q != "none" for q in args.quantization):
        from rfopt.tiny import build_tiny_model

        source = str(build_tiny_model(work / "wide-llama", hidden_size=128))  # 4-bit blocks are 64 weights wide
    setup = throughput.build_setup(args, work, source=source)
    from transformers import AutoTokenizer

    from rfopt.training.evaluation import EvalPrompts
    from rfopt.smollm2 import SMOLLM2, smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path()) if setup.source == SMOLLM2 else setup.source)
    prompt_tokens = max(map(len, EvalPrompts.of(setup.train, tokenizer).token_ids(tokenizer)))
    print(f"rfopt gangs - model {args.model}, {args.configs} configs x {args.chunks} chunks x {args.steps_per_chunk} "
          f"steps, max_completion_length {setup.configs[0].args.max_completion_length}, {len(setup.test)} eval "
          f"prompts, prompts up to {prompt_tokens} tokens; gangs {args.gangs}; {args.repeats} repeats; "
          f"{torch.get_num_threads()} threads; load average {args.loadavg_start[0]:.2f}", flush=True)
    record: dict[str, Any] = {"model": args.model, "configs": args.configs, "chunks": args.chunks,
                              "steps_per_chunk": args.steps_per_chunk, "eval_prompts": len(setup.test),
                              "max_completion_length": setup.configs[0].args.max_completion_length,
                              "quantization": args.quantization, "loadavg_start": args.loadavg_start,
                              "repeats": []}
    if not args.skip_study:
        throughput.warm_up(setup, work / "warm")
        sides = ["plain"] + args.sides
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else list(reversed(sides))
            runs: dict[str, Any] = {}
            for side in order:
                throughput._settle()
                out = work / f"r{repeat}-{side}"
                load = os.getloadavg()[0]
                if side == "plain":
                    runs[side] = run_plain_side(setup, out)
                else:
                    size, mode, quantization = parse_side(side)
                    runs[side] = run_gang_study(setup, out, size, prompt_tokens, mode, quantization)
                runs[side]["loadavg_1min_before"] = load
                print(f"  repeat {repeat} {side:>5}: {runs[side]['wall_s']:8.1f} s wall (load {load:.2f})", flush=True)
            for key in args.sides:
                runs[key]["ratio_wall"] = runs[key]["wall_s"] / runs["plain"]["wall_s"]
            record["repeats"].append(runs)
        record["median_ratio_wall"] = {
            key: statistics.median(r[key]["ratio_wall"] for r in record["repeats"]) for key in args.sides}
        print()
        print(f"{'side':>10} {'wall s (median)':>16} {'ratio per repeat':>28} {'median ratio':>13} "
              f"{'peak GiB':>9} {'held GiB':>9} {'estimate GiB':>13} {'completion len':>15}")
        plain_wall = statistics.median(r["plain"]["wall_s"] for r in record["repeats"])
        print(f"{'plain':>10} {plain_wall:16.1f} {'':>28} {'':>13} "
              f"{_gib(record['repeats'][-1]['plain']['peak_bytes']):>9}")
        for key in args.sides:
            runs = [r[key] for r in record["repeats"]]
            ratios = ", ".join(f"{r['ratio_wall']:.3f}" for r in runs)
            length = runs[-1]["mean_completion_length"]
            print(f"{key:>10} {statistics.median(r['wall_s'] for r in runs):16.1f} {ratios:>28} "
                  f"{record['median_ratio_wall'][key]:13.3f} {_gib(runs[-1]['peak_bytes']):>9} "
                  f"{_gib(runs[-1]['held_bytes']):>9} {_gib(runs[-1]['estimate_bytes']):>13} {length if length is None else round(length, 1)!s:>15}")
        record["quantized_vs_full"] = quantized_vs_full(record, args.sides)
        if record["quantized_vs_full"]:
            print()
            print(f"{'4-bit base (nf4)':>16} {'wall ratio to full precision':>29} {'base weights GiB':>17} "
                  f"{'peak GiB':>14} {'held GiB':>14} {'estimate GiB':>14}")
            for key, row in record["quantized_vs_full"].items():
                shown = [f"{_gib(row[f'{what}_bytes'])} / {_gib(row[f'full_{what}_bytes'])}" for what in MEMORY]
                print(f"{key:>16} {row['median_ratio_wall']:29.3f} {shown[0]:>17} {shown[1]:>14} {shown[2]:>14} "
                      f"{shown[3]:>14}")
            print("  (nf4 / full precision: the same gang on the base loaded in 4 bits, and in full precision; base "
                  "weights: the loaded model's parameters and buffers; on the CPU, peak and held are the process's "
                  "resident set, which keeps what earlier sides freed)")
        print()
        print("where a gang run's time goes (last repeat, seconds; a part's decode is inside it, the parts sum to the "
              "wall time):")
        plain = record["repeats"][-1]["plain"]
        print(f"  plain: evaluation {plain['evaluation_s']:.1f} (model.generate included) of {plain['wall_s']:.1f}")
        for key in args.sides:
            parts = record["repeats"][-1][key]["parts_s"]
            print(f"  {key}: " + ", ".join(
                f"{name} {value:.1f}" + (f" (its decode {parts[name + '_decode']:.1f})" if name + "_decode" in parts
                                         else "")
                + (f" (and {parts[name + '_staged']:.1f} written while evaluating)" if name + "_staged" in parts
                   else "")
                for name, value in parts.items()
                if not name.endswith(("_decode", "_staged")) or name == "rollout_decode"))
    if not args.skip_generation:
        print()
        print("generation throughput (completion tokens per second):")
        rows = 4
        new = setup.configs[0].args.max_completion_length
        record["generation"] = generation_throughput(setup, sorted(set(args.gangs) | {1, 2, 4, 8}), rows, new)
    record["loadavg_end"] = os.getloadavg()
    print(f"\nload average {record['loadavg_start'][0]:.2f} -> {record['loadavg_end'][0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"written: {args.out}")
    return record


if __name__ == "__main__":
    main()
