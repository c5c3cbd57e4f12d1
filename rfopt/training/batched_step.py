"""One batched forward of a gang's training: every member's rows through the shared base model at once, each row through
its own trial's LoRA adapter (`rfopt.training.gang`, ``gang_training="batched"``).

A gang member's trainer computes log-probabilities through TRL's fused LM head, which runs the model's backbone (the
base model's decoder stack) and then its own head with its own temperature. The gang intercepts the backbone call
(`compat.intercept_backbone`): the members' calls of one kind (with grad: the loss; without: the old-policy and the
reference forwards) wait for one another, and `BatchedBackbone.forward` runs them as one. Each member's rows are
padded on the left to the longest member's length, with explicit position ids that give every real token the position
it has when the member runs alone (HF decoders count a row's left pads as positions when given none, as TRL runs them);
the extra pads are masked out. Every LoRA layer of the batched view (`GangLinear`) computes the base layer once for all
rows and adds, to each member's row slice, that member's own delta (its ``lora_A``, ``lora_B`` and scaling: its own
parameters, so the gradient reaches them); a reference row (adapters disabled) gets none. Without dropout or
``lora_bias`` (the common case) one autograd node per layer (`GroupedLoRA`) adds every group's delta in place and writes
its gradients group by group into one input gradient: no copy of the layer's output per group nor their
concatenation, no zero-filled input gradient per group (on SmolLM2 those copies made the batched step slower than the
members' own; BENCHMARKS.md); otherwise each group goes through PEFT's own modules. Each member then gets its slice of
the hidden states back, and its own head, loss and backward follow.

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

    class GroupedLoRA(torch.autograd.Function):
        """Every row group's LoRA delta added in place to the base layer's output, and the gradients written per group
        into one input gradient: what PEFT computes for one active adapter, ``result + lora_B(lora_A(x)) * scaling``,
        without a copy of the output per group and their concatenation, nor a full-size input gradient per group
        (the slices' backward). Only for float32 or half rows of one dtype, dropout off and no ``lora_bias``
        (`GangLinear._fast`); the others take PEFT's modules."""

        @staticmethod
        def forward(ctx: Any, result: Any, x: Any, spans: tuple[tuple[int, int, float], ...],
                    *weights: Any) -> Any:
            flat, rows = result.view(-1, result.shape[-1]), x.reshape(-1, x.shape[-1])
            downs = []
            for (start, end, scaling), lora_a, lora_b in zip(spans, weights[::2], weights[1::2]):
                down = rows[start:end] @ lora_a.t()
                flat[start:end].addmm_(down, lora_b.t(), alpha=scaling)
                downs.append(down)
            ctx.mark_dirty(result)
            ctx.spans, ctx.shape = spans, x.shape
            ctx.save_for_backward(x, *weights, *downs)
            return result

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, *saved = ctx.saved_tensors
            count = len(ctx.spans)
            weights, downs = saved[:2 * count], saved[2 * count:]
            flat, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_x = None
            if ctx.needs_input_grad[1]:
                covered = sum(end - start for start, end, _ in ctx.spans)
                grad_x = (torch.empty if covered == rows.shape[0] else torch.zeros)(rows.shape, dtype=x.dtype,
                                                                                    device=x.device)
            grads: list[Any] = []
            for (start, end, scaling), lora_a, lora_b, down in zip(ctx.spans, weights[::2], weights[1::2], downs):
                piece = flat[start:end]
                grad_down = (piece @ lora_b).mul_(scaling)
                grads.append(grad_down.t() @ rows[start:end] if ctx.needs_input_grad[3 + len(grads)] else None)
                grads.append((piece.t() @ down).mul_(scaling) if ctx.needs_input_grad[3 + len(grads)] else None)
                if grad_x is not None:
                    torch.mm(grad_down, lora_a, out=grad_x[start:end])
            return (grad, None if grad_x is None else grad_x.view(ctx.shape), None, *grads)

    class GangLinear(nn.Module):
        """A PEFT ``lora.Linear`` in the batched view: the base layer once for every row, then each row group's own
        adapter delta, as PEFT computes it for one active adapter."""

        def __init__(self, layer: Any, rows: _Rows) -> None:
            super().__init__()
            object.__setattr__(self, "layer", layer)  # not a child: the view must not own (or walk) the shared layer
            self.rows = rows

        def _fast(self, adapters: list[str], x: Any, result: Any) -> bool:
            """Whether `GroupedLoRA` computes these groups as PEFT would: one dtype, no dropout, no ``lora_bias``,
            the base output its own contiguous tensor (a plain ``Linear``: its backward does not keep its output), and
            no autocast (which would cast the products inside, not the output they are added to)."""
            layer = self.layer
            if (type(layer.base_layer) is not nn.Linear or not result.is_contiguous() or x.dtype != result.dtype
                    or torch.is_autocast_enabled(x.device.type)):
                return False
            return all(isinstance(layer.lora_dropout[a], nn.Identity) and layer.lora_B[a].bias is None
                       and layer.lora_A[a].weight.dtype == x.dtype for a in adapters)

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            layer = self.layer
            result = layer.base_layer(x, *args, **kwargs)
            groups = [(start, end, adapter) for start, end, adapter in self.rows.groups
                      if adapter is not None and adapter in layer.lora_A]
            if not groups:
                return result
            if self._fast([adapter for _, _, adapter in groups], x, result):
                per_row = x.numel() // (x.shape[0] * x.shape[-1])  # the tokens of a row
                spans = tuple((start * per_row, end * per_row, float(layer.scaling[adapter]))
                              for start, end, adapter in groups)
                weights = [w for _, _, adapter in groups
                           for w in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)]
                return GroupedLoRA.apply(result, x, spans, *weights)
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
