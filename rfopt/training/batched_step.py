"""One batched forward of a gang's training: every member's rows through the shared base model at once, each row through
its own trial's LoRA adapter (`rfopt.training.gang`, ``gang_training="batched"``).

A gang member's trainer computes log-probabilities through TRL's fused LM head, which runs the model's backbone (the
base model's decoder stack) and then its own head with its own temperature. The gang intercepts the backbone call
(`compat.intercept_backbone`): the members' calls of one kind (with grad: the loss; without: the old-policy and the
reference forwards) wait for one another, and `BatchedBackbone.forward` runs them as one. Each member's rows are
padded on the left to the longest member's length, with explicit position ids that give every real token the position
it has when the member runs alone (HF decoders count a row's left pads as positions when given none, as TRL runs them);
the extra pads are masked out. Every LoRA layer of the batched view (`GangLinear`) computes the base layer once for all
rows and adds, to each member's row slice, that member's own delta through PEFT's own modules (its ``lora_A``,
``lora_B``, dropout and scaling: its own parameters, so the gradient reaches them); a reference row (adapters disabled)
gets none. Each member then gets its slice of the hidden states back, and its own head, loss and backward follow.

The view is a shallow copy of the backbone (`compat.module_view`) with gradient checkpointing off: the batched step
keeps its activations (the gang mode's measured choice: faster, more memory; the sequential mode keeps the trainer's
setting). The results differ from a member alone only by floating-point rounding (matrix shapes change with the
batch); tests/training/test_batched_step.py checks each member's gradient against the one it gets alone.

Served: PEFT LoRA on ``Linear`` layers, plain or bitsandbytes-quantized (QLoRA; any rank, alpha, dropout,
``lora_bias``). Not served (`member_refusal`): LoRA
variants (DoRA, ...), embedding or convolution adapters, ``modules_to_save`` and trainable tokens: such a member trains
its own steps inside the gang, as in the sequential mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rfopt import compat

from .rollouts.bank import adapter_refusal, served_layer_types


@dataclass
class ForwardRequest:
    """One member's backbone call: its rows, through `adapter` (None: adapters disabled, the reference forward)."""

    adapter: str | None
    input_ids: Any
    attention_mask: Any
    grad: bool


def member_refusal(model: Any, adapter: str, peft_config: Any) -> str | None:
    """Why a member with `adapter` (and `peft_config`) on the shared `model` cannot join the batched step, or None."""
    if peft_config is None:
        return "it fine-tunes the whole model"
    for field in ("modules_to_save", "trainable_token_indices"):
        if getattr(peft_config, field, None):
            return f"its adapter has {field}"
    return adapter_refusal(model, adapter)


def servable_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a backbone call is one the batched forward serves: token ids and a mask, no cache, nothing else (a
    multimodal or MoE model's extra inputs go through the member's own forward)."""
    return (not args and kwargs.get("input_ids") is not None and not kwargs.get("use_cache")
            and set(kwargs) <= {"input_ids", "attention_mask", "use_cache"})


class _Rows:
    """The row groups of the batched forward now running: ``(start, end, adapter or None)``, one per request."""

    groups: Sequence[tuple[int, int, str | None]] = ()


def _gang_linear_class() -> type:
    import torch
    import torch.nn as nn

    class GangLinear(nn.Module):
        """A PEFT ``lora.Linear`` in the batched view: the base layer once for every row, then each row group's own
        adapter delta, as PEFT computes it for one active adapter."""

        def __init__(self, layer: Any, rows: _Rows) -> None:
            super().__init__()
            object.__setattr__(self, "layer", layer)  # not a child: the view must not own (or walk) the shared layer
            self.rows = rows

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            layer = self.layer
            result = layer.base_layer(x, *args, **kwargs)
            dtype = result.dtype
            pieces = []
            for start, end, adapter in self.rows.groups:
                piece = result[start:end]
                if adapter is not None and adapter in layer.lora_A:
                    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
                    rows = x[start:end].to(lora_a.weight.dtype)  # as PEFT casts the input to the adapter's dtype
                    piece = (piece + lora_b(lora_a(layer.lora_dropout[adapter](rows))) * layer.scaling[adapter]).to(dtype)
                pieces.append(piece)
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    return GangLinear


class BatchedBackbone:
    """The batched view of a shared model's backbone, and its forward over several members' requests.

    >>> batched = BatchedBackbone(backbone)                     # doctest: +SKIP
    >>> hidden = batched.forward([request_a, request_b])        # each request's last hidden states, as alone
    """

    def __init__(self, backbone: Any) -> None:
        self.backbone = backbone
        self.rows = _Rows()
        gang_linear = _gang_linear_class()

        served = served_layer_types()  # a 4-bit or 8-bit base layer computes once for every row, as a plain one

        def replace(module: Any, view_of: Any) -> Any:
            return gang_linear(module, self.rows) if isinstance(module, served) else None

        self.view = compat.module_view(backbone, replace)
        for module in self.view.modules():
            if getattr(module, "gradient_checkpointing", False):
                module.gradient_checkpointing = False  # the view's copy only: the shared model keeps its setting

    def forward(self, requests: Sequence[ForwardRequest]) -> list[Any]:
        """Each request's ``last_hidden_state`` (its own rows and length), from one forward of every request's rows.
        The requests must share one grad mode (the caller's)."""
        import torch

        view = self.view
        if view.training != self.backbone.training:
            view.train(self.backbone.training)
        first = requests[0].input_ids
        width = max(r.input_ids.shape[1] for r in requests)
        ids, masks, positions, groups, offsets = [], [], [], [], []
        start = 0
        for request in requests:
            rows, length = request.input_ids.shape
            extra = width - length
            mask = request.attention_mask
            if mask is None:
                mask = torch.ones_like(request.input_ids)
            ids.append(torch.nn.functional.pad(request.input_ids, (extra, 0), value=0))
            masks.append(torch.nn.functional.pad(mask, (extra, 0), value=0))
            # Alone, the member's tokens sit at positions 0..length-1 (left pads counted): so they do here.
            place = (torch.arange(width, device=first.device) - extra).clamp(min=0)
            positions.append(place.unsqueeze(0).expand(rows, width))
            groups.append((start, start + rows, request.adapter))
            offsets.append(extra)
            start += rows
        self.rows.groups = groups
        try:
            out = view(input_ids=torch.cat(ids), attention_mask=torch.cat(masks), position_ids=torch.cat(positions),
                       use_cache=False)
        finally:
            self.rows.groups = ()
        hidden = out.last_hidden_state
        return [hidden[s:e, extra:] for (s, e, _), extra in zip(groups, offsets)]


def adapter_parameters(model: Any, adapter: str) -> list[Any]:
    """`adapter`'s parameters on a PeftModel, in the model's order (what its clipping and optimizer must see)."""
    return [p for name, p in model.named_parameters() if adapter in name.split(".")]
