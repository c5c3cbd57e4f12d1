"""One vectorized sampler for every row of a batched decode: each row's own settings as tensors, each request's
noise from its own stream, no host synchronisation.

`Sampling` says how one request's rows are decoded, in ``model.generate``'s meaning of each field. `RowSettings` is
the same for a whole batch, one row per entry, as tensors the decode step reads; `sample` picks each row's next token:

1. the repetition penalty over the tokens a row has seen (its prompt, padding excepted, and what it generated);
2. greedy rows: the argmax;
3. sampling rows: temperature, then top-k, top-p and min-p, in ``generate``'s order and with transformers' arithmetic
   (`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`), then a draw from their softmax by inverting its
   cumulative distribution at one uniform number per row (``searchsorted``), with no ``torch.multinomial`` (which
   synchronises with the host) and no generator state.

The uniform number is a counter-based hash (`row_key`, `uniform_noise`): a row's at token t is a function of its
request's seed, the row's index in its request and t, so a request's samples do not depend on which requests share
its batch, how its rows were split into batches, or the device. Everything here is tensor arithmetic with shapes
fixed by the batch, so the decode step can be captured as a CUDA graph and compiled with
``torch.compile(fullgraph=True)``.

Which filters run is fixed per batch (`Features`): a batch none of whose rows uses top-p sorts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rfopt import compat
from rfopt.errors import RfoptError


class Ungangable(RfoptError, ValueError):
    """Generation that the batched rollout backend cannot do as ``generate`` would: the trial trains alone, on the
    exact backend."""


_IGNORED = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
            "use_cache", "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
            "output_hidden_states", "max_length"}
"""`GenerationConfig` fields the sampler implements (the first seven), or that change nothing it decodes
(``max_length``: ``max_new_tokens``, which `Sampling` needs, takes precedence over it)."""


def generation_settings(model_config: Any, config: Any = None, **kwargs: Any) -> Any:
    """What ``model.generate(generation_config=config, **kwargs)`` decodes with, for a model whose own
    ``generation_config`` is `model_config`: merged as ``generate`` merges them (transformers 5's
    ``_prepare_generation_config``): `config`'s fields (a blank `GenerationConfig` when None), the model's where those
    are None, transformers' defaults where both are (`rfopt.compat.generation_defaults`), then `kwargs` over all.

    TRL hands ``generate`` a config whose unset fields (``min_p``, ``no_repeat_ngram_size``, ...) the model's own
    then fills: plain TRL samples with those, and so must a decoder of rfopt's.

    >>> generation_settings(model.generation_config, trainer.generation_config).no_repeat_ngram_size  # doctest: +SKIP
    3
    """
    import copy

    from transformers import GenerationConfig

    merged = copy.deepcopy(config) if config is not None else GenerationConfig()
    merged.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    merged.update(**compat.generation_defaults(), defaults_only=True)
    merged.update(**kwargs)
    if merged.cache_implementation == "hybrid":  # as generate does: a default of the Hub's, unset there
        merged.cache_implementation = None
    return merged


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

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:  # never sampled at another temperature than the one given
            raise ValueError(f"temperature={self.temperature!r} with do_sample=True: give a temperature > 0, or "
                             "do_sample=False for greedy decoding (model.generate refuses it too)")

    @classmethod
    def of(cls, config: Any) -> Sampling:
        """The sampling a `transformers.GenerationConfig` asks for (give `generation_settings`' merged config: what
        ``generate`` would decode with); raises `Ungangable` naming a setting the sampler does not implement (beam
        search, n-gram blocking, ...). A field that is None, or at transformers' default, asks for nothing."""
        from transformers import GenerationConfig

        blank = GenerationConfig()
        defaults = compat.generation_defaults()
        changed = [key for key, value in config.to_diff_dict().items()
                   if key not in _IGNORED and not key.startswith("_") and key != "transformers_version"
                   and value is not None and value != defaults.get(key, getattr(blank, key, None))]
        if changed:
            raise Ungangable(f"generation setting(s) {', '.join(sorted(changed))} are not implemented by rfopt's "
                             "batched rollout backend")
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

    def generate_kwargs(self) -> dict[str, Any]:
        """These settings as ``model.generate`` keyword arguments (the exact backend)."""
        sampled = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample,
                **(sampled if self.do_sample else {"temperature": None, "top_k": None, "top_p": None}),
                "repetition_penalty": self.repetition_penalty, "pad_token_id": self.pad_token_id,
                "eos_token_id": list(self.eos_token_ids)}


