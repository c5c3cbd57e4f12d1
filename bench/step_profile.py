"""Where a member's training step goes (issue 42): a gang study timed part by part, alone (G=1) and in a gang.

Runs ``rfopt.create_study(...).optimize(configs, ..., gang_size=G)`` (the configs of bench/throughput.py: LoRA
adapters with different ranks and learning rates on one base model, evaluation after every chunk, checkpoints and
SQLite) for each G in ``--gangs``, with the functions below wrapped by a timer, and prints the seconds of each part per
member step (a member step: one trial's optimizer step; the run's parts divided by configs x chunks x steps).

Time is *exclusive* and charged per greenlet: a gang's members are greenlets in one thread (`rfopt.training.gang`),
and while one waits for the batched decode the others run, so each member keeps its own stack of open parts and a
switch charges the time so far to the part open in the greenlet that ran (``greenlet.settrace``). A part's time is
its own code's, its wrapped callees' apart ("loss forward" is inside "loss math", but counted apart from it).

The parts (member step, in the order TRL runs them): rollout decode (the gang's batched decode; a trial alone: TRL's
``generate``), TRL's generation bookkeeping (completion masks, token counts and their ``.item()`` reads), reward
functions, scoring (advantages, reward metrics), old-policy / reference log-prob forwards (``no_grad``), the loss
forward, the loss math and its metrics, backward, clipping, the optimizer, the scheduler, ``zero_grad``, TRL's
logging, the callbacks (rfopt's chunk boundary, progress), ``train()``/``eval()`` walks, the trainer's construction,
``Trainer.train``'s own loop and ``free_memory``, switching between members. And the unit's bookkeeping, per unit:
evaluation, the study's baseline (its base model evaluated once, decode included: work plain TRL does not do),
checkpoints (the state's copy apart), the commit (storage), the best adapter, the final adapter, the
gang plan, loading, the rest (scheduler, rungs, storage reads). Gradient checkpointing and mixed precision are
printed as the configs set them (the bench's configs: checkpointing off, float32 on the CPU: autocast is a no-op).

On a CUDA device the parts would need a synchronisation at each boundary to mean anything: this is a CPU profile.
bench/gpu.py's ``steps`` part runs `profile_study` on a GPU for one figure only, the members' training time (every part
but the rollout decode, `member_training_seconds`), with the device waited for at the decodes' edges.

    nice -n 5 python bench/step_profile.py --model smollm2 --configs 4 --chunks 2 --gangs 1,4
    python bench/step_profile.py --model tiny --configs 2 --chunks 2 --gangs 1,2     # a quick check of the script
    nice -n 5 python bench/step_profile.py --model smollm2 --configs 4 --chunks 1 --gangs 4 \
        --gang-training sequential,batched     # a gang's steps in both modes (G=4b: batched; its forward and
                                               # backward are the parts "batched forward/backward (gang)")

The result is also written as JSON (default ``/tmp/rfopt-bench/<model>-step-profile.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gang  # noqa: E402 - bench/gang.py: the options of a gang study
import throughput  # noqa: E402 - bench/throughput.py: the configs, the data, the warm-up

STEP_PARTS = (
    "rollout decode", "TRL generation bookkeeping", "prompt tokenization", "rollout hand-over", "reward functions",
    "scoring (advantages, metrics)", "old-policy/ref log-probs forward", "loss forward", "loss math and metrics",
    "backward", "clipping", "optimizer step", "scheduler step", "zero_grad", "training_step (rest)",
    "TRL logging", "callbacks", "train()/eval() walks", "trainer construction", "Trainer.train loop (rest)",
    "free_memory (gc)", "chunk set-up (rest)", "switching", "gang driver", "batched forward (gang)",
    "batched backward (gang)",
)
UNIT_PARTS = (
    "evaluation decode", "evaluation (rest)", "baseline evaluation", "checkpoint: state copy", "checkpoint: files",
    "commit (storage)", "best adapter", "final adapter", "gang plan", "load (prepare)", "rest (scheduler, rungs, storage reads)",
)

SYNCED_PARTS = ("rollout decode", "evaluation decode", "baseline evaluation")
"""Parts at whose edges a CUDA profile waits for the device (`Profile.sync`)."""
TRAINING_EXCLUDED = ("rollout decode",)
"""What `member_training_seconds` leaves out of a member step's parts: the decode, which a gang shares."""


