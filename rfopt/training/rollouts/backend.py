"""The rollout-backend seam: what a trial's generation goes through, and which trials may share a batch.

A `RolloutBackend` decodes `GenerationRequest`s (one trial's rows: its adapter, its prompts' token ids, how it
samples, the seed of its own stream) into `Completions` (token ids, and sampled-token log-probabilities when asked),
or the exception that ended that request alone. Two backends:

- **exact** (`ExactBackend`): generation as plain TRL does it. A trial trains with its trainer's own ``generate``
  (the backend does not take part: `shares_batches` is False), and evaluation calls ``model.generate`` through the
  trial's adapter, one request at a time. A trial alone (``gang_size=1``) trains on it, bit for bit as plain TRL.
- **batched** (`rfopt.training.rollouts.batched.BatchedBackend`): every request of a gang in one batch, each row
  through its own adapter (`rfopt.training.rollouts.bank`), with a static cache and a step captured as a CUDA graph
  on a GPU.

**Where the plan is made, and where backends are built.** The unit's planner (`rfopt.engine.planning.plan.Planner`) decides
which trials train together and on which kind of backend (`UnitPlan.backend`: `EXACT` or `BATCHED`); the unit
(`rfopt.engine.running.unit.run_units`) asks the trial's runner for that kind (`Runner.rollout_backend`), which asks its model
pool (`rfopt.training.models.ModelPool.backend`: which model, one batched backend per base model and device), which
builds it with `make_backend`, the one place a backend is constructed from its kind. The batched backend's routing
asks `make_backend` for the exact kind too. The unit then trains the gang (`rfopt.training.gang.Gang`) and evaluates
it (`rfopt.training.evaluation.evaluate_runners`) through that same backend, so a third kind would serve both.

**What a backend must implement** (`RolloutBackend`), who calls each member, and when:

| member | called by | when |
|---|---|---|
| `refusal(config)` | the planner's gate (`rfopt.engine.running.roster.Roster.rollout_refusal`), asked of the backend the plan would use (the batched backend of the trial's base model) | once per trial and run, before its first unit, only when gangs are formed; a trial it refuses trains alone on the exact backend, the reason logged once. It is the one config gate: the batched backend's checks the config (`BatchedBackend.config_refusal`: its adapter, its generation settings), then the model it serves (`model_refusal`) |
| `shares_batches` | the gang (`rfopt.training.gang.Gang`) | each unit: True, the members' trainers generate through `generate` (TRL's ``rollout_func``), one batch for the gang; False, each trainer generates on its own, as plain TRL |
| `generate(requests, should_stop, progress)` | the gang's rollout hook, while it trains; evaluation (`evaluate_members`), after it trains; the baseline's evaluation (exact kind) | each rollout of a gang that shares batches; every evaluation. A request the backend cannot sample is routed (the batched backend decodes it through the exact kind), never returned as a failure; an exception in the list fails its request alone; `DecodeAborted` when `should_stop` says so between two tokens |
| `adapters_changed(names)` | the unit (after it loads its members' weights: a checkpoint, a warm start, a fresh adapter) and the gang (after each member's optimizer step) | before the unit's first decode, and after every optimizer step |

A caller that shows how far a call has got passes `generate` a `progress` callback: the backend tells it each token
decoded and each batch of rows done (`Decoded`), for people (the progress records say "decoding rollouts: 40 of 128
tokens", "16 of 32 prompts"); it changes nothing decoded.

A vLLM backend would be a third: `generate` as ``LLM.generate`` with one ``LoRARequest`` per request (``enable_lora``,
``max_loras`` = the gang size), the seed as ``SamplingParams.seed``; `adapters_changed` reloads the named adapters
after their optimizer steps (a vLLM engine holds its own copy of the weights; the two backends here read the trial's
weights at every call, so it is a no-op for them); `refusal` its own limits (ranks, variants, sampling settings). It
would be added to `KINDS`, to `make_backend` and to the planner's choice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rfopt import compat
from rfopt.errors import RfoptError

from .sampler import Sampling, generation_settings

logger = logging.getLogger("rfopt")

EXACT = "exact"
"""The backend kind of a trial alone: `ExactBackend`."""
BATCHED = "batched"
"""The backend kind of a gang: `rfopt.training.rollouts.batched.BatchedBackend`."""
KINDS = (EXACT, BATCHED)


class DecodeAborted(RfoptError, RuntimeError):
    """Decoding was stopped between two tokens (`RolloutBackend.generate`'s `should_stop`); a chunk stopped between two
    optimizer steps is `rfopt.training.runner.ChunkAborted`."""


@dataclass
class GenerationRequest:
    """One trial's rows of a generation: its adapter, its tokenized prompts, how it samples, and the seed of its own
    random stream for this call."""

    adapter: str | None
    """The trial's adapter on the shared model; None for a model of its own (full fine-tuning, exact backend)."""
    prompt_ids: list[list[int]]
    sampling: Sampling | None
    """None: settings only ``model.generate`` implements (`generate_kwargs`; the batched backend decodes such a request
    through ``generate``, apart from its batch)."""
    seed: int = 0
    batch_rows: int | None = None
    """Decode at most this many of its rows at once (evaluation's ``batch_size``); None: all."""
    logprobs: bool = False
    """Also return each sampled token's log-probability under the distribution it was drawn from."""
    generate_kwargs: dict[str, Any] | None = None
    """What ``model.generate`` is called with for this request (default: `sampling` as its keyword arguments); a
    ``generation_config`` among them is merged with the model's own as ``generate`` merges it."""


@dataclass
class Completions:
    """One request's completions: a list of token ids per prompt row, each cut after its first EOS."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None


Outcome = Completions | Exception


@dataclass(frozen=True)
class Decoded:
    """How far one `RolloutBackend.generate` call has got, as it tells its `progress` callback: after each token of the
    batch it decodes, and after each batch of rows."""

    rows_done: tuple[int, ...]
    """Each request's rows whose completions are decoded, in request order."""
    rows: tuple[int, ...]
    """Each request's rows."""
    tokens: int
    """New tokens decoded so far in the batch decoding now (0 between batches)."""
    max_tokens: int
    """The most new tokens that batch may decode."""
    seconds: float
    """Seconds that batch has decoded so far (its prefill included)."""

    @property
    def rate(self) -> float | None:
        """Tokens per second of the batch decoding now; None before a token is decoded."""
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None


Progress = Callable[[Decoded], None]
"""What `RolloutBackend.generate` tells of how far it has got (`Decoded`): a display's hook, cheap, and never a
reason to fail the call."""


class RolloutBackend(Protocol):
    """What a trial's generation goes through, in training and in evaluation (see the module docstring: who calls each
    member, and when)."""

    shares_batches: bool
    """True: the members' trainers generate through `generate` (TRL's ``rollout_func``), every member in one batch;
    False: each trainer generates on its own, as plain TRL."""

    def refusal(self, config: Any) -> str | None:
        """Why `config`'s trial cannot train on this backend (it then trains alone, on the exact backend), or None:
        the one config gate, asked by the planner before the trial's first unit."""

    def generate(self, requests: Sequence[GenerationRequest], should_stop: Callable[[], bool] | None = None,
                 progress: Progress | None = None) -> list[Outcome]:
        """Each request's completions, or the exception that ended that request alone. Raises `DecodeAborted` when
        `should_stop` says so between two tokens. `progress` hears how far the call has got (`Decoded`)."""

    def adapters_changed(self, names: Iterable[str]) -> None:
        """The named adapters' weights changed (an optimizer step, a loaded checkpoint)."""


def model_refusal(model: Any, mode: str = "eager") -> str | None:
    """Why the batched backend decoding in `mode` cannot serve `model` (a PeftModel, or the base model before any
    adapter is on it) at all, or None: an attention it does not mask (only ``sdpa`` and ``eager``), sliding-window
    layers (a static cache of full layers), and for a captured step (``graph``, ``compiled``) a rotary embedding that
    branches on the data (`data_dependent_rope`). Settings of the model's own ``generation_config`` that the sampler
    lacks (``no_repeat_ngram_size``, ...) are no reason: the requests that would sample with them are decoded through
    ``model.generate`` (`GenerationRequest.sampling` None)."""
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    rope = data_dependent_rope(config)
    if rope is not None and mode != "eager":
        return (f"rope_type {rope!r} branches on the sequence length at every step, which a captured decode step "
                f"({mode}) cannot; RFOPT_DECODE=eager decodes it batched")
    attention = compat.attention_implementation(config)
    if attention not in ("sdpa", "eager"):
        return f"attention {attention!r} (the batched decoder masks sdpa and eager attention)"
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (the batched decoder keeps a static cache of full layers)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    return None


_DATA_DEPENDENT_ROPE = ("dynamic", "longrope")


def data_dependent_rope(config: Any) -> str | None:
    """The rope type of a transformers model config whose rotary embedding recomputes its frequencies from the
    sequence length inside the forward (``dynamic``, ``longrope``), or None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(text, name, None)
        if not isinstance(value, dict):
            continue
        kinds = [value] if "rope_type" in value or "type" in value else [v for v in value.values() if isinstance(v, dict)]
        for kind in kinds:
            rope = kind.get("rope_type", kind.get("type"))
            if rope in _DATA_DEPENDENT_ROPE:
                return rope
    return None


def seed_from_stream() -> int:
    """A seed drawn from the calling trial's torch random stream (it advances that stream, and only it)."""
    import torch

    return int(torch.randint(0, 2**62, (1,)).item())


class _Stop:
    """A `transformers.StoppingCriteria` that ends ``generate`` when `should_stop` says so, and tells `on_token` the
    new tokens decoded so far (it is asked after every token)."""

    def __init__(self, should_stop: Callable[[], bool] | None, on_token: Callable[[int], None] | None = None) -> None:
        self.should_stop = should_stop
        self.on_token = on_token
        self.width = 0
        """The batch's prompt width: the tokens before the first new one."""
        self.stopped = False

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        if self.on_token is not None:
            self.on_token(input_ids.shape[1] - self.width)
        self.stopped = self.stopped or bool(self.should_stop is not None and self.should_stop())
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


def told(progress: Progress | None, decoded: Decoded) -> None:
    """Tell `progress` of `decoded`; a display's failure is logged, never the call's."""
    if progress is None:
        return
    try:
        progress(decoded)
    except Exception as exc:  # noqa: BLE001 - progress is for people: the decode goes on
        logger.debug("a decode's progress callback failed: %s", exc)


class ExactBackend:
    """Generation as plain TRL does it (see the module docstring): each request through ``model.generate`` with its
    adapter active, its rows in batches of `GenerationRequest.batch_rows`, from torch's generator seeded with its
    seed (the caller's random state untouched). `dtype`: what it computes in under mixed precision (autocast, as the
    trainer computes; the batched backend decodes a copy in that dtype), so that a study's trials alone and in gangs
    are evaluated alike; None: the model's own."""

    shares_batches = False

    def __init__(self, model: Any, dtype: Any = None) -> None:
        self.model = model
        self.dtype = dtype

    def refusal(self, config: Any) -> str | None:
        """None: every trial may train alone, as plain TRL."""
        return None

    def adapters_changed(self, names: Iterable[str]) -> None:
        """Nothing to do: ``generate`` reads the adapter's weights."""

    def generate(self, requests: Sequence[GenerationRequest], should_stop: Callable[[], bool] | None = None,
                 progress: Progress | None = None) -> list[Outcome]:
        results: list[Outcome] = []
        rows = tuple(len(r.prompt_ids) for r in requests)
        done = [0] * len(requests)
        for i, request in enumerate(requests):
            def tell(index: int, finished: int, tokens: int, max_tokens: int, seconds: float) -> None:
                done[index] = finished
                told(progress, Decoded(tuple(done), rows, tokens, max_tokens, seconds))

            try:
                results.append(self._generate(request, should_stop,
                                              functools.partial(tell, i) if progress is not None else None))
            except DecodeAborted:
                raise
            except RuntimeError as exc:  # e.g. "probability tensor contains either inf, nan or element < 0"
                results.append(exc)
            done[i] = rows[i]
        return results

    def _generate(self, request: GenerationRequest, should_stop: Callable[[], bool] | None,
                  tell: Callable[[int, int, int, float], None] | None = None) -> Completions:
        """`tell(rows done, tokens of the batch now, its most new tokens, its seconds)`: how far it has got."""
        import torch
        from transformers import StoppingCriteriaList

        model = self.model
        if request.adapter is not None and model.active_adapter != request.adapter:
            model.set_adapter(request.adapter)
        kwargs = dict(request.generate_kwargs if request.generate_kwargs is not None
                      else request.sampling.generate_kwargs())
        merged = generation_settings(model.generation_config, kwargs.get("generation_config"),
                                     **{k: v for k, v in kwargs.items() if k != "generation_config"})
        eos = merged.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = merged.pad_token_id
        max_tokens = int(merged.max_new_tokens or 0)
        on_token = None
        if tell is not None:
            def on_token(tokens: int) -> None:
                tell(len(completions), tokens, max_tokens, time.perf_counter() - batch_started)
        stop = _Stop(should_stop, on_token) if should_stop is not None or on_token is not None else None
        device = next(model.parameters()).device
        rows = request.prompt_ids
        step = request.batch_rows or max(1, len(rows))
        completions: list[list[int]] = []
        was_training = model.training
        model.eval()
        try:
            precision = (torch.autocast(device.type, dtype=self.dtype) if self.dtype is not None
                         else contextlib.nullcontext())
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), precision:
                torch.manual_seed(request.seed)
                for start in range(0, len(rows), step):
                    batch = rows[start:start + step]
                    width = max(map(len, batch))
                    batch_started = time.perf_counter()
                    if stop is not None:
                        stop.width = width
                    if tell is not None:
                        tell(len(completions), 0, max_tokens, 0.0)
                    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in batch], device=device)
                    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=device)
                    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs,
                                         **({"stopping_criteria": StoppingCriteriaList([stop])} if stop else {}))
                    if stop is not None and stop.stopped:
                        raise DecodeAborted("decoding stopped")
                    completions.extend(until_eos(row, eos_ids, pad) for row in out[:, width:].tolist())
                    if tell is not None:
                        tell(len(completions), 0, max_tokens, time.perf_counter() - batch_started)
        finally:
            model.train(was_training)
        return Completions(completions, None)