def request_sampling(model_config: Any, config: Any = None, **kwargs: Any) -> Sampling | None:
    """The `Sampling` of what ``model.generate(generation_config=config, **kwargs)`` decodes with
    (`generation_settings`), or None where that asks for what only ``generate`` does (a `GenerationRequest` without
    sampling: the batched backend decodes it through ``generate``, apart from the batch)."""
    try:
        return Sampling.of(generation_settings(model_config, config, **kwargs))
    except Ungangable:
        return None


@dataclass(frozen=True)
class Features:
    """Which parts of the sampler a batch needs: fixed for a decode (each combination is its own captured step)."""

    sample: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    repetition: bool = False
    logprobs: bool = False

    @classmethod
    def of(cls, samplings: Sequence[Sampling], logprobs: bool = False) -> Features:
        drawn = [s for s in samplings if s.do_sample]
        return cls(sample=bool(drawn), top_k=any(s.top_k for s in drawn), top_p=any(s.top_p < 1.0 for s in drawn),
                   min_p=any(s.min_p is not None for s in drawn),
                   repetition=any(s.repetition_penalty != 1.0 for s in samplings), logprobs=logprobs)


MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**63, so int64 arithmetic never overflows


def mix32(x: Any) -> Any:
    """A 32-bit integer hash (three rounds of xor-shift-multiply) of a tensor of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & MASK32
    return (x >> 16) ^ x


def _mix_int(x: int) -> int:
    x = ((x >> 16) ^ x) * _MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & MASK32
    return (x >> 16) ^ x


def row_key(seed: int, row: int) -> int:
    """The noise key of row `row` of a request seeded with `seed` (any int; 62-bit seeds use all their bits)."""
    seed &= (1 << 64) - 1
    key = _mix_int((seed >> 32) ^ 0x9E3779B9)
    key = _mix_int(key ^ (seed & MASK32))
    return _mix_int(key ^ (row & MASK32))


def uniform_noise(keys: Any, step: Any) -> Any:
    """One uniform number in (0, 1) per row, float64, shape (rows, 1): row r's at token `step` (an int64 tensor, shape
    ()) for its key ``keys[r]`` (int64, shape (rows,), from `row_key`)."""
    import torch

    at = mix32((keys ^ mix32((step * 0x27D4EB2F + 0x165667B1) & MASK32)) & MASK32)
    high = mix32((at * 0x2C1B3C6D + 0x297A2D39) & MASK32) >> 6  # 26 more bits, for 2**-52 resolution with `at`
    return ((at.to(torch.float64) * (1 << 26) + high.to(torch.float64) + 0.5) * (1.0 / (1 << 58)))[:, None]


@dataclass
class RowSettings:
    """Each row's sampling settings as tensors (rows of one request repeat its settings)."""

    do_sample: Any  # bool (rows,)
    temperature: Any  # float32 (rows, 1); 1 where greedy
    top_k: Any  # int64 (rows, 1); the vocabulary size where unset
    top_p: Any  # float32 (rows, 1); 1 where unset
    min_p: Any  # float32 (rows, 1); 0 where unset
    penalty: Any  # float32 (rows, 1); 1 where unset

    @classmethod
    def of(cls, samplings: Sequence[Sampling], rows: int, vocab: int, device: Any) -> RowSettings:
        """One entry per row: `samplings[i]` is row i's; rows past ``len(samplings)`` (padding) are greedy."""
        import torch

        greedy = Sampling(max_new_tokens=0, eos_token_ids=(), pad_token_id=0, do_sample=False)
        each = list(samplings) + [greedy] * (rows - len(samplings))

        def column(values: list[float], dtype: Any) -> Any:
            return torch.tensor(values, dtype=dtype, device=device)[:, None]

        return cls(
            do_sample=torch.tensor([s.do_sample for s in each], dtype=torch.bool, device=device),
            temperature=column([s.temperature if s.do_sample else 1.0 for s in each],
                               torch.float32),
            top_k=column([min(s.top_k, vocab) if s.do_sample and s.top_k else vocab for s in each], torch.int64),
            top_p=column([s.top_p if s.do_sample else 1.0 for s in each], torch.float32),
            min_p=column([s.min_p if s.do_sample and s.min_p is not None else 0.0 for s in each], torch.float32),
            penalty=column([s.repetition_penalty for s in each], torch.float32),
        )

    def copy_(self, other: RowSettings) -> None:
        """Write `other`'s values into these tensors (the decode step's buffers keep their addresses)."""
        for name in ("do_sample", "temperature", "top_k", "top_p", "min_p", "penalty"):
            getattr(self, name).copy_(getattr(other, name))


