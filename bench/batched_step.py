"""The batched gang step's own cost (issue 42 points 2-3): one batched backbone forward and backward of G members' rows
(`rfopt.training.batched_step.BatchedBackbone`) against the same members' forwards and backwards one after another.

Only the part the two modes compute differently: the shared backbone with each member's LoRA adapter (ranks 16, 16, 8,
32 on every linear layer, as bench/throughput.py's configs), rows of the widths given (a member's prompt and
completion; a narrower member is padded to the widest in the batched forward), a loss on the last 64 positions. No
decode, no TRL: each member's own head and loss are the same work in both modes. The order of the sides alternates
between repeats; the figures are process CPU seconds (steadier than wall time on a shared machine: use
``--threads 1`` there, so that no OpenMP thread spins on a busy core) and wall seconds.

    nice -n 5 python bench/batched_step.py --widths 149,149,149,149 --repeats 3 --threads 1
    nice -n 5 python bench/batched_step.py --widths 149,149,120,100 --against 12394cf   # and an earlier commit's step
    python bench/batched_step.py --model tiny --repeats 1                                  # a quick check of the script
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

RANKS = (16, 16, 8, 32)


def _earlier(commit: str) -> Any:
    """`rfopt.training.batched_step` as it was at `commit` (a module of its own beside today's)."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "show", f"{commit}:rfopt/training/batched_step.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="rfopt-batched-step-")) / "batched_step.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"rfopt.training._batched_step_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Each side's step (with `args.widths`' rows on SmolLM2 or the tiny model) as a function to time."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import rfopt.training.batched_step as today

    if args.model == "tiny":
        from rfopt.tiny import build_tiny_model

        source = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="rfopt-batched-step-")) / "tiny"))
    else:
        from rfopt.smollm2 import smollm2_path

        source = str(smollm2_path())
    names = [f"t{i}" for i in range(len(args.widths))]
    model = None
    for name, rank in zip(names, [RANKS[i % len(RANKS)] for i in range(len(names))]):
        config = LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        if model is None:
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(source), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    model.train()
    backbone = model.get_base_model().base_model
    vocab = model.config.vocab_size
    batches = []
    for i, width in enumerate(args.widths):
        ids = torch.randint(3, vocab, (args.rows, width), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        if args.prompt:  # GRPO's rows: completions of one prompt, left-padded alike
            ids[:, : args.prompt] = ids[0, : args.prompt]
            mask[:, : width // 16] = 0
        else:
            mask[0, : width // 16] = 0  # left pads on a shorter prompt, right pads on a shorter completion
        mask[-1, -3:] = 0
        batches.append((ids, mask))
    keep = min(64, min(args.widths))

    def trainable() -> None:
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)

    def sequential() -> None:
        for name, (ids, mask) in zip(names, batches):
            model.base_model.set_adapter(name)
            trainable()
            hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden[:, -keep:].pow(2).mean().backward()

    def batched(module: Any) -> Callable[[], None]:
        step = module.BatchedBackbone(backbone)

        def run() -> None:
            trainable()
            outs = step.forward([module.ForwardRequest(n, ids, mask, True) for n, (ids, mask) in zip(names, batches)])
            torch.autograd.backward([h[:, -keep:].pow(2).mean() for h in outs])
        return run

    found = {"sequential": sequential, "batched": batched(today)}
    if args.prompt:  # the same batched step with every row's prompt computed on its own
        unshared = batched(today)

        def per_row() -> None:
            saved, today.SHARE_PROMPTS_ON = today.SHARE_PROMPTS_ON, None
            try:
                unshared()
            finally:
                today.SHARE_PROMPTS_ON = saved
        found["batched, prompts per row"] = per_row
    if args.against:
        found[f"batched at {args.against}"] = batched(_earlier(args.against))
    found["zero_grad"] = lambda: model.zero_grad(set_to_none=True)
    return found


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--widths", default="149,149,149,149", help="each member's row width, comma-separated")
    parser.add_argument("--rows", type=int, default=4, help="rows per member (num_generations)")
    parser.add_argument("--prompt", type=int, default=0,
                        help="a member's rows share their first N tokens, as GRPO's completions of one prompt do")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--against", help="a commit whose batched step is timed too")
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(args.threads)
    steps = sides(args)
    zero = steps.pop("zero_grad")
    order = list(steps)
    print(f"batched step against sequential - model {args.model}, widths {args.widths} x {args.rows} rows, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in order}
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            zero()
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            results[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            print(f"  {name:<24} repeat {repeat}: {results[name][-1][1]:6.2f} s CPU {results[name][-1][0]:6.2f} s wall "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    base = sorted(c for _, c in results["sequential"])[args.repeats // 2]
    for name, times in results.items():
        cpu = sorted(c for _, c in times)[args.repeats // 2]
        print(f"{name:<24} median {cpu:6.2f} s CPU ({cpu / base:.3f} of sequential), best wall "
              f"{min(w for w, _ in times):6.2f} s")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return results


if __name__ == "__main__":
    main()
