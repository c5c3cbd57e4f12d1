"""The rollout engine: one per resident base model, it decodes a gang's generation requests in one batch.

A gang's trials share one base model and differ in their LoRA adapters. Generation of a small batch is
latency-bound (the base weights are read once per token whether 4 rows or 32 are decoded), so the engine decodes
every member's prompts together: one forward per token for the whole gang, each row through its own trial's
adapter. Each request samples from its own `torch.Generator`, seeded from its trial's random stream, so a trial's
completions do not depend on which other trials share the batch (up to the floating-point effects of batching).

- **Per-row adapters.** The shared PeftModel runs with its adapters disabled (`PeftModel.disable_adapter`, PEFT's
  public switch), and a forward hook on each LoRA layer adds every request's own delta to its rows:
  ``lora_B(lora_A(x[rows])) * scaling``, PEFT's own LoRA arithmetic on a contiguous slice of the batch. Adapters
  whose LoRA layers PEFT computes otherwise (DoRA and other variants) are refused (`ungangable`).
- **Sampling** follows what ``model.generate`` does with the trial's `GenerationConfig` (`Sampling.of`):
  repetition penalty, then temperature, top-k, top-p and min-p with transformers' own logits processors, then a
  multinomial draw (or the argmax when not sampling). Settings the engine does not implement are refused.
- **Mode.** The model decodes in eval mode: no dropout, as a vLLM engine samples. Plain TRL samples with the model
  in train mode (LoRA dropout active); that is one of the ways a gang's rollouts differ from plain TRL's.

The interface is the one a vLLM backend fills later (one engine per device, ``enable_lora``, one ``LoRARequest``
per trial; see the README, "Supported, and not (yet) supported").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


class Ungangable(ValueError):
    """A trial whose generation the rollout engine cannot do exactly as ``generate`` would: it trains alone."""


_IGNORED = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
            "use_cache", "return_dict_in_generate", "output_scores", "output_logits"}
"""`GenerationConfig` fields the engine implements (the first six), or that change nothing it decodes."""


@dataclass(frozen=True)
class Sampling:
    """How one request's rows are decoded: ``model.generate``'s meaning of each field."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, config: Any) -> Sampling:
        """The sampling a `transformers.GenerationConfig` asks for; raises `Ungangable` naming a setting the engine
        does not implement (beam search, n-gram blocking, ...)."""
        from transformers import GenerationConfig

        defaults = GenerationConfig()
        changed = [key for key, value in config.to_diff_dict().items()
                   if key not in _IGNORED and not key.startswith("_") and key != "transformers_version"
                   and getattr(defaults, key, None) != value]
        if changed:
            raise Ungangable(f"generation setting(s) {', '.join(sorted(changed))} are not implemented by rfopt's "
                             "rollout engine")
        if config.max_new_tokens is None:
            raise Ungangable("generation needs max_new_tokens")
        eos = config.eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
        return cls(
            max_new_tokens=int(config.max_new_tokens), eos_token_ids=eos_ids, pad_token_id=int(pad),
            do_sample=bool(config.do_sample),
            temperature=1.0 if config.temperature is None else float(config.temperature),
            top_k=config.top_k or None, top_p=1.0 if config.top_p is None else float(config.top_p),
            min_p=config.min_p, repetition_penalty=1.0 if config.repetition_penalty is None
            else float(config.repetition_penalty),
        )

    def processors(self, padding: Any) -> list[Any]:
        """transformers' logits processors for these settings, in ``generate``'s order; `padding`: each row's count
        of left padding (the repetition penalty ignores it, as ``generate`` does)."""
        from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                  TopKLogitsWarper, TopPLogitsWarper)

        found: list[Any] = []
        if self.repetition_penalty != 1.0:
            found.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty, prompt_ignore_length=padding))
        if self.do_sample:
            if self.temperature != 1.0:
                found.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                found.append(TopKLogitsWarper(top_k=self.top_k))
            if self.top_p < 1.0:
                found.append(TopPLogitsWarper(top_p=self.top_p))
            if self.min_p is not None:
                found.append(MinPLogitsWarper(min_p=self.min_p))
        return found


@dataclass
class Request:
    """One trial's rows of a gang's generation: its adapter, its tokenized prompts, how it samples, and the seed of
    its own random stream for this call."""

    adapter: str
    prompt_ids: list[list[int]]
    sampling: Sampling
    seed: int = 0


class Aborted(RuntimeError):
    """Decoding was stopped between two tokens (`RolloutEngine.generate`'s `should_stop`)."""


