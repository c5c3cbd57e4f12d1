"""Rollout decoding (issue 31): the batched backend against ``model.generate``, per decode iteration.

For G = 1, 4, 8, 16 trials of one base model, each with its own LoRA adapter (r16 on every linear layer, random
weights) and 4 rows of one prompt, decoding exactly `new_tokens` tokens per row (EOS never ends a row early):

- **batched**: one `BatchedBackend.generate` call for all G requests, in each mode asked (``eager``; on a CUDA device
  ``graph``, the default there, and ``compiled``). Its decode steps are timed apart from its prefill: ms per decode
  iteration (one token for every row) and completion tokens per second of the whole call;
- **generate**: ``model.generate`` through one adapter (4 rows, dynamic cache, eager), as plain TRL generates, per
  decoded token; G adapters one after another take G times as long;
- **static** (``--anchor``): ``model.generate(cache_implementation="static")`` through one adapter, which on a CUDA
  device compiles its forward (transformers' fast path; the first call compiles);
- **kernels per iteration**: CUDA kernels one eager decode step launches (``torch.profiler``), G = 4.

The first call of each shape is a warm-up (it captures the graph: its cost is printed apart); the figure is the best
of `repeats` calls.

    python bench/decode.py --model smollm2 --gangs 1,4 --threads 2          # the CPU
    python bench/decode.py --model tiny --gangs 1,2                          # a quick check of the script
    python bench/decode.py --model smollm2 --gangs 4 --evaluation 8          # an evaluation's decode (prefill apart)
    (bench/gpu.py runs it on the GPU machine with the Qwen2.5-0.5B shape)

It prints one line per measurement and writes JSON (default ``/tmp/rfopt-bench/<model>-decode.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))

NEW_TOKENS = 64


def adapters(model: Any, count: int, rank: int = 16) -> Any:
    """`model` as a PeftModel with `count` random LoRA adapters ``g0``..``g{count-1}`` (small, so that greedy text
    stays the base model's kind of text)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft = get_peft_model(model, config, adapter_name="g0")
        for i in range(1, count):
            peft.add_adapter(f"g{i}", config)
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)
    peft.eval()
    return peft


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "") == "cuda":
        torch.cuda.synchronize()


def _best(run: Callable[[], Any], repeats: int, device: Any) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - started)
    return min(times)


def time_batched(peft: Any, prompt: list[int], gangs: list[int], rows: int, new_tokens: int, mode: str,
                 repeats: int, pad: int, on_result: Callable[[dict[str, Any]], None], dtype: Any = None) -> None:
    """The batched backend in `mode`, for each G in `gangs`. A decode iteration's time is the difference between
    calls of `new_tokens` and of half as many tokens, over the tokens between them (no prefill, no start-up, the
    device's queue drained at both ends). `dtype`: what the decoder computes in (``torch.bfloat16``: the bf16 copy
    of the base and the adapters that mixed precision decodes with); None: the model's own."""
    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling

    backend = BatchedBackend(peft, mode=mode, dtype=dtype)
    half = new_tokens // 2

    def requests(g: int, tokens: int) -> list[Any]:
        sampling = Sampling(max_new_tokens=tokens, eos_token_ids=(-1,), pad_token_id=pad, temperature=1.0)
        return [GenerationRequest(f"g{i}", [prompt] * rows, sampling, seed=i) for i in range(g)]

    for g in gangs:
        stats = backend.stats
        captured_before = stats.capture_seconds
        _sync(backend.device)
        started = time.perf_counter()
        backend.generate(requests(g, new_tokens))  # warm-up: a new shape is captured here
        _sync(backend.device)
        first = time.perf_counter() - started
        captured = stats.capture_seconds - captured_before
        prefills = []

        def call(tokens: int) -> None:
            p0 = stats.prefill_seconds
            backend.generate(requests(g, tokens))
            prefills.append(stats.prefill_seconds - p0)

        full = _best(lambda: call(new_tokens), repeats, backend.device)
        short = _best(lambda: call(half), repeats, backend.device)
        tokens = g * rows * new_tokens
        result = {"what": "batched", "mode": mode, "gang_size": g, "rows": g * rows, "new_tokens": new_tokens,
                  "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
                  "ms_per_iteration": (full - short) / (new_tokens - half) * 1e3, "prefill_ms": min(prefills) * 1e3,
                  "tok_s": tokens / full, "wall_s": full, "first_call_s": first, "capture_s": captured}
        on_result(result)
        print(f"  batched {mode:>8} G={g:<2} ({g * rows:>3} rows): {result['ms_per_iteration']:7.2f} ms/iteration, "
              f"{result['tok_s']:8.0f} tok/s, call {full:6.3f} s, first call {first:5.1f} s (capture {captured:.1f} s)",
              flush=True)


