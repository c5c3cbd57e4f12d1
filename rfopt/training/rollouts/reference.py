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

from rfopt.errors import RfoptError


class Ungangable(RfoptError, ValueError):
    """A trial whose generation the rollout engine cannot do exactly as ``generate`` would: it trains alone."""


_IGNORED = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
            "use_cache", "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
            "output_hidden_states"}
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
        from transformers import (
            MinPLogitsWarper,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

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


class Aborted(RfoptError, RuntimeError):
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
                with torch.no_grad(), self.model.disable_adapter():
                    decoded = self._decode([requests[i] for i in live], device, should_stop)
            finally:
                self.model.train(was_training)
            for i, out in zip(live, decoded):
                results[i] = out
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ decoding
    def _decode(self, requests: list[Request], device: Any, should_stop: Callable[[], bool] | None
                ) -> list[list[list[int]] | Exception]:
        """Prefill each request's distinct prompts once (GRPO repeats every prompt ``num_generations`` times), copy
        their cache to every row, then decode all rows one token at a time."""
        import torch
        from transformers import DynamicCache

        # The distinct prompts of each request, and for every row the prefilled row it starts from.
        unique: list[list[list[int]]] = []
        source: list[int] = []
        for r in requests:
            seen: dict[tuple[int, ...], int] = {}
            distinct: list[list[int]] = []
            for ids in r.prompt_ids:
                key = tuple(ids)
                if key not in seen:
                    seen[key] = sum(map(len, unique)) + len(distinct)
                    distinct.append(ids)
                source.append(seen[key])
            unique.append(distinct)
        pad = requests[0].sampling.pad_token_id
        prompts = [ids for distinct in unique for ids in distinct]
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[i, width - len(ids):] = 1
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        cache = DynamicCache()
        with self._row_adapters([r.adapter for r in requests], [len(d) for d in unique]):
            out = self.model(input_ids=input_ids, attention_mask=prompt_mask,
                             position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
        index = torch.tensor(source, device=device)
        cache = out.past_key_values
        cache.reorder_cache(index)  # every row gets its prompt's cache (an index_select on the batch)
        logits = out.logits[:, -1, :].float().index_select(0, index)
        mask = prompt_mask.index_select(0, index)
        history = input_ids.index_select(0, index)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -1:]
        rows = len(source)
        spans = _spans(requests)
        padding = (width - mask.sum(dim=1)).cpu()
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
        processors = [r.sampling.processors(padding[a:b]) for r, (a, b) in zip(requests, spans)]
        limits = torch.tensor([r.sampling.max_new_tokens for r in requests for _ in r.prompt_ids], device=device)
        eos = [torch.tensor(r.sampling.eos_token_ids or [-1], device=device) for r in requests]
        failed: dict[int, Exception] = {}
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        repeats = any(r.sampling.repetition_penalty != 1.0 for r in requests)
        generated: list[Any] = []
        with self._row_adapters([r.adapter for r in requests], [len(r.prompt_ids) for r in requests]):
            for step in range(int(limits.max().item())):
                if should_stop is not None and should_stop():
                    raise Aborted("decoding stopped")
                tokens = torch.full((rows,), pad, dtype=torch.long, device=device)
                for g, (request, (a, b)) in enumerate(zip(requests, spans)):
                    if g in failed or bool(done[a:b].all()):
                        continue
                    try:
                        picked = _pick(logits[a:b], history[a:b], processors[g], request.sampling, generators[g])
                    except RuntimeError as exc:  # e.g. "probability tensor contains either inf, nan or element < 0"
                        failed[g] = exc
                        done[a:b] = True
                        continue
                    tokens[a:b] = torch.where(done[a:b], request.sampling.pad_token_id, picked)
                    done[a:b] |= torch.isin(tokens[a:b], eos[g]) | (limits[a:b] <= step + 1)
                generated.append(tokens)
                if bool(done.all()):
                    break
                if repeats:
                    history = torch.cat([history, tokens[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
                positions = positions + 1
                out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                logits = out.logits[:, -1, :].float()
        new = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in range(rows)]
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
    def _row_adapters(self, adapters: list[str], counts: list[int]) -> Iterator[None]:
        """Within this block (adapters disabled), each LoRA layer adds to each group of rows the delta of its own
        adapter: the batch is ``counts[i]`` rows of ``adapters[i]``, in that order.

        Where every group has the same number of rows and its adapter on a layer with the same rank (a gang of
        GRPO trials: ``per_device_train_batch_size`` rows each), the layer's deltas are two batched matrix products
        for the whole gang; elsewhere, one ``lora_B(lora_A(x))`` per group, on its slice of the batch."""
        import torch

        spans, start = [], 0
        for adapter, count in zip(adapters, counts):
            spans.append((adapter, start, start + count))
            start += count
        even = len(set(counts)) == 1 and len(adapters) > 1
        stacked: dict[Any, tuple[Any, Any, Any]] = {}
        layers = lora_layers(self.model)
        if even:
            for layer in layers:
                if not all(a in layer.lora_A for a in adapters):
                    continue
                a_weights = [layer.lora_A[a].weight for a in adapters]
                if len({w.shape for w in a_weights}) != 1 or any(layer.lora_B[a].bias is not None for a in adapters):
                    continue
                stacked[layer] = (torch.stack([w.t() for w in a_weights]),
                                  torch.stack([layer.lora_B[a].weight.t() for a in adapters]),
                                  torch.tensor([float(layer.scaling[a]) for a in adapters],
                                               dtype=a_weights[0].dtype, device=a_weights[0].device)[:, None, None])
        groups = len(adapters)

        def add_deltas(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            x = args[0]
            weights = stacked.get(module)
            if weights is not None:
                a_stack, b_stack, scaling = weights
                grouped = x.to(a_stack.dtype).reshape(groups, -1, x.shape[-1])
                delta = torch.bmm(torch.bmm(grouped, a_stack), b_stack) * scaling
                output += delta.reshape(output.shape).to(output.dtype)
                return output
            for adapter, a, b in spans:
                if adapter in module.lora_A:
                    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
                    delta = lora_b(lora_a(x[a:b].to(lora_a.weight.dtype))) * module.scaling[adapter]
                    output[a:b] += delta.to(output.dtype)
            return output

        handles = [layer.register_forward_hook(add_deltas) for layer in layers]
        try:
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