def member_training_seconds(run: dict[str, Any]) -> float:
    """A profiled run's members' training time (every part of `STEP_PARTS` but the rollout decode: rewards, log-prob
    and loss forwards, backward, clipping, optimizer, TRL's bookkeeping, switching), in seconds."""
    return sum(run["seconds"].get(part, 0.0) for part in STEP_PARTS if part not in TRAINING_EXCLUDED)


class Profile:
    """Exclusive wall seconds by part, each greenlet with its own stack of open parts."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        """On a CUDA device, ``torch.cuda.synchronize``: called at the edges of the decode parts (`SYNCED_PARTS`), so
        that kernels queued by training are not charged to a decode that waits for them, nor a decode's to training.
        The training parts' sum then means what it says; a part inside it, not (bench/gpu.py reads the sum)."""
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        """The process's CPU seconds (every thread: torch's intra-op threads too) by part: steadier than wall time
        on a shared machine."""
        self.calls: dict[str, int] = {}
        self._stacks: dict[Any, list[str]] = {}
        self.start()

    def start(self) -> None:
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def _charge(self, runner: Any) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        stack = self._stacks.get(runner)
        label = stack[-1] if stack else "rest (scheduler, rungs, storage reads)"
        self.seconds[label] = self.seconds.get(label, 0.0) + now - self._last
        self.cpu[label] = self.cpu.get(label, 0.0) + cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def stack(self) -> list[str]:
        import greenlet

        return self._stacks.setdefault(greenlet.getcurrent(), [])

    def enter(self, label: str) -> None:
        import greenlet

        if self.sync is not None and label in SYNCED_PARTS:
            self.sync()
        self._charge(greenlet.getcurrent())
        self.stack().append(label)
        self.calls[label] = self.calls.get(label, 0) + 1

    def leave(self) -> None:
        import greenlet

        if self.sync is not None and self.stack()[-1] in SYNCED_PARTS:
            self.sync()
        self._charge(greenlet.getcurrent())
        self.stack().pop()

    def switched(self, event: str, args: Any) -> None:
        if event in ("switch", "throw"):
            self._charge(args[0])  # the greenlet that ran until now

    @contextlib.contextmanager
    def wrapped(self, owner: Any, name: str, label: str | Callable[[list[str]], str | None]) -> Iterator[None]:
        stored = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        original = getattr(owner, name)  # a classmethod bound to its class
        profile = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            part = label(profile.stack()) if callable(label) else label
            if part is None:  # nested in itself (a module's train() calls its children's)
                return original(*args, **kwargs)
            profile.enter(part)
            try:
                return original(*args, **kwargs)
            finally:
                profile.leave()

        setattr(owner, name, wrapper)
        try:
            yield
        finally:
            setattr(owner, name, stored)


def _logps_part(stack: list[str]) -> str:
    import torch

    return "loss forward" if torch.is_grad_enabled() else "old-policy/ref log-probs forward"


def _decode_part(stack: list[str]) -> str:
    if "baseline evaluation" in stack:  # the study's base model, evaluated once: its decode is its own
        return "baseline evaluation"
    return "evaluation decode" if "evaluation (rest)" in stack else "rollout decode"


def _walk_part(stack: list[str]) -> str | None:
    return None if stack and stack[-1] == "train()/eval() walks" else "train()/eval() walks"


