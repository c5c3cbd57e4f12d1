"""The batched rollout backend: a gang's requests decoded in one batch, each row through its own adapter.

A gang's trials share one base model and differ in their LoRA adapters. Decoding a small batch is latency-bound (the
base weights are read once per token whether 4 rows are decoded or 64), so the backend decodes every member's rows
together, in four parts:

- **prefill**: each request's distinct prompts once (GRPO repeats every prompt ``num_generations`` times), through
  the model's view with the LoRA bank (`rfopt.training.rollouts.bank`), into a dynamic cache;
- the **buffers** of a bucket (`_Bucket`: groups x rows per group x cache length, each rounded up to a short ladder
  by `decode_shape`, so a study's decodes share a few shapes): transformers' `StaticCache`, into
  which the prefilled keys and values are copied row by row, the tokens, positions, attention mask, each row's
  sampling settings, seen tokens, noise keys and outputs, all preallocated and written in place;
- the **step** (`_step`): one token for every row, a pure function of those buffers (the model's forward with a 4D
  mask built from them, then `rfopt.training.rollouts.sampler.sample`), with no host synchronisation, no Python hook
  and no shape that depends on the data (but one: run eagerly on the CPU, a step attends only the cache columns written
  so far, in whole blocks of `LIVE_BLOCK`, which gives the same bits). On a CUDA device it is captured once per bucket as a CUDA graph and replayed
  for every token (``RFOPT_DECODE=graph``, the default there), or compiled by ``torch.compile`` and then captured
  (``compiled``), or run eagerly (``eager``, the default on the CPU). Capturing costs one eager step; a bucket's graph
  serves every later decode of that shape, across chunks and trials, as long as the bank keeps its buffers (and
  `MAX_BUCKETS` shapes are kept, the least recently used dropped first);
- the **host loop**: replays the step and asks `should_stop` between tokens (and tells `progress`, when given, the
  tokens so far: no device read); it reads the device (whether every row is done) only every `CHECK_EVERY` tokens.

Rows are laid out group by group (a group: one request's rows, padded to the bucket's rows per group with rows that
are done from the start), so that each LoRA layer's delta is two batched products (`rfopt.training.rollouts.bank`).
Each request samples from its own noise (its seed and each row's index in the request), so its completions do not
depend on which other requests share the batch, or on how its rows were split into batches (up to the floating-point
effects of batching on the logits).

The model decodes in eval mode (no dropout), as a vLLM engine samples; plain TRL samples with LoRA dropout active.
A request without a `Sampling` (settings only ``model.generate`` implements, such as the model's own
``no_repeat_ngram_size``) is decoded through ``generate`` with its adapter, apart from the batch (`DecodeStats.routed`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rfopt.errors import Refusal
from rfopt import compat

from ..loading import rewrites_base
from .backend import (EXACT, DecodeAborted, Decoded, Completions, GenerationRequest, Outcome, Progress, make_backend,
                      model_refusal, told)
from .bank import LoraBank, adapter_refusal, decode_view
from .sampler import Features, RowSettings, Sampling, Ungangable, row_key, sample, uniform_noise

logger = logging.getLogger("rfopt")

CHECK_EVERY = 8
"""Tokens between two reads of whether every row is done (each read waits for the device; on the CPU it is read
after every token: no wait)."""
MIN_PREFIX = 16
"""The shortest prefix shared by a decode's prompts that its prefill computes once per group (`_prefill`)."""
MIN_LENGTH = 64
"""The shortest cache length of a bucket (`decode_shape`)."""
MAX_ROWS = 256
"""Rows decoded at once, at most; more are decoded in several rounds."""
MAX_BUCKETS = 8
"""Buckets (each with its cache and captured step) kept per backend, the least recently used dropped first."""
LIVE_BLOCK = 64
"""On the CPU an eager step attends only the cache columns written so far, rounded up to a multiple of this: the
columns past them are masked and add nothing, and leaving out whole blocks of 64 gives the same bits as attending them
(torch's CPU attention reduces over whole blocks: `tests/training/test_rollouts.py` checks a decode's tokens and
log-probs equal with and without). None: every step attends the whole cache."""
MODES = ("eager", "graph", "compiled")


