"""`TrialRunner`: trains one trial chunk by chunk with TRL's `GRPOTrainer`, exactly.

A runner is a training unit in the torchtune sense (`setup`, `train_chunk`, `eval_member`,
`state`/`load_state`, `cleanup`). Each chunk builds a new `GRPOTrainer` on the trial's model (its
adapter on the shared base), trains the chunk, and hands the state on to the next chunk:

- the optimizer and LR scheduler are made once per trial over its TOTAL steps (the first chunk's
  trainer creates them as TRL would; later chunks pass them back in);
- the step counter and token count are carried into the trainer before training starts;
- the RNG state is saved at the chunk's last step and restored at the next chunk's first step
  (the trainer's constructor and dataloader draw random numbers before that);
- every chunk ends on a generation-cycle boundary (see chunks.py), so no buffered generation is
  lost;
- the data is the study's chunk, in order (``shuffle_dataset=False``: the plan already shuffled);
- the trial's own callbacks (`TrialConfig.callbacks`) are given to every chunk's trainer, after rfopt's: a chunk is
  one ``trainer.train()`` call, so their ``on_train_begin``/``on_train_end`` fire once per chunk.

So a trial trained in chunks, with other trials swapped in between, ends with the same weights as
the trial trained straight through (bit-identical on the CPU). With ``beta > 0`` the reference
model is the base model with adapters disabled, which is what a fresh LoRA starts from.

Constructing a trainer patches the shared model (a fused LM head wrapped around `forward`, dropout
disabled, gradient checkpointing and its input hook); `compat.restore_shared_model` puts each back
after the chunk so that trials sharing the model never see each other's settings. Where the chunk
trains and in what precision comes from the pool's device (`ModelPool.placement`), not from the
trial's config.

A chunk can be stopped between two optimizer steps (`train_chunk`'s `should_stop`: a worker that
lost its lease); the runner's state is then no longer any unit's, and it raises `ChunkAborted`.
When the chunk's first step starts and after each optimizer step, `train_chunk`'s `on_step` hears of it (`StepDone`:
the step, TRL's logs of it): that is how a chunk's progress is published while it trains (`rfopt.training.progress`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rfopt import compat
from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.config.rewardfuncs import checked_reward
from rfopt.config.settings import EvalSettings
from rfopt.config.trial import TrialConfig
from rfopt.errors import RfoptError, TrialDiverged
from rfopt.storage.state import RngState, TrialSnapshot

from .evaluation import EvalMember, EvalResult, evaluate_runners
from .models import ModelPool, adapter_name
from .rollouts import EXACT, RolloutBackend
from .trackers import Tracking

_NO_STATE = -1
"""`TrialRunner.units_done` after a chunk stopped midway: the weights and optimizer are no unit's."""


class ChunkAborted(RfoptError, RuntimeError):
    """A chunk was stopped before its end (its `should_stop` said so); the runner holds no unit's state now."""


@dataclass
class ChunkMetrics:
    """Training metrics of one chunk, averaged over its steps from TRL's logs (plus the last loss), and TRL's logs of
    each optimizer step as they were."""

    values: dict[str, float]
    seconds: float
    swap_seconds: float
    """From the call to `train_chunk` to the chunk's first step: activating the trial's adapter, building its
    trainer and restoring its state (what time-slicing costs over training straight through)."""
    steps: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """TRL's logged metrics of each optimizer step of the chunk, by TRL's names, with ``step``: the trainer's global
    step (continuing across chunks). Finite numbers only."""

    @classmethod
    def of(cls, logs: list[dict[str, float]], seconds: float, swap_seconds: float) -> ChunkMetrics:
        """A chunk's metrics from TRL's logs of its optimizer steps (each with ``step``): each metric's mean over the
        steps (``loss_last``: the last step's loss; ``learning_rate``: the last step's), and the steps' logs."""
        return cls(values=_aggregate(logs), seconds=seconds, swap_seconds=swap_seconds,
                   steps=[{k: v for k, v in log.items() if k != "epoch" and math.isfinite(v)} for log in logs])


