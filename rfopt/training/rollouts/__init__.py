"""Rollouts: what a trial's generation goes through, in training and in evaluation: the `RolloutBackend` seam
(`backend`: what a backend must implement, who calls each member and when, `make_backend`, the one place a backend is
built from its kind, and the exact backend), the batched backend (`batched`, with its gate `BatchedBackend.refusal`,
which decides who may share a batch), its LoRA bank (`bank`) and its sampler (`sampler`).

Which kind a unit uses is its plan's (`rfopt.engine.planning.plan.UnitPlan.backend`); the model pool builds it
(`rfopt.training.models.ModelPool.backend`, through `make_backend`), and the unit trains and evaluates its members
through it.

| module | owns |
|---|---|
| `backend.py` | the protocol, `GenerationRequest`/`Completions`, `Decoded` (how far a call has got), `make_backend`, `ExactBackend`, `model_refusal` (the batched backend's check of the model it serves) |
| `batched.py` | `BatchedBackend`: its gate (`refusal`: `config_refusal`, then `model_refusal`), prefill, static-cache buffers, the graph-safe step, the host loop |
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
    make_backend,
    model_refusal,
    seed_from_stream,
    until_eos,
)
from .batched import BatchedBackend, DecodeStats
from .sampler import Sampling, Ungangable, generation_settings, request_sampling

__all__ = ["BATCHED", "EXACT", "KINDS", "DecodeAborted", "BatchedBackend", "Completions", "DecodeStats", "Decoded",
           "ExactBackend", "GenerationRequest", "Outcome", "Progress", "RolloutBackend", "Sampling", "Ungangable",
           "generation_settings", "make_backend", "model_refusal", "request_sampling", "seed_from_stream", "until_eos"]