def default_mode(device: Any, quantized: bool = False) -> str:
    """``RFOPT_DECODE`` if set (`decode_env`); else ``graph`` on a CUDA device and ``eager`` elsewhere, and for a
    `quantized` base (bitsandbytes 4/8-bit: its kernels are not checked under CUDA graph capture here, and LLM.int8
    finds its outliers on the host)."""
    return decode_env(device) or ("graph" if _device_kind(device) == "cuda" and not quantized else "eager")


def decode_env(device: Any = None) -> str | None:
    """The decode mode ``RFOPT_DECODE`` asks for (stripped, in any case: ``" EAGER"`` is ``eager``), None where it is
    unset or blank. A value that is no mode is a `Refusal`, and so is a mode that needs CUDA where `device` (a torch
    device or ``"cuda:1"``; None: not known yet) is not a GPU. The run's up-front checks call it before anything is
    stored."""
    given = os.environ.get("RFOPT_DECODE", "")
    mode = given.strip().casefold()
    if not mode:
        return None
    if mode not in MODES:
        raise Refusal(f"RFOPT_DECODE={given!r}: give one of {', '.join(MODES)}, or unset it (graph on a GPU, eager "
                      "elsewhere)")
    if mode != "eager" and device is not None and _device_kind(device) != "cuda":
        raise Refusal(f"RFOPT_DECODE={given!r} needs a CUDA device, and this study trains on {str(device)!r}: set "
                      "RFOPT_DECODE=eager, or unset it")
    return mode


def _device_kind(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


@dataclass
class DecodeStats:
    """What the backend did (benchmarks read it)."""

    decodes: int = 0
    iterations: int = 0
    """Decode steps run (one token for every row of a batch each)."""
    rows: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    shapes: int = 0
    """Buckets made (one decode shape each; a dropped one that is needed again is made again)."""
    captures: int = 0
    capture_seconds: float = 0.0
    routed: int = 0
    """Requests it could not sample, decoded on the exact path (``model.generate``) instead."""
    prefix_tokens: int = 0
    """Prompt tokens the prefills did not compute again: a prefix shared by a group's prompts, computed once."""
    columns: int = 0
    """Cache columns the decode steps attended, summed over steps (`LIVE_BLOCK`)."""
    cached: int = 0
    """Cache columns the decode steps' buckets hold, summed over steps: `columns` is as many where every step attends
    the whole cache."""


@dataclass
class _Bucket:
    """The buffers of one decode shape (see the module docstring), and its captured step."""

    groups: int
    per_group: int
    length: int
    vocab: int
    features: Features
    cache: Any
    tokens: Any
    positions: Any
    keep: Any
    columns: Any
    cursor: Any
    step: Any
    out: Any
    logprobs: Any | None
    done: Any
    bad: Any
    limit: Any
    pad: Any
    eos: Any
    settings: RowSettings
    seen: Any | None
    keys: Any
    graph: Any = None
    compiled: Any = None
    ready: bool = field(default=False)
    written: int = 0
    """Cache columns an earlier decode (or a capture's warm-up steps) may have written: `BatchedBackend._load` zeroes
    those past the new prompts, whose keys and values the attention reads although it masks them."""

    @property
    def rows(self) -> int:
        return self.groups * self.per_group


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_shape(requests: int, rows: int, tokens: int) -> tuple[int, int, int]:
    """The bucket shape (groups, rows per group, cache length) of a decode of `requests` requests of at most `rows`
    rows each, whose longest prompt plus completion is `tokens` long: each rounded up to a short fixed ladder (powers
    of two; lengths from `MIN_LENGTH`), as vLLM pads a batch to one of its captured sizes. A study's decodes then fall
    into a few shapes, each captured once, instead of one per prompt width and gang size; the padding is rows and
    cache positions that are done or masked from the start, so no row's completion changes.

    >>> decode_shape(3, 5, 130)
    (4, 8, 256)
    """
    return _pow2(requests), _pow2(rows), max(MIN_LENGTH, _pow2(tokens))


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many first tokens every prompt of `prompts` shares, leaving each at least its last token.

    >>> shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]])
    2
    """
    shortest = min(map(len, prompts)) - 1
    first = prompts[0]
    for n in range(max(0, shortest)):
        if any(p[n] != first[n] for p in prompts):
            return n
    return max(0, shortest)


def _rows_done(requests: Sequence[GenerationRequest], results: list[Any]) -> tuple[int, ...]:
    """Each request's rows decoded so far (one refused or failed, or routed to the exact path and not decoded yet: 0)."""
    return tuple(len(r.token_ids) if isinstance(r, Completions) else 0 for r in results)


