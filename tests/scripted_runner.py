"""A scripted runner: a trial "trained" in microseconds, with no model, for the tests of what the engine does around
training (the roster, the driver, units, ops, pruning, population-based training, refusals, crashes), as Optuna tests
its optimize loop with ``lambda _: 1.0``.

`ScriptedRunner` fits the seam a `TrialRunner` fills (`rfopt.engine.running.unit.Context.runner_class`) and goes through the
same unit pipeline: a gang (`rfopt.training.gang.Gang`, the real one) trains its chunks, the progress publisher hears
its steps, the checkpoint store saves and loads its state, and the engine commits its reports. What it does instead
of TRL:

- its state is one number, ``w`` (a float64 tensor: its "adapter"), and a step counter; a chunk adds
  ``learning_rate * 100 * (chunk + 1)`` to ``w`` (so a learning rate of 0 keeps whatever it started from), and a
  trial's value after a unit is ``w`` (or what `Scripted.values` says for it). A wrong resume, a unit trained twice or
  a lost warm start shows in the values, as it would in a real trial's;
- each step calls the trial's reward functions as TRL's trainer calls them (through rfopt's `rfopt.training.evaluation
  .scored`: the step's prompts, each `num_generations` times, the dataset's columns, ``trainer_state``) on scripted
  completions, and logs TRL's names of them (``reward``, ``reward_std``, ``rewards/<name>/mean`` and ``/std``), so a
  reward function that raises, returns the wrong thing or calls ``sys.exit`` fails its trial as in training; in a gang
  whose backend shares batches the completions come through the Gang's rollout hook and `ScriptedBackend`;
- its backends are `ScriptedBackend`s, built by its pool (`ScriptedPool.backend`, by kind, as `ModelPool.backend`
  builds the real ones): a `RolloutBackend` that answers every request with scripted completions, without a model.
  The batched kind refuses what the batched backend's config gate refuses (`BatchedBackend.config_refusal`);
- evaluation is rfopt's own: the unit evaluates the trial through its plan's backend with
  `rfopt.training.evaluation.evaluate_runners` (the eval prompts rendered and tokenized by `ScriptedTokenizer`, the
  requests built, each completion scored by the trial's reward functions: their means and spread, each sample's
  ``reward`` its weighted total, the diversity measures, the per-prompt scores stored for standard errors). One thing
  is scripted: the objective ``reward`` is the trial's value (`ScriptedMember`), and its per-prompt scores are shifted
  by the same amount, so that their mean is that value;
- the finished trial's "adapter" is ``w`` in ``adapter_model.safetensors``.

Use the `scripted` fixture (tests/conftest.py): every study the test runs in this process trains on it.

    >>> def test_pruned(scripted, tiny_model, storage):           # doctest: +SKIP
    ...     scripted.values = {1: [0.1, 0.0]}                     # trial 1 reports 0.1, then 0.0
    ...     rfopt.create_study(...).optimize(configs, TRAIN, EVAL, num_chunks=2)
"""

from __future__ import annotations

import functools
import json
import math
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.config.settings import EvalSettings
from rfopt.config.trial import TrialConfig
from rfopt.storage.state import TrialSnapshot
from rfopt.training.evaluation import EvalMember, EvalPrompts, EvalResult, is_conversational, scored
from rfopt.training.models import adapter_name
from rfopt.training.rollouts import BATCHED, KINDS, BatchedBackend, Completions, Decoded, GenerationRequest, Progress
from rfopt.training.runner import ChunkAborted, ChunkMetrics, Runner, StepDone

_NO_STATE = -1


@dataclass
class Scripted:
    """What the scripted runners of a test report."""

    values: dict[int, list[float]] = field(default_factory=dict)
    """A trial's value after each unit, by trial number (one value per unit); a trial not listed, or a unit past its
    list, reports its ``w``."""
    adapters_changed: list[list[str]] = field(default_factory=list)
    """What the rollout backends were told, call by call (`RolloutBackend.adapters_changed`)."""
    on_train_step: Callable[[int, int], None] | None = None
    """Called as each step of a scripted runner starts, in its gang member's turn (the trial, the step from 1): a test
    looks at what is published mid-step."""
    on_decode: Callable[[int], None] | None = None
    """Called at each token a scripted backend "decodes" (its number, from 1): a test looks at what is published
    mid-decode."""
    on_eval: Callable[[int, int], None] | None = None
    """Called after each eval prompt a scripted runner scores (the trial, the prompts done so far): a test looks at
    what is published mid-evaluation."""
    generated: list[tuple[str, list[GenerationRequest]]] = field(default_factory=list)
    """What the rollout backends were asked to generate, call by call: the backend's kind and the requests (a gang's
    rollouts, and every evaluation)."""

    def value(self, number: int, unit: int, w: float) -> float:
        listed = self.values.get(number, [])
        return float(listed[unit]) if unit < len(listed) else w

    def runner(self, *args: Any, **kwargs: Any) -> ScriptedRunner:
        """`rfopt.engine.running.unit.Context.runner_class`: a scripted runner reporting what this script says."""
        return ScriptedRunner(*args, script=self, **kwargs)


