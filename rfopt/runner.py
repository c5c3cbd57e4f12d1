"""`TrialRunner`: trains one trial chunk by chunk with TRL's `GRPOTrainer`, exactly.

A runner is a training unit in the torchtune sense (`setup`, `train_chunk`, `evaluate`,
`state`/`load_state`, `cleanup`). Each chunk builds a new `GRPOTrainer` on the trial's model (its
adapter on the shared base), trains the chunk, and hands the state on to the next chunk:

- the optimizer and LR scheduler are made once per trial over its TOTAL steps (the first chunk's
  trainer creates them as TRL would; later chunks pass them back in);
- the step counter and token count are carried into the trainer before training starts;
- the RNG state is saved at the chunk's last step and restored at the next chunk's first step
  (the trainer's constructor and dataloader draw random numbers before that);
- every chunk ends on a generation-cycle boundary (see chunks.py), so no buffered generation is
  lost;
- the data is the study's chunk, in order (``shuffle_dataset=False``: the plan already shuffled).

So a trial trained in chunks, with other trials swapped in between, ends with the same weights as
the trial trained straight through (bit-identical on the CPU). With ``beta > 0`` the reference
model is the base model with adapters disabled, which is what a fresh LoRA starts from.

Constructing a trainer patches the shared model (a fused LM head wrapped around `forward`, dropout
disabled, gradient checkpointing and its input hook); `_undo_trainer_patches` puts each back after
the chunk so that trials sharing the model never see each other's settings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chunks import ChunkPlan, TrialSchedule
from .config import TrialConfig
from .evaluation import EvalResult, EvalSettings, evaluate
from .models import ModelPool, adapter_name


class TrialDiverged(RuntimeError):
    """Training produced a NaN or infinite loss or gradient."""


@dataclass
class RngState:
    python: Any
    numpy: Any
    torch: Any
    cuda: list[Any] = field(default_factory=list)

    @classmethod
    def capture(cls) -> RngState:
        import numpy as np
        import torch

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(), cuda=cuda)

    def restore(self) -> None:
        import numpy as np
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class ChunkMetrics:
    """Training metrics of one chunk, averaged over its steps from TRL's logs (plus the last loss)."""

    values: dict[str, float]
    seconds: float
    swap_seconds: float
    """From the call to `train_chunk` to the chunk's first step: activating the trial's adapter, building its
    trainer and restoring its state (what time-slicing costs over training straight through)."""


@dataclass
class TrialState:
    """Everything a trial needs to continue exactly (what a checkpoint holds)."""

    units_done: int
    global_step: int
    tokens_seen: int
    weights: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: RngState | None


def _trainer_class():
    from trl import GRPOTrainer

    class ChunkTrainer(GRPOTrainer):
        """GRPOTrainer that starts its state at a carried step count instead of zero."""

        def __init__(
            self, *args: Any, start_step: int, tokens_seen: int, beta: float, first_chunk: bool = True, **kwargs: Any
        ) -> None:
            self._rfopt_start = (start_step, tokens_seen)
            self._rfopt_first_chunk = first_chunk
            with _seeding_skipped(not first_chunk):
                super().__init__(*args, **kwargs)
            # Constructed with beta=0 so that TRL builds no reference copy; the reference is the base model with
            # the adapter disabled (TRL's own choice for a PEFT model without a "ref" adapter).
            self.beta = beta

        def _send_telemetry(self) -> None:
            # TRL pings its usage telemetry from every trainer it builds; a trial is one training run, not one per chunk.
            if self._rfopt_first_chunk:
                super()._send_telemetry()

        def _move_model_to_device(self, model: Any, device: Any) -> None:
            # The model is the pool's, already on its device; moving it again walks every tensor on every chunk.
            if self._rfopt_first_chunk:
                super()._move_model_to_device(model, device)

        def _prepare_for_training(self, *args: Any, **kwargs: Any):
            # After a trial's first chunk its model and optimizer state are on the device already (a checkpoint's
            # optimizer state is loaded onto its parameters' device). With device placement on, accelerate's prepare
            # walks every parameter looking for DTensors and round-trips the optimizer's state through
            # state_dict()/load_state_dict() to "move" it, on every chunk.
            placement = self.accelerator.device_placement
            if not self._rfopt_first_chunk:
                self.accelerator.device_placement = False
            try:
                return super()._prepare_for_training(*args, **kwargs)
            finally:
                self.accelerator.device_placement = placement

        def _init_training_state(self, *args: Any, **kwargs: Any):
            out = super()._init_training_state(*args, **kwargs)
            self.state.global_step, self.state.num_input_tokens_seen = self._rfopt_start
            return out

    return ChunkTrainer


