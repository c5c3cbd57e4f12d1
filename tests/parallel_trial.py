"""One trial of the tiny model trained chunk by chunk as a data-parallel job: ``python parallel_trial.py RANK WORLD
PORT OUT``. Rank 0 trains, evaluates after each chunk and writes the per-chunk values, the chunks' training
metrics and the final adapter to OUT (a JSON file and OUT.safetensors); the other ranks follow it."""

import json
import sys
import tempfile

from safetensors.torch import save_file

from rfopt_testkit import prompts_dataset, reward_len, reward_vowels, trial_config

from rfopt import EvalSettings
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.models import ModelPool
from rfopt.parallel import DataParallel, DataParallelRunner, follow, lead_done

import os


def main(rank: int, world: int, port: int, out: str) -> None:
    group = DataParallel(rank, world, port=port)
    group.start("cpu")
    train, evaluation = prompts_dataset(16), prompts_dataset(2, "E")
    # The trial's batch is 8 completions (2 prompts x 4 generations), its accumulation 2: on 2 devices, 4 each.
    config = trial_config(os.environ["RFOPT_TEST_TINY_MODEL"], rewards=[reward_len, reward_vowels],
                          per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=2e-2)
    plan = ChunkPlan.build(len(train), 2, 0)
    schedule = trial_schedule(plan, config.args)
    pool = ModelPool("cpu", "fp32")
    workdir = tempfile.mkdtemp(prefix="rfopt-parallel-")
    if not group.lead:
        follow(group, pool, train, workdir)
        group.stop()
        return
    runner = DataParallelRunner(0, config, plan, schedule, train, pool, workdir, group=group)
    values, metrics = [], []
    while not runner.finished:
        chunk = runner.train_chunk()
        metrics.append({k: v for k, v in chunk.values.items() if k in ("loss", "reward", "reward_std", "grad_norm")})
        values.append(runner.evaluate(evaluation, EvalSettings()).objective("reward"))
    lead_done(group)
    save_file({k: v.contiguous() for k, v in runner.trainable_weights().items()}, out + ".safetensors")
    with open(out, "w") as f:
        json.dump({"values": values, "metrics": metrics, "steps": runner.global_step}, f)
    group.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