def _targets() -> list[tuple[Any, str, Any]]:
    import accelerate
    import accelerate.optimizer
    import accelerate.scheduler
    import torch
    import transformers
    import transformers.trainer_callback
    from trl import GRPOTrainer

    import rfopt.engine.running.unit as unit
    from rfopt.engine.outputs.baselines import Baselines
    import rfopt.storage.schema as schema
    import rfopt.training.models as models
    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.training import gang, rollouts
    from rfopt.training.runner import TrialRunner

    return [
        (rollouts.BatchedBackend, "generate", _decode_part), (rollouts.ExactBackend, "generate", _decode_part),
        (GRPOTrainer, "_generate_single_turn", "rollout decode"),
        (GRPOTrainer, "_generate", "TRL generation bookkeeping"),
        (GRPOTrainer, "_tokenize_prompts", "prompt tokenization"),
        (gang.Gang, "_rollout", "rollout hand-over"),
        (GRPOTrainer, "_calculate_rewards", "reward functions"),
        (GRPOTrainer, "_generate_and_score_completions", "scoring (advantages, metrics)"),
        (GRPOTrainer, "_get_per_token_logps_and_entropies", _logps_part),
        (GRPOTrainer, "_compute_loss", "loss math and metrics"),
        (accelerate.Accelerator, "backward", "backward"),
        (accelerate.Accelerator, "clip_grad_norm_", "clipping"),
        (accelerate.Accelerator, "free_memory", "free_memory (gc)"),
        (accelerate.optimizer.AcceleratedOptimizer, "step", "optimizer step"),
        (accelerate.optimizer.AcceleratedOptimizer, "zero_grad", "zero_grad"),
        (accelerate.scheduler.AcceleratedScheduler, "step", "scheduler step"),
        (transformers.Trainer, "training_step", "training_step (rest)"),
        (transformers.Trainer, "_maybe_log_save_evaluate", "TRL logging"),
        (transformers.trainer_callback.CallbackHandler, "call_event", "callbacks"),
        (torch.nn.Module, "train", _walk_part),
        (GRPOTrainer, "__init__", "trainer construction"),
        (transformers.Trainer, "train", "Trainer.train loop (rest)"),
        (TrialRunner, "train_chunk", "chunk set-up (rest)"),
        (gang._MemberGlobals, "capture", "switching"), (gang._MemberGlobals, "restore", "switching"),
        (models.ModelPool, "activate", "switching"),
        (gang.Gang, "train", "gang driver"),
        (gang.Gang, "_forward", "batched forward (gang)"), (gang.Gang, "_backward", "batched backward (gang)"),
        (unit, "evaluate_runners", "evaluation (rest)"),
        (Baselines, "_evaluate", "baseline evaluation"),
        (TrialRunner, "state", "checkpoint: state copy"),
        (CheckpointStore, "save_gang", "checkpoint: files"), (CheckpointStore, "save_staged", "checkpoint: files"),
        # the files staged while the unit was evaluated, as far as the unit still waits for them after it:
        (unit._Staging, "written", "checkpoint: files"),
        (unit, "commit", "commit (storage)"),
        (unit, "keep_if_best", "best adapter"),
        (unit, "finish", "final adapter"),
        (schema, "write_gang_plan", "gang plan"),
        (unit, "prepare", "load (prepare)"),
        (models, "load_model", "model loading"),
    ]


def profile_study(setup: throughput.Setup, out_dir: Path, gang_size: int,
                  training: str = "sequential") -> dict[str, Any]:
    """``optimize(configs, ..., gang_size=G, gang_training=training)`` with every part of `_targets` timed; seconds by
    part. On a CUDA device the decodes' edges wait for the device (`Profile.sync`)."""
    import greenlet
    import optuna
    import torch

    import rfopt

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput._settle()
    cuda = setup.device.startswith("cuda")
    profile = Profile(torch.cuda.synchronize if cuda else None)
    with contextlib.ExitStack() as stack:
        for owner, name, label in _targets():
            stack.enter_context(profile.wrapped(owner, name, label))
        previous = greenlet.settrace(profile.switched)
        stack.callback(greenlet.settrace, previous)
        started, cpu = time.perf_counter(), time.process_time()
        profile.start()
        study = rfopt.create_study(study_name="profile", storage=f"sqlite:///{out_dir / 'study.db'}",
                                   pruner=optuna.pruners.NopPruner(), checkpoint_dir=out_dir / "checkpoints")
        study.optimize(setup.configs, setup.train, setup.test, num_chunks=setup.plan.num_chunks,
                       eval_settings=setup.settings, show_progress_bar=False, device=setup.device,
                       precision=setup.precision, gang_size=gang_size, gang_training=training)
        if cuda:
            torch.cuda.synchronize()
        profile._charge(greenlet.getcurrent())
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    states = {t.number: t.state.name for t in study.optuna.trials}
    if any(state != "COMPLETE" for state in states.values()):
        raise RuntimeError(f"profiled study: trials did not all complete: {states}")
    member_steps = sum(s.num_units * s.steps_per_chunk for s in setup.schedules)
    units = sum(s.num_units for s in setup.schedules)
    return {"gang_size": gang_size, "training": training, "side": _side(gang_size, training), "wall_s": wall,
            "cpu_s": cpu, "member_steps": member_steps, "units": units,
            "seconds": dict(profile.seconds), "cpu_seconds": dict(profile.cpu), "calls": dict(profile.calls)}