@contextmanager
def _seeding_skipped(skip: bool):
    """Construct a trainer without its three global ``set_seed(args.seed)`` calls (transformers' ``Trainer`` and TRL's
    ``GRPOTrainer`` constructors), when `skip`.

    A trial's later chunks restore its own RNG state at their first step (`_boundary_callback`), so what the
    constructor seeds is overwritten before anything uses it; each ``set_seed`` seeds torch, numpy, Python and every
    accelerator backend (about 1 ms on a CPU build, whose CUDA seeding records a stack trace each time). A trial's
    first chunk keeps them: training straight through starts from that seeding.
    """
    import transformers.trainer
    import trl.trainer.grpo_trainer as grpo_trainer

    if not skip:
        yield
        return
    originals = transformers.trainer.set_seed, grpo_trainer.set_seed

    def unseeded(*args: Any, **kwargs: Any) -> None:
        return None

    transformers.trainer.set_seed = grpo_trainer.set_seed = unseeded
    try:
        yield
    finally:
        transformers.trainer.set_seed, grpo_trainer.set_seed = originals


_CHUNK_TRAINER = None


def chunk_trainer_class():
    global _CHUNK_TRAINER
    if _CHUNK_TRAINER is None:
        _CHUNK_TRAINER = _trainer_class()
    return _CHUNK_TRAINER


def _boundary_callback(stop_at: int, restore: RngState | None, new_epoch: bool):
    from transformers import TrainerCallback

    class ChunkBoundary(TrainerCallback):
        """Restores the trial's RNG at the chunk's first step; stops and saves it at the chunk's last."""

        def __init__(self) -> None:
            self.rng_at_end: RngState | None = None
            self.first_step_at: float | None = None
            self.logs: list[dict[str, float]] = []
            self._first = True

        def on_step_begin(self, args, state, control, **kwargs):
            if self._first:
                self._first = False
                self.first_step_at = time.perf_counter()
                if restore is not None:
                    restore.restore()
                    if new_epoch:
                        _draw_like_a_new_epoch()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= stop_at:
                control.should_training_stop = True
                self.rng_at_end = RngState.capture()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and "train_runtime" not in logs:
                self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    return ChunkBoundary()


def _draw_like_a_new_epoch() -> None:
    """Straight through, a new epoch's dataloader iterator draws one int64 from torch's generator (its base seed)
    between the last step of an epoch and the first of the next; a chunk that starts an epoch does the same."""
    import torch

    torch.empty((), dtype=torch.int64).random_()


@functools.cache
def _peft_installed() -> bool:
    """accelerate's ``is_peft_available()`` (it reads peft's package metadata from disk on every call), asked once per
    process: packages are not installed or removed under a running study."""
    from accelerate.utils import modeling

    return bool(modeling.is_peft_available())


