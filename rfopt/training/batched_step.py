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

Rows that share a prompt (GRPO's completions of one prompt, left-padded alike) have it computed once on the CPU
(`shared_prompts`, `shares_prompts`): the forward runs the shared columns once per distinct prefix with a cache, then
every row's rest attending to a copy of its prefix's keys and values, whose gradients flow back to the one prefix,
summed. On SmolLM2 (4 members x 4 completions of an 85-token prompt, 64 new tokens) that is 0.59 of the members'
own forwards and backwards against 0.98 without it (BENCHMARKS.md); the numbers differ from a member alone by rounding
only, like the rest of the batched step. Not on a GPU yet: a step of this size is bound by kernel launches there, and
a second forward adds to them (unmeasured).

The backbone call served is the one TRL's fused LM head makes: token ids and a mask, and the arguments PEFT's
``PeftModelForCausalLM`` passes on at their neutral values (`unservable`, `NEUTRAL_ARGUMENTS`; a ``task_type=
"CAUSAL_LM"`` adapter's model). Any other call runs the member's own forward, said once with what it carried.

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


NEUTRAL_ARGUMENTS = {"inputs_embeds": (None,), "output_attentions": (None, False),
                     "output_hidden_states": (None, False), "return_dict": (None, True)}
"""Backbone arguments a call may carry at these values (what PEFT's ``PeftModelForCausalLM.forward``, a
``task_type="CAUSAL_LM"`` adapter's model, passes on) and still be the plain call the batched forward serves."""


def unservable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What keeps a backbone call from the batched forward, as a person reads it; None for a call it serves: token ids
    and a mask, no cache, and nothing else but `NEUTRAL_ARGUMENTS` at their neutral values (a multimodal or MoE model's
    extra inputs, embeddings given instead of ids, or attentions asked for go through the member's own forward)."""
    if args:
        return f"{len(args)} positional arguments"
    if kwargs.get("input_ids") is None:
        return "no input_ids"
    if kwargs.get("use_cache"):
        return "use_cache=True"
    extra = sorted(key for key, value in kwargs.items() if key not in ("input_ids", "attention_mask", "use_cache")
                   and not any(value is neutral for neutral in NEUTRAL_ARGUMENTS.get(key, ())))
    return "the arguments " + ", ".join(extra) if extra else None


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
        self.shared_tokens = 0
        """Tokens the forwards did not compute again because their rows share a prompt (`shared_prompts`)."""
        for module in self.view.modules():
            if getattr(module, "gradient_checkpointing", False):
                module.gradient_checkpointing = False  # the view's copy only: the shared model keeps its setting

    def forward(self, requests: Sequence[ForwardRequest]) -> list[Any]:
        """Each request's ``last_hidden_state`` (its own rows and length), from one forward of every request's rows
        (two where rows share a prompt: `shared_prompts`). The requests must share one grad mode (the caller's)."""
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
        input_ids, attention_mask, position_ids = torch.cat(ids), torch.cat(masks), torch.cat(positions)
        shared = (shared_prompts(input_ids, attention_mask, [(s, e) for s, e, _ in groups])
                  if shares_prompts(first.device) else None)
        try:
            if shared is None:
                self.rows.groups = groups
                hidden = view(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
            else:
                hidden = self._forward_shared(input_ids, attention_mask, position_ids, groups, shared)
        finally:
            self.rows.groups = ()
        return [hidden[s:e, extra:] for (s, e, _), extra in zip(groups, offsets)]

    def _forward_shared(self, input_ids: Any, attention_mask: Any, position_ids: Any,
                        groups: list[tuple[int, int, str | None]], shared: SharedPrompts) -> Any:
        """The forward of every row, the first `shared.width` columns once per distinct prefix: those rows through
        the view with a cache, then every row's rest on a copy of its prefix's keys and values (the gradient of each
        copy flows back to the one prefix, summed), and each row's hidden states, the prefix's then its rest's."""
        import torch
        from transformers import DynamicCache

        view, cut, heads = self.view, shared.width, shared.heads
        self.rows.groups = shared.head_groups(groups)
        head = view(input_ids=input_ids[heads, :cut], attention_mask=attention_mask[heads, :cut],
                    position_ids=position_ids[heads, :cut], past_key_values=DynamicCache(), use_cache=True)
        cache = DynamicCache()
        for index, layer in enumerate(head.past_key_values.layers):
            cache.update(layer.keys.index_select(0, shared.source), layer.values.index_select(0, shared.source), index)
        self.rows.groups = groups
        rest = view(input_ids=input_ids[:, cut:], attention_mask=attention_mask, position_ids=position_ids[:, cut:],
                    past_key_values=cache, use_cache=True)
        self.shared_tokens += cut * (input_ids.shape[0] - len(heads))
        return torch.cat([head.last_hidden_state.index_select(0, shared.source), rest.last_hidden_state], dim=1)


SHARE_PROMPTS_ON: tuple[str, ...] | None = ("cpu",)
"""The device types on which the batched forward computes a prompt its rows share once (`shared_prompts`)."""


def shares_prompts(device: Any) -> bool:
    """Whether the batched forward on `device` computes a prompt its rows share once (`shared_prompts`): on the CPU,
    where a step's time is its arithmetic (SmolLM2: a member's prompt is 85 of its rows' 149 tokens; BENCHMARKS.md).
    Not yet on a GPU: there a step of this size is bound by its kernel launches, which a second forward adds to, and
    it is not measured."""
    import torch

    return SHARE_PROMPTS_ON is not None and torch.device(device).type in SHARE_PROMPTS_ON


MIN_SHARED = 0.25
"""Share a prefix only where it saves at least this fraction of the forward's tokens (a second forward costs its own
launches and a copy of the prefix's keys and values)."""


@dataclass
class SharedPrompts:
    """How a batched forward's rows share their first `width` columns: `heads`, one row of each distinct prefix
    (grouped by request, in the requests' order), and for each row the index among `heads` of its prefix (`source`)."""

    width: int
    heads: Any  # a LongTensor
    source: Any  # a LongTensor
    counts: list[int]
    """Distinct prefixes per request."""

    def head_groups(self, groups: Sequence[tuple[int, int, str | None]]) -> list[tuple[int, int, str | None]]:
        """The requests' row groups among `heads`."""
        out, start = [], 0
        for (_, _, adapter), count in zip(groups, self.counts):
            out.append((start, start + count, adapter))
            start += count
        return out


def shared_prompts(input_ids: Any, attention_mask: Any, spans: Sequence[tuple[int, int]],
                   min_saved: float = MIN_SHARED) -> SharedPrompts | None:
    """The prefix width that saves the most tokens when each request's rows (`spans` of the batch) that agree on it
    (token ids and mask) have it computed once: a GRPO batch's completions of one prompt share that prompt (left-padded
    alike). None where that saves less than `min_saved` of the batch's tokens, or nothing (rows of different requests
    never share: their adapters differ)."""
    import numpy as np
    import torch

    rows, width = input_ids.shape
    if width < 2:
        return None
    # A row as one array: its ids where attended, -1 - id where masked (the mask is part of what must agree).
    keyed = np.where(attention_mask.cpu().numpy() != 0, input_ids.cpu().numpy(), -1 - input_ids.cpu().numpy())
    orders, gaps = [], []
    for start, end in spans:
        block = keyed[start:end]
        order = np.lexsort(block.T[::-1])  # rows sorted as sequences: rows that share a prefix are adjacent
        ordered = block[order]
        differ = ordered[1:] != ordered[:-1]
        # Each adjacent pair's common prefix (the whole width where they are equal).
        lcp = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
        orders.append(order)
        gaps.append(lcp)
    best, best_saved = 0, 0
    for cut in sorted({int(c) for lcp in gaps for c in lcp if c > 0}):
        cut = min(cut, width - 1)
        saved = cut * sum(int((lcp >= cut).sum()) for lcp in gaps)
        if saved > best_saved:
            best, best_saved = cut, saved
    if best_saved < min_saved * rows * width:
        return None
    heads, source, counts = [], [0] * rows, []
    for (start, _), order, lcp in zip(spans, orders, gaps):
        count = 0
        for k, row in enumerate(order):
            if k == 0 or lcp[k - 1] < best:  # a new prefix: this row is its head
                heads.append(start + int(row))
                count += 1
            source[start + int(row)] = len(heads) - 1
        counts.append(count)
    device = input_ids.device
    return SharedPrompts(width=best, heads=torch.tensor(heads, device=device),
                         source=torch.tensor(source, device=device), counts=counts)


def adapter_parameters(model: Any, adapter: str) -> list[Any]:
    """`adapter`'s parameters on a PeftModel, in the model's order (what its clipping and optimizer must see)."""
    return [p for name, p in model.named_parameters() if adapter in name.split(".")]