@dataclass(frozen=True)
class StepDone:
    """One optimizer step of a chunk ended (what `train_chunk`'s `on_step` hears)."""

    step: int
    """Optimizer steps of the chunk done, this one included (1 to `steps`); 0 when the chunk's first step starts."""
    steps: int
    """Optimizer steps in the chunk."""
    global_step: int
    """The trainer's global step after this one (continuing across chunks)."""
    seconds: float
    """Seconds since the chunk's first step began."""
    logs: dict[str, float]
    """TRL's logged metrics of this step, by TRL's names, with ``step`` (the global step)."""


def _boundary_callback(stop_at: int, steps: int, restore: RngState | None, new_epoch: bool,
                       should_stop: Callable[[], bool] | None, on_step: Callable[[StepDone], None] | None = None):
    from transformers import TrainerCallback

    class ChunkBoundary(TrainerCallback):
        """Restores the trial's RNG at the chunk's first step; stops and saves it at the chunk's last; stops early
        when `should_stop` says so; tells `on_step` of each step and its logs."""

        def __init__(self) -> None:
            self.rng_at_end: RngState | None = None
            self.first_step_at: float | None = None
            self.logs: list[dict[str, float]] = []
            self.aborted = False
            self._first = True

        def on_step_begin(self, args, state, control, **kwargs):
            if self._first:
                self._first = False
                self.first_step_at = time.perf_counter()
                if restore is not None:
                    restore.restore()
                    if new_epoch:
                        _draw_like_a_new_epoch()
                if on_step is not None:  # the trial is swapped in; its first step (generation first) starts
                    on_step(StepDone(step=0, steps=steps, global_step=state.global_step, seconds=0.0, logs={}))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= stop_at:
                control.should_training_stop = True
                self.rng_at_end = RngState.capture()
            elif should_stop is not None and should_stop():
                control.should_training_stop = True
                self.aborted = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and "train_runtime" not in logs:
                # TRL's logs carry no step (the Trainer adds it to log_history only); `_aggregate` skips it.
                self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
                                 | {"step": float(state.global_step)})
                if on_step is not None:  # logging_steps=1: one log per optimizer step, after the step ends
                    done = state.global_step - (stop_at - steps)
                    logged = {k: v for k, v in self.logs[-1].items() if k != "epoch" and math.isfinite(v)}
                    on_step(StepDone(step=done, steps=steps, global_step=state.global_step,
                                     seconds=time.perf_counter() - (self.first_step_at or time.perf_counter()),
                                     logs=logged))

    return ChunkBoundary()


def _draw_like_a_new_epoch() -> None:
    """Straight through, a new epoch's dataloader iterator draws one int64 from torch's generator (its base seed)
    between the last step of an epoch and the first of the next; a chunk that starts an epoch does the same."""
    import torch

    torch.empty((), dtype=torch.int64).random_()


