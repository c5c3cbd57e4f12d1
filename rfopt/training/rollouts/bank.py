"""The LoRA bank: every adapter of a batch in fixed buffers, and a view of the model that reads them.

A batched decode serves G adapters of one shared base model at once, each to its own group of rows. PEFT computes one
active adapter per forward (or loops over adapter names in Python), so the batched backend decodes through a
**view** of the model instead (`decode_view`): the same modules and the same weight tensors, with each LoRA layer
replaced by a `BankedLinear` that adds every group's own delta in two batched matrix products:

    out = base(x) + bmm(bmm(x viewed as (G, rows, in), A[:G]), B[:G])       # B scaled by the adapter's scaling

The bank (`LoraBank`) holds, per LoRA layer, ``A`` (capacity, in, rank) and ``B`` (capacity, rank, out) buffers in the
base model's dtype; `LoraBank.load` copies the batch's adapters into positions 0..G-1 in place (``copy_``, zero where
an adapter is narrower or does not adapt the layer), so the buffers keep their addresses and a captured decode step
stays valid after every optimizer step. No Python hooks run in the step, and nothing in it depends on the data.

The view is a shallow copy of the model's module tree (`decode_view`): it shares every parameter, holds no hook and
none of the instance ``forward`` wrappers a trainer puts on the shared model, and stays in eval mode. The shared
model itself is never changed. Where the trainer keeps float32 master weights and computes in bf16 (mixed precision,
as ``GRPOConfig(bf16=True)`` trains), the view holds a bf16 copy of the base weights instead (the base model is frozen
under LoRA, so the copy stays valid): decoding reads half the bytes and runs on tensor cores, as a vLLM engine
beside a trainer does.

A quantized base (QLoRA: bitsandbytes' 4-bit or 8-bit Linear under PEFT's ``lora.bnb`` layers) is served the same
way: the view's base layer is the quantized module itself (dequantized on the fly, as bitsandbytes computes it in
training), the deltas are the bank's, in the model's float dtype.

Served: PEFT's ``lora.Linear`` and its bitsandbytes 4-bit and 8-bit layers (any rank, ``lora_bias``, `fan_in_fan_out`
bases, scaling per layer). Not served
(`adapter_refusal`): LoRA variants (DoRA, ...), embedding and convolution adapters, merged adapters.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

def lora_layers(model: Any) -> list[tuple[str, Any]]:
    """The LoRA layers of a PeftModel (PEFT's ``LoraLayer`` modules that hold adapters), with their names."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, LoraLayer) and (len(getattr(m, "lora_A", {})) or len(getattr(m, "lora_embedding_A", {})))]


def served_layer_types() -> tuple[type, ...]:
    """The LoRA layer classes the bank serves: PEFT's ``lora.Linear``, and its LoRA layers on bitsandbytes' 4-bit and
    8-bit Linear (``lora.bnb.Linear4bit``, ``Linear8bitLt``: QLoRA) where bitsandbytes is installed."""
    from peft.tuners.lora import Linear

    served: list[type] = [Linear]
    if importlib.util.find_spec("bitsandbytes") is not None:
        from peft.tuners.lora import bnb

        served += [getattr(bnb, name) for name in ("Linear4bit", "Linear8bitLt") if hasattr(bnb, name)]
    return tuple(served)


def adapter_refusal(model: Any, adapter: str) -> str | None:
    """Why the bank cannot serve `adapter` of `model` (a LoRA variant, an embedding or convolution adapter, an adapter
    merged into the base weights), or None."""
    served = served_layer_types()
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is None:
        return f"no adapter {adapter!r} on the shared model"
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"adapter {adapter!r} is not LoRA"
    for name, layer in lora_layers(model):
        if getattr(layer, "merged", False):
            return f"an adapter is merged into {name}'s base weights"
        holds = adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {})
        if not holds:
            continue
        if not isinstance(layer, served):
            return (f"adapter {adapter!r} adapts {name}, a {type(layer).__name__} layer (only Linear layers, plain or "
                    "bitsandbytes-quantized, are served)")
        if adapter in getattr(layer, "lora_variant", {}):
            return f"adapter {adapter!r} is a LoRA variant (DoRA, ...) on {name}"
    return None


@dataclass
class BankEntry:
    """One LoRA layer's slice of the bank."""

    layer: Any
    a: Any  # (capacity, in, rank)
    b: Any  # (capacity, rank, out), scaled
    bias: Any | None  # (capacity, 1, out), scaled; None when no adapter has a LoRA bias there