def completion_text(step: int, row: int) -> str:
    """The scripted completion of row `row` at optimizer step `step` (a trial alone's training rows); `ScriptedBackend`
    answers with the completion of its prompt's length as the step."""
    return "ab"[(step + row) % 2] * (1 + (step + row) % 8)


class ScriptedTokenizer:
    """One token per character (what a test's reward functions see comes back as it was); a conversational prompt is
    rendered as ``role: content`` lines, then ``assistant:``."""

    pad_token_id = 0
    eos_token_id = 1
    all_special_ids = [0, 1]

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 1)

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(text) for text in texts]}

    @staticmethod
    def apply_chat_template(messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str:
        lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return lines + "assistant:" if add_generation_prompt else lines

    def rendered(self, prompt: Any) -> str:
        """A prompt as generation starts from it (the chat template applied to a conversational one)."""
        return self.apply_chat_template(prompt) if is_conversational(prompt) else str(prompt)

    def save_pretrained(self, path: str) -> None:
        Path(path, "tokenizer.json").write_text("{}")


class _Model:
    """The finished trial's "adapter" is saved through it (`CheckpointStore.save_adapter`), as PEFT saves one."""

    def __init__(self, runner: ScriptedRunner) -> None:
        from transformers import GenerationConfig

        self.runner = runner
        self.generation_config = GenerationConfig()
        """The model's own generation config (a gang's rollouts and evaluation merge it as ``generate`` does): it sets
        nothing."""

    def save_pretrained(self, path: str, selected_adapters: list[str] | None = None) -> None:
        from safetensors.torch import save_file

        save_file({"w": self.runner.w.clone()}, str(Path(path, "adapter_model.safetensors")))
        Path(path, "adapter_config.json").write_text(json.dumps({"scripted": True}))


class ScriptedPool:
    """What the unit and a gang ask of a runner's pool: to make a member's adapter the active one before it runs, and
    a rollout backend of a kind (`rfopt.training.models.ModelPool.backend`)."""

    def __init__(self, script: Scripted) -> None:
        self.active: int | None = None
        self.script = script

    def activate(self, number: int, config: TrialConfig) -> None:
        self.active = number

    def backend(self, kind: str, trial_number: int | None, config: TrialConfig) -> ScriptedBackend:
        if kind not in KINDS:
            raise ValueError(f"trial {trial_number}: rollout backend {kind!r}: give one of {', '.join(KINDS)}")
        return ScriptedBackend(kind, script=self.script)


class _Trainer:
    """What a gang's rollout hook reads of a member's trainer: its prompts' token ids and its sampling settings."""

    def __init__(self, config: TrialConfig) -> None:
        from transformers import GenerationConfig

        args = config.args  # the settings GRPOTrainer builds its generation config from
        self.generation_config = GenerationConfig(
            max_new_tokens=args.max_completion_length, do_sample=True, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            **(args.generation_kwargs or {}))

    def _tokenize_prompts(self, prompts: list[Any]) -> tuple[list[list[int]], None, None]:
        tokenizer = ScriptedTokenizer()
        return [tokenizer.encode(tokenizer.rendered(p)) for p in prompts], None, None


class ScriptedBackend:
    """A rollout backend of kind `kind` (`rfopt.training.rollouts.KINDS`) that answers every request with scripted
    completions, without a model (each row: its prompt's length, read as a step of `completion_text`); what it was
    asked goes to `Scripted.generated`, what it was told to `Scripted.adapters_changed`."""

    def __init__(self, kind: str, script: Scripted | None = None) -> None:
        self.kind = kind
        self.shares_batches = kind == BATCHED
        self.script = script or Scripted()

    def refusal(self, config: Any) -> str | None:
        """The batched kind: what the batched backend's gate refuses of a config (`BatchedBackend.config_refusal`;
        there is no model to check); the exact kind: nothing."""
        return BatchedBackend.config_refusal(config) if self.shares_batches else None

    def adapters_changed(self, names: Any) -> None:
        self.script.adapters_changed.append(list(names))

    def generate(self, requests: list[GenerationRequest], should_stop: Callable[[], bool] | None = None,
                 progress: Progress | None = None) -> list[Completions]:
        """Scripted completions. A gang's rollouts: `progress` hears each token of the longest, then every row done (as
        a decoder tells it: `rfopt.training.rollouts.Decoded`), and `Scripted.on_decode` runs at each token. An
        evaluation (requests without a trainer's ``generation_config``): `progress` hears each request's prompts done,
        one prompt at a time, and `Scripted.on_eval` runs after each."""
        self.script.generated.append((self.kind, list(requests)))
        texts = [[completion_text(len(ids), row) for row, ids in enumerate(r.prompt_ids)] for r in requests]
        out = [Completions([ScriptedTokenizer.encode(text) for text in mine], [[0.0] * len(text) for text in mine])
               for mine in texts]
        rows = tuple(len(r.prompt_ids) for r in requests)
        if all("generation_config" not in (r.generate_kwargs or {}) for r in requests):  # an evaluation
            done = [0] * len(requests)
            for i, request in enumerate(requests):
                for prompt in range(rows[i]):
                    done[i] = prompt + 1
                    if progress is not None:
                        progress(Decoded(tuple(done), rows, 0, 8, 0.001))
                    if self.script.on_eval is not None:
                        self.script.on_eval(_trial_of(request.adapter), prompt + 1)
            return out
        most = max((len(ids) for c in out for ids in c.token_ids), default=0)
        for token in range(1, most + 1):
            if progress is not None:
                progress(Decoded(tuple(0 for _ in rows), rows, token, most, 0.001 * token))
            if self.script.on_decode is not None:
                self.script.on_decode(token)
        if progress is not None:
            progress(Decoded(rows, rows, 0, most, 0.001 * most))
        return out


def _trial_of(adapter: str | None) -> int | None:
    """The trial number an adapter is named after (`rfopt.training.models.adapter_name`); None for a model's own."""
    return None if adapter is None else int(adapter.rsplit("-", 1)[1])


@dataclass
class ScriptedMember(EvalMember):
    """An eval member scored as rfopt scores one (`EvalMember.score`: the trial's reward functions on its completions),
    except for its objective: ``reward`` is `value`, and the per-prompt scores behind it are shifted to that mean."""

    value: float = 0.0

    def score(self, prompts: EvalPrompts, completion_ids: list[list[int]], tokenizer: Any,
              settings: EvalSettings) -> EvalResult:
        result = super().score(prompts, completion_ids, tokenizer, settings)
        shift = self.value - result.metrics["reward"]
        result.metrics["reward"] = self.value
        if math.isfinite(shift):
            result.scores["reward"] = [score + shift for score in result.scores["reward"]]
        return result


class ScriptedRunner(Runner):
    """A `Runner` without a model (see the module docstring)."""

    def __init__(self, number: int, config: TrialConfig, plan: ChunkPlan, schedule: TrialSchedule, train_dataset: Any,
                 pool: Any, workdir: str | Path, start_unit: int = 0, tracking: Any = None, *,
                 script: Scripted | None = None) -> None:
        self.script = script or Scripted()
        self.number = number
        self.config = config
        self.plan = plan
        self.schedule = schedule
        self.train_dataset = train_dataset
        self.pool = ScriptedPool(self.script)
        self.workdir = Path(workdir)
        self.start_unit = start_unit
        self.tracking = tracking
        self.units_done = start_unit
        self.global_step = 0
        self.tokens_seen = 0
        self.w = torch.zeros(1, dtype=torch.float64)
        self.model = _Model(self)
        self.tokenizer = ScriptedTokenizer()

    # ------------------------------------------------------------------ recipe
    def setup(self) -> None:
        pass

    def cleanup(self) -> None:
        pass

    @property
    def total_steps(self) -> int:
        return (self.schedule.num_units - self.start_unit) * self.schedule.steps_per_chunk

    @property
    def finished(self) -> bool:
        return self.units_done >= self.schedule.num_units

    def chunk_args(self, report: bool = True) -> Any:
        """What a gang reads of a chunk's GRPOConfig: the settings a trainer applies to the shared model."""
        return types.SimpleNamespace(disable_dropout=False, gradient_checkpointing=False)

    def rollout_backend(self, kind: str) -> ScriptedBackend:
        return self.pool.backend(kind, self.number, self.config)

    def trainer_state(self) -> Any:
        from transformers import TrainerState

        return TrainerState(global_step=self.global_step, max_steps=self.total_steps,
                            num_train_epochs=self.schedule.num_epochs, epoch=self.units_done / self.schedule.num_chunks)

    def train_chunk(self, should_stop: Callable[[], bool] | None = None,
                    rollout_func: Callable[[list[Any], Any], dict[str, Any]] | None = None,
                    on_step: Callable[[StepDone], None] | None = None, in_gang: bool = False,
                    on_trainer: Callable[[Any], None] | None = None) -> ChunkMetrics:
        if self.units_done == _NO_STATE:
            raise RuntimeError(f"trial {self.number}: a chunk was stopped midway; load a checkpoint before training")
        if self.finished:
            raise RuntimeError(f"trial {self.number}: all {self.schedule.num_units} chunks are already trained")
        if self.pool.active != self.number:
            raise RuntimeError(f"trial {self.number}: its gang did not make its adapter the active one")
        started = time.perf_counter()
        unit = self.units_done
        steps = self.schedule.steps_per_chunk
        if self.tracking is not None:
            on_step = self.tracking.step_listener(self.number, on_step)
        if on_step is not None:
            on_step(StepDone(step=0, steps=steps, global_step=self.global_step, seconds=0.0, logs={}))
        chunk = self.plan.chunks[self.schedule.chunk_of_unit(unit)][: self.schedule.prompts_per_chunk]
        per_step = max(1, len(chunk) // steps)
        lr = float(self.config.args.learning_rate)
        logs = []
        for step in range(steps):
            rows = chunk[step * per_step:(step + 1) * per_step]
            if self.script.on_train_step is not None:
                self.script.on_train_step(self.number, step + 1)
            scores = self._step_rewards(rows, rollout_func)
            self.global_step += 1
            self.tokens_seen += 8 * len(rows)
            log = {"loss": 0.0, "grad_norm": 0.0, "learning_rate": lr, "step": float(self.global_step)} | scores
            logs.append(log)
            if on_step is not None:
                on_step(StepDone(step=step + 1, steps=steps, global_step=self.global_step,
                                 seconds=time.perf_counter() - started, logs=dict(log)))
            if step + 1 < steps and should_stop is not None and should_stop():
                self.units_done = _NO_STATE
                raise ChunkAborted(f"trial {self.number}: chunk {unit + 1} stopped at step {self.global_step}")
        self.w += lr * 100 * (self.schedule.chunk_of_unit(unit) + 1)
        self.units_done = unit + 1
        return ChunkMetrics.of(logs, seconds=time.perf_counter() - started, swap_seconds=0.0)

    def _step_rewards(self, rows: list[int], rollout_func: Any) -> dict[str, float]:
        """The reward functions called on one step's scripted completions, as TRL's trainer calls them, under TRL's
        names."""
        data = self.train_dataset.select(rows)
        g = self.config.args.num_generations
        prompts = [p for p in data["prompt"] for _ in range(g)]
        columns = {name: [v for v in data[name] for _ in range(g)] for name in data.column_names if name != "prompt"}
        if rollout_func is not None:  # through the gang's backend
            ids = rollout_func(prompts, _Trainer(self.config))["completion_ids"]
        else:
            ids = [self.tokenizer.encode(completion_text(self.global_step, row)) for row in range(len(prompts))]
        texts = [self.tokenizer.rendered(p) for p in prompts]
        result = scored(EvalPrompts(prompts, texts, columns), ids, self.tokenizer, self.config.reward_funcs,
                        self.config.args.reward_weights, EvalSettings(num_samples=0), self.trainer_state())
        return {k: v for k, v in result.metrics.items() if k in ("reward", "reward_std") or k.startswith("rewards/")}

    # ------------------------------------------------------------------ evaluation
    def eval_member(self) -> ScriptedMember:
        """What rfopt's evaluation needs of the trial, and its scripted value (`Scripted.value`)."""
        args = self.config.args
        adapter = adapter_name(self.number) if self.config.peft_config is not None else None
        return ScriptedMember(adapter, list(self.config.reward_funcs), args.reward_weights,
                              args.max_completion_length, self.trainer_state(),
                              dict(args.chat_template_kwargs or {}),
                              value=self.script.value(self.number, self.units_done - 1, float(self.w.item())))

    # ------------------------------------------------------------------ state
    def trainable_weights(self) -> dict[str, Any]:
        return {"w": self.w.clone()}

    def state(self) -> TrialSnapshot:
        return TrialSnapshot(units_done=self.units_done, global_step=self.global_step, tokens_seen=self.tokens_seen,
                             weights=self.trainable_weights(), optimizer=None, scheduler=None, rng=None)

    def load_weights(self, weights: dict[str, Any]) -> None:
        if set(weights) != {"w"}:
            raise ValueError(f"trial {self.number}: weights do not fit its adapter ({sorted(weights)[:3]} ...)")
        self.w = weights["w"].clone().to(torch.float64)

    def load_state(self, state: TrialSnapshot) -> None:
        self.load_weights(state.weights)
        self.units_done = state.units_done
        self.global_step = state.global_step
        self.tokens_seen = state.tokens_seen


def use(monkeypatch: Any, script: Scripted | None = None) -> Scripted:
    """Make every study this process runs (through `rfopt.engine.running.run`: `optimize`, `work`, ``rfopt run``/``worker``
    in-process) train on scripted runners reporting to `script`; undone with `monkeypatch`."""
    from rfopt.engine.running import run, unit

    script = script or Scripted()
    monkeypatch.setattr(run, "Context", functools.partial(unit.Context, runner_class=script.runner))
    return script