@runtime_checkable
class Runner(Protocol):
    """What the engine (`rfopt.engine.running.unit`, `rfopt.engine.running.roster`, `rfopt.engine.outputs.best`), a
    gang (`rfopt.training.gang.Gang`) and evaluation (`rfopt.training.evaluation.evaluate_runners`) use of a trial's
    runner: the seam `rfopt.engine.running.unit.Context.runner_class` fills. A runner trains; it does not evaluate
    itself: the unit evaluates its members through the plan's backend with rfopt's evaluation, from each one's
    `eval_member`.

    `TrialRunner` (TRL on one device), `rfopt.training.parallel.DataParallelRunner` (over several) and the tests'
    ``ScriptedRunner`` (no model: tests/scripted_runner.py) declare it; tests/training/test_runner_protocol.py checks
    that each defines every member with this signature. Anything the engine or a gang starts to call on a runner is
    added here first."""

    number: int
    """The trial's number."""
    config: TrialConfig
    """The trial's configuration (its adapter's ``peft_config``, its ``args``)."""
    pool: Any
    """The `ModelPool` its model comes from (a gang activates each member's adapter through it; `rollout_backend`
    asks it for a backend)."""
    units_done: int
    """Chunk units the runner's state holds (``-1`` after a chunk stopped midway: no unit's)."""
    global_step: int
    """Optimizer steps its state holds."""

    model: Any
    """The trial's model (a gang's shared model with the trial's adapter; a property of `TrialRunner`)."""
    tokenizer: Any
    """The tokenizer its model is trained and saved with."""

    def setup(self) -> None:
        """The trial's model in the pool (its adapter on the shared base, made at the first call)."""
        ...

    def cleanup(self) -> None:
        """Release the trial's model and optimizer."""
        ...

    def chunk_args(self, report: bool = True) -> Any:
        """The trial's ``GRPOConfig`` as a chunk trains it."""
        ...

    def train_chunk(self, should_stop: Callable[[], bool] | None = None,
                    rollout_func: Callable[[list[Any], Any], dict[str, Any]] | None = None,
                    on_step: Callable[[StepDone], None] | None = None, in_gang: bool = False,
                    on_trainer: Callable[[Any], None] | None = None) -> ChunkMetrics:
        """Train the trial's next chunk unit (`TrialRunner.train_chunk`)."""
        ...

    def rollout_backend(self, kind: str) -> RolloutBackend:
        """The rollout backend of kind `kind` the trial would generate through (the unit asks for its plan's kind, the
        planner's gate for the batched kind): its pool's (`ModelPool.backend`)."""
        ...

    def eval_member(self) -> EvalMember:
        """What evaluating the trial needs besides the eval set and the backend (its adapter, reward functions,
        completion budget, trainer state): the unit evaluates its members with it through the plan's backend
        (`rfopt.training.evaluation.evaluate_runners`)."""
        ...

    def trainable_weights(self) -> dict[str, Any]:
        """The trial's trained weights."""
        ...

    def state(self) -> TrialSnapshot:
        """Its state as a checkpoint stores it."""
        ...

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Set its trained weights from another trial's `trainable_weights()` (a warm start)."""
        ...

    def load_state(self, state: TrialSnapshot) -> None:
        """Continue from a checkpoint's state."""
        ...


