"""Gangs: one to several trials of one device trained in lockstep, their rollouts through one rollout backend
(`rfopt.training.rollouts`).

Every unit of training is a gang's: a trial alone is a gang of one on the exact backend (its trainer generates as
plain TRL does), several trials of one base model a gang on the batched backend. Each member keeps its own
`GRPOTrainer`, optimizer, LR scheduler, random state and adapter (its `TrialRunner`), exactly as when it trains alone.
The members' chunks run as greenlets (coroutines with their own stack) in the caller's thread, one member at a time,
in a fixed order: a member runs until its trainer asks for rollouts (TRL's ``rollout_func`` hook, given only when
the backend `shares_batches`) or its chunk ends, and then the next member runs. When every member still training
waits for rollouts, the backend decodes all their requests in one batch, and the members run again in order.
So a gang is deterministic, and its generation costs about one batched decode per step instead of one per member.
On the exact backend the members train one after another, each as it would alone.
Greenlets and not threads, because torch's CPU kernels pay ~75 us more per small operation in a second thread that
uses OpenMP (libgomp stops spin-waiting once a process has more OpenMP threads than cores; measured: a 4x576 by
576x16 linear, 5 us in the main thread, 79 us in another, 2 intra-op threads), and a member's step and a decode are
each ~100,000 small operations (BENCHMARKS.md, "Gangs").

What a member's code changes in process-wide state stays its own: at each switch the gang swaps the random
states (Python, NumPy, torch: each member draws from its own stream), accelerate's gradient state, the shared model's
instance ``forward`` (each trainer wraps it with its own fused LM head), torch's grad mode and the active adapter.
Settings that a trainer applies to the whole model (dropout, gradient checkpointing) must be the same for every
member (`gang_key`), and the model is put back once, when the gang is done.

What a gang does within a step is told to its ``on_activity`` hook (`rfopt.storage.schema.Activity`, for people: the
progress records, the page, ``rfopt status``, the bar): its rollouts decoded so far (``decoding``: tokens of the most
new tokens, tokens per second), whose turn it is (``member`` k of n: its reward functions, its loss, its optimizer
step), and in the batched mode its one batched forward or backward (``batched``). A trial alone says nothing finer
than its steps (it generates inside TRL's own ``generate``).

A member that raises (a reward function, a sampling error of its own) leaves the gang alone; the others go on.
`Gang.abort` (Ctrl-C, a lost lease) stops every member at its next optimizer step or decoded token.
`Gang.decode_seconds` is the time its members waited for the backend.

How the members' training steps run is the gang's ``training`` mode (`GANG_TRAINING`):

- ``"sequential"``: each member runs its own forwards and backward, one member after another, exactly as it would
  alone (bit for bit).
- ``"batched"`` (the default): two more sync points, like the rollout one. A member's backbone calls (the loss forward with grad; the
  old-policy and the adapter-disabled reference forwards without) wait for the others' calls of the same kind, and the
  gang runs them as one forward of the shared base, each row through its own member's adapter
  (`rfopt.training.batched_step`); each member's own fused LM head (its temperature), loss and metrics follow on its
  rows. Its ``accelerator.backward(loss)`` waits too, and the gang differentiates the sum of the waiting members' losses
  once: their adapters are disjoint, so each gets exactly its own gradient. Clipping, the optimizer and the schedule
  stay each member's own: while a member runs only its own adapter holds gradients (the others' are kept aside), so
  ``max_grad_norm`` clips over its own parameters. Results differ from the sequential mode only by floating-point
  rounding (the matrix shapes change), and a gang in this mode is deterministic for the same members. A member the
  batched forward cannot serve (`batched_step.member_refusal`: DoRA, ``modules_to_save``, ...) runs its own forwards
  inside the gang, said once. A batched step holds every member's activations at once: the memory plan counts them
  (`rfopt.training.memory.GangMemory.need`), and a gang that fits only taking its steps one after another is planned
  sequential (`rfopt.engine.plan`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rfopt import compat
from rfopt.storage.schema import Activity
from rfopt.storage.state import RngState

from .batched_step import BatchedBackbone, ForwardRequest, adapter_parameters, member_refusal, unservable
from .models import adapter_name
from .rollouts import DecodeAborted, Decoded, GenerationRequest, RolloutBackend, request_sampling, seed_from_stream
from .rollouts.bank import lora_layers
from .runner import ChunkMetrics, Runner, StepDone

logger = logging.getLogger(__name__)

DEFAULT_GANG_SIZE = 4
"""``gang_size`` when a run gives none (`Study.optimize`, ``rfopt run``, a study file): chosen from the benchmarks
(BENCHMARKS.md, "Gangs"). Memory planning trains fewer at once where the device is short (`rfopt.training.memory.gang_memory`);
``gang_size=1`` trains one trial at a time, bit for bit as plain TRL."""

GANG_TRAINING = ("batched", "sequential")
"""How a gang's members run their training steps (see the module docstring): each its own, or one batched forward and
backward for all."""

DEFAULT_GANG_TRAINING = "batched"
"""``gang_training`` when a run gives none: one batched step for the gang (on the CPU each prompt computed once: SmolLM2,
G=4, the members' training 0.74x of sequential and the whole study 0.90x, for 1.26x the memory; BENCHMARKS.md). A gang
that fits in memory only taking its steps one after another trains so, said once; ``"sequential"`` keeps each trial's
numbers bit for bit as alone (README, "Gangs"). Not yet measured on a GPU (``bench/gpu.py`` measures both)."""

_ORDER = ("rollout", "forward", "forward+grad", "backward")
"""What the gang serves first when members wait on different things: a step's earlier phase, so that a member behind
the others catches up and joins their batch."""

TOKENS_SECONDS = 0.2
"""A decode's tokens so far are told to ``on_activity`` at most this often (a token takes milliseconds)."""

_SAID: set[str] = set()


@dataclass
class GangMember:
    """One trial of a gang: its runner, what stops its chunk early, and what its chunk came to."""

    runner: Runner
    should_stop: Callable[[], bool] | None = None
    on_step: Callable[[StepDone], None] | None = None
    """Told of the member's steps (`TrialRunner.train_chunk`'s `on_step`: its progress record)."""
    result: ChunkMetrics | None = None
    error: BaseException | None = None

    @property
    def number(self) -> int:
        return self.runner.number


@dataclass
class _Turn:
    """Everything the gang keeps of one member while it trains, one object per member: where its code stands (its
    greenlet, the process-wide state it sees, what it waits on, ``(kind, request)`` of `_ORDER`, and the answer to it,
    whether its chunk ended) and, in the batched mode, its part in the batched step (whether the batched forward can
    serve it and whether its trainer is routed through it, its adapter's parameters and their kept-aside gradients,
    and whether it waits inside PEFT's ``disable_adapter``)."""

    greenlet: Any
    globals: _MemberGlobals
    waiting: tuple[str, Any] | None = None
    answer: Any = None
    done: bool = False
    servable: bool = False
    """The batched forward can serve its adapter (`batched_step.member_refusal` has no reason)."""
    batched: bool = False
    """Its trainer is built and routed: its backbone calls and its backward go through the gang's batched step."""
    params: list[Any] | None = None
    """Its adapter's parameters (a servable member's); their gradients are on them only while it runs or in a batched
    backward, and kept aside in `grads` otherwise."""
    grads: list[Any] = field(default_factory=list)
    adapters_disabled: bool = False
    """Whether the shared model's adapters were disabled where it waits (TRL's reference forward); put back when it
    runs again."""


@dataclass
class _MemberGlobals:
    """The process-wide state one member's code sees while it runs: captured when it waits for a rollout, restored
    when it resumes."""

    rng: RngState
    gradient: dict[str, Any]
    forward: dict[Any, Any]
    grad_enabled: bool = True
    """torch's grad mode: per thread, so shared by the members, which all run in the caller's thread."""

    @classmethod
    def capture(cls, model: Any) -> _MemberGlobals:
        import torch

        return cls(RngState.capture(), compat.gradient_state(), compat.forward_patches(model), torch.is_grad_enabled())

    def restore(self) -> None:
        import torch

        self.rng.restore()
        compat.set_gradient_state(self.gradient)
        compat.set_forward_patches(self.forward)
        torch.set_grad_enabled(self.grad_enabled)


class Gang:
    """Trains one chunk of each member in lockstep (see the module docstring).

    >>> gang = Gang(backend, [GangMember(runner_3), GangMember(runner_5)])   # doctest: +SKIP
    >>> gang.train()                          # each member's `result` (ChunkMetrics) or `error` is set
    """

    def __init__(self, backend: RolloutBackend, members: list[GangMember],
                 training: str = DEFAULT_GANG_TRAINING, on_activity: Callable[[Activity], None] | None = None) -> None:
        if not members:
            raise ValueError("a gang needs at least one member")
        if training not in GANG_TRAINING:
            raise ValueError(f"gang training {training!r}: choose one of {', '.join(GANG_TRAINING)}")
        self.backend = backend
        self.members = members
        self.training = training
        self.on_activity = on_activity if len(members) > 1 else None
        """Told what the gang does within a step (see the module docstring); a trial alone: nothing."""
        self.model = members[0].runner.model  # the shared model (a trial alone: its own)
        self._turns: list[_Turn] = []
        self._caller: Any = None
        self._aborted = threading.Event()
        self.decodes = 0
        """Batched decodes this gang ran (one per generation cycle of its members)."""
        self.decode_seconds = 0.0
        self.forwards = 0
        """Batched training forwards this gang ran (``training="batched"``)."""
        self.backwards = 0
        self._current: int | None = None
        self._raised: dict[Any, bool] = {}
        """The batched step's parameters whose ``requires_grad`` it raised, with what it was."""
        self._step: BatchedBackbone | None = None
        self._lora: Any = None
        self._activity = Activity("member")
        """What it told `on_activity` last."""
        self._said_at = -float("inf")

    # ------------------------------------------------------------------ the run
    def train(self) -> None:
        """Train each member's next chunk; returns when every member has its `result` or `error`."""
        import greenlet

        model = self.model
        members = self.members
        for member in members:
            member.result = member.error = None
        args = members[0].runner.chunk_args(report=False)
        outside = _MemberGlobals.capture(model)
        self._caller = greenlet.getcurrent()
        self._turns = [_Turn(greenlet.greenlet(functools.partial(self._body, i)),
                             _MemberGlobals(outside.rng, dict(outside.gradient), dict(outside.forward),
                                            outside.grad_enabled))
                       for i in range(len(members))]
        batched = self.training == "batched" and len(members) > 1 and self.backend.shares_batches
        with compat.restore_shared_model(model, args), self._batching(batched), _heap_frozen():
            try:
                self._drive()
            except BaseException:  # Ctrl-C: every member stops at its next step (a waiting one hears `DecodeAborted`)
                self.abort()
                self._drive()
                raise
            finally:
                outside.restore()

    @contextlib.contextmanager
    def _batching(self, on: bool) -> Any:
        """The batched mode's set-up: the backbone routed through the gang, the members it can serve, their
        parameters (whose gradients are kept aside while another member runs); all undone on exit."""
        self._raised = {}
        if not on:
            yield
            return
        model = self.model
        for member, turn in zip(self.members, self._turns):
            adapter = adapter_name(member.number)
            refusal = member_refusal(model, adapter, member.runner.config.peft_config)
            turn.servable = refusal is None
            if refusal is not None and refusal not in _SAID:
                _SAID.add(refusal)
                logger.warning("trial %d trains its own steps beside its gang's batched step: %s", member.number,
                               refusal)
        servable = [(member, turn) for member, turn in zip(self.members, self._turns) if turn.servable]
        if not servable:
            yield
            return
        for member, turn in servable:  # the others take their steps whole while they run, as in the sequential mode
            turn.params = adapter_parameters(model, adapter_name(member.number))
            turn.grads = [p.grad for p in turn.params]
            for p in turn.params:
                p.grad = None
        self._lora = next((layer for _, layer in lora_layers(model)), None)
        try:
            with compat.intercept_backbone(model, self._backbone_call) as backbone:
                self._step = BatchedBackbone(backbone)
                yield
        finally:
            for _, turn in servable:
                for p, grad in zip(turn.params or (), turn.grads):
                    p.grad = grad
            self._lower_grads()
            self._set_adapters_disabled(False)
            self._step = None

    def abort(self) -> None:
        """Stop every member at its next optimizer step (or the backend at its next token)."""
        self._aborted.set()

    def _drive(self) -> None:
        """Rounds until every member is done: each member able to run runs, in order, until it waits on the gang (for
        rollouts; in the batched mode also for a forward or its backward) or its chunk ends; then the gang serves every
        member waiting on the first thing in `_ORDER` that any waits on, in one batch."""
        turns = self._turns
        while not all(turn.done for turn in turns):
            for i, turn in enumerate(turns):
                if not turn.done and turn.waiting is None:  # to start, or answered: it goes on
                    self._run(i)
            waiting = [turn.waiting for turn in turns if turn.waiting is not None]
            if not waiting:  # every member ran until it was done
                continue
            kind = min((k for k, _ in waiting), key=_ORDER.index)
            batch = [j for j, turn in enumerate(turns) if turn.waiting is not None and turn.waiting[0] == kind]
            requests = [turns[j].waiting[1] for j in batch]
            for j in batch:
                turns[j].waiting = None
            started = time.perf_counter()
            if kind == "rollout":
                self._tell("decoding", 0)  # its total, the most new tokens, comes with the first token
            else:
                self._tell("batched", len(batch))
            try:
                if self._aborted.is_set():
                    raise DecodeAborted("the gang was stopped")
                if kind == "rollout":
                    outs: list[Any] = self.backend.generate(requests, should_stop=self._aborted.is_set,
                                                            progress=self._decoded if self.on_activity else None)
                    self.decodes += 1
                elif kind == "backward":
                    outs = self._backward(batch, requests)
                else:
                    outs = self._forward(batch, requests)
            except BaseException as exc:  # noqa: BLE001 - stopped, or the engine failed: every waiting member hears
                heard = exc if isinstance(exc, Exception) else DecodeAborted("interrupted")
                for j in batch:
                    turns[j].answer = heard
                if not isinstance(exc, Exception):  # Ctrl-C: the members stop, and it goes on up
                    raise
                continue
            finally:
                if kind == "rollout":
                    self.decode_seconds += time.perf_counter() - started
            for j, out in zip(batch, outs):
                turns[j].answer = out

    def _run(self, i: int) -> None:
        """Member `i` runs, with its own process-wide state, until it asks for rollouts or its chunk ends."""
        member = self.members[i]
        turn = self._turns[i]
        turn.globals.restore()
        member.runner.pool.activate(member.number, member.runner.config)
        self._tell("member", len(self.members), done=i + 1, trial=member.number)
        self._swap_grads(i, True)
        self._set_adapters_disabled(turn.adapters_disabled)
        turn.adapters_disabled = False
        self._current = i
        try:
            turn.greenlet.switch()
        finally:
            self._current = None
            self._swap_grads(i, False)
        if turn.greenlet.dead:
            turn.done = True
            if isinstance(member.error, KeyboardInterrupt):  # Ctrl-C while this member ran: it stopped, not failed
                member.error = DecodeAborted("interrupted")
                if not self._aborted.is_set():
                    raise KeyboardInterrupt

    def _tell(self, what: str, total: int, done: int = 0, trial: int | None = None) -> None:
        """What the gang does now, to `on_activity` (a display's failure is not the gang's)."""
        if self.on_activity is None:
            return
        self._activity = Activity(what, done=done, total=total, trial=trial, since=time.time())
        self._say(self._activity)

    def _decoded(self, decoded: Decoded) -> None:
        """The backend's progress while it decodes the members' rollouts: tokens so far of the most new tokens, at
        most every `TOKENS_SECONDS` (a batch of rows done, between two batches, is not news here)."""
        now = time.perf_counter()
        if decoded.tokens and (decoded.tokens == 1 or now - self._said_at >= TOKENS_SECONDS):
            self._said_at = now
            self._activity = replace(self._activity, done=decoded.tokens, total=decoded.max_tokens, rate=decoded.rate)
            self._say(self._activity)

    def _say(self, activity: Activity) -> None:
        try:
            self.on_activity(activity)
        except Exception as exc:  # noqa: BLE001 - progress is for people: the gang goes on
            logger.debug("a gang's progress hook failed: %s", exc)

    # ------------------------------------------------------------------ one member's code
    def _body(self, i: int) -> None:
        member = self.members[i]
        rollouts = (lambda prompts, trainer: self._rollout(i, prompts, trainer)) if self.backend.shares_batches else None
        try:
            member.result = member.runner.train_chunk(
                should_stop=lambda: self._aborted.is_set() or bool(member.should_stop and member.should_stop()),
                rollout_func=rollouts,
                on_step=functools.partial(self._stepped, member),
                in_gang=True,
                **({"on_trainer": functools.partial(self._route, i)} if self._step is not None else {}),
            )
        except BaseException as exc:  # noqa: BLE001 - the member's own failure; the gang goes on
            member.error = exc

    def _stepped(self, member: GangMember, done: StepDone) -> None:
        """A member's step hook: after each optimizer step its adapter changed, and the backend hears of it (one that
        holds its own copy of the weights reloads it); then the member's own listener."""
        if done.step > 0:
            self.backend.adapters_changed([adapter_name(member.number)])
        if member.on_step is not None:
            member.on_step(done)

    def _rollout(self, i: int, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func`` for member `i`: queue its request, let the others run, and take the completions."""
        if self._aborted.is_set():
            raise DecodeAborted("the gang was stopped")
        config = trainer.generation_config  # merged with the model's own, as TRL's generate call merges it
        request = GenerationRequest(
            adapter=adapter_name(self.members[i].number),
            prompt_ids=compat.tokenized_prompts(trainer, prompts),
            sampling=request_sampling(self.model.generation_config, config),
            seed=seed_from_stream(),  # from this member's own stream: its draws do not depend on the others
            generate_kwargs={"generation_config": config},
        )
        out = self._wait(i, "rollout", request)
        return {"prompt_ids": request.prompt_ids, "completion_ids": out.token_ids, "logprobs": out.logprobs}

    def _wait(self, i: int, kind: str, request: Any) -> Any:
        """Member `i` waits on the gang for `kind` (`_ORDER`): back to `_drive`, which resumes it with the answer."""
        if self._aborted.is_set():
            raise DecodeAborted("the gang was stopped")
        turn = self._turns[i]
        turn.waiting = (kind, request)
        turn.globals = _MemberGlobals.capture(self.model)
        if self._step is not None:  # it may wait inside TRL's `use_adapter(model, None)`: the reference forward
            turn.adapters_disabled = self._adapters_disabled()
        self._caller.switch()
        out, turn.answer = turn.answer, None
        if isinstance(out, BaseException):
            raise out
        return out

    # ------------------------------------------------------------------ the batched step (training="batched")
    def _route(self, i: int, trainer: Any) -> None:
        """Member `i`'s trainer is built: in the batched mode its backward goes through the gang, and then its
        forwards join the batch (a member whose backward cannot be routed keeps both its own)."""
        turn = self._turns[i]
        if turn.servable and compat.route_backward(trainer, lambda loss: self._wait(i, "backward", loss)):
            turn.batched = True

    def _backbone_call(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of the shared backbone (`compat.intercept_backbone`): a batched member's waits for the batch."""
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPast

        i = self._current
        if i is None or not self._turns[i].batched:
            return original(*args, **kwargs)
        reason = unservable(args, kwargs)
        if reason is not None:  # its own forward, as in the sequential mode: said once per reason
            if reason not in _SAID:
                _SAID.add(reason)
                logger.warning("trial %d runs its own forward beside its gang's batched step: its model calls the "
                               "backbone with %s, which the batched forward does not serve", self.members[i].number,
                               reason)
            return original(*args, **kwargs)
        disabled = self._adapters_disabled()  # the reference forward: the base model alone
        request = ForwardRequest(None if disabled else adapter_name(self.members[i].number), kwargs["input_ids"],
                                 kwargs.get("attention_mask"), torch.is_grad_enabled())
        hidden = self._wait(i, "forward+grad" if request.grad else "forward", request)
        return BaseModelOutputWithPast(last_hidden_state=hidden)

    def _adapters_disabled(self) -> bool:
        return self._lora is not None and bool(self._lora.disable_adapters)

    def _set_adapters_disabled(self, disabled: bool) -> None:
        """Disable or enable the shared model's adapter layers as the member about to run left them (PEFT's
        ``disable_adapter`` is a context a batched member can wait inside; the others must not run in it)."""
        if self._step is None or self._adapters_disabled() == disabled:
            return
        if disabled:
            self.model.base_model.disable_adapter_layers()
        else:
            self.model.base_model.enable_adapter_layers()

    def _forward(self, batch: list[int], requests: list[ForwardRequest]) -> list[Any]:
        import torch

        assert self._step is not None
        grad = requests[0].grad
        if grad:
            self._raise_grads(batch)
        with torch.set_grad_enabled(grad):
            outs = self._step.forward(requests)
        self.forwards += 1
        return outs

    def _backward(self, batch: list[int], losses: list[Any]) -> list[None]:
        """One backward of the waiting members' losses, into each member's kept-aside gradients."""
        import torch

        self._raise_grads(batch)  # a member's `pool.activate` made only its own adapter trainable meanwhile
        for i in range(len(self._turns)):
            self._swap_grads(i, True)
        try:
            live = [loss for loss in losses if loss.requires_grad]
            if live:
                torch.autograd.backward(live)
        finally:
            for i in range(len(self._turns)):
                self._swap_grads(i, False)
            self._lower_grads()
        self.backwards += 1
        return [None] * len(batch)

    def _swap_grads(self, i: int, install: bool) -> None:
        """Put member `i`'s kept-aside gradients on its parameters (`install`), or take them off again."""
        turn = self._turns[i]
        if turn.params is None:
            return
        if install:
            for p, grad in zip(turn.params, turn.grads):
                p.grad = grad
        else:
            turn.grads = [p.grad for p in turn.params]
            for p in turn.params:
                p.grad = None

    def _raise_grads(self, members: list[int]) -> None:
        """Make `members`' adapters trainable for a batched forward and its backward (PEFT makes only the active one
        so); `_lower_grads` puts back what they were."""
        for i in members:
            for p in self._turns[i].params or ():
                self._raised.setdefault(p, p.requires_grad)
                p.requires_grad_(True)

    def _lower_grads(self) -> None:
        for p, flag in self._raised.items():
            p.requires_grad_(flag)
        self._raised = {}


@contextlib.contextmanager
def _heap_frozen() -> Any:
    """While a gang trains, the objects alive when it started (the resident model's modules and parameters, its
    adapters, the datasets, the tokenizer: some 650,000 objects with SmolLM2 and four adapters) are kept out of the
    cyclic garbage collector's walks (``gc.freeze``): every member's ``Trainer.train`` starts with a full collection
    (accelerate's ``free_memory``), 0.34 s of CPU each with SmolLM2 resident (BENCHMARKS.md, "Where a member's step
    goes"), and the automatic collections walk them too. Garbage made while the gang trains is collected as before,
    and what was frozen is handed back (``gc.unfreeze``) when it ends; no number changes. A process that froze
    objects itself keeps its own freeze: nothing is done then."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class GangKey:
    """What members of one gang must share: the base model, and the settings a trainer applies to the whole model."""

    model_key: str
    disable_dropout: bool
    gradient_checkpointing: bool
    cast_lm_head_to_fp32: bool
    extra: tuple[Any, ...] = field(default=())


def gang_key(config: Any) -> GangKey:
    args = config.args
    return GangKey(
        model_key=config.model_key,
        disable_dropout=bool(args.disable_dropout),
        gradient_checkpointing=bool(args.gradient_checkpointing),
        cast_lm_head_to_fp32=bool(getattr(args, "cast_lm_head_to_fp32", False)),
        extra=(repr(args.gradient_checkpointing_kwargs),),
    )