def greedy_agreement(peft: Any, prompt: list[int], rows: int, new_tokens: int, pad: int) -> dict[str, Any]:
    """How far the batched backend's greedy tokens through one adapter agree with ``model.generate``'s (tokens
    until the first difference, per row)."""
    import torch

    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling

    sampling = Sampling(max_new_tokens=new_tokens, eos_token_ids=(-1,), pad_token_id=pad, do_sample=False)
    ours = BatchedBackend(peft).generate([GenerationRequest("g1", [prompt] * rows, sampling)])[0].token_ids
    peft.set_adapter("g1")
    ids = torch.tensor([prompt] * rows, device=peft.device)
    with torch.no_grad():
        out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    theirs = out[:, len(prompt):].tolist()
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(ours, theirs)]
    return {"what": "agreement", "rows": rows, "new_tokens": new_tokens, "tokens_equal_before_first_difference": same}


def time_generate(peft: Any, prompt: list[int], rows: int, new_tokens: int, repeats: int, pad: int, static: bool,
                  on_result: Callable[[dict[str, Any]], None]) -> None:
    """``model.generate`` through one adapter, 4 rows: ms per decoded token."""
    import torch

    peft.set_adapter("g0")
    ids = torch.tensor([prompt] * rows, device=peft.device)
    extra = {"cache_implementation": "static"} if static else {}

    def run() -> None:
        with torch.no_grad():
            peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, pad_token_id=pad,
                          **extra)

    started = time.perf_counter()
    run()
    first = time.perf_counter() - started
    wall = _best(run, repeats, peft.device)
    what = "static" if static else "generate"
    result = {"what": what, "gang_size": 1, "rows": rows, "new_tokens": new_tokens,
              "ms_per_iteration": wall / new_tokens * 1e3, "tok_s": rows * new_tokens / wall, "wall_s": wall,
              "first_call_s": first}
    on_result(result)
    print(f"  model.generate {'static, compiled' if static else 'eager, dynamic cache'} (1 adapter, {rows} rows): "
          f"{result['ms_per_iteration']:7.2f} ms/token, {result['tok_s']:8.0f} tok/s, first call {first:.1f} s",
          flush=True)


