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

Backends are built in one place, by kind (`EXACT`, `BATCHED`: `rfopt.training.models.ModelPool.backend`).
`RolloutBackend.refusal(config)` is the one gate that decides, before training, whether a trial may generate through
a backend: the unit's planner (`rfopt.engine.planning.plan`) asks it of the backend a gang would use, and a trial it refuses
trains alone, on the exact backend. The batched backend's is `refusal` (the config: its adapter, its generation
settings) and then its own `model_refusal` (the model it serves). A request the batched backend cannot sample all the
same is decoded on the exact path (``model.generate``), never returned as a failure. `adapters_changed` is called
after every gang member's optimizer step and after a unit loads its members' weights. A caller that shows how far a
call has got passes `generate` a `progress` callback: the backend tells it each token decoded and each batch of rows
done (`Decoded`), for people (the progress records say "decoding rollouts: 40 of 128 tokens", "16 of 32 prompts");
it changes nothing decoded.

A vLLM backend would be a third: `generate` as ``LLM.generate`` with one ``LoRARequest`` per request (``enable_lora``,
``max_loras`` = the gang size), the seed as ``SamplingParams.seed``; `adapters_changed` reloads the named adapters
after their optimizer steps (a vLLM engine holds its own copy of the weights; the two backends here read the trial's
weights at every call, so it is a no-op for them).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rfopt import compat
from rfopt.errors import RfoptError
from ..loading import rewrites_base

from .sampler import Sampling, Ungangable, generation_settings

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
    """What a gang's generation goes through (see the module docstring)."""

    shares_batches: bool
    """True: the members' trainers generate through `generate` (TRL's ``rollout_func``), every member in one batch;
    False: each trainer generates on its own, as plain TRL."""

    def refusal(self, config: Any) -> str | None:
        """Why `config`'s trial cannot train on this backend, or None."""

    def generate(self, requests: Sequence[GenerationRequest], should_stop: Callable[[], bool] | None = None,
                 progress: Progress | None = None) -> list[Outcome]:
        """Each request's completions, or the exception that ended that request alone. Raises `DecodeAborted` when
        `should_stop` says so between two tokens. `progress` hears how far the call has got (`Decoded`)."""

    def adapters_changed(self, names: Iterable[str]) -> None:
        """The named adapters' weights changed (an optimizer step, a loaded checkpoint)."""


def refusal(config: Any) -> str | None:
    """Why a trial's rollouts cannot share a batch (it then trains alone, on the exact backend, as with
    ``gang_size=1``), or None: the one place that decides it.

    The batched backend decodes plain LoRA adapters on Linear layers of a shared base model, with the sampling settings
    ``model.generate`` knows from TRL's `GenerationConfig` (`Sampling`)."""
    from transformers import GenerationConfig

    peft = config.peft_config
    if peft is None:
        return "full fine-tuning trains its own copy of the model"
    if str(getattr(peft, "peft_type", "")).split(".")[-1] != "LORA":
        return f"{type(peft).__name__} is not a LoRA adapter"
    if getattr(peft, "use_dora", False):
        return "DoRA adapters are not decoded by the batched rollout backend"
    variant = lora_variant(peft)
    if variant is not None:
        return f"{variant} makes a LoRA variant (the batched backend's bank serves plain LoRA)"
    init = rewrites_base(peft)
    if init is not None:
        return (f"init_lora_weights={init!r} rewrites its base model's weights when its adapter is added: it trains on "
                "a base model of its own")
    if getattr(peft, "trainable_token_indices", None):
        return "trainable_token_indices trains token embeddings (the batched decoder reads the base model's)"
    for name, why in _UNSERVED.items():
        if getattr(peft, name, None):
            return f"LoRA {name} {why}"
    if getattr(peft, "bias", "none") != "none":
        return f"LoRA bias={peft.bias!r} trains the base model's biases"
    if getattr(peft, "modules_to_save", None):
        return "modules_to_save trains copies of base modules"
    if getattr(peft, "target_parameters", None):
        return "target_parameters adapts parameters, not Linear layers"
    embedding = _embedding_target(getattr(peft, "target_modules", None))
    if embedding is not None:
        return f"target_modules names {embedding!r}, an embedding (only Linear layers are decoded in a batch)"
    args = config.args
    if getattr(args, "use_vllm", False):
        return "it generates with vLLM"
    if getattr(args, "use_transformers_continuous_batching", False):
        return "it generates with transformers' continuous batching"
    # The generation settings GRPOTrainer builds from its args (its `generation_config` without vLLM).
    kwargs = {"max_new_tokens": args.max_completion_length, "do_sample": True, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
              "repetition_penalty": args.repetition_penalty, **(args.generation_kwargs or {})}
    try:
        Sampling.of(GenerationConfig(**kwargs))
    except (Ungangable, ValueError, TypeError) as exc:
        return str(exc)
    return None


_UNSERVED = {"layer_replication": "repeats layers the batched decoder does not repeat",
             "use_qalora": "adapts a quantized layer the batched decoder does not serve",
             "megatron_config": "adapts Megatron's parallel layers"}
"""`LoraConfig` fields that make an adapter the batched backend does not decode, and why."""


def lora_variant(peft: Any) -> str | None:
    """The `LoraConfig` field (or ``init_lora_weights`` value) that makes `peft` one of PEFT's LoRA variants (DoRA,
    aLoRA, Arrow, BD-LoRA, VeLoRA, MonteCLoRA, KaSA, MiCA, ...), as PEFT itself tells them (its fields' metadata), or
    None for plain LoRA."""
    import dataclasses

    if not dataclasses.is_dataclass(peft):
        return None
    for field in dataclasses.fields(peft):
        value = getattr(peft, field.name, None)
        if field.metadata.get("is_lora_variant") and value:
            return field.name
        if value in field.metadata.get("lora_variants", ()):
            return f"{field.name}={value!r}"
    return None


_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings", "embeddings")


def _embedding_target(target_modules: Any) -> str | None:
    """The embedding module name `target_modules` would adapt (a list of names, or a regular expression), if any."""
    if target_modules is None or target_modules == "all-linear":  # PEFT's all-linear adapts Linear layers only
        return None
    if isinstance(target_modules, str):
        return next((name for name in _EMBEDDINGS if re.fullmatch(target_modules, f"model.{name}")
                     or re.fullmatch(target_modules, name)), None)
    return next((t for t in target_modules if any(t == name or t.endswith("." + name) for name in _EMBEDDINGS)),
                None)


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


def until_eos(ids: list[int], eos_ids: Sequence[int], pad_id: int | None) -> list[int]:
    """A completion cut after its first EOS; without one, ``generate``'s right padding removed."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return [t for t in ids if t != pad_id] if pad_id not in eos_ids else ids


__all__ = ["BATCHED", "EXACT", "KINDS", "DecodeAborted", "Decoded", "Completions", "ExactBackend", "GenerationRequest",
           "Outcome", "Progress", "RolloutBackend", "model_refusal", "refusal", "seed_from_stream", "told", "until_eos"]