class LoraBank:
    """Per LoRA layer of one PeftModel: the batch's adapters stacked in fixed buffers (see the module docstring)."""

    def __init__(self, model: Any, capacity: int, rank: int, dtype: Any = None) -> None:
        import torch

        self.model = model
        self.capacity = capacity
        self.rank = rank
        self.dtype = dtype
        """What the view computes in (None: the base model's own dtype)."""
        self.groups = 0
        """Adapters of the batch being decoded (positions 0..groups-1); read by the banked layers."""

        self.entries: dict[int, BankEntry] = {}
        for _, layer in banked_layers(model):
            weight = layer.base_layer.weight  # the bank computes in the view's dtype, as a vLLM engine does
            # A quantized base layer's weight is packed integers: its output comes in the model's own float dtype.
            own = weight.dtype if weight.is_floating_point() else model.get_base_model().dtype
            dtype, device = self.dtype or own, weight.device
            in_features, out_features = layer.in_features, layer.out_features
            with_bias = any(getattr(layer, "lora_bias", {}).get(a, False) for a in layer.lora_A)
            self.entries[id(layer)] = BankEntry(
                layer=layer,
                a=torch.zeros((capacity, in_features, rank), dtype=dtype, device=device),
                b=torch.zeros((capacity, rank, out_features), dtype=dtype, device=device),
                bias=torch.zeros((capacity, 1, out_features), dtype=dtype, device=device) if with_bias else None,
            )
        self.signature = signature(model)

    @classmethod
    def fitting(cls, model: Any, adapters: int, old: LoraBank | None, dtype: Any = None) -> LoraBank:
        """`old` if it still fits `model` (the same LoRA layers, room for `adapters`, every rank within its own);
        else a new bank with room for at least as many."""
        rank = max_rank(model)
        if (old is not None and old.signature == signature(model) and adapters <= old.capacity and rank <= old.rank
                and not _new_bias(old)):
            return old
        # Room for every adapter on the model: a bank that grows drops the steps captured on its buffers.
        capacity = max(adapters, len(getattr(model, "peft_config", {})), old.capacity if old is not None else 1)
        return cls(model, capacity=1 << (capacity - 1).bit_length(), rank=max(rank, old.rank if old else 0),
                   dtype=dtype)

    def load(self, adapters: Sequence[str]) -> None:
        """Copy `adapters` (their current weights) into positions 0..len-1; the banked layers then serve them."""
        import torch

        with torch.no_grad():
            for entry in self.entries.values():
                layer = entry.layer
                for g, name in enumerate(adapters):
                    a, b = entry.a[g], entry.b[g]
                    if name not in layer.lora_A:
                        a.zero_()
                        b.zero_()
                        if entry.bias is not None:
                            entry.bias[g].zero_()
                        continue
                    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
                    rank = lora_a.weight.shape[0]
                    scaling = float(layer.scaling[name])
                    a[:, :rank].copy_(lora_a.weight.t())
                    b[:rank].copy_(lora_b.weight.t() * scaling)
                    if rank < self.rank:
                        a[:, rank:].zero_()
                        b[rank:].zero_()
                    if entry.bias is not None:
                        if lora_b.bias is None:
                            entry.bias[g].zero_()
                        else:
                            entry.bias[g, 0].copy_(lora_b.bias * scaling)
        self.groups = len(adapters)


def _new_bias(bank: LoraBank) -> bool:
    """Whether an adapter added since `bank` was made has a LoRA bias where the bank keeps none."""
    return any(entry.bias is None and any(getattr(entry.layer, "lora_bias", {}).get(a, False)
                                          for a in entry.layer.lora_A)
               for entry in bank.entries.values())


def banked_layers(model: Any) -> list[tuple[str, Any]]:
    """The LoRA layers the bank serves: PEFT's ``lora.Linear`` and its bitsandbytes layers (`served_layer_types`;
    another adapter's embedding or convolution layer, on the shared model beside the gang's, is decoded as its base
    layer: no adapter the bank serves adapts it)."""
    served = served_layer_types()
    return [(name, layer) for name, layer in lora_layers(model) if isinstance(layer, served)]


def signature(model: Any) -> tuple[int, ...]:
    """Which modules are LoRA layers: a new adapter that adapts other modules changes it (the view is then stale)."""
    return tuple(id(layer) for _, layer in lora_layers(model))


def max_rank(model: Any) -> int:
    return max((m.weight.shape[0] for _, layer in banked_layers(model) for m in layer.lora_A.values()), default=1)


def banked_linear(base: Any, entry: BankEntry, bank: LoraBank) -> Any:
    """A LoRA layer of the view: `base`'s output plus each group's delta from `bank` (`BankedLinear`)."""
    return _banked_linear_class()(base, entry, bank)


_CLASSES: dict[str, type] = {}


def _banked_linear_class() -> type:
    """`BankedLinear`, made at first use (torch is imported lazily, as everywhere in rfopt)."""
    if "BankedLinear" not in _CLASSES:
        import torch
        import torch.nn as nn

        class BankedLinear(nn.Module):
            """``base(x)`` plus, for each group g of rows, ``x_g @ A[g] @ B[g]`` (+ the scaled LoRA bias)."""

            def __init__(self, base: Any, entry: BankEntry, bank: LoraBank) -> None:
                super().__init__()
                self.base = base
                self.entry = entry
                self.bank = bank

            def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                out = self.base(x, *args, **kwargs)
                entry = self.entry
                groups = self.bank.groups
                grouped = x.reshape(groups, -1, x.shape[-1]).to(entry.a.dtype)
                delta = torch.bmm(torch.bmm(grouped, entry.a[:groups]), entry.b[:groups])
                if entry.bias is not None:
                    delta = delta + entry.bias[:groups]
                return out + delta.reshape(out.shape).to(out.dtype)

        _CLASSES["BankedLinear"] = BankedLinear
    return _CLASSES["BankedLinear"]


def decode_view(model: Any, bank: LoraBank) -> Any:
    """The PeftModel's underlying model as a module tree of its own that shares every weight, with each LoRA layer
    served from `bank` (see the module docstring); in eval mode."""
    from rfopt import compat

    from peft.tuners.lora import LoraLayer

    def replace(module: Any, view_of: Any) -> Any:
        entry = bank.entries.get(id(module))
        if entry is None:  # a LoRA layer only adapters outside the batch adapt: its base layer alone
            return view_of(module.base_layer) if isinstance(module, LoraLayer) else None
        return banked_linear(view_of(module.base_layer), entry, bank)

    view = compat.module_view(model.get_base_model(), replace, dtype=bank.dtype)
    view.eval()
    return view


__all__ = ["BankEntry", "banked_layers", "banked_linear", "LoraBank", "adapter_refusal", "decode_view", "lora_layers", "max_rank",
           "served_layer_types", "signature"]