def count_kernels(peft: Any, prompt: list[int], gang: int, rows: int, pad: int) -> int | None:
    """CUDA kernels launched by one eager decode step of G trials (None on the CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling

    if peft.device.type != "cuda":
        return None
    backend = BatchedBackend(peft, mode="eager")
    sampling = Sampling(max_new_tokens=2, eos_token_ids=(-1,), pad_token_id=pad, temperature=1.0)
    requests = [GenerationRequest(f"g{i}", [prompt] * rows, sampling, seed=i) for i in range(gang)]
    backend.generate(requests)
    bucket = next(iter(backend._buckets.values()))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        backend._step(bucket)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def profile_step(peft: Any, prompt: list[int], gang: int, rows: int, pad: int, top: int = 12) -> dict[str, Any]:
    """CUDA time of one eager decode step of G trials, by kernel (the most expensive first): what a captured step
    spends its time on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling

    backend = BatchedBackend(peft, mode="eager")
    sampling = Sampling(max_new_tokens=2, eos_token_ids=(-1,), pad_token_id=pad, temperature=1.0)
    backend.generate([GenerationRequest(f"g{i}", [prompt] * rows, sampling, seed=i) for i in range(gang)])
    bucket = next(iter(backend._buckets.values()))
    with torch.no_grad():
        backend._step(bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        backend._step(bucket)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels.setdefault(e.name[:90], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                       else e.cuda_time_total)
    total = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    print(f"  profile G={gang}: {sum(len(v) for v in kernels.values())} kernels, {total / 1e3:.2f} ms of CUDA time",
          flush=True)
    for name, times in ranked:
        print(f"    {sum(times) / 1e3:7.3f} ms  x{len(times):<4} {name}", flush=True)
    return {"what": "profile", "gang_size": gang, "cuda_ms": total / 1e3,
            "top": [(name, sum(t) / 1e3, len(t)) for name, t in ranked]}


def run(peft: Any, tokenizer: Any, prompt: list[int], gangs: list[int], *, rows: int = 4,
        new_tokens: int = NEW_TOKENS, modes: list[str], repeats: int = 2, anchor: bool = False,
        with_generate: bool = True, with_agreement: bool = True, on_result: Callable[[dict[str, Any]], None]
        ) -> None:
    """Every measurement above; `on_result` hears each one as it is made (bench/gpu.py writes its JSON then)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if with_agreement:
        agreement = greedy_agreement(peft, prompt, rows, new_tokens, pad)
        on_result(agreement)
        print(f"  greedy tokens equal to model.generate's before the first difference, per row: "
              f"{agreement['tokens_equal_before_first_difference']} of {new_tokens}", flush=True)
    for mode in modes:
        time_batched(peft, prompt, gangs, rows, new_tokens, mode, repeats, pad, on_result)
    if with_generate:
        time_generate(peft, prompt, rows, new_tokens, repeats, pad, static=False, on_result=on_result)
    if anchor:
        time_generate(peft, prompt, rows, new_tokens, repeats, pad, static=True, on_result=on_result)
    if with_generate:
        kernels = count_kernels(peft, prompt, 4, rows, pad)
        if kernels is not None:
            on_result({"what": "kernels", "gang_size": 4, "kernels_per_iteration": kernels})
            print(f"  CUDA kernels per eager decode step, G=4: {kernels}", flush=True)


def time_evaluation(peft: Any, tokenizer: Any, gang: int, prompts: list[list[int]], new_tokens: int, repeats: int,
                    on_result: Callable[[dict[str, Any]], None]) -> None:
    """An evaluation's decode (``--evaluation N``): G trials x N evaluation prompts (rendered by one chat template,
    so they share its system prompt), greedy, ending at EOS, as a gang's evaluation decodes them; the shipped decoder
    against itself with the shared prefix prefilled whole (``MIN_PREFIX`` out of reach) and with every step attending
    the whole cache (``LIVE_BLOCK`` None), the variants alternating, best of `repeats`: prefill and steps apart."""
    from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling, batched

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampling = Sampling(max_new_tokens=new_tokens, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=pad,
                        do_sample=False)
    requests = [GenerationRequest(f"g{i}", prompts, sampling) for i in range(gang)]
    variants = {"shipped": {}, "prefix prefilled whole": {"MIN_PREFIX": 10 ** 9},
                "whole cache attended": {"LIVE_BLOCK": None}}
    best: dict[str, dict[str, float]] = {}
    tokens: dict[str, Any] = {}
    backend = BatchedBackend(peft, mode="eager")
    backend.generate(requests)  # warm-up: the bucket is made here
    for repeat in range(repeats):
        for name in (list(variants) if repeat % 2 == 0 else list(variants)[::-1]):
            saved = {key: getattr(batched, key) for key in variants[name]}
            for key, value in variants[name].items():
                setattr(batched, key, value)
            try:
                stats = backend.stats
                prefill0, started = stats.prefill_seconds, time.perf_counter()
                out = backend.generate(requests)
                wall = time.perf_counter() - started
            finally:
                for key, value in saved.items():
                    setattr(batched, key, value)
            prefill = stats.prefill_seconds - prefill0
            tokens[name] = [o.token_ids for o in out]
            if name not in best or wall < best[name]["wall_s"]:
                best[name] = {"wall_s": wall, "prefill_s": prefill, "steps_s": wall - prefill}
    lengths = [len(p) for p in prompts]
    from rfopt.training.rollouts.batched import shared_prefix

    for name, figures in best.items():
        same = sum(a == b for x, y in zip(tokens[name], tokens["shipped"]) for a, b in zip(x, y))
        result = {"what": "evaluation", "variant": name, "gang_size": gang, "prompts": len(prompts),
                  "prompt_tokens": [min(lengths), max(lengths)], "shared_prefix": shared_prefix(prompts),
                  "rows_equal_to_shipped": same, **figures}
        on_result(result)
        print(f"  evaluation decode, {gang} trials x {len(prompts)} prompts ({min(lengths)}-{max(lengths)} tokens, "
              f"{shared_prefix(prompts)} shared), {name:>22}: {figures['wall_s']:6.2f} s (prefill "
              f"{figures['prefill_s']:5.2f} s, steps {figures['steps_s']:5.2f} s); rows equal to shipped: {same} of "
              f"{gang * len(prompts)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--gangs", default="1,4")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="eager", help="comma-separated: eager, graph, compiled")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--anchor", action="store_true", help="also model.generate with a static, compiled cache")
    parser.add_argument("--evaluation", type=int, default=0, metavar="N",
                        help="only an evaluation's decode: G (the largest of --gangs) trials x N evaluation prompts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rfopt.studies.data import load_arithmetic

    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        from rfopt.smollm2 import smollm2_path

        path = smollm2_path()
    else:
        from rfopt.tiny import build_tiny_model

        path = build_tiny_model(Path(tempfile.mkdtemp(prefix="rfopt-decode-")) / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    gangs = [int(g) for g in args.gangs.split(",")]
    peft = adapters(AutoModelForCausalLM.from_pretrained(path), max(gangs))
    train, _ = load_arithmetic(n_train=1, n_test=1)
    prompt = tokenizer.apply_chat_template(train["prompt"][0], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    results: list[dict[str, Any]] = []
    print(f"decode - {args.model}, {len(prompt)}-token prompt, {args.rows} rows per trial, {args.new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.evaluation:
        _, test = load_arithmetic(n_train=1, n_test=args.evaluation, seed=0)
        prompts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"] for p in test["prompt"]]
        time_evaluation(peft, tokenizer, max(gangs), prompts, args.new_tokens, max(args.repeats, 2), results.append)
    else:
        run(peft, tokenizer, prompt, gangs, rows=args.rows, new_tokens=args.new_tokens, modes=args.modes.split(","),
            repeats=args.repeats, anchor=args.anchor, on_result=results.append)
    out = args.out or Path(tempfile.gettempdir()) / "rfopt-bench" / f"{args.model}-decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "results": results, "loadavg_end": os.getloadavg()}, indent=1))
    print(f"load average at the end {os.getloadavg()[0]:.2f}; written: {out}")


if __name__ == "__main__":
    main()