def _side(gang_size: int, training: str) -> str:
    return f"G={gang_size}" + ("b" if training == "batched" and gang_size > 1 else "")


def print_table(runs: list[dict[str, Any]]) -> None:
    """Per part: wall and CPU seconds per member step (the step's parts) or per unit (the bookkeeping)."""
    heads = "".join(f"{r['side'] + ' wall':>11}{'cpu':>7}" for r in runs)

    def row(part: str, per: str) -> str:
        return f"{part:<40}" + "".join(f"{r['seconds'].get(part, 0.0) / r[per]:11.3f}"
                                        f"{r['cpu_seconds'].get(part, 0.0) / r[per]:7.3f}" for r in runs)

    print(f"\n{'per member step (s)':<40}{heads}")
    for part in STEP_PARTS:
        print(row(part, "member_steps"))
    total = [(sum(r[k].get(p, 0.0) for p in STEP_PARTS) / r["member_steps"]) for r in runs
             for k in ("seconds", "cpu_seconds")]
    print(f"{'member step, all parts':<40}" + "".join(f"{w:11.3f}{c:7.3f}" for w, c in zip(total[::2], total[1::2])))
    print(f"\n{'per unit (s)':<40}{heads}")
    for part in UNIT_PARTS:
        print(row(part, "units"))
    print(f"\n{'run (s)':<40}" + "".join(f"{r['side']:>10}" for r in runs))
    for key in ("wall_s", "cpu_s"):
        print(f"{key:<40}" + "".join(f"{r[key]:10.1f}" for r in runs))
    print(f"{'model loading':<40}" + "".join(f"{r['seconds'].get('model loading', 0.0):10.1f}" for r in runs))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gang.study_arguments(parser, chunks=2, gangs="1,4")  # bench/gang.py's options of a gang study
    parser.add_argument("--gang-training", default="sequential",
                        help="gang training modes, comma-separated (sequential, batched): each G > 1 runs in each; a "
                        "batched side is headed G=<g>b")
    args = gang.study_args(parser, argv, "step-profile")
    args.sides = [(g, mode) for g in args.gangs for mode in args.gang_training.split(",")
                  if g > 1 or mode == "sequential"]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="rfopt-step-profile-"))
    setup = throughput.build_setup(args, work)
    first = setup.configs[0].args
    print(f"rfopt step profile - model {args.model}, {args.configs} configs x {args.chunks} chunks x "
          f"{args.steps_per_chunk} steps, max_completion_length {first.max_completion_length}, {len(setup.test)} eval "
          f"prompts; gangs {args.gangs} ({args.gang_training}); {torch.get_num_threads()} threads; gradient_checkpointing "
          f"{first.gradient_checkpointing}, bf16 {first.bf16}; load average {os.getloadavg()[0]:.2f}", flush=True)
    record: dict[str, Any] = {"model": args.model, "configs": args.configs, "chunks": args.chunks,
                              "steps_per_chunk": args.steps_per_chunk, "eval_prompts": len(setup.test),
                              "max_completion_length": first.max_completion_length,
                              "gradient_checkpointing": bool(first.gradient_checkpointing), "bf16": bool(first.bf16),
                              "loadavg_start": os.getloadavg(), "runs": []}
    throughput.warm_up(setup, work / "warm")
    for g, mode in args.sides:
        load = os.getloadavg()
        run = profile_study(setup, work / f"G{g}-{mode}", g, mode)
        run["loadavg_before"], run["loadavg_after"] = load, os.getloadavg()
        record["runs"].append(run)
        print(f"  {run['side']}: {run['wall_s']:.1f} s wall, {run['cpu_s']:.1f} s CPU (load {load[0]:.2f} -> "
              f"{run['loadavg_after'][0]:.2f})", flush=True)
        gc.collect()
    print_table(record["runs"])
    record["loadavg_end"] = os.getloadavg()
    print(f"\nload average {record['loadavg_start'][0]:.2f} -> {record['loadavg_end'][0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"written: {args.out}")
    return record


if __name__ == "__main__":
    main()
