"""What a gang unit's checkpoint costs the unit, before and since its files are written while it is evaluated
(issue 42 point 6).

A unit's checkpoint is its members' states (LoRA weights, AdamW's two moments, counters) and its report. Since
a8f3bb5 the engine stages each member's state files (`CheckpointStore.stage`: tensors and ``state.json``, flushed to
disk) in a thread while the unit is evaluated, and the unit waits only for the rest: the report, publishing (rename),
the gang record and each member's ``LATEST`` (`CheckpointStore.save_gang`). This times, per gang unit of SmolLM2-135M
with 4 LoRA adapters (r 16, 16, 8, 32 on every linear layer, as bench/gang.py's configs) and their AdamW states:

- **whole**: staging and saving back to back, what a unit waited for before (the same files and calls);
- **staged**: the staging alone, which now runs beside the evaluation (a unit's evaluation of SmolLM2 takes ~10 s on
  the CPU, so it is off the unit's path whenever it is shorter than that);
- **left**: what the unit still waits for after its evaluation.

Order alternates (whole, then staged+left, and so on); each figure is the median over `--repeats`. The load average
is printed: the figures are wall seconds of disk writes and fsyncs on a shared disk.

    python bench/checkpoint_overlap.py --repeats 3 [--dir /path/on/the/disk/to/measure]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def snapshots(ranks: tuple[int, ...]) -> list[tuple[dict, dict]]:
    """Each adapter's weights and an AdamW state after one step over them (both moments filled)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rfopt.smollm2 import smollm2_path

    model = None
    for i, rank in enumerate(ranks):
        config = LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        if model is None:
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(smollm2_path()), config, adapter_name="t0")
        else:
            model.add_adapter(f"t{i}", config)
    out = []
    for i in range(len(ranks)):
        weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=f"t{i}").items()}
        params = [torch.nn.Parameter(v.clone()) for v in weights.values()]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        out.append((weights, optimizer.state_dict()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint store goes (default: a temporary directory)")
    args = parser.parse_args()

    import torch

    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.storage.state import TrialSnapshot, UnitReport

    torch.set_num_threads(2)
    states = snapshots((16, 16, 8, 32))
    report = UnitReport(unit=0, value=0.5, metrics={"eval": {"reward": 0.5}},
                        samples=[{"prompt": "p" * 200, "completion": "c" * 400}] * 8, steps=[])
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="rfopt-checkpoint-overlap-"))
    store = CheckpointStore(root)
    load = os.getloadavg()[0]
    whole, staged, left = [], [], []
    try:
        for unit in range(1, 2 * args.repeats + 1):
            unit_states = [TrialSnapshot(units_done=unit, global_step=4 * unit, tokens_seen=0, weights=w, optimizer=o,
                                         scheduler={"last_epoch": unit}, rng=None) for w, o in states]
            started = time.perf_counter()
            entries = [store.stage(number, state) for number, state in enumerate(unit_states)]
            staged_at = time.perf_counter()
            store.save_gang([(entry, report) for entry in entries], gang=f"bench-{unit}")
            ended = time.perf_counter()
            if unit % 2:
                whole.append(ended - started)
            else:
                staged.append(staged_at - started)
                left.append(ended - staged_at)
        size = sum(f.stat().st_size for f in (root / "trial-00000").parent.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"SmolLM2-135M, 4 LoRA adapters (r 16, 16, 8, 32) with AdamW states: {size / 2**20:.1f} MiB of checkpoints a "
          f"gang unit; {args.repeats} repeats; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name, values in (("whole (before: the unit waited for all of it)", whole),
                         ("staged (now beside the evaluation)", staged),
                         ("left (now: what the unit waits for)", left)):
        print(f"  {name:48} median {statistics.median(values):.3f} s  {[round(v, 3) for v in values]}")


if __name__ == "__main__":
    main()