def make_backend(kind: str, model: Any, *, dtype: Any = None, **options: Any) -> RolloutBackend:
    """The one place a rollout backend is built from its kind (`KINDS`), on `model`: `EXACT`, an `ExactBackend`;
    `BATCHED`, a `rfopt.training.rollouts.batched.BatchedBackend` (`options`: its ``mode``, ``max_rows``). `dtype`: what
    it computes in under mixed precision (None: the model's own). The model pool (`rfopt.training.models.ModelPool
    .backend`) decides which model; a third kind is added here.

    >>> make_backend(EXACT, model).generate([GenerationRequest(None, [[1, 5, 7]], sampling)])   # doctest: +SKIP
    """
    if kind == EXACT:
        if options:
            raise TypeError(f"the exact backend takes no {', '.join(sorted(options))}")
        return ExactBackend(model, dtype=dtype)
    if kind == BATCHED:
        from .batched import BatchedBackend  # a module above this one: it decodes through this seam's types

        return BatchedBackend(model, dtype=dtype, **options)
    raise ValueError(f"rollout backend {kind!r}: give one of {', '.join(KINDS)}")


def until_eos(ids: list[int], eos_ids: Sequence[int], pad_id: int | None) -> list[int]:
    """A completion cut after its first EOS; without one, ``generate``'s right padding removed."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return [t for t in ids if t != pad_id] if pad_id not in eos_ids else ids


__all__ = ["BATCHED", "EXACT", "KINDS", "DecodeAborted", "Decoded", "Completions", "ExactBackend", "GenerationRequest",
           "Outcome", "Progress", "RolloutBackend", "make_backend", "model_refusal", "seed_from_stream", "told",
           "until_eos"]