@contextmanager
def _answer_model_checks_once(answers: dict[Any, Any], enabled: bool = True):
    """While a chunk's trainer is built and run, answer library checks that walk the whole model from `answers`.

    Each ``Trainer.train`` call asks, of a model that rfopt has not changed since the last chunk:
    accelerate's ``is_peft_model`` (about ten times; each reads peft's package metadata and walks every submodule
    in ``has_compiled_regions``), ``Accelerator.verify_device_map`` (a walk of every module looking for a multi-device
    ``hf_device_map``) and transformers' ``get_model_param_count`` (a walk of every parameter, for one log line).
    On SmolLM2 with LoRA these walks were a third of a swap. `answers` is the pool's record for this model
    (`ModelPool.answers`), kept across chunks and cleared when an adapter is added or removed; the parameter count
    is kept per active adapter (it counts the trainable parameters). With ``torch_compile`` nothing is answered.
    """
    import accelerate
    import transformers.trainer
    from accelerate.utils import modeling, other

    if not enabled:
        yield
        return
    originals = (
        other.has_compiled_regions,
        modeling.is_peft_available,
        accelerate.Accelerator.verify_device_map,
        transformers.trainer.get_model_param_count,
    )
    peft_available = _peft_installed()

    def remembered(key: tuple[Any, ...], of: Any, compute: Any) -> Any:
        # Held weakly: `answers` lives as long as the model it is about, and an id can be reused by another object.
        seen = answers.get(key)
        if seen is None or seen[0]() is not of:
            seen = answers[key] = (weakref.ref(of), compute())
        return seen[1]

    def has_compiled_regions(module: Any) -> bool:
        return remembered(("compiled", id(module)), module, lambda: originals[0](module))

    def verify_device_map(accelerator: Any, model: Any) -> bool:
        return remembered(("device_map", id(model)), model, lambda: originals[2](accelerator, model))

    def get_model_param_count(model: Any, trainable_only: bool = False) -> int:
        key = ("params", id(model), trainable_only, str(getattr(model, "active_adapter", None)))
        return remembered(key, model, lambda: originals[3](model, trainable_only=trainable_only))

    other.has_compiled_regions, modeling.is_peft_available = has_compiled_regions, lambda: peft_available
    accelerate.Accelerator.verify_device_map = verify_device_map
    transformers.trainer.get_model_param_count = get_model_param_count
    try:
        yield
    finally:
        other.has_compiled_regions, modeling.is_peft_available = originals[:2]
        accelerate.Accelerator.verify_device_map = originals[2]
        transformers.trainer.get_model_param_count = originals[3]


@contextmanager
def _undo_trainer_patches(model: Any, args: Any):
    """Put back what constructing and running a GRPOTrainer with `args` changes on a (shared) model.

    TRL zeroes dropout only with ``args.disable_dropout`` and turns gradient checkpointing on only with
    ``args.gradient_checkpointing``; each check walks every module of the model, so it is made only when the trainer
    will change that setting.
    """
    import torch.nn as nn

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    patched = {m: m.__dict__.get("forward") for m in (model, base)}
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, nn.Dropout)] if args.disable_dropout else []
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; after __post_init__ they mirror.
    checkpoints = bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", False))
    checkpointing = checkpoints and getattr(base, "is_gradient_checkpointing", False)
    try:
        yield
    finally:
        for module, forward in patched.items():
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        for module, p in dropouts:
            module.p = p
        if getattr(base, "_require_grads_hook", None) is not None:
            base.disable_input_require_grads()
        if checkpoints and not checkpointing and getattr(base, "is_gradient_checkpointing", False):
            base.gradient_checkpointing_disable()


