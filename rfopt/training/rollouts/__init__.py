"""Rollouts: what a trial's generation goes through (`backend`: the `RolloutBackend` seam, the exact backend, and
`refusal`, which decides who may share a batch), the batched backend (`batched`), its LoRA bank (`bank`) and its
sampler (`sampler`).

| module | owns |
|---|---|
| `backend.py` | the protocol, `GenerationRequest`/`Completions`, `Decoded` (how far a call has got), `refusal`/`model_refusal`, `ExactBackend` |
| `batched.py` | `BatchedBackend`: prefill, static-cache buffers, the graph-safe step, the host loop |
| `bank.py` | the LoRA bank (every adapter of a batch in fixed buffers) and the model's view that reads it |
| `sampler.py` | `Sampling` (one request's settings, from `generation_settings`: merged as ``generate`` merges them), the vectorized sampler and its counter-based noise |
"""

from .backend import (
    BATCHED,
    EXACT,
    KINDS,
    DecodeAborted,
    Decoded,
    Completions,
    ExactBackend,
    GenerationRequest,
    Outcome,
    Progress,
    RolloutBackend,
    model_refusal,
    refusal,
    seed_from_stream,
    until_eos,
)
from .batched import BatchedBackend, DecodeStats
from .sampler import Sampling, Ungangable, generation_settings, request_sampling

__all__ = ["BATCHED", "EXACT", "KINDS", "DecodeAborted", "BatchedBackend", "Completions", "DecodeStats", "Decoded",
           "ExactBackend", "GenerationRequest", "Outcome", "Progress", "RolloutBackend", "Sampling", "Ungangable",
           "generation_settings", "model_refusal", "refusal", "request_sampling", "seed_from_stream", "until_eos"]