def sample(logits: Any, settings: RowSettings, features: Features, seen: Any | None = None,
           noise: Any | None = None) -> tuple[Any, Any | None]:
    """Each row's next token (int64, shape (rows,)) from its logits (float32, (rows, vocab)), and, with
    ``features.logprobs``, the token's log-probability under the distribution it was drawn from (greedy rows: the
    penalised softmax). `seen`: bool (rows, vocab), the tokens each row has seen (for the repetition penalty);
    `noise`: `uniform_noise` for this token (for sampling rows)."""
    import torch

    scores = logits
    if features.repetition:
        penalised = torch.where(scores < 0, scores * settings.penalty, scores / settings.penalty)
        scores = torch.where(seen, penalised, scores)
    greedy = scores.argmax(dim=-1)
    if not features.sample:
        return greedy, (_logprob(scores, greedy) if features.logprobs else None)
    drawn = scores / settings.temperature
    # masked_fill with a Python number: no tensor made on the host inside the step (a CUDA graph cannot copy one in)
    if features.top_k:  # transformers' TopKLogitsWarper: below the k-th largest value goes
        ordered = drawn.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, settings.top_k - 1)
        drawn = drawn.masked_fill(drawn < kth, float("-inf"))
    if features.top_p:  # transformers' TopPLogitsWarper: the smallest tokens whose mass is <= 1 - top_p go
        ascending, order = drawn.sort(dim=-1, descending=False)
        mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= (1 - settings.top_p)
        drop[:, -1] = False
        drawn = drawn.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if features.min_p:  # transformers' MinPLogitsWarper: below min_p times the top probability goes
        probs = drawn.softmax(dim=-1)
        drawn = drawn.masked_fill(probs < settings.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    cumulative = drawn.softmax(dim=-1).to(torch.float64).cumsum(dim=-1)
    picked = torch.searchsorted(cumulative, noise * cumulative[:, -1:], right=True)[:, 0]
    picked = picked.clamp(max=drawn.shape[-1] - 1)  # the last sum's rounding
    tokens = torch.where(settings.do_sample, picked, greedy)
    if not features.logprobs:
        return tokens, None
    return tokens, torch.where(settings.do_sample, _logprob(drawn, tokens), _logprob(scores, tokens))


def _logprob(scores: Any, tokens: Any) -> Any:
    return scores.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]


__all__ = ["Features", "RowSettings", "Sampling", "Ungangable", "generation_settings", "mix32",
           "request_sampling", "row_key", "sample", "uniform_noise"]