class TrialRunner:
    """Trains one trial, one chunk at a time, on a model from a `ModelPool`."""

    def __init__(
        self,
        number: int,
        config: TrialConfig,
        plan: ChunkPlan,
        schedule: TrialSchedule,
        train_dataset: Any,
        pool: ModelPool,
        workdir: str | Path,
        start_unit: int = 0,
    ) -> None:
        """`start_unit` > 0 starts a warm-started clone at its parent's progress: it trains the remaining units
        with a fresh optimizer and LR schedule over the remaining steps."""
        self.number = number
        self.config = config
        self.plan = plan
        self.schedule = schedule
        self.train_dataset = train_dataset
        self.pool = pool
        self.workdir = Path(workdir)
        self.start_unit = start_unit
        self.units_done = start_unit
        self.global_step = 0
        self.tokens_seen = 0
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._rng: RngState | None = None
        self._model: Any = None

    # ------------------------------------------------------------------ recipe
    def setup(self) -> None:
        self._model = self.pool.acquire(self.number, self.config)

    @property
    def model(self) -> Any:
        if self._model is None:
            self.setup()
        else:
            self.pool.activate(self.number, self.config)
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self.pool.tokenizer(self.config)

    @property
    def total_steps(self) -> int:
        """Optimizer steps this runner trains in all (the LR schedule's length)."""
        return (self.schedule.num_units - self.start_unit) * self.schedule.steps_per_chunk

    @property
    def finished(self) -> bool:
        return self.units_done >= self.schedule.num_units

    def chunk_dataset(self, unit: int) -> Any:
        rows = self.plan.chunks[self.schedule.chunk_of_unit(unit)][: self.schedule.prompts_per_chunk]
        return _rows_of(self.train_dataset, rows)

    def train_chunk(self) -> ChunkMetrics:
        """Train the trial's next chunk unit; raises on a reward function error or a diverged loss."""
        if self.finished:
            raise RuntimeError(f"trial {self.number}: all {self.schedule.num_units} chunks are already trained")
        started = time.perf_counter()
        unit = self.units_done
        stop_at = self.global_step + self.schedule.steps_per_chunk
        model = self.model
        # The first chunk keeps the RNG the trainer's constructor seeded; later ones continue the trial's own.
        new_epoch = self._rng is not None and self.schedule.chunk_of_unit(unit) == 0
        boundary = _boundary_callback(stop_at, self._rng, new_epoch)
        args = self._chunk_args()
        checks = _answer_model_checks_once(self.pool.answers(model), enabled=not args.torch_compile)
        with _undo_trainer_patches(model, args), checks:
            trainer = chunk_trainer_class()(
                model=model,
                reward_funcs=list(self.config.rewards),
                args=args,
                train_dataset=self.chunk_dataset(unit),
                processing_class=self.tokenizer,
                callbacks=[boundary],
                optimizers=(self._optimizer, self._scheduler),
                start_step=self.global_step,
                tokens_seen=self.tokens_seen,
                beta=self.config.grpo.beta,
                first_chunk=unit == self.start_unit,
            )
            _quiet(trainer)
            trainer._total_train_tokens = self.tokens_seen
            trainer.train()
        if trainer.state.global_step != stop_at or boundary.rng_at_end is None:
            raise RuntimeError(
                f"trial {self.number}: chunk {unit} stopped at step {trainer.state.global_step}, expected {stop_at}"
            )
        optimizer = trainer.optimizer
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self._scheduler = trainer.lr_scheduler
        self._rng = boundary.rng_at_end
        self.tokens_seen = int(trainer._total_train_tokens)
        self.global_step = stop_at
        self.units_done = unit + 1
        values = _aggregate(boundary.logs)
        for key in ("loss", "grad_norm"):
            if key in values and not math.isfinite(values[key]):
                raise TrialDiverged(f"trial {self.number}: {key} is {values[key]} in chunk {unit}")
        return ChunkMetrics(
            values=values,
            seconds=time.perf_counter() - started,
            swap_seconds=(boundary.first_step_at or started) - started,
        )

    def evaluate(self, eval_dataset: Any, settings: EvalSettings) -> EvalResult:
        return evaluate(
            self.model,
            self.tokenizer,
            eval_dataset,
            list(self.config.rewards),
            self.config.reward_weights or self.config.grpo.reward_weights,
            settings,
            max_new_tokens=self.config.grpo.max_completion_length,
        )

    def cleanup(self) -> None:
        self.pool.release(self.number, self.config)
        self._model = None
        self._optimizer = self._scheduler = None

    # ------------------------------------------------------------------ state
    def trainable_weights(self) -> dict[str, Any]:
        """The trial's trained weights: its adapter (PEFT) or the whole model (full fine-tuning)."""
        model = self.model
        if self.config.peft is not None:
            from peft import get_peft_model_state_dict

            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name(self.number)).items()}
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state(self) -> TrialState:
        return TrialState(
            units_done=self.units_done,
            global_step=self.global_step,
            tokens_seen=self.tokens_seen,
            weights=self.trainable_weights(),
            optimizer=None if self._optimizer is None else self._optimizer.state_dict(),
            scheduler=None if self._scheduler is None else self._scheduler.state_dict(),
            rng=self._rng,
        )

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Set the trial's trained weights (its adapter, or the whole model) from `trainable_weights()` of a trial
        of the same shape."""
        model = self.model
        if self.config.peft is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name(self.number))
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
            if missing:
                raise ValueError(f"trial {self.number}: weights do not fit its adapter ({missing[:3]} ...)")
        else:
            model.load_state_dict(weights)

    def load_state(self, state: TrialState) -> None:
        """Continue from `state` (a checkpoint): weights, optimizer, scheduler, RNG and counters."""
        self.load_weights(state.weights)
        if state.optimizer is not None:
            self._optimizer, self._scheduler = self._fresh_optimizer()
            self._optimizer.load_state_dict(state.optimizer)
            self._scheduler.load_state_dict(state.scheduler)
        self._rng = state.rng
        self.units_done = state.units_done
        self.global_step = state.global_step
        self.tokens_seen = state.tokens_seen

    def _fresh_optimizer(self) -> tuple[Any, Any]:
        """An optimizer and LR scheduler over the trial's total steps, made by TRL's trainer as it would make them."""
        args = self._chunk_args()
        with _undo_trainer_patches(self.model, args):
            trainer = chunk_trainer_class()(
                model=self.model,
                reward_funcs=list(self.config.rewards),
                args=args,
                train_dataset=self.chunk_dataset(0),
                processing_class=self.tokenizer,
                start_step=0,
                tokens_seen=0,
                beta=self.config.grpo.beta,
                first_chunk=False,
            )
            optimizer = trainer.create_optimizer()
            scheduler = trainer.create_scheduler(self.total_steps, optimizer)
        return optimizer, scheduler

    def _chunk_args(self) -> Any:
        grpo = self.config.resolved_grpo()
        return dataclasses.replace(
            grpo,
            output_dir=str(self.workdir / f"trial-{self.number}"),
            max_steps=self.total_steps,
            shuffle_dataset=False,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
            eval_strategy="no",
            beta=0.0,
            generation_batch_size=None,
        )


_SELECTED: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def _rows_of(dataset: Any, rows: list[int]) -> Any:
    """``dataset.select(rows)``, made once per dataset and rows: a study's trials train the same chunks of the same
    dataset, and each select builds an indices table and hashes a fingerprint (some 3 ms, a tiny model's step)."""
    selected = _SELECTED.setdefault(dataset, {})
    key = tuple(rows)
    if key not in selected:
        selected[key] = dataset.select(rows)
    return selected[key]


def _quiet(trainer: Any) -> None:
    """rfopt shows its own progress; the trainer's per-step printing would drown it."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def _aggregate(logs: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each logged metric over a chunk's steps; `loss_last` keeps the final step's loss."""
    skip = {"epoch", "step", "learning_rate"}
    keys = {k for log in logs for k in log if k not in skip}
    values = {}
    for key in sorted(keys):
        seen = [log[key] for log in logs if key in log]
        values[key] = sum(seen) / len(seen)
    if logs:
        if "learning_rate" in logs[-1]:
            values["learning_rate"] = logs[-1]["learning_rate"]
        if "loss" in logs[-1]:
            values["loss_last"] = logs[-1]["loss"]
    return values