def lora_layers(model: Any) -> list[Any]:
    """The LoRA layers of a PeftModel (PEFT's ``LoraLayer`` modules that hold adapters)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer) and len(m.lora_A)]


def ungangable_adapter(model: Any, adapter: str) -> str | None:
    """Why the engine cannot decode through `adapter` of `model` (a LoRA variant such as DoRA, a bias, an embedding
    or convolution adapter), or None."""
    import torch.nn as nn

    config = model.peft_config.get(adapter)
    if config is None:
        return f"no adapter {adapter!r} on the shared model"
    if getattr(config, "peft_type", None) is None or str(config.peft_type).split(".")[-1] != "LORA":
        return f"adapter {adapter!r} is not LoRA"
    if getattr(config, "bias", "none") != "none":
        return f"LoRA bias={config.bias!r} trains the base model's biases"
    if getattr(config, "modules_to_save", None):
        return "modules_to_save trains copies of base modules"
    for layer in lora_layers(model):
        if adapter not in layer.lora_A:
            continue
        if adapter in getattr(layer, "lora_variant", {}):
            return f"adapter {adapter!r} is a LoRA variant (DoRA, ...)"
        if not isinstance(layer.lora_A[adapter], nn.Linear):
            return f"adapter {adapter!r} adapts a layer other than a Linear one"
    return None


class RolloutEngine:
    """Decodes a gang's requests through one shared PeftModel, each row with its own adapter and random stream.

    >>> engine = RolloutEngine(peft_model)                                          # doctest: +SKIP
    >>> out = engine.generate([Request("trial-0", ids0, sampling0, seed=7), Request("trial-1", ids1, sampling1)])
    >>> out[0]   # trial 0's completions, one list of token ids per prompt, each ending at its first EOS
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(self, requests: Sequence[Request], should_stop: Callable[[], bool] | None = None
                 ) -> list[list[list[int]] | Exception]:
        """Each request's completions (one list of token ids per prompt, cut after the first EOS), or the exception
        that ended that request alone (its logits could not be sampled: NaN weights, say). Raises `Aborted` when
        `should_stop` says so between two tokens."""
        import torch

        results: list[list[list[int]] | Exception | None] = [None] * len(requests)
        live = []
        for i, r in enumerate(requests):
            why = ungangable_adapter(self.model, r.adapter)
            if why is not None:
                results[i] = Ungangable(why)
            elif not r.prompt_ids:
                results[i] = []
            else:
                live.append(i)
        if live:
            device = next(self.model.parameters()).device
            was_training = self.model.training
            self.model.eval()
            try:
                with torch.no_grad(), self._row_adapters([requests[i] for i in live]):
                    decoded = self._decode([requests[i] for i in live], device, should_stop)
            finally:
                self.model.train(was_training)
            for i, out in zip(live, decoded):
                results[i] = out
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ decoding
    def _decode(self, requests: list[Request], device: Any, should_stop: Callable[[], bool] | None
                ) -> list[list[list[int]] | Exception]:
        import torch
        from transformers import DynamicCache

        rows = [ids for r in requests for ids in r.prompt_ids]
        spans = _spans(requests)
        width = max(len(ids) for ids in rows)
        pad = requests[0].sampling.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
                mask[i, width - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        padding = (width - mask.sum(dim=1)).cpu()
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
        processors = [r.sampling.processors(padding[a:b]) for r, (a, b) in zip(requests, spans)]
        limits = torch.tensor([r.sampling.max_new_tokens for r in requests for _ in r.prompt_ids], device=device)
        eos = [torch.tensor(r.sampling.eos_token_ids or [-1], device=device) for r in requests]
        failed: dict[int, Exception] = {}
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        history = input_ids
        generated: list[Any] = []
        cache = DynamicCache()
        step_ids, step_positions = input_ids, positions
        for step in range(int(limits.max().item())):
            if should_stop is not None and should_stop():
                raise Aborted("decoding stopped")
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            tokens = torch.full((len(rows),), pad, dtype=torch.long, device=device)
            for g, (request, (a, b)) in enumerate(zip(requests, spans)):
                if g in failed or bool(done[a:b].all()):
                    continue
                try:
                    tokens[a:b] = _pick(logits[a:b], history[a:b], processors[g], request.sampling, generators[g])
                except RuntimeError as exc:  # e.g. "probability tensor contains either inf, nan or element < 0"
                    failed[g] = exc
                    done[a:b] = True
                    continue
                tokens[a:b] = torch.where(done[a:b], torch.full_like(tokens[a:b], request.sampling.pad_token_id),
                                          tokens[a:b])
                done[a:b] |= torch.isin(tokens[a:b], eos[g]) | (limits[a:b] <= step + 1)
            generated.append(tokens)
            history = torch.cat([history, tokens[:, None]], dim=1)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            step_ids = tokens[:, None]
            step_positions = step_positions[:, -1:] + 1
        new = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in rows]
        results: list[list[list[int]] | Exception] = []
        for g, (request, (a, b)) in enumerate(zip(requests, spans)):
            if g in failed:
                results.append(failed[g])
                continue
            ids = set(request.sampling.eos_token_ids)
            limit = request.sampling.max_new_tokens
            results.append([_until_eos(row[:limit], ids) for row in new[a:b]])
        return results

    # ------------------------------------------------------------------ per-row adapters
    @contextlib.contextmanager
    def _row_adapters(self, requests: list[Request]) -> Iterator[None]:
        """Within this block the shared model computes each request's rows through the request's own adapter."""
        spans = [(r.adapter, a, b) for r, (a, b) in zip(requests, _spans(requests))]

        def add_deltas(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            x = args[0]
            for adapter, a, b in spans:
                if adapter in module.lora_A:
                    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
                    delta = lora_b(lora_a(x[a:b].to(lora_a.weight.dtype))) * module.scaling[adapter]
                    output[a:b] += delta.to(output.dtype)
            return output

        handles = [layer.register_forward_hook(add_deltas) for layer in lora_layers(self.model)]
        try:
            with self.model.disable_adapter():
                yield
        finally:
            for handle in handles:
                handle.remove()


def _spans(requests: Sequence[Request]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for r in requests:
        spans.append((start, start + len(r.prompt_ids)))
        start += len(r.prompt_ids)
    return spans


def _pick(logits: Any, history: Any, processors: list[Any], sampling: Sampling, generator: Any) -> Any:
    import torch

    scores = logits
    for processor in processors:
        scores = processor(history, scores)
    if not sampling.do_sample:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids


def seed_from_stream() -> int:
    """A seed drawn from the calling trial's torch random stream (it advances that stream, and only it)."""
    import torch

    return int(torch.randint(0, 2**62, (1,)).item())


__all__ = ["Aborted", "Request", "RolloutEngine", "Sampling", "Ungangable", "lora_layers", "seed_from_stream",
           "ungangable_adapter"]

