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

A member that raises (a reward function, a sampling error of its own) leaves the gang alone; the others go on.
`Gang.abort` (Ctrl-C, a lost lease) stops every member at its next optimizer step or decoded token.
`Gang.decode_seconds` is the time its members waited for the backend.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rfopt import compat
from rfopt.storage.state import RngState

from .models import adapter_name
from .rollouts import Aborted, GenerationRequest, RolloutBackend, Sampling, seed_from_stream
from .runner import ChunkMetrics, StepDone, TrialRunner

DEFAULT_GANG_SIZE = 4
"""``gang_size`` when a run gives none (`Study.optimize`, ``rfopt run``, a study file): chosen from the benchmarks
(BENCHMARKS.md, "Gangs"). Memory planning trains fewer at once where the device is short (`rfopt.training.memory.gang_memory`);
``gang_size=1`` trains one trial at a time, bit for bit as plain TRL."""


@dataclass
class GangMember:
    """One trial of a gang: its runner, what stops its chunk early, and what its chunk came to."""

    runner: TrialRunner
    should_stop: Callable[[], bool] | None = None
    on_step: Callable[[StepDone], None] | None = None
    """Told of the member's steps (`TrialRunner.train_chunk`'s `on_step`: its progress record)."""
    result: ChunkMetrics | None = None
    error: BaseException | None = None

    @property
    def number(self) -> int:
        return self.runner.number


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

    def __init__(self, backend: RolloutBackend, members: list[GangMember]) -> None:
        if not members:
            raise ValueError("a gang needs at least one member")
        self.backend = backend
        self.members = members
        self.model = members[0].runner.model  # the shared model (a trial alone: its own)
        self._pending: dict[int, GenerationRequest] = {}
        self._responses: dict[int, Any] = {}
        self._done: set[int] = set()
        self._globals: dict[int, _MemberGlobals] = {}
        self._greenlets: dict[int, Any] = {}
        self._caller: Any = None
        self._aborted = threading.Event()
        self.decodes = 0
        """Batched decodes this gang ran (one per generation cycle of its members)."""
        self.decode_seconds = 0.0

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
        self._globals = {i: _MemberGlobals(outside.rng, dict(outside.gradient), dict(outside.forward),
                                           outside.grad_enabled)
                         for i in range(len(members))}
        self._caller = greenlet.getcurrent()
        self._greenlets = {i: greenlet.greenlet(functools.partial(self._body, i)) for i in range(len(members))}
        self._done, self._pending, self._responses = set(), {}, {}
        with compat.restore_shared_model(model, args):
            try:
                self._drive()
            except BaseException:  # Ctrl-C: every member stops at its next step (a waiting one hears `Aborted`)
                self.abort()
                self._drive()
                raise
            finally:
                outside.restore()

    def abort(self) -> None:
        """Stop every member at its next optimizer step (or the backend at its next token)."""
        self._aborted.set()

    def _drive(self) -> None:
        """Rounds until every member is done: each member able to run runs, in order, until its trainer asks for
        rollouts or its chunk ends; then one batched decode answers every request."""
        while len(self._done) < len(self.members):
            for i in range(len(self.members)):
                if i not in self._done and i not in self._pending:  # to start, or answered: it goes on
                    self._run(i)
            if not self._pending:  # every member ran until it was done
                continue
            batch = sorted(self._pending)
            requests = [self._pending.pop(j) for j in batch]
            started = time.perf_counter()
            try:
                if self._aborted.is_set():
                    raise Aborted("the gang was stopped")
                outs: list[Any] = self.backend.generate(requests, should_stop=self._aborted.is_set)
            except BaseException as exc:  # noqa: BLE001 - stopped, or the engine failed: every waiting member hears
                heard = exc if isinstance(exc, Exception) else Aborted("interrupted")
                self._responses.update(zip(batch, [heard] * len(batch)))
                if not isinstance(exc, Exception):  # Ctrl-C: the members stop, and it goes on up
                    raise
                continue
            finally:
                self.decode_seconds += time.perf_counter() - started
            self.decodes += 1
            self._responses.update(zip(batch, outs))

    def _run(self, i: int) -> None:
        """Member `i` runs, with its own process-wide state, until it asks for rollouts or its chunk ends."""
        member = self.members[i]
        self._globals[i].restore()
        member.runner.pool.activate(member.number, member.runner.config)
        self._greenlets[i].switch()
        if self._greenlets[i].dead:
            self._done.add(i)
            if isinstance(member.error, KeyboardInterrupt):  # Ctrl-C while this member ran: it stopped, not failed
                member.error = Aborted("interrupted")
                if not self._aborted.is_set():
                    raise KeyboardInterrupt

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
            raise Aborted("the gang was stopped")
        request = GenerationRequest(
            adapter=adapter_name(self.members[i].number),
            prompt_ids=compat.tokenized_prompts(trainer, prompts),
            sampling=Sampling.of(trainer.generation_config),
            seed=seed_from_stream(),  # from this member's own stream: its draws do not depend on the others
        )
        self._pending[i] = request
        self._globals[i] = _MemberGlobals.capture(self.model)
        self._caller.switch()  # back to `_drive`; it resumes this member once the batch is decoded
        out = self._responses.pop(i)
        if isinstance(out, BaseException):
            raise out
        return {"prompt_ids": request.prompt_ids, "completion_ids": out.token_ids, "logprobs": out.logprobs}


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