class BatchedBackend:
    """Decodes a gang's requests in one batch through one shared PeftModel (see the module docstring).

    >>> backend = BatchedBackend(peft_model)                                          # doctest: +SKIP
    >>> out = backend.generate([GenerationRequest("trial-0", ids0, sampling0, seed=7),
    ...                         GenerationRequest("trial-1", ids1, sampling1)])
    >>> out[0].token_ids   # trial 0's completions, one list of token ids per prompt, each ending at its first EOS
    """

    shares_batches = True

    def __init__(self, model: Any, *, mode: str | None = None, max_rows: int = MAX_ROWS, dtype: Any = None) -> None:
        """`dtype`: what the decoder computes in (the training's mixed precision: bf16 for float32 master weights
        trained with ``bf16=True``); None: the model's own."""
        self.model = model
        self.dtype = dtype
        self.device = next(model.parameters()).device
        quantized = bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))
        self.mode = mode or default_mode(self.device, quantized)
        if mode is None and not os.environ.get("RFOPT_DECODE") and self.mode != "eager" and \
                model_refusal(model, self.mode) is not None and model_refusal(model) is None:
            logger.warning("%s: decoding eagerly (no captured step): %s", type(model).__name__,
                           model_refusal(model, self.mode))
            self.mode = "eager"  # a model whose step branches on the data is decoded eagerly, not refused
        if self.mode not in MODES:
            raise Refusal(f"decode mode {self.mode!r}: give one of {', '.join(MODES)}")
        if self.mode != "eager" and self.device.type != "cuda":
            raise Refusal(f"decode mode {self.mode!r} needs a CUDA device; the model is on {self.device}")
        self.max_rows = max_rows
        self.stats = DecodeStats()
        self._bank: LoraBank | None = None
        self._view: Any = None
        self._buckets: OrderedDict[tuple[Any, ...], _Bucket] = OrderedDict()
        self._pool: Any = None
        self._dtype: Any = None
        self._attention = "sdpa"

    # ------------------------------------------------------------------ the protocol
    def refusal(self, config: Any) -> str | None:
        """Why `config`'s trial cannot generate through this backend (it then trains alone, on the exact backend), or
        None: the one gate, asked by the unit's planner before the trial's first unit. The config first
        (`config_refusal`: its adapter, its generation settings), then this backend's own check of the model it serves
        (`model_refusal`)."""
        return self.config_refusal(config) or model_refusal(self.model, self.mode)

    @staticmethod
    def config_refusal(config: Any) -> str | None:
        """The half of `refusal` that reads only the config: why its rollouts cannot share a batch, or None. Ask
        `refusal`, the one gate (it adds this backend's check of the model it serves); this half is apart so that a
        stand-in for the batched backend without a model (the tests' scripted backend) refuses what it refuses.

        The batched backend decodes plain LoRA adapters on Linear layers of a shared base model, with the sampling
        settings ``model.generate`` knows from TRL's `GenerationConfig` (`Sampling`)."""
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
            return (f"init_lora_weights={init!r} rewrites its base model's weights when its adapter is added: it "
                    "trains on a base model of its own")
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

    def adapters_changed(self, names: Iterable[str]) -> None:
        """Nothing to do: every decode copies its adapters' current weights into the bank."""

    def generate(self, requests: Sequence[GenerationRequest], should_stop: Callable[[], bool] | None = None,
                 progress: Progress | None = None) -> list[Outcome]:
        results: list[Any] = [None] * len(requests)
        live: list[int] = []
        routed: list[int] = []
        for i, r in enumerate(requests):
            why = ("its generation settings need model.generate" if r.sampling is None
                   else adapter_refusal(self.model, r.adapter) if r.adapter is not None
                   else "it has no adapter on the shared model")
            if why is not None and r.adapter in getattr(self.model, "peft_config", {}) and \
                    (r.generate_kwargs is not None or r.sampling is not None):
                routed.append(i)  # what this backend cannot sample goes to the exact path, never back as a failure
            elif why is not None:
                results[i] = Ungangable(why)
            elif not r.prompt_ids:
                results[i] = Completions([], [] if r.logprobs else None)
            else:
                results[i] = Completions([], [] if r.logprobs else None)
                live.append(i)
        # Rounds: each request's rows in slices of its batch_rows (and of what fits beside the others, the groups
        # padded as `decode_shape` pads them). A round's rows per group are its slices' full size, so a last, shorter
        # slice decodes in the shape of the others.
        while live:
            share = max(1, self.max_rows // _pow2(len(live)))
            share = 1 << (share.bit_length() - 1)  # a power of two: padded, the groups still fit in max_rows
            parts, per_group = [], 1
            for i in live:
                r, done = requests[i], len(results[i].token_ids)
                take = min(r.batch_rows or len(r.prompt_ids), share)
                per_group = max(per_group, take)
                parts.append((i, list(range(done, min(done + take, len(r.prompt_ids))))))
            tick = None
            if progress is not None:
                finished = _rows_done(requests, results)

                def tick(tokens: int, most: int, seconds: float, finished: tuple[int, ...] = finished) -> None:
                    told(progress, Decoded(finished, tuple(len(r.prompt_ids) for r in requests), tokens, most,
                                           seconds))
            outs = self._decode([(requests[i], rows) for i, rows in parts], should_stop, per_group, tick)
            for (i, _), out in zip(parts, outs):
                if isinstance(out, Exception):
                    results[i] = out
                    continue
                results[i].token_ids.extend(out.token_ids)
                if out.logprobs is not None:
                    results[i].logprobs.extend(out.logprobs)
            live = [i for i in live if isinstance(results[i], Completions)
                    and len(results[i].token_ids) < len(requests[i].prompt_ids)]
            if progress is not None:
                told(progress, Decoded(_rows_done(requests, results), tuple(len(r.prompt_ids) for r in requests), 0,
                                       0, 0.0))
        if routed:
            self.stats.routed += len(routed)
            active = self.model.active_adapter
            try:
                before = _rows_done(requests, results)

                def routed_progress(d: Decoded) -> None:  # the routed requests' rows among all of the call's
                    done = list(before)
                    for i, n in zip(routed, d.rows_done):
                        done[i] = n
                    told(progress, Decoded(tuple(done), tuple(len(r.prompt_ids) for r in requests), d.tokens,
                                           d.max_tokens, d.seconds))
                outs = make_backend(EXACT, self.model, dtype=self.dtype).generate(
                    [requests[i] for i in routed], should_stop, routed_progress if progress is not None else None)
            finally:
                if self.model.active_adapter != active:
                    self.model.set_adapter(active)
            for i, out in zip(routed, outs):
                results[i] = out
        return results

    # ------------------------------------------------------------------ one batch
    def _decode(self, parts: list[tuple[GenerationRequest, list[int]]], should_stop: Callable[[], bool] | None,
                rows_per_group: int = 1, tick: Callable[[int, int, float], None] | None = None) -> list[Outcome]:
        """One batch: `parts` (a request and the indices of its rows to decode), in a bucket of `decode_shape` for
        at least `rows_per_group` rows per group. Padding groups (the first request's adapter, rows done from the
        start) fill the ladder's group count. `tick(tokens, most new tokens, seconds)` hears each token decoded."""
        import torch

        started = time.perf_counter()
        with torch.no_grad():
            width = max(len(r.prompt_ids[j]) for r, rows in parts for j in rows)
            steps = max(r.sampling.max_new_tokens for r, _ in parts)
            groups, per_group, length = decode_shape(len(parts), max(rows_per_group, *(len(rows) for _, rows in parts)),
                                                     width + steps)
            self._prepare(groups)
            adapters = [r.adapter for r, _ in parts]
            self._bank.load(adapters + adapters[:1] * (groups - len(parts)))
            self._bank.groups = len(parts)  # the prefill: the real groups' distinct prompts
            # Each group's distinct prompts, and for every decode row the prefill row it starts from.
            distinct: list[list[list[int]]] = []
            source: list[int] = []
            for r, rows in parts:
                seen: dict[tuple[int, ...], int] = {}
                mine: list[list[int]] = []
                for j in rows:
                    key = tuple(r.prompt_ids[j])
                    if key not in seen:
                        seen[key] = len(mine)
                        mine.append(r.prompt_ids[j])
                distinct.append(mine)
            prefill_rows = max(len(d) for d in distinct)
            for g, (r, rows) in enumerate(parts):
                index = {tuple(p): k for k, p in enumerate(distinct[g])}
                source += [g * prefill_rows + index[tuple(r.prompt_ids[j])] for j in rows]
                source += [g * prefill_rows] * (per_group - len(rows))  # padding rows: done from the start
            source += [0] * (per_group * (groups - len(parts)))  # padding groups: likewise
            samplings = [r.sampling for r, _ in parts]
            features = Features.of(samplings, logprobs=any(r.logprobs for r, _ in parts))
            eos_width = _pow2(max(1, max(len(s.eos_token_ids) for s in samplings)))
            logits, cache, lengths, prefix = self._prefill(parts, distinct, prefill_rows)
            width = cache.layers[0].keys.shape[2]  # at most the longest prompt: a shared prefix is held once
            prefilled = time.perf_counter()
            self._bank.groups = groups  # the decode steps: every group of the bucket, padding included
            bucket = self._bucket(groups, per_group, length, features, eos_width, cache)
            self._load(bucket, parts, source, cache, width, lengths, prefix)
            self._emit(bucket, logits.index_select(0, torch.tensor(source, device=self.device)))
            iterations = 1
            on_cpu = self.device.type == "cpu"  # reading the device there waits for nothing
            trims = LIVE_BLOCK is not None and bucket.graph is None and on_cpu
            try:
                for t in range(1, steps):
                    if tick is not None:
                        tick(t, steps, time.perf_counter() - started)
                    if should_stop is not None and should_stop():
                        raise DecodeAborted("decoding stopped")
                    if (on_cpu or t % CHECK_EVERY == 0) and bool(bucket.done.all()):
                        break
                    # The step writes column width + t - 1 and attends every column up to it.
                    if trims:
                        bucket.cache.live = min(bucket.length, -(-(width + t) // LIVE_BLOCK) * LIVE_BLOCK)
                    self._run_step(bucket)
                    self.stats.columns += bucket.cache.live or bucket.length
                    self.stats.cached += bucket.length
                    iterations += 1
            finally:
                bucket.cache.live = None
            out = bucket.out[:, :steps].tolist()
            logprobs = bucket.logprobs[:, :steps].tolist() if bucket.logprobs is not None else None
            bad = bucket.bad.tolist()
        stats = self.stats
        stats.decodes += 1
        stats.iterations += iterations
        stats.rows += sum(len(rows) for _, rows in parts)
        stats.seconds += time.perf_counter() - started
        stats.prefill_seconds += prefilled - started
        results: list[Outcome] = []
        for g, (r, rows) in enumerate(parts):
            first = g * per_group
            if any(bad[first:first + len(rows)]):
                results.append(RuntimeError(
                    f"adapter {r.adapter!r}: its logits are not finite (NaN or infinite weights?); its completions "
                    "cannot be sampled"))
                continue
            eos = set(r.sampling.eos_token_ids)
            limit = r.sampling.max_new_tokens
            ids, lps = [], []
            for k in range(len(rows)):
                row = out[first + k][:limit]
                end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
                ids.append(row[:end])
                if logprobs is not None:
                    lps.append(logprobs[first + k][:end])
            results.append(Completions(ids, lps if r.logprobs else None))
        return results

    def _prepare(self, groups: int) -> None:
        """The bank and the view, made again when the model's LoRA layers changed or the bank is too small."""
        bank = LoraBank.fitting(self.model, groups, self._bank, dtype=self.dtype)
        if bank is not self._bank:
            self._bank = bank
            self._view = decode_view(self.model, bank)
            self._dtype = self._view.dtype
            self._attention = compat.attention_implementation(self._view.config)
            self._buckets.clear()  # their steps read the old bank's buffers
            self._pool = None  # the graphs that shared it are gone: a new capture needs a new pool

    def _prefill(self, parts: list[tuple[GenerationRequest, list[int]]], distinct: list[list[list[int]]],
                 prefill_rows: int) -> tuple[Any, Any, list[int], int]:
        """The distinct prompts through the view (group by group, padded to `prefill_rows` each): the last logits of
        each (float32), the dynamic cache, each prefill row's prompt length, and the length of the prefix they share.

        Prompts that share a prefix of at least `MIN_PREFIX` tokens (an evaluation's prompts, rendered by one chat
        template with one system prompt) have it prefilled once per group, and then each its own rest, after it: the
        cache holds the prefix in its first columns, then each row's rest padded on the left (the padding masked, the
        positions each token's own), so its columns are the prefix's, the padding's and the rest's in that order."""
        import torch
        from transformers import DynamicCache

        prompts = []
        for mine in distinct:
            prompts += mine + [mine[0]] * (prefill_rows - len(mine))
        lengths = [len(p) for p in prompts]
        prefix = shared_prefix(prompts) if prefill_rows > 1 else 0
        if prefix < MIN_PREFIX:
            prefix = 0
        pad = parts[0][0].sampling.pad_token_id
        rest = max(lengths) - prefix
        ids = torch.full((len(prompts), rest), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), prefix + rest), dtype=torch.long)
        mask[:, :prefix] = 1
        for i, p in enumerate(prompts):
            ids[i, rest - (len(p) - prefix):] = torch.tensor(p[prefix:], dtype=torch.long)
            mask[i, prefix + rest - (len(p) - prefix):] = 1
        cache = DynamicCache()
        if prefix:  # once per group (a group's adapter makes its own keys and values), then one copy for each row
            head = torch.tensor([prompts[0][:prefix]] * len(distinct), dtype=torch.long, device=self.device)
            shared = self._view(input_ids=head, position_ids=torch.arange(prefix, device=self.device)[None],
                                past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1).past_key_values
            for index, layer in enumerate(shared.layers):
                cache.update(layer.keys.repeat_interleave(prefill_rows, dim=0),
                             layer.values.repeat_interleave(prefill_rows, dim=0), index)
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self._view(input_ids=ids, attention_mask=mask,
                         position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)[:, prefix:], past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.stats.prefix_tokens += prefix * (len(prompts) - len(distinct))
        return out.logits[:, -1, :].float(), out.past_key_values, lengths, prefix

    # ------------------------------------------------------------------ buckets
    def _bucket(self, groups: int, per_group: int, length: int, features: Features, eos_width: int,
                cache: Any) -> _Bucket:
        import torch
        from transformers import StaticCache

        key = (groups, per_group, length, features, eos_width, id(self._bank))
        if key in self._buckets:
            self._buckets.move_to_end(key)
            return self._buckets[key]
        while len(self._buckets) >= MAX_BUCKETS:  # the least recently used goes
            self._buckets.popitem(last=False)
        if not self._buckets:  # no graph holds the shared pool any more: a new capture needs a new one
            self._pool = None
        rows = groups * per_group
        device = self.device
        config = self._view.config
        vocab = int(config.get_text_config(decoder=True).vocab_size)
        static = _live_cache(StaticCache)(config=config, max_cache_len=length)
        layers = cache.layers
        static.early_initialization(batch_size=rows, num_heads=[layer.keys.shape[1] for layer in layers],
                                    head_dim=[layer.keys.shape[3] for layer in layers], dtype=layers[0].keys.dtype,
                                    device=device)
        long = dict(dtype=torch.long, device=device)
        greedy = Sampling(max_new_tokens=0, eos_token_ids=(), pad_token_id=0, do_sample=False)
        bucket = _Bucket(
            groups=groups, per_group=per_group, length=length, vocab=vocab, features=features, cache=static,
            written=length,
            tokens=torch.zeros((rows, 1), **long), positions=torch.zeros((rows, 1), **long),
            keep=torch.ones((rows, length), dtype=torch.bool, device=device),
            columns=torch.arange(length, **long), cursor=torch.zeros((), **long), step=torch.zeros((), **long),
            out=torch.zeros((rows, length), **long),
            logprobs=torch.zeros((rows, length), dtype=torch.float32, device=device) if features.logprobs else None,
            done=torch.ones(rows, dtype=torch.bool, device=device),
            bad=torch.zeros(rows, dtype=torch.bool, device=device), limit=torch.zeros(rows, **long),
            pad=torch.zeros(rows, **long), eos=torch.full((rows, eos_width), -1, **long),
            settings=RowSettings.of([greedy] * rows, rows, vocab, device),
            seen=torch.zeros((rows, vocab), dtype=torch.bool, device=device) if features.repetition else None,
            keys=torch.zeros(rows, **long),
        )
        self._buckets[key] = bucket
        self.stats.shapes += 1
        if self.mode != "eager":
            self._capture(bucket)
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Capture the bucket's step as a CUDA graph (compiled first in ``compiled`` mode), on its buffers as they are
        (the warm-up steps change them; every decode writes them again before its first step)."""
        import torch

        started = time.perf_counter()
        step: Callable[[], None] = lambda: self._step(bucket)  # noqa: E731
        if self.mode == "compiled":
            bucket.compiled = torch.compile(self._step, fullgraph=True, dynamic=False)
            step = lambda: bucket.compiled(bucket)  # noqa: E731
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3 if self.mode == "compiled" else 2):  # the first runs allocate; a graph must not
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        bucket.graph = graph
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - started

    def _load(self, bucket: _Bucket, parts: list[tuple[GenerationRequest, list[int]]], source: list[int],
              cache: Any, width: int, lengths: list[int], prefix: int = 0) -> None:
        """Write this decode's state into the bucket's buffers, in place: `cache`'s `width` columns (`prefix` of them
        the shared prefix, `_prefill`)."""
        import torch

        device = self.device
        rows = bucket.rows
        per_group = bucket.per_group
        index = torch.tensor(source, device=device)
        # An earlier decode's keys and values past this one's prompts are masked, not gone: attention multiplies them
        # by a weight of 0, and a NaN left by an adapter with NaN weights stays NaN, so whoever decodes next in those
        # rows would get NaN logits. Zeroed, up to where an earlier decode wrote.
        stale = slice(width, max(width, bucket.written))
        for mine, theirs in zip(bucket.cache.layers, cache.layers):
            mine.keys[:, :, :width].copy_(theirs.keys.index_select(0, index))
            mine.values[:, :, :width].copy_(theirs.values.index_select(0, index))
            mine.keys[:, :, stale].zero_()
            mine.values[:, :, stale].zero_()
            mine.cumulative_length.fill_(width)
        bucket.written = min(bucket.length, width + max(r.sampling.max_new_tokens for r, _ in parts))
        keep = torch.ones((rows, bucket.length), dtype=torch.bool)
        positions = torch.zeros((rows, 1), dtype=torch.long)
        for row, src in enumerate(source):
            keep[row, prefix: width - (lengths[src] - prefix)] = False  # the prefill's padding, after the prefix
            positions[row, 0] = lengths[src]
        samplings: list[Sampling] = []
        keys, limit, pad, eos, real = [], [], [], [], []
        eos_width = bucket.eos.shape[1]
        for r, rows_of in parts:
            s = r.sampling
            for k in range(per_group):
                real.append(k < len(rows_of))
                samplings.append(s)
                keys.append(row_key(r.seed, rows_of[k]) if k < len(rows_of) else 0)
                limit.append(s.max_new_tokens if k < len(rows_of) else 0)
                pad.append(s.pad_token_id)
                eos.append(list(s.eos_token_ids)[:eos_width] + [-1] * (eos_width - len(s.eos_token_ids)))
        padding = rows - len(real)  # the padding groups' rows: done from the start
        real += [False] * padding
        samplings += [samplings[0]] * padding
        keys += [0] * padding
        limit += [0] * padding
        pad += [pad[0]] * padding
        eos += [eos[0]] * padding
        bucket.keep.copy_(keep)
        bucket.positions.copy_(positions)
        bucket.cursor.fill_(width)
        bucket.step.fill_(0)
        bucket.done.copy_(~torch.tensor(real))
        bucket.bad.zero_()
        bucket.limit.copy_(torch.tensor(limit))
        bucket.pad.copy_(torch.tensor(pad))
        bucket.eos.copy_(torch.tensor(eos))
        bucket.keys.copy_(torch.tensor(keys, dtype=torch.long))
        bucket.settings.copy_(RowSettings.of(samplings, rows, bucket.vocab, "cpu"))
        bucket.out.zero_()
        if bucket.seen is not None:
            bucket.seen.zero_()
            row_index, token_index = [], []
            for row in range(len(parts) * per_group):
                g, k = divmod(row, per_group)
                r, rows_of = parts[g]
                if k < len(rows_of):
                    ids = r.prompt_ids[rows_of[k]]
                    row_index += [row] * len(ids)
                    token_index += list(ids)
            if row_index:
                bucket.seen[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = True

    # ------------------------------------------------------------------ the step
    def _run_step(self, bucket: _Bucket) -> None:
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._step(bucket)

    def _step(self, bucket: _Bucket) -> None:
        """One token for every row: the view's forward on the last tokens, then `_emit`. Only tensor operations on the
        bucket's buffers, updated in place (see the module docstring)."""
        import torch

        live = bucket.cache.live  # None: the whole cache (a captured step always reads it whole)
        keep = bucket.keep[:, :live] & (bucket.columns[:live] <= bucket.cursor)
        if self._attention == "sdpa":
            mask = keep[:, None, None, :]
        else:  # eager attention adds a float mask
            dtype = self._dtype
            mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
                ~keep, torch.finfo(dtype).min)[:, None, None, :]
        out = self._view(input_ids=bucket.tokens, position_ids=bucket.positions, attention_mask=mask,
                         past_key_values=bucket.cache, use_cache=True, logits_to_keep=1)
        self._emit(bucket, out.logits[:, -1, :].float())
        bucket.positions.add_(1)
        bucket.cursor.add_(1)

    def _emit(self, bucket: _Bucket, logits: Any) -> None:
        """Sample every row's token at the bucket's step from `logits` and write it (and what follows from it)."""
        import torch

        bucket.bad |= ~torch.isfinite(logits).all(dim=-1)
        noise = uniform_noise(bucket.keys, bucket.step) if bucket.features.sample else None
        tokens, logprobs = sample(logits, bucket.settings, bucket.features, bucket.seen, noise)
        tokens = torch.where(bucket.done, bucket.pad, tokens)
        at = bucket.step.view(1)
        bucket.out.index_copy_(1, at, tokens[:, None])
        if bucket.logprobs is not None:
            bucket.logprobs.index_copy_(1, at, logprobs[:, None])
        bucket.done |= (tokens[:, None] == bucket.eos).any(dim=-1) | (bucket.step + 1 >= bucket.limit)
        if bucket.seen is not None:
            bucket.seen.scatter_(1, tokens[:, None], True)
        bucket.tokens.copy_(tokens[:, None])
        bucket.step.add_(1)


def _live_cache(static_cache: type) -> type:
    """transformers' `StaticCache` whose `update` returns the keys and values of its first ``live`` columns only (all
    of them while ``live`` is None): the columns an eager CPU step attends (`LIVE_BLOCK`)."""
    if "LiveCache" not in _CLASSES:
        class LiveCache(static_cache):  # type: ignore[misc, valid-type]
            live: int | None = None

            def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
                keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
                if self.live is None:
                    return keys, values
                return keys[:, :, :self.live], values[:, :, :self.live]

        _CLASSES["LiveCache"] = LiveCache
    return _CLASSES["LiveCache"]


_CLASSES: dict[str, type] = {}

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
    for spec in dataclasses.fields(peft):
        value = getattr(peft, spec.name, None)
        if spec.metadata.get("is_lora_variant") and value:
            return spec.name
        if value in spec.metadata.get("lora_variants", ()):
            return f"{spec.name}={value!r}"
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


__all__ = ["BatchedBackend", "CHECK_EVERY", "DecodeStats", "LIVE_BLOCK", "MODES", "decode_env", "decode_shape", "default_mode",
           "lora_variant"]