class TrialRunner(Runner):
    """Trains one trial, one chunk at a time, on a model from a `ModelPool` (the `Runner` the engine uses)."""

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
        tracking: Tracking | None = None,
    ) -> None:
        """`start_unit` > 0 starts a warm-started clone at its parent's progress: it trains the remaining units
        with a fresh optimizer and LR schedule over the remaining steps. `tracking`: where the trial's steps are logged
        (`rfopt.training.trackers`); none by default."""
        self.number = number
        self.config = config
        self.plan = plan
        self.schedule = schedule
        self.train_dataset = train_dataset
        self.pool = pool
        self.workdir = Path(workdir)
        self.start_unit = start_unit
        self.tracking = tracking
        self.units_done = start_unit
        self.global_step = 0
        self.tokens_seen = 0
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._rng: RngState | None = None
        self._model: Any = None

    # ------------------------------------------------------------------ recipe
    def setup(self) -> None:
        """The trial's model in the pool: its adapter on the shared base model (made at the first call)."""
        if self._model is None:
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

    def train_chunk(self, should_stop: Callable[[], bool] | None = None,
                    rollout_func: Callable[[list[Any], Any], dict[str, Any]] | None = None,
                    on_step: Callable[[StepDone], None] | None = None, in_gang: bool = False,
                    on_trainer: Callable[[Any], None] | None = None) -> ChunkMetrics:
        """Train the trial's next chunk unit; raises on a reward function error or a diverged loss.

        `should_stop` is asked after every optimizer step: when it says True, the chunk stops there and
        `ChunkAborted` is raised (the runner's state is then no unit's: load a checkpoint before training again).
        `on_step` is called when the first step starts (step 0) and after every optimizer step with the step and
        TRL's logs of it (`StepDone`); it must not touch training state (the progress publisher writes one record,
        `rfopt.training.progress`).
        `rollout_func`: a gang member's on the batched backend (`rfopt.training.gang`): its trainer generates through the
        gang's rollout backend (TRL's ``rollout_func`` hook). `in_gang`: the gang, not the chunk, puts the shared model
        back when every member is done. `on_trainer`: told of the chunk's trainer before it trains (a gang that batches
        its members' steps routes the trainer's backward through itself).
        """
        if self.units_done == _NO_STATE:
            raise RuntimeError(f"trial {self.number}: a chunk was stopped midway; load a checkpoint before training")
        if self.finished:
            raise RuntimeError(f"trial {self.number}: all {self.schedule.num_units} chunks are already trained")
        started = time.perf_counter()
        unit = self.units_done
        stop_at = self.global_step + self.schedule.steps_per_chunk
        model = self.model
        # The first chunk keeps the RNG the trainer's constructor seeded; later ones continue the trial's own.
        new_epoch = self._rng is not None and self.schedule.chunk_of_unit(unit) == 0
        args = self.chunk_args()
        if self.tracking is not None:  # each step's TRL logs in the trial's runs (`rfopt.training.trackers`)
            on_step = self.tracking.step_listener(self.number, on_step)
        boundary = _boundary_callback(stop_at, self.schedule.steps_per_chunk, self._rng, new_epoch, should_stop,
                                      on_step)
        restored = contextlib.nullcontext() if in_gang else compat.restore_shared_model(model, args)
        with restored, warnings.catch_warnings():
            # TRL calls its rollout hook experimental; rfopt's gangs are the ones who use it, knowingly.
            warnings.filterwarnings("ignore", message="You are using 'rollout_func'", category=UserWarning)
            trainer = compat.chunk_trainer_class()(
                model=model,
                reward_funcs=self.reward_funcs,
                args=args,
                train_dataset=self.chunk_dataset(unit),
                processing_class=self.tokenizer,
                callbacks=[boundary, *self.config.callbacks],
                optimizers=(self._optimizer, self._scheduler),
                start_step=self.global_step,
                tokens_seen=self.tokens_seen,
                beta=self.config.args.beta,
                first_chunk=unit == self.start_unit,
                **({} if rollout_func is None else {"rollout_func": rollout_func}),
            )
            _quiet(trainer)
            if on_trainer is not None:
                on_trainer(trainer)
            trainer.train()
        if boundary.aborted:
            self.units_done = _NO_STATE
            raise ChunkAborted(f"trial {self.number}: chunk {unit + 1} stopped at step {trainer.state.global_step}")
        if trainer.state.global_step != stop_at or boundary.rng_at_end is None:
            raise RuntimeError(
                f"trial {self.number}: chunk {unit + 1} stopped at step {trainer.state.global_step}, expected {stop_at}"
            )
        optimizer = trainer.optimizer
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self._scheduler = trainer.lr_scheduler
        self._rng = boundary.rng_at_end
        self.tokens_seen = int(trainer.state.num_input_tokens_seen)
        self.global_step = stop_at
        self.units_done = unit + 1
        chunk = ChunkMetrics.of(boundary.logs, seconds=time.perf_counter() - started,
                                swap_seconds=(boundary.first_step_at or started) - started)
        for key in ("loss", "grad_norm"):
            if key in chunk.values and not math.isfinite(chunk.values[key]):
                raise TrialDiverged(f"trial {self.number}: {key} is {chunk.values[key]} in chunk {unit + 1}")
        return chunk

    @property
    def reward_funcs(self) -> list[Any]:
        """The trial's reward functions as the trainer gets them: what they return is checked, and a failure names
        the function (`checked_reward`)."""
        return [checked_reward(func) for func in self.config.reward_funcs]

    def evaluate(self, eval_dataset: Any, settings: EvalSettings) -> EvalResult:
        """The trial's evaluation alone, on the exact backend (``model.generate``): what a gang's evaluation is compared
        with. The engine evaluates a unit's members through its plan's backend (`evaluate_runners`)."""
        (result,) = evaluate_runners(self.rollout_backend(EXACT), [self], eval_dataset, settings)
        if isinstance(result, Exception):
            raise result
        return result

    def eval_member(self) -> EvalMember:
        """What evaluating the trial needs (`rfopt.training.evaluation.evaluate_runners`)."""
        return EvalMember(adapter_name(self.number) if self.config.peft_config is not None else None,
                          list(self.config.reward_funcs), self.config.args.reward_weights,
                          self.config.args.max_completion_length, self.trainer_state(),
                          dict(self.config.args.chat_template_kwargs or {}))

    def rollout_backend(self, kind: str) -> RolloutBackend:
        """The rollout backend of kind `kind` the trial would generate through (`ModelPool.backend`): `EXACT`, the
        exact backend on its model; `BATCHED`, its base model's batched backend (whose `refusal` says whether it
        may)."""
        return self.pool.backend(kind, self.number, self.config)

    def trainer_state(self) -> Any:
        """What a reward function reading ``trainer_state`` gets from TRL at the trial's current step."""
        from transformers import TrainerState

        return TrainerState(global_step=self.global_step, max_steps=self.total_steps,
                            num_train_epochs=self.schedule.num_epochs, epoch=self.units_done / self.schedule.num_chunks)

    def cleanup(self) -> None:
        self.pool.release(self.number, self.config)
        self._model = None
        self._optimizer = self._scheduler = None

    # ------------------------------------------------------------------ state
    def trainable_weights(self) -> dict[str, Any]:
        """The trial's trained weights: its adapter (PEFT) or the whole model (full fine-tuning)."""
        model = self.model
        if self.config.peft_config is not None:
            from peft import get_peft_model_state_dict

            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name(self.number)).items()}
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state(self) -> TrialSnapshot:
        return TrialSnapshot(
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
        if self.config.peft_config is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name(self.number))
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
            if missing:
                raise ValueError(f"trial {self.number}: weights do not fit its adapter ({missing[:3]} ...)")
        else:
            model.load_state_dict(weights)

    def load_state(self, state: TrialSnapshot) -> None:
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
        args = self.chunk_args(report=False)  # a trainer that never trains reports nothing
        with compat.restore_shared_model(self.model, args):
            trainer = compat.chunk_trainer_class()(
                model=self.model,
                reward_funcs=self.reward_funcs,
                args=args,
                train_dataset=self.chunk_dataset(0),
                processing_class=self.tokenizer,
                start_step=0,
                tokens_seen=0,
                beta=self.config.args.beta,
                first_chunk=False,
            )
            optimizer = trainer.create_optimizer()
            scheduler = trainer.create_scheduler(self.total_steps, optimizer)
        return optimizer, scheduler

    def chunk_args(self, report: bool = True) -> Any:
        """The trial's GRPOConfig as a chunk trains it: rfopt's plumbing, and placement from the pool's device. The
        model is the pool's, loaded with ``model_init_kwargs`` already (TRL would warn that they are ignored)."""
        return dataclasses.replace(
            self.config.args,
            **self.pool.placement.args(),
            output_dir=str(self.workdir / f"trial-{self.number}"),
            max_steps=self.total_steps,
            shuffle_dataset=False,
            save_strategy="no",
            **(self._tracker_args() if report else {"report_to": []}),
            logging_steps=1,
            disable_tqdm=True,
            eval_strategy="no",
            beta=0.0,
            generation_batch_size=None,
            model_init_kwargs=None,
        )

    def _tracker_args(self) -> dict[str, Any]:
        """``report_to`` and the run's name for the trackers passed on to TRL's integrations; rfopt logs to the others
        itself (`rfopt.training.trackers`)."""
        if self.tracking is None:
            return {"report_to": []}
        return self.tracking.trainer_args(self.number)


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
