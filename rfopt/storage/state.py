"""What a trial carries from one chunk unit to the next: the records a checkpoint holds, and their stored form.

`TrialSnapshot` is everything a trial needs to continue exactly (weights, optimizer, scheduler, RNG,
counters); `UnitReport` is what one unit commits to storage (its value, metrics and samples). The
runner produces both, the checkpoint store writes and reads them, the engine commits the report.
They live here, below all three, so that none of them imports another for its types.

`on_cpu` brings its tensors to the CPU (before a thread writes them); `to_tensors` lays a `TrialSnapshot` out as a
checkpoint stores it (its tensors for ``tensors.safetensors``, the rest for ``state.json``); `from_tensors` reads it
back, bit for bit (a bitsandbytes 8-bit optimizer's quantized state, nested in its state dict, included).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RngState:
    """The Python, NumPy, torch and CUDA random states at a chunk boundary."""

    python: Any
    numpy: Any
    torch: Any
    cuda: list[Any] = field(default_factory=list)

    @classmethod
    def capture(cls) -> RngState:
        import numpy as np
        import torch

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(), cuda=cuda)

    def restore(self) -> None:
        import numpy as np
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class TrialSnapshot:
    """Everything a trial needs to continue exactly (what a checkpoint holds). Not Optuna's `TrialState` (a trial's
    RUNNING/COMPLETE/... state), whose name it had."""

    units_done: int
    global_step: int
    tokens_seen: int
    weights: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: RngState | None


def on_cpu(state: TrialSnapshot) -> TrialSnapshot:
    """`state` with its weights' and optimizer's tensors on the CPU: copies of those elsewhere, those on the CPU as
    they are, and a tensor held by several entries (bitsandbytes' quantization maps) still one. What a thread may write
    while the device goes on working: a copy off a GPU made from another thread waits on the device's queue, and while
    the main thread captures a CUDA graph (the batched decoder does, in an evaluation) it is an error."""
    import torch

    copies: dict[int, Any] = {}

    def cpu(value: Any) -> Any:
        if torch.is_tensor(value):
            if id(value) not in copies:
                copies[id(value)] = value.detach().cpu()
            return copies[id(value)]
        if isinstance(value, dict):
            return {key: cpu(inner) for key, inner in value.items()}
        return value

    optimizer = None if state.optimizer is None else {**state.optimizer, "state": cpu(state.optimizer["state"])}
    return dataclasses.replace(state, weights=cpu(state.weights), optimizer=optimizer)


@dataclass
class UnitReport:
    """What a unit commits to storage: its value (``trial.report(value, step=unit)``), metrics and samples.

    It rides in the unit's checkpoint, so that a unit whose checkpoint is durable but whose report never reached
    storage (a crash, a worker that lost its lease) is committed later with exactly these values.
    """

    unit: int
    value: float
    metrics: dict[str, Any]
    samples: list[Any]
    steps: list[dict[str, float]] = field(default_factory=list)
    """TRL's logs of each optimizer step of the unit (`ChunkMetrics.steps`); empty for a unit evaluated again after a
    crash without its training logs, and in reports written before rfopt kept them."""


def to_tensors(state: TrialSnapshot) -> tuple[dict[str, Any], dict[str, Any]]:
    """`state` as a checkpoint stores it: its tensors (weights, optimizer tensors, torch and CUDA RNG states) for
    ``tensors.safetensors``, and the rest as JSON-ready metadata for ``state.json``."""
    import torch

    tensors: dict[str, Any] = {f"weights.{k}": v.detach().contiguous().cpu() for k, v in state.weights.items()}
    meta: dict[str, Any] = {
        "units_done": state.units_done,
        "global_step": state.global_step,
        "tokens_seen": state.tokens_seen,
        "scheduler": state.scheduler,
        "optimizer": None,
        "rng": None,
    }
    if state.optimizer is not None:
        named: dict[int, str] = {}

        def laid_out(value: Any, name: str) -> Any:
            # A tensor by name (one tensor held by several entries once: bitsandbytes' quantization maps, qmap1 and
            # qmap2, are one tensor for every parameter); a dict of them (bitsandbytes nests its quantized state:
            # state1, absmax1, ...) entry by entry; anything else as it is.
            if torch.is_tensor(value):
                if id(value) not in named:
                    named[id(value)] = name
                    tensors[name] = value.detach().contiguous().cpu()
                return {"tensor": named[id(value)]}
            if isinstance(value, dict):
                return {"nested": {key: laid_out(inner, f"{name}.{key}") for key, inner in value.items()}}
            return value

        plain_state = {str(index): {key: laid_out(value, f"optimizer.{index}.{key}") for key, value in entry.items()}
                       for index, entry in state.optimizer["state"].items()}
        meta["optimizer"] = {"state": plain_state, "param_groups": state.optimizer["param_groups"]}
    if state.rng is not None:
        tensors["rng.torch"] = state.rng.torch
        for i, cuda_state in enumerate(state.rng.cuda):
            tensors[f"rng.cuda.{i}"] = cuda_state
        version, internal, gauss = state.rng.python
        kind, keys, pos, has_gauss, cached = state.rng.numpy
        meta["rng"] = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "cuda_devices": len(state.rng.cuda),
        }
    return tensors, meta


def from_tensors(tensors: dict[str, Any], meta: dict[str, Any]) -> TrialSnapshot:
    """The `TrialSnapshot` that `to_tensors` laid out as `tensors` and `meta` (read back from a checkpoint)."""
    import numpy as np

    weights = {k[len("weights.") :]: v for k, v in tensors.items() if k.startswith("weights.")}
    optimizer = None
    if meta["optimizer"] is not None:
        def read(value: Any) -> Any:
            if isinstance(value, dict) and "tensor" in value:
                return tensors[value["tensor"]]
            if isinstance(value, dict) and "nested" in value:
                return {key: read(inner) for key, inner in value["nested"].items()}
            return value

        opt_state = {int(index): {key: read(value) for key, value in entry.items()}
                     for index, entry in meta["optimizer"]["state"].items()}
        optimizer = {"state": opt_state, "param_groups": meta["optimizer"]["param_groups"]}
    rng = None
    if meta["rng"] is not None:
        version, internal, gauss = meta["rng"]["python"]
        kind, keys, pos, has_gauss, cached = meta["rng"]["numpy"]
        rng = RngState(
            python=(version, tuple(internal), gauss),
            numpy=(kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
            torch=tensors["rng.torch"],
            cuda=[tensors[f"rng.cuda.{i}"] for i in range(meta["rng"]["cuda_devices"])],
        )
    return TrialSnapshot(
        units_done=meta["units_done"],
        global_step=meta["global_step"],
        tokens_seen=meta["tokens_seen"],
        weights=weights,
        optimizer=optimizer,
        scheduler=meta["scheduler"],
        rng=rng,
    )
